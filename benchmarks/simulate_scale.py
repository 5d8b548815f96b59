"""One real training step of a full-size model, sharded across many simulated processes, in one process on a CPU.

    python benchmarks/simulate_scale.py --model llama3-70b --world-size 64 --train-last all --gradient-checkpointing
    python benchmarks/simulate_scale.py --model llama3-8b --world-size 8 --train-last 2 --json
    python benchmarks/simulate_scale.py --model llama3-8b --world-size 8 --train-last 2 --no-shard   # DDP

How: a fake process group (backend "fake": every collective returns at once, moving nothing) stands in for
`--world-size` processes, and fake tensors (`FakeTensorMode`: shapes, dtypes and devices, no storage) stand in for
the weights, so that Llama-3-70B "fits". The package's own code then runs as a sharded run would: the classifier
built and sharded by `sharding.shard_model`, `train.make_optimizer` with `TrainSettings`' defaults (float32 master
weights and moments), a batch of `--batch-size` texts of `--max-length` tokens laid out by `batching.to_batch` as
training lays it out (packed), the forward, the loss, backward and the optimizer step, twice. PyTorch's
`FSDPMemTracker` (`MemTracker` with `--no-shard`) counts every tensor one process allocates and frees. That peak
is printed beside the plan's (`llama_scratch.planning.memory`, what `--plan` prints) for the same run; `--json`
makes the last line one JSON object.

What its peak is (torch/distributed/_tools/mem_tracker.py): after every operation the tracker sees, it sums the
bytes of the storages alive per device and keeps the largest sum since it was entered, with the breakdown by kind
at that moment. `reset_mod_stats` clears only the per-module statistics, not that peak, so it is read here, and
reset by hand, once per step: step 1 creates the optimizer's moments during its `step`, step 2 runs its backward
beside them (the steady state, which the plan describes). The float32 master weights, built with the optimizer before
the tracker is entered, are registered with it by hand ("OptState", with the moments).

What it is and is not: the memory of a step, as PyTorch's allocator would be asked for it by this code, with the
CPU's kernels (the fake device is a CPU: attention and AdamW run as on a CPU, so the plan is taken for a CPU too).
It is not a GPU measurement: no CUDA context, no allocator fragmentation, no NCCL buffers (the plan's "required"
adds margins for those), and no time. `--real` runs the same step on real tensors instead (small models only): it
is how the fake counting is checked (tests/benchmarks/test_simulate_scale.py).

Details of the set-up, each checked on small real tensors before it was trusted (benchmarks/RESULTS.md):
- the step runs outside the fake-tensor context (the tensors stay fake), because inside it the tracker also counted
  the whole-size temporaries DTensor uses to work out output shapes (2-3x too much for AdamW's step); FSDP's own
  buffers are then real CPU tensors (a block gathered: 1.7 GB for 70B), freed as in a real run;
- the unused next-token projection, a sharded group of its own that never runs, is registered with the tracker by
  hand;
- DDP (`--no-shard`) cannot run on fake tensors (its C++ reducer needs real storage), so its memory is simulated:
  a whole replica whose gradients are views of one flat buffer allocated up front and kept, as DDP's
  `gradient_as_bucket_view` buckets are (distributed.wrap), zeroed between steps; the all-reduce itself, in place,
  adds nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModMemStats, _FSDPRefType
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a fresh clone without installing

from llama_scratch.data.batching import TokenizedSplit, forward, to_batch  # noqa: E402
from llama_scratch.model.classifier import LlamaClassifier  # noqa: E402
from llama_scratch.model.config import PRESETS, LlamaConfig  # noqa: E402
from llama_scratch.model.llama import Llama  # noqa: E402
from llama_scratch.model.lora import LoRASettings  # noqa: E402
from llama_scratch.parallel import sharding  # noqa: E402
from llama_scratch.planning.advice import smallest_world  # noqa: E402
from llama_scratch.planning.memory import MemoryPlan, PlanInputs, plan_memory  # noqa: E402
from llama_scratch.training.loop import TrainSettings, make_optimizer  # noqa: E402

GiB = 2**30
CPU = torch.device("cpu")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b", choices=sorted(PRESETS), help="a preset (default: llama3-8b)")
    p.add_argument("--world-size", type=int, default=8, help="simulated processes (default: 8)")
    p.add_argument(
        "--shard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="FSDP2 (the default), or --no-shard: DDP, a whole replica per process",
    )
    p.add_argument("--train-last", default="all", help="blocks trained, or 'all' (default: all)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--lora", type=int, metavar="RANK", help="LoRA adapters of this rank in the trained blocks")
    p.add_argument("--batch-size", type=int, default=4, help="texts per process (default: 4)")
    p.add_argument("--max-length", type=int, default=128, help="tokens per text (default: 128)")
    p.add_argument("--gpu-memory", type=float, default=80.0, metavar="GiB", help="GPU to compare with (default: 80)")
    p.add_argument("--real", action="store_true", help="real tensors instead of fake ones (small models only)")
    p.add_argument("--json", action="store_true", help="end with one line of JSON")
    return p.parse_args(argv)


def plan_inputs_of(args: argparse.Namespace, device_type: str) -> PlanInputs:
    train_last = None if args.train_last == "all" else int(args.train_last)
    return PlanInputs(
        cfg=LlamaConfig.from_name(args.model),
        batch_size=args.batch_size,
        seq_len=args.max_length,
        train_last=train_last,
        dtype=torch.bfloat16,
        gradient_checkpointing=args.gradient_checkpointing,
        world_size=args.world_size,
        device_type=device_type,
        shard=args.shard,
        lora=LoRASettings(args.lora) if args.lora else None,
    )


def batch_of(cfg: LlamaConfig, rows: int, length: int) -> dict:
    """`rows` texts of `length` tokens, laid out as training lays them out (to_batch, TrainSettings' side)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (rows, length), generator=g).tolist()
    split = TokenizedSplit(ids=ids, labels=[i % 2 for i in range(rows)])
    return to_batch(split, list(range(rows)), TrainSettings().padding_side, CPU)


def simulate(args: argparse.Namespace) -> dict:
    """Two training steps of one of `--world-size` processes under a fake process group (and fake tensors, unless
    `--real`): the tracker's peak per step, in bytes, and its breakdown at the higher one."""
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    mesh = init_device_mesh("cpu", (args.world_size,)) if args.shard else None  # before the fake mode: it is real
    r = plan_inputs_of(args, "cpu")
    started = time.perf_counter()
    fake = contextlib.nullcontext() if args.real else FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        cfg = dataclasses.replace(r.cfg, dtype=torch.bfloat16)
        clf = LlamaClassifier(Llama(cfg), num_classes=2, train_last=r.train_last, lora=r.lora)
        clf.backbone.gradient_checkpointing = args.gradient_checkpointing
        if args.shard:
            sharding.shard_model(clf, mesh)
        else:
            bucket_views(clf)
    batch = batch_of(cfg, args.batch_size, args.max_length)
    inputs = [t for t in batch.values() if isinstance(t, torch.Tensor)]
    optimizer = make_optimizer(clf, TrainSettings())
    if args.shard:
        tracker, opt_kind = FSDPMemTracker(clf, optimizer), _FSDPRefType.OPT
    else:
        tracker, opt_kind = ReplicaTracker(), _MemRefType.OPT
        tracker.track_external(clf, optimizer, *inputs)
    steps = []
    with tracker:
        if args.shard:
            tracker.track_inputs(tuple(inputs))
        for master in getattr(optimizer, "masters", []):  # float32 master weights: the optimizer's, outside its state
            tracker._update_and_maybe_create_winfos(master, opt_kind)
        untied = args.shard and not cfg.tie_embeddings
        if untied:  # gathered once and freed, so that FSDP's hooks find what they expect
            clf.backbone.lm_head.unshard()
            clf.backbone.lm_head.reshard()
        for _ in range(2):  # step 2: its backward runs beside the optimizer's moments, created in step 1's step
            if untied:  # never called, so the tracker never met it (see the module docstring)
                tracker.memory_tracking[clf.backbone.lm_head] = _FSDPModMemStats("backbone.lm_head")
            logits = forward(clf, batch)
            F.cross_entropy(logits.float(), batch["labels"]).backward()
            del logits
            optimizer.step()
            optimizer.zero_grad(set_to_none=args.shard)  # DDP: zeroed in place, the bucket views stay (train.py)
            snapshot = tracker.get_tracker_snapshot("peak")[CPU]
            steps.append({getattr(k, "value", k): v for k, v in snapshot.items() if v})  # kinds by name
            tracker.reset_mod_stats()  # FSDPMemTracker refuses a second forward of the root otherwise
            tracker._peak_mem, tracker._peak_mem_snap = {}, {}  # the next step's own peak
    peak = max(steps, key=lambda s: s["Total"])
    return {
        "simulated_peak": peak["Total"],
        "steps": [s["Total"] for s in steps],
        "breakdown": peak,
        "seconds": time.perf_counter() - started,
    }


class ReplicaTracker(MemTracker):
    """MemTracker for a replica with frozen parameters: it hooks every parameter's gradient, which a parameter that
    needs none refuses. The gradients here are DDP's bucket views, allocated up front and tracked from the start."""

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True) -> tuple[int, int]:
        return super()._track_module_params_and_buffers(module, install_grad_hooks=False)


def bucket_views(clf: LlamaClassifier) -> None:
    """DDP's gradients (distributed.wrap: gradient_as_bucket_view, allocated when DDP is built): views of one flat
    buffer, allocated now and kept, which autograd accumulates into in place."""
    trained = [p for p in clf.parameters() if p.requires_grad]
    flat = torch.zeros(sum(p.numel() for p in trained), dtype=trained[0].dtype)
    offset = 0
    for p in trained:
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()


def size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def plan_parts(plan: MemoryPlan) -> dict[str, float]:
    """The plan's parts and phases, in GiB, for the JSON line."""
    parts = ("weights", "gradients", "optimizer_state", "activations", "gathered", "forward_work", "backward_work")
    return {k: getattr(plan, k) / GiB for k in parts} | {
        f"peak in {k}": (plan.persistent + v) / GiB for k, v in plan.phases.items()
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sim = simulate(args)
    plan = plan_memory(plan_inputs_of(args, "cpu"))
    gpu_plan = plan_memory(plan_inputs_of(args, "cuda"))
    gpu_bytes = int(args.gpu_memory * GiB)
    fewest = smallest_world(gpu_plan.inputs, gpu_bytes)
    ratio = sim["simulated_peak"] / plan.peak
    what = (
        f"{args.model}, {args.world_size} processes, {'sharded (FSDP2)' if args.shard else 'DDP'}, "
        f"train-last {args.train_last}, batch {args.batch_size} x {args.max_length}"
        + (", checkpointing" if args.gradient_checkpointing else "")
        + (f", LoRA {args.lora}" if args.lora else "")
        + (", real tensors" if args.real else "")
    )
    print(what)
    print(
        f"  simulated peak per process {sim['simulated_peak'] / GiB:8.2f} GiB  ({sim['seconds']:.1f} s; steps: "
        + ", ".join(f"{n / GiB:.2f}" for n in sim["steps"])
        + ")"
    )
    print("    at the peak: " + ", ".join(f"{k} {size(v)}" for k, v in sim["breakdown"].items() if k != "Total"))
    print(f"  plan peak per process      {plan.peak / GiB:8.2f} GiB  ({plan.peak_phase}; simulated / plan {ratio:.3f})")
    parts = ("weights", "gradients", "optimizer_state", "activations", "gathered")
    print("    " + ", ".join(f"{k.replace('_', ' ')} {size(getattr(plan, k))}" for k in parts))
    fits = "fits" if gpu_plan.fits(gpu_bytes) else "does not fit"
    print(
        f"  plan for a GPU: peak {gpu_plan.peak / GiB:.2f} GiB, needed with margins {gpu_plan.required() / GiB:.2f}"
        f" GiB: {fits} {args.gpu_memory:g} GiB; sharded, it fits from "
        + (f"{fewest} processes" if fewest else "no world size up to 1024")
    )
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "world_size": args.world_size,
                    "shard": args.shard,
                    "train_last": args.train_last,
                    "gradient_checkpointing": args.gradient_checkpointing,
                    "lora": args.lora,
                    "real": args.real,
                    "batch_size": args.batch_size,
                    "max_length": args.max_length,
                    "simulated_peak_gib": sim["simulated_peak"] / GiB,
                    "plan_peak_gib": plan.peak / GiB,
                    "ratio": ratio,
                    "simulated_steps_gib": [n / GiB for n in sim["steps"]],
                    "simulated_breakdown_gib": {k: v / GiB for k, v in sim["breakdown"].items()},
                    "plan_gib": plan_parts(plan),
                    "plan_peak_phase": plan.peak_phase,
                    "gpu_plan_required_gib": gpu_plan.required() / GiB,
                    "gpu_fits": gpu_plan.fits(gpu_bytes),
                    "smallest_world_size": fewest,
                    "seconds": sim["seconds"],
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

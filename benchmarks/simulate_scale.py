"""One real training step of a full-size model, sharded across many simulated processes, in one process on a CPU.

    python benchmarks/simulate_scale.py --model llama3-70b --world-size 64 --train-last all --gradient-checkpointing
    python benchmarks/simulate_scale.py --model llama3-8b --world-size 8 --train-last 2 --json

How: a fake process group (backend "fake": every collective returns at once, moving nothing) stands in for
`--world-size` processes, and fake tensors (`FakeTensorMode`: shapes, dtypes and devices, no storage) stand in for
the weights, so that Llama-3-70B "fits". The package's own code then runs as a sharded run would: the classifier
built and sharded by `sharding.shard_model`, `train.make_optimizer` (float32 master weights), one forward of a batch
of `--batch-size` texts of `--max-length` tokens, the loss, backward, and the optimizer step. PyTorch's
`FSDPMemTracker` counts every tensor one process allocates and frees, and keeps the peak. That peak is printed
beside the plan's (`llama_scratch.plan`, what `--plan` prints) for the same recipe; `--json` makes the last line
one JSON object.

What it is and is not: the memory of one step, as PyTorch's allocator would be asked for it by this code, with the
CPU's kernels (the fake device is a CPU: attention and AdamW run as on a CPU, so the plan is taken for a CPU too).
It is not a GPU measurement: no CUDA context, no allocator fragmentation, no NCCL buffers (the plan's "required"
adds margins for those), and no time.

Two details of the set-up, each checked on small real tensors before it was trusted (benchmarks/RESULTS.md):
the step runs outside the fake-tensor context (the tensors stay fake), because inside it the tracker also counted
the whole-size temporaries DTensor uses to work out output shapes (2-3x too much for AdamW's step); and the unused
next-token projection, a sharded group of its own that never runs, is registered with the tracker by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModMemStats
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a fresh clone without installing

from llama_scratch import sharding  # noqa: E402
from llama_scratch.classifier import LlamaClassifier  # noqa: E402
from llama_scratch.config import PRESETS, LlamaConfig  # noqa: E402
from llama_scratch.lora import LoRASettings  # noqa: E402
from llama_scratch.model import Llama  # noqa: E402
from llama_scratch.plan import Recipe, plan_memory  # noqa: E402
from llama_scratch.train import TrainSettings, make_optimizer  # noqa: E402

GiB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b", choices=sorted(PRESETS), help="a preset (default: llama3-8b)")
    p.add_argument("--world-size", type=int, default=8, help="simulated processes (default: 8)")
    p.add_argument("--train-last", default="all", help="blocks trained, or 'all' (default: all)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--lora", type=int, metavar="RANK", help="LoRA adapters of this rank in the trained blocks")
    p.add_argument("--batch-size", type=int, default=4, help="texts per process (default: 4)")
    p.add_argument("--max-length", type=int, default=128, help="tokens per text (default: 128)")
    p.add_argument("--gpu-memory", type=float, default=80.0, metavar="GiB", help="GPU to compare with (default: 80)")
    p.add_argument("--json", action="store_true", help="end with one line of JSON")
    return p.parse_args(argv)


def recipe_of(args: argparse.Namespace, device_type: str) -> Recipe:
    train_last = None if args.train_last == "all" else int(args.train_last)
    return Recipe(cfg=LlamaConfig.from_name(args.model), batch_size=args.batch_size, seq_len=args.max_length,
                  train_last=train_last, dtype=torch.bfloat16, gradient_checkpointing=args.gradient_checkpointing,
                  world_size=args.world_size, device_type=device_type, shard=True,
                  lora=LoRASettings(args.lora) if args.lora else None)  # fmt: skip


def simulate(args: argparse.Namespace) -> dict:
    """One sharded training step under a fake process group and fake tensors; the tracker's peak per process."""
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    mesh = init_device_mesh("cpu", (args.world_size,))  # before the fake mode: the mesh is real
    r = recipe_of(args, "cpu")
    started = time.perf_counter()
    with FakeTensorMode(allow_non_fake_inputs=True):
        cfg = dataclasses.replace(r.cfg, dtype=torch.bfloat16)
        clf = LlamaClassifier(Llama(cfg), num_classes=2, train_last=r.train_last, lora=r.lora)
        clf.backbone.gradient_checkpointing = args.gradient_checkpointing
        sharding.shard_model(clf, mesh)
        ids = torch.randint(0, cfg.vocab_size, (args.batch_size, args.max_length))
        labels = torch.zeros(args.batch_size, dtype=torch.long)
    tracker = FSDPMemTracker(clf)
    with tracker:
        if not cfg.tie_embeddings:  # gathered once and freed, so that FSDP's hooks find what they expect
            clf.backbone.lm_head.unshard()
            clf.backbone.lm_head.reshard()
        optimizer = make_optimizer(clf, TrainSettings())  # its float32 masters are counted too
        peaks = []
        for _ in range(2):  # the second step is the steady state: its backward runs beside the optimizer's moments
            if not cfg.tie_embeddings:  # never called, so the tracker never met it (see the module docstring)
                tracker.memory_tracking[clf.backbone.lm_head] = _FSDPModMemStats("backbone.lm_head")
            logits = clf(ids)
            F.cross_entropy(logits.float(), labels).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del logits
            peaks.append(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
            tracker.reset_mod_stats()  # the tracker follows one step at a time
    return {"simulated_peak": max(peaks), "seconds": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sim = simulate(args)
    plan = plan_memory(recipe_of(args, "cpu"))
    gpu_plan = plan_memory(recipe_of(args, "cuda"))
    ratio = sim["simulated_peak"] / plan.peak
    what = (
        f"{args.model}, {args.world_size} processes, train-last {args.train_last}"
        + (", checkpointing" if args.gradient_checkpointing else "")
        + (f", LoRA {args.lora}" if args.lora else "")
    )
    print(what)
    print(f"  simulated peak per process {sim['simulated_peak'] / GiB:7.2f} GiB  ({sim['seconds']:.1f} s)")
    print(f"  plan peak per process      {plan.peak / GiB:7.2f} GiB  (ratio simulated / plan {ratio:.3f})")
    print(
        f"  plan for a GPU: peak {gpu_plan.peak / GiB:.2f} GiB, required with margins {gpu_plan.required() / GiB:.2f}"
        f" GiB: {'fits' if gpu_plan.fits(int(args.gpu_memory * GiB)) else 'does not fit'} {args.gpu_memory:g} GiB"
    )
    if args.json:
        print(json.dumps({
            "model": args.model, "world_size": args.world_size, "train_last": args.train_last,
            "gradient_checkpointing": args.gradient_checkpointing, "lora": args.lora,
            "batch_size": args.batch_size, "max_length": args.max_length,
            "simulated_peak_gib": sim["simulated_peak"] / GiB, "plan_peak_gib": plan.peak / GiB, "ratio": ratio,
            "plan_phases_gib": {k: (plan.persistent + v) / GiB for k, v in plan.phases.items()},
            "gpu_plan_required_gib": gpu_plan.required() / GiB, "seconds": sim["seconds"],
        }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Llama-3-8B at full scale: load memory, training throughput and MFU, and peak memory against the plan.

    python benchmarks/gpu_8b.py                           # on a GPU: the real Llama-3-8B shape, random weights
    python benchmarks/gpu_8b.py --json results.json       # also write the figures as JSON
    python benchmarks/gpu_8b.py --shape small             # on CPU in seconds: the same code on a 5-layer model

1. A random-weight checkpoint of the shape is written to --dir (16 GB for 8B, streamed: memory stays flat) unless
   one is there already.
2. (a) `load_weights` streams it onto the device; its peak memory / checkpoint bytes (GPU: max_memory_allocated).
3. (b, c) Each recipe (train the last block; the last 4; all of them with gradient checkpointing) at each sequence
   length trains on random tokens exactly as train.py does (classifier, cross-entropy, clip, AdamW step). Reported:
   tokens/s and model FLOPs utilisation, the peak memory of the steps next to `plan_memory`'s figure, and the
   attention backend one more untimed step used (common.attention_backends).

FLOPs per step: 6 x trained parameters x tokens (forward and backward) + 2 x frozen parameters x tokens (forward
only) + causal attention (QK^T and PV over T(T+1)/2 pairs per head: once for frozen blocks, three times for trained
ones), where the classifier's last block counts only the tokens it runs at (see model_flops; "MFU 6PT" counts it at
every token, the usual convention). The embedding lookup and the unused language-model head are not counted; nor is
checkpointing's recompute. MFU divides by the GPU's dense bfloat16 peak (table below, or --peak-tflops).

On CPU there is no max_memory_allocated: a dispatch mode counts the bytes of every live tensor instead (exact for
tensors, blind to allocator overhead), with the weights, which exist before it starts, added as a baseline.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
import weakref
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Runnable from a fresh clone as `python benchmarks/gpu_8b.py`: this folder (for common.py) and the repository
# (for llama_scratch, installed or not) are importable.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import attention_backends, write_random_checkpoint  # noqa: E402

from llama_scratch import Llama, LlamaClassifier, LlamaConfig  # noqa: E402
from llama_scratch.checkpoints.weights import load_weights, save_checkpoint  # noqa: E402
from llama_scratch.planning.memory import GiB, PlanInputs, count_parameters, plan_memory  # noqa: E402
from llama_scratch.training.loop import TrainSettings, make_optimizer  # noqa: E402

SHAPES = {
    "llama3-8b": LlamaConfig.from_name("llama3-8b", dtype=torch.bfloat16),
    # Small enough for CI on a CPU, deep enough that "last 4" is not "all", real grouped-query attention.
    "small": LlamaConfig(
        vocab_size=2048,
        dim=256,
        n_layers=5,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=768,
        max_seq_len=1024,
        dtype=torch.float32,
    ),
}
RECIPES = {"last-1": (1, False), "last-4": (4, False), "all+ckpt": (None, True)}  # name: (train_last, checkpointing)

# Dense bfloat16 tensor-core peaks (no sparsity), TFLOP/s, by a piece of torch.cuda.get_device_name(); first match.
PEAK_BF16_TFLOPS = [
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.4),  # also GH200
    ("H800", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
]


def peak_tflops(device_name: str) -> float | None:
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return None


# --- memory ---------------------------------------------------------------------------------------------------------


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of all tensor storages created inside the mode and still alive, and their peak (CPU stand-in for
    torch.cuda.max_memory_allocated). A storage counts once however many views share it; a weak reference tells
    when it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0

    def _freed(self, key: int, nbytes: int) -> None:
        if self.live.pop(key, None) is not None:
            self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output sharing an input's storage (a view such as weight.t(), an in-place update) allocated nothing.
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                key = id(st)
                if key not in self.live and st.data_ptr() not in inputs:
                    n = st.nbytes()
                    self.live[key] = weakref.ref(st, lambda _, k=key, n=n: self._freed(k, n))
                    self.current += n
                    self.peak = max(self.peak, self.current)
        return out


@contextmanager
def peak_memory(device: torch.device, baseline: int = 0):
    """Yields a dict whose "peak" is set on exit: bytes allocated at the highest point inside the block.

    CUDA: torch.cuda.max_memory_allocated (everything on the device). CPU: LiveTensorBytes plus `baseline` (the
    bytes already allocated before the block, which the mode cannot see)."""
    out = {"peak": 0}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield out
        torch.cuda.synchronize(device)
        out["peak"] = torch.cuda.max_memory_allocated(device)
    else:
        with LiveTensorBytes() as live:
            yield out
        out["peak"] = baseline + live.peak


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage once."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*module.parameters(), *module.buffers()]
    }
    return sum(storages.values())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- the measurements -----------------------------------------------------------------------------------------------


def ensure_checkpoint(cfg: LlamaConfig, directory: Path) -> Path:
    """A random checkpoint of `cfg`'s shape in `directory`, written unless a complete one of that shape is there."""
    config = directory / "config.json"
    if config.exists() and json.loads(config.read_text()) == json.loads(json.dumps(cfg.to_hf_dict())):
        return directory
    start = time.perf_counter()
    print(f"writing a random checkpoint to {directory} ...", file=sys.stderr, flush=True)
    if count_parameters(cfg).backbone * cfg.dtype.itemsize > GiB:
        write_random_checkpoint(cfg, directory)  # streamed tensor by tensor: 16 GB never sits in memory
    else:
        save_checkpoint(Llama(cfg), cfg, directory)  # small: initialise on CPU and save, the quicker way
    print(f"  written in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return directory


def measure_load(cfg: LlamaConfig, ckpt: Path, device: torch.device) -> tuple[Llama, dict]:
    """(a) Load onto `device` with load_weights; peak memory over checkpoint bytes."""
    with torch.device("meta"):
        model = Llama(cfg)
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    with peak_memory(device) as mem:
        report = load_weights(model, ckpt, device=device, progress=False)
    on_gpu = device.type == "cuda"
    return model, {
        "checkpoint_bytes": report.bytes,
        "peak_bytes": mem["peak"] if on_gpu else None,
        "peak_over_checkpoint": mem["peak"] / report.bytes if on_gpu else None,
        "seconds": report.seconds,
        "gb_per_s": report.bytes / 1e9 / report.seconds,
        # On CPU load_weights maps the files (pages stay file-backed until written): no allocation to count here.
        "note": None if on_gpu else "CPU: memory-mapped; resident memory is measured by benchmarks/load_memory.py",
    }


def model_flops(
    cfg: LlamaConfig, train_last: int | None, batch: int, seq: int, num_classes: int = 2, lora: bool = False
) -> dict:
    """FLOPs of one training step, two ways (see the module docstring).

    "done": what the classifier computes. Its last block runs at each row's last token (its layout's query rows),
    so only that block's norm, k_proj and v_proj see every token. "6PT": the usual convention, every block at
    every token; on this classifier it counts work that is never done, so it overstates MFU.
    `lora`: the trained blocks' weights are frozen under adapters, so their backward computes the input's gradient
    only: 4 FLOPs a weight a token instead of 6 (the rank-r adapters' own, under 0.5% at rank 8, are not counted).
    """
    counts = count_parameters(cfg, train_last, num_classes)
    n, k = cfg.n_layers, cfg.n_layers if train_last is None else train_last
    tokens, block = batch * seq, counts.block
    causal = 2 * 2 * batch * cfg.n_heads * cfg.head_dim * seq * (seq + 1) / 2  # QK^T and PV, one block's forward
    one_query = 2 * 2 * batch * cfg.n_heads * cfg.head_dim * seq  # the last block: one query per row
    head = 6 * (cfg.dim + counts.head) * batch  # final norm and head, at one token per row
    kv = 2 * cfg.dim * cfg.n_kv_heads * cfg.head_dim  # k_proj and v_proj
    full_trained, full_frozen = max(k - 1, 0), n - max(k, 1)
    t = 4 if lora else 6  # per weight and token in a trained block: forward 2, input gradient 2, weight gradient 2
    last = (t if k else 2) * (kv * tokens + (block - kv) * batch) + (3 if k else 1) * one_query
    done = (t * block * tokens + 3 * causal) * full_trained + (2 * block * tokens + causal) * full_frozen + last + head
    convention = t * k * block * tokens + 2 * (n - k) * block * tokens + causal * (3 * k + n - k) + head
    return {"done": done, "6PT": convention}


@dataclass
class Run:
    recipe: str
    seq_len: int
    batch_size: int
    train_last: int | None
    gradient_checkpointing: bool
    trainable_params: int
    steps: int
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    tflops: float = 0.0
    mfu: float | None = None  # on the FLOPs done
    mfu_6pt: float | None = None  # on the 6 x parameters x tokens convention
    peak_bytes: int = 0
    plan_bytes: int = 0
    measured_over_plan: float = 0.0
    sdpa_backend: str | None = None  # what scaled_dot_product_attention ran (common.attention_backends)
    error: str | None = None


def run_recipe(
    backbone: Llama, name: str, seq: int, batch: int, steps: int, warmup: int, peak: float | None, opt_state: str
) -> Run:
    """(b, c) Train one recipe on random tokens: warm-up steps under the memory probe, then timed steps."""
    cfg, device = backbone.cfg, backbone.embed_tokens.weight.device
    train_last, ckpt = RECIPES[name]
    train_last = None if train_last is None else min(train_last, cfg.n_layers)
    clf = LlamaClassifier(backbone, num_classes=2, train_last=train_last).train()
    backbone.gradient_checkpointing = ckpt
    plan = plan_memory(  # its batches are padded ones: clf(ids, mask)
        PlanInputs(cfg, batch, seq, train_last, 2, cfg.dtype, opt_state, ckpt, device_type=device.type, packed=False)
    )
    run = Run(name, seq, batch, train_last, ckpt, plan.counts.trainable, steps, plan_bytes=plan.peak)
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device, generator=gen)
    mask = torch.ones_like(ids)  # the trainer always passes a mask; all ones keeps the fused causal kernel
    labels = torch.randint(0, 2, (batch,), device=device, generator=gen)
    optimizer = make_optimizer(clf, TrainSettings(batch_size=batch, lr=1e-5, optimizer_state=opt_state))
    params = [p for p in clf.parameters() if p.requires_grad]

    def step() -> None:  # the body of train.train's loop
        loss = F.cross_entropy(clf(ids, mask).float(), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    try:
        with peak_memory(device, baseline=tensor_bytes(clf)) as mem:
            for _ in range(warmup):  # the first step also allocates the optimizer state
                step()
        run.sdpa_backend = attention_backends(step, device)["backend"]  # one more untimed step, profiled
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync(device)
        run.seconds = time.perf_counter() - start
    except torch.OutOfMemoryError as e:
        run.error = f"out of memory: {str(e).splitlines()[0]}"
        return run
    finally:  # leave the backbone as it came: no gradients, no optimizer state, frozen, no checkpointing
        optimizer.zero_grad(set_to_none=True)
        optimizer.state.clear()
        backbone.requires_grad_(False)
        backbone.gradient_checkpointing = False
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    run.peak_bytes = mem["peak"]
    run.measured_over_plan = run.peak_bytes / run.plan_bytes
    run.tokens_per_s = batch * seq * steps / run.seconds
    flops = model_flops(cfg, train_last, batch, seq)
    run.tflops = flops["done"] * steps / run.seconds / 1e12
    run.mfu = run.tflops / peak if peak else None
    run.mfu_6pt = flops["6PT"] * steps / run.seconds / 1e12 / peak if peak else None
    return run


# --- the report -----------------------------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    """A section for benchmarks/RESULTS.md."""
    load = result["load"]
    lines = [
        f"### {result['shape']} on {result['device_name']} (torch {result['torch']}, {result['dtype']})",
        "",
        f"`{result['command']}`",
        "",
        f"load_weights: peak {load['peak_bytes'] / GiB:.2f} GiB for a {load['checkpoint_bytes'] / GiB:.2f} GiB "
        f"checkpoint = **{load['peak_over_checkpoint']:.3f}x** (target <= 1.05x), {load['seconds']:.1f} s "
        f"({load['gb_per_s']:.2f} GB/s)"
        if load["note"] is None
        else f"load_weights: {load['checkpoint_bytes'] / GiB:.2f} GiB in {load['seconds']:.1f} s; {load['note']}",
        "",
        "| recipe | seq | batch | trained params | tokens/s | model TFLOP/s | MFU | MFU 6PT | peak GiB | plan GiB "
        "| peak/plan | attention |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in result["runs"]:
        head = f"| {r['recipe']} | {r['seq_len']} | {r['batch_size']} | {r['trainable_params'] / 1e6:,.1f}M |"
        if r["error"]:
            lines.append(f"{head} {r['error']} | | | | | {r['plan_bytes'] / GiB:.2f} | | |")
            continue
        mfu = " | ".join(f"{m:.1%}" if m is not None else "n/a" for m in (r["mfu"], r["mfu_6pt"]))
        lines.append(
            f"{head} {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {mfu} | {r['peak_bytes'] / GiB:.2f} | "
            f"{r['plan_bytes'] / GiB:.2f} | {r['measured_over_plan']:.3f} | {r['sdpa_backend']} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=list(SHAPES), help="default: llama3-8b on a GPU, small on CPU")
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--dir", type=Path, help="where the random checkpoint goes (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep a checkpoint written to the temporary directory")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[128, 512])
    p.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    p.add_argument("--tokens", type=int, help="tokens per step; batch = tokens // seq (default: 4096 GPU, 512 CPU)")
    p.add_argument("--steps", type=int, help="timed steps (default: 10 GPU, 2 CPU)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps, over which peak memory is taken")
    p.add_argument("--optimizer-state", choices=["param", "float32"], default="param")
    p.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, if not in the table")
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    on_gpu = device.type == "cuda"
    shape = args.shape or ("llama3-8b" if on_gpu else "small")
    cfg = SHAPES[shape]
    name = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    peak = args.peak_tflops or (peak_tflops(name) if on_gpu else None)
    tokens, steps = args.tokens or (4096 if on_gpu else 512), args.steps or (10 if on_gpu else 2)

    temporary = args.dir is None
    directory = args.dir or Path(tempfile.mkdtemp(prefix=f"llama-{shape}-"))
    result = {
        "shape": shape,
        "device_name": name,
        "torch": torch.__version__,
        "dtype": str(cfg.dtype).removeprefix("torch."),
        "peak_bf16_tflops": peak,
        "command": " ".join(["python", "benchmarks/gpu_8b.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    try:
        ckpt = ensure_checkpoint(cfg, directory)
        backbone, result["load"] = measure_load(cfg, ckpt, device)
        print(f"load: {result['load']}", file=sys.stderr, flush=True)
        runs = []
        for seq in args.seq_lens:
            for recipe in args.recipes:
                run = run_recipe(
                    backbone, recipe, seq, max(1, tokens // seq), steps, args.warmup, peak, args.optimizer_state
                )
                print(
                    f"{recipe} seq {seq}: {run.tokens_per_s:,.0f} tokens/s, peak {run.peak_bytes / GiB:.2f} GiB "
                    f"(plan {run.plan_bytes / GiB:.2f}){' ' + run.error if run.error else ''}",
                    file=sys.stderr,
                    flush=True,
                )
                runs.append(asdict(run))
        result["runs"] = runs
    finally:
        if temporary and not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    print(markdown(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()

"""Attention's cost when every batch has a new length: cuDNN's fused kernel against flash, on a GPU.

Why this exists: on an H200 (2026-11-26, benchmarks/RESULTS.md "GPU figures") `gpu_check.py --profile` found cuDNN's
scaled-dot-product attention spending 26 ms (forward) and 36 ms (backward) of host time per call at Llama-3-8B's
head shapes while its kernels ran for 28-58 us. The suspicion: cuDNN builds an execution plan for each new shape,
and packed training batches have a new longest text almost every step. This script times forward + backward of
the package's own attention call shape (`F.scaled_dot_product_attention`, causal, key/value heads shared in the
kernel as `model.attention_kernels.kernel_shares_heads` allows) over a sequence of lengths, each setting in its own
process so no setting inherits another's cached plans:

- `cudnn`:    torch's default order on sm90 (cuDNN first);
- `no-cudnn`: cuDNN's SDPA switched off (`torch.backends.cuda.enable_cudnn_sdp(False)`): flash takes the call;
- `cudnn-64`: cuDNN, with each length rounded up to a multiple of 64, so only a few shapes ever occur.

Per setting: the median and mean wall time of one forward + backward over the first pass of lengths (mostly new
shapes) and over a second pass of the same lengths (every shape seen), synchronized after each call.

    python benchmarks/sdpa_shapes.py --out DIR     # DIR/sdpa_shapes.json, and a table printed
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"8b": (32, 8, 128), "small": (9, 3, 64)}  # (query heads, key/value heads, head dim)
SETTINGS = ("cudnn", "no-cudnn", "cudnn-64")


def lengths(n: int, seed: int = 0) -> list[int]:
    """The longest text of n packed batches: byte-level tokens of SMS texts run from ~10 to 385."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(40, 386, (n,), generator=g).tolist()


def one_call(shape: str, texts: int, length: int, device: torch.device) -> float:
    """Seconds for one forward + backward, synchronized before and after."""
    heads, kv_heads, hd = SHAPES[shape]
    q = torch.randn(texts, heads, length, hd, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(texts, kv_heads, length, hd, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.sum().backward()
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def run_setting(setting: str, shape: str, steps: int, texts: int) -> dict:
    device = torch.device("cuda")
    if setting == "no-cudnn":
        torch.backends.cuda.enable_cudnn_sdp(False)
    seq = lengths(steps)
    if setting == "cudnn-64":
        seq = [-(-n // 64) * 64 for n in seq]
    one_call(shape, texts, 8, device)  # CUDA context, cuBLAS handles: not the attention's cost
    first = [one_call(shape, texts, n, device) for n in seq]
    again = [one_call(shape, texts, n, device) for n in seq]
    ms = lambda xs: {"median_ms": 1e3 * statistics.median(xs), "mean_ms": 1e3 * statistics.mean(xs)}  # noqa: E731
    return {
        "setting": setting,
        "shape": shape,
        "distinct_lengths": len(set(seq)),
        "first": ms(first),
        "again": ms(again),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("sdpa_shapes"))
    p.add_argument("--steps", type=int, default=40, help="lengths per pass (default 40)")
    p.add_argument("--texts", type=int, default=8, help="texts per call (default 8, gpu_check's batch)")
    p.add_argument("--one", nargs=2, metavar=("SETTING", "SHAPE"), help=argparse.SUPPRESS)  # a child process
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_setting(*args.one, args.steps, args.texts)))
        return 0
    rows = []
    for shape in SHAPES:
        for setting in SETTINGS:
            cmd = [sys.executable, __file__, "--one", setting, shape, "--steps", str(args.steps)]
            cmd += ["--texts", str(args.texts)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                rows.append({"setting": setting, "shape": shape, "error": done.stderr.strip().splitlines()[-1:]})
            else:
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    result["cudnn"] = torch.backends.cudnn.version()
    (args.out / "sdpa_shapes.json").write_text(json.dumps(result, indent=1))
    print("| shape | setting | distinct lengths | first pass median / mean ms | second pass median / mean ms |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['setting']} | error: {r['error']} | | |")
            continue
        f, a = r["first"], r["again"]
        print(
            f"| {r['shape']} | {r['setting']} | {r['distinct_lengths']} | {f['median_ms']:.2f} / {f['mean_ms']:.2f} "
            f"| {a['median_ms']:.2f} / {a['mean_ms']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peak memory and time to load a real-shape checkpoint: our streaming loader next to the alternatives.

    python benchmarks/load_memory.py --shape llama3.2-1b            # 2.5 GB, bf16
    python benchmarks/load_memory.py --shape llama3-8b --cleanup    # 16 GB, bf16; deletes the files afterwards
    python benchmarks/load_memory.py --shape llama3-8b --device cuda

A random-weight checkpoint of the real shape is written once under --dir. Each method then runs in a fresh process
(so one's memory cannot hide another's), after the files were read once to put them in the page cache:
  raw           read the files' bytes into new memory and nothing else: the floor for any loader
  ours          build on the meta device, `load_weights` streams tensor by tensor into place (on CPU, with the
                file's dtype, each parameter maps the file: no copy)
  ours-copy     the same with mmap=False: every tensor read into new memory (what a dtype change or a GPU does)
  transformers  `LlamaForCausalLM.from_pretrained(dir, dtype=bfloat16)`
  nf4 / int8    `load_weights(..., quantize=...)`: every block's linears and the LM head quantized as they stream
                in (a few rows at a time), the embedding mapped as in `ours`
  naive         build the model (random init), `safetensors.torch.load_file`, `load_state_dict`: the way that
                needed a second full copy of the weights
Reported per method: load seconds; seconds to then touch every memory page of every parameter (a memory map that
defers the cost must not count as free); the seconds `cat` needs to read the files from the page cache into one
reused buffer, and load time relative to it and to `raw` (fresh memory costs page faults, which on a VM can cost
more than the copy); peak resident memory above the process's baseline / checkpoint size, after loading and after
the touch; the process's anonymous memory (RssAnon: its own, not the mapped files' pages) above its baseline /
checkpoint size, at its highest while loading (read every 5 ms on a thread: a transient the load frees before it
returns shows here, not in a reading after it) and once loaded; bytes read from disk rather than the page cache.
With --device cuda: peak `torch.cuda.max_memory_allocated()` / checkpoint size instead of resident memory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from common import (
    GiB,
    PeakSampler,
    checkpoint_files,
    mem_available,
    proc_status,
    python_cmd,
    read_files,
    run_watched,
)

METHODS = ["raw", "ours", "ours-copy", "nf4", "transformers", "naive"]


# --- the measured process ----------------------------------------------------------------------------------------


def touch(model: torch.nn.Module) -> float:
    """Read one value from every memory page of every parameter and buffer (pages of a memory map become
    resident; a quantized layer's weights are its buffers)."""
    total = 0.0
    for p in [*model.parameters(), *model.buffers()]:
        flat = p.detach().reshape(-1)
        total += float(flat[:: max(1, 4096 // p.element_size())].float().sum())
    return total


def disk_read_bytes() -> int:
    """Bytes this process caused to be fetched from storage (not served by the page cache)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def load(method: str, ckpt: Path, device: torch.device) -> torch.nn.Module:
    from llama_scratch import Llama, LlamaConfig
    from llama_scratch.checkpoints.hf_layout import hf_to_ours
    from llama_scratch.checkpoints.weights import load_weights

    cfg = LlamaConfig.from_hf(ckpt)
    if method == "raw":  # the least any loader must do: the files' bytes into new memory on the device
        model = torch.nn.ParameterList()
        for file in checkpoint_files(ckpt):
            data = torch.empty(file.stat().st_size, dtype=torch.uint8)
            with open(file, "rb", buffering=0) as f:
                view, done = memoryview(data.numpy()), 0
                while done < len(view):
                    done += f.readinto(view[done:])
            model.append(torch.nn.Parameter(data.to(device), requires_grad=False))
    elif method in ("ours", "ours-copy"):
        with torch.device("meta"):
            model = Llama(cfg)
        load_weights(model, ckpt, device=device, progress=False, mmap=method == "ours")
    elif method in ("nf4", "int8"):
        with torch.device("meta"):
            model = Llama(cfg)
        load_weights(model, ckpt, device=device, progress=False, quantize=method)
    elif method == "transformers":
        from transformers import LlamaForCausalLM

        extra = {"device_map": str(device)} if device.type == "cuda" else {}
        model = LlamaForCausalLM.from_pretrained(ckpt, dtype=cfg.dtype, **extra)
    elif method == "naive":
        from safetensors.torch import load_file

        with device:
            model = Llama(cfg)
        state = {}
        for file in checkpoint_files(ckpt):
            state.update({hf_to_ours(k): v for k, v in load_file(file, device=str(device)).items()})
        if cfg.tie_embeddings:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        model.load_state_dict(state)
        del state
    else:
        raise ValueError(f"unknown method {method!r}")
    return model


def worker(method: str, ckpt: Path, device: torch.device) -> None:
    """Load, measure, touch, measure; one JSON line on stdout."""
    if method == "transformers":
        import transformers  # noqa: F401  (imported before the baseline: its import is not loading)
    import llama_scratch.checkpoints.weights  # noqa: F401

    with torch.device("meta"):  # the first init on meta imports parts of torch (~2 s), which is not loading
        torch.nn.Embedding(2, 2), torch.nn.Linear(2, 2)
    if device.type == "cuda":
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats(device)
    status = proc_status()
    base, anon_base = status["VmRSS"], status["RssAnon"]
    disk0 = disk_read_bytes()
    start = time.perf_counter()
    with PeakSampler("RssAnon", 0.005) as anon:
        model = load(method, ckpt, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    result = {"load_s": time.perf_counter() - start, "base": base, "hwm_load": proc_status()["VmHWM"]}
    # The process's own memory: sampled during the load (its transient) and once it has returned.
    result |= {"anon_base": anon_base, "anon_peak": anon.peak, "anon_after": proc_status()["RssAnon"]}
    result["anon_samples"] = anon.samples
    if device.type == "cuda":
        result["cuda_load"] = torch.cuda.max_memory_allocated(device)
    start = time.perf_counter()
    touch(model)
    result |= {"touch_s": time.perf_counter() - start, "hwm_touch": proc_status()["VmHWM"]}
    result["disk_read"] = disk_read_bytes() - disk0
    if device.type == "cuda":
        result["cuda_touch"] = torch.cuda.max_memory_allocated(device)
        result["gpu"] = torch.cuda.get_device_name(device)
    print(json.dumps(result), flush=True)


# --- the driver --------------------------------------------------------------------------------------------------


def ensure_checkpoint(shape: str, root: Path) -> Path:
    from common import write_random_checkpoint

    from llama_scratch import LlamaConfig

    ckpt = root / shape
    if (ckpt / "config.json").exists():
        return ckpt
    cfg = LlamaConfig.from_name(shape, dtype=torch.bfloat16)
    start = time.perf_counter()
    print(f"writing a random {shape} checkpoint to {ckpt} ...", file=sys.stderr, flush=True)
    write_random_checkpoint(cfg, ckpt)
    print(f"  written in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return ckpt


def measure(method: str, ckpt: Path, device: str, min_available: int) -> dict:
    files = checkpoint_files(ckpt)
    read_files(files)  # into the page cache
    row = {"method": method, "raw_s": read_files(files)}
    code, out, note, peak = run_watched(
        python_cmd(__file__, "--worker", method, "--ckpt", str(ckpt), "--device", device), min_available
    )
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if code == 0 and lines:
        row |= json.loads(lines[-1])
    else:
        row["note"] = note or f"exit code {code}"
        row["peak_seen"] = peak
    return row


def table(rows: list[dict], ckpt_bytes: int, device: str) -> str:
    gpu = device.startswith("cuda")
    floor = next((r["load_s"] for r in rows if r["method"] == "raw" and "load_s" in r), None)
    head = ["method", "load s", "+ touch s", "cached read s", "load / cached read", "load / raw"]
    head += (
        ["GPU peak after load / ckpt", "after touch / ckpt"]
        if gpu
        else ["peak RSS after load", "/ ckpt", "after touching every param", "/ ckpt"]
        + ["anon peak during load / ckpt", "anon after load / ckpt"]
    )
    head += ["disk read GiB", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "load_s" not in r:
            seen = f"{r['peak_seen'] / GiB:.2f} GiB when it died" if r.get("peak_seen") else ""
            cells = [r["method"], "-", "-", f"{r['raw_s']:.2f}", "-", "-", *["-"] * (2 if gpu else 6), "-"]
            lines.append("| " + " | ".join([*cells, f"{r['note']} {seen}"]) + " |")
            continue
        cells = [r["method"], f"{r['load_s']:.2f}", f"{r['touch_s']:.2f}", f"{r['raw_s']:.2f}"]
        cells += [f"{r['load_s'] / r['raw_s']:.2f}x", f"{r['load_s'] / floor:.2f}x" if floor else "-"]
        if gpu:
            cells += [f"{r['cuda_load'] / ckpt_bytes:.3f}", f"{r['cuda_touch'] / ckpt_bytes:.3f}"]
        else:
            load, touched = r["hwm_load"] - r["base"], r["hwm_touch"] - r["base"]
            cells += [f"{load / GiB:.2f} GiB", f"{load / ckpt_bytes:.3f}"]
            cells += [f"{touched / GiB:.2f} GiB", f"{touched / ckpt_bytes:.3f}"]
            during, after = r["anon_peak"] - r["anon_base"], r["anon_after"] - r["anon_base"]
            cells += [f"{during / ckpt_bytes:.3f} ({during / GiB:.2f} GiB)", f"{after / ckpt_bytes:.3f}"]
        cells += [f"{r['disk_read'] / GiB:.2f}", r.get("gpu", "")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama3.2-1b", help="a preset name: llama3.2-1b, llama3-8b, ...")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/llama_scratch_bench"), help="checkpoint cache")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--min-available-gib", type=float, default=1.0, help="kill a method below this free memory")
    parser.add_argument("--repeat", type=int, default=1, help="runs per method; the fastest is reported")
    parser.add_argument("--cleanup", action="store_true", help="delete the checkpoint afterwards")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.ckpt, torch.device(args.device))

    ckpt = ensure_checkpoint(args.shape, args.dir)
    ckpt_bytes = sum(f.stat().st_size for f in checkpoint_files(ckpt))
    rows = []
    for method in args.methods.split(","):
        print(f"measuring {method} ...", file=sys.stderr, flush=True)
        runs = [measure(method, ckpt, args.device, int(args.min_available_gib * GiB)) for _ in range(args.repeat)]
        rows.append(min(runs, key=lambda r: r.get("load_s", float("inf"))))
        rows[-1]["raw_s"] = min(r["raw_s"] for r in runs)
    base = ", ".join(f"{r['method']} {r['base'] / GiB:.2f}" for r in rows if "base" in r)
    n_files = len(checkpoint_files(ckpt))
    print(f"\n{args.shape}: {ckpt_bytes / GiB:.2f} GiB in {n_files} file(s), bf16, on {args.device}")
    print(f"memory: {mem_available() / GiB:.1f} GiB available now; process baseline RSS (GiB, subtracted): {base}\n")
    print(table(rows, ckpt_bytes, args.device))
    if args.cleanup:
        shutil.rmtree(ckpt)


if __name__ == "__main__":
    main()

"""Helpers shared by the benchmarks: process memory, the page cache, watched subprocesses, random checkpoints, and
which attention kernel ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

GiB = 2**30


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """Memory lines of /proc/PID/status in bytes (VmRSS, VmHWM = peak resident, RssAnon, RssFile)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[key] = int(value.split()[0]) * 1024
    return out


class PeakSampler:
    """The highest value of a /proc/self/status line (RssAnon by default) while the `with` block runs, read every
    `interval` seconds on a thread.

    VmHWM, the kernel's own high-water mark, counts file-backed pages too (a memory-mapped checkpoint read once is
    resident but not owned), and says nothing about which part was the process's own memory; a reading after the
    block misses what was freed before it ended. Sampling sees the transient. Peaks shorter than `interval` can still
    be missed: it is a lower bound, read beside VmHWM."""

    def __init__(self, key: str = "RssAnon", interval: float = 0.005):
        self.key, self.interval = key, interval
        self.peak, self.samples = 0, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _read(self) -> None:
        self.peak = max(self.peak, proc_status()[self.key])
        self.samples += 1

    def _watch(self) -> None:
        while not self._done.wait(self.interval):
            self._read()

    def __enter__(self) -> PeakSampler:
        self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self._read()


def mem_available() -> int:
    """Memory the kernel can hand out without swapping (free plus reclaimable page cache), in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def read_files(files: list[Path], chunk: int = 64 * 2**20) -> float:
    """Read the files start to end into one reused buffer (no memory growth); seconds taken.

    Run once to pull the files into the page cache, then again to time the lower bound of any loader: bytes moved
    from the page cache into the process, with no parsing, no allocation and no conversion.
    """
    buf = bytearray(chunk)
    view = memoryview(buf)
    start = time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
    return time.perf_counter() - start


def run_watched(cmd: list[str], min_available: int = GiB, timeout: float = 3600) -> tuple[int, str, str, int]:
    """Run a command while watching system memory; kill it before it can take memory other processes need.

    Returns (exit code, stdout, a note if we killed it, the highest RSS seen). The OOM killer would otherwise pick
    any large process on a shared machine, not necessarily the one at fault.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    note, peak = "", 0
    done = threading.Event()

    def watch() -> None:
        nonlocal note, peak
        while not done.wait(0.05):
            try:
                peak = max(peak, proc_status(proc.pid).get("VmRSS", 0))
            except (FileNotFoundError, ProcessLookupError):
                return
            if mem_available() < min_available:
                note = f"killed at {peak / GiB:.1f} GiB resident: system memory nearly exhausted"
                proc.kill()
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        note = f"killed after {timeout:.0f} s timeout"
    done.set()
    watcher.join()
    if proc.returncode == -9 and not note:
        note = "killed by the kernel (out of memory)"
    return proc.returncode, out, note, peak


def write_random_checkpoint(cfg, out_dir: Path, shard_bytes: int = 5 * GiB, seed: int = 0) -> Path:
    """A checkpoint of `cfg`'s exact shapes in Hugging Face layout, filled with small random values, written fast.

    Tensors are produced piece by piece from a 64 MiB pool of random values (shifted per tensor, so no two are
    equal) and streamed into the safetensors files, so memory stays flat even for 16 GB. config.json is written last
    and marks a complete checkpoint; an interrupted run leaves no config.json and starts over.
    """
    from llama_scratch.checkpoints.hf_layout import ours_to_hf
    from llama_scratch.model.llama import Llama

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").unlink(missing_ok=True)
    with torch.device("meta"):
        model = Llama(cfg)
    specs = [(ours_to_hf(n), tuple(p.shape)) for n, p in model.named_parameters()]
    itemsize = cfg.dtype.itemsize
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in specs:
        nbytes = torch.Size(shape).numel() * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if len(shards) == 1:
        names = ["model.safetensors"]
    gen = torch.Generator().manual_seed(seed)
    pool = (torch.randn(32 * 2**20, generator=gen) * 0.02).to(cfg.dtype)
    dtype_tag = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[cfg.dtype]
    weight_map = {}
    for k, (shard, file_name) in enumerate(zip(shards, names, strict=True)):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in shard:
            nbytes = torch.Size(shape).numel() * itemsize
            header[name] = {"dtype": dtype_tag, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file_name
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
        tmp = out_dir / f".{file_name}.tmp"
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for i, (_name, shape) in enumerate(shard):
                numel = torch.Size(shape).numel()
                if len(shape) == 1:  # norm gains: near one, as in a trained model
                    f.write((1 + pool[:numel].float()).to(cfg.dtype).view(torch.uint8).numpy().tobytes())
                    continue
                shift = (k * 7919 + i * 104729) % pool.numel()
                rolled = torch.roll(pool, shift).view(torch.uint8).numpy()
                left = numel * itemsize
                while left:
                    n = min(left, rolled.nbytes)
                    f.write(memoryview(rolled)[:n])
                    left -= n
        os.replace(tmp, out_dir / file_name)
    if len(shards) > 1:
        total = sum(torch.Size(s).numel() * itemsize for _, s in specs)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out_dir / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    return out_dir


def checkpoint_files(ckpt: Path) -> list[Path]:
    from llama_scratch.checkpoints.hf_layout import find_checkpoint_files

    return find_checkpoint_files(ckpt)


def python_cmd(script: str | Path, *args: str) -> list[str]:
    return [sys.executable, str(script), *args]


# The operators scaled_dot_product_attention dispatches to, one per backend (what torch.profiler names them).
SDPA_OPS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash-cpu",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
# Words in the names of CUDA attention kernels (flash's, cutlass's memory-efficient "fmha", cuDNN's), as evidence.
_KERNEL_WORDS = ("flash", "fmha", "cudnn", "attention", "sdpa")


def attention_backends(run: Callable[[], object], device: torch.device) -> dict:
    """Which backend scaled_dot_product_attention really used while `run()` ran (one training step, say).

    Asked of the profiler, not of the `torch.backends.cuda.*_sdp_enabled()` switches, which say what is allowed, not
    what a call's shapes, dtype and mask got: each backend is its own operator, so the operators that ran tell. A
    run can use several (the classifier's last block passes a mask, the blocks below it none): "backend" joins them
    by "+", most calls first; "calls" counts forward calls per backend; "kernels" lists the CUDA kernels whose names
    look like attention's, for the record. A profiler that fails leaves backend "unknown" and the error.
    """
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        with torch.profiler.profile(activities=activities) as prof:
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        events = prof.events()
    except torch.OutOfMemoryError:  # the step's own failure, not the profiler's
        raise
    except RuntimeError as e:  # CUPTI missing or busy: the evidence is lost, not the run (the caller checks it ran)
        return {"backend": "unknown", "calls": {}, "kernels": [], "launches": None, "error": f"profiler: {e}"}
    calls = Counter(SDPA_OPS[e.name] for e in events if e.name in SDPA_OPS)
    on_device = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA]  # kernels, not ops
    kernels = sorted({name for name in on_device if any(w in name.lower() for w in _KERNEL_WORDS)})
    backend = "+".join(name for name, _ in calls.most_common()) or "none seen"
    launches = len(on_device) if device.type == "cuda" else None  # kernels, copies and fills on the device
    kernels = [k[:120] for k in kernels[:8]]
    return {"backend": backend, "calls": dict(calls), "kernels": kernels, "launches": launches, "error": None}

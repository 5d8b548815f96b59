"""Which device and dtype to compute on, and how much memory there is: the questions every command asks first.

bfloat16 is the default where the hardware computes it natively (recent GPUs); on a CPU bfloat16 matmuls are
many times slower than float32, so CPU runs compute in float32, unless the float32 copy of the weights would
not fit in memory, in which case the checkpoint's own dtype is kept (slow beats impossible).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from ..model.config import parse_dtype


class DeviceError(ValueError):
    """A device that this machine does not have; the message says what to use instead."""


def resolve_device(name: str | None) -> torch.device:
    """`auto` (or None): the GPU if there is one, else the CPU. An unavailable device is one clear error."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"--device {name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise DeviceError(f"--device {name}: no CUDA GPU is visible; use --device cpu")
        if device.index is not None and device.index >= count:
            raise DeviceError(f"--device {name}: only {count} CUDA GPU(s) are visible (cuda:0 to cuda:{count - 1})")
    elif device.type not in ("cpu", "cuda"):
        raise DeviceError(f"--device {name}: only cpu and cuda devices are supported")
    return device


def memory_budget(device: torch.device, fraction: float = 0.25) -> int:
    """A share of the device's total memory (the cache and the default-model choice each take one)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory * fraction)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * fraction)


def free_memory(device: torch.device) -> int:
    """Bytes that could still be allocated on the device now (after the weights are loaded, say)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # ours, held unused
    try:  # Linux: MemAvailable counts the page cache the kernel can give back (memory-mapped weights included)
        meminfo = Path("/proc/meminfo").read_text()
        return int(re.search(r"MemAvailable:\s+(\d+) kB", meminfo).group(1)) * 1024
    except (OSError, AttributeError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):  # macOS has no such count: all of memory, so the budget alone decides
        return memory_budget(device, fraction=1.0)


def choose_dtype(
    name: str, device: torch.device, stored: torch.dtype | None = None, n_params: int = 0, log=print
) -> torch.dtype:
    """The compute dtype for `--dtype name`: an explicit name as given; `auto` bfloat16 on a GPU that computes it
    natively, else float32, except that a float32 copy of `n_params` weights stored as `stored` that would not fit
    in what is free keeps the stored dtype, and says so."""
    if name != "auto":
        return parse_dtype(name)
    if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.bfloat16
    if stored is not None and stored != torch.float32 and n_params * 4 > free_memory(device) * 0.9:
        log(
            f"dtype: {str(stored).removeprefix('torch.')}, as stored: a float32 copy of {n_params / 1e9:.1f}B "
            f"weights ({n_params * 4 / 2**30:.1f} GiB) would not fit in the "
            f"{free_memory(device) / 2**30:.1f} GiB free (pass --dtype float32 to insist)"
        )
        return stored
    return torch.float32


def make_deterministic() -> None:
    """Bit-exact reruns and resumes on a GPU: deterministic kernels only (an error names any op without one),
    cuBLAS with a fixed workspace, no cuDNN autotuning. Slower; CPU runs are deterministic already. Call before the
    first CUDA work."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False

"""Which fused attention kernel a call asks for, and whether it can share key/value heads: `sdpa`, the package's
one call of `scaled_dot_product_attention`.

The network (`llama.Attention`) only says what to compute: queries, keys, values, which keys each query sees (a
mask, or plain causal). How fast that runs depends on which of torch's kernels takes the call, and that choice
has two levers, both here:

- **The order the kernels are tried in** (`CUDA_KERNEL_ORDER`). Recent torch tries cuDNN's kernel first on recent
  GPUs, and cuDNN builds an execution plan for each new shape: tens of milliseconds of host time the first time a
  length is seen, as fast as flash once it is planned. Training batches are packed to their longest text and
  generation adds a key each token, so nearly every call has a new length: the package asks for flash first, then
  the memory-efficient kernel; cuDNN only where neither takes the call; the math kernel last (it materialises the
  float32 T x T scores of every head).
- **Repeating key/value heads or letting the kernel share them** (`kernel_shares_heads`). Grouped-query attention
  has fewer key/value heads than query heads; a kernel that shares them itself (`enable_gqa`) spares a copy of k
  and v per query head, but on a GPU only flash accepts that, and flash takes no mask and half precision only.
  Anything else with `enable_gqa` falls to the math kernel, so there the heads are repeated first.

The measurements behind both (the per-shape planning cost, the tokens/s before and after, the kernels each setting
ran) are in benchmarks/RESULTS.md, "cuDNN attention against flash (the fix)" and the H200 run above it.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# The fused attention kernels in the order a CUDA call asks for them: flash costs nothing per new shape, cuDNN
# plans each new one on the host (above); math last.
CUDA_KERNEL_ORDER = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.MATH,
]


def kernel_order(device: torch.device) -> contextlib.AbstractContextManager:
    """CUDA_KERNEL_ORDER for a call on a CUDA device; nothing elsewhere (the CPU has flash and math only, and
    entering the context costs tens of microseconds a call there)."""
    return sdpa_kernel(CUDA_KERNEL_ORDER, set_priority=True) if device.type == "cuda" else contextlib.nullcontext()


def kernel_shares_heads(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether `enable_gqa` keeps this call on a fast kernel, so k and v need not be repeated.

    On a GPU (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, torch 2.5 to 2.11), among the fused kernels
    only flash attention accepts fewer key/value heads than query heads, and flash takes no mask, float16 and
    bfloat16 only, on sm80 and newer. The memory-efficient kernel refuses grouped heads (until a change after
    torch 2.11), and cuDNN takes them but not every shape (and comes after flash: CUDA_KERNEL_ORDER). So on a GPU: no
    mask, half precision, sm80+: flash serves it. Anything else with `enable_gqa` would fall to the math kernel
    (float32 T x T scores per head): a masked call (a KV cache's, query rows', packed texts' last tokens), float32,
    an older GPU. The CPU's flash kernel takes grouped heads in every dtype; masked calls repeat there too, so that
    the CPU runs the paths a GPU runs. Other devices: repeat. (Which kernel each setting ran, and how much faster
    sharing was where it applies: benchmarks/RESULTS.md.)
    """
    if mask is not None or q.device.type not in ("cpu", "cuda"):
        return False
    if q.device.type == "cpu":
        return True
    return q.dtype in (torch.float16, torch.bfloat16) and torch.cuda.get_device_capability(q.device) >= (8, 0)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
    """Softmax of scaled query-key scores, times the values: q [B, heads, Q, head_dim], k and v
    [B, kv_heads, keys, head_dim] -> [B, heads, Q, head_dim].

    Query heads share key/value heads (grouped-query attention). Either the kernel shares them itself
    (`enable_gqa`) or each key/value head is repeated for its query heads first, as chapter 3 does by hand: a copy
    of k and v per query head, but a call every fast kernel takes. `kernel_shares_heads` says which; the outputs
    are the same either way.
    """
    grouped = k.shape[1] != q.shape[1]
    shared = grouped and kernel_shares_heads(q, mask)
    if grouped and not shared:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    with kernel_order(q.device):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=shared)

"""A frozen weight in 4 or 8 bits: NF4 (QLoRA's 4-bit NormalFloat) and int8, and the linear layer that holds one.

A frozen base model is read, never trained, so its weights need only be good enough to compute with. Storing
them in fewer bits shrinks the model; each forward dequantizes a layer's weight to the compute dtype just
before its matmul (F.linear), so the arithmetic is unchanged and only the weight's values are approximate.

NF4 (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs"). Trained weights are close to
normally distributed, so the 16 levels of a 4-bit code are placed where a normal distribution puts equal
probability mass (its quantiles), not evenly. The weight is cut into blocks of 64 consecutive values along each
row; each block is divided by its absolute maximum (its scale), so every value lies in [-1, 1], and each value is
replaced by the index (0..15) of the nearest level. Two indices are packed into one byte, the first in the high
nibble (bitsandbytes' and torchao's layout). Dequantizing is one table look-up and one multiply:
w ~= NF4[index] * scale. Cost: 4 bits per value plus one float32 scale per 64 values = 4.5 bits (QLoRA's
"double quantization", 8-bit scales, would make it 4.127; not done here: 0.4 bits for a second code path).

int8: one symmetric scale per output row (absmax / 127), each value rounded to the nearest of -127..127.
8 bits plus one float32 per row: twice NF4's size, about 10x less error.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The 16 NF4 levels, exactly as bitsandbytes (functional.get_4bit_type("nf4")) and the QLoRA paper define them:
# quantiles of N(0, 1), computed separately for the negative half (8 levels, -1 included) and the positive half
# (9 levels, 1 included) so that 0 is one level, exact (padding and zero weights stay zero), then divided by the
# largest so they span [-1, 1]. torchao's NF4Tensor uses the same values rounded to 4 decimals.
NF4 = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ]
)
# The nearest level of x is the number of midpoints below it: one bucketize instead of 16 distances per value.
NF4_MIDPOINTS = (NF4[1:] + NF4[:-1]) / 2
BLOCK = 64  # values per NF4 scale (QLoRA's choice)
KINDS = ("nf4", "int8")


def quantize_nf4(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] weight -> (codes [out, in / 2] uint8, two indices per byte, scales [out, in / block] float32)."""
    out_features, in_features = w.shape
    if in_features % block:
        raise ValueError(f"NF4 needs rows of a multiple of {block} values, got {in_features}")
    x = w.float().reshape(out_features, in_features // block, block)
    scales = x.abs().amax(-1)
    # An all-zero block has scale 0: dividing by a tiny number instead keeps it 0 (index 7), not 0/0 = NaN.
    normed = x / scales.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    index = torch.bucketize(normed, NF4_MIDPOINTS.to(w.device)).reshape(out_features, in_features)
    codes = (index[:, 0::2] << 4 | index[:, 1::2]).to(torch.uint8)
    return codes, scales


_NF4_ON: dict[torch.device, torch.Tensor] = {}


def nf4_levels(device: torch.device) -> torch.Tensor:
    """The 16 levels on `device`, copied there once. A copy in every forward would be a copy from ordinary host
    memory, which makes the host wait for the GPU: one wait a step per quantized layer (benchmarks/gpu_check.py
    counts a step's host syncs)."""
    if device not in _NF4_ON:
        _NF4_ON[device] = NF4.to(device)
    return _NF4_ON[device]


def dequantize_nf4(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(codes, scales) from `quantize_nf4` -> the [out, in] weight in `dtype`, computed in float32."""
    index = torch.stack([codes >> 4, codes & 0xF], dim=-1).reshape(codes.shape[0], -1).long()  # unpack, in order
    values = nf4_levels(codes.device)[index]
    block = values.shape[1] // scales.shape[1]
    return (values.view(scales.shape[0], scales.shape[1], block) * scales[..., None]).reshape(values.shape).to(dtype)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] weight -> (int8 values [out, in], scales [out, 1] float32): symmetric, one scale per output row."""
    x = w.float()
    scales = x.abs().amax(-1, keepdim=True) / 127
    q = (x / scales.clamp_min(torch.finfo(torch.float32).tiny)).round().clamp(-127, 127)
    return q.to(torch.int8), scales


def dequantize_int8(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (values.float() * scales).to(dtype)


def dequantize(kind: str, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The [out, in] weight that a `kind` layer's (codes, scales) stand for, in `dtype`."""
    return dequantize_nf4(codes, scales, dtype) if kind == "nf4" else dequantize_int8(codes, scales, dtype)


def storage(kind: str, out_features: int, in_features: int) -> tuple[tuple, torch.dtype, tuple]:
    """(codes' shape, codes' dtype, scales' shape) of a quantized [out, in] weight."""
    if kind == "nf4":
        return (out_features, in_features // 2), torch.uint8, (out_features, in_features // BLOCK)
    if kind == "int8":
        return (out_features, in_features), torch.int8, (out_features, 1)
    raise ValueError(f"quantize is one of {', '.join(KINDS)}, not {kind!r}")


class FrozenQuantizedLinear(torch.autograd.Function):
    """y = F.linear(x, W) for a frozen W held as (codes, scales): what autograd keeps for backward is the
    quantized form, never W itself.

    Through plain autograd, F.linear(x, dequantize(codes, scales)) saves the dequantized W for x's gradient: a
    fresh [out, in] tensor in the compute dtype per layer, alive from the layer's forward until its backward, so
    a QLoRA model would hold a full-precision copy of every adapted block's weights during a step, the very memory
    quantizing saves. Here forward saves the buffers themselves (no new memory) and backward dequantizes again,
    then grad_x = grad_y W: one more dequantization per layer in exchange (torchao's `linear_nf4` does the same).
    W is frozen, so no weight gradient. The same dequantization and the same matmuls as the plain path: outputs and
    input gradients are bit-identical to it (tests/model/test_quantize.py).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, kind: str) -> torch.Tensor:
        ctx.kind = kind  # the kind, not a dequantizing function: a plain constant for torch.compile to trace
        ctx.save_for_backward(codes, scales)
        return F.linear(x, dequantize(kind, codes, scales, x.dtype))

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        codes, scales = ctx.saved_tensors
        return grad_y @ dequantize(ctx.kind, codes, scales, grad_y.dtype), None, None, None


class QuantizedLinear(nn.Module):
    """A frozen bias-free linear layer whose weight is held quantized: buffers `codes` and `scales` (nothing to
    train: no parameters). Its forward dequantizes the weight to the input's dtype, then F.linear; its backward
    dequantizes it again (FrozenQuantizedLinear), so autograd keeps the codes, never the dequantized weight.

    Created empty (possibly on the meta device, as the streaming loader does: `fill_rows` then quantizes the
    weight a few rows at a time as they are read), or from a weight (`from_weight`, `from_linear`).
    `compute_dtype` is the dtype of the weight it stands for: LoRA adapters on top are created in it.
    """

    def __init__(self, in_features: int, out_features: int, kind: str, compute_dtype: torch.dtype, device=None):
        super().__init__()
        codes_shape, codes_dtype, scales_shape = storage(kind, out_features, in_features)
        if kind == "nf4" and in_features % BLOCK:
            raise ValueError(f"NF4 needs rows of a multiple of {BLOCK} values, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.kind, self.compute_dtype = kind, compute_dtype
        self.register_buffer("codes", torch.empty(codes_shape, dtype=codes_dtype, device=device))
        self.register_buffer("scales", torch.empty(scales_shape, dtype=torch.float32, device=device))

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of the weight it holds, [out, in] (what a checkpoint stores under its name)."""
        return (self.out_features, self.in_features)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, kind: str) -> QuantizedLinear:
        layer = cls(weight.shape[1], weight.shape[0], kind, weight.dtype, device=weight.device)
        layer.fill_rows(0, weight)
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, kind: str) -> QuantizedLinear:
        """The layer quantized; a layer on the meta device gives an empty one there, to be filled by the loader."""
        if linear.bias is not None:
            raise ValueError("QuantizedLinear holds no bias (Llama's projections have none)")
        if linear.weight.is_meta:
            return cls(linear.in_features, linear.out_features, kind, linear.weight.dtype, device="meta")
        return cls.from_weight(linear.weight.detach(), kind)

    @torch.no_grad()
    def fill_rows(self, start: int, rows: torch.Tensor) -> None:
        """Quantize weight rows [start, start + len(rows)) into place: the loader streams a weight in row chunks,
        so the full-precision weight never exists whole."""
        codes, scales = quantize_nf4(rows) if self.kind == "nf4" else quantize_int8(rows)
        self.codes[start : start + len(rows)] = codes
        self.scales[start : start + len(rows)] = scales

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The [out, in] weight the layer computes with, in `dtype` (default: `compute_dtype`): export, merge."""
        return dequantize(self.kind, self.codes, self.scales, dtype or self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The whole weight is dequantized for each call: a transient [out, in] tensor, freed after the matmul, and
        # dequantized again in backward (FrozenQuantizedLinear), so autograd holds only the codes and scales.
        if self.kind == "nf4":
            # The code book's first copy to a device is a side effect torch.compile cannot keep inside a Function:
            # made here, outside it, the Function only reads it.
            nf4_levels(self.codes.device)
        return FrozenQuantizedLinear.apply(x, self.codes, self.scales, self.kind)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


def quantize_linears(model: nn.Module, kind: str, keep_last: int = 0) -> list[str]:
    """Swap the frozen linear layers of a `Llama` for QuantizedLinear, in place: every linear in every block but
    the last `keep_last` (blocks that train whole stay in full precision), and the LM head unless it is the tied
    embedding. The embedding and the norms stay as they are. On the meta device the new layers are empty, for the
    streaming loader to fill; materialized layers are quantized now. Returns the swapped modules' names."""
    storage(kind, 1, BLOCK)  # an unknown kind fails here, before anything changes
    blocks = model.blocks
    if not 0 <= keep_last <= len(blocks):
        raise ValueError(f"keep_last must be between 0 and {len(blocks)}, got {keep_last}")
    swapped = []
    parents = [(f"blocks.{i}", blocks[i]) for i in range(len(blocks) - keep_last)]
    for prefix, block in parents:
        for name, module in list(block.named_modules()):
            for child_name, child in list(module.named_children()):
                if type(child) is nn.Linear:
                    setattr(module, child_name, QuantizedLinear.from_linear(child, kind))
                    swapped.append(".".join(p for p in (prefix, name, child_name) if p))
    head = getattr(model, "lm_head", None)
    if type(head) is nn.Linear and head.weight is not model.embed_tokens.weight:
        model.lm_head = QuantizedLinear.from_linear(head, kind)
        swapped.append("lm_head")
    return swapped


def dequantize_linears(model: nn.Module) -> nn.Module:
    """Every QuantizedLinear back to a frozen nn.Linear holding its dequantized weight (in its compute dtype), in
    place: a model `save_checkpoint` and transformers can read (the quantization error stays in its weights)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantizedLinear):
                plain = nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
                plain.weight = nn.Parameter(child.dequantized(), requires_grad=False)
                setattr(parent, name, plain)
    return model

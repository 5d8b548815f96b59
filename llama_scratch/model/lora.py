"""LoRA: fine-tune a big linear layer by learning a small, low-rank change to its weight.

A linear layer computes h = W x, with W of shape [out, in]. Fine-tuning W itself trains out x in numbers per
layer and keeps as many gradients and optimizer moments. LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of
Large Language Models") freezes W and learns the change as a product of two thin matrices:

    h = W x + (alpha / r) B A x          A: [r, in]   B: [out, r]   r much smaller than in and out

so the layer trains r x (in + out) numbers: for a 576 x 576 projection at r = 8, 9,216 instead of 331,776.

- B starts at zero, so B A = 0 and the adapted model starts exactly where the pretrained one is.
- A starts random (as in PEFT, Kaiming-uniform). If it were zero too, B's gradient, grad_h (A x)^T, would be
  zero and nothing would ever move.
- alpha / r scales the change. We default alpha to 2 r, so the scale is 2 at every rank. The LoRA paper keeps
  alpha fixed as r varies instead (set to the first r tried, then not tuned), so that alpha / r shrinks as r grows
  and less needs retuning when r changes; rsLoRA (Kalajdzievski 2023) finds 1 / r too small at large ranks and
  scales by alpha / sqrt(r). With our constant scale, retune the learning rate (or fix alpha) when the rank
  changes.
- Dropout, if asked, applies to the adapter's input only: the frozen path W x sees the text unchanged.

After training, (alpha / r) B A is just an [out, in] matrix: `merge` adds it to W once, and the layer is a plain
`nn.Linear` again, as fast as the original and saved in the base model's own format (see `merge_lora`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .quantize import QuantizedLinear

# Short names for the seven projections of a Llama block, and where each lives inside `model.Block`.
TARGETS = {
    "q": "attention.q_proj",
    "k": "attention.k_proj",
    "v": "attention.v_proj",
    "o": "attention.o_proj",
    "gate": "ffn.gate_proj",
    "up": "ffn.up_proj",
    "down": "ffn.down_proj",
}


@dataclass(frozen=True)
class LoRASettings:
    """Which adapters to add: rank r, alpha (None: 2 r), dropout on the adapters' input, target projections."""

    rank: int
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] = tuple(TARGETS)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"the LoRA rank must be at least 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"the LoRA dropout must be in [0, 1), got {self.dropout}")
        object.__setattr__(self, "targets", parse_targets(self.targets))
        object.__setattr__(self, "alpha", float(2 * self.rank if self.alpha is None else self.alpha))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def parse_targets(targets: str | Iterable[str]) -> tuple[str, ...]:
    """'q,k,v' (or a list of names) -> ('q', 'k', 'v') in the block's order; an unknown name is a clear error."""
    names = [t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets) if t.strip()]
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        raise ValueError(f"LoRA targets are among {','.join(TARGETS)}; got {','.join(names) or 'none'}")
    return tuple(t for t in TARGETS if t in names)


def new_adapters(rank: int, n_in: int, n_out: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A [rank, in] drawn Kaiming-uniform (PEFT's initialisation, nn.Linear's default) and B [out, rank] zero.
    The one place they are drawn, always from the CPU's generator (then moved): a sharded run draws them on the
    CPU (sharding.fresh_values), and a single process on a GPU starts from the same adapters."""
    if torch.device(device).type == "meta":
        return torch.empty(rank, n_in, dtype=dtype, device=device), torch.empty(n_out, rank, dtype=dtype, device=device)
    a = torch.empty(rank, n_in, dtype=dtype, device="cpu")
    nn.init.kaiming_uniform_(a, a=math.sqrt(5))
    return a.to(device), torch.zeros(n_out, rank, dtype=dtype, device=device)


class LoRALinear(nn.Linear):
    """A frozen `nn.Linear` plus a trainable low-rank change: h = W x + b + scale * B A dropout(x).

    It subclasses nn.Linear and holds the wrapped layer's own `weight` (and `bias`) Parameter, not a copy, under
    the same name: the base weights keep their names in a state dict, and the adapters are added beside them as
    `lora_a` [rank, in] and `lora_b` [out, rank], created on the weight's device and in its dtype.

    QLoRA: the wrapped layer may be a `QuantizedLinear` (a 4-bit or int8 frozen weight). It is then kept whole as
    the submodule `quantized` (its buffers `quantized.codes`, `quantized.scales`), `weight` and `bias` are None,
    and the adapters are created in its compute dtype: W x is computed from the dequantized weight, B A x as ever.
    """

    def __init__(self, base: nn.Linear | QuantizedLinear, rank: int, alpha: float, dropout: float = 0.0):
        nn.Module.__init__(self)  # not nn.Linear.__init__: that would allocate a second weight
        self.in_features, self.out_features = base.in_features, base.out_features
        if isinstance(base, QuantizedLinear):
            self.quantized: QuantizedLinear | None = base
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
            dtype, device = base.compute_dtype, base.codes.device
        else:
            self.quantized = None
            self.weight, self.bias = base.weight, base.bias
            self.weight.requires_grad_(False)
            if self.bias is not None:
                self.bias.requires_grad_(False)
            dtype, device = base.weight.dtype, base.weight.device
        a, b = new_adapters(rank, self.in_features, self.out_features, dtype, device)
        self.lora_a, self.lora_b = nn.Parameter(a), nn.Parameter(b)
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low_rank = F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b)  # B (A x): never forms B A
        frozen = self.quantized(x) if self.quantized is not None else F.linear(x, self.weight, self.bias)
        return frozen + self.scale * low_rank

    @torch.no_grad()
    def merge(self) -> nn.Linear:
        """Fold scale * B A into `weight` (in place: the same Parameter) and return a plain nn.Linear holding it.

        B A is formed in float32 and rounded once into the weight's dtype. B is then zeroed, so this layer, if
        still called, computes what the merged one does and a second merge adds nothing. Over a quantized base,
        the merged weight is the dequantized one plus B A, a new Parameter in the compute dtype (adding B A to
        4-bit codes would round it away); this layer then still computes with the quantized weight.
        """
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        if self.quantized is not None:
            base = self.quantized.dequantized(torch.float32)
            merged = merged_weight(base, self.lora_a, self.lora_b, self.scale).to(self.quantized.compute_dtype)
            plain.weight = nn.Parameter(merged, requires_grad=False)
        else:
            self.weight.copy_(merged_weight(self.weight, self.lora_a, self.lora_b, self.scale))
            plain.weight, plain.bias = self.weight, self.bias
        self.lora_b.zero_()
        return plain

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha:g}"


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a `Llama`, a `LlamaClassifier` (its backbone's) or a list of blocks itself."""
    model = getattr(model, "backbone", model)
    return model.blocks if hasattr(model, "blocks") else model


def add_lora(
    model: nn.Module,
    rank: int | LoRASettings,
    alpha: float | None = None,
    dropout: float = 0.0,
    targets: str | Iterable[str] = tuple(TARGETS),
    blocks: Iterable[int] | None = None,
) -> list[int]:
    """Replace the `targets` projections of the chosen `blocks` (indices; None: all) by LoRALinear layers.

    The wrapped weights are frozen and the adapters trainable; nothing else changes its requires_grad (the
    classifier decides what else trains). `rank` may be a LoRASettings instead of the four values. Returns the
    adapted block indices, sorted. Add adapters after loading the base weights: a base checkpoint has no
    lora_a or lora_b to load.
    """
    s = rank if isinstance(rank, LoRASettings) else LoRASettings(rank, alpha, dropout, parse_targets(targets))
    all_blocks = blocks_of(model)
    chosen = sorted(set(range(len(all_blocks)) if blocks is None else blocks))
    if chosen and not 0 <= chosen[0] <= chosen[-1] < len(all_blocks):
        raise ValueError(f"LoRA blocks must be between 0 and {len(all_blocks) - 1}, got {chosen}")
    for i in chosen:
        for target in s.targets:
            parent_name, name = TARGETS[target].split(".")
            parent = all_blocks[i].get_submodule(parent_name)
            layer = getattr(parent, name)
            if isinstance(layer, LoRALinear):
                raise ValueError(f"block {i}'s {name} already has a LoRA adapter")
            setattr(parent, name, LoRALinear(layer, s.rank, s.alpha, s.dropout))
    return chosen


def lora_layers(model: nn.Module) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B A, in float32 (in bfloat16 the small update would round away); the caller rounds it once.

    weight [out, in], lora_a [rank, in], lora_b [out, rank]. `export_hf` merges checkpoint tensors with it too."""
    return weight.float() + scale * (lora_b.float() @ lora_a.float())


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight and put plain nn.Linear layers back: the base model's names and shapes,
    ready for `save_checkpoint` and any reader of the Hugging Face format. Changes `model` in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                setattr(parent, name, child.merge())
    return model

"""How many parameters a classifier holds and trains, counted on the meta device: no memory is allocated, so
Llama-3-70B is counted as fast as the tiny preset. The memory plan (planning/), the default model's choice and the
dtype's choice (sources/) all count through here."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .classifier import LlamaClassifier
from .config import LlamaConfig
from .llama import Llama
from .lora import LoRASettings
from .quantize import QuantizedLinear


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of the classifier (tied weights once), from the model on the meta device."""

    total: int  # backbone + adapters + head
    backbone: int  # the base model's own parameters
    head: int
    trainable: int
    block: int  # one transformer block (without adapters)
    block_trained: int  # of a trained block: all of it, or its adapters only
    down_trained: int  # of a trained block's down projection (its first gradient in backward)
    ffn_trained: int  # of its feed-forward and its norm: the gradients that come before attention's
    below_attention_trained: int  # of its q, k, v and attention norm: the gradients that come after attention's
    embedding: int
    largest_trainable: int  # elements of the largest trainable tensor
    buffer_bytes: int  # the rotary tables (float32, not in the checkpoint)
    # (out, in) of each frozen linear weight of the backbone: the projections of frozen blocks, the base weights
    # under LoRA adapters, an untied lm_head. What --quantize holds in 4 or 8 bits; embeddings, norms, the head and
    # a tied lm_head (the embedding) stay in the parameter dtype.
    frozen_linears: tuple[tuple[int, int], ...]
    largest_frozen_block_linear: int  # elements of the largest of them a forward runs (not the lm_head)


def count_parameters(
    cfg: LlamaConfig,
    train_last: int | None = 1,
    num_classes: int = 2,
    lora: LoRASettings | None = None,
    shards: int = 1,
) -> ParamCounts:
    """Build the classifier on the meta device (no memory) and count what it holds and what trains.

    `shards` > 1: what one of that many processes holds under FSDP2, which cuts every parameter, frozen ones too, by
    rows: ceil(rows / shards) rows each, the last processes' shares padded to that size. Then `total`, `trainable`,
    `head`, `block_trained`, `down_trained`, `ffn_trained`, `below_attention_trained` and `largest_trainable`
    are one process's share; `backbone`, `block` and
    `embedding` stay whole (what is gathered to compute a block or the embedding)."""
    with torch.device("meta"):
        clf = LlamaClassifier(Llama(cfg), num_classes=num_classes, train_last=train_last, lora=lora)

    def numel(p: torch.Tensor) -> int:
        if shards == 1 or p.ndim == 0:
            return p.numel()
        return -(-p.shape[0] // shards) * (p.numel() // p.shape[0])

    trainable = list(clf.trainable_parameters().values())
    base = {n: p for n, p in clf.backbone.named_parameters() if not n.endswith(("lora_a", "lora_b"))}
    top = clf.backbone.blocks[-1]
    linears = frozen_linears(clf)
    in_blocks = [o * i for name, (o, i) in linears.items() if name.startswith("blocks.")]
    return ParamCounts(
        total=sum(numel(p) for p in clf.parameters()),
        backbone=sum(p.numel() for p in base.values()),
        head=numel(clf.head.weight),
        trainable=sum(numel(p) for p in trainable),
        block=sum(p.numel() for n, p in base.items() if n.startswith(f"blocks.{cfg.n_layers - 1}.")),
        block_trained=sum(numel(p) for p in top.parameters() if p.requires_grad),
        down_trained=sum(numel(p) for p in top.ffn.down_proj.parameters() if p.requires_grad),
        ffn_trained=sum(numel(p) for m in (top.ffn, top.ffn_norm) for p in m.parameters() if p.requires_grad),
        below_attention_trained=sum(
            numel(p)
            for m in (top.attention.q_proj, top.attention.k_proj, top.attention.v_proj, top.attention_norm)
            for p in m.parameters()
            if p.requires_grad
        ),
        embedding=clf.backbone.embed_tokens.weight.numel(),
        largest_trainable=max((numel(p) for p in trainable), default=0),
        buffer_bytes=sum(b.numel() * b.element_size() for b in clf.backbone.buffers()),
        frozen_linears=tuple(linears.values()),
        largest_frozen_block_linear=max(in_blocks, default=0),
    )


def frozen_linears(clf: LlamaClassifier) -> dict[str, tuple[int, int]]:
    """Name -> (out, in) of the backbone's frozen linear weights, a LoRA layer's base weight among them. A tied
    lm_head is the embedding (not a linear's own weight) and the classification head is outside the backbone."""
    embedding = clf.backbone.embed_tokens.weight
    return {
        name: tuple(module.weight.shape)
        for name, module in clf.backbone.named_modules()
        if isinstance(module, nn.Linear) and not module.weight.requires_grad and module.weight is not embedding
    }


def held_parameters(model: nn.Module) -> tuple[int, int]:
    """(every parameter `model` holds, how many of them are held quantized). A QuantizedLinear keeps its weight as
    buffers (packed codes and scales), which `parameters()` leaves out: counted here as the out x in weights they
    stand for, so a --quantize run reports the model's size, not the part left in full precision."""
    quantized = sum(m.out_features * m.in_features for m in model.modules() if isinstance(m, QuantizedLinear))
    return sum(p.numel() for p in model.parameters()) + quantized, quantized

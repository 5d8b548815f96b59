"""The KV cache: keys and values of every position processed so far, per block, for generating token by token."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class BlockCache(NamedTuple):
    """One block's share of a `KVCache`: its key and value stores, and the position where x's first token goes
    (the positions to write, like gpt-fast's `input_pos` and Meta's `start_pos`)."""

    keys: torch.Tensor  # [B, kv_heads, max_len, head_dim]
    values: torch.Tensor
    start: int

    def write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' k and v [B, kv_heads, T, head_dim]; return the keys and values up to them."""
        end = self.start + k.shape[2]
        self.keys[:, :, self.start : end], self.values[:, :, self.start : end] = k, v
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """Keys and values of every position processed so far, per block: what makes generating a token cheap.

    A position's keys and values never change once computed (position t attends only to positions <= t). So
    generation runs the model on the new tokens only, and they attend to the stored keys and values of the
    earlier ones. `length` positions are filled; the model writes the next ones after them (a `Layout` made with
    this cache says where), then advances `length`.
    """

    def __init__(self, model: nn.Module, batch_size: int, max_len: int):
        """Stores for `batch_size` rows of up to `max_len` positions, in the dtype and on the device of `model`
        (a `Llama`: its `cfg` and its embedding's weight)."""
        cfg, param = model.cfg, model.embed_tokens.weight
        if max_len > cfg.max_seq_len:
            raise ValueError(f"{max_len} positions exceed the model's context of {cfg.max_seq_len}")
        shape = (batch_size, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.keys = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in range(cfg.n_layers)]
        self.values = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in range(cfg.n_layers)]
        self.length, self.max_len = 0, max_len

    def block(self, i: int) -> BlockCache:
        return BlockCache(self.keys[i], self.values[i], self.length)

"""Llama-3, top to bottom: the order in which a token's vector flows through the network.

token ids -> embedding -> n_layers x Block(RMSNorm -> attention -> add, RMSNorm -> feed-forward -> add)
          -> final RMSNorm -> output projection -> next-token logits

Weights use the Hugging Face layout, whose query/key rows are ordered so that rotary embedding rotates the
first half of each head against the second half (Meta's original code rotates interleaved pairs instead).

Two things attention needs live beside this file: how a batch's tokens are laid out (padded, packed texts, after a
KV cache: `layout.Layout`, made once per batch) and which fused kernel computes it (`attention_kernels.sdpa`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention_kernels import sdpa
from .config import LlamaConfig, RopeScaling
from .kv_cache import KVCache
from .layout import Layout


class RMSNorm(nn.Module):
    """Scale each vector to unit root-mean-square, then by a learned per-channel gain. No mean, no bias."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32: the mean of squares loses too much precision in bfloat16.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The rotation speed of each pair of channels, in radians per position (float32, head_dim // 2 values)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is None:
        return inv_freq
    # Llama-3.1: slow (long-wavelength) channels are slowed further by `factor` so that positions far beyond the
    # original training context still map to angles the model has seen; fast channels keep their speed, which
    # preserves local word order; channels in between are interpolated smoothly.
    wavelen = 2 * math.pi / inv_freq
    long_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    short_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > long_wavelen, inv_freq / scaling.factor, inv_freq)
    in_between = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
    return torch.where(in_between, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Cosine and sine tables for every position up to the context length, always float32.

    The tables are non-persistent buffers (not in the checkpoint). Casting a model to bfloat16 or moving it with
    `to_empty` would round or wipe them, so `_apply` recomputes them in float32 after any such conversion.
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim, self.theta, self.scaling, self.max_seq_len = (
            cfg.head_dim,
            cfg.rope_theta,
            cfg.rope_scaling,
            cfg.max_seq_len,
        )
        cos, sin = self._tables(device=None)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = rope_frequencies(self.head_dim, self.theta, self.scaling).to(device)
        positions = torch.arange(self.max_seq_len, dtype=torch.float32, device=device)
        angles = torch.outer(positions, inv_freq)  # [max_seq_len, head_dim // 2]
        return angles.cos(), angles.sin()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.cos.device.type != "meta":
            self.cos, self.sin = self._tables(self.cos.device)
        return self

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, head_dim // 2], ready to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel i of each head against channel i + head_dim/2 by the position's angle.

    After rotation, the dot product of a query and a key depends only on how far apart they are.
    """
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return rotated.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention: n_heads query heads share n_kv_heads key/value heads (a smaller KV cache).

    The one attention of the package: training, the classifier's last block (a layout's query rows) and generation
    (a layout's cache) all run this forward, so wrappers that act on module calls (LoRA, FSDP, checkpointing) see
    them all.
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False, dtype=cfg.dtype)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, dtype=cfg.dtype)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, dtype=cfg.dtype)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False, dtype=cfg.dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layout: Layout) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim], or [B, R, dim] at the layout's query rows.

        rope: cos and sin at x's positions. `layout` (layout.py) says how x's tokens are laid out: padded, packed
        texts, or after a cache's. Keys and values come from every position, but queries and everything after
        them are computed only at the rows the caller reads.
        """
        B, T, _ = x.shape
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, kv_heads, T, head_dim]
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        # One statement a step, each result replacing its input: what is no longer needed is freed at once.
        k = apply_rotary(k, *rope)
        k, v = layout.keys_values(k, v)  # after the cached ones (stored with them); packed texts apart
        x, rope = layout.at_query_rows(x, rope)  # queries only where the output is read
        q = self.q_proj(x).view(B, x.shape[1], self.n_heads, self.head_dim).transpose(1, 2)  # [B, heads, *, hd]
        q = apply_rotary(q, *rope)
        q = layout.queries(q)  # laid out as the keys are
        out = layout.back(sdpa(q, k, v, layout.mask, layout.is_causal))  # laid out as x is
        return self.o_proj(out.transpose(1, 2).reshape(B, x.shape[1], -1))


class FeedForward(nn.Module):
    """SwiGLU: a SiLU-activated gate multiplies a linear 'up' projection, then 'down' returns to model width."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False, dtype=cfg.dtype)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False, dtype=cfg.dtype)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False, dtype=cfg.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One transformer layer. Normalise before each sub-layer and add its output back to the residual stream."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.dtype)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.dtype)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layout: Layout) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim]; at the layout's query rows [B, R], only those rows: [B, R, dim]."""
        attended = self.attention(self.attention_norm(x), rope, layout)
        x = layout.at_rows(x)  # the residual stream too, and the feed-forward below, only at those rows
        x = x + attended
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    """The whole network: embedding, blocks, final norm and the output projection to next-token logits."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim, dtype=cfg.dtype)
        self.rope = RotaryEmbedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.final_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.dtype)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, dtype=cfg.dtype)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.apply(_init_weights)  # a no-op on the meta device, where checkpoints are loaded
        # Keep only each trained block's input for backward and recompute the rest there: activation memory of
        # one block instead of all, for about a third more compute. Used in training only (see run_blocks).
        self.gradient_checkpointing = False

    def run_blocks(
        self, x: torch.Tensor, layout: Layout | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """The residual stream x [B, T, dim] through blocks[start:stop] (a slice lets frozen layers run once), laid
        out as `layout` says (layout.py; None: each row one text, no padding).

        With query rows (`Layout.reading`), the caller reads the output only there, so the last block runs only at
        those rows (its keys and values still come from every position) and the result is [B, R, dim]. With a
        cache, the caller advances it (see `hidden_states`).
        """
        layout = Layout.unpadded(x.shape[1], x.device) if layout is None else layout
        blocks = range(len(self.blocks))[start:stop]
        if len(blocks) == 0:
            return layout.at_rows(x)
        rope = self.rope(layout.positions)
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for i in blocks:
            block, here = self.blocks[i], layout.for_block(i, last=i == blocks[-1])
            # A frozen block fed by frozen blocks saves nothing for backward: there is nothing to recompute. A
            # block run at query rows only saves little (its norm, keys and values): not worth recomputing. Nor is
            # the top block (run at every position when the classifier reads every token's mean): its backward
            # comes first, right after the forward, so its saved tensors would be rebuilt at once.
            if (
                recompute
                and here.rows is None
                and i != blocks[-1]
                and (x.requires_grad or any(p.requires_grad for p in block.parameters()))
            ):
                x = checkpoint(block, x, rope, here, use_reentrant=False)
            else:
                x = block(x, rope, here)
        return x

    def hidden_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, cache: KVCache | None = None
    ) -> torch.Tensor:
        """[B, T] token ids (attention_mask [B, T] of 1 = real, 0 = pad) -> [B, T, dim] after the final norm.

        With a `cache`, `input_ids` are the tokens after its `length` cached ones (their keys and values are added),
        and `attention_mask` covers cached and new positions alike.
        """
        layout = Layout.plain(attention_mask, input_ids.shape[1], input_ids.device, cache)
        x = self.run_blocks(self.embed_tokens(input_ids), layout)
        if cache is not None:
            cache.length += input_ids.shape[1]
        return self.final_norm(x)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, cache: KVCache | None = None
    ) -> torch.Tensor:
        """Next-token logits [B, T, vocab_size] (see `hidden_states` for the arguments)."""
        return self.lm_head(self.hidden_states(input_ids, attention_mask, cache=cache))


def _init_weights(module: nn.Module) -> None:
    """Small normal weights (std 0.02), as for pretraining from scratch; pretrained weights overwrite them."""
    if isinstance(module, (nn.Linear, nn.Embedding)) and not module.weight.is_meta:
        nn.init.normal_(module.weight, mean=0.0, std=0.02)

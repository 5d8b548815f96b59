"""Llama-3, top to bottom: the order in which a token's vector flows through the network.

token ids -> embedding -> n_layers x Block(RMSNorm -> attention -> add, RMSNorm -> feed-forward -> add)
          -> final RMSNorm -> output projection -> next-token logits

Weights use the Hugging Face layout, whose query/key rows are ordered so that rotary embedding rotates the
first half of each head against the second half (Meta's original code rotates interleaved pairs instead).
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from .config import LlamaConfig, RopeScaling
from .packing import Packed, Rows, at_rows, visible_keys


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
    earlier ones. `length` positions are filled; the model writes the next ones after them.
    """

    def __init__(self, model: Llama, batch_size: int, max_len: int):
        cfg, param = model.cfg, model.embed_tokens.weight
        if max_len > cfg.max_seq_len:
            raise ValueError(f"{max_len} positions exceed the model's context of {cfg.max_seq_len}")
        shape = (batch_size, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.keys = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in range(cfg.n_layers)]
        self.values = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in range(cfg.n_layers)]
        self.length, self.max_len = 0, max_len

    def block(self, i: int) -> BlockCache:
        return BlockCache(self.keys[i], self.values[i], self.length)


class Attention(nn.Module):
    """Grouped-query attention: n_heads query heads share n_kv_heads key/value heads (a smaller KV cache).

    The one attention of the package: training, the classifier's last block (`query_rows`) and generation
    (`cache`) all run this forward, so wrappers that act on module calls (LoRA, FSDP, checkpointing) see them all.
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False, dtype=cfg.dtype)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, dtype=cfg.dtype)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, dtype=cfg.dtype)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False, dtype=cfg.dtype)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        *,
        cache: BlockCache | None = None,
        query_rows: Rows | None = None,
        packed: Packed | None = None,
    ) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim], or [B, R, dim] at `query_rows`.

        rope: cos and sin at x's positions. mask: None for plain causal attention, or [B, 1, T, keys] booleans,
        True where a query may see a key. cache: earlier positions' keys and values; x's are stored after them.
        query_rows [B, R]: positions of x where the caller reads the output. Keys and values come from every
        position, but queries and everything after them are computed at those rows only.
        packed: x [1, N, dim] holds several texts one after another (packing.py); each attends to itself only,
        causally, laid out as a right-padded batch for the kernel. query_rows is then `packed.last` (one per text).
        """
        B, T, _ = x.shape
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, kv_heads, T, head_dim]
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        k = apply_rotary(k, *rope)
        if cache is not None:
            k, v = cache.write(k, v)  # now every position so far
        if packed is not None:  # texts apart: [texts, kv_heads, longest, head_dim], right-padded
            k, v = packed.pad(k), packed.pad(v)
            mask, is_causal = (None, True) if query_rows is None else (packed.last_sees, False)
        else:
            mask, is_causal = visible_keys(mask, query_rows, T, k.shape[2], x.device)
        if query_rows is not None:  # queries only where the output is read
            x, rope = at_rows(x, query_rows), tuple(at_rows(t[:, 0], query_rows).unsqueeze(1) for t in rope)
        q = self.q_proj(x).view(B, x.shape[1], self.n_heads, self.head_dim).transpose(1, 2)  # [B, heads, *, hd]
        q = apply_rotary(q, *rope)
        if packed is not None:  # every query row is one text's own (its last token): one query per text
            q = packed.pad(q) if query_rows is None else q.transpose(0, 2)
        out = self.attend(q, k, v, mask, is_causal)
        if packed is not None:
            out = packed.unpad(out) if query_rows is None else out.transpose(0, 2)
        return self.o_proj(out.transpose(1, 2).reshape(B, x.shape[1], -1))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool
    ) -> torch.Tensor:
        """Softmax of scaled query-key scores, times the values: the package's one call of the fused kernel.

        Query heads share key/value heads (grouped-query attention). Either the kernel shares them itself
        (`enable_gqa`, torch >= 2.5) or each key/value head is repeated for its query heads first, as chapter 3 does
        by hand: a copy of k and v per query head, but a call every fast kernel takes. `kernel_shares_heads` says
        which; the outputs are the same either way.
        """
        shared = self.n_kv_heads != self.n_heads and kernel_shares_heads(q, mask)
        if self.n_kv_heads != self.n_heads and not shared:
            k, v = (t.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1) for t in (k, v))
        with kernel_order(q.device):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=shared)


# The fused attention kernels in the order a CUDA call asks for them. torch >= 2.10 tries cuDNN's first on recent
# GPUs, and cuDNN builds an execution plan for each new shape: on an H200 (benchmarks/sdpa_shapes.py, 8B's heads, 8
# texts) a forward + backward at a length it had not seen took ~100 ms of host time, against 0.4 ms with flash, and
# 0.4 ms with cuDNN once the shape was planned. Training batches are packed to their longest text and generation adds
# a key each token, so nearly every call has a new length: flash first, then the memory-efficient kernel; cuDNN only
# where neither takes the call, math last. gpu_check.py's 8B "last 2 blocks" recipe went from 4,612 to 48,573 tokens/s.
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

    On CUDA (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, torch 2.5 to 2.11), among the fused kernels
    only flash attention accepts fewer key/value heads than query heads, and flash takes no mask, float16 and
    bfloat16 only, on sm80 and newer. The memory-efficient kernel refuses grouped heads (until a change after
    torch 2.11), and cuDNN takes them but not every shape (and comes after flash: CUDA_KERNEL_ORDER). So on CUDA:
    no mask, half precision, sm80+: flash serves it. Anything else with `enable_gqa` would
    fall to the math kernel (float32 T x T scores per head; issue 20): a masked call (a KV cache's, query rows',
    packed texts' last tokens), float32, an older GPU. The CPU's flash kernel takes grouped heads in every dtype;
    masked calls repeat there too, so that the CPU runs the paths a GPU runs. Other devices: repeat.
    Measured on an H200 (torch 2.11+cu130, cuDNN 9.19; 8B's heads, 8 x 512): cuDNN ran every bfloat16 call, shared
    heads 1.3-1.7x faster forward and backward; with cuDNN off, shared heads went to flash without a mask and to
    math with one (repeated: memory-efficient); float32 with shared heads went to math, 1.6x slower (causal).
    """
    if mask is not None or q.device.type not in ("cpu", "cuda"):
        return False
    if q.device.type == "cpu":
        return True
    return q.dtype in (torch.float16, torch.bfloat16) and torch.cuda.get_device_capability(q.device) >= (8, 0)


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

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        *,
        cache: BlockCache | None = None,
        query_rows: Rows | None = None,
        packed: Packed | None = None,
    ) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim]; with `query_rows` [B, R], only those rows: [B, R, dim] (see Attention)."""
        attended = self.attention(self.attention_norm(x), rope, mask, cache=cache, query_rows=query_rows, packed=packed)
        if query_rows is not None:
            x = at_rows(x, query_rows)  # the residual stream too, and the feed-forward below, only at those rows
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

    def attention_inputs(
        self,
        attention_mask: torch.Tensor | None,
        seq_len: int,
        device: torch.device,
        past: int = 0,
        padding_side: str | None = None,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
        """Rotary tables for the positions of `seq_len` tokens after `past` cached ones, and the attention mask:
        None for plain causal attention, else [B, 1, seq_len, past + seq_len] (`attention_mask` covers them all).

        Positions count real tokens only, so a left-padded row gets the same positions (and the same results)
        as the row without padding. `padding_side` ("right" or "left"), when the caller knows it from building
        the batch, spares reading the mask back to find out (a host-device sync on every forward, issue 20).
        """
        if attention_mask is None:
            positions = torch.arange(past, past + seq_len, device=device).expand(1, seq_len)
            return self.rope(positions), None
        real = attention_mask.to(device=device, dtype=torch.bool)
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
        # Right padding needs no mask. A real token attends only to earlier positions, and those are all real (the
        # pads come after the text), so causal attention alone gives it exactly its unpadded result. A pad sees
        # earlier real tokens and pads: its output is garbage nobody reads. Plain causal attention keeps the fastest
        # kernel. This holds without a cache only: a token generated after right pads would see them.
        if padding_side is None:
            right_padded_or_none = bool((real[:, :-1] >= real[:, 1:]).all())
        else:
            right_padded_or_none = padding_side == "right"
        if right_padded_or_none and (past == 0 or (padding_side is None and bool(real.all()))):
            return self.rope(positions), None
        n_keys = past + seq_len
        query_at = torch.arange(past, n_keys, device=device)[:, None]  # each query's position among the keys
        keys = torch.arange(n_keys, device=device)
        # A query may see earlier real keys. Each token may also see itself, so a pad row attends to something
        # (a row with nothing to attend to would give NaN, which would then leak through the values).
        mask = (keys <= query_at) & (real[:, None, :] | (keys == query_at))
        return self.rope(positions), mask.unsqueeze(1)  # [B, 1, T, keys], broadcast over heads

    def run_blocks(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        start: int = 0,
        stop: int | None = None,
        *,
        query_rows: Rows | None = None,
        cache: KVCache | None = None,
        packed: Packed | None = None,
        padding_side: str | None = None,
    ) -> torch.Tensor:
        """The residual stream x [B, T, dim] through blocks[start:stop] (a slice lets frozen layers run once).

        query_rows [B, R]: the caller reads the output only at these positions, so the last block runs only there
        (its keys and values still come from every position) and the result is [B, R, dim].
        cache: x holds the positions after the cache's `length`; the caller advances it (see `hidden_states`).
        packed: x [1, N, dim] is several texts packed without padding (no attention_mask; query_rows, if any, is
        `packed.last`). padding_side: see `attention_inputs`.
        """
        blocks = range(len(self.blocks))[start:stop]
        if len(blocks) == 0:
            return x if query_rows is None else at_rows(x, query_rows)
        if cache is not None and cache.length + x.shape[1] > cache.max_len:
            raise ValueError(f"the cache holds {cache.max_len} positions; {cache.length} used, {x.shape[1]} more asked")
        if packed is not None:
            rope, mask = self.rope(packed.positions), None
        else:
            past = 0 if cache is None else cache.length
            rope, mask = self.attention_inputs(attention_mask, x.shape[1], x.device, past, padding_side)
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for i in blocks:
            block, rows = self.blocks[i], query_rows if i == blocks[-1] else None
            kwargs = {"cache": None if cache is None else cache.block(i), "query_rows": rows, "packed": packed}
            # A frozen block fed by frozen blocks saves nothing for backward: there is nothing to recompute. A
            # block run at query rows only saves little (its norm, keys and values): not worth recomputing.
            if recompute and rows is None and (x.requires_grad or any(p.requires_grad for p in block.parameters())):
                x = checkpoint(block, x, rope, mask, use_reentrant=False, **kwargs)
            else:
                x = block(x, rope, mask, **kwargs)
        return x

    def hidden_states(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, cache: KVCache | None = None
    ) -> torch.Tensor:
        """[B, T] token ids (attention_mask [B, T] of 1 = real, 0 = pad) -> [B, T, dim] after the final norm.

        With a `cache`, `input_ids` are the tokens after its `length` cached ones (their keys and values are added),
        and `attention_mask` covers cached and new positions alike.
        """
        x = self.run_blocks(self.embed_tokens(input_ids), attention_mask, cache=cache)
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

"""How one batch's tokens are laid out, told to attention once per batch: padded, packed, or after a KV cache.

Everything in a block except attention works token by token (norms, projections, feed-forward, LoRA): it cares
only that x is [rows, tokens, dim]. Attention alone must know which tokens belong together and which keys each
query may see. A `Layout` says so, once per batch, and every block's attention reads it:

- **padded**: B texts in [B, T] rows, each padded on the right or the left (an attention mask), or all of one
  length (no mask). Positions count real tokens only.
- **packed**: the texts' real tokens one after another in one [1, N] stream, no pad anywhere (`packing.Packed`);
  attention lays them out per text, as a right-padded batch, and packs its output back.
- **cached**: the new tokens of B rows after the positions a `KVCache` holds (generation); their keys and values
  are stored after the cached ones, and the queries see both.

A layout may also name the query rows its caller reads after the last block (`reading`; `at_last_tokens` for a
classifier, which pools each text's last token): that block computes its queries, and everything after them,
only there. A classifier that pools the mean reads every position instead, through `text_means`.

A layout is made where the batch is made: `data.batching.to_batch` builds it from what it knows on the host (the
lengths, the padding side), so that a forward never reads a device tensor back to find out
(`tests/training/test_host_sync.py`);
`Llama.forward` builds it for the plain calls (a mask or none, a cache), looking at the mask when it must.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .kv_cache import KVCache
from .packing import Packed

# Query rows: [B, R] positions per batch row, or slice(-1, None), the last position of every row (known without
# looking at a tensor, so no host sync to learn that it sees every key).
Rows = torch.Tensor | slice


def at_rows(t: torch.Tensor, rows: Rows) -> torch.Tensor:
    """t [B or 1, T, ...] at the positions `rows` [B, R] of each batch row -> [B, R, ...] (a slice: t[:, rows])."""
    if isinstance(rows, slice):  # a copy, as indexing with a tensor makes: a view saved for backward keeps all of t
        return t[:, rows].clone()
    batch = torch.arange(rows.shape[0], device=rows.device)[:, None]
    return t.expand(rows.shape[0], *t.shape[1:])[batch, rows]


def last_real_positions(attention_mask: torch.Tensor | None, batch: int, seq_len: int, device) -> torch.Tensor:
    """[B] index of each row's last real token, whichever side the padding is on.

    In a causal model only the last token has read the whole text, so it is the one that can summarise it.
    """
    if attention_mask is None:
        return torch.full((batch,), seq_len - 1, device=device)
    positions = torch.arange(seq_len, device=device)
    return (attention_mask.to(device).long() * positions).argmax(-1)  # the largest position whose mask is 1


def causal_after(past: int, n: int, device: torch.device) -> tuple[torch.Tensor | None, bool]:
    """`scaled_dot_product_attention`'s (attn_mask, is_causal) for `n` new tokens after `past` cached ones, each
    seeing itself and every position before it. We pass a mask only where we must: the fastest kernels take none."""
    if past == 0:
        return None, True
    if n == 1:
        return None, False  # one new token after cached ones: it sees them all
    # is_causal=True aligns its triangle top-left (query 0 with key 0); after cached keys it must end bottom-right.
    return torch.ones(n, past + n, dtype=torch.bool, device=device).tril(diagonal=past)[None, None], False


def cached_before(cache: KVCache | None, seq_len: int) -> int:
    """How many positions the cache holds before `seq_len` new ones (0 without a cache), once sure it has room."""
    if cache is None:
        return 0
    if cache.length + seq_len > cache.max_len:
        raise ValueError(f"the cache holds {cache.max_len} positions; {cache.length} used, {seq_len} more asked")
    return cache.length


@dataclass(frozen=True, eq=False)  # eq=False: two layouts are never compared by their tensors
class Layout:
    """One batch's layout (see the module's docstring). Make it with `unpadded`, `padded` or `packed`; `run_blocks`
    hands each block `for_block(i, last)`, which is what attention reads."""

    positions: torch.Tensor  # [B, T] (packed: [1, N]) each new token's position within its own text: rotary angles
    mask: torch.Tensor | None = None  # [B or 1, 1, T, keys] True where a query may see a key; None: is_causal says
    is_causal: bool = True  # with no mask: each query sees itself and the keys before it (True), or every key
    texts: Packed | None = None  # packed texts: where each token of the stream belongs
    cache: KVCache | None = None  # the earlier positions' keys and values; these tokens' are written after them
    real: torch.Tensor | None = None  # [B, keys] True at real tokens, False at pads (a padded batch's mask)
    side: str | None = None  # where a padded batch's pads are, "right" or "left", when its builder knows
    rows: Rows | None = None  # where the caller reads the last block's output: its queries are computed only there
    block: int = 0  # the block this is handed to (`for_block`): whose store in the cache it writes

    @classmethod
    def unpadded(cls, seq_len: int, device: torch.device, *, cache: KVCache | None = None) -> Layout:
        """B rows of `seq_len` new tokens each, every row one text with no padding, after the `cache`'s positions
        if one is given."""
        past = cached_before(cache, seq_len)
        positions = torch.arange(past, past + seq_len, device=device).expand(1, seq_len)
        return cls(positions, *causal_after(past, seq_len, device), cache=cache)

    @classmethod
    def padded(cls, attention_mask: torch.Tensor, *, side: str | None = None, cache: KVCache | None = None) -> Layout:
        """B padded rows, after the `cache`'s positions if one is given, on the mask's device.

        attention_mask [B, past + new tokens]: 1 at real tokens, 0 at pads, covering cached and new positions alike.
        `side` ("right" or "left"), when the batch's builder knows it, spares reading the mask back to find out (a
        host-device sync on every forward).
        """
        real, device = attention_mask.bool(), attention_mask.device
        seq_len = real.shape[1] - (0 if cache is None else cache.length)  # the new tokens
        past = cached_before(cache, seq_len)
        # Positions count real tokens only, so a left-padded row gets the same positions (and the same results) as
        # the row without padding.
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
        # Right padding needs no mask. A real token attends only to earlier positions, and those are all real (the
        # pads come after the text), so causal attention alone gives it exactly its unpadded result. A pad sees
        # earlier real tokens and pads: its output is garbage nobody reads. Plain causal attention keeps the fastest
        # kernel. This holds without a cache only: a token generated after right pads would see them.
        right_padded_or_none = side == "right" if side is not None else bool((real[:, :-1] >= real[:, 1:]).all())
        if right_padded_or_none and (past == 0 or (side is None and bool(real.all()))):
            return cls(positions, *causal_after(past, seq_len, device), cache=cache, real=real, side=side)
        n_keys = past + seq_len
        query_at = torch.arange(past, n_keys, device=device)[:, None]  # each query's position among the keys
        keys = torch.arange(n_keys, device=device)
        # A query may see earlier real keys. Each token may also see itself, so a pad row attends to something
        # (a row with nothing to attend to would give NaN, which would then leak through the values).
        mask = (keys <= query_at) & (real[:, None, :] | (keys == query_at))
        return cls(positions, mask.unsqueeze(1), False, cache=cache, real=real, side=side)  # [B, 1, T, keys]

    @classmethod
    def plain(
        cls, attention_mask: torch.Tensor | None, seq_len: int, device: torch.device, cache: KVCache | None = None
    ) -> Layout:
        """The layout of a plain call, `model(ids, attention_mask)`: `padded` as the mask says (its side read from
        it), or `unpadded` without one."""
        if attention_mask is None:
            return cls.unpadded(seq_len, device, cache=cache)
        return cls.padded(attention_mask.to(device), cache=cache)

    @classmethod
    def packed(cls, texts: Packed) -> Layout:
        """Texts packed one after another (`packing.pack`): each attends to itself only, causally."""
        return cls(texts.positions, texts=texts)

    def reading(self, rows: Rows) -> Layout:
        """This layout, its last block run at `rows` only: [B, R] positions of each row (packed: `texts.last`, one
        per text), or a slice. Keys and values still come from every position."""
        return replace(self, rows=rows)

    def at_last_tokens(self) -> Layout:
        """This layout read at each text's last real token: what the classifier pools (no cache)."""
        if self.texts is not None:
            return self.reading(self.texts.last)
        if self.real is None:
            return self.reading(slice(-1, None))
        last = last_real_positions(self.real, *self.real.shape, self.real.device)
        # Rows that all end at the last position need no mask there (the fastest kernel). Only a layout that was not
        # told how its batch was padded pays a look at the device tensor (a host sync) to find out.
        if self.side is None and bool((last == self.real.shape[1] - 1).all()):
            return self.reading(slice(-1, None))
        return self.reading(last[:, None])

    def for_block(self, i: int, last: bool) -> Layout:
        """What block i's attention reads: the cache's store it writes, and the query rows at the last block run
        only, with the keys those rows see."""
        if self.rows is None or not last:
            return replace(self, rows=None, block=i)
        if self.texts is not None:  # one query per text, its last token: it sees its own text's keys
            return replace(self, mask=self.texts.last_sees, is_causal=False, block=i)
        n_queries = self.positions.shape[1]
        past = 0 if self.cache is None else self.cache.length  # cached positions before the first query
        if isinstance(self.rows, slice):  # the last query sees every key it may see
            mask = None if self.mask is None else self.mask[:, :, self.rows]
        elif self.mask is not None:
            mask = at_rows(self.mask[:, 0], self.rows).unsqueeze(1)  # the mask's rows: [B, 1, R, keys]
        else:
            mask = (torch.arange(past + n_queries, device=self.rows.device) <= past + self.rows[..., None]).unsqueeze(1)
        return replace(self, mask=mask, is_causal=False, block=i)

    # What attention asks, in the order it asks it (llama.Attention.forward).

    def keys_values(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x's keys and values [B, kv_heads, T, head_dim] as the kernel takes them: after the cached ones (and
        stored with them), and packed texts apart, [texts, kv_heads, longest, head_dim], right-padded."""
        if self.cache is not None:
            k, v = self.cache.block(self.block).write(k, v)  # now every position so far
        if self.texts is not None:
            k, v = self.texts.pad(k), self.texts.pad(v)
        return k, v

    def text_means(self, t: torch.Tensor) -> torch.Tensor:
        """t [B, T, dim] (packed: [1, N, dim]) -> [texts, dim], the mean over each text's real tokens: a pad weighs
        nothing, so a text's mean is the same alone, padded on either side, or packed."""
        if self.texts is not None:
            return self.texts.means(t)
        if self.real is None:
            return t.mean(1)
        real = self.real[:, -t.shape[1] :].unsqueeze(-1)  # the new tokens' columns (after a cache)
        # Summed and divided in float32, as `mean` does: bfloat16 counts exactly only up to 256 tokens.
        return ((t * real).sum(1, dtype=torch.float32) / real.sum(1)).to(t.dtype)

    def at_rows(self, t: torch.Tensor) -> torch.Tensor:
        """t [B, T, ...] at the query rows, [B, R, ...] (all of t when this layout reads none)."""
        return t if self.rows is None else at_rows(t, self.rows)

    def at_query_rows(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [B, T, dim] and its rotary tables [B, 1, T, head_dim // 2] at the query rows only (all of them when
        this layout reads none)."""
        if self.rows is None:
            return x, rope
        return self.at_rows(x), tuple(self.at_rows(t[:, 0]).unsqueeze(1) for t in rope)

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """Queries [B, heads, T or R, head_dim] as the kernel takes them: packed texts apart, as keys are; at
        packed texts' last tokens, one query per text, [texts, heads, 1, head_dim]."""
        if self.texts is None:
            return q
        return self.texts.pad(q) if self.rows is None else q.transpose(0, 2)

    def back(self, out: torch.Tensor) -> torch.Tensor:
        """The kernel's output laid out as x was (the inverse of `queries`): [B, heads, T or R, head_dim]."""
        if self.texts is None:
            return out
        return self.texts.unpad(out) if self.rows is None else out.transpose(0, 2)

"""Batch layouts for attention: which keys each query sees, for padded batches, query rows and packed texts.

Padding-free batches: the real tokens of several texts packed into one stream, no pad anywhere.

Everything in a block except attention works token by token (norms, projections, feed-forward, LoRA), so it can
run on the packed stream [1, N, dim], N the number of real tokens, and spend no compute on padding. Attention is
the one place where texts must stay apart: there the stream's queries, keys and values are laid out as a
right-padded [texts, heads, longest, head_dim] batch, attended causally (right padding needs no mask, so the
fastest kernel serves it) and packed back. Measured on a 2-core CPU that beats one block-diagonal mask over the
whole stream, whose N x N scores grow with the square of the batch (benchmarks/RESULTS.md).

Everything here is built on the host from the texts' lengths, where the batch is made: the forward then never
has to read a device tensor back to learn the layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class Packed(NamedTuple):
    """Where each token of a packed stream belongs. Positions restart at 0 for every text (rotary embedding)."""

    positions: torch.Tensor  # [1, N] each token's position within its own text
    slots: torch.Tensor  # [N] each token's place in the right-padded [texts * longest] layout
    last: torch.Tensor  # [1, texts] each text's last token in the stream: the one the classifier pools
    last_sees: torch.Tensor  # [texts, 1, 1, longest] the keys a text's last token may see: its own tokens
    lengths: tuple[int, ...]  # each text's length, on the host

    @property
    def texts(self) -> int:
        return len(self.lengths)

    @property
    def longest(self) -> int:
        return max(self.lengths)

    def pad(self, t: torch.Tensor) -> torch.Tensor:
        """[1, heads, N, head_dim] packed -> [texts, heads, longest, head_dim], right-padded with zeros."""
        flat = t[0].transpose(0, 1)  # [N, heads, head_dim]
        padded = flat.new_zeros(self.texts * self.longest, *flat.shape[1:]).index_copy(0, self.slots, flat)
        return padded.view(self.texts, self.longest, *flat.shape[1:]).transpose(1, 2)

    def unpad(self, t: torch.Tensor) -> torch.Tensor:
        """[texts, heads, longest, head_dim] -> [1, heads, N, head_dim]: the real positions only, in stream order."""
        flat = t.transpose(1, 2).reshape(self.texts * self.longest, *t.shape[1:2], t.shape[-1])
        return flat[self.slots].transpose(0, 1).unsqueeze(0)

    def split(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[1, N, ...] -> one [length, ...] tensor per text."""
        return t[0].split(self.lengths)


def pack(lengths: Sequence[int], device: torch.device | str | None = None) -> Packed:
    """The layout of texts of these lengths packed one after another (built on the CPU, then moved)."""
    if not lengths or min(lengths) < 1:
        raise ValueError(f"every packed text needs at least one token, got lengths {list(lengths)}")
    longest, counts = max(lengths), torch.tensor(lengths)
    starts = counts.cumsum(0) - counts  # where each text begins in the stream
    text_of = torch.repeat_interleave(torch.arange(len(lengths)), counts)  # [N] which text each token is in
    positions = torch.arange(sum(lengths)) - starts[text_of]
    last_sees = torch.arange(longest) < counts[:, None]  # [texts, longest]
    return Packed(
        positions=positions.unsqueeze(0).to(device),
        slots=(text_of * longest + positions).to(device),
        last=(starts + counts - 1).unsqueeze(0).to(device),
        last_sees=last_sees[:, None, None, :].to(device),
        lengths=tuple(lengths),
    )


def pack_ids(
    token_lists: Sequence[Sequence[int]], device: torch.device | str | None = None
) -> tuple[torch.Tensor, Packed]:
    """Token-id lists -> the packed stream [1, N] of their ids and its layout."""
    ids = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.long)
    return ids.unsqueeze(0).to(device), pack([len(t) for t in token_lists], device)


# Query rows: [B, R] positions per batch row, or slice(-1, None), the last position of every row (known without
# looking at a tensor, so no host sync to learn that it sees every key).
Rows = torch.Tensor | slice


def at_rows(t: torch.Tensor, rows: Rows) -> torch.Tensor:
    """t [B or 1, T, ...] at the positions `rows` [B, R] of each batch row -> [B, R, ...] (a slice: t[:, rows])."""
    if isinstance(rows, slice):  # a copy, as indexing with a tensor makes: a view saved for backward keeps all of t
        return t[:, rows].clone()
    batch = torch.arange(rows.shape[0], device=rows.device)[:, None]
    return t.expand(rows.shape[0], *t.shape[1:])[batch, rows]


def visible_keys(
    mask: torch.Tensor | None, query_rows: Rows | None, n_queries: int, n_keys: int, device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    """`scaled_dot_product_attention`'s (attn_mask, is_causal) for queries at the last `n_queries` of `n_keys`
    positions, or only at `query_rows` [B, R] of those. `mask` None means plain causal: each position sees itself
    and every position before it. We pass a mask only where we must: the fastest kernels take none.
    """
    past = n_keys - n_queries  # cached positions before the first query
    if isinstance(query_rows, slice):
        return (None, False) if mask is None else (mask[:, :, query_rows], False)  # the last query sees every key
    if query_rows is not None:
        if mask is not None:
            return at_rows(mask[:, 0], query_rows).unsqueeze(1), False  # the mask's rows: [B, 1, R, keys]
        return (torch.arange(n_keys, device=device) <= past + query_rows[..., None]).unsqueeze(1), False
    if mask is not None:
        return mask, False
    if n_queries == n_keys:
        return None, True
    if n_queries == 1:
        return None, False  # one new token after cached ones: it sees them all
    # is_causal=True aligns its triangle top-left (query 0 with key 0); after cached keys it must end bottom-right.
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril(diagonal=past), False

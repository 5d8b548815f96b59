"""Padding-free batches: the real tokens of several texts packed into one stream, no pad anywhere.

Everything in a block except attention works token by token (norms, projections, feed-forward, LoRA), so it can
run on the packed stream [1, N, dim], N the number of real tokens, and spend no compute on padding. Attention is
the one place where texts must stay apart: there the stream's queries, keys and values are laid out as a
right-padded [texts, heads, longest, head_dim] batch, attended causally (right padding needs no mask, so the
fastest kernel serves it) and packed back. Measured on a 2-core CPU that beats one block-diagonal mask over the
whole stream, whose N x N scores grow with the square of the batch (benchmarks/RESULTS.md). `layout.Layout.packed`
is how attention is told.

Everything here is built on the host from the texts' lengths, where the batch is made, and copied to the device
with the batch's token ids and labels in one non-blocking copy (`to_device`): the forward then never has to
read a device tensor back to learn the layout, and the host never waits for the GPU to hand the batch over.
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

    def means(self, t: torch.Tensor) -> torch.Tensor:
        """[1, N, dim] -> [texts, dim], the mean of each text's tokens.

        A mean per text: exact, and its backward keeps nothing, for two small kernels a text. Not one product with a
        [texts, N] matrix of 1/length weights, which grows as texts x tokens (under --batch-tokens, with the square
        of the budget); nor `index_add`, whose CUDA sums are atomic, in no fixed order, so the same batch would give
        other bits."""
        return torch.stack([part.mean(0) for part in self.split(t)])


def to_device(host: Sequence[torch.Tensor], device: torch.device | str | None) -> list[torch.Tensor]:
    """Host tensors of one dtype on `device` in one copy: views of one flat tensor, shaped as given.

    A blocking copy to a GPU waits for all the work queued before it, so a batch copied that way stalls the GPU's
    queue once per copy. On a GPU the flat tensor is pinned and copied `non_blocking`: the host goes on queueing
    while it travels (the caching host allocator keeps the pinned buffer until the copy is done).
    """
    flat = torch.cat([t.reshape(-1) for t in host])
    if device is not None and torch.device(device).type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in host]), host, strict=True)]


def layout_parts(lengths: Sequence[int]) -> list[torch.Tensor]:
    """The layout of texts of these lengths, as host int64 tensors: counts, positions, slots, last (see `Packed`).
    Built on the CPU, where the lengths are, with no op that would read a device (repeat_interleave is told its
    output's size), to travel with the batch's other ints in one copy (`to_device`)."""
    if not lengths or min(lengths) < 1:
        raise ValueError(f"every packed text needs at least one token, got lengths {list(lengths)}")
    longest, counts, n = max(lengths), torch.tensor(lengths), sum(lengths)
    starts = counts.cumsum(0) - counts  # where each text begins in the stream
    text_of = torch.repeat_interleave(torch.arange(len(lengths)), counts, output_size=n)  # [N] each token's text
    positions = torch.arange(n) - starts[text_of]
    return [counts, positions, text_of * longest + positions, starts + counts - 1]


def assemble(parts: Sequence[torch.Tensor], lengths: Sequence[int]) -> Packed:
    """`layout_parts`' tensors, moved, as a `Packed`; `last_sees` is drawn where they are (the device)."""
    counts, positions, slots, last = parts
    last_sees = torch.arange(max(lengths), device=counts.device) < counts[:, None]  # [texts, longest]
    return Packed(positions[None], slots, last[None], last_sees[:, None, None, :], tuple(lengths))


def pack(lengths: Sequence[int], device: torch.device | str | None = None) -> Packed:
    """The layout of texts of these lengths packed one after another (built on the CPU, then moved in one copy)."""
    return assemble(to_device(layout_parts(lengths), device), lengths)


def pack_ids(
    token_lists: Sequence[Sequence[int]], device: torch.device | str | None = None
) -> tuple[torch.Tensor, Packed]:
    """Token-id lists -> the packed stream [1, N] of their ids and its layout (one copy to `device`)."""
    ids = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.long)
    lengths = [len(t) for t in token_lists]
    ids, *parts = to_device([ids, *layout_parts(lengths)], device)
    return ids[None], assemble(parts, lengths)

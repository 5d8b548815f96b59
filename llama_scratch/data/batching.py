"""From texts to padded batches: token ids per text, one tensor per batch, batches of similar lengths.

Rows keep their own lengths as lists until a batch is formed; `collate` pads a batch only to its own longest
row, and `length_sorted_batches` groups rows of similar length so that little compute goes to padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ..checkpoints.progress import progress_bar
from ..model.layout import Layout
from ..model.packing import assemble, layout_parts, to_device


class Encoder(Protocol):
    """What the data code needs from a tokenizer (our `Tokenizer`, or any object with these two members)."""

    pad_id: int

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]: ...


def encode_texts(
    texts: Sequence[str], tokenizer: Encoder, max_length: int | None = None, progress: bool = False
) -> tuple[list[list[int]], int]:
    """Token ids with BOS (no EOS) per text, and how many were truncated.

    Truncation keeps the first `max_length` tokens (BOS included) and drops the end: the classifier then reads
    the last kept token (or, under --pooling mean, the kept tokens), so the model never sees the tail.
    `max_length=None` keeps everything.
    """
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be at least 1, got {max_length}")
    ids = [tokenizer.encode(t, bos=True, eos=False) for t in progress_bar(texts, "tokenizing", disable=not progress)]
    if max_length is None:
        return ids, 0
    return [x[:max_length] for x in ids], sum(len(x) > max_length for x in ids)


def default_max_length(token_lists: Sequence[Sequence[int]], model_max: int) -> int:
    """Long enough for the longest row, capped by the model's context (batches pad only to their own longest)."""
    if not token_lists:
        raise ValueError("no token lists to measure")
    return min(max(len(x) for x in token_lists), model_max)


def collate(
    batch: Sequence[tuple[Sequence[int], int]], pad_id: int, padding_side: str = "right"
) -> dict[str, torch.Tensor]:
    """Pad to the batch's longest row: `input_ids` [B, T], `attention_mask` [B, T] (1 = real), `labels` [B] (or
    [B, classes] for multi-hot rows).

    `pad_id` must be a real token id (the embedding still looks padded positions up; the mask hides them).
    """
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    if pad_id is None or pad_id < 0:
        raise ValueError(f"pad_id must be a valid token id, got {pad_id!r}")
    longest = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for row, (ids, _) in enumerate(batch):
        span = slice(0, len(ids)) if padding_side == "right" else slice(longest - len(ids), longest)
        input_ids[row, span] = torch.as_tensor(ids, dtype=torch.long)
        attention_mask[row, span] = 1
    labels = torch.tensor([label for _, label in batch], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def length_sorted_batches(
    lengths: Sequence[int], batch_size: int, rank: int = 0, world_size: int = 1
) -> list[list[int]]:
    """Row indices sorted by length and cut into batches, for passes where order does not matter (evaluation,
    prediction, caching). With several processes each takes every `world_size`-th row: every row exactly once.
    """
    rows = sorted(range(len(lengths)), key=lengths.__getitem__)[rank::world_size]
    return [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]


@dataclass
class TokenizedSplit:
    """One split's texts after the tokenizer: token-id lists and class ids, and optionally each text's frozen-prefix
    output. (`splitting.split_dataset` cuts the labelled texts into splits; `--split` names how.)"""

    ids: list[list[int]]
    labels: list[int] | list[list[int]]  # class ids, or (--multi-label) multi-hot rows: `LabelledTexts.targets`
    states: list[torch.Tensor] | None = None  # see prefix_cache: then the model runs only its trained blocks
    pad_id: int = 0  # the token that fills padded positions (masked out or after the text: any valid id works)

    @property
    def multi_hot(self) -> bool:
        """Whether the labels are multi-hot rows (--multi-label): a batch's `labels` is then [B, classes]."""
        return bool(self.labels) and isinstance(self.labels[0], list)


def pad_states(states: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad [length, dim] tensors into a [B, T, dim] batch and its 1/0 attention mask."""
    longest = max(s.shape[0] for s in states)
    batch = states[0].new_zeros(len(states), longest, states[0].shape[1])
    mask = torch.zeros(len(states), longest, dtype=torch.long, device=states[0].device)
    for row, s in enumerate(states):
        batch[row, : s.shape[0]] = s
        mask[row, : s.shape[0]] = 1
    return batch, mask


def to_batch(split: TokenizedSplit, rows: list[int], side: str, device: torch.device) -> dict[str, Any]:
    """A batch of these rows: `input_ids` or (with a cache) `frozen_states`, `labels`, and the batch's `layout`:
    packed (side "packed": the texts one after another, no padding, see packing.py) or padded on `side` ("right"
    or "left", and then its `attention_mask` too). Decided here, on the host, so the forward never has to look.

    Every int the batch needs (labels, ids, the packed layout or the mask) goes to the device in one non-blocking
    copy (`to_device`): no copy here makes the host wait for the GPU. Cached states are on the device already.
    """
    labels = torch.tensor([split.labels[i] for i in rows])
    if side == "packed":
        lengths = [len(split.ids[i]) for i in rows]
        cached = split.states is not None
        ids = torch.tensor([] if cached else [t for i in rows for t in split.ids[i]], dtype=torch.long)
        labels, ids, *parts = to_device([labels, ids, *layout_parts(lengths)], device)
        batch = {"layout": Layout.packed(assemble(parts, lengths)), "labels": labels}
        if cached:
            return batch | {"frozen_states": torch.cat([split.states[i] for i in rows])[None]}
        return batch | {"input_ids": ids[None]}
    if split.states is not None:
        states, mask = pad_states([split.states[i] for i in rows])  # made on the states' device
        labels = to_device([labels], device)[0]
        layout = Layout.padded(mask, side="right")
        return {"frozen_states": states, "attention_mask": mask, "labels": labels, "layout": layout}
    batch = collate([(split.ids[i], split.labels[i]) for i in rows], split.pad_id, side)
    moved = dict(zip(batch, to_device(list(batch.values()), device), strict=True))
    return moved | {"layout": Layout.padded(moved["attention_mask"], side=side)}


def forward(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The model's logits for a batch of `to_batch`, whichever its layout."""
    return model(batch.get("input_ids"), frozen_states=batch.get("frozen_states"), layout=batch["layout"])

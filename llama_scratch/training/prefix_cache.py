"""Frozen-prefix caching: run the frozen bottom of the network once per text, not once per epoch.

When only the last k of L blocks train, everything below them (the embedding and blocks 0..L-k-1) is fixed,
so its output for a given text never changes. We compute that output once, keep it, and train the last k
blocks on it: after the first pass, an epoch costs about k/L of a full forward and backward.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch

from ..checkpoints.progress import progress_bar
from ..data.batching import TokenizedSplit, collate, length_sorted_batches
from ..model.classifier import LlamaClassifier
from ..model.layout import Layout
from ..model.packing import pack_ids, to_device
from ..parallel.strategy import Replicated, Strategy
from ..sources.devices import memory_budget


def distinct_texts(token_lists: Iterable[list[int]]) -> dict[tuple[int, ...], int]:
    """Each distinct text's index among the distinct ones, in order of first appearance: a repeat runs only once."""
    distinct: dict[tuple[int, ...], int] = {}
    for ids in token_lists:
        distinct.setdefault(tuple(ids), len(distinct))
    return distinct


def cache_bytes(token_lists: list[list[int]], clf: LlamaClassifier) -> int:
    """Memory the cached states take: one vector of the model's width per real token."""
    width = clf.backbone.cfg.dim
    return sum(map(len, token_lists)) * width * clf.head.weight.element_size()


@torch.no_grad()
def compute_frozen_states(
    clf: LlamaClassifier,
    token_lists: list[list[int]],
    pad_id: int,
    batch_size: int = 16,
    show: bool = True,
    strategy: Strategy | None = None,
    name: str = "",
    packed: bool = False,
) -> list[torch.Tensor]:
    """Each text's residual stream after the frozen blocks: a [length, dim] tensor per text, on the model's device.

    Texts go through in batches sorted by length, right-padded (which keeps each row's real positions identical to
    running it alone: causal attention never looks ahead) or packed without padding (`packed`, packing.py). Sorted
    batches carry little padding, so packing gains less here (benchmarks/RESULTS.md); `cache_splits` packs.
    Several processes (DDP or --shard: `strategy`, one process without) each compute every N-th text and then
    exchange them: all end up with every text, since the training loop deals the rows out afresh every epoch
    (train.epoch_batches) and evaluation deals out each split by length. Sharded, each frozen block's forward
    gathers its parameters from every process, so every process runs as many forwards as the busiest: one with
    fewer batches runs a one-text batch more, dropped.
    """
    device, dtype = clf.head.weight.device, clf.backbone.embed_tokens.weight.dtype
    strategy = strategy or Replicated(device=device)
    processes = strategy.processes
    states: list[torch.Tensor] = [torch.empty(0)] * len(token_lists)
    batches = length_sorted_batches([len(x) for x in token_lists], batch_size, processes.rank, processes.world_size)
    extra = strategy.batches_to_match(len(batches))
    desc, quiet = f"caching frozen layers {name}".strip(), not (show and strategy.is_main)
    # Not inference_mode: training reads these states. Sharded, the root's parameters stay gathered after its
    # forward (it expects a backward): freed when the pass ends.
    with strategy.forwards_only(clf, inference=False):
        for k, rows in enumerate(progress_bar(batches + [[0]] * extra, desc, leave=False, disable=quiet)):
            if packed:  # no padding: each text's states are its own stretch of the stream
                ids, texts = pack_ids([token_lists[i] for i in rows], device)
                out = texts.split(clf.frozen_prefix(ids, Layout.packed(texts)))
            else:
                batch = collate([(token_lists[i], 0) for i in rows], pad_id)
                ids, mask = to_device([batch["input_ids"], batch["attention_mask"]], device)  # one copy
                x = clf.frozen_prefix(ids, Layout.padded(mask, side="right"))
                out = [x[row, : len(token_lists[i])] for row, i in enumerate(rows)]
            for i, s in zip(rows, out, strict=True):
                if k < len(batches):  # not the batch a sharded process runs only to take part
                    states[i] = s.clone()
    mine = [i for rows in batches for i in rows]
    everyone = strategy.exchange_rows(mine, [states[i] for i in mine], clf.backbone.cfg.dim, dtype)
    return [everyone[i] for i in range(len(token_lists))]


def use_cache(choice: str, clf: LlamaClassifier, ids: dict[str, list[list[int]]], strategy: Strategy, log) -> bool:
    """Whether to cache the frozen layers' output: there must be frozen blocks, and (auto) room to keep it: at most a
    quarter of the device's memory, and half of what the model's own weights leave of it. Decided from the data, the
    model and the device's size, never from what is free at this moment: the same command and seed must cache, or
    not, whatever else runs, since the cached and uncached runs round differently (the frozen blocks run over other
    batches) and so end a few float32 roundings apart. The log says which was chosen.

    With several processes (DDP or --shard) every process must decide alike (computing the cache is collective), so
    the tightest one decides. Each process keeps every text's states (see `compute_frozen_states`), so the size
    counted is the whole cache even when sharded; processes on a CPU share the host's memory and each keeps a copy."""
    frozen = clf.frozen_blocks
    if choice == "off" or frozen == 0:
        return False
    size = cache_bytes(list(distinct_texts(itertools.chain(*ids.values()))), clf)  # each distinct text once
    if choice == "auto":
        device = strategy.device
        left = memory_budget(device, fraction=1.0) - strategy.held_bytes(clf)  # the rest is for training itself
        room = min(memory_budget(device), left // 2)
        if size > strategy.least_room(room):
            log(
                f"not caching the frozen layers: {size / 2**30:.1f} GiB exceeds a quarter of the device's memory "
                "or half of what the model leaves (--cache-frozen on to insist)"
            )
            return False
    each = strategy.per_process(" in each process")
    log(f"caching the output of the {frozen} frozen blocks for every text ({size / 2**20:,.0f} MiB{each})")
    return True


def cache_splits(
    clf: LlamaClassifier, splits: dict[str, TokenizedSplit], rows: int, strategy: Strategy
) -> dict[str, TokenizedSplit]:
    """The same splits, each text carrying its frozen-prefix output (the training loop then runs only the rest).

    Every distinct text runs once, whichever splits hold it, and its copies share one tensor: labelled data often
    repeats itself (the bundled SMS collection does: benchmarks/RESULTS.md counts its distinct texts).
    """
    distinct = distinct_texts(itertools.chain(*(split.ids for split in splits.values())))
    pad_id = next(iter(splits.values())).pad_id
    states = compute_frozen_states(clf, [list(ids) for ids in distinct], pad_id, rows, strategy=strategy, packed=True)
    return {
        k: TokenizedSplit(v.ids, v.labels, [states[distinct[tuple(ids)]] for ids in v.ids], v.pad_id)
        for k, v in splits.items()
    }

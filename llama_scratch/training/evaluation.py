"""Evaluation: loss, accuracy and the confusion matrix over a whole split, and per-class figures from it."""

from __future__ import annotations

from collections import Counter
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..data.batching import TokenizedSplit, forward, length_sorted_batches, to_batch
from ..parallel.strategy import Strategy, unwrap


class EvalSettings(Protocol):
    """What evaluation reads from the training settings (train.TrainSettings has both)."""

    eval_rows: int  # rows per batch: no gradients are kept, so more than in training
    padding_side: str


def evaluate(model: nn.Module, split: TokenizedSplit, s: EvalSettings, strategy: Strategy, desc: str) -> dict:
    """See `_evaluate`; without gradients, in the strategy's way (inference_mode; sharded, no_grad, which FSDP2
    can free after: `Strategy.forwards_only`). `Replicated()` evaluates in one process on the CPU."""
    with strategy.forwards_only(model):
        return _evaluate(model, split, s, strategy, desc)


def _evaluate(model: nn.Module, split: TokenizedSplit, s: EvalSettings, strategy: Strategy, desc: str) -> dict:
    """Loss, accuracy and confusion matrix over a whole split, shared out across processes.

    Each process takes every N-th row (no padding rows, unlike `DistributedSampler`), so summing the counts
    over processes counts every row exactly once. Rows are sorted by length so batches carry little padding.
    """
    model, device, processes = unwrap(model), strategy.device, strategy.processes
    num_classes = model.head.out_features  # the classifier's head says how many classes there are
    was_training = model.training
    model.eval()
    batches = length_sorted_batches([len(x) for x in split.ids], s.eval_rows, processes.rank, processes.world_size)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.float64, device=device)  # [true, predicted]
    # Sharded, every process runs every forward (its blocks are gathered from everyone): one with fewer batches
    # runs a one-row batch more whose result it drops.
    extra = strategy.batches_to_match(len(batches))
    for k, rows in enumerate(tqdm(batches + [[0]] * extra, desc, leave=False, disable=not strategy.is_main)):
        batch = to_batch(split, rows, s.padding_side, device)
        logits = forward(model, batch).float()
        if k >= len(batches):
            continue
        loss_sum += F.cross_entropy(logits, batch["labels"], reduction="sum").double()
        confusion += count_pairs(batch["labels"], logits.argmax(-1), num_classes)
    totals = strategy.all_sum(torch.cat([loss_sum.view(1), confusion.flatten()])).tolist()  # the one read
    model.train(was_training)
    matrix = [[int(c) for c in totals[1 + k * num_classes : 1 + (k + 1) * num_classes]] for k in range(num_classes)]
    n = sum(map(sum, matrix))
    return {
        "loss": totals[0] / max(n, 1),
        "accuracy": sum(matrix[k][k] for k in range(num_classes)) / max(n, 1),
        "confusion": matrix,
        "count": n,
    }


def count_pairs(true: torch.Tensor, predicted: torch.Tensor, num_classes: int) -> torch.Tensor:
    """[num_classes, num_classes] float64 counts of each (true, predicted) pair: one-hot rows multiplied, not
    `bincount`, which on a GPU reads its input's largest value back to size its output (a host sync a batch)."""
    classes = torch.arange(num_classes, device=true.device)
    return (true[:, None] == classes).double().T @ (predicted[:, None] == classes).double()


def per_class(confusion: list[list[int]], label_names: list[str]) -> dict[str, dict]:
    """Precision, recall and F1 of each class from a [true, predicted] confusion matrix."""
    c = torch.tensor(confusion, dtype=torch.float64)
    out = {}
    for k, name in enumerate(label_names):
        tp, predicted, actual = c[k, k].item(), c[:, k].sum().item(), c[k].sum().item()
        p = tp / predicted if predicted else 0.0
        r = tp / actual if actual else 0.0
        out[name] = {"precision": p, "recall": r, "f1": 2 * p * r / (p + r) if p + r else 0.0, "support": int(actual)}
    return out


def warn_if_one_class(val_accuracy: float, val_labels: list[int], log) -> None:
    """A model that learned nothing predicts the commonest class; its accuracy is then that class's share."""
    majority = max(Counter(val_labels).values()) / max(len(val_labels), 1)
    if val_accuracy <= majority + 1e-9:
        log(
            f"warning: validation accuracy {val_accuracy:.2%} is no better than always answering the commonest "
            f"class ({majority:.2%}): the model has not learned the task. Try more data, more --epochs, a higher "
            "--lr, or --class-weights balanced for imbalanced labels."
        )

"""What training minimises and counts as right, for one label per text and for several (`--multi-label`): the
one place the train step (`loop.train_step`) and evaluation (`evaluation.evaluate`) take them from, so the two
cannot drift apart.

The labels' shape says which task it is: [B] class ids (one label per text) or [B, C] multi-hot rows (several).

One label per text: the classes compete, so the logits go through one softmax and the loss is cross-entropy.
Several labels per text: the labels do not compete (a text about sports can be about politics too), so each logit
is a yes/no question of its own: a sigmoid per label and binary cross-entropy per label, averaged. A softmax
would force the probabilities to share one unit between labels that are all present. It is what transformers'
`LlamaForSequenceClassification` computes under `problem_type: multi_label_classification`, so an export reads
the same way (`export_hf`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def loss(
    logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor | None = None, reduction: str = "mean"
) -> torch.Tensor:
    """The loss of `logits` [B, C] against `labels`: [B] class ids (cross-entropy; `weight` per class) or [B, C]
    0/1 targets (binary cross-entropy with logits, the mean over rows and labels; `weight` is then each label's
    `pos_weight`, how much more its positive rows count, see `loop.balanced_weights`).

    `reduction` "sum" sums over rows: under --multi-label each row's loss is then the mean over its labels, so
    the sum divided by the rows is the "mean" a training step reports.
    """
    logits = logits.float()
    if labels.ndim == 1:
        return F.cross_entropy(logits, labels, weight=weight, reduction=reduction)
    targets = labels.to(logits.dtype)
    if reduction == "sum":
        per_label = F.binary_cross_entropy_with_logits(logits, targets, pos_weight=weight, reduction="sum")
        return per_label / logits.shape[-1]
    return F.binary_cross_entropy_with_logits(logits, targets, pos_weight=weight, reduction=reduction)


def correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """How many rows are right, as a device tensor (no read to the host: `tests/training/test_host_sync.py`): the most
    probable class is the label, or under --multi-label every label's decision at probability 0.5 (logit >= 0,
    "at or above", as `classify` reads a threshold) equals its target: an exact match of the whole set."""
    if labels.ndim == 1:
        return (logits.argmax(-1) == labels).sum()
    return ((logits >= 0) == labels.bool()).all(-1).sum()

"""Evaluation: loss, accuracy and the confusion matrix over a whole split, per-class figures and macro-F1 from it,
ROC AUC from the probabilities, and which evaluation's weights a run keeps (`--select-by`).

Under --multi-label (a split whose labels are multi-hot rows) every row's probabilities are gathered instead of a
confusion matrix: per-label precision, recall and F1, micro- and macro-F1 and the exact-match accuracy follow
on the host at a threshold (`label_set_figures`), which `final_figures` chooses on the validation split."""

from __future__ import annotations

from collections import Counter
from typing import Protocol

import torch
from torch import nn

from ..checkpoints.progress import progress_bar
from ..data.batching import TokenizedSplit, forward, length_sorted_batches, to_batch
from ..parallel.strategy import Strategy, unwrap
from . import objective


class EvalSettings(Protocol):
    """What evaluation reads from the training settings (train.TrainSettings has both)."""

    eval_rows: int  # rows per batch: no gradients are kept, so more than in training
    padding_side: str


SELECT_BY = ("accuracy", "macro_f1", "loss")  # what --select-by may name: the measure the kept weights are best at
THRESHOLDS = tuple(k / 20 for k in range(1, 20))  # --multi-label: the thresholds tried on validation, 0.05 .. 0.95


def accuracy_name(multi_label: bool) -> str:
    """What an evaluation's `accuracy` is called where a person reads it: under --multi-label the exact match (every
    label of a text right). The key stays `accuracy` in the history and metrics.json, so that --select-by and
    scripts read one name whatever the run."""
    return "exact match" if multi_label else "accuracy"


def label_sets(result: dict) -> bool:
    """Whether `evaluate` gave a --multi-label split's result: every row's probabilities, for a threshold to be
    chosen later, and no confusion matrix."""
    return "probabilities" in result


def check_threshold_value(threshold: float) -> float:
    """A --threshold, refused in one line unless strictly between 0 and 1 (at 0 or 1 every label, or none, would be
    predicted whatever the text): finetune's and classify's flag alike."""
    if not 0 < threshold < 1:
        raise ValueError(f"--threshold must be a probability between 0 and 1 (not included), got {threshold:g}")
    return threshold


def evaluate(
    model: nn.Module, split: TokenizedSplit, s: EvalSettings, strategy: Strategy, desc: str, scores: bool = False
) -> dict:
    """See `_evaluate`; without gradients, in the strategy's way (inference_mode; sharded, no_grad, which FSDP2
    can free after: `Strategy.forwards_only`). `Replicated()` evaluates in one process on the CPU."""
    with strategy.forwards_only(model):
        return _evaluate(model, split, s, strategy, desc, scores)


def _evaluate(
    model: nn.Module, split: TokenizedSplit, s: EvalSettings, strategy: Strategy, desc: str, scores: bool = False
) -> dict:
    """Loss, accuracy, macro-F1 and confusion matrix over a whole split, shared out across processes; with
    `scores` (two classes), the ROC AUC of the second class's probability as well, read in the same one read.

    Each process takes every N-th row (no padding rows, unlike `DistributedSampler`), so summing the counts
    over processes counts every row exactly once. Rows are sorted by length so batches carry little padding.
    """
    model, device, processes = unwrap(model), strategy.device, strategy.processes
    num_classes = model.head.out_features  # the classifier's head says how many classes there are
    multi = split.multi_hot
    width = num_classes if multi else 1  # each row's probabilities gathered: every label's, or the second class's
    was_training = model.training
    model.eval()
    batches = length_sorted_batches([len(x) for x in split.ids], s.eval_rows, processes.rank, processes.world_size)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    # Each process writes its rows' probabilities into its own stretch of one vector (offsets known on the host:
    # no index tensor to copy), so summing over processes gathers them all.
    gather = scores or multi
    order, offset = score_order(split, s.eval_rows, processes.rank, processes.world_size) if gather else ([], 0)
    probs = torch.zeros(len(order) * width, dtype=torch.float64, device=device)
    classes = 0 if multi else num_classes  # no confusion matrix for sets of labels: their figures come from probs
    confusion = torch.zeros(classes, classes, dtype=torch.float64, device=device)  # [true, predicted]
    # Sharded, every process runs every forward (its blocks are gathered from everyone): one with fewer batches
    # runs a one-row batch more whose result it drops.
    extra = strategy.batches_to_match(len(batches))
    for k, rows in enumerate(progress_bar(batches + [[0]] * extra, desc, leave=False, disable=not strategy.is_main)):
        batch = to_batch(split, rows, s.padding_side, device)
        logits = forward(model, batch).float()
        if k >= len(batches):
            continue
        loss_sum += objective.loss(logits, batch["labels"], reduction="sum").double()
        if not multi:
            confusion += count_pairs(batch["labels"], logits.argmax(-1), num_classes)
        if gather:
            start = (offset + k * s.eval_rows) * width
            shown = logits.sigmoid() if multi else logits.softmax(-1)[:, -1]
            probs[start : start + len(rows) * width] = shown.double().flatten()
    totals = strategy.all_sum(torch.cat([loss_sum.view(1), confusion.flatten(), probs])).tolist()  # the one read
    model.train(was_training)
    if multi:
        rows = [totals[1 + i * width : 1 + (i + 1) * width] for i in range(len(order))]
        return multi_label_result(totals[0], rows, [split.labels[i] for i in order])
    cells = num_classes * num_classes
    matrix = [[int(c) for c in totals[1 + k * num_classes : 1 + (k + 1) * num_classes]] for k in range(num_classes)]
    n = sum(map(sum, matrix))
    result = {
        "loss": totals[0] / max(n, 1),
        "accuracy": sum(matrix[k][k] for k in range(num_classes)) / max(n, 1),
        "macro_f1": macro_f1(matrix),
        "confusion": matrix,
        "count": n,
    }
    if scores:
        result["roc_auc"] = roc_auc(totals[1 + cells :], [int(split.labels[i] == num_classes - 1) for i in order])
    return result


def multi_label_result(loss_sum: float, probs: list[list[float]], targets: list[list[int]]) -> dict:
    """A --multi-label evaluation: the mean loss, the figures at threshold 0.5 (`label_set_figures`: `accuracy`
    is the exact match, so history and --select-by read it as they read a single label's), and every row's
    probabilities and targets, from which `final_figures` chooses the threshold and figures again."""
    figures = label_set_figures(probs, targets, 0.5)
    return figures | {"loss": loss_sum / max(len(probs), 1), "probabilities": probs, "targets": targets}


def score_order(split: TokenizedSplit, rows: int, rank: int, world_size: int) -> tuple[list[int], int]:
    """Every row of `split` in the order the processes' probabilities are laid out (rank 0's rows in its batch
    order, then rank 1's, ...), and where this process's stretch begins."""
    lengths = [len(x) for x in split.ids]
    parts = [[i for b in length_sorted_batches(lengths, rows, r, world_size) for i in b] for r in range(world_size)]
    return [i for part in parts for i in part], sum(len(part) for part in parts[:rank])


def count_pairs(true: torch.Tensor, predicted: torch.Tensor, num_classes: int) -> torch.Tensor:
    """[num_classes, num_classes] float64 counts of each (true, predicted) pair: one-hot rows multiplied, not
    `bincount`, which on a GPU reads its input's largest value back to size its output (a host sync a batch)."""
    classes = torch.arange(num_classes, device=true.device)
    return (true[:, None] == classes).double().T @ (predicted[:, None] == classes).double()


def per_class(confusion: list[list[int]], label_names: list[str]) -> dict[str, dict]:
    """Precision, recall and F1 of each class from a [true, predicted] confusion matrix."""
    out = {}  # plain Python on the host's counts: no tensor, so nothing that a GPU check would count as a read
    for k, name in enumerate(label_names):
        tp, predicted, actual = confusion[k][k], sum(row[k] for row in confusion), sum(confusion[k])
        p = tp / predicted if predicted else 0.0
        r = tp / actual if actual else 0.0
        out[name] = {"precision": p, "recall": r, "f1": 2 * p * r / (p + r) if p + r else 0.0, "support": int(actual)}
    return out


def macro_f1(confusion: list[list[int]]) -> float:
    """The mean of the per-class F1 scores, over the classes that occur as a true or a predicted label (as
    scikit-learn's `f1_score(average="macro")` counts them): a rare class weighs as much as a common one, so a
    model that ignores it scores low even where its accuracy is high."""
    names = [str(k) for k in range(len(confusion))]
    present = [k for k in range(len(confusion)) if sum(confusion[k]) or sum(row[k] for row in confusion)]
    scores = per_class(confusion, names)
    return sum(scores[names[k]]["f1"] for k in present) / max(len(present), 1)


def label_set_figures(
    probs: list[list[float]], targets: list[list[int]], threshold: float, label_names: list[str] | None = None
) -> dict:
    """--multi-label figures with each label predicted when its probability is at or above `threshold`: the
    exact-match (subset) accuracy as `accuracy` (every label of the row right), micro-F1 (every (row, label)
    decision pooled: 2 TP / (2 TP + FP + FN)), macro-F1 (the mean of the labels' F1 over the labels present as
    true or predicted, as `macro_f1` counts classes; scikit-learn's multi-label macro average would count a label
    absent from both as F1 0), per-label precision, recall, F1 and support (`per_class` of each label's 2 x 2
    confusion matrix: the same keys as one label's classes) and the row count. Plain Python on the host."""
    names = label_names or [str(k) for k in range(len(targets[0]) if targets else 0)]
    predicted = [[int(p >= threshold) for p in row] for row in probs]
    labels, tp, fp, fn, present = {}, 0, 0, 0, []
    for k, name in enumerate(names):
        pairs = Counter((t[k], p[k]) for t, p in zip(targets, predicted, strict=True))
        matrix = [[pairs[0, 0], pairs[0, 1]], [pairs[1, 0], pairs[1, 1]]]  # [true, predicted]; 1: has the label
        labels[name] = per_class(matrix, ["no", "yes"])["yes"]
        tp, fp, fn = tp + pairs[1, 1], fp + pairs[0, 1], fn + pairs[1, 0]
        if pairs[1, 1] + pairs[0, 1] + pairs[1, 0]:  # true or predicted somewhere
            present.append(labels[name]["f1"])
    return {
        "accuracy": sum(p == t for p, t in zip(predicted, targets, strict=True)) / max(len(targets), 1),
        "micro_f1": 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0,
        "macro_f1": sum(present) / max(len(present), 1),
        "per_label": labels,
        "count": len(targets),
    }


def choose_threshold(probs: list[list[float]], targets: list[list[int]]) -> float:
    """The threshold of THRESHOLDS at which the validation rows' micro-F1 is highest; of equals, the one nearest
    0.5 (the sigmoid's own even odds, where training measured), then the lower. One threshold for every label:
    per-label thresholds would be fitted to a few validation rows each."""
    return max(
        THRESHOLDS,
        key=lambda t: (label_set_figures(probs, targets, t)["micro_f1"], -abs(round(20 * t) - 10), -t),
    )


def roc_auc(scores: list[float], positive: list[int]) -> float | None:
    """The area under the ROC curve: the chance that a positive row scores above a negative one, ties counted
    half (the Mann-Whitney rank statistic, with tied scores given their mean rank). None without both classes."""
    pairs = sorted(zip(scores, positive, strict=True))
    n_pos = sum(positive)
    n_neg = len(pairs) - n_pos
    if not n_pos or not n_neg:
        return None
    rank_sum, i = 0.0, 0
    while i < len(pairs):
        j = i
        while j < len(pairs) and pairs[j][0] == pairs[i][0]:
            j += 1
        rank_sum += (i + 1 + j) / 2 * sum(p for _, p in pairs[i:j])  # ranks i+1 .. j share their mean
        i = j
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def final_figures(results: dict[str, dict], label_names: list[str], threshold: float | None = None) -> dict:
    """metrics.json's figures from the final evaluation of each split ("train", "val", "test": `evaluate`'s
    results with the kept weights): accuracy, loss and macro-F1 per split, and the test split per class (with its
    confusion matrix, and its ROC AUC when it was asked for).

    Under --multi-label: one threshold for deciding each label, `threshold` (--threshold) or the one that
    maximises micro-F1 on the validation split (`choose_threshold`), said in `threshold` and
    `threshold_chosen_on`; every split's figures at it (`accuracy`: exact match), micro-F1 beside macro-F1, the
    test split per label; no confusion matrix (a text is in several classes at once)."""
    if not label_sets(results["test"]):
        test = results["test"]
        return {
            **{f"{k}_{m}": r[m] for m in ("accuracy", "loss", "macro_f1") for k, r in results.items()},
            **({"test_roc_auc": test["roc_auc"]} if "roc_auc" in test else {}),
            "test_per_class": per_class(test["confusion"], label_names),
            "test_confusion": test["confusion"],
        }
    val = results["val"]
    chosen = threshold if threshold is not None else choose_threshold(val["probabilities"], val["targets"])
    at = {k: label_set_figures(r["probabilities"], r["targets"], chosen, label_names) for k, r in results.items()}
    return {
        **{f"{k}_{m}": at[k][m] for m in ("accuracy", "micro_f1", "macro_f1") for k in results},
        **{f"{k}_loss": r["loss"] for k, r in results.items()},
        "test_per_class": at["test"]["per_label"],
        "threshold": chosen,
        "threshold_chosen_on": "validation" if threshold is None else "--threshold",
    }


def final_line(metrics: dict) -> str:
    """The run's last log line's figures: test accuracy (the bag-of-words baseline's beside it, val, train), or
    under --multi-label the test micro- and macro-F1 and exact-match accuracy at the run's threshold."""
    baseline = metrics.get("baseline", {}).get("test_accuracy")
    beside = "" if baseline is None else f"bag-of-words baseline {baseline:.2%}; "
    if "threshold" not in metrics:
        return (
            f"test accuracy {metrics['test_accuracy']:.2%} ({beside}val {metrics['val_accuracy']:.2%}, train "
            f"{metrics['train_accuracy']:.2%}"
        )
    origin = metrics["threshold_chosen_on"]
    origin = "given by --threshold" if origin == "--threshold" else f"chosen on {origin}"
    return (
        f"test micro-F1 {metrics['test_micro_f1']:.4f}, macro-F1 {metrics['test_macro_f1']:.4f}, exact match "
        f"{metrics['test_accuracy']:.2%} at threshold {metrics['threshold']:g} ({beside}{origin}; "
        f"val micro-F1 {metrics['val_micro_f1']:.4f}, train "
        f"{metrics['train_micro_f1']:.4f}"
    )


def selection_key(row: dict, select_by: str) -> tuple[float, float]:
    """What makes one evaluation better than another under `select_by` (greater is better): the measure itself,
    then on ties (common on a small validation split) the other of accuracy and loss."""
    if select_by == "loss":
        return -row["val_loss"], row["val_accuracy"]
    if select_by not in SELECT_BY:
        raise ValueError(f"--select-by must be one of {', '.join(SELECT_BY)}, got {select_by!r}")
    return row[f"val_{select_by}"], -row["val_loss"]


def history_line(row: dict, multi_label: bool) -> str:
    """An evaluation's history row as the log shows it (`loop.finish_epoch`): the running training figures and the
    validation split's, `accuracy` named for what it is (`accuracy_name`)."""
    acc = accuracy_name(multi_label) if multi_label else "acc"  # a short word on a long line
    return (
        f"epoch {row['epoch']}: step {row['step']}, train loss {row['train_loss']:.4f} {acc} "
        f"{row['train_accuracy']:.2%}, val loss {row['val_loss']:.4f} {acc} {row['val_accuracy']:.2%} "
        f"macro-F1 {row['val_macro_f1']:.4f}"
    )


def kept_row(history: list[dict], best_step: int, select_by: str, multi_label: bool = False) -> str:
    """Which evaluation's weights the run keeps, and why: the final figures are theirs, not the last row's (whose
    training figures were also counted on the batches as they trained, not in a pass of their own). `multi_label`:
    the run's `accuracy` is the exact match, and is called so."""
    best = next((r for r in history if r["step"] == best_step), None)
    if best is None:
        return "no epoch was evaluated: keeping the weights as they are"
    accuracy = accuracy_name(multi_label)
    if select_by == "loss":
        why = f"the lowest validation loss, {best['val_loss']:.4f}, at validation {accuracy} {best['val_accuracy']:.2%}"
    else:
        value = f"{best['val_accuracy']:.2%}" if select_by == "accuracy" else f"{best['val_macro_f1']:.4f}"
        shown = accuracy if select_by == "accuracy" else "macro-F1"
        why = f"the best validation {shown}, {value}, at validation loss {best['val_loss']:.4f}"
    unit = "step" if per_step(history) else "epoch"
    last = history[-1]
    if best is last:
        return f"keeping the last {unit}'s weights ({unit} {last[unit]}: {why})"
    return f"keeping {unit} {best[unit]}'s weights, not {unit} {last[unit]}'s ({why}); the figures below are for them"


def per_step(history: list[dict]) -> bool:
    """Whether the history has rows inside epochs (--eval-every), not one row an epoch."""
    return len({r["epoch"] for r in history}) < len(history)


OVERFIT_GAP = 0.10  # train accuracy this far above validation's: the weights learned the training rows themselves


def warn_if_overfit(metrics: dict, log) -> None:
    """Say so when the kept weights score far better on the training split than on validation: they fit the
    training rows rather than the task, and the test figure is validation's, not training's, to expect."""
    train, val = metrics.get("train_accuracy"), metrics.get("val_accuracy")
    if train is None or val is None or train - val <= OVERFIT_GAP:
        return
    log(
        f"note: train accuracy {train:.2%} is far above validation's {val:.2%} (epoch {metrics['best_epoch']}'s "
        "weights, kept for the best validation figure): the model fits its training rows more than the task. Try "
        "fewer trained blocks or epochs, a lower --lr, more data, or --search"
    )


def warn_if_one_class(val_accuracy: float, val_labels: list, log, val_micro_f1: float | None = None) -> None:
    """A model that learned nothing predicts the commonest class; its accuracy is then that class's share.

    Under --multi-label (`val_micro_f1` given) exact match says little: where most texts carry no label, answering
    none for every text matches most rows. A model that learned nothing there predicts no label at all, or none of
    the right ones: micro-F1 0."""
    if val_micro_f1 is not None:
        if val_micro_f1 <= 0:
            log(
                "warning: validation micro-F1 is 0: no validation text got any of its labels right at the "
                "threshold; the model has not learned the task. Try more data, more --epochs, a higher --lr, or "
                "--class-weights balanced for rare labels."
            )
        return
    majority = max(Counter(val_labels).values()) / max(len(val_labels), 1)
    if val_accuracy <= majority + 1e-9:
        log(
            f"warning: validation accuracy {val_accuracy:.2%} is no better than always answering the commonest "
            f"class ({majority:.2%}): the model has not learned the task. Try more data, more --epochs, a higher "
            "--lr, or --class-weights balanced for imbalanced labels."
        )

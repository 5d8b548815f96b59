"""The simple thing a fine-tuned model must beat: a bag-of-words logistic regression on the same splits.

A user's first question about their own data is "is this better than the simple thing?". So every run also fits,
in seconds on the CPU, the classic text classifier: each text becomes counts of its words, word pairs and
character 2-4-grams (TF-IDF weighted), and a linear layer with a softmax (one sigmoid per label under
--multi-label) is fitted on the training split. Its L2 penalty is chosen on the validation split, the one figure it
is tuned on, and its test figure is reported beside the model's. Where the model does not beat it, the run says so.

Plain torch on the host: the features are a sparse matrix, the fit is full-batch L-BFGS with its gradient written
out, the objective scikit-learn's `LogisticRegression` minimises (C x the summed loss + half the squared weights),
which the tests check against.
"""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

PENALTIES = (0.1, 1.0, 10.0, 100.0, 1000.0)  # the C values tried, from a strong penalty to a weak one
MAX_FEATURES = 100_000  # the most frequent n-grams kept: enough for tens of thousands of texts, small in memory
WORD = re.compile(r"\w+")


def ngrams(text: str) -> list[str]:
    """The n-grams a text is counted by: its lowercased words and word pairs, and the character 2- to 4-grams of
    each word padded by a space (so "spam" gives " s", "sp", ..., "am "): spelling variants and word pieces share
    features, which matters for short texts."""
    words = WORD.findall(text.lower())
    found = [f"w {w}" for w in words] + [f"w {a} {b}" for a, b in zip(words, words[1:], strict=False)]
    for w in words:
        padded = f" {w} "
        found += [f"c {padded[i : i + n]}" for n in (2, 3, 4) for i in range(len(padded) - n + 1)]
    return found


@dataclass
class Vocabulary:
    """The n-grams kept, each with its column and its inverse document frequency, learned from training texts."""

    index: dict[str, int]
    idf: torch.Tensor  # [features] float32

    @classmethod
    def fit(cls, texts: list[str], min_df: int = 2) -> Vocabulary:
        """N-grams found in at least `min_df` training texts (1 for tiny data), the MAX_FEATURES most common; idf
        as scikit-learn's smoothed one, log((1 + n) / (1 + df)) + 1, so a word in every text still counts a little."""
        df = Counter(g for t in texts for g in set(ngrams(t)))
        min_df = min_df if len(texts) >= 20 else 1
        kept = sorted((g for g, c in df.items() if c >= min_df), key=lambda g: (-df[g], g))[:MAX_FEATURES]
        kept.sort()
        idf = [math.log((1 + len(texts)) / (1 + df[g])) + 1 for g in kept]
        return cls({g: i for i, g in enumerate(kept)}, torch.tensor(idf, dtype=torch.float32))

    def features(self, texts: list[str]) -> torch.Tensor:
        """TF-IDF rows, sparse [texts, features]: sublinear counts (1 + log count), times idf, scaled to unit length."""
        rows, cols, values = [], [], []
        for r, text in enumerate(texts):
            counts = Counter(self.index[g] for g in ngrams(text) if g in self.index)
            rows += [r] * len(counts)
            cols += list(counts)
            values += [1 + math.log(c) for c in counts.values()]
        idx = torch.tensor([rows, cols], dtype=torch.long).reshape(2, -1)
        weights = torch.tensor(values, dtype=torch.float32) * self.idf[idx[1]]
        norms = torch.zeros(len(texts)).index_add_(0, idx[0], weights * weights).sqrt().clamp(min=1e-12)
        shape = (len(texts), len(self.index))
        return torch.sparse_coo_tensor(idx, weights / norms[idx[0]], shape, check_invariants=True).coalesce()


def fit_logistic(
    x: torch.Tensor,
    y: torch.Tensor,
    c: float,
    outputs: int,
    multi_label: bool,
    start: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [features, outputs] and bias [outputs] minimising C x the summed loss + |W|^2 / 2 (no penalty on the
    bias), as scikit-learn's LogisticRegression(C=c) does: softmax cross-entropy over `outputs` classes (y: class
    ids), or one sigmoid per label (y: multi-hot rows, `outputs` labels). `start`: the weights to start from (the
    fit at a neighbouring C is close: far fewer steps than from zero).

    The gradient is written out rather than left to autograd: (predicted - target) x C, times the features'
    transpose, plus W; the transpose is made once as a compressed sparse matrix, where autograd would transpose
    the sparse features again at every step, which dominated the time on 20,000 texts. In float64: L-BFGS stops on
    small changes that float32 would blur."""
    x64 = x.double().coalesce()
    with warnings.catch_warnings():  # torch calls its compressed sparse tensors beta; what is used here is plain
        warnings.simplefilter("ignore", UserWarning)
        rows, xt = x64.to_sparse_csr(), x64.t().coalesce().to_sparse_csr()
    w = torch.zeros(x.shape[1], outputs, dtype=torch.float64) if start is None else start[0].double().clone()
    b = torch.zeros(outputs, dtype=torch.float64) if start is None else start[1].double().clone()
    w.requires_grad_(), b.requires_grad_()
    target = y.double() if multi_label else F.one_hot(y, outputs).double()
    settings = {"max_iter": 200, "tolerance_grad": 1e-6, "history_size": 20, "line_search_fn": "strong_wolfe"}
    optimizer = torch.optim.LBFGS([w, b], lr=1, **settings)

    @torch.no_grad()
    def objective() -> torch.Tensor:
        logits = rows @ w + b
        if multi_label:  # log(1 + e^z) - t z, summed over texts and labels
            loss = (F.softplus(logits) - target * logits).sum()
            error = torch.sigmoid(logits) - target
        else:
            log_p = logits.log_softmax(-1)
            loss = -(target * log_p).sum()
            error = log_p.exp() - target
        w.grad, b.grad = c * (xt @ error) + w, c * error.sum(0)
        return c * loss + 0.5 * (w * w).sum()

    optimizer.step(objective)
    return w.detach().float(), b.detach().float()


def mean_loss(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, b: torch.Tensor, multi_label: bool) -> float:
    """The mean cross-entropy (binary, per label, under multi-label) of the fit's predictions for x."""
    logits = torch.sparse.mm(x, w) + b
    if multi_label:
        return F.binary_cross_entropy_with_logits(logits, y.float()).item()
    return F.cross_entropy(logits, y).item()


def predict(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, multi_label: bool) -> torch.Tensor:
    """Class ids [texts], or under multi-label each label at probability >= 0.5 [texts, labels] (a logit >= 0)."""
    logits = torch.sparse.mm(x, w) + b
    return (logits >= 0).long() if multi_label else logits.argmax(-1)


def accuracy(predicted: torch.Tensor, y: torch.Tensor, multi_label: bool) -> float:
    """The share of texts whose prediction is right: its class, or under multi-label all its labels (exact match)."""
    right = (predicted == y).all(-1) if multi_label else predicted == y
    return right.float().mean().item()


def fit_chosen_on_validation(
    x: dict[str, torch.Tensor], y: dict[str, torch.Tensor], num_classes: int, multi_label: bool
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """The fit on x["train"] at each C of PENALTIES, and the one chosen by validation accuracy (of equals, the lower
    validation loss): (C, weights, bias)."""
    best, fit = None, None
    for c in PENALTIES:  # from the strongest penalty to the weakest, each fit starting from the one before
        fit = w, b = fit_logistic(x["train"], y["train"], c, num_classes, multi_label, start=fit)
        val = accuracy(predict(x["val"], w, b, multi_label), y["val"], multi_label)
        key = (val, -mean_loss(x["val"], y["val"], w, b, multi_label))
        if best is None or key > best[0]:
            best = (key, c, w, b)
    _, c, w, b = best
    return c, w, b


def bag_of_words(splits: dict[str, tuple[list[str], list]], num_classes: int, multi_label: bool) -> dict:
    """Fit on splits["train"], choose C by validation accuracy (exact match under multi-label; of equals, the
    lower validation loss, as the run's own `--select-by` breaks ties: a small validation split ties often), and
    score every split: {"train_accuracy", "val_accuracy", "test_accuracy", "c",
    "features"}. `splits` maps a split's name to its texts and targets (class ids, or multi-hot rows)."""
    vocab = Vocabulary.fit(splits["train"][0])
    x = {k: vocab.features(texts) for k, (texts, _) in splits.items()}
    y = {k: torch.tensor(targets, dtype=torch.long) for k, (_, targets) in splits.items()}
    if len(vocab.index) == 0 or (not multi_label and y["train"].unique().numel() < 2):
        return {}  # nothing to fit: no n-gram shared by two texts, or a single class
    c, w, b = fit_chosen_on_validation(x, y, num_classes, multi_label)
    figures = {f"{k}_accuracy": accuracy(predict(x[k], w, b, multi_label), y[k], multi_label) for k in splits}
    return {**figures, "c": c, "features": len(vocab.index)}


def warn_if_no_better(metrics: dict, log, pooling: str = "last") -> None:
    """Say so when the bag-of-words baseline does at least as well on the test split as the fine-tuned model, and
    what to try: the question a user asks first of their own data is whether the model beats the simple thing.
    The advice follows the task suite (benchmarks/RESULTS.md, "Recipes on the task suite" and "Mean pooling"): the
    rate, the mean of every token's vector where words decide the class, and reading more of long texts moved the
    model there; training more blocks at a smaller rate did not, on average."""
    baseline = metrics["baseline"].get("test_accuracy")
    if baseline is None or metrics["test_accuracy"] > baseline:
        return
    what = "exact match" if metrics["multi_label"] else "test accuracy"
    first = "" if "search" in metrics else "--search (a few recipes tried on the validation split), "
    mean = "" if pooling == "mean" else "--pooling mean (the head reads every word, as the baseline does), "
    log(
        "note: a bag-of-words logistic regression does at least as well on this test split "
        f"({what} {baseline:.2%} against the model's {metrics['test_accuracy']:.2%}). Try {mean}{first}a longer "
        "--max-length if training texts were truncated, more epochs if the last one was kept, or a larger --model; "
        "a task decided by a few words may need no more than the baseline"
    )

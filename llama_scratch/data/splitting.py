"""Cutting labelled texts into train, validation and test splits, and the choices that make accuracies comparable
(or not). Each split is `LabelledTexts` still; `batching.TokenizedSplit` is one after the tokenizer.

Four protocols (`split_dataset`, chosen by `--split`): the book's balanced split, the same without repeated texts,
a stratified split that keeps every row, and a plain shuffled cut. Randomness comes only from the seed.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from .labelled import BUNDLED, DataError, DataWarning, LabelledTexts

PROTOCOLS = ("book", "dedup", "stratified", "full")


def default_protocol(name_or_path: str | Path) -> str:
    """`book` for the bundled SMS set (comparable with the book); `stratified` for user files.

    For user data, undersampling to the smallest class can throw most of it away (10,000 vs 200 rows leaves 400),
    so the default keeps every row and gives each split the same class proportions, which keeps rare classes in
    val and test. With imbalanced classes read the per-class precision/recall, not only accuracy.
    """
    return "book" if str(name_or_path) in BUNDLED else "stratified"


def dedup_key(text: str) -> str:
    """Texts equal up to case and whitespace count as duplicates (SMS: 5,159 distinct, vs 5,171 byte-exact)."""
    return " ".join(text.split()).casefold()


def first_occurrences(data: LabelledTexts) -> list[int]:
    """Indices of the first row of each distinct text (by `dedup_key`); warns if a text has two labels."""
    first: dict[str, int] = {}
    conflicts = 0
    for i, text in enumerate(data.texts):
        key = dedup_key(text)
        if key not in first:
            first[key] = i
        elif data.labels[first[key]] != data.labels[i]:
            conflicts += 1
    if conflicts:
        warnings.warn(f"{data.source}: {conflicts:,} repeats have another label; kept the first", DataWarning, 2)
    return sorted(first.values())


def shared_texts(a: LabelledTexts, b: LabelledTexts) -> int:
    """How many rows of `b` have a text (by `dedup_key`) that also occurs in `a`: leakage from train into test."""
    keys = {dedup_key(t) for t in a.texts}
    return sum(dedup_key(t) in keys for t in b.texts)


def split_dataset(
    data: LabelledTexts, protocol: str = "book", seed: int = 123, fractions: tuple[float, float] = (0.7, 0.1)
) -> dict[str, LabelledTexts]:
    """Train/val/test splits: train = int(0.7 n), val = int(0.1 n), test = the rest.

    - `book` (default for sms_spam), as in *Build a Large Language Model (From Scratch)*, ch. 6: undersample every
      class to the size of the smallest (a random subset), shuffle, cut. SMS: 747 + 747 = 1,494 -> 1045/149/300.
      The rows drawn differ from the book's: it sampled with pandas (random_state=123), and pandas' default
      quoting reads this file as 5,572 rows.
    - `dedup`: `book` after keeping only the first row of each distinct text, so no message is in both train and
      test (the book split has some: 403 SMS rows repeat an earlier text). SMS: 642 + 642 -> 898/128/258.
    - `stratified` (default for user files): every row; each split keeps the class proportions (within a row).
    - `full`: every row, shuffled, cut.
    Randomness comes only from `numpy.random.default_rng(seed)`, so a seed gives the same splits everywhere.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown split protocol {protocol!r}; choose one of: {', '.join(PROTOCOLS)}")
    rng = np.random.default_rng(seed)
    labels = np.asarray(data.labels)
    index = np.asarray(first_occurrences(data) if protocol == "dedup" else range(len(data)), dtype=np.int64)
    if protocol in ("book", "dedup"):
        members = [index[labels[index] == c] for c in range(data.num_classes)]
        smallest = min(len(m) for m in members)
        index = rng.permutation(np.concatenate([rng.choice(m, smallest, replace=False) for m in members]))
    elif protocol == "stratified":  # order rows by their position within their (shuffled) class, then cut
        position = np.empty(len(index))
        for c in range(data.num_classes):
            where = np.flatnonzero(labels == c)
            position[rng.permutation(where)] = (np.arange(len(where)) + 0.5) / max(len(where), 1)
        index = index[np.argsort(position, kind="stable")]
    else:
        index = rng.permutation(index)
    n = len(index)
    n_train, n_val = int(n * fractions[0]), int(n * fractions[1])
    parts = {"train": index[:n_train], "val": index[n_train : n_train + n_val], "test": index[n_train + n_val :]}
    if min(len(p) for p in parts.values()) == 0:
        sizes = "/".join(str(len(p)) for p in parts.values())
        raise DataError(f"{data.source}: {n} rows under '{protocol}' give train/val/test {sizes}; need more rows")
    if protocol == "stratified":  # the cut left each split ordered by position; mix the classes
        parts = {name: rng.permutation(p) for name, p in parts.items()}
    return {name: data.subset(p.tolist()) for name, p in parts.items()}

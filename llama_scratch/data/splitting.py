"""Cutting labelled texts into train, validation and test splits, and the choices that make accuracies comparable
(or not). Each split is `LabelledTexts` still; `batching.TokenizedSplit` is one after the tokenizer.

Four protocols (`split_dataset`, chosen by `--split`): the book's balanced split, the same without repeated texts,
a stratified split that keeps every row, and a plain shuffled cut. Randomness comes only from the seed.

A project's own validation or test file (`--val-data`, `--test-data`: `read_held_out`) replaces that split: it is
not cut from the data, whose rows it would have had train instead (`split_dataset`'s `given`), and its labels are
the training data's class ids. Its rows whose text is also in the training rows are counted (`overlap`), not refused.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection
from pathlib import Path

import numpy as np

from .labelled import BUNDLED, DataError, DataWarning, LabelledTexts, load_dataset

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
    data: LabelledTexts,
    protocol: str = "book",
    seed: int = 123,
    fractions: tuple[float, float] = (0.7, 0.1),
    given: Collection[str] = (),
) -> dict[str, LabelledTexts]:
    """Train/val/test splits: train = int(0.7 n), val = int(0.1 n), test = the rest.

    `given`: the splits that come from files of their own ("val", "test"), which are not cut: val = int(0.1 n) and
    test = n - int(0.7 n) - int(0.1 n) as without them, for those still cut, and train = every other row (the
    protocol's rows: `book` still undersamples). With both given, train is every row of `data`, uncut and in order,
    whatever the protocol.

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
    if {"val", "test"} <= set(given):
        return {"train": data.subset(range(len(data)))}
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown split protocol {protocol!r}; choose one of: {', '.join(PROTOCOLS)}")
    if data.multi_label and protocol in ("book", "dedup"):  # a text of several labels is in several classes
        raise DataError(
            f"--split {protocol} undersamples each class to the smallest, and under --multi-label a text has "
            "several classes; use --split stratified (each set of labels kept in proportion) or full"
        )
    rng = np.random.default_rng(seed)
    labels, kinds = strata(data)
    index = np.asarray(first_occurrences(data) if protocol == "dedup" else range(len(data)), dtype=np.int64)
    if protocol in ("book", "dedup"):
        members = [index[labels[index] == c] for c in range(kinds)]
        smallest = min(len(m) for m in members)
        index = rng.permutation(np.concatenate([rng.choice(m, smallest, replace=False) for m in members]))
    elif protocol == "stratified":  # order rows by their position within their (shuffled) class, then cut
        position = np.empty(len(index))
        for c in range(kinds):
            where = np.flatnonzero(labels == c)
            # Rows sit evenly along [0, 1), each stratum's first at `phase` / its size. A class is big, so the middle
            # (0.5) gives it its exact shares. Label sets are often 1 to 3 rows: at 0.5, a set of one row would always
            # train, one of two always give a row to validation; a random phase gives each split its expected share.
            phase = rng.random() if data.multi_label else 0.5
            position[rng.permutation(where)] = (np.arange(len(where)) + phase) / max(len(where), 1)
        index = index[np.argsort(position, kind="stable")]
    else:
        index = rng.permutation(index)
    n = len(index)
    n_val = 0 if "val" in given else int(n * fractions[1])
    n_test = 0 if "test" in given else n - int(n * fractions[0]) - int(n * fractions[1])
    n_train = n - n_val - n_test
    parts = {"train": index[:n_train], "val": index[n_train : n_train + n_val], "test": index[n_train + n_val :]}
    parts = {name: p for name, p in parts.items() if name not in given}
    if min(len(p) for p in parts.values()) == 0:
        sizes = "/".join(str(len(p)) for p in parts.values())
        raise DataError(f"{data.source}: {n} rows under '{protocol}' give {'/'.join(parts)} {sizes}; need more rows")
    if protocol == "stratified":  # the cut left each split ordered by position; mix the classes
        parts = {name: rng.permutation(p) for name, p in parts.items()}
    return {name: data.subset(p.tolist()) for name, p in parts.items()}


def strata(data: LabelledTexts) -> tuple[np.ndarray, int]:
    """What `stratified` keeps in proportion, as an id per row, and how many ids there are: the class, or under
    --multi-label the whole set of a text's labels (`sports;politics` one stratum, `sports` another, none a third).
    The stratified cut needs only an id per row, so a set serves as well as a class: each split then gets its
    share of every combination, and so of every label; a set of a few rows goes where a random phase puts it
    (`split_dataset`), so that small sets reach each split in proportion on average."""
    if not data.multi_label:
        return np.asarray(data.labels, dtype=np.int64), data.num_classes
    ids = {ys: k for k, ys in enumerate(sorted(set(data.labels)))}
    return np.asarray([ids[ys] for ys in data.labels], dtype=np.int64), len(ids)


def read_held_out(flag: str, path: str, train: LabelledTexts, columns: dict) -> LabelledTexts:
    """`--val-data` or `--test-data` (`flag`): a file read as `--data` was (`load_dataset`, the same `columns`
    flags), its labels renumbered as the training data's classes. A label the training data lacks is refused by
    name: the classifier has no output for it. Classes it lacks are fine (a small validation file may hold one)."""
    if not Path(path).is_file() and path not in BUNDLED:
        what = "a directory, not a file" if Path(path).is_dir() else "no such file"
        raise DataError(f"{flag} {path}: {what}")
    # One class, or few rows of each, is no wrong column; --multi-label files are read as --data was.
    held = load_dataset(path, **columns, held_out=True, multi_label=train.multi_label)
    index = {name: k for k, name in enumerate(train.label_names)}
    sets = held.label_sets()
    for k, name in enumerate(held.label_names):
        if name not in index:
            line = held.rows[next(i for i, ys in enumerate(sets) if k in ys)]
            known = ", ".join(train.label_names)
            raise DataError(f"{flag} {path} line {line}: label {name!r} is not in the training data ({known})")
    renumbered = [tuple(sorted(index[held.label_names[y]] for y in ys)) for ys in sets]
    return LabelledTexts(
        texts=held.texts,
        labels=renumbered if train.multi_label else [y for (y,) in renumbered],
        label_names=list(train.label_names),
        source=held.source,
        rows=held.rows,
        skipped=held.skipped,
        columns=held.columns,
        multi_label=train.multi_label,
    )


def overlap(train: LabelledTexts, held: LabelledTexts) -> str | None:
    """A line for the log when rows of `held` have a text (by `dedup_key`) that is also in `train`: how many, and
    the first one's line in each file. Not refused: a fixed test set is the project's to keep, but such rows
    measure memory, not held-out accuracy. None when there is none."""
    first: dict[str, int] = {}
    for text, row in zip(train.texts, train.rows or range(1, len(train) + 1), strict=True):
        first.setdefault(dedup_key(text), row)
    shared = [
        (row, first[key]) for text, row in zip(held.texts, held.rows, strict=True) if (key := dedup_key(text)) in first
    ]
    if not shared:
        return None
    (row, train_row), n = shared[0], len(shared)
    return (
        f"{held.source}: {n:,} of {len(held):,} rows have a text that is also in the training rows (first: line "
        f"{row}, as line {train_row} of {train.source}); kept, but they measure memory, not held-out accuracy"
    )


def split_with_files(
    data: LabelledTexts, protocol: str | None, seed: int, files: dict[str, str], columns: dict, log
) -> dict[str, LabelledTexts]:
    """Train/val/test: the splits in `files` ("val", "test": a path each) read from them (`read_held_out`, their
    overlap with the training rows logged), the others cut from `data` (`split_dataset`; `protocol` None: both
    files given, every row of `data` trains)."""
    parts = split_dataset(data, protocol or "full", seed=seed, given=files.keys())
    for name, path in files.items():
        parts[name] = read_held_out(f"--{name}-data", path, data, columns)
        log(parts[name].describe())
        if line := overlap(parts["train"], parts[name]):
            log(line)
    parts = {name: parts[name] for name in ("train", "val", "test")}
    sizes = {k: f"{k} {len(v):,}" + (f" ({files[k]})" if k in files else "") for k, v in parts.items()}
    cut = f"split '{protocol}'" if protocol else f"every row of {data.source} trains"
    log(f"{cut}: {', '.join(sizes.values())}")  # without files, the line it always was
    return parts

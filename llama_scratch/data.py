"""Datasets for classification: the bundled SMS Spam Collection and user files, splits, and padded batches.

The path of a dataset: `load_dataset` reads rows into `LabelledTexts` (bad rows are skipped and reported, never
fatal), `split_dataset` cuts train/val/test, `encode_texts` turns texts into token ids, and `make_loader` batches
them, padding each batch to its own longest row.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import re
import sys
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from tqdm import tqdm

BUNDLED = ("sms_spam",)
PROTOCOLS = ("book", "dedup", "stratified", "full")
TEXT_NAMES = ("text", "sentence", "message", "content", "body", "review", "document", "comment", "tweet", "sms")
LABEL_NAMES = ("label", "labels", "class", "category", "target", "sentiment", "intent", "topic")
_UNDECODABLE = re.compile("[\udc80-\udcff]")  # what errors="surrogateescape" turns non-UTF-8 bytes into
_INTEGER = re.compile(r"[+-]?\d+")


class DataError(ValueError):
    """A dataset that cannot be used: missing file, no usable rows, one class, columns that cannot be told apart."""


class DataWarning(UserWarning):
    """Bad rows were skipped. Filter this category (e.g. on DDP ranks > 0) to silence the report."""


@dataclass
class BadRow:
    line: int  # 1-based line number in the file where the row starts
    reason: str


@dataclass
class LabelledTexts:
    """Texts with integer class ids; `label_names[i]` names class i.

    `rows[k]` is the 1-based line of `texts[k]` in the source file, so a prediction can be traced back to the file
    and disjointness of splits can be checked even when texts repeat. `skipped` lists the rows that were not usable
    (splits carry an empty list: the skips belong to the file, not to a split).
    """

    texts: list[str]
    labels: list[int]
    label_names: list[str]
    source: str
    rows: list[int] = field(default_factory=list)
    skipped: list[BadRow] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.texts) != len(self.labels) or (self.rows and len(self.rows) != len(self.texts)):
            raise ValueError(f"{self.source}: texts, labels and rows differ in length")
        if any(not 0 <= y < len(self.label_names) for y in self.labels):
            raise ValueError(f"{self.source}: a label is outside 0..{len(self.label_names) - 1}")

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def num_classes(self) -> int:
        return len(self.label_names)

    def class_counts(self) -> dict[str, int]:
        counts = Counter(self.labels)
        return {name: counts[i] for i, name in enumerate(self.label_names)}

    def subset(self, indices: Iterable[int]) -> LabelledTexts:
        idx = [int(i) for i in indices]
        return LabelledTexts(
            texts=[self.texts[i] for i in idx],
            labels=[self.labels[i] for i in idx],
            label_names=list(self.label_names),
            source=self.source,
            rows=[self.rows[i] for i in idx] if self.rows else [],
        )

    def describe(self) -> str:
        """One line for logs, e.g. `sms_spam: 5,574 rows; ham 4,827, spam 747; 0 bad rows skipped`."""
        classes = ", ".join(f"{name} {n:,}" for name, n in self.class_counts().items())
        return f"{self.source}: {len(self):,} rows; {classes}; {len(self.skipped):,} bad rows skipped"

    def skipped_report(self, first: int = 5) -> str:
        """The first few skipped rows with their line numbers, for a warning or an error message."""
        shown = "; ".join(f"line {b.line}: {b.reason}" for b in self.skipped[:first])
        more = f" (and {len(self.skipped) - first:,} more)" if len(self.skipped) > first else ""
        hint = " (is the file UTF-8?)" if any("undecodable" in b.reason for b in self.skipped) else ""
        return f"{shown}{more}{hint}"


# ---------------------------------------------------------------------------------------------- loading


def load_sms_spam() -> LabelledTexts:
    """The bundled SMS Spam Collection (UCI, CC BY 4.0): 5,574 messages, 4,827 ham and 747 spam.

    Each line is `label<TAB>text`, read by splitting on the first TAB with no quote handling: 54 messages begin
    with `"` and a quoting CSV reader would merge lines (5,572 rows). Texts are kept byte-for-byte, including
    C1 control characters, HTML entities and surrounding whitespace (see `data/README.md`). A trailing CR is
    dropped from each line so a CRLF checkout (git autocrlf) reads the same as the original LF file.
    """
    raw = resources.files("llama_scratch").joinpath("data/sms_spam.tsv").read_bytes()
    texts, labels, rows = [], [], []
    for number, line in enumerate(raw.decode("utf-8").split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line:
            continue
        label, tab, text = line.partition("\t")
        if not tab or label not in ("ham", "spam"):
            raise DataError(f"bundled sms_spam.tsv line {number}: expected 'ham|spam<TAB>text', got {line[:60]!r}")
        texts.append(text)
        labels.append(0 if label == "ham" else 1)
        rows.append(number)
    return LabelledTexts(texts, labels, ["ham", "spam"], source="sms_spam", rows=rows)


def load_dataset(
    name_or_path: str | Path, text_column: str | None = None, label_column: str | None = None
) -> LabelledTexts:
    """A bundled dataset by name (`sms_spam`) or a `.csv`, `.tsv` or `.jsonl` file.

    CSV follows RFC 4180 quoting. TSV is split on TABs with no quoting (like the bundled file: a quote is just a
    character). Either may have a header row, recognised by a column named like `text`/`sentence`/`message` or
    `label`/`class`/`category`/`target` (or by `text_column`/`label_column`); without one, a two-column file's
    label column is the one with few distinct values, and `text_column`/`label_column` may be 0-based numbers.
    JSONL lines are objects with `text` and `label` keys (or the given ones). Labels are strings or integers;
    class ids follow the sorted label names (numerically when all are integers). Files may start with a UTF-8 BOM
    and use CRLF line ends. Bad rows are skipped and reported with a `DataWarning`.
    """
    if str(name_or_path) == "sms_spam":
        return load_sms_spam()
    path = Path(name_or_path)
    if not path.is_file():
        what = "a directory, not a file" if path.is_dir() else "no such file"
        raise DataError(f"{path}: {what} (and not a bundled dataset: {', '.join(BUNDLED)})")
    suffix = path.suffix.lower()
    raw = path.read_bytes().removeprefix(b"\xef\xbb\xbf")
    text = raw.decode("utf-8", errors="surrogateescape")  # undecodable bytes become markers, reported per row
    if suffix == ".jsonl":
        items, skipped = _read_jsonl(text, path, text_column, label_column)
    elif suffix in (".csv", ".tsv"):
        table = _csv_rows(text, path) if suffix == ".csv" else _tsv_rows(text)
        items, skipped = _read_table(list(table), path, text_column, label_column)
    else:
        raise DataError(f"{path}: unsupported file type {suffix!r}; use .csv, .tsv or .jsonl")
    return _build(items, skipped, path)


def _csv_rows(text: str, path: Path) -> Iterator[tuple[int, list[str]]]:
    """(starting line, cells) per CSV record; a quoted field may span lines. Blank lines are left out."""
    reader = csv.reader(io.StringIO(text, newline=""))
    limit = csv.field_size_limit()
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # long documents exceed the default 128 KiB per field
    try:
        start = 1
        for cells in reader:
            if any(c.strip() for c in cells):
                yield start, cells
            start = reader.line_num + 1
    except csv.Error as e:
        raise DataError(f"{path} line {reader.line_num}: unreadable CSV ({e})") from None
    finally:
        csv.field_size_limit(limit)


def _tsv_rows(text: str) -> Iterator[tuple[int, list[str]]]:
    """(line, cells) per line split on TABs. Splits on "\\n" only: str.splitlines would also break on U+0085."""
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if line.strip():
            yield number, line.split("\t")


def _find_column(cells: list[str], name: str) -> int | None:
    lowered = [c.strip().lower() for c in cells]
    if name in cells:
        return cells.index(name)
    return lowered.index(name.strip().lower()) if name.strip().lower() in lowered else None


def _first_known(cells: list[str], names: Sequence[str]) -> int | None:
    return next((i for i in (_find_column(cells, n) for n in names) if i is not None), None)


def _read_table(
    table: list[tuple[int, list[str]]], path: Path, text_column: str | None, label_column: str | None
) -> tuple[list[tuple[int, str, str]], list[BadRow]]:
    """Pick the text and label columns, then turn rows into (line, text, label) items or bad rows."""
    if not table:
        raise DataError(f"{path}: the file has no rows")
    ask = "pass --text-column and --label-column"
    header = table[0][1]
    given = [c for c in (text_column, label_column) if c is not None]
    known_text, known_label = _first_known(header, TEXT_NAMES), _first_known(header, LABEL_NAMES)
    has_header = known_text is not None or known_label is not None
    has_header = has_header or any(_find_column(header, c) is not None for c in given)
    if has_header:
        width, body = len(header), table[1:]
        ti = _find_column(header, text_column) if text_column is not None else known_text
        li = _find_column(header, label_column) if label_column is not None else known_label
        for name, index in ((text_column, ti), (label_column, li)):
            if name is not None and index is None:
                raise DataError(f"{path}: no column {name!r} in the header {header}")
        if width == 2 and (ti is None) != (li is None):
            ti, li = (1 - li, li) if ti is None else (ti, 1 - ti)
        if ti is None or li is None or ti == li:
            raise DataError(f"{path}: cannot tell the text and label columns apart in the header {header}; {ask}")
    else:
        width = Counter(len(cells) for _, cells in table).most_common(1)[0][0]
        body = table
        if given:
            numbers = [int(c) for c in given if _INTEGER.fullmatch(c.strip()) and 0 <= int(c) < width]
            if len(numbers) < 2 or numbers[0] == numbers[1]:
                raise DataError(
                    f"{path}: no header row (first row: {header}); {ask} as header names, "
                    f"or both as 0-based column numbers below {width}"
                )
            ti, li = numbers
        elif width != 2:
            raise DataError(f"{path}: no header row and {width} columns; {ask}")
        else:
            ti, li = _guess_columns([cells for _, cells in table if len(cells) == 2], path, ask)
    items, skipped = [], []
    for line, cells in body:
        if len(cells) != width:
            skipped.append(BadRow(line, f"expected {width} columns, found {len(cells)}"))
        else:
            _check_item(line, cells[ti], cells[li].strip(), items, skipped)
    return items, skipped


def _guess_columns(rows: list[list[str]], path: Path, ask: str) -> tuple[int, int]:
    """In a headerless two-column file, the label column has at most half as many distinct values as the text."""
    distinct = [len({r[i].strip() for r in rows}) for i in (0, 1)]
    label = int(distinct[1] < distinct[0])
    if 2 * distinct[label] > distinct[1 - label]:
        raise DataError(
            f"{path}: no header row, and the columns have {distinct[0]} and {distinct[1]} distinct values, "
            f"so neither is clearly the label; {ask} (0-based column numbers)"
        )
    return 1 - label, label


def _read_jsonl(
    text: str, path: Path, text_column: str | None, label_column: str | None
) -> tuple[list[tuple[int, str, str]], list[BadRow]]:
    """One JSON object per line; keys from the options, or the first known names in the first object."""
    items: list[tuple[int, str, str]] = []
    skipped: list[BadRow] = []
    keys: tuple[str, str] | None = None
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        if _UNDECODABLE.search(line):
            skipped.append(BadRow(number, "undecodable bytes (not UTF-8)"))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            skipped.append(BadRow(number, f"malformed JSON ({e.msg} at column {e.colno})"))
            continue
        if not isinstance(obj, dict):
            skipped.append(BadRow(number, f"not a JSON object but {type(obj).__name__}"))
            continue
        if keys is None:
            lowered = {str(k).lower(): k for k in obj}  # like CSV headers, known names match in any case
            tk = text_column or next((lowered[k] for k in TEXT_NAMES if k in lowered), None)
            lk = label_column or next((lowered[k] for k in LABEL_NAMES if k in lowered), None)
            if tk is None or lk is None:
                raise DataError(
                    f"{path} line {number}: cannot tell the text and label keys among {list(obj)}; "
                    "pass --text-column and --label-column"
                )
            keys = (tk, lk)
        value, label = obj.get(keys[0]), obj.get(keys[1])
        if value is None:
            skipped.append(BadRow(number, f"missing {keys[0]!r}"))
        elif not isinstance(value, str):
            skipped.append(BadRow(number, f"{keys[0]!r} is {type(value).__name__}, not a string"))
        elif isinstance(label, bool):  # before int: JSON true/false are bools, named "false" < "true"
            _check_item(number, value, str(label).lower(), items, skipped)
        elif isinstance(label, float) and label.is_integer():
            _check_item(number, value, str(int(label)), items, skipped)
        elif label is None or isinstance(label, int | str):
            _check_item(number, value, "" if label is None else str(label).strip(), items, skipped)
        else:
            skipped.append(BadRow(number, f"label {label!r} is not a string or an integer"))
    return items, skipped


def _check_item(line: int, text: str, label: str, items: list, skipped: list[BadRow]) -> None:
    if _UNDECODABLE.search(text) or _UNDECODABLE.search(label):
        skipped.append(BadRow(line, "undecodable bytes (not UTF-8)"))
    elif not text.strip():
        skipped.append(BadRow(line, "empty text"))
    elif not label:
        skipped.append(BadRow(line, "missing label"))
    else:
        items.append((line, text, label))


def _build(items: list[tuple[int, str, str]], skipped: list[BadRow], path: Path) -> LabelledTexts:
    """Number the classes, refuse data that cannot train a classifier, and warn about skipped rows."""
    data = LabelledTexts([], [], [], source=str(path), skipped=skipped)
    if not items:
        raise DataError(f"{path}: no usable rows" + (f"; skipped {data.skipped_report()}" if skipped else ""))
    integers = all(_INTEGER.fullmatch(label) for _, _, label in items)
    if integers:  # "1", "01" and "+1" are one class; names sort numerically so 2 < 10
        items = [(line, text, str(int(label))) for line, text, label in items]
    names = sorted({label for _, _, label in items}, key=int if integers else None)
    if len(names) < 2:
        raise DataError(f"{path}: only one class ({names[0]!r}) in {len(items):,} rows; a classifier needs two")
    index = {name: i for i, name in enumerate(names)}
    data = LabelledTexts(
        texts=[text for _, text, _ in items],
        labels=[index[label] for _, _, label in items],
        label_names=names,
        source=str(path),
        rows=[line for line, _, _ in items],
        skipped=skipped,
    )
    if skipped:
        warnings.warn(f"{path}: skipped {len(skipped):,} bad rows: {data.skipped_report()}", DataWarning, 3)
    return data


# ---------------------------------------------------------------------------------------------- splits


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


# ---------------------------------------------------------------------------------------------- batching


class Encoder(Protocol):
    """What the data code needs from a tokenizer (our `Tokenizer`, or any object with these two members)."""

    pad_id: int

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]: ...


def encode_texts(
    texts: Sequence[str], tokenizer: Encoder, max_length: int | None = None, progress: bool = False
) -> tuple[list[list[int]], int]:
    """Token ids with BOS (no EOS) per text, and how many were truncated.

    Truncation keeps the first `max_length` tokens (BOS included) and drops the end: the classifier then reads
    the last kept token, so the model never sees the tail. `max_length=None` keeps everything.
    """
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be at least 1, got {max_length}")
    ids = [tokenizer.encode(t, bos=True, eos=False) for t in tqdm(texts, "tokenizing", disable=not progress)]
    if max_length is None:
        return ids, 0
    return [x[:max_length] for x in ids], sum(len(x) > max_length for x in ids)


def default_max_length(token_lists: Sequence[Sequence[int]], model_max: int) -> int:
    """Long enough for the longest row, capped by the model's context (batches pad only to their own longest)."""
    if not token_lists:
        raise ValueError("no token lists to measure")
    return min(max(len(x) for x in token_lists), model_max)


class EncodedDataset(Dataset):
    """(token ids, class id) pairs, kept as lists: rows differ in length until `collate` pads a batch."""

    def __init__(self, token_ids: Sequence[Sequence[int]], labels: Sequence[int]) -> None:
        if len(token_ids) != len(labels):
            raise ValueError(f"{len(token_ids)} token lists but {len(labels)} labels")
        if any(len(x) == 0 for x in token_ids):
            raise ValueError("an encoded row is empty; encode with bos=True so every row has a real token")
        self.token_ids, self.labels = token_ids, labels

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, i: int) -> tuple[Sequence[int], int]:
        return self.token_ids[i], int(self.labels[i])


def collate(
    batch: Sequence[tuple[Sequence[int], int]], pad_id: int, padding_side: str = "right"
) -> dict[str, torch.Tensor]:
    """Pad to the batch's longest row: `input_ids` [B, T], `attention_mask` [B, T] (1 = real), `labels` [B].

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


def make_loader(
    encoded: Sequence[Sequence[int]],
    labels: Sequence[int],
    batch_size: int,
    shuffle: bool,
    seed: int,
    pad_id: int,
    sampler: Sampler | None = None,
    *,
    padding_side: str = "right",
    num_replicas: int = 1,
    rank: int = 0,
) -> DataLoader:
    """A DataLoader of padded batches whose order depends only on (seed, epoch): call `loader.sampler.set_epoch`.

    Without `sampler` it uses `DistributedSampler(num_replicas, rank, shuffle, seed)`: with the defaults that is
    a single process seeing exactly the order one DDP replica would (batch 8 on one process = the union of batch 4
    on each of two ranks), and under DDP pass `num_replicas`/`rank` (or your own sampler). That sampler pads the
    last round with repeated rows so every rank gets the same count; count evaluation samples accordingly.
    The loader gets its own seeded `torch.Generator` so iterating it never draws from the global torch RNG.
    """
    dataset = EncodedDataset(encoded, labels)
    if sampler is None:
        sampler = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=functools.partial(collate, pad_id=pad_id, padding_side=padding_side),
        generator=torch.Generator().manual_seed(seed),
    )

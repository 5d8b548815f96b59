"""Labelled texts for classification: the bundled SMS Spam Collection, the user's CSV, TSV, TXT, JSONL or Parquet
files, and Hugging Face dataset repositories (`owner/name`, made local by `hub_data`).

`load_dataset` reads rows into `LabelledTexts`; bad rows are skipped and reported (file, line, why), never fatal.
The file formats themselves (encoding checks, CSV/TSV/TXT/JSONL parsing) are in `data_files`.
What follows: `splitting.split_dataset` cuts train/val/test, and `batching` turns texts into padded token batches.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .formats import (
    COLUMN_SAMPLE,
    UNDECODABLE,
    Column,
    DataError,
    Table,
    decode,
    find_column,
    first_known,
    guess_columns,
    jsonl_objects,
    looks_like_header,
    parquet_columns,
    table_rows,
)
from .hub import dataset_files, is_dataset_id

BUNDLED = ("sms_spam",)
TEXT_NAMES = ("text", "sentence", "message", "content", "body", "review", "document", "comment", "tweet", "sms")
LABEL_NAMES = ("label", "labels", "class", "category", "target", "sentiment", "intent", "topic")
_INTEGER = re.compile(r"[+-]?\d+")
MAX_CLASSES = 1000  # more is a wrong label column, not a task; evaluation keeps a classes x classes confusion matrix
MAX_LABEL_DIGITS = 18  # any such integer fits in 64 bits
FEW_CLASSES = 10  # up to this many classes a tiny file may have one row each; beyond, at least two rows per class
SEPARATOR = ";"  # between the labels of one text under --multi-label (`sports;politics`)
MULTI_LABEL_HINT = f" (most labels hold {SEPARATOR!r}: several labels per text? --multi-label)"


class DataWarning(UserWarning):
    """Bad rows were skipped. Filter this category (e.g. on DDP ranks > 0) to silence the report."""


@dataclass
class BadRow:
    line: int  # 1-based line number in the file where the row starts
    reason: str


@dataclass
class LabelledTexts:
    """Texts with integer class ids; `label_names[i]` names class i.

    `multi_label` (--multi-label): each text has zero or more of the labels, and `labels[k]` is the sorted tuple of
    its class ids (an empty tuple: none of them); otherwise `labels[k]` is the one class id of text k.

    `rows[k]` is the 1-based line of `texts[k]` in the source file, so a prediction can be traced back to the file
    and disjointness of splits can be checked even when texts repeat. `skipped` lists the rows that were not usable
    (splits carry an empty list: the skips belong to the file, not to a split).
    """

    texts: list[str]
    labels: list[int] | list[tuple[int, ...]]
    label_names: list[str]
    source: str
    rows: list[int] = field(default_factory=list)
    skipped: list[BadRow] = field(default_factory=list)
    columns: str = ""  # where the texts and labels came from, e.g. "text 'review', label 'stars' (header row)"
    multi_label: bool = False

    def __post_init__(self) -> None:
        if len(self.texts) != len(self.labels) or (self.rows and len(self.rows) != len(self.texts)):
            raise ValueError(f"{self.source}: texts, labels and rows differ in length")
        if any(not 0 <= y < len(self.label_names) for ys in self.label_sets() for y in ys):
            raise ValueError(f"{self.source}: a label is outside 0..{len(self.label_names) - 1}")

    def label_sets(self) -> list[tuple[int, ...]]:
        """Each text's class ids as a tuple, in either mode (one id each without --multi-label)."""
        return list(self.labels) if self.multi_label else [(y,) for y in self.labels]

    def targets(self) -> list[int] | list[list[int]]:
        """What the loss compares the logits with: the class ids, or under --multi-label a multi-hot row per text
        (1 for each of its labels, 0 for the others: [texts, classes] once a batch makes it a tensor)."""
        if not self.multi_label:
            return list(self.labels)
        return [[int(k in ys) for k in range(self.num_classes)] for ys in self.labels]

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def num_classes(self) -> int:
        return len(self.label_names)

    def class_counts(self) -> dict[str, int]:
        """Rows of each class; under --multi-label, the rows carrying each label (a row may count for several)."""
        counts = Counter(y for ys in self.label_sets() for y in ys)
        return {name: counts[i] for i, name in enumerate(self.label_names)}

    def subset(self, indices: Iterable[int]) -> LabelledTexts:
        idx = [int(i) for i in indices]
        return LabelledTexts(
            texts=[self.texts[i] for i in idx],
            labels=[self.labels[i] for i in idx],
            label_names=list(self.label_names),
            source=self.source,
            rows=[self.rows[i] for i in idx] if self.rows else [],
            multi_label=self.multi_label,
        )

    def describe(self) -> str:
        """One line for logs, e.g. `sms_spam: 5,574 rows; ham 4,827, spam 747; 0 bad rows skipped`.

        A user's file adds the columns read, e.g. `; text 'review', label 'stars' (header row)`: they were guessed.
        Under --multi-label the counts are rows carrying each label, and the rows with none are counted too;
        without it, labels that mostly hold the separator get a hint that several labels per text were meant.
        """
        classes = ", ".join(f"{name} {n:,}" for name, n in self.class_counts().items())
        if self.multi_label:
            classes = f"multi-label: {classes}; {sum(not ys for ys in self.labels):,} with none"
        elif 2 * sum(SEPARATOR in self.label_names[y] for y in self.labels) > len(self):
            classes += MULTI_LABEL_HINT
        columns = f"; {self.columns}" if self.columns else ""
        return f"{self.source}: {len(self):,} rows; {classes}; {len(self.skipped):,} bad rows skipped{columns}"

    def fingerprint(self) -> str:
        """A digest of the texts, labels and label names: an edited data file, or other columns, changes it."""
        digest = hashlib.sha256(json.dumps([self.label_names, self.labels]).encode())
        for text in self.texts:
            digest.update(text.encode("utf-8", "surrogatepass") + b"\0")
        return digest.hexdigest()

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
    name_or_path: str | Path,
    text_column: str | None = None,
    label_column: str | None = None,
    header: bool | None = None,
    split: str = "train",
    held_out: bool = False,
    multi_label: bool = False,
) -> LabelledTexts:
    """A bundled dataset by name (`sms_spam`), a `.csv`, `.tsv`, `.txt`, `.jsonl` or `.parquet` file, or the `split`
    of a Hugging Face dataset repository `owner/name` (fetched once into the Hugging Face cache; see `hub_data`).

    CSV follows RFC 4180 quoting. TSV is split on TABs, and unquoted only when it is csv-quoted throughout (Python's
    csv writer, pandas); one with stray quotes (like the bundled file) keeps every quote (`data_files.tsv_table`;
    `describe()` says which). A `.txt` file is read as TSV when its first 100 rows have the same number of TABs,
    else as CSV when they have the same number of comma-separated fields (UCI's sentiment sets are
    `sentence<TAB>label` .txt files).
    Any of these may have a header row: one naming a column like `text`/`sentence`/`message` or `label`/`class`/
    `category`/`target` (or `text_column`/`label_column`), or one whose cells are unlike the rest of their columns
    (`rating` atop pos/neg/pos, `id` atop numbers, `feedback` atop long texts); `header` True or False says so
    instead. Columns not named are told apart by their values: the label has few distinct values, the text the
    longest ones, and an id column (every value distinct) is neither. `text_column`/`label_column` may also be
    0-based column numbers.
    JSONL lines are objects with `text` and `label` keys (or the given ones, or keys told apart by their values
    like a table's columns: `json_keys`). Labels are strings or integers;
    class ids follow the sorted label names (numerically when all are integers). Files may start with a UTF-8 BOM
    and use CRLF line ends. A Parquet file's columns are found by name like JSONL keys (pyarrow reads only those
    two). Bad rows are skipped and reported with a `DataWarning`.

    `held_out`: a validation or test file, whose labels the training data's vouch for (`splitting.read_held_out`):
    one class, or few rows per class, is then no sign of a wrong label column, and is not refused.

    `multi_label` (--multi-label): a label cell holds zero or more labels separated by `;` (`sports;politics`,
    whitespace around each ignored); an empty cell means none of them rather than a missing label. The classes
    are the distinct single labels. A file of one label per row reads the same way, each row one label.
    """
    if str(name_or_path) == "sms_spam":
        if multi_label:  # never a silent single-label run under a multi-label flag
            raise DataError(
                "sms_spam has one label per text (ham or spam); --multi-label needs a file whose label "
                "column holds ';'-separated labels"
            )
        return load_sms_spam()
    path = Path(name_or_path)
    if not path.exists() and is_dataset_id(str(name_or_path)):
        files = dataset_files(str(name_or_path), split)
        if files[0].suffix.lower() == ".parquet":
            items, skipped, columns = _read_parquet(files, text_column, label_column)
            return _build(items, skipped, f"{name_or_path} ({split})", columns, held_out, multi_label)
        path = files[0]
    if not path.is_file():
        what = "a directory, not a file" if path.is_dir() else "no such file"
        raise DataError(f"{path}: {what} (and not a bundled dataset: {', '.join(BUNDLED)})")
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".tsv", ".txt", ".jsonl", ".parquet"):  # before reading: an .xlsx is no NUL-byte error
        raise DataError(f"{path}: unsupported file type {suffix!r}; use .csv, .tsv, .txt, .jsonl or .parquet")
    if suffix == ".parquet":
        items, skipped, columns = _read_parquet([path], text_column, label_column)
        return _build(items, skipped, path, columns, held_out, multi_label)
    text = decode(path.read_bytes(), path)
    if suffix == ".jsonl":
        items, skipped, columns = _read_jsonl(text, path, text_column, label_column)
        return _build(items, skipped, path, columns, held_out, multi_label)
    table, quotes = table_rows(text, path)
    items, skipped, columns = _read_table(table, path, text_column, label_column, header)
    columns = f"{columns}; {quotes}" if quotes else columns
    return _build(items, skipped, path, columns, held_out, multi_label)


def _read_table(
    table: list[tuple[int, list[str]]],
    path: Path,
    text_column: str | None,
    label_column: str | None,
    header: bool | None,
) -> tuple[list[tuple[int, str, str]], list[BadRow], str]:
    """Find the header row and the text and label columns, then turn rows into (line, text, label) items or bad rows."""
    found = find_columns(table, path, text_column, label_column, header)
    items, skipped = [], []
    for line, cells in found.body:
        if len(cells) != found.width:
            skipped.append(BadRow(line, f"expected {found.width} columns, found {len(cells)}"))
        else:
            _check_item(line, cells[found.text], cells[found.label].strip(), items, skipped)
    return items, skipped, found.describe()


@dataclass
class TableColumns:
    """Where a table's texts (and labels) are: its rows below any header, their width, and the columns."""

    where: Table  # the first row and whether it is a header, for names and messages
    body: list[tuple[int, list[str]]]
    width: int
    text: int
    label: int | None  # None: no label was wanted, and none was clear
    guessed: bool  # told from the cells (a header row by its contents, or columns by their values), not by a name

    def describe(self) -> str:
        """How the table was read, e.g. "text 'review', label 'stars' (header row)", as training logs it."""
        label = "" if self.label is None else f", label {self.where.name(self.label)}"
        return f"text {self.where.name(self.text)}{label} ({'header row' if self.where.header else 'no header row'})"


def find_columns(
    table: list[tuple[int, list[str]]],
    path: Path,
    text_column: str | None,
    label_column: str | None,
    header: bool | None = None,
    need_label: bool = True,
    is_label: Callable[[str], bool] | None = None,
) -> TableColumns:
    """The one column finder, for training's tables and classify's alike: a header row if the first row names a
    known column (TEXT_NAMES, LABEL_NAMES) or a given one, or if its cells are unlike their columns'
    (`looks_like_header`; `header` True or False says so instead); the text and label columns as given (header
    names or 0-based numbers), else by known names, else told apart by their values (`guess_columns`).

    A single column is a header only by name: with nothing beside it to compare, a short first text would look like
    a column name (classify reads one-column files: a list of texts). `need_label` False (classify without
    --labels) wants only the text column; `is_label` (classify: one of the run's label names) helps both guesses.
    """
    if not table:
        raise DataError(f"{path}: the file has no rows")
    first = table[0][1]
    named = any(find_column(first, c) is not None for c in (text_column, label_column) if c is not None)
    known = first_known(first, TEXT_NAMES) is not None or first_known(first, LABEL_NAMES) is not None
    if header is None:
        found = known or (not named and len(first) > 1 and looks_like_header(table, is_label))
        where = Table(path, first, named or found, detected=found, need_label=need_label)
    else:
        where = Table(path, first, header, detected=False, need_label=need_label)
    guessed = where.detected and not known
    body = table[1:] if where.header else table
    width = len(first) if where.header else Counter(len(cells) for _, cells in table).most_common(1)[0][0]
    ti, li = (_given_column(where, c, width) for c in (text_column, label_column))
    if where.header:
        ti = first_known(first, TEXT_NAMES) if text_column is None else ti
        li = first_known(first, LABEL_NAMES) if label_column is None else li
    if ti is None or (li is None and need_label):
        rows = [cells for _, cells in body[:COLUMN_SAMPLE] if len(cells) == width]
        ti, li = guess_columns(where, [Column.of(rows, j) for j in range(width)], ti, li, is_label)
        guessed = True
    if ti == li:
        raise where.unclear(f"the text and the label are both {where.name(ti)}")
    return TableColumns(where, body, width, ti, li, guessed)


def _given_column(where: Table, name: str | None, width: int) -> int | None:
    """The column a --text-column or --label-column names: a header cell, else a 0-based column number."""
    if name is None:
        return None
    if where.header and (index := find_column(where.first, name)) is not None:
        return index
    if _INTEGER.fullmatch(name.strip()) and 0 <= int(name) < width:
        return int(name)
    if where.header:
        raise DataError(f"{where.path}: no column {name!r} in the header {where.first}")
    raise DataError(
        f"{where.path}: no header row (first row: {where.first}) and no column {name!r}; pass {where.flags()} as "
        f"header names, or as 0-based column numbers below {width}"
    )


def _read_jsonl(
    text: str, path: Path, text_column: str | None, label_column: str | None
) -> tuple[list[tuple[int, str, str]], list[BadRow], str]:
    """One JSON object per line; the text and label keys as `json_keys` finds them."""
    objects = list(jsonl_objects(text, path))
    items: list[tuple[int, str, str]] = []
    skipped = [BadRow(number, problem) for number, obj, problem in objects if obj is None]
    if len(skipped) == len(objects):
        return items, skipped, ""  # no object at all: _build says so, with the skipped lines
    tk, lk = json_keys(objects, path, text_column, label_column)
    for number, obj, _ in objects:
        if obj is not None:
            _check_value(number, obj.get(tk), obj.get(lk), tk, items, skipped)
    skipped.sort(key=lambda bad: bad.line)
    return items, skipped, f"text {tk!r}, label {lk!r} (JSON keys)"


def json_keys(
    objects: list[tuple[int, dict | None, str]],
    path: Path,
    text_key: str | None,
    label_key: str | None,
    label: bool = True,
    is_label: Callable[[str], bool] | None = None,
) -> tuple[str, str | None]:
    """The text and label keys of JSON Lines objects (as `jsonl_objects` reads them): the given ones, else the first
    known names (TEXT_NAMES, LABEL_NAMES) among the first object's keys, found like header cells.

    Keys with other names (`docstring`, `package`) are told apart by their values in the first COLUMN_SAMPLE
    objects, as a table's unnamed columns are (`guess_columns`): the label has few distinct values, the text the
    longest strings. `label` False: only the text key is needed (classify without --labels); the label key may
    then be None. `is_label` is what classify knows besides, as for a table (`find_columns`).
    """
    number, first = next((number, obj) for number, obj, _ in objects if obj is not None)
    keys = [str(k) for k in first]
    known = [None if i is None else keys[i] for i in (first_known(keys, TEXT_NAMES), first_known(keys, LABEL_NAMES))]
    tk = text_key if text_key is not None else known[0]
    lk = label_key if label_key is not None else known[1]
    if tk is not None and (lk is not None or not label):
        return tk, lk
    where = Table(path, keys, header=True, detected=False, json_line=number, need_label=label)
    sample = [[_json_cell(obj.get(k)) for k in keys] for _, obj, _ in objects[:COLUMN_SAMPLE] if obj is not None]
    given = [None if k is None else find_column(keys, k) for k in (tk, lk)]
    for k, index in zip((tk, lk), given, strict=True):
        if k is not None and index is None:
            raise DataError(f"{path} line {number}: no key {k!r} among {keys}; pass --text-column and --label-column")
    ti, li = guess_columns(where, [Column.of(sample, j) for j in range(len(keys))], *given, is_label)
    return keys[ti], None if li is None else keys[li]


def _json_cell(value: object) -> str:
    """A JSON value as a table cell for telling keys apart: a string, or a label as `_check_value` reads it; other
    values (lists, objects, fractions, null) are no text and no label, so empty."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return value if isinstance(value, str) else str(value) if isinstance(value, int) else ""


def _read_parquet(
    paths: list[Path], text_column: str | None, label_column: str | None
) -> tuple[list[tuple[int, str, str]], list[BadRow], str]:
    """Parquet shards' text and label columns as items; a bad row's "line" is its 1-based row across the shards."""
    texts, labels, tk, lk = parquet_columns(paths, text_column, label_column, TEXT_NAMES, LABEL_NAMES)
    items: list[tuple[int, str, str]] = []
    skipped: list[BadRow] = []
    for number, (value, label) in enumerate(zip(texts, labels, strict=True), start=1):
        _check_value(number, value, label, tk, items, skipped)
    return items, skipped, f"text {tk!r}, label {lk!r} (Parquet columns)"


def _check_value(number: int, value: object, label: object, key: str, items: list, skipped: list[BadRow]) -> None:
    """A JSON or Parquet row's text (a string) and label (a string, an integer, a whole float or a bool, or a list
    of strings and integers: a set of labels, read as its SEPARATOR-joined cell, so `["sports", "politics"]` is
    `sports;politics` and `[]` is none; without --multi-label a list of one label is that label)."""
    if isinstance(label, list) and all(isinstance(y, int | str) and not isinstance(y, bool) for y in label):
        label = SEPARATOR.join(str(y).strip() for y in label)
    if value is None:
        skipped.append(BadRow(number, f"missing {key!r}"))
    elif not isinstance(value, str):
        skipped.append(BadRow(number, f"{key!r} is {type(value).__name__}, not a string"))
    elif isinstance(label, bool):  # before int: JSON true/false are bools, named "false" < "true"
        _check_item(number, value, str(label).lower(), items, skipped)
    elif isinstance(label, float) and label.is_integer():
        _check_item(number, value, str(int(label)), items, skipped)
    elif label is None or isinstance(label, int | str):
        _check_item(number, value, "" if label is None else str(label).strip(), items, skipped)
    else:
        skipped.append(BadRow(number, f"label {label!r} is not a string or an integer"))


def _check_item(line: int, text: str, label: str, items: list, skipped: list[BadRow]) -> None:
    if UNDECODABLE.search(text) or UNDECODABLE.search(label):
        skipped.append(BadRow(line, "undecodable bytes (not UTF-8)"))
    elif not text.strip():
        skipped.append(BadRow(line, "empty text"))
    else:  # an empty label is "none of the labels" under --multi-label, else a bad row (`_build` decides)
        items.append((line, text, label))


def _check_label_digits(items: list[tuple[int, str, str]], path: Path) -> None:
    """Refuse numeric labels longer than MAX_LABEL_DIGITS: an id column, or a broken file (int() stops at 4,300)."""
    for line, _, label in items:
        digits = len(label.lstrip("+-"))
        if digits > MAX_LABEL_DIGITS and _INTEGER.fullmatch(label):
            raise DataError(
                f"{path} line {line}: the label is a {digits:,}-digit number (at most {MAX_LABEL_DIGITS}); "
                "wrong label column? (--label-column)"
            )


def _check_class_count(names: list[str], rows: int, path: Path) -> None:
    """Refuse about one row per class: a text or id column taken as the label, which no classifier can learn."""
    if len(names) > MAX_CLASSES:
        why = f"more than the {MAX_CLASSES:,} classes allowed"
    elif len(names) > FEW_CLASSES and 2 * len(names) > rows:
        why = "fewer than two rows per class"
    else:
        return
    shown = ", ".join(repr(name[:30]) for name in names[:3])
    hint = MULTI_LABEL_HINT if 2 * sum(SEPARATOR in name for name in names) > len(names) else ""
    raise DataError(
        f"{path}: {len(names):,} distinct labels in {rows:,} rows ({shown}, ...), {why}; "
        f"wrong label column? (--label-column){hint}"
    )


def _build(
    items: list[tuple[int, str, str]],
    skipped: list[BadRow],
    path: Path | str,
    columns: str = "",
    held_out: bool = False,
    multi_label: bool = False,
) -> LabelledTexts:
    """Number the classes, refuse data that cannot train a classifier (unless `held_out`: it only evaluates one),
    and warn about skipped rows. `multi_label`: each label cell holds zero or more labels separated by SEPARATOR
    (an empty cell: none of them); the classes are the distinct single labels."""
    if not multi_label and (missing := [BadRow(line, "missing label") for line, _, label in items if not label]):
        items = [item for item in items if item[2]]
        skipped = sorted(skipped + missing, key=lambda bad: bad.line)
    data = LabelledTexts([], [], [], source=str(path), skipped=skipped)
    if not items:
        raise DataError(f"{path}: no usable rows" + (f"; skipped {data.skipped_report()}" if skipped else ""))
    cells = [label_set(label) if multi_label else (label,) for _, _, label in items]
    singles = [(line, "", label) for (line, _, _), labels in zip(items, cells, strict=True) for label in labels]
    _check_label_digits(singles, path)
    integers = all(_INTEGER.fullmatch(label) for _, _, label in singles)
    if integers:  # "1", "01" and "+1" are one class; names sort numerically so 2 < 10
        cells = [tuple(dict.fromkeys(str(int(label)) for label in labels)) for labels in cells]
    names = sorted({label for labels in cells for label in labels}, key=int if integers else None)
    if not held_out:
        _check_classes(names, cells, path, multi_label)
    index = {name: i for i, name in enumerate(names)}
    ids = [tuple(sorted(index[label] for label in labels)) for labels in cells]
    data = LabelledTexts(
        texts=[text for _, text, _ in items],
        labels=ids if multi_label else [y for (y,) in ids],
        label_names=names,
        source=str(path),
        rows=[line for line, _, _ in items],
        skipped=skipped,
        columns=columns,
        multi_label=multi_label,
    )
    if skipped:
        warnings.warn(f"{path}: skipped {len(skipped):,} bad rows: {data.skipped_report()}", DataWarning, 3)
    return data


def label_set(cell: str) -> tuple[str, ...]:
    """The labels of one --multi-label cell: split on SEPARATOR, each stripped, empty pieces and repeats dropped."""
    return tuple(dict.fromkeys(part.strip() for part in cell.split(SEPARATOR) if part.strip()))


def _check_classes(names: list[str], cells: list[tuple[str, ...]], path: Path | str, multi_label: bool) -> None:
    """Refuse training data no classifier can learn from: one class (one label, under --multi-label), or a label
    column that is really a text or id column (`_check_class_count`; under --multi-label also a column where every
    row holds a set of labels of its own). One tag beside rows of none (`toxic` or empty) is a yes/no question:
    the message says how to ask it, as two classes."""
    if len(names) < 2:
        what = "a multi-label classifier needs at least two labels" if multi_label else "a classifier needs two"
        if multi_label and names and any(not cell for cell in cells):
            what = (
                f"one tag or none is a yes/no task: label the other rows too (e.g. 'not {names[0]}') and drop "
                "--multi-label"
            )
        one = f"only one {'label' if multi_label else 'class'} ({names[0]!r})" if names else "no label at all"
        raise DataError(f"{path}: {one} in {len(cells):,} rows; {what}")
    _check_class_count(names, len(cells), path)
    if multi_label and len(cells) >= 2 * FEW_CLASSES and len(set(map(frozenset, cells))) == len(cells):
        raise DataError(
            f"{path}: every one of the {len(cells):,} rows has a set of labels of its own; wrong label column? "
            "(--label-column)"
        )

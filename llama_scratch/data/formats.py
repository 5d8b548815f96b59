"""A data file's bytes as rows: the encoding checked, then CSV records, TSV or .txt lines, or JSONL objects;
a Parquet file's text and label columns (`parquet_columns`, with pyarrow, an optional dependency).

`data.load_dataset` decides which cells are the text and the label. This module knows the file formats
(`table_rows` reads a .csv, .tsv or .txt table for training and `classify` alike), and how to find columns: by
name (`find_column`, `first_known`, for header cells and JSON keys), or by their cells (`Column`): whether the
first row is a header (`looks_like_header`), and which unnamed column is the text and which the label
(`guess_columns`). `labelled.find_columns` puts these together, for training and `classify` alike; what `classify`
knows besides (the run's label names, whether a label is wanted at all) comes in as arguments.
`DataError` lives here so the readers can raise it; import it from `llama_scratch.data.labelled`.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

UNDECODABLE = re.compile("[\udc80-\udcff]")  # what errors="surrogateescape" turns non-UTF-8 bytes into
BYTE_ORDER_MARKS = (  # UTF-32 first: its little-endian mark starts with UTF-16's
    ("UTF-32", (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)),
    ("UTF-16", (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)),
)
TXT_SAMPLE = 100  # the first rows of a .txt file that must agree on its delimiter
COLUMN_SAMPLE = 1000  # the rows that header detection and column guessing look at
GUESSED_CLASSES = 100  # a label column found by its values has at most this many; more must be named
MAX_ID_LENGTH = 40  # an id is a number or one token this long at most (a UUID has 36 characters)
NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
NAME = re.compile(r"\w+([ _.-]\w+){0,2}")  # a column name: up to three words, like `stars`, `customer_feedback`
# A TSV field as Python's csv writer (delimiter TAB) writes it: quoted, with inner quotes doubled, when it holds a
# TAB, a quote, CR or LF; else bare, and then without a quote. Each ends at a TAB, a line end or the file's end.
QUOTED_FIELD = re.compile(r'"([^"]*(?:""[^"]*)*)"(\t|\r?\n|\Z)')
BARE_FIELD = re.compile(r'([^\t\r\n"]*)(\t|\r?\n|\Z)')


class DataError(ValueError):
    """A dataset that cannot be used: missing file, no usable rows, one class, columns that cannot be told apart."""


def decode(raw: bytes, path: Path) -> str:
    """UTF-8 text, undecodable bytes kept as markers (reported per row); UTF-16/32 and binary files are refused.

    Read as UTF-8, UTF-16 text has a NUL byte beside every ASCII character, and loads as rows labelled '\\x00a\\x00'.
    """
    for name, marks in BYTE_ORDER_MARKS:
        if raw.startswith(marks):
            raise DataError(f"{path} looks {name} encoded (byte-order mark); save it as UTF-8")
    head = raw[:65536]
    if head.count(0) > len(head) // 100:  # a stray NUL in a text file is kept; many mean another encoding
        line = raw.count(b"\n", 0, raw.index(0)) + 1
        raise DataError(
            f"{path} contains NUL bytes (line {line:,}): is it binary, or UTF-16/32 without a byte-order mark?"
        )
    return raw.removeprefix(codecs.BOM_UTF8).decode("utf-8", errors="surrogateescape")


def csv_rows(text: str, path: Path) -> Iterator[tuple[int, list[str]]]:
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


def table_rows(text: str, path: Path) -> tuple[list[tuple[int, list[str]]], str]:
    """A .csv, .tsv or .txt table's (line, cells) rows, and how its quotes were read when that needs saying (else
    ""): training (`data.load_dataset`) and `classify --file` read a table through here, so they read the same."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return list(csv_rows(text, path)), ""
    return tsv_table(text) if suffix == ".tsv" else txt_rows(text, path)


def tsv_rows(text: str) -> Iterator[tuple[int, list[str]]]:
    """(line, cells) per line split on TABs, quotes kept as they are. Splits on "\\n" only: str.splitlines would
    also break on U+0085."""
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if line.strip():
            yield number, line.split("\t")


def tsv_table(text: str) -> tuple[list[tuple[int, list[str]]], str]:
    """A TSV file's rows, and how its quotes were read (or "" when it has none).

    Python's csv writer (and pandas' to_csv) quote a field that holds a TAB, a quote or a line end, and double
    its quotes: `"say ""hi"" now"`. Read by lines and TABs, that text trains as written, quotes and all, and a field
    with a line end splits its row. But a TSV written by hand or by a plain join has stray quotes of its own (54
    bundled SMS texts start with one, 10 without a closing one), and unquoting those would merge rows. So the
    whole file is read one way: with csv quoting when every quote in it is where that writer puts one (a field
    that starts and ends with a quote, inner quotes doubled, the closing one followed by a TAB or a line end);
    else every quote is kept, and the note names the first line that is not csv quoting.
    """
    if '"' not in text:
        return list(tsv_rows(text)), ""
    rows, quoted, line = _csv_quoted(text)
    if rows is None:
        return list(tsv_rows(text)), f"quotes kept as written (line {line:,} is not csv quoting)"
    return rows, f"{quoted:,} quoted fields read as csv quoting"


def _csv_quoted(text: str) -> tuple[list[tuple[int, list[str]]] | None, int, int]:
    """(rows, quoted fields, 0) of a TSV read with csv quoting, or (None, 0, line) at the first line that is not.

    A row starts on the line of its first field; a quoted field may span lines. Blank rows are left out."""
    rows: list[tuple[int, list[str]]] = []
    cells: list[str] = []
    pos, line, start, quoted = 0, 1, 1, 0
    while True:
        is_quoted = text.startswith('"', pos)
        match = (QUOTED_FIELD if is_quoted else BARE_FIELD).match(text, pos)
        if match is None:
            return None, 0, line
        cells.append(match[1].replace('""', '"') if is_quoted else match[1])
        quoted += is_quoted
        line += match[0].count("\n")
        pos = match.end()
        if match[2] == "\t":
            continue
        if any(cell.strip() for cell in cells):
            rows.append((start, cells))
        if pos == len(text):
            return rows, quoted, 0
        cells, start = [], line


def txt_rows(text: str, path: Path) -> tuple[list[tuple[int, list[str]]], str]:
    """A .txt file's rows and how its quotes were read: TSV (as `tsv_table` reads it) when its first rows all have
    the same number of TABs (one or more), else CSV when they all have the same number of comma-separated fields
    (two or more). UCI's sentiment sets are `text<TAB>0`.
    """
    tsv, note = tsv_table(text)
    sample = [len(cells) - 1 for _, cells in tsv[:TXT_SAMPLE]]
    tabs = set(sample)
    if not tabs:
        return [], ""  # no rows: the caller says so
    if len(tabs) == 1 and 0 not in tabs:
        return tsv, note
    try:
        with closing(csv_rows(text, path)) as rows:  # closing: csv_rows restores the field size limit when closed
            fields = {len(cells) for _, cells in islice(rows, TXT_SAMPLE)}
    except DataError:
        fields = set()
    if len(fields) == 1 and 1 not in fields:
        return list(csv_rows(text, path)), ""
    counts = f"{_spread(fields)} comma-separated fields" if fields else "unreadable as CSV"
    raise DataError(
        f"{path}: a .txt file is read as tab- or comma-separated columns; found neither in its first "
        f"{len(sample)} lines ({_spread(tabs)} tabs, {counts}); rename it .tsv or .csv to choose"
    )


def parquet_columns(
    paths: list[Path], text_column: str | None, label_column: str | None, text_names, label_names
) -> tuple[list, list, str, str]:
    """The text and label values of Parquet files (a split's shards, in order), and the two column names: the given
    ones, else the first known names (any case). Only these two columns are read."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{paths[0]} is a Parquet file, which needs pyarrow: pip install 'llama-scratch[parquet]'"
        ) from None
    texts: list = []
    labels: list = []
    keys: tuple[str, str] | None = None
    for path in paths:
        try:
            names = pq.read_schema(path).names
            if keys is None:
                lowered = {n.lower(): n for n in names}
                tk = text_column or next((lowered[k] for k in text_names if k in lowered), None)
                lk = label_column or next((lowered[k] for k in label_names if k in lowered), None)
                if tk is None or lk is None:
                    raise DataError(
                        f"{path}: cannot tell the text and label columns among {names}; "
                        "pass --text-column and --label-column"
                    )
                keys = (tk, lk)
            missing = [k for k in keys if k not in names]
            if missing:
                raise DataError(f"{path}: no column {missing[0]!r} among the Parquet columns {names}")
            table = pq.read_table(path, columns=list(dict.fromkeys(keys)))
            texts += table.column(keys[0]).to_pylist()
            labels += table.column(keys[1]).to_pylist()
        except DataError:
            raise
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for files that are not Parquet
            raise DataError(f"{path}: unreadable Parquet file ({_first_line(e)})") from None
    assert keys is not None
    return texts, labels, keys[0], keys[1]


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _spread(counts: set[int]) -> str:
    return f"{min(counts)}-{max(counts)}" if len(counts) > 1 else str(min(counts))


def jsonl_objects(text: str, path: Path) -> Iterator[tuple[int, dict | None, str]]:
    """(line, object, "") per non-blank line, or (line, None, why) for a line that is not a JSON object."""
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        if UNDECODABLE.search(line):
            yield number, None, "undecodable bytes (not UTF-8)"
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            yield number, None, f"malformed JSON ({e.msg} at column {e.colno})"
            continue
        except ValueError:  # from int(): Python refuses to read integers this long
            raise DataError(f"{path} line {number}: a number of more than 4,300 digits, too long to read") from None
        if isinstance(obj, dict):
            yield number, obj, ""
        else:
            yield number, None, f"not a JSON object but {type(obj).__name__}"


def find_column(cells: list[str], name: str) -> int | None:
    """A column by name among header cells (or JSON keys): as written, else ignoring case and spaces around."""
    if name in cells:
        return cells.index(name)
    lowered = [c.strip().lower() for c in cells]
    return lowered.index(name.strip().lower()) if name.strip().lower() in lowered else None


def first_known(cells: list[str], names: Sequence[str]) -> int | None:
    """The column of the first of `names` (in their order) that `cells` hold, found as `find_column` finds it."""
    return next((i for i in (find_column(cells, n) for n in names) if i is not None), None)


@dataclass
class Column:
    """A column's non-empty cells, stripped and summarised: enough to tell a header cell, an id, a label or a text."""

    values: set[str]
    rows: int  # non-empty cells
    numeric: bool
    length: int  # the median length of its cells

    @classmethod
    def of(cls, rows: list[list[str]], index: int) -> Column:
        cells = [cell for row in rows if (cell := row[index].strip())]
        lengths = sorted(len(cell) for cell in cells)
        numeric = bool(cells) and all(NUMBER.fullmatch(cell) for cell in cells)
        return cls(set(cells), len(cells), numeric, lengths[len(lengths) // 2] if cells else 0)

    @property
    def repeats(self) -> bool:
        """At most half as many distinct values as cells: a label column, or some other category."""
        return 0 < 2 * len(self.values) <= self.rows

    @property
    def is_id(self) -> bool:
        """Every value distinct, and each a number or one short token: a row id, never the text or the label."""
        if self.rows < 2 or len(self.values) < self.rows:
            return False
        return self.numeric or all(len(v) <= MAX_ID_LENGTH and len(v.split()) == 1 for v in self.values)

    def vote(self, cell: str) -> int:
        """+1 if `cell`, atop this column, looks like its name; -1 if it looks like one more value; 0 if unclear."""
        cell = cell.strip()
        if not cell or not self.values:
            return 0
        if self.numeric:
            return -1 if NUMBER.fullmatch(cell) else 1  # `id` atop 1, 2, 3
        if self.repeats:
            return -1 if cell in self.values else 1  # `rating` atop pos, neg, pos
        if len(cell.split()) >= 4:
            return -1  # a sentence is a text, not a name
        return 1 if NAME.fullmatch(cell) and 2 * len(cell) <= self.length else 0  # `feedback` atop long texts


def looks_like_header(table: list[tuple[int, list[str]]], is_label: Callable[[str], bool] | None = None) -> bool:
    """Whether the first row names the columns: one of its cells is unlike the rest of its column, and none alike.

    `is_label` (classify: one of the run's label names) tells more: a first-row cell that is a label name atop a
    column of label names is one more value, however rare (one `spam` atop many `ham` would otherwise look like
    a name)."""
    first = table[0][1]
    rest = [cells for _, cells in table[1 : COLUMN_SAMPLE + 1] if len(cells) == len(first)]
    votes = set()
    for j, cell in enumerate(first):
        column = Column.of(rest, j)
        labels = is_label is not None and bool(column.values) and all(map(is_label, {cell.strip(), *column.values}))
        votes.add(-1 if labels else column.vote(cell))
    return 1 in votes and -1 not in votes


@dataclass
class Table:
    """A table's first row and whether it is a header: what column choices and their error messages refer to."""

    path: Path
    first: list[str]
    header: bool
    detected: bool  # the header was recognised, not forced: --no-header may be the way out
    json_line: int = 0  # JSON Lines: `first` is the keys of the first object, on this line
    need_label: bool = True  # False: only the text is wanted (classify without --labels)

    def name(self, index: int) -> str:
        return repr(self.first[index]) if self.header else f"column {index}"

    def flags(self) -> str:
        """The flags that name the columns wanted."""
        return "--text-column and --label-column" if self.need_label else "--text-column"

    def unclear(self, why: str) -> DataError:
        cells = [c if len(c) <= 30 else c[:27] + "..." for c in self.first]
        seen = f"header {cells}" if self.header else f"no header row; first row {cells}"
        ways = "header names or 0-based numbers" if self.header else "0-based column numbers, or header names"
        if self.json_line:
            seen, ways = f"keys {cells} on line {self.json_line:,}", "key names"
        no_header = ", or --no-header if the first row is data" if self.detected else ""
        return DataError(f"{self.path}: {why} ({seen}); pass {self.flags()} ({ways}){no_header}")


def guess_columns(
    where: Table, columns: list[Column], ti: int | None, li: int | None, is_label: Callable[[str], bool] | None = None
) -> tuple[int, int | None]:
    """The text and label columns not named, told apart by their values.

    Of two columns, the label has at most half as many distinct values as the text. In a wider table, ids (every
    value distinct) are set aside; the label is the one column with few distinct values (repeats, at most
    GUESSED_CLASSES), the text the column with the longest values, at least twice as long as any other's.

    What classify knows besides: `is_label` (one of the run's label names) names the label first, when exactly one
    column holds nothing else (a few rows say little about repeats; the run's names say which column they fill).
    Without a label wanted (`where.need_label` False), one column is the text, and the text is still found when
    no column is clearly the label (the label may be None then).
    """
    if len(columns) < 2:
        if columns and not where.need_label:
            return 0, li
        raise where.unclear("one column only; a text and a label need two")
    if li is None and is_label is not None:
        named = [j for j, c in enumerate(columns) if j != ti and c.values and all(map(is_label, c.values))]
        li = named[0] if len(named) == 1 else None
    if len(columns) == 2 and (ti is not None or li is not None):
        return (1 - li, li) if ti is None else (ti, 1 - ti)
    if len(columns) == 2:
        distinct = [len(c.values) for c in columns]
        label = int(distinct[1] < distinct[0])
        if 2 * distinct[label] <= distinct[1 - label]:
            return 1 - label, label
        if where.need_label:
            why = f"the columns have {distinct[0]} and {distinct[1]} distinct values, so neither is clearly the label"
            raise where.unclear(why)
        # Only the text is wanted (`id,description`): found as in a wider table, an id column set aside.
    free = [j for j, c in enumerate(columns) if j not in (ti, li) and not c.is_id]
    labels = [j for j in free if columns[j].repeats and len(columns[j].values) <= GUESSED_CLASSES]
    if li is None and (len(labels) == 1 or where.need_label):
        if len(labels) != 1:
            raise where.unclear(_which("label", "few distinct values", where, labels))
        li = labels[0]
    texts = sorted((j for j in free if j != li and j not in labels), key=lambda j: -columns[j].length)
    if ti is None:
        if not texts or (len(texts) > 1 and 2 * columns[texts[1]].length >= columns[texts[0]].length):
            raise where.unclear(_which("text", "long values", where, sorted(texts[:2])))
        ti = texts[0]
    return ti, li


def _which(role: str, trait: str, where: Table, candidates: list[int]) -> str:
    """Why no column is clearly the text or the label: none fits, or several do."""
    if not candidates:
        return f"no column is clearly the {role} (an id column, every value distinct, is never used)"
    names = [repr(where.first[j]) if where.header else str(j) for j in candidates]
    listed = ("" if where.header else "columns ") + f"{', '.join(names[:-1])} and {names[-1]}"
    return f"{listed} {'both' if len(names) == 2 else 'all'} have {trait}, so none is clearly the {role}"

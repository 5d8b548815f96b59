"""A data file's bytes as rows: the encoding checked, then CSV records, TSV or .txt lines, or JSONL objects.

`data.load_dataset` decides which cells are the text and the label; this module knows only the file formats.
`DataError` lives here so the readers can raise it; import it from `llama_scratch.data`.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import re
import sys
from collections.abc import Iterator
from contextlib import closing
from itertools import islice
from pathlib import Path

UNDECODABLE = re.compile("[\udc80-\udcff]")  # what errors="surrogateescape" turns non-UTF-8 bytes into
BYTE_ORDER_MARKS = (  # UTF-32 first: its little-endian mark starts with UTF-16's
    ("UTF-32", (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)),
    ("UTF-16", (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)),
)
TXT_SAMPLE = 100  # the first rows of a .txt file that must agree on its delimiter


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


def tsv_rows(text: str) -> Iterator[tuple[int, list[str]]]:
    """(line, cells) per line split on TABs. Splits on "\\n" only: str.splitlines would also break on U+0085."""
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if line.strip():
            yield number, line.split("\t")


def txt_rows(text: str, path: Path) -> list[tuple[int, list[str]]]:
    """A .txt file's rows: TSV when its first lines all have the same number of TABs (one or more), else CSV when
    they all have the same number of comma-separated fields (two or more). UCI's sentiment sets are `text<TAB>0`.
    """
    sample = [len(cells) - 1 for _, cells in islice(tsv_rows(text), TXT_SAMPLE)]
    tabs = set(sample)
    if not tabs:
        return []  # no rows: the caller says so
    if len(tabs) == 1 and 0 not in tabs:
        return list(tsv_rows(text))
    try:
        with closing(csv_rows(text, path)) as rows:  # closing: csv_rows restores the field size limit when closed
            fields = {len(cells) for _, cells in islice(rows, TXT_SAMPLE)}
    except DataError:
        fields = set()
    if len(fields) == 1 and 1 not in fields:
        return list(csv_rows(text, path))
    counts = f"{_spread(fields)} comma-separated fields" if fields else "unreadable as CSV"
    raise DataError(
        f"{path}: a .txt file is read as tab- or comma-separated columns; found neither in its first "
        f"{len(sample)} lines ({_spread(tabs)} tabs, {counts}); rename it .tsv or .csv to choose"
    )


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

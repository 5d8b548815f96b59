"""What `classify` reads: texts from the command line, a file with one text per line, or a CSV/TSV/TXT/JSONL
table whose text column (and, for `--labels`, label column) is found the way training finds it (`data.py`).
Tables are read by training's own readers (`data_files.table_rows`: the same cells, quotes read the same way), columns
and JSON keys are found by name with its `find_column`, and keys with other names by `data.json_keys`.

Labels are checked against the run's label names here, before the model loads: an unknown one is an error that
names the line. Empty texts are left out and counted, never classified.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .formats import (
    UNDECODABLE,
    decode,
    find_column,
    first_known,
    jsonl_objects,
    table_rows,
)
from .labelled import (
    LABEL_NAMES,
    MAX_LABEL_DIGITS,
    TEXT_NAMES,
    DataError,
    json_keys,
)

INTEGER = re.compile(r"[+-]?\d+")


@dataclass
class Inputs:
    """What to classify, the file's label of each text when asked for (`None` otherwise), and the inputs left out
    as "where: why" (an empty text is not classified, so the output can be shorter than the input). `read_as` says
    how the file's quotes were read, when that needs saying (as training's log does)."""

    texts: list[str] = field(default_factory=list)
    labels: list[str] | None = None
    skipped: list[str] = field(default_factory=list)
    read_as: str = ""


Row = tuple[str, str, str | None]  # (where, text, label or None when labels were not asked for)


def read_inputs(
    texts: list[str],
    file: str | None,
    text_column: str | None,
    label_column: str | None,
    labels: bool,
    label_names: list[str],
) -> Inputs:
    """The texts of the command line, then of `file`; with `labels`, each text's label as a name of the run."""
    rows: list[Row] = [(f"argument {i}", text, None) for i, text in enumerate(texts, start=1)]
    skipped: list[str] = []  # rows of the file that are not even a text
    read_as = ""
    if file:
        file_rows, skipped, read_as = read_file(file, text_column, label_column, labels, label_names)
        rows += file_rows
    inputs = Inputs(labels=[] if labels else None, skipped=skipped, read_as=read_as)
    for where, text, label in rows:
        if UNDECODABLE.search(text):
            inputs.skipped.append(f"{where}: undecodable bytes (not UTF-8)")
        elif not text.strip():
            inputs.skipped.append(f"{where}: empty text")
        elif inputs.labels is None:
            inputs.texts.append(text)
        elif not label or not label.strip():
            inputs.skipped.append(f"{where}: missing label")
        elif (name := known_label(label, label_names)) is None:
            known = ", ".join(label_names)
            raise DataError(f"{where}: label {label.strip()!r} is not one of this classifier's labels ({known})")
        else:
            inputs.texts.append(text)
            inputs.labels.append(name)
    return inputs


def known_label(value: str, label_names: list[str]) -> str | None:
    """The run's name for a file's label: as written, or as data.py names integer classes ('01' and '+1' are '1')."""
    value = value.strip()
    if value in label_names:
        return value
    if INTEGER.fullmatch(value) and len(value.lstrip("+-")) <= MAX_LABEL_DIGITS and str(int(value)) in label_names:
        return str(int(value))
    return None


def read_file(
    name: str, text_column: str | None, label_column: str | None, labels: bool, label_names: list[str]
) -> tuple[list[Row], list[str], str]:
    """Rows and skipped rows of `--file`, and how a table's quotes were read (or ""): .csv, .tsv and .jsonl are
    tables; .txt too when a column is asked for (read like training data), else it holds one text per line, like
    standard input ('-') and any other file."""
    if name == "-":
        if labels or text_column is not None:
            raise DataError("--labels and --text-column need a .csv, .tsv, .txt or .jsonl file, not standard input")
        return line_rows(decode(sys.stdin.buffer.read(), Path("<stdin>")), "<stdin>"), [], ""
    path = Path(name)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {name}: {e.strerror}") from None
    suffix = path.suffix.lower()
    if suffix == ".json":
        raise DataError(f"{name}: a .json file is not read; save it as JSON Lines (.jsonl, one object per line)")
    text = decode(raw, path)
    asked = labels or text_column is not None
    if suffix == ".jsonl":
        return (*jsonl_rows(text, name, text_column, label_column, labels), "")
    if suffix in (".csv", ".tsv") or (suffix == ".txt" and asked):
        table, read_as = table_rows(text, path)
    elif asked:
        raise DataError(f"{name}: --labels and --text-column need a .csv, .tsv, .txt or .jsonl file")
    else:
        return line_rows(text, name), [], ""
    if not table:
        raise DataError(f"{name}: the file has no rows")
    body, width, ti, li = choose_columns(table, name, text_column, label_column, labels, label_names)
    rows, skipped = [], []
    for line, cells in body:
        if len(cells) != width:
            skipped.append(f"{name} line {line}: expected {width} columns, found {len(cells)}")
        else:
            rows.append((f"{name} line {line}", cells[ti], cells[li] if li is not None else None))
    return rows, skipped, read_as


def line_rows(text: str, source: str) -> list[Row]:
    """One text per line; split on "\\n" only, as data_files does (str.splitlines also breaks on U+0085)."""
    lines = text.split("\n")
    if lines[-1] == "":  # the file's last line end
        lines.pop()
    return [(f"{source} line {n}", line.removesuffix("\r"), None) for n, line in enumerate(lines, start=1)]


Table = list[tuple[int, list[str]]]  # (line, cells) per row, as data_files reads them


def choose_columns(
    table: Table, name: str, text_column: str | None, label_column: str | None, labels: bool, label_names: list[str]
) -> tuple[Table, int, int, int | None]:
    """(rows below any header, their width, text column, label column when asked for). As in training, a header
    row names a known column (data.TEXT_NAMES, LABEL_NAMES) or a given one; without a header, columns are 0-based
    numbers, a single column is the text, and of two, the one holding only the run's label names is the label."""
    header = table[0][1]
    ti = find_column(header, text_column) if text_column is not None else first_known(header, TEXT_NAMES)
    li = find_column(header, label_column) if label_column is not None else first_known(header, LABEL_NAMES)
    if ti is not None or li is not None:  # a header row
        body, width = table[1:], len(header)
        for given, index in ((text_column, ti), (label_column, li)):
            if given is not None and index is None:
                raise DataError(f"{name}: no column {given!r} in the header {header}")
    else:
        body, width = table, Counter(len(cells) for _, cells in table).most_common(1)[0][0]
        ti, li = (None if c is None else column_number(c, width, name, header) for c in (text_column, label_column))
        if width == 1:
            ti = 0 if ti is None else ti
        elif width == 2 and ti is None and li is None:
            only_labels = [i for i in (0, 1) if all(known_label(c[i], label_names) for _, c in table if len(c) == 2)]
            li = only_labels[0] if len(only_labels) == 1 else None
    if width == 2 and (ti is None) != (li is None):
        ti, li = (1 - li, li) if ti is None else (ti, 1 - ti)
    if ti is None or (labels and li is None) or ti == li:
        what, ask = ("text and label columns", " and --label-column") if labels else ("text column", "")
        raise DataError(f"{name}: cannot tell the {what} in the first row {header}; pass --text-column{ask}")
    return body, width, ti, li if labels else None


def column_number(given: str, width: int, name: str, header: list[str]) -> int:
    if INTEGER.fullmatch(given.strip()) and 0 <= int(given) < width:
        return int(given)
    raise DataError(
        f"{name}: no column {given!r}: the first row {header} is not a header, so columns are 0-based "
        f"numbers below {width}"
    )


def jsonl_rows(
    text: str, name: str, text_key: str | None, label_key: str | None, labels: bool
) -> tuple[list[Row], list[str]]:
    """One JSON object per line; the keys as training finds them (`data.json_keys`), the label's only with labels.
    A key given but not in the first object is an error here (training would skip every row as missing it)."""
    objects = list(jsonl_objects(text, Path(name)))
    found = [(number, obj) for number, obj, _ in objects if obj is not None]
    tk, lk = "", None  # no object at all: every line is skipped below, with its reason
    if found:
        tk, lk = json_keys(objects, Path(name), text_key, label_key, label=labels)
        number, first = found[0]
        for key in (tk, lk) if labels else (tk,):
            if key not in first:
                ask = "--text-column and --label-column" if labels else "--text-column"
                raise DataError(f"{name} line {number}: no key {key!r} among {list(first)}; pass {ask}")
    rows: list[Row] = []
    skipped: list[str] = []
    for number, obj, problem in objects:
        where = f"{name} line {number}"
        if obj is None:
            skipped.append(f"{where}: {problem}")
        elif not isinstance(value := obj.get(tk), str):
            skipped.append(f"{where}: {tk!r} is {'missing' if value is None else type(value).__name__}")
        else:
            rows.append((where, value, json_label(obj.get(lk)) if labels else None))
    return rows, skipped


def json_label(value: object) -> str:
    """A JSON label as data.py reads it: true/false as 'true'/'false', 1.0 as '1'; a missing one is empty."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "" if value is None else value if isinstance(value, str) else json.dumps(value)

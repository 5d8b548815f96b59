"""What `classify` reads: texts from the command line, a file with one text per line, or a CSV/TSV/TXT/JSONL
table whose text column (and, for `--labels`, label column) is found the way training finds it.
Tables are read by training's own readers (`formats.table_rows`: the same cells, quotes read the same way), their
columns found by training's own finder (`labelled.find_columns`: the same names, the same rules for a header row
and for columns told apart by their values) and JSON keys by `labelled.json_keys`. Classify adds what it knows:
the run's label names (a column holding only those is the label) and whether a label is wanted at all.

Labels are checked against the run's label names here, before the model loads: an unknown one is an error that
names the line, and so is a cell of several of the run's labels (`a;b`) for a run of one label per text. Empty
texts are left out and counted, never classified.

Each text of a table keeps its row (`Inputs.records`: a table's cells, a JSON object), so `classify --output`
writes the file's own columns back beside the scores (`data/scored.py`): ids and metadata survive the round trip.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .formats import UNDECODABLE, decode, jsonl_objects, table_rows
from .labelled import MAX_LABEL_DIGITS, SEPARATOR, DataError, TableColumns, find_columns, json_keys, label_set

INTEGER = re.compile(r"[+-]?\d+")


Record = list[str] | dict | None  # a text's row in its file: a table's cells, a JSON object; None: no file row


@dataclass
class Inputs:
    """What to classify, the file's label of each text when asked for (`None` otherwise), and the inputs left out
    as "where: why" (an empty text is not classified, so the output can be shorter than the input). `read_as` says
    how the file's quotes were read, when that needs saying (as training's log does)."""

    texts: list[str] = field(default_factory=list)
    labels: list[str] | None = None  # --multi-label runs: the run's names of a text's labels, SEPARATOR-joined
    skipped: list[str] = field(default_factory=list)
    read_as: str = ""
    columns: str = ""  # the table's columns, when told from its cells rather than by name: worth saying
    kind: str = "lines"  # "table" (CSV/TSV/TXT cells) or "jsonl" (objects): each text's row is in `records`
    fields: list[str] = field(default_factory=list)  # a table's column names ("column_N" without a header)
    text_field: str = "text"  # the table's text column or JSON key: where a command-line text goes beside them
    records: list[Record] = field(default_factory=list)  # per text: its row (None: a command-line text)


Row = tuple[str, str, str | None, Record]  # (where, text, label or None when labels were not asked for, its row)


@dataclass
class FileRows:
    """What `read_file` found in `--file`: its rows and skipped rows, how it was read when that needs saying, and
    for a table or JSON Lines, what `Inputs` keeps of it (`kind`, `fields`, `text_field`)."""

    rows: list[Row]
    skipped: list[str] = field(default_factory=list)
    read_as: str = ""
    columns: str = ""
    kind: str = "lines"
    fields: list[str] = field(default_factory=list)
    text_field: str = "text"


def read_inputs(
    texts: list[str],
    file: str | None,
    text_column: str | None,
    label_column: str | None,
    labels: bool,
    label_names: list[str],
    header: bool | None = None,
    multi_label: bool = False,
) -> Inputs:
    """The texts of the command line, then of `file`; with `labels`, each text's label as a name of the run.
    `header` False: a table's first row is data (--no-header); None: told from the table, as in training.
    `multi_label` (a --multi-label run): a label cell holds zero or more labels, SEPARATOR-joined (an empty cell:
    none), each checked; kept as the run's names joined in the run's order."""
    rows: list[Row] = [(f"argument {i}", text, None, None) for i, text in enumerate(texts, start=1)]
    inputs = Inputs(labels=[] if labels else None)
    if file:
        found = read_file(file, text_column, label_column, labels, label_names, header)
        inputs.skipped, inputs.read_as, inputs.columns = found.skipped, found.read_as, found.columns
        inputs.kind, inputs.fields, inputs.text_field = found.kind, found.fields, found.text_field
        rows += found.rows
    for where, text, label, record in rows:
        if UNDECODABLE.search(text):
            inputs.skipped.append(f"{where}: undecodable bytes (not UTF-8)")
        elif not text.strip():
            inputs.skipped.append(f"{where}: empty text")
        elif inputs.labels is None:
            inputs.texts.append(text)
            inputs.records.append(record)
        elif multi_label:
            inputs.texts.append(text)
            inputs.labels.append(known_set(label or "", label_names, where))
            inputs.records.append(record)
        elif not label or not label.strip():
            inputs.skipped.append(f"{where}: missing label")
        elif (name := known_label(label, label_names)) is None:
            raise DataError(f"{where}: label {label.strip()!r} {unknown_label(label, label_names)}")
        else:
            inputs.texts.append(text)
            inputs.labels.append(name)
            inputs.records.append(record)
    return inputs


def known_label(value: str, label_names: list[str]) -> str | None:
    """The run's name for a file's label: as written, or as data.py names integer classes ('01' and '+1' are '1')."""
    value = value.strip()
    if value in label_names:
        return value
    if INTEGER.fullmatch(value) and len(value.lstrip("+-")) <= MAX_LABEL_DIGITS and str(int(value)) in label_names:
        return str(int(value))
    return None


def unknown_label(value: str, label_names: list[str]) -> str:
    """Why a single-label run's file cell is no label of the run: several of them SEPARATOR-joined (what a
    --multi-label run's file holds: scored against a run of one label per text, it would be one wrong class), or
    none of them."""
    parts = value.strip().split(SEPARATOR)
    if len(parts) > 1 and all(known_label(part, label_names) is not None for part in parts):
        return (
            f"is several labels ({SEPARATOR}-separated), but this classifier has one label per text (its run was "
            "not --multi-label); give each text one label"
        )
    return f"is not one of this classifier's labels ({', '.join(label_names)})"


def known_set(value: str, label_names: list[str], where: str) -> str:
    """A --multi-label cell as the run's names, SEPARATOR-joined in the run's order ("" for none of them); a
    label the run lacks is refused by name."""
    names = set()
    for part in label_set(value):  # split as training splits a cell
        if (name := known_label(part, label_names)) is None:
            known = ", ".join(label_names)
            raise DataError(f"{where}: label {part!r} is not one of this classifier's labels ({known})")
        names.add(name)
    return SEPARATOR.join(name for name in label_names if name in names)


def run_label(label_names: list[str]) -> Callable[[str], bool]:
    """Whether a cell is one of the run's labels (as `known_label` reads it), or several of them SEPARATOR-joined
    (a --multi-label run's): what classify tells the column finder. Sets count for a run of one label per text too:
    the finder then finds the column the file means, and `read_inputs` refuses such a cell by its row."""
    return lambda value: (
        known_label(value, label_names) is not None
        or all(known_label(part, label_names) is not None for part in value.split(SEPARATOR))
    )


def read_file(
    name: str,
    text_column: str | None,
    label_column: str | None,
    labels: bool,
    label_names: list[str],
    header: bool | None = None,
) -> FileRows:
    """Rows and skipped rows of `--file`, how a table's quotes were read and how its columns were found, when
    that needs saying (else ""): .csv, .tsv and .jsonl are tables; .txt too when a column is asked for (read like
    training data), else it holds one text per line, like standard input ('-') and any other file."""
    if name == "-":
        if labels or text_column is not None:
            raise DataError("--labels and --text-column need a .csv, .tsv, .txt or .jsonl file, not standard input")
        return FileRows(line_rows(decode(sys.stdin.buffer.read(), Path("<stdin>")), "<stdin>"))
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
        return jsonl_rows(text, name, text_column, label_column, labels, label_names)
    if suffix in (".csv", ".tsv") or (suffix == ".txt" and asked):
        table, read_as = table_rows(text, path)
    elif asked:
        raise DataError(f"{name}: --labels and --text-column need a .csv, .tsv, .txt or .jsonl file")
    else:
        return FileRows(line_rows(text, name))
    found = choose_columns(table, name, text_column, label_column, labels, label_names, header)
    rows, skipped = [], []
    for line, cells in found.body:
        if len(cells) != found.width:
            skipped.append(f"{name} line {line}: expected {found.width} columns, found {len(cells)}")
        else:
            label = cells[found.label] if found.label is not None else None
            rows.append((f"{name} line {line}", cells[found.text], label, cells))
    fields = list(found.where.first) if found.where.header else [f"column_{j}" for j in range(found.width)]
    columns = found.describe() if found.guessed else ""
    return FileRows(rows, skipped, read_as, columns, "table", fields, fields[found.text])


def line_rows(text: str, source: str) -> list[Row]:
    """One text per line; split on "\\n" only, as data_files does (str.splitlines also breaks on U+0085)."""
    lines = text.split("\n")
    if lines[-1] == "":  # the file's last line end
        lines.pop()
    return [(f"{source} line {n}", line.removesuffix("\r"), None, None) for n, line in enumerate(lines, start=1)]


def choose_columns(
    table: list[tuple[int, list[str]]],
    name: str,
    text_column: str | None,
    label_column: str | None,
    labels: bool,
    label_names: list[str],
    header: bool | None = None,
) -> TableColumns:
    """The table's columns as training finds them (`labelled.find_columns`: by name, else a header row and the
    columns told from their cells), with what classify knows besides: the run's label names (the one column
    holding only those is the label, and a first row of them is data, not a header) and whether a label is wanted
    (without --labels only the text column is, and a single column is the text). `label` is None without labels."""
    found = find_columns(table, Path(name), text_column, label_column, header, labels, run_label(label_names))
    return found if labels else dataclasses.replace(found, label=None)


def jsonl_rows(
    text: str, name: str, text_key: str | None, label_key: str | None, labels: bool, label_names: list[str]
) -> FileRows:
    """One JSON object per line; the keys as training finds them (`data.json_keys`), the label's only with labels.
    A key given but not in the first object is an error here (training would skip every row as missing it)."""
    objects = list(jsonl_objects(text, Path(name)))
    found = [(number, obj) for number, obj, _ in objects if obj is not None]
    tk, lk = "", None  # no object at all: every line is skipped below, with its reason
    if found:
        tk, lk = json_keys(objects, Path(name), text_key, label_key, labels, run_label(label_names))
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
            rows.append((where, value, json_label(obj.get(lk)) if labels else None, obj))
    return FileRows(rows, skipped, kind="jsonl", text_field=tk)


def json_label(value: object) -> str:
    """A JSON label as data.py reads it: true/false as 'true'/'false', 1.0 as '1'; a missing one is empty."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "" if value is None else value if isinstance(value, str) else json.dumps(value)

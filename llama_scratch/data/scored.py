"""What `classify --output` writes: each classified text's row with its scores, as CSV, TSV or JSON Lines (by the
output file's suffix: `.tsv`, `.jsonl`, anything else CSV).

A table's row keeps every column of the input, in order, followed by `predicted`, `probability` and `p_<class>`
for each class, so ids and metadata survive the round trip; a JSON object keeps every key and gets those keys
added. Texts given one per line (or on the command line) have no columns of their own: their row is `text`, the
scores and, with `--labels`, `label`. A column of the input already named like a score is refused rather than
silently written twice or overwritten (the file was probably scored before).

A --multi-label run's `predicted` holds the labels at or above its threshold, `;`-joined as training reads them
(empty for none: a scored file reads back as training data), and there is no `probability`: each label has its
own, in `p_<label>`, and no one number stands for the set.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from .inputs import Inputs
from .labelled import SEPARATOR, DataError

DIGITS = 6  # of each probability: finer differences mean nothing once a model runs in bfloat16


def score_names(label_names: list[str], multi_label: bool = False) -> list[str]:
    """The columns (or keys) the scores add, after the input's own."""
    return ["predicted", *([] if multi_label else ["probability"]), *(f"p_{name}" for name in label_names)]


def output_fields(inputs: Inputs, label_names: list[str], multi_label: bool = False) -> list[str]:
    """The input's own column names (a table's, every JSON key in order of appearance, or `text`), refused in one
    line if one of them is a name the scores add."""
    if inputs.kind == "jsonl":
        fields = list(dict.fromkeys(k for r in inputs.records if isinstance(r, dict) for k in r))
    else:
        fields = list(inputs.fields) if inputs.kind == "table" else ["text"]
    added = score_names(label_names, multi_label)
    if clash := [name for name in added if name in fields]:
        raise DataError(f"--file has a column {clash[0]!r} already (scored before?); classify adds {', '.join(added)}")
    return fields


def scored_rows(
    inputs: Inputs, probs: list[list[float]], picks: list[int] | list[list[int]], label_names: list[str]
) -> tuple[list[str], list[tuple[list | dict, dict]]]:
    """The input's column names and, per classified text, its row (a table's cells, a JSON object) and its scores
    (`score_names`, plus `label` for texts without columns given --labels; `picks`: each text's predicted class,
    as `classify.best` chose it, or for a --multi-label run the list of its labels at or above the threshold).
    A command-line text beside a table fills only the text column."""
    multi = bool(picks) and isinstance(picks[0], list)
    fields = output_fields(inputs, label_names, multi)
    at = fields.index(inputs.text_field) if inputs.kind == "table" else 0
    rows = []
    for i, (text, record) in enumerate(zip(inputs.texts, inputs.records, strict=True)):
        if record is None:  # a command-line text, or a file of one text per line
            record = (
                {inputs.text_field: text}
                if inputs.kind == "jsonl"
                else [text if j == at else "" for j in range(len(fields))]
            )
        k = picks[i]
        if multi:
            scores = {"predicted": SEPARATOR.join(label_names[j] for j in k)}
        else:
            scores = {"predicted": label_names[k], "probability": probs[i][k]}
        scores |= {f"p_{name}": p for name, p in zip(label_names, probs[i], strict=True)}
        if inputs.kind == "lines" and inputs.labels is not None:
            scores["label"] = inputs.labels[i]
        rows.append((record, scores))
    return fields, rows


def _cell(value: object) -> str:
    """A value as a CSV/TSV cell: text as it is, a probability with DIGITS decimals, other JSON values as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return f"{value:.{DIGITS}f}"
    return "" if value is None else json.dumps(value, ensure_ascii=False)


def scored_text(
    path: Path, inputs: Inputs, probs: list[list[float]], picks: list[int] | list[list[int]], label_names: list[str]
) -> str:
    """The whole output file's text, in the format `path`'s suffix names. A table's row is written by position
    (a header may name two columns alike, and each keeps its cell), except as JSON, where a name is one key."""
    fields, rows = scored_rows(inputs, probs, picks, label_names)
    if path.suffix.lower() == ".jsonl":
        lines = []
        for record, scores in rows:
            obj = dict(record) if isinstance(record, dict) else dict(zip(fields, record, strict=True))
            obj |= {k: round(v, DIGITS) if isinstance(v, float) else v for k, v in scores.items()}
            lines.append(json.dumps(obj, ensure_ascii=False) + "\n")
        return "".join(lines)
    out = io.StringIO()
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    writer = csv.writer(out, delimiter=delimiter, lineterminator="\n")  # "\n": write_text gives the platform's
    writer.writerow(fields + list(rows[0][1]) if rows else fields)
    for record, scores in rows:
        cells = [_cell(record.get(f)) for f in fields] if isinstance(record, dict) else record
        writer.writerow([*cells, *map(_cell, scores.values())])
    return out.getvalue()

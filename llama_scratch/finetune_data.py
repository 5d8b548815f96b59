"""What the data flags of `python -m llama_scratch.finetune_classifier` read: --data cut into train, validation and
test splits, or joined by --val-data and --test-data, and what a run records of where each split came from (for
--resume's identity, metrics.json and classifier.json). The flags themselves are finetune_args'."""

from __future__ import annotations

import argparse

from .data.labelled import DataError, LabelledTexts, load_dataset
from .data.splitting import default_protocol, split_with_files
from .training.evaluation import check_threshold_value


def held_out_files(args: argparse.Namespace) -> dict[str, str]:
    """The splits given as files of their own ("val", "test"), by --val-data and --test-data."""
    return {name: path for name in ("val", "test") if (path := getattr(args, f"{name}_data", None))}


def split_protocol(args: argparse.Namespace) -> str | None:
    """How --data is cut: --split, else the default for it; None with both --val-data and --test-data, when
    --data is all training (a --split then would cut nothing, so it is refused rather than ignored)."""
    if len(held_out_files(args)) == 2:
        if args.split:
            raise DataError("--split cuts --data, but with --val-data and --test-data every row of --data trains")
        return None
    return args.split or default_protocol(args.data)


def held_out_identity(args: argparse.Namespace, parts: dict[str, LabelledTexts]) -> dict:
    """What a resume point records of --val-data and --test-data: the file and a digest of what was read from it,
    so a resume with another file, or the same file edited, is refused (None: the split was cut from --data)."""
    files = held_out_files(args)
    return {
        **{f"{k}_data": files.get(k) for k in ("val", "test")},
        **{f"{k}_digest": parts[k].fingerprint() if k in files else None for k in ("val", "test")},
    }


def split_files(args: argparse.Namespace, data: LabelledTexts, parts: dict[str, LabelledTexts]) -> dict:
    """Where each split came from, for metrics.json and classifier.json: the file (or dataset) read and a digest
    of what was read from it (`LabelledTexts.fingerprint`: --data's whole, for the splits cut from it)."""
    files = held_out_files(args)
    whole = data.fingerprint()
    return {
        k: {"file": files[k], "digest": parts[k].fingerprint()} if k in files else {"file": args.data, "digest": whole}
        for k in ("train", "val", "test")
    }


def read_data(args: argparse.Namespace, log) -> tuple[LabelledTexts, dict[str, LabelledTexts], str | None]:
    """The labelled texts and their train/val/test split: cut from --data, or read from --val-data/--test-data
    (the protocol None when both are: nothing is cut)."""
    check_threshold(args)
    columns = {"text_column": args.text_column, "label_column": args.label_column, "header": args.header}
    data = load_dataset(args.data, **columns, split=args.data_split, multi_label=args.multi_label)
    log(data.describe())
    protocol = split_protocol(args)
    parts = split_with_files(data, protocol, args.seed, held_out_files(args), columns, log)
    return data, parts, protocol


def check_threshold(args: argparse.Namespace) -> None:
    """--threshold decides each label of --multi-label, a probability strictly between 0 and 1 (at 0 or 1 every
    label, or none, would be predicted whatever the text); one label per text is the most probable class."""
    if args.threshold is None:
        return
    if not args.multi_label:
        raise ValueError("--threshold decides each label of --multi-label; one label per text takes the likeliest")
    check_threshold_value(args.threshold)

"""`--data owner/name`: a Hugging Face dataset repository, fetched into the usual Hugging Face cache, and the data
files of one split in it (`--data-split`, default train) found by the common layouts.

The layouts: `data/train-00000-of-00001.parquet` (what the Hub's Parquet conversion and `push_to_hub` write),
`train.csv` / `train.jsonl` / `train.tsv` / `train.parquet`, `train/*.parquet`, or a single data file (train only).
A reference is a dataset id only if it is `owner/name`, does not exist here and does not look like a local path
(`download.looks_like_path`): a mistyped local path is "no such file", never a fetch. Reading the files is
`data.load_dataset`'s job; this module only makes them local.
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import snapshot_download

from ..sources.fetch import looks_like_path, offline
from .formats import DataError

DATA_SUFFIXES = (".parquet", ".csv", ".tsv", ".jsonl")
ALLOW_PATTERNS = [f"*{suffix}" for suffix in DATA_SUFFIXES]  # no README, scripts or images


def is_dataset_id(ref: str) -> bool:
    """'owner/name' that is not a path here, existing or meant."""
    return not Path(ref).exists() and not looks_like_path(ref) and re.fullmatch(r"[\w.-]+/[\w.-]+", ref) is not None


def dataset_files(repo_id: str, split: str = "train") -> list[Path]:
    """The local data files of `split` in the dataset repository `repo_id` (fetched once into the HF cache)."""
    if switch := offline():
        raise DataError(
            f"cannot fetch dataset {repo_id}: offline ({switch} is set); unset it, or download the data file and "
            "pass its path to --data"
        )
    try:
        root = Path(snapshot_download(repo_id, repo_type="dataset", allow_patterns=ALLOW_PATTERNS))
    except Exception as e:  # not found, gated, no network: huggingface_hub and httpx raise many kinds
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise DataError(
            f"cannot fetch dataset {repo_id}: {type(e).__name__}: {first}; check the name (owner/name), the "
            "network and HF_TOKEN, or download the data file and pass its path to --data"
        ) from None
    return split_files(root, repo_id, split)


def split_files(root: Path, repo_id: str, split: str) -> list[Path]:
    """A split's files under a dataset snapshot: named after the split (`train.csv`, `train-00000-of-00002.parquet`)
    or in a directory named after it; Parquet shards in order. A lone data file is the train split."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in DATA_SUFFIXES)
    chosen = [p for p in files if p.stem == split or p.name.startswith(f"{split}-") or p.parent.name == split]
    parquet = [p for p in chosen if p.suffix.lower() == ".parquet"]
    if parquet:
        return parquet
    if len(chosen) == 1:
        return chosen
    if not chosen and split == "train" and len(files) == 1:
        return files
    shown = ", ".join(str(p.relative_to(root)) for p in (chosen or files)[:5]) or "no data files"
    why = "several files, in no one format" if chosen else f"no {split!r} split"
    raise DataError(f"dataset {repo_id}: {why} ({shown}); pick one with --data-split, or pass a file to --data")

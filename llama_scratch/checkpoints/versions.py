"""Schema versions of the JSON records the tool writes (`classifier.json`, `metrics.json`): how an older file is read.

Each record carries its schema `version`, the shape it was written in; a file without one is version 1 (everything
written before versions were kept). Reading brings a file to the current shape one step at a time, each step a
plain function from version N's dict to version N+1's, written once by the module that owns the record. So what
a file "from before" some flag meant lives in that step, and the code that reads the record sees one shape only.
A file newer than this code is refused in one line naming it and its version: its keys may mean something that
this code would misread, and the fix (a newer llama_scratch) is the user's to choose.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from .hf_layout import CheckpointError

VERSION_KEY = "version"  # as run_flags.json has it (finetune_settings)

Upgrade = Callable[[dict], dict]  # version N's record -> version N+1's


def versioned(record: dict, version: int) -> dict:
    """`record` as written: its version first, so a reader of the file sees it before anything else."""
    return {VERSION_KEY: version, **record}


def upgraded(record: dict, path: Path, current: int, steps: Mapping[int, Upgrade]) -> dict:
    """`record` (a JSON object read from `path`) in the current shape, without its version key: each step from its
    own version up to `current` applied in turn (`steps[n]` takes version n to n + 1). CheckpointError, naming the
    file, for a version that is not a whole number from 1 up, or one newer than `current`."""
    version = record.get(VERSION_KEY, 1)  # files written before versions were kept are all version 1
    if type(version) is not int or version < 1:  # a bool is an int to isinstance
        raise CheckpointError(f"{path}: {VERSION_KEY} {version!r} is not a version this tool writes")
    if version > current:
        raise CheckpointError(
            f"{path} was written by a newer llama_scratch ({VERSION_KEY} {version}; this one reads up to {current}): "
            "update llama_scratch to read it"
        )
    record = {k: v for k, v in record.items() if k != VERSION_KEY}
    for n in range(version, current):
        record = steps[n](record)
    return record

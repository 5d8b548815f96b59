"""A fine-tuning run's output directory: which files are ours, what state the run is in, and its results as a set.

An output directory is new (missing or empty), or ours: it holds only files that a run writes. Ours is either
unfinished (a resume point is there: continue with --resume, or restart with --overwrite) or finished
(`classifier.json` is there: --overwrite to replace it). A directory holding anything else is refused whatever
the flags say, so pointing --output at the wrong folder never overwrites or deletes a file we did not write.

While a run trains, the directory holds only work files (the resume point and the best weights so far). The
results appear at the end, `classifier.json` last; each result carries the run's id, and `classify` checks that
the weights and `classifier.json` share it, so files of two runs are never taken for one.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

from .train import RESUME_FILE

BEST_FILE = "best.safetensors"  # the best trained weights so far, while the run trains
WORK_FILES = (RESUME_FILE, BEST_FILE)
RESULT_FILES = ("classifier.safetensors", "history.csv", "history.png", "metrics.json", "classifier.json")
LEGACY_RESUME = "checkpoint.pt"  # a pickle written by versions before 0.2; never loaded
_OUR_TEMP = re.compile(r"\..+\.\d+\.(tmp|old)")  # atomic.write_atomic's temporary names


class OutputError(ValueError):
    """An output directory this run may not use (the message says which flag, if any, would allow it)."""


def new_run_id() -> str:
    return uuid.uuid4().hex


def _ours(name: str) -> bool:
    return name in WORK_FILES or name in RESULT_FILES or name == LEGACY_RESUME or bool(_OUR_TEMP.fullmatch(name))


def check_output(out: Path, resume: bool, overwrite: bool) -> str:
    """Whether this run may use `out`, decided before anything is loaded: 'new', 'unfinished' or 'finished'.

    Raises OutputError for a directory that holds files we did not write (always), an unfinished run without
    --resume/--overwrite, a finished run without --overwrite, and an old pickled resume point unless --overwrite.
    """
    if out.exists() and not out.is_dir():
        raise OutputError(f"--output {out} is a file, not a directory")
    names = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if foreign := [n for n in names if not _ours(n)]:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutputError(
            f"--output {out} holds files this tool did not write ({shown}); choose a new or empty directory"
        )
    if LEGACY_RESUME in names and not overwrite:
        raise OutputError(
            f"{out} holds a resume point from an older version ({LEGACY_RESUME}, a pickle, which is never loaded "
            "because unpickling can run code); pass --overwrite to start this run again"
        )
    if RESUME_FILE in names or BEST_FILE in names:
        if not (resume or overwrite):
            raise OutputError(f"{out} holds an unfinished run: pass --resume to continue it or --overwrite to restart")
        return "unfinished"
    if "classifier.json" in names:
        if not overwrite:
            hint = "; it has nothing left to resume" if resume else ""
            raise OutputError(
                f"{out} holds a finished run{hint}: pass --overwrite to replace it, or choose another --output"
            )
        return "finished"
    return "new"


def clear_run(out: Path) -> None:
    """Remove an earlier run's files (ours by name: `check_output` has refused any directory with others)."""
    if out.is_dir():
        for path in out.iterdir():
            if _ours(path.name) and path.is_file():
                path.unlink()

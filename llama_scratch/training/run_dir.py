"""A fine-tuning run's output directory: which files are ours, what state the run is in, and its results as a set.

An output directory is new (missing or empty), or ours: it holds only files that a run writes. Ours is either
unfinished (a resume point is there: continue with --resume, or restart with --overwrite) or finished
(`classifier.json` is there: --overwrite to replace it). A directory holding anything else is refused whatever
the flags say, so pointing --output at the wrong folder never overwrites or deletes a file we did not write.

While a run trains, the directory holds only work files (the resume point and the best weights so far). The
results appear at the end, `classifier.json` last; each result carries the run's id, and `classify` checks that
the weights and `classifier.json` share it, so files of two runs are never taken for one.

`metrics.json` carries its schema `version` (`METRICS_VERSION`, `checkpoints.versions`); `read_metrics` brings one
written before versions were kept to the current shape (`upgrade_metrics_1`) and refuses one newer than this code.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import re
import shlex
import shutil
import time
import uuid
from pathlib import Path

from ..checkpoints.atomic import write_atomic, write_text_atomic
from ..checkpoints.run_record import RECORD_FILE, RUN_MARKER, WEIGHTS_FILE, RunRecord, write_record
from ..checkpoints.versions import upgraded, versioned
from ..parallel.strategy import Strategy
from .evaluation import accuracy_name, per_step
from .resume_points import RESUME_DIR, RESUME_FILE, is_resume_dir

RUNS_DIR = Path("runs")  # where runs go when --output is not given
BEST_FILE = "best.safetensors"  # the best trained weights so far, while the run trains
FLAGS_FILE = "run_flags.json"  # the flags the run was started with: `--resume --output RUN` needs no others
METRICS_FILE = "metrics.json"  # the run's figures and what they were measured on
SEARCH_FILE = "search.json"  # --search's candidates and the one chosen (training/search.py)
METRICS_VERSION = 2  # the shape `write_results` writes; `read_metrics` brings older ones to it
WORK_FILES = (RESUME_FILE, BEST_FILE, RESUME_DIR, FLAGS_FILE)
RESULT_FILES = (
    WEIGHTS_FILE,
    "history.csv",
    "history.png",
    "confusion.png",
    METRICS_FILE,
    RECORD_FILE,
    SEARCH_FILE,
)
MARKER = RUN_MARKER  # written when a run starts: only a directory holding it is ours to clear
_OUR_TEMP = re.compile(rf"\.({'|'.join(map(re.escape, WORK_FILES + RESULT_FILES))})\.\d+\.tmp")  # write_atomic's


class OutputError(ValueError):
    """An output directory this run may not use (the message says which flag, if any, would allow it)."""


def new_run_id() -> str:
    return uuid.uuid4().hex


def _ours(entry: Path) -> bool:
    """A plain file by one of the names a run writes, or a sharded resume point holding only its parts (the names
    alone prove nothing without the marker)."""
    name = entry.name
    if name == RESUME_DIR and entry.is_dir() and not entry.is_symlink():
        return is_resume_dir(entry)
    known = name in WORK_FILES or name in RESULT_FILES or name == MARKER or bool(_OUR_TEMP.fullmatch(name))
    return known and entry.is_file() and not entry.is_symlink()


def remove_ours(path: Path) -> None:
    """Remove a file or sharded resume point this tool wrote (see `_ours`); nothing if absent."""
    if path.is_dir() and _ours(path):
        shutil.rmtree(path)
    elif path.is_file():
        path.unlink()


def check_output(out: Path, resume: bool, overwrite: bool) -> str:
    """Whether this run may use `out`, decided before anything is loaded: 'new', 'unfinished' or 'finished'.

    Raises OutputError for a directory that holds anything we did not write (always: a non-empty directory without
    our marker is not ours at all), an unfinished run without --resume/--overwrite, and a finished run without
    --overwrite.
    """
    if out.exists() and not out.is_dir():
        raise OutputError(f"--output {out} is a file, not a directory")
    entries = sorted(out.iterdir()) if out.is_dir() else []
    names = [e.name for e in entries]
    foreign = names if entries and MARKER not in names else [e.name for e in entries if not _ours(e)]
    if foreign:  # without our marker nothing in it is ours, whatever the names (metrics.json is a common name)
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        legacy = (
            " (checkpoint.pt of an older version is a pickle and is never loaded)" if "checkpoint.pt" in names else ""
        )
        raise OutputError(
            f"--output {out} holds files this tool did not write ({shown}){legacy}; choose a new or empty directory"
        )
    if RESUME_FILE in names or BEST_FILE in names or RESUME_DIR in names:
        if not (resume or overwrite):
            raise OutputError(f"{out} holds an unfinished run: pass --resume to continue it or --overwrite to restart")
        return "unfinished"
    if RECORD_FILE in names:
        if not overwrite:
            hint = "; it has nothing left to resume" if resume else ""
            raise OutputError(
                f"{out} holds a finished run{hint}: pass --overwrite to replace it, or choose another --output"
            )
        return "finished"
    return "new"


def clear_run(out: Path) -> None:
    """Remove an earlier run's files (`check_output` has refused any directory holding others, or no marker)."""
    if out.is_dir():
        for path in out.iterdir():
            if _ours(path) and path.name != MARKER:
                remove_ours(path)


def latest_run(runs: Path = RUNS_DIR) -> Path:
    """What `--resume` without `--output` continues: the run runs/latest points at."""
    if not (runs / "latest").exists():
        raise OutputError(f"--resume without --output continues {runs}/latest, which does not exist; pass --output")
    return (runs / "latest").resolve()


def resumable(out: Path, overwrite: bool, latest: bool = False) -> dict | None:
    """What `--resume --output OUT` continues, decided before anything is loaded: the flags the run in `out` was
    started with (None: a run of an older version, which kept none: the flags typed are its flags). Refused in one
    line when `out` holds no run of ours to continue: missing, empty, finished (`check_output`) or not ours.
    `latest`: `out` is what runs/latest points at (bare --resume), which follows only runs without --output."""
    try:
        if not out.is_dir():
            raise OutputError(f"--resume: {out} does not exist, so there is no run to continue; leave out --resume")
        state = check_output(out, resume=True, overwrite=overwrite)
        flags = read_flags(out)
        if state == "new" and flags is None:
            raise OutputError(f"--resume: {out} holds no run to continue; leave out --resume to start one there")
    except OutputError as e:
        if not latest:
            raise
        why = f"{e} ({RUNS_DIR}/latest follows the newest run started without --output: pass --output RUN)"
        raise OutputError(why) from None
    return flags


def read_flags(out: Path) -> dict | None:
    """The flags the run in `out` was started with (None: no record, as in a run of an older version)."""
    path = out / FLAGS_FILE
    if not path.is_file():
        return None
    try:
        flags = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise OutputError(f"{path} is not readable JSON ({e}); resume with every flag given, or --overwrite") from None
    if not isinstance(flags, dict):
        raise OutputError(f"{path} does not hold the run's flags; resume with every flag given, or --overwrite")
    return flags


def has_resume_point(out: Path) -> bool:
    """Whether `out` holds progress to continue (a resume point, single or sharded)."""
    return (out / RESUME_FILE).is_file() or (out / RESUME_DIR).is_dir()


def interrupted(out: Path | None, phase: str) -> str:
    """What a Ctrl-C (or SIGTERM) while `phase` leaves in `out` (None: not made yet), and the command that continues
    from it: `--resume --output OUT` alone, since the run's flags are kept there."""
    if out is None:
        return f"interrupted while {phase}: nothing was written; run the same command to start again"
    flags = f"--resume --output {shlex.quote(str(out))}"
    torchrun = "WORLD_SIZE" in os.environ  # launched by torchrun: its own flags must be given again
    again = f"{'the same torchrun command with' if torchrun else 'python -m llama_scratch.finetune_classifier'} {flags}"
    if has_resume_point(out):
        return f"interrupted while {phase}; continue with: {again}"
    return (
        f"interrupted while {phase}, before the first training step: nothing was trained yet. {out}/ keeps the "
        f"run's flags; start it again with: {again}"
    )


def default_output(model_ref: str, data: str, runs: Path = RUNS_DIR) -> Path:
    """A new directory per run, named for the model, the data file (with its type: x.csv and x.jsonl differ) and
    the time, so that no run lands in another's folder."""
    name = Path(data).name.replace(".", "-")
    base = runs / f"{Path(model_ref).name}-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, n = base, 1
    while out.exists():  # two runs started within the same second
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


def point_latest(out: Path) -> None:
    """runs/latest -> the newest run's directory, so `classify --checkpoint runs/latest` finds it. Only a link
    we made is replaced; a file or directory of that name that someone else put there is left alone."""
    latest = out.parent / "latest"
    if latest.exists() and not latest.is_symlink():
        return
    tmp = out.parent / f".latest.{os.getpid()}.tmp"
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(out.name, target_is_directory=True)
        os.replace(tmp, latest)
    except OSError:  # a filesystem without symbolic links: the run is still in its own folder
        tmp.unlink(missing_ok=True)


def history_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return buf.getvalue()


def _pyplot():
    """matplotlib's pyplot, drawing to files only. Imported when a run ends, not when the command starts: it
    takes about half a second."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_history(rows: list[dict], path: Path, best_step: int | None = None, multi_label: bool = False) -> None:
    """history.png: loss and accuracy at each evaluation, training (the mean since the row before) and validation,
    with the evaluation whose weights the run kept marked (the final figures are its, not necessarily the last
    row's). By epoch, or by optimizer step when there are rows inside epochs (--eval-every). A --multi-label run's
    `accuracy` is the exact match (every label of a text right), and its plot says so."""
    plt = _pyplot()
    unit = "step" if per_step(rows) else "epoch"
    xs = [r[unit] for r in rows]
    kept = next((r[unit] for r in rows if r["step"] == best_step), None)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    for split in ("train", "val"):
        ax1.plot(xs, [r[f"{split}_loss"] for r in rows], marker="o", label=split)
        ax2.plot(xs, [r[f"{split}_accuracy"] for r in rows], marker="o", label=split)
    if unit == "step":  # the measure --select-by may choose, beside accuracy
        ax2.plot(xs, [r["val_macro_f1"] for r in rows], marker=".", linestyle=":", label="val macro-F1")
    for ax, what in ((ax1, "loss"), (ax2, accuracy_name(multi_label))):
        ax.set(xlabel=unit, ylabel=what, title=what)
        if unit == "epoch":
            # Whole epochs only, half an epoch of margin: one epoch alone would otherwise get an axis from 0.96 to
            # 1.04.
            ax.set_xticks(xs)
            ax.set_xlim(min(xs, default=1) - 0.5, max(xs, default=1) + 0.5)
        if kept is not None:
            ax.axvline(kept, color="grey", linestyle="--", linewidth=1, label=f"kept ({unit} {kept})")
    ax1.legend()
    if unit == "step":
        ax2.legend()
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)


def plot_confusion(confusion: list[list[int]], names: list[str], path: Path) -> None:
    """confusion.png: the test split's confusion matrix, true classes down, predicted across, counts written in."""
    plt = _pyplot()
    k = len(names)
    size = min(3 + 0.5 * k, 12)
    fig, ax = plt.subplots(figsize=(size, size))
    ax.imshow(confusion, cmap="Blues")
    if k <= 30:  # beyond that, labels and counts would only overlap
        ax.set_xticks(range(k), names, rotation=45, ha="right")
        ax.set_yticks(range(k), names)
        top = max(max(row) for row in confusion) or 1
        for i, row in enumerate(confusion):
            for j, n in enumerate(row):
                ax.text(j, i, str(n), ha="center", va="center", color="white" if n > top / 2 else "black")
    ax.set(xlabel="predicted", ylabel="true", title="test confusion matrix")
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)


def write_results(out: Path, run_id: str, metrics: dict, record: RunRecord, history: list[dict]) -> None:
    """The results as a set, after classifier.safetensors (written by every process: a sharded model is gathered),
    classifier.json (the run record, what classify reads first) last, all tied by one run id; then the run's working
    files go."""
    metrics["run_id"] = run_id
    write_text_atomic(out / "history.csv", history_csv(history))
    plot_history(history, out / "history.png", metrics["best_step"], metrics["multi_label"])
    if "test_confusion" in metrics:  # none under --multi-label: a text is in several classes at once
        plot_confusion(metrics["test_confusion"], metrics["label_names"], out / "confusion.png")
    write_text_atomic(out / METRICS_FILE, json.dumps(versioned(metrics, METRICS_VERSION), indent=2) + "\n")
    write_record(out, dataclasses.replace(record, run_id=run_id))
    for name in (BEST_FILE, FLAGS_FILE, RESUME_FILE, RESUME_DIR):  # spent; the resume point last: a crash here
        # reads "unfinished"
        remove_ours(out / name)


def upgrade_metrics_1(metrics: dict) -> dict:
    """A version 1 metrics.json (no `version`: written before versions were kept) as version 2: the keys
    added as the tool grew, with what a file without them meant. A --multi-label run has always recorded its
    threshold; before --select-by the kept weights were those of the best validation accuracy; before
    --val-data/--test-data every split was cut from --data (whose digest was not recorded); the best step, the
    run id and the macro-F1 of each split were not recorded, and no bag-of-words baseline was fitted."""
    splits = metrics.get("split_sizes") or {}
    added = {
        "split_files": {k: {"file": metrics.get("data"), "digest": None} for k in splits},
        "multi_label": "threshold" in metrics,
        "select_by": "accuracy",
        "best_step": None,
        "run_id": None,
        "baseline": None,
        **{f"{k}_macro_f1": None for k in splits},
    }
    return added | metrics


METRICS_UPGRADES = {1: upgrade_metrics_1}  # version n -> n + 1, applied in turn by `checkpoints.versions.upgraded`


def read_metrics(out: Path) -> dict | None:
    """The finished run's metrics.json in the current shape; None when there is none or it is not a JSON object
    (the figures are a report, not needed to load the weights: an export without them says so). A version newer
    than this code is refused (CheckpointError, naming the file and the version)."""
    path = out / METRICS_FILE
    try:
        metrics = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # ValueError: not UTF-8, or not JSON
        return None
    return upgraded(metrics, path, METRICS_VERSION, METRICS_UPGRADES) if isinstance(metrics, dict) else None


def start_output(out: Path, resume: bool, pointed: bool, strategy: Strategy, flags: dict) -> None:
    """A fresh run clears what an earlier run of ours left in `out` (check_output has refused anything else), and
    records the flags it was started with (a resumed run keeps the record it was started with). Rank 0 does it,
    once every process has checked `out` (a process that looked after would find the run started and refuse);
    the others go on once it is done, or raise its error."""
    strategy.barrier()
    strategy.on_main(lambda: make_output(out, resume, pointed, flags))


def make_output(out: Path, resume: bool, pointed: bool, flags: dict) -> None:
    """`start_output`'s work, in one process."""
    if not resume:
        clear_run(out)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / MARKER).exists():
        write_text_atomic(out / MARKER, "llama_scratch fine-tuning run: this tool may replace the files here\n")
    if not (out / FLAGS_FILE).exists():
        write_text_atomic(out / FLAGS_FILE, json.dumps(flags, indent=2) + "\n")
    if pointed:  # a default output folder: runs/latest points at it
        point_latest(out)

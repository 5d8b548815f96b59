"""Where a run keeps its resume point, which process writes and reads what, and every process ending alike.

What one resume point holds, and how it is written and read as safetensors plus JSON, is checkpoints/resume.py's.
This module decides, for the processes of a run (the strategy, whose collectives it uses):

- **Where.** A replicated run (one process, or DDP's replicas, which hold equal copies of everything) keeps one
  file, `resume.safetensors`, written by rank 0. A sharded run (`--shard`: no process holds the others' rows) keeps
  a directory, `resume.sharded/`, of one part per process: each save is a new numbered point, named in `current`
  once every part is written (one atomic file replace), so a kill at any moment leaves a complete point.
- **Who reads.** Every process must end alike, with the same point or the same refusal: a process that went on
  alone would wait for the others in a collective for hours. Sharded, each process reads its own part, and one
  vote says all found theirs, all found none, or all refuse in one line. Replicated, rank 0 looks first; when
  every process sees the same file (each hashes its header and size, and all agree) each reads it from its own
  disk, so that a point of several GB is not sent over the network; otherwise (machines that share no disk) rank 0
  reads it and sends it, the record as JSON bytes and the tensors one by one, never a pickle.
- **A point of the other kind** (sharded or not) is refused by name, rather than ignored (the run would start
  over).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

from ..checkpoints import resume
from ..checkpoints.atomic import write_text_atomic
from ..checkpoints.resume import ResumeError
from ..parallel.strategy import Strategy

RESUME_FILE = "resume.safetensors"
RESUME_DIR = "resume.sharded"  # under --shard: one part per process (write_parts)

PART = re.compile(r"rank-\d{5}-of-\d{5}\.safetensors")
# A part, or one being written (atomic.write_atomic's temporary, which a process killed mid-save leaves behind).
PART_OR_TEMP = re.compile(rf"{PART.pattern}|\.{PART.pattern}\.\d+\.tmp")
POINT = re.compile(r"point-\d{8}")
CURRENT = "current"


def part_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def location(strategy: Strategy, out: Path, resuming: bool) -> Path:
    """Where this run keeps its resume point in `out`: the file, or the directory of parts when each process holds
    its own part of the state. Resuming, a point of the other kind is refused by name."""
    single, parts = out / RESUME_FILE, out / RESUME_DIR
    mine, other = (parts, single) if strategy.state_per_process else (single, parts)
    if resuming and not mine.exists() and other.exists():
        if other is single:
            raise ResumeError(f"{other} was saved by a run without --shard: resume it without --shard")
        point = (parts / CURRENT).read_text().strip() if (parts / CURRENT).is_file() else ""
        n = len([f for f in (parts / point).iterdir() if PART.fullmatch(f.name)]) if POINT.fullmatch(point) else 0
        raise ResumeError(
            f"{other} was saved by a sharded run of {n or 'several'} processes: resume it with --shard "
            f"under torchrun with {n or 'as many'} processes"
        )
    return mine


# --- writing ---------------------------------------------------------------------------------------------------


def save(strategy: Strategy, where: Path, write: Callable[[Path], None]) -> None:
    """A resume point at `where` (`location`'s), written by `write(file)`. Every process calls it: sharded, each
    writes its part (`write_parts`); replicated, rank 0 writes, since the replicas are equal (and its failure, a
    full disk say, is every process's: strategy.on_main)."""
    if strategy.state_per_process:
        write_parts(strategy, where, write)
    else:
        strategy.on_main(lambda: write(where))


def write_parts(strategy: Strategy, directory: Path, write_part: Callable[[Path], None]) -> None:
    """A point of one part per process (`write_part(file)`) in a new numbered directory inside `directory`; once
    all have written, rank 0 names it in `directory/current` (one atomic file replace) and removes the older ones.
    A kill at any moment leaves `current` naming a complete point, never a mix of steps."""
    processes = strategy.processes

    def new_point() -> str:
        directory.mkdir(parents=True, exist_ok=True)
        done = [int(d.name.removeprefix("point-")) for d in directory.iterdir() if POINT.fullmatch(d.name)]
        new = directory / f"point-{max(done, default=0) + 1:08d}"
        new.mkdir()
        return new.name

    new = directory / strategy.on_main(new_point)  # in this process's `directory`
    new.mkdir(parents=True, exist_ok=True)  # a machine that does not share rank 0's disk
    write_part(new / part_name(processes.rank, processes.world_size))
    strategy.barrier()
    # Rank 0 alone counts, and its count is everyone's: processes counting each on its own can disagree (NFS caches
    # directory listings), and those that raised would leave the others waiting. By name: NFS asks the server.
    parts = [new / part_name(r, processes.world_size) for r in range(processes.world_size)]
    missing = strategy.on_main(lambda: sum(not f.is_file() for f in parts))
    if missing:  # every process raises alike
        raise ResumeError(
            f"{new} lacks {missing} of the {processes.world_size} processes' parts: a sharded run's --output must "
            "be on a disk that every machine sees"
        )

    def name_it() -> None:
        write_text_atomic(directory / CURRENT, new.name + "\n")
        for old in directory.iterdir():
            if POINT.fullmatch(old.name) and old != new:
                shutil.rmtree(old)

    strategy.on_main(name_it)  # every process waits for it: the point is complete when save returns


def is_resume_dir(directory: Path) -> bool:
    """A directory `write_parts` wrote: `current`, numbered points holding parts, and atomic writes' temporaries
    (of `current`, and of parts in a point whose save was cut short: the next save removes that point)."""
    for entry in directory.iterdir():
        if entry.is_symlink():
            return False
        if POINT.fullmatch(entry.name) and entry.is_dir():
            if not all(PART_OR_TEMP.fullmatch(f.name) and f.is_file() for f in entry.iterdir()):
                return False
        elif not (entry.is_file() and re.fullmatch(rf"{CURRENT}|\.{CURRENT}\.\d+\.tmp", entry.name)):
            return False
    return True


# --- reading ---------------------------------------------------------------------------------------------------


def read(strategy: Strategy, out: Path, tensors: bool = True) -> tuple[Path, dict] | None:
    """--resume: the point this run continues from, as (the file read, resume.read_point's record: only its JSON
    without `tensors`), or None when none was saved; alike on every process, which need not see rank 0's disk. A
    point of the other kind is refused by name (`location`). Every process calls it."""
    return (_read_parts if strategy.state_per_process else _read_whole)(strategy, out, tensors)


def part_path(directory: Path, rank: int, world_size: int) -> Path:
    """Process `rank`'s part of the complete point in `directory` (a path that does not exist when no save was
    completed); a clear error when it was saved by another number of processes (resume with the same)."""
    current = directory / CURRENT
    name = current.read_text().strip() if current.is_file() else ""
    if not POINT.fullmatch(name) or not (directory / name).is_dir():
        return directory / "no-complete-point"
    mine = directory / name / part_name(rank, world_size)
    saved = sorted(f.name for f in (directory / name).iterdir() if PART.fullmatch(f.name))
    if not mine.exists():
        n = saved[0].split("-of-")[1].split(".")[0].lstrip("0") if saved else "no"
        raise ResumeError(
            f"{directory} was saved by {n} processes, this run has {world_size}: resume a sharded "
            "run with the same number of processes"
        )
    return mine


def _read_parts(strategy: Strategy, out: Path, tensors: bool) -> tuple[Path, dict] | None:
    """Each process reads its own part (no process holds the others' rows), then one vote: all found theirs, all
    found none, or all failed alike (say, a point of another number of processes), or every process refuses in the
    same line: the processes do not see the same files."""
    found, error = None, None
    processes = strategy.processes
    try:
        where = location(strategy, out, resuming=True)
        part = part_path(where, processes.rank, processes.world_size) if where.exists() else where
        found = (part, resume.read_point(part, tensors)) if part.is_file() else None
    except ResumeError as e:
        error = e
    failed, seen = strategy.vote(error is not None, found is not None)
    if failed.everyone:
        raise error
    if failed.nobody and (seen.everyone or seen.nobody):
        return found
    raise ResumeError(
        f"{out / RESUME_DIR}: {seen.count} of {seen.of} processes found their part of the resume point, "
        f"{failed.count} could not read it and {seen.of - seen.count - failed.count} found none: under --shard each "
        "process reads its own part, so --output must be on a disk that every machine sees"
    )


def fingerprint(path: Path) -> str | None:
    """A digest of the point at `path` as this process sees it: its size and its safetensors header (the tensors'
    names, offsets and the JSON record, whose counters change with every save), or None when it cannot be read.
    Reads the header only, however large the file."""
    try:
        with path.open("rb") as f:
            size = path.stat().st_size
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size:
                return None
            return hashlib.sha256(f"{size}:".encode() + f.read(n)).hexdigest()
    except (OSError, struct.error):
        return None


def _read_whole(strategy: Strategy, out: Path, tensors: bool) -> tuple[Path, dict] | None:
    """Replicas: rank 0 looks (its finding, none or a refusal, is everyone's) and says which point it found; when
    every process sees that point (the same fingerprint), each reads it from its own disk, else rank 0 reads it and
    sends it."""

    def look() -> dict | None:
        where = location(strategy, out, resuming=True)
        return {"where": str(where), "digest": fingerprint(where)} if where.is_file() else None

    head = strategy.on_main(look)
    if head is None:
        return None
    where = Path(head["where"])  # the same path in every process's `out`: out / RESUME_FILE
    (same,) = strategy.vote(head["digest"] is not None and fingerprint(where) == head["digest"])
    if same.everyone:
        return _read_each(strategy, where, tensors)
    return where, _sent_from_main(strategy, where, tensors)


def _read_each(strategy: Strategy, where: Path, tensors: bool) -> tuple[Path, dict]:
    """Every process reads the point all of them see; all read it, or all refuse (in one line when only some
    failed: a process that went on would wait for the others in a collective)."""
    found, error = None, None
    try:
        found = resume.read_point(where, tensors)
    except ResumeError as e:
        error = e
    (failed,) = strategy.vote(error is not None)
    if failed.nobody:
        return where, found
    if failed.everyone:
        raise error
    raise ResumeError(
        f"{where}: {failed.count} of {failed.of} processes could not read the resume point that every process sees"
    )


def _sent_from_main(strategy: Strategy, where: Path, tensors: bool) -> dict:
    """Rank 0 reads the point and sends it: the JSON record as bytes, then the tensors; its refusal is everyone's."""
    kept: dict = {}

    def read_record() -> dict:
        record, kept["tensors"] = resume.read_raw(where, tensors)
        return record

    record = strategy.on_main(read_record)
    if not tensors:
        return record
    return resume.decode(record, strategy.tensors_from_main(kept.get("tensors")), where)

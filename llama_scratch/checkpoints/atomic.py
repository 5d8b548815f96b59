"""Writing files so that a reader, a crash or a full disk never sees half of one, and nothing not ours is deleted.

Every file the tool writes goes through `write_atomic`: the bytes go to a temporary name in the same directory,
are flushed to the disk (fsync), and only then renamed over the target, after which the directory entry itself
is flushed. A reader sees the old file or the new one; a failed write removes its temporary file and leaves the
old file as it was. Whole directories (a converted or downloaded checkpoint) are built under a temporary name
beside the target and swapped in by `replace_directory`, which refuses to replace a directory we did not write.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_file(path: Path) -> None:
    """Flush a file's bytes to the disk (a rename alone may reach the disk before the data does)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries, so a rename into it survives a power cut (a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call `write(tmp)` to fill a temporary file beside `path`, then flush it and rename it to `path`.

    The file gets the permissions `open()` would give it (the umask), whatever `write` chose. On any failure,
    a full disk included, the temporary file is removed and `path` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # some writers (safetensors) create files owner-only
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    """`write_atomic` for text (UTF-8)."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def replace_directory(target: str | Path, build: Callable[[Path], object], is_ours: Callable[[Path], bool]) -> Path:
    """Build a directory with `build(tmp)` beside `target`, then swap it in: old aside, new in, old removed.

    There is no moment at which neither the old nor the new directory exists under some name, and a failed
    `build` leaves `target` as it was. An existing non-empty `target` is replaced only if `is_ours(target)`
    says this tool wrote it; otherwise a FileExistsError names it and nothing is touched.
    """
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a directory; choose another place")
    if target.is_dir() and any(target.iterdir()) and not is_ours(target):
        raise FileExistsError(f"{target} already holds files this tool did not write; choose an empty or new directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    old = target.with_name(f".{target.name}.{os.getpid()}.old")
    for leftover in (tmp, old):  # ours by name (pid-stamped), from a run of this same process id that died
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        tmp.mkdir()
        build(tmp)
        for f in tmp.rglob("*"):
            if f.is_file():
                fsync_file(f)
        if target.exists():
            os.replace(target, old)
        try:
            os.replace(tmp, target)
        except OSError:
            if old.exists():
                os.replace(old, target)  # put the old directory back: never leave neither
            raise
        fsync_dir(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return target

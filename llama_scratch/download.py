"""`python -m llama_scratch.download`: fetch a checkpoint. The fetching itself is `sources/fetch.py`, which the
commands that resolve `--model` use too; this module is only the command line."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from .cli import group, option, parse_settings
from .sources import fetch as sources
from .sources.fetch import SPECIAL_SOURCES, DownloadError, default_dir, fetch


@dataclass
class DownloadOptions:
    """What to fetch, and where."""

    repo_id: str = option(
        "", "Hugging Face repository (e.g. meta-llama/Llama-3.2-1B), or smollm2-135m", positional=True
    )
    dir: Path | None = option(None, "where to put the files (default: weights/NAME)")
    revision: str | None = option(None, "branch, tag or commit (default: main)")
    force: bool = option(False, "replace a checkpoint this tool did not write (only that)")


@dataclass
class DownloadSettings:
    """The download command's settings (one group)."""

    download: DownloadOptions = group(DownloadOptions)


def main(argv: list[str] | None = None) -> int:
    description = sources.__doc__.split("\n")[0]
    o = parse_settings(
        DownloadSettings, argv, prog="python -m llama_scratch.download", description=description
    ).download
    try:
        default = None if o.repo_id in SPECIAL_SOURCES else default_dir(o.repo_id)
        path = fetch(o.repo_id, o.dir or default, o.revision, force=o.force)
    except (DownloadError, OSError, ValueError) as e:  # ValueError: a GGUF that cannot be converted
        print(f"error: {e}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(f"{o.repo_id} is in {path} ({size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m llama_scratch.download`: fetch a checkpoint. The fetching itself is `sources/fetch.py`, which the
commands that resolve `--model` use too; this module is only the command line."""

from __future__ import annotations

import sys
from pathlib import Path

from .cli import CommandParser
from .sources import fetch as sources
from .sources.fetch import SPECIAL_SOURCES, DownloadError, default_dir, fetch


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="python -m llama_scratch.download", description=sources.__doc__.split("\n")[0])
    parser.add_argument("repo_id", help="Hugging Face repository (e.g. meta-llama/Llama-3.2-1B), or smollm2-135m")
    parser.add_argument("--dir", type=Path, help="where to put the files (default: weights/NAME)")
    parser.add_argument("--revision", help="branch, tag or commit (default: main)")
    parser.add_argument("--force", action="store_true", help="replace a checkpoint this tool did not write (only that)")
    args = parser.parse_args(argv)
    try:
        default = None if args.repo_id in SPECIAL_SOURCES else default_dir(args.repo_id)
        path = fetch(args.repo_id, args.dir or default, args.revision, force=args.force)
    except (DownloadError, OSError, ValueError) as e:  # ValueError: a GGUF that cannot be converted
        print(f"error: {e}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(f"{args.repo_id} is in {path} ({size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

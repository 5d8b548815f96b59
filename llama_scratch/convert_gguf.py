"""`python -m llama_scratch.convert_gguf FILE.gguf OUT_DIR [--force]`: turn a Llama GGUF file into a checkpoint
directory.

OUT_DIR is built beside its final place and swapped in by renames, so it is complete or absent. An existing
OUT_DIR is replaced only if this tool wrote it; --force also replaces a checkpoint written by something else, but
never a directory holding anything other than checkpoint files (see `llama_scratch.checkpoints.hf_layout.replaceable`).
"""

from __future__ import annotations

import sys
import time

from .checkpoints.gguf import GGUFError, convert_gguf
from .cli import CommandParser
from .model.config import parse_dtype


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(
        prog="python -m llama_scratch.convert_gguf",
        description="Convert a llama.cpp GGUF file (Llama architecture, byte-level BPE tokenizer) into a Hugging "
        "Face-layout checkpoint directory (float32 safetensors, config.json, tokenizer.json) for --model.",
    )
    parser.add_argument("gguf_file", help="the .gguf file")
    parser.add_argument("out_dir", help="directory to write (an existing one is replaced only if this tool wrote it)")
    parser.add_argument(
        "--dtype", default="float32", help="float32 (default: exact) or bfloat16 (half the size, rounded)"
    )
    parser.add_argument("--force", action="store_true", help="replace a checkpoint this tool did not write (only that)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        dtype = parse_dtype(args.dtype)
        out = convert_gguf(args.gguf_file, args.out_dir, dtype=dtype, progress=not args.no_progress, force=args.force)
    except (GGUFError, OSError, ValueError) as e:  # OSError: a missing file, a refused OUT_DIR, a full disk
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

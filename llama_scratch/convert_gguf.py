"""`python -m llama_scratch.convert_gguf FILE.gguf OUT_DIR [--force]`: turn a Llama GGUF file into a checkpoint
directory.

OUT_DIR is built beside its final place and swapped in by renames, so it is complete or absent. An existing
OUT_DIR is replaced only if this tool wrote it; --force also replaces a checkpoint written by something else, but
never a directory holding anything other than checkpoint files (see `llama_scratch.checkpoints.hf_layout.replaceable`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from .checkpoints.gguf import GGUFError, convert_gguf
from .cli import group, option, parse_settings
from .model.config import parse_dtype


@dataclass
class ConvertOptions:
    """The file to convert, where to, and how."""

    gguf_file: str = option("", "the .gguf file", positional=True)
    out_dir: str = option(
        "", "directory to write (an existing one is replaced only if this tool wrote it)", positional=True
    )
    dtype: str = option("float32", "float32 (default: exact) or bfloat16 (half the size, rounded)")
    force: bool = option(False, "replace a checkpoint this tool did not write (only that)")
    no_progress: bool = option(False, "no progress bar")


@dataclass
class ConvertSettings:
    """The convert command's settings (one group)."""

    convert: ConvertOptions = group(ConvertOptions)


DESCRIPTION = (
    "Convert a llama.cpp GGUF file (Llama architecture, byte-level BPE tokenizer) into a Hugging Face-layout "
    "checkpoint directory (float32 safetensors, config.json, tokenizer.json) for --model."
)


def main(argv: list[str] | None = None) -> int:
    o = parse_settings(ConvertSettings, argv, prog="python -m llama_scratch.convert_gguf", description=DESCRIPTION)
    o = o.convert
    start = time.perf_counter()
    try:
        dtype = parse_dtype(o.dtype)
        out = convert_gguf(o.gguf_file, o.out_dir, dtype=dtype, progress=not o.no_progress, force=o.force)
    except (GGUFError, OSError, ValueError) as e:  # OSError: a missing file, a refused OUT_DIR, a full disk
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

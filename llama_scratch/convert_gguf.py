"""`python -m llama_scratch.convert_gguf FILE.gguf OUT_DIR`: turn a Llama GGUF file into a checkpoint directory."""

from __future__ import annotations

import argparse
import sys
import time

from .config import parse_dtype
from .gguf import GGUFError, convert_gguf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m llama_scratch.convert_gguf",
        description="Convert a llama.cpp GGUF file (Llama architecture, byte-level BPE tokenizer) into a Hugging "
        "Face-layout checkpoint directory (float32 safetensors, config.json, tokenizer.json) for --model.",
    )
    parser.add_argument("gguf_file", help="the .gguf file")
    parser.add_argument("out_dir", help="directory to write (replaced if it exists)")
    parser.add_argument(
        "--dtype", default="float32", help="float32 (default: exact) or bfloat16 (half the size, rounded)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        dtype = parse_dtype(args.dtype)
        out = convert_gguf(args.gguf_file, args.out_dir, dtype=dtype, progress=not args.no_progress)
    except (GGUFError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How far a quantized base's outputs move from full precision, on a real checkpoint and the bundled SMS texts.

    python benchmarks/quantize_error.py                          # SmolLM2-135M-Instruct (weights/), int8 and nf4
    python benchmarks/quantize_error.py --model DIR --texts 32   # another checkpoint, fewer texts

For each scheme the model is loaded with every block's linears (and an untied LM head) quantized, exactly as
`--quantize` loads a frozen base, and run in float32 beside the full-precision model on the first N texts of the
SMS data (each cut to 64 tokens). Reported: the relative error of the next-token logits at every position
(||quantized - full|| / ||full||), and how often the top-1 next token is unchanged. The classifier pools one of
these positions' hidden states, so this is the error its frozen features start from.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # runnable from a fresh clone, installed or not
from llama_scratch import load_model  # noqa: E402
from llama_scratch.data.labelled import load_dataset  # noqa: E402
from llama_scratch.model.tokenizer import Tokenizer  # noqa: E402


def next_token_logits(model: torch.nn.Module, rows: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(torch.tensor([row]))[0].float() for row in rows])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="weights/smollm2-135m-instruct", help="a checkpoint directory")
    p.add_argument("--texts", type=int, default=64, help="how many SMS texts (default: 64)")
    p.add_argument("--schemes", nargs="+", default=["int8", "nf4"], choices=["int8", "nf4"])
    args = p.parse_args(argv)
    tokenizer = Tokenizer.for_checkpoint(args.model)
    rows = [tokenizer.encode(text)[:64] for text in load_dataset("sms_spam").texts[: args.texts]]
    full = next_token_logits(load_model(args.model, device="cpu", dtype=torch.float32, progress=False).eval(), rows)
    print(f"{args.model}: {len(rows)} texts, {full.shape[0]:,} positions, float32 compute")
    for scheme in args.schemes:
        start = time.perf_counter()
        model = load_model(args.model, device="cpu", dtype=torch.float32, quantize=scheme, progress=False).eval()
        got = next_token_logits(model, rows)
        error = ((got - full).norm() / full.norm()).item()
        same = (got.argmax(-1) == full.argmax(-1)).float().mean().item()
        seconds = time.perf_counter() - start
        print(
            f"{scheme}: logits relative error {error:.4f}; top-1 unchanged at {same:.1%} of positions ({seconds:.0f} s)"
        )


if __name__ == "__main__":
    main()

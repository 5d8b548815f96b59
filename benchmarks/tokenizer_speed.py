"""How fast the tokenizer encodes the bundled SMS dataset, next to Meta's reference and bare tiktoken.

Run: python benchmarks/tokenizer_speed.py [--repeats 5]
Each timing encodes all 5,574 messages one call at a time (as the data pipeline does); best and median of the
repeats are reported, with the reference's time divided by ours.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import tiktoken

from llama_scratch.model.tokenizer import Tokenizer, default_model_path

SMS = Path(__file__).parents[1] / "llama_scratch" / "data" / "sms_spam.tsv"


def timings(encode: Callable[[str], list[int]], texts: list[str], repeats: int) -> list[float]:
    """Seconds per pass over `texts`, one entry per repeat (after one warm-up pass)."""
    for text in texts:
        encode(text)
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        for text in texts:
            encode(text)
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    texts = [line.split("\t", 1)[1] for line in SMS.read_text(encoding="utf-8").splitlines()]
    chars = sum(map(len, texts))

    start = time.perf_counter()
    ours = Tokenizer.default()
    load_ours = time.perf_counter() - start
    from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer  # reference: benchmark/test-only

    start = time.perf_counter()
    meta = MetaTokenizer(default_model_path())
    load_meta = time.perf_counter() - start
    n_tokens = sum(len(ours.encode(t)) for t in texts)

    runs = {
        "llama_scratch Tokenizer.encode": timings(lambda t: ours.encode(t, bos=True), texts, args.repeats),
        "Meta reference Tokenizer.encode": timings(lambda t: meta.encode(t, bos=True, eos=False), texts, args.repeats),
        "bare tiktoken encode_ordinary": timings(ours.encoding.encode_ordinary, texts, args.repeats),
    }
    print(f"SMS dataset: {len(texts)} messages, {chars:,} characters, {n_tokens:,} tokens")
    print(f"python {platform.python_version()}, tiktoken {tiktoken.__version__}, {platform.processor() or 'cpu'}")
    print(f"load tokenizer.model: ours {load_ours:.3f} s, reference {load_meta:.3f} s")
    for name, secs in runs.items():
        best, median = min(secs), statistics.median(secs)
        print(
            f"{name:34s} best {best * 1e3:7.1f} ms  median {median * 1e3:7.1f} ms  {n_tokens / best / 1e6:5.2f} M tok/s"
        )
    ratio = min(runs["Meta reference Tokenizer.encode"]) / min(runs["llama_scratch Tokenizer.encode"])
    print(f"reference / ours (best): {ratio:.2f}x")


if __name__ == "__main__":
    main()

"""Packed vs padded where batches are sorted by length: the frozen-prefix pass and evaluation/classify.

Run: python benchmarks/packed_passes.py [--texts 400] [--threads N]

The 44M `small` config of train_speed.py (random weights, train_last=1: 7 frozen blocks), the first `--texts` SMS
messages (Llama-3 tokens renumbered into its vocabulary), 16 texts a batch. "prefix" is
`prefix_cache.compute_frozen_states` with `packed=True` or `False`; "evaluation" is the classifier's forward
under `torch.inference_mode` over `batching.length_sorted_batches`, `to_batch` layout "packed" or "right" (what
`evaluation.evaluate` and `classify.predict_proba` do). Alternating, median of 3 rounds.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from train_speed import BENCH_PRESETS, renumber  # noqa: E402

from llama_scratch import Llama, LlamaClassifier, Tokenizer  # noqa: E402
from llama_scratch.data.batching import TokenizedSplit, forward, length_sorted_batches, to_batch  # noqa: E402
from llama_scratch.data.labelled import load_sms_spam  # noqa: E402
from llama_scratch.training.prefix_cache import compute_frozen_states  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=400)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg, tok = BENCH_PRESETS["small"], Tokenizer.default()
    rows = [tok.encode(t, bos=True) for t in load_sms_spam().texts[: args.texts]]
    [rows], pad = renumber([rows], tok.pad_id, cfg.vocab_size)
    clf = LlamaClassifier(Llama(cfg), 2, train_last=1).eval()
    split = TokenizedSplit(rows, [0] * len(rows), pad_id=pad)

    def prefix(layout: str) -> None:
        compute_frozen_states(clf, rows, pad, 16, show=False, packed=layout == "packed")

    @torch.inference_mode()
    def evaluation(layout: str) -> None:
        for batch in length_sorted_batches([len(r) for r in rows], 16):
            forward(clf, to_batch(split, batch, layout, torch.device("cpu")))

    print(f"{torch.get_num_threads()} threads, {len(rows)} texts, {sum(map(len, rows))} tokens")
    print("| pass | packed s | padded s | padded / packed |\n| --- | ---: | ---: | ---: |")
    for name, f in [("frozen prefix", prefix), ("evaluation / classify", evaluation)]:
        times: dict[str, list[float]] = {"packed": [], "right": []}
        f("packed"), f("right")  # warm-up
        for r in range(3):
            for layout in ("packed", "right") if r % 2 == 0 else ("right", "packed"):
                start = time.perf_counter()
                f(layout)
                times[layout].append(time.perf_counter() - start)
        packed, padded = statistics.median(times["packed"]), statistics.median(times["right"])
        print(f"| {name} | {packed:.2f} | {padded:.2f} | {padded / packed:.2f}x |")


if __name__ == "__main__":
    main()

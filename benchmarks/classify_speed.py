"""`classify` against transformers' `pipeline("text-classification")` on the same exported weights.

Run: python benchmarks/classify_speed.py [--model MODEL] [--texts 256] [--batch-size 16] [--rounds 3] [--threads N]

A short run (`finetune_classifier`, one optimizer step, the last 2 blocks, on 96 SMS texts) of the default model
(or `--model`) is exported with `export_hf` in float32; ours is `classify.load_classifier` on the run and
`classify.predict_proba` (tokenizing included, length-sorted, packed without padding unless `--layout right`),
theirs is `transformers.pipeline("text-classification", model=EXPORT, top_k=None)` with the same batch size (its
tokenizer and padding included). Both score the same `--texts` SMS messages; the probabilities must agree to 1e-4
(asserted). Rounds alternate which goes first; tokens/s counts the texts' tokens (BOS included), once.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import transformers

from llama_scratch import classify, export_hf, finetune_classifier
from llama_scratch.data.labelled import load_sms_spam


def make_run(tmp: Path, model: str | None) -> tuple[Path, Path]:
    """A one-step run on 96 SMS texts and its float32 export."""
    sms = load_sms_spam()
    data = tmp / "sms.csv"
    with data.open("w", newline="") as f:
        csv.writer(f).writerows(
            [("message", "category")]
            + [(t, ["ham", "spam"][y]) for t, y in zip(sms.texts[:96], sms.labels[:96], strict=True)]
        )
    run, export = tmp / "run", tmp / "export"
    argv = ["--data", str(data), "--split", "full", "--output", str(run), "--max-steps", "1", "--train-last", "2"]
    assert finetune_classifier.main(argv + (["--model", model] if model else [])) == 0
    assert export_hf.main(["--checkpoint", str(run), "--output", str(export), "--dtype", "float32"]) == 0
    return run, export


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="base model of the run (default: the command's default)")
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--layout", choices=["packed", "right"], default="packed", help="our batches")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    texts = load_sms_spam().texts[-args.texts :]  # not the texts the run trained on
    with tempfile.TemporaryDirectory() as tmp:
        run, export = make_run(Path(tmp), args.model)
        clf, tokenizer, _ = classify.load_classifier(run, device="cpu", dtype="float32")
        pipe = transformers.pipeline("text-classification", model=str(export), device="cpu", top_k=None)

        def ours() -> torch.Tensor:
            return classify.predict_proba(clf, tokenizer, texts, batch_size=args.batch_size, layout=args.layout)

        def theirs() -> torch.Tensor:
            out = pipe(texts, batch_size=args.batch_size)
            names = [pipe.model.config.id2label[k] for k in range(len(pipe.model.config.id2label))]
            return torch.tensor([[{d["label"]: d["score"] for d in row}[n] for n in names] for row in out])

        torch.testing.assert_close(ours(), theirs(), rtol=1e-4, atol=1e-4)
        times: dict[str, list[float]] = {"ours": [], "theirs": []}
        for r in range(args.rounds):
            for name, f in [("ours", ours), ("theirs", theirs)][:: 1 if r % 2 == 0 else -1]:
                start = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - start)
            print(f"  round {r + 1}: ours {times['ours'][-1]:.2f} s, theirs {times['theirs'][-1]:.2f} s")
    tokens = sum(len(tokenizer.encode(t, bos=True)) for t in texts)
    ours_s, theirs_s = statistics.median(times["ours"]), statistics.median(times["theirs"])
    ratio = statistics.median(t / o for o, t in zip(times["ours"], times["theirs"], strict=True))
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
        f"load average {os.getloadavg()[0]:.1f}; {clf.backbone.cfg.n_layers} layers, dim {clf.backbone.cfg.dim}"
    )
    print("\n| model | texts | batch | ours layout | ours tok/s | pipeline tok/s | ratio (median of rounds) |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: |")
    print(
        f"| {args.model or 'default'} | {len(texts)} ({tokens} tokens) | {args.batch_size} | {args.layout} "
        f"| {tokens / ours_s:.0f} | {tokens / theirs_s:.0f} | {theirs_s / ours_s:.2f}x ({ratio:.2f}x) |"
    )


if __name__ == "__main__":
    main()

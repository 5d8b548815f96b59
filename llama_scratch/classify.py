"""Label texts with a fine-tuned classifier: `python -m llama_scratch.classify --checkpoint runs/X "some text"`.

The base model is streamed onto the device first (the same low-memory path as training), then the trained
parameters from `classifier.safetensors` are put in place.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from .batching import collate, length_sorted_batches
from .classifier import LlamaClassifier
from .config import LlamaConfig, parse_dtype
from .download import DownloadError
from .finetune_classifier import choose_dtype
from .model import Llama
from .tokenizer import Tokenizer
from .weights import CheckpointError, load_model


def load_classifier(
    run_dir: str | Path, device: str | torch.device = "auto", dtype: str = "auto"
) -> tuple[LlamaClassifier, Tokenizer, dict]:
    """A fine-tuned classifier from a `finetune_classifier` output directory, its tokenizer and its settings."""
    run_dir = Path(run_dir)
    meta_path, weights_path = run_dir / "classifier.json", run_dir / "classifier.safetensors"
    for path in (meta_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: is {run_dir} the --output of a finished fine-tuning run?")
    meta = json.loads(meta_path.read_text())
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    torch_dtype = choose_dtype(dtype, device)
    if dtype == "auto" and torch_dtype != torch.float32:  # the device computes low precision well: use what
        torch_dtype = parse_dtype(meta["dtype"])  # training used, so predictions match the evaluation it reported
    if meta["weights_include_backbone"]:  # trained from scratch: the file holds every weight
        cfg = LlamaConfig.from_hf_dict(meta["config"], source=str(meta_path))
        cfg.dtype = torch_dtype
        with torch.device("meta"):
            backbone = Llama(cfg)
        backbone.to_empty(device=device)
    else:
        backbone = load_model(meta["base_model"], device=device, dtype=torch_dtype)
    clf = LlamaClassifier(backbone, num_classes=meta["num_classes"], train_last=meta["train_last"]).eval()
    params = dict(clf.named_parameters())
    with safe_open(weights_path, framework="pt", device=str(device)) as f:
        names = f.keys()  # safe_open is not iterable itself
        unknown = [k for k in names if k not in params]
        if unknown:
            raise CheckpointError(f"{weights_path}: tensors that this classifier does not have: {unknown[:5]}")
        with torch.no_grad():
            for name in names:
                params[name].copy_(f.get_tensor(name))
    tokenizer = Tokenizer.default() if meta["tokenizer"] == "llama3" else Tokenizer.for_checkpoint(meta["tokenizer"])
    return clf, tokenizer, meta


@torch.inference_mode()
def predict(
    clf: LlamaClassifier, tokenizer: Tokenizer, texts: list[str], max_length: int, batch_size: int = 16
) -> list[tuple[int, float]]:
    """(class id, probability) per text, in input order. Texts are batched by length to pad little."""
    device = clf.head.weight.device
    ids = [tokenizer.encode(t, bos=True)[:max_length] for t in texts]
    out: list[tuple[int, float]] = [(0, 0.0)] * len(ids)
    for rows in length_sorted_batches([len(x) for x in ids], batch_size):
        batch = collate([(ids[i], 0) for i in rows], tokenizer.pad_id)
        probs = clf(batch["input_ids"].to(device), batch["attention_mask"].to(device)).float().softmax(-1)
        best = probs.max(-1)
        for i, label, p in zip(rows, best.indices.tolist(), best.values.tolist(), strict=True):
            out[i] = (label, p)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llama_scratch.classify", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, type=Path, help="output directory of finetune_classifier")
    p.add_argument("texts", nargs="*", help="texts to classify")
    p.add_argument("--file", help="a file with one text per line ('-': standard input)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (the training dtype on a GPU with bfloat16, else float32) | bfloat16 | float32",
    )
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args(argv)
    texts = list(args.texts)
    if args.file:
        try:
            handle = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")  # noqa: SIM115
        except OSError as e:
            print(f"error: cannot read {args.file}: {e.strerror}", file=sys.stderr)
            return 2
        with handle:
            texts += [line.rstrip("\r\n") for line in handle if line.strip()]
    if not texts:
        p.error("give texts to classify, or --file")
    try:
        clf, tokenizer, meta = load_classifier(args.checkpoint, args.device, args.dtype)
    except (FileNotFoundError, ValueError, DownloadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for text, (label, prob) in zip(
        texts, predict(clf, tokenizer, texts, meta["max_length"], args.batch_size), strict=True
    ):
        print(f"{meta['label_names'][label]}\t{prob:.3f}\t{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

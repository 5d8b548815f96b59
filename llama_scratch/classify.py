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
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from .batching import collate, length_sorted_batches
from .classifier import LlamaClassifier
from .config import LlamaConfig, parse_dtype
from .download import DownloadError
from .finetune_classifier import choose_dtype
from .model import Llama
from .tokenizer import Tokenizer
from .train import RESUME_FILE
from .weights import CheckpointError, copy_named_tensors, load_model


def load_classifier(
    run_dir: str | Path, device: str | torch.device = "auto", dtype: str = "auto"
) -> tuple[LlamaClassifier, Tokenizer, dict]:
    """A fine-tuned classifier from a `finetune_classifier` output directory, its tokenizer and its settings."""
    run_dir = Path(run_dir)
    meta_path, weights_path = run_dir / "classifier.json", run_dir / "classifier.safetensors"
    if (run_dir / RESUME_FILE).is_file() and not meta_path.is_file():
        raise FileNotFoundError(f"{run_dir} holds an unfinished run: finish it with finetune_classifier --resume")
    for path in (meta_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: is {run_dir} the --output of a finished fine-tuning run?")
    meta = read_run_files(meta_path, weights_path)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    torch_dtype = choose_dtype(dtype, device)
    if dtype == "auto" and torch_dtype != torch.float32:  # the device computes low precision well: use what
        torch_dtype = parse_dtype(meta["dtype"])  # training used, so predictions match the evaluation it reported
    if meta["weights_include_backbone"]:  # trained from scratch: the file holds every weight
        cfg = LlamaConfig.from_hf_dict(meta["config"], source=str(meta_path))
        cfg.dtype = torch_dtype
        with torch.device("meta"):
            backbone = Llama(cfg)
        backbone.to_empty(device=device)  # every weight is then filled from the file
        if cfg.tie_embeddings:  # to_empty gives each name its own tensor: tie them again
            backbone.lm_head.weight = backbone.embed_tokens.weight
    else:
        backbone = load_model(meta["base_model"], device=device, dtype=torch_dtype)
    clf = LlamaClassifier(backbone, num_classes=meta["num_classes"], train_last=meta["train_last"]).eval()
    tensors = load_file(weights_path, device=str(device))
    # Every parameter of a from-scratch model, else every one the run trained: none may keep a fresh initialisation.
    needed = clf.named_parameters() if meta["weights_include_backbone"] else clf.trainable_parameters().items()
    copy_named_tensors(clf, tensors, str(weights_path), required=[name for name, _ in needed])
    tokenizer = Tokenizer.default() if meta["tokenizer"] == "llama3" else Tokenizer.for_checkpoint(meta["tokenizer"])
    return clf, tokenizer, meta


RUN_KEYS = ("base_model", "weights_include_backbone", "config", "num_classes", "label_names", "train_last",
            "tokenizer", "max_length", "dtype")  # fmt: skip


def read_run_files(meta_path: Path, weights_path: Path) -> dict:
    """classifier.json, checked to hold what loading needs and to come from the same run as the weights file."""
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        with safe_open(weights_path, framework="pt") as f:
            weights_run = (f.metadata() or {}).get("run_id")
    except (UnicodeDecodeError, json.JSONDecodeError, SafetensorError) as e:
        raise CheckpointError(f"{meta_path.parent}: unreadable run files: {e}") from None
    missing = [k for k in RUN_KEYS if k not in meta] if isinstance(meta, dict) else list(RUN_KEYS)
    if missing:
        raise CheckpointError(f"{meta_path} is not a classifier description (it lacks {', '.join(missing)})")
    if meta.get("run_id") != weights_run:  # runs from before run ids have neither
        raise CheckpointError(
            f"{meta_path.parent}: classifier.json and classifier.safetensors come from different runs (run ids "
            f"{meta.get('run_id')} and {weights_run}); train again into a new --output"
        )
    return meta


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

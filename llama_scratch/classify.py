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
from .config import PRESETS, LlamaConfig, parse_dtype
from .devices import choose_dtype, resolve_device
from .download import DownloadError
from .model import Llama
from .plan import count_parameters
from .sources import load_model
from .tokenizer import Tokenizer
from .train import RESUME_FILE
from .weights import CheckpointError, copy_named_tensors


def load_classifier(
    run_dir: str | Path, device: str | torch.device = "auto", dtype: str = "auto", model: str | Path | None = None
) -> tuple[LlamaClassifier, Tokenizer, dict]:
    """A fine-tuned classifier from a `finetune_classifier` output directory, its tokenizer and its settings.
    `model` points at the base checkpoint when it is no longer where the run recorded it."""
    run_dir, device = Path(run_dir), resolve_device(str(device))
    meta_path, weights_path = run_dir / "classifier.json", run_dir / "classifier.safetensors"
    if (run_dir / RESUME_FILE).is_file() and not meta_path.is_file():
        raise FileNotFoundError(f"{run_dir} holds an unfinished run: finish it with finetune_classifier --resume")
    for path in (meta_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: is {run_dir} the --output of a finished fine-tuning run?")
    meta = read_run_files(meta_path, weights_path)
    cfg = LlamaConfig.from_hf_dict(meta["config"], source=str(meta_path))
    trained_in = parse_dtype(meta["dtype"])  # a float32 copy that would not fit keeps the training dtype
    torch_dtype = choose_dtype(dtype, device, trained_in, count_parameters(cfg).backbone)
    if dtype == "auto" and torch_dtype != torch.float32:  # the device computes low precision well: use what
        torch_dtype = trained_in  # training used, so predictions match the evaluation it reported
    base = None
    if meta["weights_include_backbone"]:  # trained from scratch: the file holds every weight
        cfg.dtype = torch_dtype
        with torch.device("meta"):
            backbone = Llama(cfg)
        backbone.to_empty(device=device)  # every weight is then filled from the file
        if cfg.tie_embeddings:  # to_empty gives each name its own tensor: tie them again
            backbone.lm_head.weight = backbone.embed_tokens.weight
    else:
        base = find_base_model(meta, run_dir, model)
        backbone = load_model(base, device=device, dtype=torch_dtype)
    clf = LlamaClassifier(backbone, num_classes=meta["num_classes"], train_last=meta["train_last"]).eval()
    tensors = load_file(weights_path, device=str(device))
    # Every parameter of a from-scratch model, else every one the run trained: none may keep a fresh initialisation.
    needed = clf.named_parameters() if meta["weights_include_backbone"] else clf.trainable_parameters().items()
    copy_named_tensors(clf, tensors, str(weights_path), required=[name for name, _ in needed])
    if meta["tokenizer"] == "llama3":
        tokenizer = Tokenizer.default()
    else:  # the base checkpoint's own: where it is now, if it moved
        tokenizer = Tokenizer.for_checkpoint(base if base and Path(base).is_dir() else meta["tokenizer"])
    return clf, tokenizer, meta


def find_base_model(meta: dict, run_dir: Path, override: str | Path | None) -> str:
    """The base checkpoint: `--model` if given; else as recorded, relative to the run (a run moved together with
    its weights), then absolute, then the Hub repo it came from; a clear error naming --model otherwise."""
    if override is not None:
        if not Path(override).exists():
            raise FileNotFoundError(f"--model {override}: no such file or directory")
        return str(override)
    candidates = []
    if rel := meta.get("base_model_relative"):
        candidates.append(run_dir / rel)
    candidates.append(Path(meta["base_model"]))
    for path in candidates:
        if path.exists():
            return str(path)
    if meta["base_model"] in PRESETS or meta.get("base_model_repo"):
        return meta.get("base_model_repo") or meta["base_model"]
    raise FileNotFoundError(
        f"the base model of {run_dir} is no longer at {meta['base_model']} (moved or deleted?); pass --model PATH "
        "to point at its checkpoint directory"
    )


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
    clf: LlamaClassifier, tokenizer: Tokenizer, texts: list[str], max_length: int | None = None, batch_size: int = 16
) -> list[tuple[int, float]]:
    """(class id, probability) per text, in input order. Texts are cut to `max_length` tokens only if asked (by
    default, to the model's context: the training run's length limit is no limit here). Batched by length."""
    device = clf.head.weight.device
    ids = [tokenizer.encode(t, bos=True)[: max_length or clf.backbone.cfg.max_seq_len] for t in texts]
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
    p.add_argument("--max-length", type=int, help="cut texts to this many tokens (default: the model's context, "
                   "whatever the training run used)")  # fmt: skip
    p.add_argument("--model", help="the base checkpoint directory, when it moved since training")
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
        clf, tokenizer, meta = load_classifier(args.checkpoint, args.device, args.dtype, args.model)
    except (FileNotFoundError, ValueError, DownloadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    max_length = args.max_length or clf.backbone.cfg.max_seq_len
    if cut := sum(len(tokenizer.encode(t, bos=True)) > max_length for t in texts):
        why = "--max-length" if args.max_length else "the model's context"
        print(f"note: {cut} text(s) longer than {max_length} tokens ({why}) were cut to that", file=sys.stderr)
    for text, (label, prob) in zip(texts, predict(clf, tokenizer, texts, max_length, args.batch_size), strict=True):
        print(f"{meta['label_names'][label]}\t{prob:.3f}\t{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

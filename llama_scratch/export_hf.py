"""Export a fine-tuned classifier as a directory Hugging Face transformers loads with no code of ours.

`python -m llama_scratch.export_hf --checkpoint runs/X --output DIR [--dtype bfloat16|float32]`.

DIR loads with `AutoModelForSequenceClassification.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)`,
no code of ours: config.json (LlamaForSequenceClassification, the labels, the padding token), the weights in
safetensors shards (the run's trained tensors over the base checkpoint's, LoRA adapters merged, the head as
`score.weight`), the tokenizer files and a README.md model card. transformers pools the last token that is not
the padding token: our last real token with right padding, as we train, and with left padding the last position
(its position ids then count from the first pad, not the first token, which rotary embeddings do not notice).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoints.atomic import replace_directory, write_text_atomic
from .checkpoints.export_tokenizer import tokenizer_file, tokenizer_files
from .checkpoints.export_weights import plan_export, write_weights
from .checkpoints.model_card import model_card
from .checkpoints.run_record import WEIGHTS_FILE, read_run
from .cli import group, option, parse_settings
from .model.config import LlamaConfig, parse_dtype
from .model.tokenizer import Tokenizer
from .sources.fetch import DownloadError
from .sources.resolve import local_checkpoint
from .training.run_dir import read_metrics

MARKER = "llama_scratch_export.json"  # names the files an export wrote: only those are ever replaced
GB = 10**9


class ExportError(ValueError):
    """An export that cannot be made as asked (the message says which flag, if any, would allow it)."""


def is_export(path: Path) -> bool:
    """A directory this command wrote and nobody added to: the marker lists every other entry in it."""
    return not foreign_entries(path)


def foreign_entries(path: Path) -> list[str]:
    """What in `path` an export did not write: everything when there is no readable marker."""
    names = sorted(p.name for p in path.iterdir())
    try:
        ours = set(json.loads((path / MARKER).read_text(encoding="utf-8"))["files"]) | {MARKER}
    except (OSError, ValueError, KeyError, TypeError):
        return names
    return [n for n in names if n not in ours or (path / n).is_dir()]


def check_output(out: Path, overwrite: bool) -> None:
    """New or empty, or a previous export with --overwrite; decided before anything is read or written."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--output {out} is a file, not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if foreign := foreign_entries(out):
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ExportError(
            f"--output {out} holds files this tool did not write ({shown}); choose a new or empty directory"
        )
    if not overwrite:
        raise ExportError(f"--output {out} holds an earlier export: pass --overwrite to replace it")


def hf_config(
    cfg: LlamaConfig, label_names: list[str], tokenizer: Tokenizer, dtype: torch.dtype, multi_label: bool = False
) -> dict:
    """config.json: our LlamaConfig's fields, the sequence-classification architecture, the labels and the padding
    token, whose id transformers uses to find each row's last real token. `problem_type` tells transformers how
    the logits are read (its loss, and a pipeline's scores): a softmax over the classes, or under --multi-label a
    sigmoid per label (`multi_label_classification`), as the run trained and classify predicts."""
    names = [str(n) for n in label_names]
    dtype_name = str(dtype).removeprefix("torch.")
    config = cfg.to_hf_dict() | {
        "architectures": ["LlamaForSequenceClassification"],
        "num_labels": len(names),
        "id2label": {str(i): n for i, n in enumerate(names)},
        "label2id": {n: i for i, n in enumerate(names)},
        "problem_type": "multi_label_classification" if multi_label else "single_label_classification",
        "pad_token_id": tokenizer.pad_id,
        "eos_token_id": tokenizer.eos_id,
        "torch_dtype": dtype_name,  # transformers < 5 reads this name,
        "dtype": dtype_name,  # transformers >= 5 this one
    }
    return config | ({"bos_token_id": tokenizer.bos_id} if tokenizer.bos_id is not None else {})


def export(
    run: Path,
    out: Path,
    dtype: str | None = None,
    model: str | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = 5 * GB,
    command: str | None = None,
    log=print,
) -> Path:
    """Write the export of the finished run `run` into `out` (built beside it, then swapped in)."""
    check_output(out, overwrite)
    record = read_run(run)
    if record.pooling != "last":  # LlamaForSequenceClassification reads the last token, and no config says otherwise
        raise ExportError(
            f"{run} pools the mean of each text's tokens (--pooling {record.pooling}), which transformers' "
            "LlamaForSequenceClassification cannot: it reads the last token only. Classify with `llama-scratch "
            "classify`, or train with --pooling last to export"
        )
    metrics = read_metrics(run)  # for the model card; a run without one still exports
    cfg = record.model_config()
    torch_dtype = parse_dtype(dtype or record.dtype)
    if torch_dtype not in (torch.float32, torch.bfloat16):  # only a run trained in float16 gets here
        raise ExportError(f"the run trained in {record.dtype}; pass --dtype bfloat16 or --dtype float32")
    base = None if record.weights_include_backbone else local_checkpoint(record.find_base(model), log)
    if base is not None and not Path(base).is_dir():
        raise ExportError(f"the base model {base} is not a checkpoint directory; pass --model PATH")
    planned = plan_export(cfg, record.num_classes, run / WEIGHTS_FILE, base and Path(base), record.lora)
    vocab = tokenizer_file(record.tokenizer, base)
    tokenizer = Tokenizer.for_checkpoint(vocab)
    texts = tokenizer_files(vocab, tokenizer, cfg.max_seq_len)
    config = hf_config(cfg, record.label_names, tokenizer, torch_dtype, record.multi_label)
    texts["config.json"] = json.dumps(config, indent=2) + "\n"
    texts["README.md"] = model_card(record, metrics, torch_dtype, command or f"export of {run}")

    def build(tmp: Path) -> None:
        written = write_weights(tmp, planned, torch_dtype, record.lora, max_shard_bytes, log)
        for name, text in texts.items():
            write_text_atomic(tmp / name, text)
        marker = {
            "tool": "llama_scratch.export_hf",
            "run": str(run.resolve()),
            "run_id": record.run_id,
            "files": sorted([*written, *texts]),
        }
        write_text_atomic(tmp / MARKER, json.dumps(marker, indent=2) + "\n")

    replace_directory(Path(os.path.abspath(out)), build, is_export)  # abspath: `.` gets a name to build beside
    log(
        f"exported {run} to {out}/ ({len(planned)} tensors, {torch_dtype}); load it with "
        f"AutoModelForSequenceClassification.from_pretrained({str(out)!r})"
    )
    return out


def positive_float(text: str) -> float:
    """An argparse type for --max-shard-gb."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


@dataclass
class ExportOptions:
    """Which run, where to, in which dtype and shard size."""

    checkpoint: Path | None = option(None, "output directory of finetune_classifier", required=True)
    output: Path | None = option(
        None, "the directory to write (new, empty, or an earlier export with --overwrite)", required=True
    )
    dtype: str | None = option(
        None, "the weights' dtype (default: the dtype the run trained in)", choices=("bfloat16", "float32")
    )
    model: str | None = option(None, "the base checkpoint directory, when it moved since training")
    max_shard_gb: float = option(5.0, "largest weight file, in GB (default: 5)", parse=positive_float)
    overwrite: bool = option(False, "replace an earlier export in --output")


@dataclass
class ExportSettings:
    """The export command's settings (one group)."""

    export: ExportOptions = group(ExportOptions)


def parse_args(argv: list[str] | None = None) -> ExportOptions:
    """The command line as ExportOptions."""
    prog, description = "python -m llama_scratch.export_hf", __doc__.splitlines()[0]
    return parse_settings(ExportSettings, argv, prog=prog, description=description).export


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", "-m", "llama_scratch.export_hf", *(sys.argv[1:] if argv is None else argv)])
    try:
        export(
            args.checkpoint, args.output, args.dtype, args.model, args.overwrite, int(args.max_shard_gb * GB), command
        )
    # ExportError and CheckpointError are ValueErrors: bad input, told in one line.
    except (ValueError, DownloadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # ours name their file (a missing run or base); the system's (a full disk) get one here
        print(f"error: {e if e.strerror is None else f'{e.filename or args.output}: {e.strerror}'}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

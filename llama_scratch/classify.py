"""Label texts with a fine-tuned classifier: `python -m llama_scratch.classify --checkpoint runs/X "some text"`.

The base model is streamed onto the device first (the same low-memory path as training), then the trained
parameters from `classifier.safetensors` are put in place. Texts come from the command line, a file with one
per line, or a CSV/TSV/JSONL table; with `--labels`, the table's label column is compared with the predictions
(accuracy, per-class precision/recall/F1, confusion matrix); `--output` writes every class's probability beside
the input's own columns (`data/scored.py`).

A `--multi-label` run gives each label its own probability (a sigmoid, not a softmax over the classes) and
predicts every label at or above the run's threshold (classifier.json's, or `--threshold`): none, one or several.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoints.atomic import write_text_atomic
from .checkpoints.run_record import WEIGHTS_FILE, read_run
from .checkpoints.weights import CheckpointError, copy_named_file
from .cli import group, option, parse_settings, positive_int
from .data.batching import TokenizedSplit, forward, length_sorted_batches, to_batch
from .data.inputs import read_inputs
from .data.labelled import SEPARATOR, DataError
from .data.scored import output_fields, scored_text
from .model.classifier import LlamaClassifier, full_precision_blocks
from .model.config import parse_dtype
from .model.counts import count_parameters
from .model.llama import Llama
from .model.tokenizer import Tokenizer
from .sources.devices import choose_dtype, resolve_device
from .sources.fetch import DownloadError
from .sources.resolve import load_model
from .training.evaluation import check_threshold_value, label_set_figures, per_class

SHOWN_SKIPS = 5  # skipped inputs named in the note; the rest are counted
ECHO_CHARS = 72  # of each text, after its label: enough to tell texts apart, one line; --output holds the whole


def load_classifier(
    run_dir: str | Path,
    device: str | torch.device = "auto",
    dtype: str = "auto",
    model: str | Path | None = None,
    quantize: str | None = None,
) -> tuple[LlamaClassifier, Tokenizer, dict]:
    """A fine-tuned classifier from a `finetune_classifier` output directory, its tokenizer and its settings (the
    run record, classifier.json, as a dict). `model` points at the base checkpoint when it is no longer where the
    run recorded it. The frozen base is quantized as the run's was (classifier.json's "quantize": the same
    weights, so the same predictions), or as `quantize` ("nf4", "int8") asks instead."""
    run_dir, device = Path(run_dir), resolve_device(str(device))
    record = read_run(run_dir)
    weights_path = run_dir / WEIGHTS_FILE
    cfg = record.model_config()
    trained_in = parse_dtype(record.dtype)  # a float32 copy that would not fit keeps the training dtype
    torch_dtype = choose_dtype(dtype, device, trained_in, count_parameters(cfg).backbone)
    if dtype == "auto" and torch_dtype != torch.float32:  # the device computes low precision well: use what
        torch_dtype = trained_in  # training used, so predictions match the evaluation it reported
    base = None
    if record.weights_include_backbone:  # trained from scratch: the file holds every weight
        if quantize:  # every weight trained: nothing frozen to hold in fewer bits (the run refused it too)
            raise ValueError(f"--quantize holds a frozen base; {run_dir} was trained from random weights and has none")
        cfg.dtype = torch_dtype
        with torch.device("meta"):
            backbone = Llama(cfg)
        backbone.to_empty(device=device)  # every weight is then filled from the file
        if cfg.tie_embeddings:  # to_empty gives each name its own tensor: tie them again
            backbone.lm_head.weight = backbone.embed_tokens.weight
    else:
        base = record.find_base(model)
        quantize = quantize or record.quantize
        lora = record.lora.settings if record.lora else None
        keep = full_precision_blocks(cfg.n_layers, record.train_last, lora) if quantize else 0
        backbone = load_model(base, device=device, dtype=torch_dtype, quantize=quantize, keep_last=keep)
    lora = record.lora.settings if record.lora else None
    clf = LlamaClassifier(backbone, record.num_classes, record.train_last, lora, record.multi_label, record.pooling)
    clf.eval()
    if record.lora and list(record.lora.blocks) != clf.lora_blocks:
        raise CheckpointError(
            f"{record.path}: LoRA blocks {list(record.lora.blocks)} are not the "
            f"last train_last={record.train_last} blocks {clf.lora_blocks}"
        )
    # Every parameter of a from-scratch model, else every one the run trained: none may keep a fresh initialisation.
    # Read one tensor at a time into the parameters: a from-scratch run's file is the whole model.
    needed = clf.named_parameters() if record.weights_include_backbone else clf.trainable_parameters().items()
    copy_named_file(clf, weights_path, required=[name for name, _ in needed])
    if record.tokenizer == "llama3":
        tokenizer = Tokenizer.default()
    else:  # the base checkpoint's own: where it is now, if it moved
        tokenizer = Tokenizer.for_checkpoint(base if base and Path(base).is_dir() else record.tokenizer)
    return clf, tokenizer, record.to_json()


@torch.inference_mode()
def predict_proba(
    clf: LlamaClassifier,
    tokenizer: Tokenizer,
    texts: list[str],
    max_length: int | None = None,
    batch_size: int = 16,
    layout: str = "packed",
    multi_label: bool | None = None,
) -> torch.Tensor:
    """Every class's probability per text, [texts, classes] in float32 on the CPU, in input order. Texts are cut
    to `max_length` tokens only if asked (by default, to the model's context: the training run's length limit is
    no limit here). Batched by length; `layout` "packed" (no padding at all, packing.py) or "right"/"left".
    `multi_label` (a --multi-label run, classifier.json's "multi_label"; None: the classifier's own, as
    `load_classifier` set it): each label's own probability, the sigmoid of its logit, instead of a softmax over
    the classes."""
    multi_label = clf.multi_label if multi_label is None else multi_label
    device = clf.head.weight.device
    ids = [tokenizer.encode(t, bos=True)[: max_length or clf.backbone.cfg.max_seq_len] for t in texts]
    split = TokenizedSplit(ids, [0] * len(ids), pad_id=tokenizer.pad_id)
    out = torch.zeros(len(ids), clf.head.out_features)
    for rows in length_sorted_batches([len(x) for x in ids], batch_size):
        logits = forward(clf, to_batch(split, rows, layout, device))
        out[rows] = (logits.float().sigmoid() if multi_label else logits.float().softmax(-1)).cpu()
    return out


def predict(
    clf: LlamaClassifier, tokenizer: Tokenizer, texts: list[str], max_length: int | None = None, batch_size: int = 16
) -> list[tuple[int, float]]:
    """(class id, probability) per text, in input order: the most probable class of `predict_proba`. A
    --multi-label classifier has no one class a text: `above(predict_proba(...), threshold)` gives its labels."""
    if clf.multi_label:
        raise ValueError(
            "predict gives one class a text; this classifier is --multi-label: use "
            "above(predict_proba(clf, tokenizer, texts), threshold) with the run's threshold"
        )
    return best(predict_proba(clf, tokenizer, texts, max_length, batch_size))


def above(probs: torch.Tensor, threshold: float) -> list[list[int]]:
    """Each row's labels (class ids, in order) whose probability is at or above `threshold`: a --multi-label
    run's prediction, none, one or several."""
    return [[k for k, p in enumerate(row) if p >= threshold] for row in probs.tolist()]


def best(probs: torch.Tensor) -> list[tuple[int, float]]:
    """(class id, probability) of each row's most probable class; on a tie, the lower class id."""
    top = probs.max(-1)
    return list(zip(top.indices.tolist(), top.values.tolist(), strict=True))


# ---------------------------------------------------------------------------------------------- outputs


def echo(text: str, width: int = ECHO_CHARS) -> str:
    """A text as printed after its label: on one line (newlines, tabs and runs of spaces shown as one space, so the
    line stays three tab-separated fields), cut to `width` characters with an ellipsis. A 23 KB text printed whole
    would bury every other line."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1].rstrip() + "…"


def label_set_report(truth: list[str], predicted: list[list[int]], label_names: list[str]) -> str:
    """A --multi-label file's figures (`evaluation.label_set_figures`, as training reports them): the exact-match
    accuracy, micro- and macro-F1 and each label's precision/recall/F1/support, as text. `truth`: each text's
    labels SEPARATOR-joined (`inputs.known_set`)."""
    index = {name: k for k, name in enumerate(label_names)}
    targets = [[0] * len(label_names) for _ in truth]
    for row, labels in zip(targets, truth, strict=True):
        for name in filter(None, labels.split(SEPARATOR)):
            row[index[name]] = 1
    chosen = [[int(k in ks) for k in range(len(label_names))] for ks in predicted]
    figures = label_set_figures(chosen, targets, 0.5, label_names)  # 0/1 "probabilities": the labels chosen
    exact = round(figures["accuracy"] * len(truth))
    w = max(5, *map(len, label_names))
    lines = [
        f"exact match {figures['accuracy']:.2%} ({exact:,} of {len(truth):,}); micro-F1 {figures['micro_f1']:.3f}, "
        f"macro-F1 {figures['macro_f1']:.3f}",
        f"{'label':<{w}}  precision  recall     F1  support",
    ]
    for name, m in figures["per_label"].items():
        lines.append(f"{name:<{w}}  {m['precision']:9.3f}  {m['recall']:6.3f}  {m['f1']:5.3f}  {m['support']:7,}")
    return "\n".join(lines)


def evaluation_report(truth: list[str], predicted: list[str], label_names: list[str]) -> str:
    """Accuracy, per-class precision/recall/F1/support (train.per_class) and the confusion matrix, as text."""
    index = {name: k for k, name in enumerate(label_names)}
    confusion = [[0] * len(label_names) for _ in label_names]  # [true, predicted]
    for t, p in zip(truth, predicted, strict=True):
        confusion[index[t]][index[p]] += 1
    correct = sum(confusion[k][k] for k in range(len(label_names)))
    w = max(5, *map(len, label_names))
    lines = [
        f"accuracy {correct / len(truth):.2%} ({correct:,} of {len(truth):,})",
        f"{'class':<{w}}  precision  recall     F1  support",
    ]
    for name, m in per_class(confusion, label_names).items():
        lines.append(f"{name:<{w}}  {m['precision']:9.3f}  {m['recall']:6.3f}  {m['f1']:5.3f}  {m['support']:7,}")
    cw = max(len(f"{len(truth):,}"), *map(len, label_names))
    lines.append("confusion matrix (rows: true class, columns: predicted):")
    lines.append(" " * w + "".join(f"  {name:>{cw}}" for name in label_names))
    lines += [
        f"{name:<{w}}" + "".join(f"  {c:>{cw},}" for c in row) for name, row in zip(label_names, confusion, strict=True)
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- command line


@dataclass
class ClassifyOptions:
    """Which run, which texts (given or in a file, with their labels to score against), and how to compute."""

    checkpoint: Path | None = option(None, "output directory of finetune_classifier", required=True)
    texts: list[str] | None = option(None, "texts to classify", positional=True, nargs="*")
    file: str | None = option(
        None,
        "texts to classify: a .csv, .tsv or .jsonl table (its text column found by name, as in training), or one text "
        "per line (.txt and any other file; '-': standard input)",
    )
    text_column: str | None = option(
        None,
        "the table's text column or JSONL key, when its name is not a usual one (text, sentence, message, ...); a "
        "0-based number for a file without a header",
        metavar="NAME",
    )
    labels: bool = option(
        False,
        "the file also has a label column: print accuracy, per-class precision/recall/F1 and the confusion matrix (a "
        "--multi-label run's: ;-separated labels, and exact match, micro/macro-F1 and each label's figures) (a .txt "
        "file is then read as a tab- or comma-separated table, as in training)",
    )
    label_column: str | None = option(None, "the file's label column or key (implies --labels)", metavar="NAME")
    header: bool | None = option(
        None,
        "the table's first row is data, not column names (default: told from its contents, as in training)",
        flag="--no-header",
        negate=True,
    )
    output: Path | None = option(
        None,
        "write the scores instead of printing a line per text (label, probability, the text's first "
        f"{ECHO_CHARS} characters): a table's or JSONL file's own columns, then predicted, probability and p_<class> "
        "for each class (text, the scores and label with --labels for texts without columns; a --multi-label run's "
        "predicted is its labels ;-joined, and it has no probability); JSON Lines for .jsonl, TSV for .tsv, else CSV",
        metavar="FILE",
    )
    overwrite: bool = option(False, "replace an existing --output file")
    threshold: float | None = option(
        None,
        "a --multi-label run: predict each label whose probability is at least T, 0 < T < 1 (default: the run's, "
        "chosen on its validation split or given by its --threshold; classifier.json)",
        metavar="T",
    )
    device: str = option("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = option("auto", "auto (the training dtype on a GPU with bfloat16, else float32) | bfloat16 | float32")
    batch_size: int = option(16, "texts per forward (default: 16)", parse=positive_int)
    max_length: int | None = option(
        None,
        "cut texts to this many tokens (default: the model's context, whatever the training run used)",
        parse=positive_int,
    )
    model: str | None = option(None, "the base checkpoint directory, when it moved since training")
    quantize: str | None = option(
        None,
        "hold the frozen base weights in 4-bit NF4 or int8 (default: as the run trained, classifier.json)",
        choices=("nf4", "int8"),
    )


@dataclass
class ClassifySettings:
    """The classify command's settings (one group)."""

    classify: ClassifyOptions = group(ClassifyOptions)


def misused(settings: ClassifySettings) -> str | None:
    """What the flags cannot mean together, as a usage error (None: nothing)."""
    o = settings.classify
    if not o.texts and not o.file:
        return "give texts to classify, or --file"
    if (o.labels or o.label_column is not None or o.text_column is not None or o.header is not None) and not o.file:
        return "--labels, --label-column, --text-column and --no-header read a --file"
    if (o.labels or o.label_column is not None) and o.texts:
        return "--labels: texts given on the command line have no label; put them in the --file"
    return None


def parse_args(argv: list[str] | None = None) -> ClassifyOptions:
    """The command line as ClassifyOptions (`--label-column` implies `--labels`)."""
    prog, description = "python -m llama_scratch.classify", __doc__.splitlines()[0]
    o = parse_settings(ClassifySettings, argv, misused, prog=prog, description=description).classify
    o.labels = o.labels or o.label_column is not None
    return o


def run(args: ClassifyOptions) -> None:
    """Check everything cheap first (output, device, run, input file), then load the model and classify."""
    reading = Path(args.file) if args.file and args.file != "-" else None
    if args.output and reading and reading.exists() and args.output.exists() and args.output.samefile(reading):
        raise DataError(f"--output {args.output} is the --file being classified; write the scores to another file")
    if args.output and args.output.exists() and (args.output.is_dir() or not args.overwrite):
        why = "is a directory" if args.output.is_dir() else "exists; pass --overwrite to replace it"
        raise DataError(f"--output {args.output} {why}")
    device = resolve_device(args.device)
    record = read_run(args.checkpoint)
    names, multi, threshold = record.label_names, record.multi_label, run_threshold(args.threshold, record)
    inputs = read_inputs(
        args.texts, args.file, args.text_column, args.label_column, args.labels, names, args.header, multi
    )
    if inputs.read_as:  # e.g. a TSV's csv-quoted fields were unquoted, as training reads them
        print(f"note: {args.file}: {inputs.read_as}", file=sys.stderr)
    if inputs.columns:  # found from the cells, not by name: never a silent guess (training logs the same words)
        print(f"note: {args.file}: {inputs.columns}", file=sys.stderr)
    if inputs.skipped:
        more = f" (and {len(inputs.skipped) - SHOWN_SKIPS:,} more)" if len(inputs.skipped) > SHOWN_SKIPS else ""
        shown = "; ".join(inputs.skipped[:SHOWN_SKIPS])
        print(f"note: left out {len(inputs.skipped):,} input(s): {shown}{more}", file=sys.stderr)
    if not inputs.texts:
        raise DataError(f"{args.file or 'the arguments'}: no text to classify")
    if args.output:
        output_fields(inputs, names, multi)  # a clash of column names is refused before the model loads
    clf, tokenizer, _ = load_classifier(args.checkpoint, device, args.dtype, args.model, args.quantize)
    max_length = args.max_length or clf.backbone.cfg.max_seq_len
    if cut := sum(len(tokenizer.encode(t, bos=True)) > max_length for t in inputs.texts):
        why = "--max-length" if args.max_length else "the model's context"
        print(f"note: {cut} text(s) longer than {max_length} tokens ({why}) were cut to that", file=sys.stderr)
    probs = predict_proba(clf, tokenizer, inputs.texts, max_length, args.batch_size, multi_label=multi)
    picks = above(probs, threshold) if multi else [k for k, _ in best(probs)]
    if args.output:
        try:
            write_text_atomic(args.output, scored_text(args.output, inputs, probs.tolist(), picks, names))
        except OSError as e:
            raise DataError(f"cannot write --output {args.output}: {e.strerror or e}") from None
        print(f"wrote {len(inputs.texts):,} rows to {args.output}", file=sys.stderr)
    else:
        for text, row, pick in zip(inputs.texts, probs.tolist(), picks, strict=True):
            print(f"{shown_labels(pick, row, names)}\t{echo(text)}")
    if inputs.labels is not None and multi:
        print(label_set_report(inputs.labels, picks, names))
    elif inputs.labels is not None:
        print(evaluation_report(inputs.labels, [names[k] for k in picks], names))


def run_threshold(given: float | None, record) -> float | None:
    """The threshold a --multi-label run's labels are decided by: `--threshold`, else the run's own (None for a
    run of one label per text, which takes the most probable class: --threshold is refused there)."""
    if given is None:
        return record.threshold
    if not record.multi_label:
        raise DataError(
            f"--threshold decides the labels of a --multi-label run; {record.path.parent} has one label per text"
        )
    return check_threshold_value(given)


def shown_labels(pick: int | list[int], probs: list[float], names: list[str]) -> str:
    """A text's prediction as printed before it: the label and its probability, tab-separated; for a
    --multi-label run its labels and their probabilities, each SEPARATOR-joined, or `(none)` and `-`."""
    if isinstance(pick, int):
        return f"{names[pick]}\t{probs[pick]:.3f}"
    if not pick:
        return "(none)\t-"
    return f"{SEPARATOR.join(names[k] for k in pick)}\t{SEPARATOR.join(f'{probs[k]:.3f}' for k in pick)}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    # DataError, DeviceError and CheckpointError are ValueErrors: bad input, told in one line.
    except (FileNotFoundError, ValueError, DownloadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

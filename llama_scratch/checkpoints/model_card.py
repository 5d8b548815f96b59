"""README.md of an export, the model card: what the model is, what it learned from, how well it did, how it was
made and how to load it. Everything comes from the run's record (classifier.json) and metrics.json, both read in
their current shape (`run_record.read_run`, `run_dir.read_metrics`: older versions are upgraded there, so nothing
here asks which version wrote them); nothing is guessed."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .run_record import RunRecord


def model_card(record: RunRecord, metrics: dict | None, dtype: torch.dtype, command: str) -> str:
    """The whole card: Hugging Face front matter, then the sections. `metrics` None: the run has no metrics.json."""
    parts = [
        front_matter(record),
        f"# {title(record, metrics)}\n\n{summary(record, metrics)}",
        usage(record),
        labels(record),
        results(metrics),
        training(record, metrics, dtype),
        f"## How it was made\n\nTrained by `python -m llama_scratch.finetune_classifier` (run id "
        f"`{record.run_id or 'not recorded'}`), exported with:\n\n```bash\n{command}\n```",
    ]
    return "\n\n".join(p for p in parts if p) + "\n"


def front_matter(record: RunRecord) -> str:
    """The metadata block the Hub reads; JSON strings are valid YAML, so names need no escaping rules of their own."""
    lines = ["---", "library_name: transformers", "pipeline_tag: text-classification", "tags:", "- llama_scratch"]
    if repo := record.base_model_repo:
        lines.append(f"base_model: {json.dumps(repo)}")
    return "\n".join([*lines, "---"])


def base_name(record: RunRecord) -> str:
    if record.weights_include_backbone:
        return f"the `{record.base_model}` preset, trained from random weights (no pretrained base)"
    return f"`{record.base_model_repo or record.base_model}`"


def data_name(metrics: dict | None) -> str | None:
    """The data file's name, not its path: a card is published, the folders it sat in are nobody's business."""
    return Path(metrics["data"]).name if metrics and metrics["data"] else None


def title(record: RunRecord, metrics: dict | None) -> str:
    data = data_name(metrics)
    kind, classes = ("Multi-label text classifier", "labels") if record.multi_label else ("Text classifier", "classes")
    return f"{kind} ({len(record.label_names)} {classes}{f', {data}' if data else ''})"


def summary(record: RunRecord, metrics: dict | None) -> str:
    lines = [f"A `LlamaForSequenceClassification` fine-tuned from {base_name(record)} with llama_scratch."]
    if data := data_name(metrics):
        files = {k: Path(v["file"]).name for k, v in metrics["split_files"].items()}
        sizes = ", ".join(
            f"{k} {v:,}" + (f" from `{files[k]}`" if files[k] != data else "")
            for k, v in metrics["split_sizes"].items()
        )
        split = metrics["split"]
        cut = "validation and test files of its own" if split is None else f"split `{split}`"
        lines.append(f"Data: `{data}`, {cut} ({sizes} texts).")
    if record.multi_label:
        origin = metrics["threshold_chosen_on"] if metrics else "validation"  # a run without figures: its default
        origin = "given by --threshold" if origin == "--threshold" else f"chosen on {origin}"
        lines.append(
            f"Multi-label: each label has its own probability (a sigmoid of its logit; `problem_type` "
            f"`multi_label_classification`), and a text has every label whose probability is at least "
            f"{record.threshold:g} ({origin})."
        )
        if metrics:
            lines.append(
                f"Test micro-F1 {metrics['test_micro_f1']:.4f}, macro-F1 {metrics['test_macro_f1']:.4f}, exact "
                f"match {metrics['test_accuracy']:.2%}."
            )
    elif metrics:
        lines.append(f"Test accuracy: {metrics['test_accuracy']:.2%}.")
    return " ".join(lines)


def usage(record: RunRecord) -> str:
    text = _USAGE
    if record.multi_label:
        text += (
            "\n\nEvery label has its own probability: ask the pipeline for all of them (`top_k=None`; it applies the "
            f"sigmoid that `problem_type` names) and keep those at or above {record.threshold:g}, the run's threshold."
        )
    return text


_USAGE = """## Use

```python
from transformers import pipeline
classify = pipeline("text-classification", model="THIS_DIRECTORY")
classify(["first text", "second text"])
```

or `AutoModelForSequenceClassification.from_pretrained("THIS_DIRECTORY")` with
`AutoTokenizer.from_pretrained("THIS_DIRECTORY")`. The model reads each text's last real token, found as the last
token that is not the padding token (`pad_token_id` in config.json); the tokenizer pads on the right, as training
did, and encodes the spelling of a special token inside a text as plain text (`split_special_tokens`), as
training did, so that no text can contain the padding token."""


def labels(record: RunRecord) -> str:
    rows = "\n".join(f"| {i} | {name} |" for i, name in enumerate(record.label_names))
    return f"## Labels\n\n| id | label |\n| --- | --- |\n{rows}"


def results(metrics: dict | None) -> str:
    """Accuracy and loss per split, and the test split per class, from metrics.json (a --multi-label run's:
    exact-match accuracy, micro-F1 and loss at its threshold, and the test split per label)."""
    if not metrics:
        return "## Results\n\nThe run has no metrics.json."
    multi = metrics["multi_label"]
    rows = [
        f"| {k} | {metrics[f'{k}_accuracy']:.2%} | "
        + (f"{metrics[f'{k}_micro_f1']:.4f} | " if multi else "")
        + f"{metrics[f'{k}_loss']:.4f} |"
        for k in ("train", "val", "test")
    ]
    head = (
        "| split | exact match | micro-F1 | loss |\n| --- | --- | --- | --- |"
        if multi
        else ("| split | accuracy | loss |\n| --- | --- | --- |")
    )
    text = f"## Results\n\n{head}\n" + "\n".join(rows)
    if per_class := metrics["test_per_class"]:
        text += (
            f"\n\nTest split per {'label' if multi else 'class'}:\n\n| label | precision | recall | F1 | support |\n"
        )
        text += "| --- | --- | --- | --- | --- |\n"
        text += "\n".join(
            f"| {name} | {m['precision']:.3f} | {m['recall']:.3f} | {m['f1']:.3f} | {m['support']:,} |"
            for name, m in per_class.items()
        )
    return text


def training(record: RunRecord, metrics: dict | None, dtype: torch.dtype) -> str:
    """What trained and how: blocks, adapters, lengths, dtypes and the training settings."""
    last = record.train_last
    trained = "every weight" if last is None else f"the head, the final norm and the last {last} blocks"
    lines = [f"- base model: {base_name(record)}", f"- trained: {trained}"]
    if lora := record.lora:
        s = lora.settings
        lines.append(
            f"- LoRA: rank {s.rank}, alpha {s.alpha}, targets {', '.join(s.targets)}, "
            f"blocks {', '.join(map(str, lora.blocks))} (merged into the weights here)"
        )
    lines.append(
        f"- texts cut to {record.max_length} tokens in training; trained in {record.dtype}, exported in "
        f"{str(dtype).removeprefix('torch.')}"
    )
    if metrics:
        steps = metrics["steps"]
        lines.append(f"- {steps:,} optimizer step{'s' if steps != 1 else ''}, best epoch {metrics['best_epoch']}")
    settings = record.settings or {}
    shown = {
        k: v
        for k, v in settings.items()
        if k in ("epochs", "batch_size", "grad_accum", "lr", "weight_decay", "warmup", "schedule", "seed", "max_steps")
    }
    if shown:
        lines.append("- settings: " + ", ".join(f"{k} {v}" for k, v in shown.items()))
    return "## Training\n\n" + "\n".join(lines)

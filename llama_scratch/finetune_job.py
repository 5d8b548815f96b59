"""What one fine-tuning run is, and what it writes down about itself to be resumed and read back.

The phases of `finetune_classifier.run` share a `Job` (its settings, data, chosen model, output folder). A resume
point must belong to the same run: `run_identity` is what it records besides the recipe, and `check_resume_point`
refuses another run's point before any weight loads. `classifier_meta` is the run record (classifier.json) that
`classify` and `export` rebuild the classifier from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoints.run_record import RunRecord, new_record
from .data.labelled import LabelledTexts
from .finetune_data import held_out_identity, split_files
from .finetune_settings import FinetuneSettings
from .model.classifier import LlamaClassifier
from .model.lora import LoRASettings
from .parallel.strategy import Strategy
from .training import resume_points
from .training.loop import TrainSettings, check_same_run


@dataclass
class ModelChoice:
    """Which model a run trains, decided before anything is loaded."""

    ref: str  # a preset or a local checkpoint directory
    repo_id: str | None  # the Hub repository it was fetched from, if any
    dtype: torch.dtype
    from_scratch: bool  # a preset: random weights
    train_last: int | None  # blocks trained (None: all)
    lora: LoRASettings | None  # LoRA adapters in those blocks instead of their weights
    quantize: str | None = None  # "nf4" or "int8": the frozen base weights held quantized (None: off)


@dataclass
class Job:
    """What the phases of one run share once data, model and output are chosen."""

    settings: FinetuneSettings
    strategy: Strategy  # how the processes share the run: asked, never worked out again
    started: float
    data: LabelledTexts
    parts: dict[str, LabelledTexts]
    protocol: str | None  # None: --val-data and --test-data given, nothing cut from --data
    choice: ModelChoice
    out: Path
    board: Callable[[dict], None] | None = None  # --tensorboard: writes each history row (training.board)


def check_resume_point(job: Job, settings: TrainSettings, log) -> None:
    """--resume: refuse a resume point of another run now, with everything known before the weights load (the
    loop checks again when it reads the point, with the max length as well). Every process gets the point's JSON
    (resume_points.read: rank 0's, or each its part's, agreed on), so all refuse alike, on machines that do not
    share rank 0's disk too. A point of the other kind (sharded or not) is refused by name here too.

    Without --lr the run continues at the rate it started with, which an older version may have chosen by
    another default: the default is a choice made for the user, not a setting they gave, so it is not a reason
    to refuse their run."""
    strategy, out = job.strategy, job.out
    found = resume_points.read(strategy, out, tensors=False)
    if found is None:
        return
    # A malformed point is left to check_same_run, which refuses it in one line naming the file.
    saved = found[1].get("settings") if isinstance(found[1], dict) else None
    started_at = saved.get("lr") if isinstance(saved, dict) else None
    if job.settings.recipe.lr is None and isinstance(started_at, float) and started_at != settings.lr:
        log(
            f"resuming at the rate the run started with, {started_at:g} (the default for these settings is now "
            f"{settings.lr:g})"
        )
        settings.lr = started_at
    max_length = job.settings.data.max_length
    identity = {"world_size": strategy.processes.world_size, **run_identity(job, max_length)}
    if max_length is None:  # known once the texts are tokenized
        identity.pop("max_length")
    # A token budget's epochs (raised to reach --min-steps) are known once the texts are tokenized, too.
    given = job.settings.recipe
    unknown = ("epochs",) if given.batch_tokens is not None and given.epochs is None else ()
    check_same_run(found[0], found[1], settings, identity, partial=True, unknown=unknown)


def classifier_meta(
    job: Job, clf: LlamaClassifier, tokenizer_ref: str, max_length: int, settings: TrainSettings, threshold=None
) -> RunRecord:
    """The run record (classifier.json): what `classify` needs to rebuild the classifier, and how it was trained
    (under --multi-label, with the threshold that decides each label)."""
    choice = job.choice
    return new_record(
        model_ref=choice.ref,
        repo_id=choice.repo_id,
        out=job.out,
        from_scratch=choice.from_scratch,
        config=clf.backbone.cfg,
        label_names=job.data.label_names,
        train_last=choice.train_last,
        lora=choice.lora,
        lora_blocks=clf.lora_blocks,
        quantize=choice.quantize,
        data=split_files(job.settings.data, job.data, job.parts),
        tokenizer=tokenizer_ref,
        max_length=max_length,
        dtype=choice.dtype,
        settings=settings,
        multi_label=job.data.multi_label,
        threshold=threshold,
        pooling=clf.pooling,
    )


def run_identity(job: Job, max_length: int) -> dict:
    """What a resume point must share with the run that resumes it, besides the recipe (TrainSettings)."""
    asked, data, choice, lora = job.settings.data, job.data, job.choice, job.choice.lora
    return {
        "model": choice.ref,
        "data": asked.source,
        "data_digest": data.fingerprint(),
        "text_column": asked.text_column,
        "label_column": asked.label_column,
        "header": asked.header,
        "label_names": data.label_names,
        "num_classes": data.num_classes,
        "multi_label": data.multi_label,
        "split": job.protocol,
        **held_out_identity(asked, job.parts),  # None where cut from --data
        "max_length": max_length,
        "dtype": str(choice.dtype),
        "train_last": "all" if choice.train_last is None else choice.train_last,
        "lora": lora.rank if lora else None,
        "lora_alpha": lora.alpha if lora else None,
        "lora_dropout": lora.dropout if lora else None,
        "lora_targets": ",".join(lora.targets) if lora else None,
        "quantize": choice.quantize,
        "pooling": job.settings.recipe.pooling,
    }

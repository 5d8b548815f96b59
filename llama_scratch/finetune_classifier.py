"""Fine-tune a Llama checkpoint as a text classifier: `python -m llama_scratch.finetune_classifier --help`.

Same command on one CPU, one GPU, or several GPUs under `torchrun --nproc_per_node N` (DDP, or FSDP2 with
--shard). How the processes share the run is decided once (`choose_strategy`) and asked of that strategy.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from .checkpoints.run_record import WEIGHTS_FILE
from .cli import plain_warnings
from .data.batching import TokenizedSplit
from .data.labelled import DataWarning
from .finetune_data import read_data, split_files, tokenize
from .finetune_job import Job, ModelChoice, check_resume_point, classifier_meta, run_identity
from .finetune_settings import (
    FinetuneSettings,
    lora_settings,
    parse_args,
    quantize_setting,
    recorded_flags,
    refuse_float16,
    resumed_flags,
)
from .model.classifier import LlamaClassifier
from .model.config import LlamaConfig
from .model.counts import count_parameters, held_parameters
from .model.tokenizer import Tokenizer
from .parallel.strategy import Processes, Strategy, choose_strategy, teardown
from .planning.memory import PlanInputs, planned_batch
from .planning.report import detect_gpu, plan_command, plans_from_scratch, refuse_unfit_replica
from .sources.devices import choose_dtype, make_deterministic
from .sources.fetch import DownloadError
from .sources.resolve import (
    chosen_train_last,
    config_of,
    default_model,
    is_repo_id,
    local_checkpoint,
    resolve_tokenizer,
    trains_from_scratch,
)
from .training.baseline import bag_of_words, warn_if_no_better
from .training.board import open_board
from .training.evaluation import (
    evaluate,
    final_figures,
    final_line,
    kept_row,
    warn_if_one_class,
    warn_if_overfit,
)
from .training.interrupts import sigterm_as_ctrl_c
from .training.loop import (
    TrainingDiverged,
    TrainSettings,
    balanced_weights,
    default_lr,
    train,
)
from .training.prefix_cache import cache_splits, use_cache
from .training.run_dir import (
    BEST_FILE,
    check_output,
    default_output,
    interrupted,
    latest_run,
    new_run_id,
    resumable,
    start_output,
    write_results,
)
from .training.search import Searched, choose_recipe, chosen_before, why_not
from .training.steps import raise_epochs


def train_settings(
    settings: FinetuneSettings,
    from_scratch: bool,
    train_labels: list,
    num_classes: int,
    processes: Processes,
    log,
) -> TrainSettings:
    """The loop's recipe from the settings (the fields of the same name), with what depends on the model and the
    data: the peak rate when --lr is not given (`default_lr`: smaller when more than 2 pretrained blocks train
    whole); small data gets more epochs; balanced class weights if asked."""
    recipe = settings.recipe
    train_last = chosen_train_last(recipe.train_last, from_scratch)
    same = {f.name for f in fields(TrainSettings)} & {f.name for f in fields(recipe)} - {
        "epochs",
        "lr",
        "class_weights",
    }
    train = TrainSettings(
        **{name: getattr(recipe, name) for name in same},
        epochs=recipe.epochs or TrainSettings.epochs,
        lr=recipe.lr or default_lr(train_last, from_scratch or bool(settings.lora.rank)),
        class_weights=balanced_weights(train_labels, num_classes) if recipe.class_weights == "balanced" else None,
        save_every=settings.output.save_every,
        optimizer_state=settings.compute.optimizer_state,
    )
    if recipe.batch_tokens is None:  # a token budget's steps depend on the texts' lengths: after tokenizing
        raise_epochs(train, recipe.epochs is not None, len(train_labels), processes, log)
    return train


def choose_model(settings: FinetuneSettings, strategy: Strategy, log) -> ModelChoice:
    """The model reference made local (fetched, converted or found by rank 0, then by each other node's first
    process where that node cannot see rank 0's copy; the other processes take their node's answer),
    the dtype to compute in, and how much of it trains."""
    device, asked = strategy.device, settings.model.dtype
    dtype = refuse_float16(choose_dtype(asked, device), "--dtype float16")  # a first answer, to size by
    ref = settings.model.ref or strategy.on_each_node(lambda: default_model(device, dtype, log))
    repo_id = ref if is_repo_id(ref) else None
    ref = strategy.on_each_node(lambda: local_checkpoint(ref, log))  # several nodes may share no disk

    def checkpoint_dtype() -> torch.dtype:  # a float32 copy that would not fit keeps the checkpoint's own dtype
        if not Path(ref).is_dir():
            return dtype
        cfg = LlamaConfig.from_hf(ref)
        return choose_dtype(asked, device, cfg.dtype, count_parameters(cfg).backbone, log)

    # Free memory differs between processes: rank 0 decides, and sends the dtype's name (on_main sends JSON).
    dtype = getattr(torch, strategy.on_main(lambda: str(checkpoint_dtype()).removeprefix("torch.")))
    refuse_float16(dtype, f"{ref} is stored in float16, and a float32 copy would not fit: it")
    from_scratch = trains_from_scratch(ref)
    train_last = chosen_train_last(settings.recipe.train_last, from_scratch)
    lora = lora_settings(settings, from_scratch)
    quantize = quantize_setting(settings, from_scratch, train_last, lora)
    return ModelChoice(ref, repo_id, dtype, from_scratch, train_last, lora, quantize)


def compile_token_wise(clf: LlamaClassifier) -> None:
    """--compile: torch.compile (dynamic shapes) each block's feed-forward and norms, the work done token by token.
    Attention stays eager: a packed batch's lengths would recompile it for every batch. Off by default: on a 2-core
    CPU it was slower even before the compile time (benchmarks/RESULTS.md)."""
    for block in clf.backbone.blocks:
        for module in (block.ffn, block.attention_norm, block.ffn_norm):
            module.compile(dynamic=True)


def replica_plan_inputs(job: Job) -> PlanInputs:
    """The run as the memory plan sees it, before the texts' length is known (512 tokens, as --plan assumes)."""
    recipe, compute, choice = job.settings.recipe, job.settings.compute, job.choice
    return PlanInputs(
        cfg=config_of(choice.ref),
        **planned_batch(recipe.batch_size, recipe.batch_tokens, job.settings.data.max_length or 512),
        train_last=choice.train_last,
        dtype=choice.dtype,
        optimizer_state=compute.optimizer_state,
        gradient_checkpointing=compute.gradient_checkpointing,
        world_size=job.strategy.processes.world_size,
        grad_accum=recipe.grad_accum,
        device_type=job.strategy.device.type,
        lora=choice.lora,
        quantize=choice.quantize,
        pooling=recipe.pooling,
    )


def build_classifier(job: Job, log) -> tuple[LlamaClassifier, Tokenizer, str]:
    """The classifier with its backbone streamed onto the device (under --shard, each process's rows of it), and
    the tokenizer that belongs to it."""
    choice = job.choice
    n = job.data.num_classes
    clf = job.strategy.build_classifier(choice.ref, choice.dtype, n, choice.train_last, choice.lora, choice.quantize)
    clf.pooling = job.settings.recipe.pooling  # what the head reads: no weights of its own, so set after the build
    backbone = clf.backbone
    backbone.gradient_checkpointing = job.settings.compute.gradient_checkpointing
    tokenizer, tokenizer_ref = resolve_tokenizer(choice.ref, backbone.cfg, log)
    if tokenizer.n_words > backbone.cfg.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.n_words:,} tokens but {choice.ref} embeds only "
            f"{backbone.cfg.vocab_size:,}: they do not belong together (is the checkpoint's tokenizer file missing?)"
        )
    return clf, tokenizer, tokenizer_ref


@dataclass
class Progress:
    """Where a run stands, for the message an interrupt leaves: what it was doing, and its output directory once
    that exists (it then holds the run's flags, and later its resume points)."""

    phase: str = "starting"
    out: Path | None = None


def prepare(settings: FinetuneSettings, progress: Progress) -> tuple[Job, TrainSettings, Callable[..., None]]:
    """The phases before anything large is loaded: processes, settings (a resumed run's own), data, the model's
    choice, the training recipe and the output directory. A resume point of another run is refused here, not
    after minutes of loading and caching."""
    parallel, output = settings.parallel, settings.output
    if parallel.shard_group is not None and not parallel.shard:
        raise ValueError("--shard-group G needs --shard")
    strategy = choose_strategy(settings.model.device, parallel.shard, parallel.shard_group)
    log = strategy.log
    strategy.quiet_elsewhere(DataWarning)
    if output.resume:  # a run to continue, and its own settings for those not typed again, before anything is read
        latest = output.output is None  # runs/latest's
        output.output = output.output or latest_run()
        recorded = strategy.on_main(lambda: resumable(output.output, output.overwrite, latest))
        if recorded is not None:
            settings = resumed_flags(settings, recorded, output.output)
    started = time.perf_counter()
    torch.manual_seed(settings.recipe.seed)
    progress.phase = "reading the data"
    data, parts, protocol = read_data(settings.data, settings.recipe.seed, log)
    progress.phase = "finding the model"
    choice = choose_model(settings, strategy, log)
    several = strategy.processes.several
    if settings.recipe.search and (
        why := why_not(choice.from_scratch, choice.lora, choice.quantize, choice.train_last, several)
    ):
        raise ValueError(f"--search: {why}; drop --search or that setting")
    out = output.output or Path(strategy.on_main(lambda: str(default_output(choice.ref, settings.data.source))))
    log(f"output: {out}/")
    check_output(out, output.resume, output.overwrite)  # before anything is loaded or written
    job = Job(settings, strategy, started, data, parts, protocol, choice, out)
    job.board = open_board(
        output.tensorboard, strategy.is_main
    )  # a missing package: refused before anything is written
    recipe = train_settings(
        settings, choice.from_scratch, parts["train"].targets(), data.num_classes, strategy.processes, log
    )
    if output.resume and settings.recipe.search and (chosen := chosen_before(out)):
        choice.train_last, recipe.lr = chosen.train_last, chosen.lr  # what its resume points were trained with
    if output.resume:
        check_resume_point(job, recipe, log)  # another run's point is refused before minutes of loading and caching
    start_output(out, output.resume, output.output is None, strategy, recorded_flags(settings))
    progress.out = out
    if strategy.refuses_unfit_replica:  # DDP on GPUs: before a replica that cannot fit is loaded
        refuse_unfit_replica(replica_plan_inputs(job), detect_gpu(), choice.ref)
    return job, recipe, log


def run(settings: FinetuneSettings, progress: Progress | None = None) -> dict:
    """The main job in phases: data, model, output, tokens, recipe, training, results."""
    progress = progress or Progress()
    if settings.plan.requested:  # before the process group, the data and the weights: nothing is allocated
        ref = settings.model.ref
        if ref is None:  # the default model may have to be downloaded: a plan names its model instead
            raise ValueError("--plan needs --model: a preset (e.g. llama3-8b), a checkpoint directory or a repo id")
        scratch = plans_from_scratch(ref)
        train_last, lora = chosen_train_last(settings.recipe.train_last, scratch), lora_settings(settings, scratch)
        quantize_setting(settings, scratch, train_last, lora)  # what a run would refuse, the plan refuses alike
        return plan_command(settings, config_of(ref), train_last, lora)
    job, recipe, log = prepare(settings, progress)
    settings, strategy, choice, out, parts = job.settings, job.strategy, job.choice, job.out, job.parts
    progress.phase = "loading the weights"
    clf, tokenizer, tokenizer_ref = build_classifier(job, log)
    splits, max_length = tokenize(parts, tokenizer, clf.backbone.cfg.max_seq_len, settings.data.max_length, log)
    if recipe.batch_tokens is not None:
        lengths = [len(x) for x in splits["train"].ids]
        raise_epochs(recipe, settings.recipe.epochs is not None, len(lengths), strategy.processes, log, lengths)
    n_train = sum(p.numel() for p in clf.trainable_parameters().values())
    held, quantized = held_parameters(clf)
    in_bits = f" ({quantized:,} of them frozen in {choice.quantize})" if quantized else ""
    where = f"{strategy.device} in {choice.dtype}{strategy.describe()}"
    log(f"training {n_train:,} of {held:,} parameters{in_bits} on {where}")
    # Sharded too: every process takes part in each frozen forward and keeps every text's states (prefix_cache).
    progress.phase = "running the frozen layers once per text (the frozen-prefix cache)"
    clf, splits, searched = cache_or_search(job, clf, splits, recipe, progress, log)
    if settings.compute.compile:
        compile_token_wise(clf)
    model = strategy.wrap(clf)  # DDP with several replicas; a sharded model was wrapped when it was built
    save = functools.partial(save_classifier, clf, choice.from_scratch, strategy)
    progress.phase = "training"
    state = train(
        model,
        splits,
        recipe,
        strategy,
        out,
        settings.output.resume,
        lambda epoch: save(out / BEST_FILE),
        log,
        run_identity=run_identity(job, max_length),
        on_row=job.board,
    )
    progress.phase = "evaluating the best weights"
    log(kept_row(state.history, state.best_step, recipe.select_by, multi_label=job.data.multi_label))
    metrics = final_metrics(job, model, clf, splits, recipe, state)
    if searched is not None:
        metrics["search"] = {"chosen": searched.chosen.name, "candidates": searched.rows}
    run_id = strategy.on_main(new_run_id)
    progress.phase = "writing the results"
    save(out / WEIGHTS_FILE, {"run_id": run_id})  # every process: a sharded model is gathered tensor by tensor
    meta = functools.partial(classifier_meta, job, clf, tokenizer_ref, max_length, recipe, metrics.get("threshold"))
    strategy.on_main(lambda: write_results(out, run_id, metrics, meta(), state.history))  # rank 0 writes
    warn_if_one_class(metrics["val_accuracy"], parts["val"].labels, log, metrics.get("val_micro_f1"))
    warn_if_overfit(metrics, log)
    warn_if_no_better(metrics, log, clf.pooling)
    weights = f"epoch {metrics['best_epoch']}'s weights"
    if searched is not None:
        weights += f" of {searched.chosen.name}, chosen by --search"
    log(f"{final_line(metrics)}; {weights}); {metrics['seconds']:.0f} s. Results in {out}/")
    return metrics


def cache_or_search(
    job: Job, clf: LlamaClassifier, splits: dict[str, TokenizedSplit], recipe: TrainSettings, progress: Progress, log
) -> tuple[LlamaClassifier, dict[str, TokenizedSplit], Searched | None]:
    """The frozen-prefix cache if it is on (`use_cache`); with --search, the search first, whose candidates share
    it, and the classifier and cached splits of the recipe it chose."""
    compute = job.settings.compute
    cache = use_cache(compute.cache_frozen, clf, {k: v.ids for k, v in splits.items()}, job.strategy, log)
    if job.settings.recipe.search:
        progress.phase = "trying recipes (--search)"
        return search_recipes(job, clf, splits, recipe, cache, log)
    if cache:
        splits = cache_splits(clf, splits, recipe.eval_rows, job.strategy)
    return clf, splits, None


def search_recipes(
    job: Job, clf: LlamaClassifier, splits: dict[str, TokenizedSplit], recipe: TrainSettings, cache: bool, log
) -> tuple[LlamaClassifier, dict[str, TokenizedSplit], Searched]:
    """--search (training.search.choose_recipe), and the chosen blocks in the model's choice: what classifier.json
    and the resume identity record."""
    asked = job.settings.recipe
    typed_last = None if asked.train_last is None else chosen_train_last(asked.train_last, False)
    where = (job.strategy, job.out, asked.search_minutes, cache, log)
    clf, splits, found = choose_recipe(clf, splits, recipe, typed_last, asked.lr, *where)
    job.choice.train_last = found.chosen.train_last
    return clf, splits, found


def save_classifier(
    clf: LlamaClassifier, from_scratch: bool, strategy: Strategy, path: Path, metadata: dict | None = None
) -> None:
    """Trained parameters only, unless the backbone came from random weights (then nothing else holds it). Called
    by every process: a sharded model is gathered one tensor at a time, and rank 0 writes."""
    state = clf.state_dict() if from_scratch else clf.trainable_parameters()
    strategy.save_trained(state, path, metadata)


def final_metrics(
    job: Job, model, clf: LlamaClassifier, splits: dict[str, TokenizedSplit], settings: TrainSettings, state
) -> dict:
    """Every split evaluated with the best weights (by `--select-by`), and the run's figures (under --multi-label
    at the threshold --threshold gives or the validation split chooses: `final_figures`)."""
    best, strategy = job.out / BEST_FILE, job.strategy
    if strategy.on_main(lambda: not best.exists()):  # no epoch ended here (resumed after the last one)
        save_classifier(clf, job.choice.from_scratch, strategy, best)
    # The other processes receive rank 0's best weights: they may not see its files (several nodes, no shared disk).
    saved = dict(clf.named_parameters()) if job.choice.from_scratch else clf.trainable_parameters()
    strategy.load_trained(clf, saved, best)
    data, choice = job.data, job.choice
    two = data.num_classes == 2 and not data.multi_label  # ROC AUC: the second class's probability ranked, for test
    results = {
        k: evaluate(model, splits[k], settings, strategy, f"final {k}", two and k == "test")
        for k in ("train", "val", "test")
    }
    splits_text = {k: (p.texts, p.targets()) for k, p in job.parts.items()}
    baseline = strategy.on_main(lambda: bag_of_words(splits_text, data.num_classes, data.multi_label))
    return {
        "model": choice.ref,
        "data": job.settings.data.source,
        "split": job.protocol,
        "split_sizes": {k: len(v) for k, v in job.parts.items()},
        "split_files": split_files(job.settings.data, job.data, job.parts),
        "num_classes": data.num_classes,
        "label_names": data.label_names,
        "multi_label": data.multi_label,
        **final_figures(results, data.label_names, job.settings.data.threshold),
        "baseline": baseline,  # a bag-of-words logistic regression on the same splits (training.baseline)
        "best_epoch": state.best_epoch,
        "best_step": state.best_step,
        "select_by": settings.select_by,
        "steps": state.step,
        "seconds": time.perf_counter() - job.started,
        "train_seconds": state.train_seconds,
        "tokens_per_second": state.train_tokens / max(state.train_seconds, 1e-9),
        "dtype": str(choice.dtype).removeprefix("torch."),
        "device": str(strategy.device),
        "world_size": strategy.processes.world_size,
        "trainable_parameters": sum(p.numel() for p in clf.trainable_parameters().values()),
    }


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    plain_warnings(DataWarning)  # a file's skipped rows: the message, not the line of ours that warned
    # Before the first CUDA allocation: segments that grow in place instead of new blocks beside old ones, so a
    # long run's memory does not fragment past the plan (the user's own setting wins).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if settings.compute.deterministic:
        make_deterministic()
    sigterm_as_ctrl_c()
    progress = Progress()
    try:
        run(settings, progress)
    except KeyboardInterrupt:
        if Processes.from_environment().is_main:  # the strategy may not be chosen yet: what torchrun said
            print(f"\n{interrupted(progress.out, progress.phase)}", file=sys.stderr)
        return 130
    # DataError, CheckpointError, OutputError and ResumeError are ValueErrors: bad input, told in one line.
    except (DownloadError, TrainingDiverged, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

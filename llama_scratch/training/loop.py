"""The training loop: AdamW on the trainable parameters, warm-up then decay, evaluation each epoch (and every
`eval_every` steps), the best weights by the measure asked (`select_by`), and
checkpoints that let an interrupted run continue to exactly the weights an uninterrupted run would reach.

Which rows each step trains on, and how many steps an epoch makes, is `steps.py`'s.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from ..checkpoints import resume
from ..checkpoints.progress import progress_bar
from ..data.batching import TokenizedSplit, forward, to_batch
from ..model.packing import to_device
from ..parallel.strategy import Replicated, Strategy, optimizer_kernels, unwrap
from . import objective, resume_points
from .evaluation import evaluate, history_line, label_sets, selection_key
from .interrupts import interrupts_deferred, stops_noted
from .optim import MasterWeightAdamW
from .steps import check_enough_data, epoch_plan


@dataclass
class TrainSettings:
    """The training recipe, and the one place its defaults live (the command's flags and help derive from it)."""

    epochs: int = 5
    max_steps: int | None = None  # stop after this many optimizer steps (the schedule is shortened to match)
    min_steps: int = 100  # small data: the command raises the epochs until training takes at least this many steps
    batch_size: int = 8  # rows per process per micro-batch
    # A budget of tokens per micro-batch instead (None: batch_size rows): texts grouped by length, so a batch of
    # short texts holds many rows and one of long texts few, and every micro-batch is about equally much work.
    batch_tokens: int | None = None
    grad_accum: int = 1
    # The peak rate of the default recipe (the last 2 blocks, the head): the best of the rates tried for it on the
    # task suite, and SMS spam's 98.67% either way (benchmarks/RESULTS.md, "Recipes on the task suite"). Weights that
    # start from nothing (LoRA adapters, a model from scratch) learn at it too (the LoRA rows of the accuracy tables).
    lr: float = 1e-3
    # More pretrained blocks training whole take smaller steps: more weights move at once (`default_lr`).
    lr_deep: ClassVar[float] = 2e-4
    weight_decay: float = 0.1
    warmup: float = 0.1  # fraction of the steps spent ramping the learning rate up from zero
    schedule: str = "cosine"  # cosine | linear | constant (after the warm-up)
    clip_grad: float = 1.0  # max gradient norm; 0 disables clipping
    seed: int = 123
    save_every: int = 50  # optimizer steps between resume checkpoints (also at every epoch end and on Ctrl-C)
    eval_batch_size: int | None = None  # None: 2 x batch_size
    padding_side: str = "packed"  # packed: no padding at all (model/packing.py); "right"/"left" pad
    # "float32": float32 masters + moments for bf16 parameters (12 B a trained parameter; optim.py), else bf16 rounds
    # most updates away; "param": moments in the parameters' dtype (4 B in bf16, lossy). Same on float32 weights.
    optimizer_state: str = "float32"
    eval_every: int | None = None  # optimizer steps between validation evaluations, besides each epoch's end
    select_by: str = "accuracy"  # accuracy | macro_f1 | loss: the validation measure the kept weights are best at
    # Stop after this many evaluations without a better result (one an epoch without eval_every; None: never).
    patience: int | None = None
    class_weights: list[float] | None = None  # per-class loss weights (see balanced_weights); None: all equal

    def __post_init__(self) -> None:
        if self.eval_every is not None and self.eval_every < 1:
            raise ValueError(f"--eval-every must be a number of optimizer steps, at least 1; got {self.eval_every}")

    @property
    def eval_rows(self) -> int:
        """Rows per batch where nothing trains (evaluation, the frozen-prefix pass): no gradients, so twice as many."""
        return self.eval_batch_size or 2 * self.batch_size


def default_lr(train_last: int | None, fresh: bool) -> float:
    """The peak rate when --lr is not given: `TrainSettings.lr` for up to 2 trained blocks (None: all), adapters or
    random weights (`fresh`); `lr_deep` when more pretrained blocks train whole, where 1e-3 was never measured and
    full fine-tuning's usual rates are far smaller."""
    return TrainSettings.lr if fresh or (train_last is not None and train_last <= 2) else TrainSettings.lr_deep


@dataclass
class TrainState:
    """Everything needed to continue a run, besides the weights and the optimizer."""

    epoch: int = 0  # the epoch in progress
    batches_done: int = 0  # micro-batches of that epoch already consumed (always a whole optimizer step)
    step: int = 0  # optimizer steps taken in total
    best_val_accuracy: float = -1.0  # the kept evaluation's figures (what a later one must beat: selection_key)
    best_val_loss: float = math.inf
    best_val_macro_f1: float = -1.0
    best_epoch: int = -1
    best_step: int = -1  # the step of the evaluation whose weights are kept (its history row)
    history: list[dict] = field(default_factory=list)
    # Since the last history row (the epoch's start without eval_every), over all processes: (loss x rows,
    # correct, rows); here so a resumed stretch reports all of it.
    row_sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    train_seconds: float = 0.0
    train_tokens: int = 0
    evaluated_step: int = -1  # the step at which an evaluation (validation, history, best) was last recorded


class TrainingDiverged(RuntimeError):
    pass


class StopAgreed(KeyboardInterrupt):
    """Raised by every process at the same step's end when one was asked to stop (Strategy.stop_agreed): all save
    together. `saved`: the point was saved at that step already (an epoch's end)."""

    def __init__(self, saved: bool = False) -> None:
        super().__init__()
        self.saved = saved


# ---------------------------------------------------------------------------------------------- class weights


def balanced_weights(labels: list[int] | list[list[int]], num_classes: int) -> list[float]:
    """Loss weights n / (classes x count): each class weighs as much as if all were equally common (a rare one too).

    Under --multi-label (`labels` multi-hot rows, `LabelledTexts.targets`) each label is its own yes/no question,
    so its weight is binary cross-entropy's `pos_weight`: negatives / positives, so its positive rows weigh as
    much as its negative ones (a label on 1 row in 10 gets 9). A label no training row carries gets negatives / 1:
    it has no positive term to weigh."""
    if labels and isinstance(labels[0], list):
        positives = torch.tensor(labels, dtype=torch.float64).sum(0)
        return ((len(labels) - positives) / positives.clamp(min=1)).tolist()
    counts = torch.bincount(torch.tensor(labels), minlength=num_classes).clamp(min=1)
    return (len(labels) / (num_classes * counts.double())).tolist()


# ---------------------------------------------------------------------------------------------- optimizer


def make_optimizer(model: nn.Module, s: TrainSettings) -> torch.optim.AdamW:
    """AdamW over trainable parameters only (frozen ones get no state). Norm gains are not weight-decayed.

    The kernel is chosen for the parameters' kind (`optimizer_kernels`): fused on GPUs and CPUs, multi-tensor
    (foreach) for sharded parameters (DTensors), which the fused kernel would gather whole.
    "float32" `optimizer_state` on low-precision parameters steps float32 masters (MasterWeightAdamW).
    """
    if s.optimizer_state not in ("param", "float32"):
        raise ValueError(f"optimizer_state must be 'param' or 'float32', got {s.optimizer_state!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    masters = s.optimizer_state == "float32" and any(p.dtype != torch.float32 for p in params)
    return (MasterWeightAdamW if masters else torch.optim.AdamW)(
        groups, lr=s.lr, betas=(0.9, 0.95), eps=1e-8, **optimizer_kernels(params)
    )


def lr_factor(step: int, total: int, s: TrainSettings) -> float:
    """Multiplier of the peak learning rate at `step`: linear warm-up, then cosine or linear decay to 10%."""
    warmup = int(s.warmup * total)
    if step < warmup:
        return (step + 1) / warmup
    if s.schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if s.schedule == "cosine" else 1 - progress
    return 0.1 + 0.9 * decay


# ---------------------------------------------------------------------------------------------- checkpoints


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trained parameters only, detached (the frozen backbone is reloaded from its own checkpoint)."""
    return {name: p.detach() for name, p in unwrap(model).named_parameters() if p.requires_grad}


def save_resume_point(
    path: Path, model, optimizer, scheduler, state: TrainState, settings: TrainSettings, identity: dict
) -> None:
    """The trained parameters, optimizer, schedule, RNG and counters, in one safetensors file (see resume.py)."""
    plain = {"state": asdict(state), "settings": asdict(settings), "identity": identity}
    resume.write_point(path, trainable_state(model), optimizer, scheduler, **plain)


def check_same_run(
    path: Path, record: dict, settings: TrainSettings, identity: dict, partial: bool = False, unknown: tuple = ()
) -> None:
    """Refuse (by name) a resume point whose settings, data or model differ from this run's. `partial`: compare only
    what `identity` holds, for a look before everything is known (the command's check before the weights load);
    `unknown`: settings not known yet at that look, left out of it."""
    try:
        saved = {**record["settings"], **record["identity"]}
    except (KeyError, TypeError) as e:
        raise resume.ResumeError(f"{path} is not a usable resume point: {e}") from None
    now = {**asdict(settings), **identity}
    for changeable in ("save_every",):  # how often to save may change between the two halves of a run
        saved.pop(changeable, None), now.pop(changeable, None)
    if partial:
        now = {k: v for k, v in now.items() if k not in unknown}
        saved = {k: v for k, v in saved.items() if k in now}
    resume.check_same_run(path, saved, now)


def load_resume_point(
    path: Path,
    model,
    optimizer,
    scheduler,
    settings: TrainSettings,
    identity: dict,
    strategy: Strategy | None = None,
    record: dict | None = None,
) -> TrainState:
    """Continue from `path`, refusing (by name) any setting, data or model that differs from the saved run's.
    `strategy` makes the saved tensors like the parameters (a sharded process's rows: DTensors again); the
    default, one process, takes them whole as saved. `record`: the point already read (resume_points.read,
    which under several processes is how those that do not see `path` get it); read from `path` when None."""
    strategy = strategy or Replicated()
    record = resume.read_point(path) if record is None else record
    try:
        state = {k: v for k, v in record["state"].items() if k in {f.name for f in fields(TrainState)}}
        defaults = asdict(TrainState())  # a counter this version dropped is ignored; a new one starts at its default
        if bad := [
            k
            for k, v in state.items()
            if type(v) is not type(defaults[k]) and not (isinstance(defaults[k], float) and type(v) is int)
        ]:
            raise TypeError(f"state entries of the wrong type: {', '.join(bad)}")
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise resume.ResumeError(f"{path} is not a usable resume point: {e}") from None
    check_same_run(path, record, settings, identity)
    strategy.as_resumed(record, model, optimizer)
    resume.restore(record, unwrap(model), optimizer, scheduler, path)
    return TrainState(**state)


# ---------------------------------------------------------------------------------------------- the loop


def class_weight(s: TrainSettings, device: torch.device) -> torch.Tensor | None:
    """The loss's class weights on the device (None: all equal), copied once without waiting (packing.to_device)."""
    return None if s.class_weights is None else to_device([torch.tensor(s.class_weights)], device)[0]


def row_weights(split: TokenizedSplit, s: TrainSettings) -> list[float] | None:
    """Each training row's class weight, for the step's summed weights (`epoch_plan`); None without class weights,
    or under --multi-label, where a label's weight is its positive rows' `pos_weight`, inside each row's loss."""
    if s.class_weights is None or split.multi_hot:
        return None
    return [s.class_weights[y] for y in split.labels]


def train_step(
    model: nn.Module,
    split: TokenizedSplit,
    step_rows: list[list[int]],
    s: TrainSettings,
    strategy: Strategy,
    weight: torch.Tensor | None = None,
    step_total: float | None = None,
) -> tuple[torch.Tensor, int]:
    """Forward and backward over one optimizer step's micro-batches, gradients accumulating. `weight`: the class
    weights on the device (`class_weight`; made here when not given). `step_total` (`epoch_plan`): what the step's
    loss is divided by, its rows over all processes when micro-batches differ in size (a token budget), or the sum
    of its rows' class weights: each micro-batch's summed loss over it, so the step's gradient is that of the
    (weighted) mean over all its rows, as one batch of them would give. None: each micro-batch's mean divided by
    `grad_accum` (equal batches, no class weights). The processes' gradients are averaged, hence `world_size`.

    Returns this process's (loss x rows, correct, rows) for the step, kept on the device so that nothing waits
    for the GPU here (nothing is copied to the device either, but each micro-batch's one non-blocking copy), and
    the tokens the step trained on (all processes), counted on the host from the lengths.
    """
    device, world_size = strategy.device, strategy.processes.world_size
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    if weight is None and s.class_weights is not None:
        weight = class_weight(s, device)
    tokens = 0
    for j, rows in enumerate(step_rows):
        batch = to_batch(split, rows, s.padding_side, device)
        # Several processes combine their gradients only after the last micro-batch of a step.
        with strategy.gradient_sync(model, j == len(step_rows) - 1):
            logits = forward(model, batch)
            mean = objective.loss(logits, batch["labels"], weight)
            if step_total is None:
                (mean / s.grad_accum).backward()
            elif weight is None or batch["labels"].ndim > 1:  # rows count alike (a label's pos_weight is in its mean)
                (mean * (len(rows) * world_size / step_total)).backward()
            else:  # class weights: the sum of each row's weighted loss, over the step's summed weights
                summed = objective.loss(logits, batch["labels"], weight, reduction="sum")
                (summed * (world_size / step_total)).backward()
        correct = objective.correct(logits, batch["labels"])
        sums[:2] += torch.stack([mean.detach().double() * len(rows), correct.double()])
        sums[2] += len(rows)  # a number the kernel is given: no tensor made on the host and copied
        tokens += sum(len(split.ids[i]) for i in rows) * world_size
    return sums, tokens


def check_finite(totals: list[float], state: TrainState, resume_path: Path, world_size: int = 1) -> None:
    """Stop on a non-finite loss or gradient norm, summed over all processes: one process's NaN is everyone's, so all
    stop together instead of some waiting forever in a collective. Every process holds the whole model's norm
    (DDP's gradients are averaged, a sharded one is `full_norm`), so the sum is `world_size` times it."""
    loss_sum, _, rows, norm_sum = totals
    if not (math.isfinite(loss_sum) and math.isfinite(norm_sum)):
        raise TrainingDiverged(
            f"the loss became {loss_sum / max(rows, 1)} (gradient norm {norm_sum / world_size}) at step "
            f"{state.step + 1}, epoch {state.epoch + 1}; try a lower --lr. The last good resume point is {resume_path}."
        )


def finish_epoch(state: TrainState, val: dict, complete: bool, on_best, log, select_by: str = "accuracy") -> dict:
    """Record an evaluation (an epoch's end, or every `eval_every` steps inside one) in the history, keep the best
    weights by `select_by`, and, at an epoch's end (`complete`), move the epoch counters on. Returns the row.

    Called with interrupts held (see `train`): the history row, the best figures, the best weights on disk and
    the counters change together or not at all, so a Ctrl-C here never leaves a duplicated row or a best
    evaluation whose weights were not saved.
    """
    loss_sum, correct, rows_seen = state.row_sums
    row = {
        "epoch": state.epoch + 1,
        "step": state.step,
        # Running figures from the batches trained since the last row (a full pass would cost as much as an epoch).
        "train_loss": loss_sum / max(rows_seen, 1),
        "train_accuracy": correct / max(rows_seen, 1),
        "val_loss": val["loss"],
        "val_accuracy": val["accuracy"],
        "val_macro_f1": val["macro_f1"],
    }
    state.history.append(row)
    state.evaluated_step, state.row_sums = state.step, [0.0, 0.0, 0.0]
    log(history_line(row, label_sets(val)))
    # Before any best, the figures are -1 and infinity: any evaluation beats them, whatever the measure.
    best = {"val_accuracy": state.best_val_accuracy, "val_loss": state.best_val_loss}
    if selection_key(row, select_by) > selection_key(best | {"val_macro_f1": state.best_val_macro_f1}, select_by):
        state.best_val_accuracy, state.best_val_loss = row["val_accuracy"], row["val_loss"]
        state.best_val_macro_f1, state.best_epoch, state.best_step = row["val_macro_f1"], row["epoch"], row["step"]
        if on_best is not None:  # on every process: a sharded model is gathered to save it
            on_best(row["epoch"])
    if complete:
        state.epoch, state.batches_done = state.epoch + 1, 0
    return row


@dataclass
class Loop:
    """What every step of one run uses: the model and its optimizer, the settings, and where progress goes."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    s: TrainSettings
    strategy: Strategy
    total: int  # optimizer steps the schedule runs for
    resume_path: Path
    identity: dict
    asked: Callable[[], bool] = lambda: False  # whether this process was asked to stop (interrupts.stops_noted)
    val: TokenizedSplit | None = None  # what each evaluation runs on
    on_best: Callable[[int], None] | None = None  # the best weights so far: saved (every process calls it)
    log: Callable[..., None] = print
    on_row: Callable[[dict], None] | None = None  # each history row once recorded (--tensorboard)

    def record(self, state: TrainState, complete: bool) -> None:
        """Evaluate on `val`, then record the row, keep the best weights and save a resume point, all or nothing
        (interrupts held). Asked to stop during the evaluation: stopped here, not a step later."""
        val = evaluate(self.model, self.val, self.s, self.strategy, "evaluating val")
        with interrupts_deferred():
            row = finish_epoch(state, val, complete, self.on_best, self.log, self.s.select_by)
            self.save_point(state)
            if self.on_row is not None:  # with the row: a Ctrl-C between them would leave it out
                self.on_row(row)
        self.stop_if_asked(saved=True)

    def save_point(self, state: TrainState) -> None:
        """Called by every process: sharded, each writes its rows; replicated, rank 0 writes (resume_points.save)."""
        parts = (self.model, self.optimizer, self.scheduler, state, self.s, self.identity)
        resume_points.save(self.strategy, self.resume_path, lambda file: save_resume_point(file, *parts))

    def stop_if_asked(self, saved: bool = False) -> None:
        """At a step's end: every process stops here (StopAgreed) when any was asked to (one vote on the host)."""
        if self.strategy.stop_agreed(self.asked()):
            raise StopAgreed(saved)

    def saved_on_interrupt(self, state: TrainState, interrupt: KeyboardInterrupt) -> bool:
        """The resume point an interrupt leaves: saved by every process when they agreed to stop (or one process
        was stopped); a process stopped alone among several (a second signal) saves nothing, since a save that
        the others do not join could wait for them forever."""
        if isinstance(interrupt, StopAgreed) or not self.strategy.processes.several:
            if not getattr(interrupt, "saved", False):
                self.save_point(state)
            return True
        return False


def train_epoch(loop: Loop, split: TokenizedSplit, state: TrainState) -> bool:
    """One epoch's optimizer steps from where `state` stands; True when it ran to its end (not the step limit)."""
    s, strategy = loop.s, loop.strategy
    batches, step_totals = epoch_plan(
        [len(x) for x in split.ids], state.epoch, s, strategy.processes, row_weights(split, s)
    )
    bar = progress_bar(
        total=len(batches) // s.grad_accum,
        initial=state.batches_done // s.grad_accum,
        desc=f"epoch {state.epoch + 1}/{s.epochs}",
        disable=not strategy.is_main,
    )
    started = time.perf_counter()
    # Resumed after the run's last step but before that epoch's end was recorded: nothing left to step.
    todo = range(state.batches_done, len(batches), s.grad_accum) if state.step < loop.total else range(0)
    weight = class_weight(s, strategy.device)  # once an epoch, not once a step
    if eval_due(state, s, len(batches), loop.total):  # resumed from a stop during that evaluation: done again
        loop.record(state, complete=False)
        if patience_spent(state, s):
            return False
    for k in todo:
        total = None if step_totals is None else step_totals[k // s.grad_accum]
        sums, tokens = train_step(loop.model, split, batches[k : k + s.grad_accum], s, strategy, weight, total)
        params = [p for p in loop.model.parameters() if p.requires_grad]
        norm = nn.utils.clip_grad_norm_(params, s.clip_grad if s.clip_grad > 0 else float("inf"))
        norm = strategy.full_norm(norm.detach()).to(sums).view(1)  # sharded: the norm of all the rows
        totals = strategy.all_sum(torch.cat([sums, norm])).tolist()  # one sync a step
        check_finite(totals, state, loop.resume_path, strategy.processes.world_size)
        with interrupts_deferred():  # weights, optimizer, schedule and counters move together
            loop.optimizer.step()
            loop.scheduler.step()
            # Freed gradients lower the next forward's peak; DDP's are views of its buckets: zeroed instead.
            strategy.zero_grad(loop.optimizer)
            state.step += 1
            state.batches_done = k + s.grad_accum
            state.row_sums = [a + b for a, b in zip(state.row_sums, totals[:3], strict=True)]
            state.train_tokens += tokens  # counted with the step: a resumed run's tokens/s covers each step once
            now = time.perf_counter()
            state.train_seconds, started = state.train_seconds + now - started, now
        bar.update(1)
        bar.set_postfix(loss=f"{totals[0] / max(totals[2], 1):.4f}", lr=f"{loop.scheduler.get_last_lr()[0]:.2e}")
        loop.stop_if_asked()  # before the periodic save: a stop saves this step itself (train)
        if eval_due(state, s, len(batches), loop.total):  # it saves a resume point too
            loop.record(state, complete=False)
            if patience_spent(state, s):
                break
        elif state.step % s.save_every == 0:
            loop.save_point(state)
        if state.step >= loop.total:
            break
    bar.close()
    return state.batches_done >= len(batches)


def eval_due(state: TrainState, s: TrainSettings, n_batches: int, total: int) -> bool:
    """An evaluation inside the epoch now: every `eval_every` steps, not yet recorded, unless the epoch's end or
    the run's last step is where the epoch stands (`train` evaluates there anyway: one row a step)."""
    inside = 0 < state.batches_done < n_batches and state.step < total
    return bool(s.eval_every) and inside and state.step % s.eval_every == 0 and state.evaluated_step != state.step


def patience_spent(state: TrainState, s: TrainSettings) -> bool:
    """Whether the last `patience` evaluations (each epoch's end, and every `eval_every` steps) all failed to
    beat the kept one."""
    since = sum(r["step"] > state.best_step for r in state.history)
    return bool(s.patience) and state.best_epoch >= 0 and since >= s.patience


def more_to_do(state: TrainState, s: TrainSettings, total: int) -> bool:
    """Steps left, or an epoch whose end was not recorded yet (a resume point saved at the last step, before its
    evaluation); never after early stopping, so a resumed run that had stopped stays stopped."""
    if state.epoch >= s.epochs or patience_spent(state, s):
        return False
    return state.step < total or state.evaluated_step != state.step


def train(
    model: nn.Module,
    splits: dict[str, TokenizedSplit],
    s: TrainSettings,
    strategy: Strategy,
    out_dir: Path,
    resume: bool = False,
    on_best=None,
    log=print,
    run_identity: dict | None = None,
    on_row=None,
) -> TrainState:
    """Train `model` (`strategy.wrap`'s: a classifier, maybe wrapped in DDP or sharded) on splits['train'],
    evaluating on 'val' after each epoch and every `s.eval_every` steps. `strategy` says how the processes share
    the work (`Replicated()`: one process on the CPU). `on_best(epoch)` is called on every process when the
    validation measure `s.select_by` improves (rank 0 saves); `on_row(row)` with each history row as recorded.
    `run_identity` (model, data, ...) is stored with each resume point with the number of processes; resuming
    under another refuses.
    """
    lengths = [len(x) for x in splits["train"].ids]
    steps_per_epoch = check_enough_data(len(lengths), s, strategy.processes, lengths)
    total = steps_per_epoch * s.epochs if s.max_steps is None else min(s.max_steps, steps_per_epoch * s.epochs)
    optimizer = make_optimizer(model, s)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total, s))
    identity = {"world_size": strategy.processes.world_size, **(run_identity or {})}
    where = resume_points.location(strategy, out_dir, resuming=False)
    loop = Loop(model, optimizer, scheduler, s, strategy, total, where, identity)
    loop.val, loop.on_best, loop.log, loop.on_row = splits["val"], on_best, log, on_row
    state = TrainState()
    # Alike on every process, which need not share rank 0's disk (rank 0 reads and sends, or all agree).
    found = resume_points.read(strategy, out_dir) if resume else None
    if found is not None:
        state = load_resume_point(found[0], model, optimizer, scheduler, s, identity, strategy, record=found[1])
        log(f"resuming from {loop.resume_path}: epoch {state.epoch + 1}, step {state.step}")
    elif resume:
        log(f"--resume: no resume point at {loop.resume_path}; starting from the beginning")
    model.train()
    with stops_noted(strategy.processes.several) as asked:
        loop.asked = asked
        try:
            while more_to_do(state, s, total):
                complete = train_epoch(loop, splits["train"], state)
                if not patience_spent(state, s):  # (spent by an evaluation inside the epoch: stopped there)
                    loop.record(state, complete)  # the epoch's end: its row, best weights and resume point
                if patience_spent(state, s):
                    unit = "evaluation" if s.eval_every else "epoch"
                    log(f"stopping early: no better validation result in the last {s.patience} {unit}(s) (--patience)")
                    break
                if not complete:
                    break  # max_steps reached inside the epoch
        except KeyboardInterrupt as interrupt:
            # Gradients of an unfinished step are discarded: the saved point is the last whole step.
            if loop.saved_on_interrupt(state, interrupt):
                log(f"\ninterrupted at step {state.step}: progress saved to {loop.resume_path}")
            else:
                log(f"\nstopped at step {state.step} without saving: {loop.resume_path} holds the last resume point")
            raise
    return state

"""Which rows each optimizer step trains on: an epoch's micro-batches in a seeded order, shared out among the
processes, by a count of rows (`batch_size`) or a budget of tokens (`batch_tokens`), and how many steps an epoch
makes (the schedule's length, and the epochs small data needs to reach `min_steps`).

One optimizer step = `grad_accum` micro-batches on each of `world_size` processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

import torch
from torch.utils.data import DistributedSampler

from ..parallel.strategy import Processes


class StepRecipe(Protocol):
    """What the steps depend on in the recipe (`loop.TrainSettings` holds it, with everything else)."""

    epochs: int
    min_steps: int
    batch_size: int
    batch_tokens: int | None
    grad_accum: int
    seed: int
    padding_side: str


def epoch_batches(n: int, epoch: int, s: StepRecipe, processes: Processes) -> list[list[int]]:
    """This process's micro-batches for one epoch, as row indices, in a fixed order given (seed, epoch).

    The order comes from `DistributedSampler`: with N processes each takes every N-th row of one shuffled list,
    so batch k of one process with batch size 8 holds the rows of batch k on two with batch size 4: the same
    steps. The last, incomplete batch is dropped: every step has the same size on every process.
    """
    sampler = DistributedSampler(
        range(n), num_replicas=processes.world_size, rank=processes.rank, shuffle=True, seed=s.seed
    )
    sampler.set_epoch(epoch)
    order = list(sampler)
    usable = len(order) // (s.batch_size * s.grad_accum) * s.batch_size * s.grad_accum
    return [order[i : i + s.batch_size] for i in range(0, usable, s.batch_size)]


def budget_batches(lengths: Sequence[int], budget: int, seed: int, epoch: int, padded: bool) -> list[list[int]]:
    """Every row in micro-batches of at most `budget` tokens (a longer text alone in its own), in an order fixed by
    (seed, epoch): the same on every process, which each take their share (`epoch_plan`).

    The rows are shuffled, then sorted by length (a stable sort: texts of equal length stay shuffled), and cut
    greedily where the next text would overflow the budget; then the batches' order is shuffled. Texts of similar
    length share a batch, so a padded batch wastes little and a packed one pads little inside attention. A padded
    batch (`padded`) costs rows x longest everywhere; a packed one its real tokens in the linear layers, but rows x
    longest in attention's padded copy (`Packed.pad`), so a packed batch keeps both under the budget: the memory
    plan's bound holds for it (short texts of mixed lengths would otherwise pad to twice the budget there).

    Sorting before cutting makes the number of batches the same in every epoch (the cuts depend on the sorted
    lengths alone), so the schedule's length is known before training starts.
    """
    if budget < 1:
        raise ValueError(f"--batch-tokens must be a positive number of tokens, got {budget}")
    g = torch.Generator().manual_seed(seed + epoch)
    order = sorted(torch.randperm(len(lengths), generator=g).tolist(), key=lengths.__getitem__)
    batches: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i in order:
        n = lengths[i]  # the longest so far: the rows come shortest first
        slots = (len(current) + 1) * n  # rows x longest: what padding, or attention's padded copy, holds
        cost = slots if padded else max(tokens + n, slots)
        if current and cost > budget:
            batches.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += n
    if current:
        batches.append(current)
    return [batches[k] for k in torch.randperm(len(batches), generator=g).tolist()]


def epoch_plan(
    lengths: Sequence[int], epoch: int, s: StepRecipe, processes: Processes, row_weights: Sequence[float] | None = None
) -> tuple[list[list[int]], list[float] | None]:
    """This process's micro-batches for one epoch, and what each optimizer step's loss is divided by: its rows over
    all processes, or with `row_weights` (each row's class weight, `--class-weights`) the sum of its rows' weights.
    None with `batch_size` and no weights: every micro-batch has that many rows, and its mean is the step's share.

    A token budget makes micro-batches of different sizes, so a mean over each would weigh a row in a small batch
    more than one in a large; and a weighted mean over each micro-batch would undo class weights in a micro-batch
    of one class. Dividing each micro-batch's summed loss by the step's total makes the step's loss the mean over
    all its rows (`train_step`). Every process makes the same list of batches and takes every `world_size`-th:
    step k's micro-batches on all processes are the k-th window of `world_size x grad_accum` batches, and a last
    window not full is dropped.
    """
    weigh = (lambda b: len(b)) if row_weights is None else (lambda b: sum(row_weights[i] for i in b))
    window = processes.world_size * s.grad_accum
    if s.batch_tokens is None:
        mine = epoch_batches(len(lengths), epoch, s, processes)
        if row_weights is None:
            return mine, None
        ranks = [epoch_batches(len(lengths), epoch, s, replace(processes, rank=r)) for r in range(processes.world_size)]
        steps = range(0, len(mine), s.grad_accum)
        return mine, [sum(weigh(b) for r in ranks for b in r[k : k + s.grad_accum]) for k in steps]
    every = budget_batches(lengths, s.batch_tokens, s.seed, epoch, padded=s.padding_side != "packed")
    every = every[: len(every) // window * window]
    totals = [sum(weigh(b) for b in every[i : i + window]) for i in range(0, len(every), window)]
    return every[processes.rank :: processes.world_size], totals


def check_enough_data(n_train: int, s: StepRecipe, processes: Processes, lengths: Sequence[int] | None = None) -> int:
    """Optimizer steps per epoch (as `epoch_plan` makes them); a clear error when there is not one full step.
    With `batch_tokens` the count depends on the texts' `lengths`, which must then be given."""
    world_size = processes.world_size
    if s.batch_tokens is not None:
        if lengths is None:
            raise ValueError("a token budget's steps per epoch depend on the texts' lengths: pass them")
        steps = len(epoch_plan(lengths, 0, s, processes)[1] or [])
        if steps == 0:
            n = len(budget_batches(lengths, s.batch_tokens, s.seed, 0, s.padding_side != "packed"))
            raise ValueError(
                f"the training split's {n_train} rows make {n} micro-batches of --batch-tokens {s.batch_tokens}, "
                f"fewer than one step needs ({s.grad_accum} accumulation x {world_size} processes); lower "
                "--batch-tokens, --grad-accum or the number of processes"
            )
        return steps
    rows_per_process = math.ceil(n_train / world_size)  # DistributedSampler's share, padded with repeats
    steps = rows_per_process // (s.batch_size * s.grad_accum)
    if steps == 0:
        per_step = s.batch_size * s.grad_accum * world_size
        raise ValueError(
            f"the training split has {n_train} rows, fewer than one step needs ({s.batch_size} rows x "
            f"{s.grad_accum} accumulation x {world_size} processes = {per_step}); lower --batch-size, "
            "--grad-accum or the number of processes"
        )
    return steps


def epochs_for_min_steps(
    n_train: int, s: StepRecipe, processes: Processes, lengths: Sequence[int] | None = None
) -> int:
    """Enough epochs for `s.min_steps` optimizer steps: five epochs of a few dozen rows leave a model where it was.
    (`lengths`: the training texts', needed with `batch_tokens`; see `check_enough_data`.)"""
    steps = check_enough_data(n_train, s, processes, lengths)
    return max(s.epochs, math.ceil(s.min_steps / steps))


def raise_epochs(s: StepRecipe, epochs_given: bool, n_train: int, processes: Processes, log: Callable, lengths=None):
    """Without --epochs (`epochs_given` False), more epochs for small data, to reach `s.min_steps` optimizer steps;
    said in the log. `lengths`: the training texts' token counts, which a token budget needs to count its steps."""
    epochs = epochs_for_min_steps(n_train, s, processes, lengths)
    if not epochs_given and epochs > s.epochs:
        log(
            f"{n_train:,} training rows make few optimizer steps: {epochs} epochs instead of "
            f"{s.epochs}, for at least {s.min_steps} steps (--epochs or --min-steps to choose)"
        )
        s.epochs = epochs

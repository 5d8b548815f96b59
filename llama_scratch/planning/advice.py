"""When a memory plan does not fit the GPU: the first part that does not, what fits instead (each option
re-planned), and the fewest GPUs over which a sharded run fits.

`--plan` prints these (plan_report.py) below its table; each option is a set of flags the command takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..model.lora import LoRASettings
from .memory import (
    FP32,
    NF4_BLOCK,
    QUANTIZE,
    GiB,
    MemoryPlan,
    PlanInputs,
    plan_memory,
    planned_rows,
    planned_tokens,
    with_margin,
)

STAGES = ("weights", "weights, state and gradients", "activations", "fits")  # in the order memory fills
LORA_RANK = 8  # the adapters' rank the advice offers: the recipe the docs and the GPU figures use


@dataclass
class Advice:
    """Why a plan does not fit, and the options that do: each one re-planned and found to fit."""

    problem: str  # the first part that does not fit
    options: list[tuple[str, int]] = field(default_factory=list)  # (flags, GPU memory needed)
    closest: tuple[str, int] | None = None  # when no option fits: the best one tried
    note: str = ""


def in_gib(n: int) -> str:
    return f"{n / GiB:.1f}".removesuffix(".0") + " GiB"


def misfit(plan: MemoryPlan, gpu_bytes: int) -> str:
    """The first of STAGES that does not fit: the weights come first, then what training adds before it has seen
    a batch (optimizer state, gradients), then what grows with the batch (activations and temporaries)."""
    if with_margin(plan.weights) > gpu_bytes:
        return STAGES[0]
    if with_margin(plan.persistent + plan.phases["optimizer step"]) > gpu_bytes:
        return STAGES[1]
    return STAGES[3] if plan.fits(gpu_bytes) else STAGES[2]


def _exceeds(what: str, n: int, gpu_bytes: int) -> str:
    margin = "" if n > gpu_bytes else f", {in_gib(with_margin(n))} with the 5% + 0.5 GiB margin"
    return f"{what} ({in_gib(n)}{margin}) exceed the GPU's {in_gib(gpu_bytes)}"


def _flags(r: PlanInputs, changes: dict) -> str:
    """The command-line flags that turn the plan inputs `r` into `r` with `changes` (unchanged fields say nothing)."""
    names = {"optimizer_state": "--optimizer-state", "train_last": "--train-last", "batch_size": "--batch-size"}
    names |= {"grad_accum": "--grad-accum", "seq_len": "--max-length"}
    flags = []
    budget = r.tokens is not None and changes.get("tokens") is not None  # a token budget's batch: its own flag
    for key, value in changes.items():
        if getattr(r, key) == value or (budget and key == "batch_size"):
            continue
        if key == "tokens":
            flags.append(f"--batch-tokens {value}")
        elif key == "gradient_checkpointing":
            flags.append("--gradient-checkpointing")
        elif key == "dtype":
            flags.append("--dtype " + str(value).removeprefix("torch."))
        elif key == "quantize":
            flags.append(f"--quantize {value}")
        elif key == "lora":
            flags.append(f"--lora {value.rank}")
        else:
            flags.append(f"{names[key]} {value}")
    return " ".join(flags)


def replan(r: PlanInputs, changes: dict) -> MemoryPlan:
    if {"batch_size", "seq_len"} & changes.keys():  # other rows or lengths: whole texts, not the budget's tokens
        changes = {"tokens": None, **changes}
    return plan_memory(dataclasses.replace(r, **changes))


def _lora(plan: MemoryPlan, weights_fit: bool = True) -> list[tuple[dict, MemoryPlan]]:
    """LoRA adapters of rank LORA_RANK in the blocks that train, instead of their weights: optimizer state and
    gradients for a few million parameters instead of whole blocks; and with the frozen weights in NF4 as well
    (QLoRA), the cheapest recipe of all. Only the NF4 one where the weights alone do not fit (`weights_fit` False).
    Offered where blocks' weights train: not under --lora already, nor --train-last all (the embedding trains
    too) or 0 (no block to adapt)."""
    r = plan.inputs
    if r.lora is not None or not r.train_last:
        return []
    lora = {"lora": LoRASettings(LORA_RANK)}
    adapted = replan(r, lora)
    tried = [(lora, adapted)] if weights_fit else []
    return tried + [({**lora, **changes}, p) for changes, p in _quantized(adapted)]


def _quantized(plan: MemoryPlan) -> list[tuple[dict, MemoryPlan]]:
    """The frozen linear weights in NF4 (--quantize nf4), a quarter of their bfloat16 bytes: tried where the
    weights, or what stays allocated throughout, do not fit, when there are frozen linears and they are not already
    NF4. Tried after the options that keep the weights exact, so that it is offered beside them."""
    r, linears = plan.inputs, plan.counts.frozen_linears
    whole = r.train_last is None and r.lora is None  # nothing frozen but the unused lm_head: refused
    if r.quantize == "nf4" or whole or not linears or any(i % NF4_BLOCK for _, i in linears):
        return []
    return [({"quantize": "nf4"}, replan(r, {"quantize": "nf4"}))]


def _largest(values: list[int], plan_with: Callable[[int], MemoryPlan], gpu_bytes: int) -> int | None:
    """The largest of the ascending `values` whose plan fits (bisection: memory grows with each of these knobs)."""
    lo, hi, best = 0, len(values) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if plan_with(values[mid]).fits(gpu_bytes):
            best, lo = values[mid], mid + 1
        else:
            hi = mid - 1
    return best


def _fewer_trained(plan: MemoryPlan, gpu_bytes: int) -> list[tuple[dict, MemoryPlan]]:
    """Optimizer state and gradients grow with what trains: the most blocks that fit as asked, then with the
    cheaper options (AdamW moments in the parameter dtype, gradient checkpointing), each kept if it trains more."""
    r = plan.inputs
    variants = [{}]
    if r.optimizer_state == "float32" and r.param_dtype.itemsize < FP32:
        variants.append({"optimizer_state": "param"})  # 12 bytes of state per trained parameter become 4 (bf16)
    if not r.gradient_checkpointing:
        variants.append({"gradient_checkpointing": True})
    as_asked = r.cfg.n_layers + 1 if r.train_last is None else r.train_last  # "all" trains the embedding too
    tried, most = [], -1
    for v in variants:
        n = as_asked if v and replan(r, v).fits(gpu_bytes) else None
        if n is None:
            n = _largest(list(range(as_asked)), lambda k, v=v: replan(r, {**v, "train_last": k}), gpu_bytes)
        changes = v if n == as_asked else {**v, "train_last": n or 0}
        if n is None or n > most:  # one that fits only if it trains more than the ones before
            tried.append((changes, replan(r, changes)))
            most = max(most, -1 if n is None else n)
    return tried


def _fewer_rows(r: PlanInputs) -> tuple[list[int], Callable[[int], dict]]:
    """The smaller micro-batches to try, ascending, and the changes that make each: fewer rows with more
    micro-batches a step (the same rows a step), or under a token budget (`tokens`) a budget of a half, a quarter,
    ... with as many times the micro-batches (about the same tokens a step); not below one text of `seq_len`."""
    if r.tokens is None:
        rows = r.batch_size * r.grad_accum
        return [b for b in range(1, r.batch_size) if rows % b == 0], lambda b: {
            "batch_size": b,
            "grad_accum": rows // b,
        }
    parts = {r.tokens // 2**i: 2**i for i in range(1, 16) if r.tokens // 2**i >= r.seq_len}
    return sorted(parts), lambda t: {
        "batch_size": planned_rows(0, t, r.seq_len),
        "tokens": planned_tokens(t, r.seq_len),
        "grad_accum": r.grad_accum * parts[t],
    }


def _smaller_activations(plan: MemoryPlan, gpu_bytes: int) -> list[tuple[dict, MemoryPlan]]:
    """Activations grow with the rows and tokens of a micro-batch: gradient checkpointing, or smaller micro-batches
    (more of them a step: the same work a step, `_fewer_rows`), both if neither alone fits, and only then shorter
    texts."""
    r = plan.inputs
    rows = r.batch_size * r.grad_accum
    sizes, smaller = _fewer_rows(r)
    ckpt = {} if r.gradient_checkpointing else {"gradient_checkpointing": True}
    tried = [(ckpt, replan(r, ckpt))] if ckpt else []
    for v in [{}, ckpt] if ckpt else [{}]:
        if v and any(p.fits(gpu_bytes) for _, p in tried):
            break
        b = _largest(sizes, lambda b, v=v: replan(r, {**v, **smaller(b)}), gpu_bytes)
        if b is None and r.tokens is not None:  # no budget fits: one text a micro-batch, then shorter texts
            continue
        changes = {**v, **(smaller(b) if b else {"batch_size": 1, "grad_accum": rows})}
        tried.append((changes, replan(r, changes)))
    if not any(p.fits(gpu_bytes) for _, p in tried):

        def one_text(t: int) -> dict:  # one text of t tokens a micro-batch (a budget of t: one such text)
            if r.tokens is None:
                return {**ckpt, "batch_size": 1, "grad_accum": rows, "seq_len": t}
            return {**ckpt, "batch_size": 1, "seq_len": t, "tokens": t, "grad_accum": r.grad_accum * r.tokens // t}

        t = _largest(list(range(1, r.seq_len)), lambda t: replan(r, one_text(t)), gpu_bytes)
        if t is not None:
            tried.append((one_text(t), replan(r, one_text(t))))
    return tried


def advise(plan: MemoryPlan, gpu_bytes: int, shard: bool = True) -> Advice:
    """Name the first part of the plan that does not fit on `gpu_bytes` and try only what shrinks that part,
    re-planning each option. When none fits but the best one gets past this part, go on to the next part from
    it. The options of one GPU come first, cheapest recipe to the most changed; sharding across GPUs (`shard`,
    where the weights, state or gradients do not fit) last."""
    r, stage = plan.inputs, misfit(plan, gpu_bytes)
    note = ""
    if stage == STAGES[0]:
        dtype = str(r.param_dtype).removeprefix("torch.")
        held = f"{dtype} and {QUANTIZE[r.quantize]}" if r.quantize else dtype
        problem = _exceeds(f"the {held} weights alone", plan.weights, gpu_bytes)
        tried = [({"dtype": torch.bfloat16}, replan(r, {"dtype": torch.bfloat16}))] if dtype == "float32" else []
        tried += _quantized(plan) + _lora(plan, weights_fit=False)
        note = "no setting helps on one GPU or under DDP (a whole copy per GPU): shard it across GPUs (--shard)"
    elif stage == STAGES[1]:
        fixed = plan.persistent + plan.phases["optimizer step"]
        problem = _exceeds("the weights, optimizer state and gradients", fixed, gpu_bytes) + ", before activations"
        tried = _fewer_trained(plan, gpu_bytes) + _quantized(plan) + _lora(plan)
    elif stage == STAGES[2]:
        problem = (
            f"the activations and temporaries of the {plan.peak_phase} ({in_gib(max(plan.phases.values()))}) on "
            f"top of the weights and optimizer state ({in_gib(plan.persistent)}): {in_gib(plan.required())} needed "
            f"with the margin, the GPU has {in_gib(gpu_bytes)}"
        )
        tried = _smaller_activations(plan, gpu_bytes)
    else:
        return Advice("nothing: it fits")
    tried = [(c, p) for c, p in tried if _flags(r, c)]
    options = [(_flags(r, c), p.required()) for c, p in tried if p.fits(gpu_bytes)]
    closest = None
    if not options and tried:
        changes, best = min(tried, key=lambda t: t[1].required())
        flags = _flags(r, changes)
        if STAGES.index(misfit(best, gpu_bytes)) == STAGES.index(stage):  # this part does not fit whatever was tried
            closest = None if note else (flags, best.required())
        else:  # this part fits now: what else does it take
            rest = advise(best, gpu_bytes, shard=False)
            options = [(f"{flags} {f}", n) for f, n in rest.options]
            closest = (f"{flags} {rest.closest[0]}", rest.closest[1]) if rest.closest else (flags, best.required())
            note = rest.note
    if shard and stage in STAGES[:2] and (sharded := shard_option(plan, gpu_bytes)):
        options.append(sharded)
    if options:
        return Advice(problem, options)
    return Advice(problem, closest=closest, note=note)


def shard_option(plan: MemoryPlan, gpu_bytes: int) -> tuple[str, int] | None:
    """Sharding as an option: the fewest GPUs over which `--shard` fits, as flags and the memory each then needs."""
    r = plan.inputs
    n = smallest_world(dataclasses.replace(r, shard_group=None), gpu_bytes)
    if r.shard and n is not None and n <= r.world_size:
        return None
    if n is None:
        return None
    sharded = replan(r, {"shard": True, "world_size": n, "nodes": 1, "shard_group": None, "quantize": None})
    instead = " without --quantize" if r.quantize else ""
    return f"--shard on {n} GPUs (torchrun, {n} processes){instead}", sharded.required()


def advice_lines(advice: Advice) -> list[str]:
    lines = [f"  the first part that does not fit: {advice.problem}"]
    if advice.options:
        lines.append("  what fits instead (each option re-planned):")
        lines += [f"    {flags:<62} needs {in_gib(n)}" for flags, n in advice.options]
        if any("--max-length" in flags for flags, _ in advice.options):
            lines.append("    (--max-length cuts each text to that many tokens)")
    elif advice.closest:
        flags, n = advice.closest
        lines.append(f"  nothing tried fits; the closest is {flags} (needs {in_gib(n)})")
    if advice.note:
        lines.append(f"  {advice.note}")
    return lines


def world_sizes(per_node: int = 8, most: int = 1024) -> list[int]:
    """The world sizes worth sharding over, ascending: 2, 4, ... up to one node's `per_node` GPUs, then whole
    nodes of them."""
    small = [n for n in (2, 4, 8, 16, 32, 64) if n < per_node]
    return [n for n in [*small, *range(per_node, most + 1, per_node)] if 2 <= n <= most]


def smallest_world(r: PlanInputs, gpu_bytes: int, most: int = 1024) -> int | None:
    """The fewest processes (GPUs) over which a run of `r`, sharded, fits `gpu_bytes` each: 2, 4, 8, then whole
    nodes of 8 (or of `r`'s GPUs per node, when it spans several nodes). Bisection: each process's share
    only shrinks as processes are added. None: not even `most`. Sharded weights are full precision: a
    --quantize of `r` is left out (memory.PlanInputs refuses the two together)."""
    r = dataclasses.replace(r, quantize=None)
    sizes = world_sizes(r.per_node if r.nodes > 1 else 8, most)
    lo, hi, best = 0, len(sizes) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if plan_memory(dataclasses.replace(r, shard=True, world_size=sizes[mid], nodes=1)).fits(gpu_bytes):
            best, hi = sizes[mid], mid - 1
        else:
            lo = mid + 1
    return best

"""The `--plan` report: a memory plan (plan.py) as a table, checked against the GPU at hand or a given size.

`finetune_classifier --plan` comes here before anything is loaded: only the model's config is read.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import PRESETS, parse_dtype
from .lora import LoRASettings
from .plan import FP32, GiB, MemoryPlan, Recipe, plan_memory, smallest_world, with_margin
from .sources import config_of

SCRATCH_PRESETS = ("tiny",)  # presets with no published checkpoint: only ever trained from random weights


class PlanDoesNotFit(ValueError):
    """The planned run does not fit the GPU: `finetune_classifier --plan` exits 2, as for any bad input."""


def detect_gpu() -> tuple[str, int] | None:
    """(name, total memory in bytes) of the current CUDA device, or None without one. Reads properties only."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return props.name, props.total_memory


def _gib(n: int) -> str:
    return f"{n / GiB:9.2f} GiB"


def trained_text(r: Recipe) -> str:
    """What trains, in words: blocks, or LoRA adapters in them."""
    trained = "all blocks and the embedding" if r.train_last is None else f"last {r.train_last} block(s)"
    return trained if r.lora is None else f"LoRA rank {r.lora.rank} ({','.join(r.lora.targets)}) in the {trained}"


def format_plan(plan: MemoryPlan, gpu: tuple[str, int] | None = None) -> str:
    """A readable table: each part, the phases, the peak, and whether it fits `gpu` (name, bytes)."""
    r, c = plan.recipe, plan.counts
    s = r.param_dtype.itemsize
    dtype = str(r.param_dtype).removeprefix("torch.")
    trained = trained_text(r)
    state = f"AdamW moments in {dtype}" if r.optimizer_state == "param" or s == FP32 else "float32 master + moments"
    ckpt = ", gradient checkpointing" if r.gradient_checkpointing else ""
    adapters = c.total - c.backbone - c.head
    parts = f"{c.backbone:,} backbone + " + (f"{adapters:,} LoRA adapters + " if adapters else "") + f"{c.head:,} head"
    lines = [
        f"Memory plan per GPU: batch {r.batch_size} x {r.seq_len} tokens, train {trained}{ckpt}, {dtype}, "
        f"world size {r.world_size}"
        + (f" on {r.nodes} nodes ({r.per_node} each)" if r.nodes > 1 else "")
        + (f", sharded (FSDP2) across {r.shard_group or r.world_size}" if r.shard else ""),  # fmt: skip
        f"  parameters {c.total:,} ({parts}); training {c.trainable:,}",
        "",
        f"  {'part':<28}{'size':>13}   what",
    ]

    def row(name: str, n: int, what: str) -> None:
        lines.append(f"  {name:<28}{_gib(n)}   {what}")

    share = f" / {r.shard_group or r.world_size} processes" if r.shard else ""
    row("weights", plan.weights, f"{c.total:,} x {s} B{share} + rotary tables")
    row("optimizer state", plan.optimizer_state, f"{state}, {c.trainable:,} trained parameters{share}")
    row("gradients", plan.gradients, f"{c.trainable:,} x {s} B, {gradients_note(r, share)}")
    k = r.trained_blocks
    if k > 1:
        each = "inputs only" if r.gradient_checkpointing else f"{plan.block_activations / GiB:.2f} GiB each"
        what = f"{k - 1} full block(s) ({each}) + the last block ({plan.last_block_activations / GiB:.2f} GiB)"
    else:
        what = f"the last block, run at each row's last token ({plan.last_block_activations / GiB:.2f} GiB)"
    row("activations", plan.activations, f"saved for backward: {what if k else 'final norm and head'}")
    if r.gradient_checkpointing and plan.block_activations:
        row("  + recomputed block", plan.block_activations, "one block's saved tensors, rebuilt during backward")
    if plan.frozen_forward:
        frozen = r.cfg.n_layers - r.trained_blocks
        row("frozen forward temporaries", plan.frozen_forward, f"{frozen} frozen block(s) save nothing; one at a time")
    if plan.gathered:
        row("gathered, at most", plan.gathered, "whole blocks (computed + prefetched) and a block's whole gradient")
    what = "a checkpointed block runs like a frozen one" if r.gradient_checkpointing else "float32 rotary arithmetic"
    row("forward temporaries", plan.forward_work, f"beyond the saved tensors: {what}")
    row("backward temporaries", plan.backward_work, "gradients of one block's activations")
    if r.optimizer_state == "float32" and s < FP32:
        step_note = "float32 gradients for the masters"
    else:
        step_note = "fused AdamW: none" if r.device_type == "cuda" else "per-tensor AdamW"
    row("optimizer step temporaries", plan.step_work, step_note)
    lines.append("")
    persistent = plan.persistent
    for phase, n in plan.phases.items():
        mark = "  <- peak" if phase == plan.peak_phase else ""
        row(f"peak in {phase}", persistent + n, f"weights + state + {n / GiB:.2f} GiB{mark}")
    row("PEAK", plan.peak, "max_memory_allocated() should come out near this" if r.device_type == "cuda" else
        "bytes of live tensors (on CPU the allocator adds its own overhead)")  # fmt: skip
    nccl = f" + {plan.collectives / GiB:.2f} GiB (NCCL buffers, several GPUs)" if plan.collectives else ""
    row("needed", plan.required(), f"peak + 5% + 0.5 GiB (CUDA context, allocator fragmentation){nccl}")
    return "\n".join(lines + verdict_lines(plan, gpu))


def gradients_note(r: Recipe, share: str) -> str:
    if r.shard:
        return f"this process's rows{share}, reduce-scattered in float32"
    if r.world_size > 1:
        return "views of DDP's all-reduce buckets, kept between steps"
    return "kept while micro-batches accumulate" if r.grad_accum > 1 else "from backward to the optimizer step"


def verdict_lines(plan: MemoryPlan, gpu: tuple[str, int] | None) -> list[str]:
    """Whether the plan fits `gpu` (name, bytes); if not, what does not and what would (see advise)."""
    if gpu is None:
        return ["  no GPU detected: pass --gpu-memory GiB to check a fit"]
    name, total = gpu
    verdict = "FITS" if plan.fits(total) else "DOES NOT FIT"
    spare = (total - plan.required()) / GiB
    lines = [f"  {verdict} on {name} ({total / GiB:.1f} GiB): {spare:+.1f} GiB to spare"]
    if plan.recipe.shard:
        lines.append(fewest_line(plan.recipe, total))
    return lines if plan.fits(total) else lines + advice_lines(advise(plan, total))


def fewest_line(r: Recipe, gpu_bytes: int) -> str:
    """Sharded: the smallest world size at which this recipe fits `gpu_bytes` a process, and what each then needs."""
    n = smallest_world(r, gpu_bytes)
    if n is None:
        return f"  sharded, it fits {_size(gpu_bytes)} on no world size up to 1024 processes"
    each = _replan(r, {"world_size": n, "nodes": 1}).required()
    group = f" (shards of {r.shard_group})" if r.shard_group else ""
    return f"  smallest world size that fits, sharded{group}: {n} processes (GPUs), {_size(each)} each"


# --- when it does not fit: the first part that does not, and what fits instead -----------------------------------

STAGES = ("weights", "weights, state and gradients", "activations", "fits")  # in the order memory fills


@dataclass
class Advice:
    """Why a plan does not fit, and the options that do: each one re-planned and found to fit."""

    problem: str  # the first part that does not fit
    options: list[tuple[str, int]] = field(default_factory=list)  # (flags, GPU memory needed)
    closest: tuple[str, int] | None = None  # when no option fits: the best one tried
    note: str = ""


def _size(n: int) -> str:
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
    margin = "" if n > gpu_bytes else f", {_size(with_margin(n))} with the 5% + 0.5 GiB margin"
    return f"{what} ({_size(n)}{margin}) exceed the GPU's {_size(gpu_bytes)}"


def _flags(r: Recipe, changes: dict) -> str:
    """The command-line flags that turn recipe `r` into `r` with `changes` (unchanged fields say nothing)."""
    names = {"optimizer_state": "--optimizer-state", "train_last": "--train-last", "batch_size": "--batch-size"}
    names |= {"grad_accum": "--grad-accum", "seq_len": "--max-length"}
    flags = []
    for key, value in changes.items():
        if getattr(r, key) == value:
            continue
        if key == "gradient_checkpointing":
            flags.append("--gradient-checkpointing")
        elif key == "dtype":
            flags.append("--dtype " + str(value).removeprefix("torch."))
        else:
            flags.append(f"{names[key]} {value}")
    return " ".join(flags)


def _replan(r: Recipe, changes: dict) -> MemoryPlan:
    return plan_memory(dataclasses.replace(r, **changes))


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
    r = plan.recipe
    variants = [{}]
    if r.optimizer_state == "float32" and r.param_dtype.itemsize < FP32:
        variants.append({"optimizer_state": "param"})  # 12 bytes of state per trained parameter become 4 (bf16)
    if not r.gradient_checkpointing:
        variants.append({"gradient_checkpointing": True})
    as_asked = r.cfg.n_layers + 1 if r.train_last is None else r.train_last  # "all" trains the embedding too
    tried, most = [], -1
    for v in variants:
        n = as_asked if v and _replan(r, v).fits(gpu_bytes) else None
        if n is None:
            n = _largest(list(range(as_asked)), lambda k, v=v: _replan(r, {**v, "train_last": k}), gpu_bytes)
        changes = v if n == as_asked else {**v, "train_last": n or 0}
        if n is None or n > most:  # one that fits only if it trains more than the ones before
            tried.append((changes, _replan(r, changes)))
            most = max(most, -1 if n is None else n)
    return tried


def _smaller_activations(plan: MemoryPlan, gpu_bytes: int) -> list[tuple[dict, MemoryPlan]]:
    """Activations grow with the rows and tokens of a micro-batch: gradient checkpointing, or fewer rows per
    micro-batch (more micro-batches: the same rows per optimizer step), both if neither alone fits, and only then
    shorter texts."""
    r = plan.recipe
    rows = r.batch_size * r.grad_accum
    sizes = [b for b in range(1, r.batch_size) if rows % b == 0]
    ckpt = {} if r.gradient_checkpointing else {"gradient_checkpointing": True}
    tried = [(ckpt, _replan(r, ckpt))] if ckpt else []
    for v in [{}, ckpt] if ckpt else [{}]:
        if v and any(p.fits(gpu_bytes) for _, p in tried):
            break
        b = _largest(sizes, lambda b, v=v: _replan(r, {**v, "batch_size": b, "grad_accum": rows // b}), gpu_bytes)
        changes = {**v, "batch_size": b or 1, "grad_accum": rows // (b or 1)}
        tried.append((changes, _replan(r, changes)))
    if not any(p.fits(gpu_bytes) for _, p in tried):
        one_row = {**ckpt, "batch_size": 1, "grad_accum": rows}
        t = _largest(list(range(1, r.seq_len)), lambda t: _replan(r, {**one_row, "seq_len": t}), gpu_bytes)
        if t is not None:
            tried.append(({**one_row, "seq_len": t}, _replan(r, {**one_row, "seq_len": t})))
    return tried


def advise(plan: MemoryPlan, gpu_bytes: int) -> Advice:
    """Name the first part of the plan that does not fit on `gpu_bytes` and try only what shrinks that part,
    re-planning each option. When none fits but the best one gets past this part, go on to the next part."""
    r, stage = plan.recipe, misfit(plan, gpu_bytes)
    note = ""
    if stage == STAGES[0]:
        dtype = str(r.param_dtype).removeprefix("torch.")
        problem = _exceeds(f"the {dtype} weights alone", plan.weights, gpu_bytes)
        tried = [({"dtype": torch.bfloat16}, _replan(r, {"dtype": torch.bfloat16}))] if dtype == "float32" else []
        note = "no setting helps on one GPU or under DDP (a whole copy per GPU): shard it across GPUs (--shard)"
    elif stage == STAGES[1]:
        fixed = plan.persistent + plan.phases["optimizer step"]
        problem = _exceeds("the weights, optimizer state and gradients", fixed, gpu_bytes) + ", before activations"
        tried = _fewer_trained(plan, gpu_bytes)
    elif stage == STAGES[2]:
        problem = (
            f"the activations and temporaries of the {plan.peak_phase} ({_size(max(plan.phases.values()))}) on "
            f"top of the weights and optimizer state ({_size(plan.persistent)}): {_size(plan.required())} needed "
            f"with the margin, the GPU has {_size(gpu_bytes)}"
        )
        tried = _smaller_activations(plan, gpu_bytes)
    else:
        return Advice("nothing: it fits")
    tried = [(c, p) for c, p in tried if _flags(r, c)]
    options = [(_flags(r, c), p.required()) for c, p in tried if p.fits(gpu_bytes)]
    if stage in STAGES[:2] and (sharded := shard_option(plan, gpu_bytes)):
        options.append(sharded)
    if options or not tried:
        return Advice(problem, options, note="" if options else note)
    changes, best = min(tried, key=lambda t: t[1].required())
    flags = _flags(r, changes)
    if STAGES.index(misfit(best, gpu_bytes)) == STAGES.index(stage):  # this part does not fit whatever was tried
        return Advice(problem, closest=None if note else (flags, best.required()), note=note)
    rest = advise(best, gpu_bytes)  # this part fits now: what else does it take
    options = [(f"{flags} {f}", n) for f, n in rest.options]
    closest = (f"{flags} {rest.closest[0]}", rest.closest[1]) if rest.closest else (flags, best.required())
    return Advice(problem, options, None if options else closest, rest.note)


def shard_option(plan: MemoryPlan, gpu_bytes: int) -> tuple[str, int] | None:
    """Sharding as an option: the fewest GPUs over which `--shard` fits, as flags and the memory each then needs."""
    r = plan.recipe
    n = smallest_world(dataclasses.replace(r, shard_group=None), gpu_bytes)
    if r.shard and n is not None and n <= r.world_size:
        return None
    if n is None:
        return None
    sharded = _replan(r, {"shard": True, "world_size": n, "nodes": 1, "shard_group": None})
    return f"--shard on {n} GPUs (torchrun, {n} processes)", sharded.required()


def refuse_unfit_replica(r: Recipe, gpu: tuple[str, int], model_ref: str) -> None:
    """Before a DDP run loads anything: when a whole replica's weights, optimizer state and gradients cannot fit
    the GPU, stop with one line naming --shard (and the fewest GPUs it fits on), instead of running out of memory
    minutes later. Activations depend on the texts' length, not yet known here: those are left to --plan."""
    plan = plan_memory(r)
    if misfit(plan, gpu[1]) not in STAGES[:2]:
        return
    n = smallest_world(r, gpu[1])
    where = f" (planned to fit from {n} GPUs)" if n else ""
    raise PlanDoesNotFit(
        f"{model_ref}: every process would hold a whole replica (DDP), whose weights, optimizer state and gradients "
        f"need {_size(with_margin(plan.persistent + plan.phases['optimizer step']))}, more than {gpu[0]}'s "
        f"{_size(gpu[1])}: add --shard to share them out across the processes{where}; --plan shows the figures"
    )


def advice_lines(advice: Advice) -> list[str]:
    lines = [f"  the first part that does not fit: {advice.problem}"]
    if advice.options:
        lines.append("  what fits instead (each option re-planned):")
        lines += [f"    {flags:<62} needs {_size(n)}" for flags, n in advice.options]
        if any("--max-length" in flags for flags, _ in advice.options):
            lines.append("    (--max-length cuts each text to that many tokens)")
    elif advice.closest:
        flags, n = advice.closest
        lines.append(f"  nothing tried fits; the closest is {flags} (needs {_size(n)})")
    if advice.note:
        lines.append(f"  {advice.note}")
    return lines


# --- the command: finetune_classifier --plan -----------------------------------------------------------------------


def plans_from_scratch(model_ref: str) -> bool:
    """Whether `--plan` plans training from random weights. A preset named on --plan (llama3-8b) stands for its
    published checkpoint: a user plans the run they will make with its weights. Only 'tiny' has none."""
    return model_ref in SCRATCH_PRESETS and not Path(model_ref).exists()


def planned_dtype(arg: str, on_gpu: bool) -> torch.dtype:
    """`--dtype` as the run would choose it: `auto` is bfloat16 on a GPU that has it (or a GPU only planned for)."""
    if arg != "auto":
        return parse_dtype(arg)
    if on_gpu and (not torch.cuda.is_available() or torch.cuda.is_bf16_supported()):
        return torch.bfloat16
    return torch.float32


def plan_command(args, train_last: int | None, lora: LoRASettings | None = None) -> dict:
    """`python -m llama_scratch.finetune_classifier ... --plan`: print the plan for these arguments, load nothing.

    Reads only the model's config.json (or preset). `train_last` is what the command resolved `--train-last` to
    (None: everything; for a preset, what its checkpoint would train: see plans_from_scratch), `lora` its --lora
    flags (adapters in those blocks instead of their weights). The device and dtype
    follow the command's `auto` choices, except that `--gpu-memory` means "plan for a GPU" on a machine without one
    (bfloat16, fused AdamW). Raises PlanDoesNotFit, after printing, when the plan does not fit the GPU.
    """
    gpu = detect_gpu()
    if args.gpu_memory is not None:
        gpu = (gpu[0] if gpu else "the given GPU", int(args.gpu_memory * GiB))
    on_gpu = args.device.startswith("cuda") or (args.device == "auto" and gpu is not None)
    dtype = planned_dtype(args.dtype, on_gpu)
    model_ref = args.model
    preset = model_ref in PRESETS and not Path(model_ref).exists() and not plans_from_scratch(model_ref)
    notes = []
    if args.max_length is None:
        notes.append("no --max-length given: planned for 512 tokens a text (a batch holds at most batch size x that)")
    if preset:
        notes.append(
            f"--model {model_ref} alone trains the preset's random weights (all blocks by default); to train the real "
            "checkpoint, download it and pass its directory as --model"
        )
    recipe = Recipe(
        cfg=config_of(model_ref),
        batch_size=args.batch_size,
        seq_len=args.max_length or 512,
        train_last=train_last,
        dtype=dtype,
        optimizer_state=args.optimizer_state,
        gradient_checkpointing=args.gradient_checkpointing,
        world_size=args.world_size or int(os.environ.get("WORLD_SIZE", 1)),
        nodes=getattr(args, "nodes", None) or 1,
        shard=args.shard,
        shard_group=args.shard_group,
        grad_accum=args.grad_accum,
        device_type="cuda" if on_gpu else "cpu",
        lora=lora,
    )
    plan = plan_memory(recipe)
    cache = getattr(args, "cache_frozen", "off")  # the frozen-prefix cache (prefix_cache.py)
    if cache != "off" and recipe.train_last is not None and recipe.train_last < recipe.cfg.n_layers:
        per_token = recipe.cfg.dim * dtype.itemsize
        notes.append(
            f"--cache-frozen {cache} adds {per_token / 1024:.0f} KiB per token of the data set, kept on the device; "
            "the frozen forward then runs once, up front"
        )
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"model {model_ref}")
        if preset and args.train_last is None:
            shown = "all" if train_last is None else train_last
            print(f"planning {model_ref} as a pretrained checkpoint: --train-last {shown} (the default for pretrained "
                  "weights)")  # fmt: skip
        print(format_plan(plan, gpu if on_gpu else None))
        for note in notes:
            print(f"  note: {note}")
    if on_gpu and gpu is not None and not plan.fits(gpu[1]):
        raise PlanDoesNotFit(f"the plan needs {_size(plan.required())}, more than {gpu[0]}'s {_size(gpu[1])}")
    return plan.as_dict()

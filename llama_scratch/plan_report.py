"""The `--plan` report: a memory plan (plan.py) as a table, checked against the GPU at hand or a given size.

`finetune_classifier --plan` comes here before anything is loaded: only the model's config is read.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .config import PRESETS, parse_dtype
from .lora import LoRASettings
from .plan import FP32, GiB, MemoryPlan, Recipe, plan_memory, with_margin
from .plan_advice import STAGES, advice_lines, advise, in_gib, misfit, replan, smallest_world
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
        step_note = "per-tensor AdamW (sharded parameters)" if r.shard else "fused AdamW: none"
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
        return f"  sharded, it fits {in_gib(gpu_bytes)} on no world size up to 1024 processes"
    each = replan(r, {"world_size": n, "nodes": 1}).required()
    group = f" (shards of {r.shard_group})" if r.shard_group else ""
    return f"  smallest world size that fits, sharded{group}: {n} processes (GPUs), {in_gib(each)} each"


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
        f"need {in_gib(with_margin(plan.persistent + plan.phases['optimizer step']))}, more than {gpu[0]}'s "
        f"{in_gib(gpu[1])}: add --shard to share them out across the processes{where}; --plan shows the figures"
    )


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
        raise PlanDoesNotFit(f"the plan needs {in_gib(plan.required())}, more than {gpu[0]}'s {in_gib(gpu[1])}")
    return plan.as_dict()

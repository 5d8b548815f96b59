"""The `--plan` report: a memory plan (plan.py) as a table, checked against the GPU at hand or a given size.

`finetune_classifier --plan` comes here before anything is loaded: only the model's config is read.

A plan is for the GPU a run will have, which is rarely the machine that plans it: without `--device cpu` it plans
for a GPU, in bfloat16 under `--dtype auto`, whether or not this machine has one, and says what it assumed. It
checks the fit against the detected GPU's memory or `--gpu-memory`; with neither, it says it checked nothing and
exits 0 (2 is kept for "does not fit", where there is a memory to fit).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..model.config import PRESETS, LlamaConfig, parse_dtype
from ..model.lora import LoRASettings
from .advice import STAGES, advice_lines, advise, in_gib, misfit, replan, smallest_world
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


def trained_text(r: PlanInputs) -> str:
    """What trains, in words: blocks, or LoRA adapters in them."""
    trained = "all blocks and the embedding" if r.train_last is None else f"last {r.train_last} block(s)"
    return trained if r.lora is None else f"LoRA rank {r.lora.rank} ({','.join(r.lora.targets)}) in the {trained}"


def plan_heading(plan: MemoryPlan) -> list[str]:
    """The plan's first lines: the inputs it was made for, and the parameters counted."""
    r, c = plan.inputs, plan.counts
    dtype = str(r.param_dtype).removeprefix("torch.")
    ckpt = ", gradient checkpointing" if r.gradient_checkpointing else ""
    adapters = c.total - c.backbone - c.head
    parts = f"{c.backbone:,} backbone + " + (f"{adapters:,} LoRA adapters + " if adapters else "") + f"{c.head:,} head"
    per = "GPU" if r.device_type == "cuda" else "process (CPU)"
    quantized = f", weights: {QUANTIZE[r.quantize]} (frozen base)" if r.quantize else ""
    return [
        f"Memory plan per {per}: batch {batch_text(r)}, train {trained_text(r)}{ckpt}, {dtype}"
        f"{quantized}, world size {r.world_size}"
        + (f" on {r.nodes} nodes ({r.per_node} each)" if r.nodes > 1 else "")
        + (f", sharded (FSDP2) across {r.shard_group or r.world_size}" if r.shard else ""),
        f"  parameters {c.total:,} ({parts}); training {c.trainable:,}",
        "",
        f"  {'part':<28}{'size':>13}   what",
    ]


def batch_text(r: PlanInputs) -> str:
    """A micro-batch as planned: rows x tokens, or (a token budget) its real tokens and the texts attention pads."""
    if r.tokens is None:
        return f"{r.batch_size} x {r.seq_len} tokens"
    return f"{r.tokens:,} tokens packed ({r.batch_size} texts of up to {r.seq_len} inside attention)"


def format_plan(plan: MemoryPlan, gpu: tuple[str, int] | None = None) -> str:
    """A readable table: each part, the phases, the peak, and whether it fits `gpu` (name, bytes)."""
    r, c = plan.inputs, plan.counts
    s = r.param_dtype.itemsize
    dtype = str(r.param_dtype).removeprefix("torch.")
    state = f"AdamW moments in {dtype}" if r.optimizer_state == "param" or s == FP32 else "float32 master + moments"
    lines = plan_heading(plan)

    def row(name: str, n: int, what: str) -> None:
        lines.append(f"  {name:<28}{_gib(n)}   {what}")

    share = f" / {r.shard_group or r.world_size} processes" if r.shard else ""
    for name, n, what in weights_rows(plan, share):
        row(name, n, what)
    row("optimizer state", plan.optimizer_state, f"{state}, {c.trainable:,} trained parameters{share}")
    row("gradients", plan.gradients, f"{c.trainable:,} x {s} B, {gradients_note(r, share)}")
    k, full = r.trained_blocks, r.full_blocks
    each = "inputs only" if r.gradient_checkpointing else f"{plan.block_activations / GiB:.2f} GiB each"
    if r.pooling == "mean":  # the head reads every token, so every trained block runs at every token
        each += ", the top one whole" if r.checkpointed_blocks < full and r.gradient_checkpointing else ""
        what = f"{k} full block(s) ({each}), the final norm at every token (--pooling mean)"
    elif full:
        what = f"{full} full block(s) ({each}) + the last block ({plan.last_block_activations / GiB:.2f} GiB)"
    else:
        what = f"the last block, run at each row's last token ({plan.last_block_activations / GiB:.2f} GiB)"
    row("activations", plan.activations, f"saved for backward: {what if k else 'final norm and head'}")
    if r.checkpointed_blocks:
        row("  + recomputed block", plan.block_activations, "one block's saved tensors, rebuilt during backward")
    if plan.frozen_forward:
        frozen = r.cfg.n_layers - r.trained_blocks
        row("frozen forward temporaries", plan.frozen_forward, f"{frozen} frozen block(s) save nothing; one at a time")
    if plan.dequantized:
        row(
            "dequantizing", plan.dequantized, f"the largest frozen linear to {dtype} and its temporaries, one at a time"
        )
    if plan.gathered:
        row("gathered, at most", plan.gathered, "whole blocks (computed + prefetched) and a block's whole gradient")
    what = "a checkpointed block runs like a frozen one" if r.gradient_checkpointing else "float32 rotary arithmetic"
    row("forward temporaries", plan.forward_work, f"beyond the saved tensors: {what}")
    row("backward temporaries", plan.backward_work, "gradients of one block's activations")
    if r.optimizer_state == "float32" and s < FP32:
        step_note = "float32 gradients for the masters"
    else:
        step_note = "foreach AdamW's sqrt(v) (sharded parameters)" if r.shard else "fused AdamW: none"
    row("optimizer step temporaries", plan.step_work, step_note)
    lines.append("")
    persistent = plan.persistent
    for phase, n in plan.phases.items():
        mark = "  <- peak" if phase == plan.peak_phase else ""
        row(f"peak in {phase}", persistent + n, f"weights + state + {n / GiB:.2f} GiB{mark}")
    row(
        "PEAK",
        plan.peak,
        "max_memory_allocated() should come out near this"
        if r.device_type == "cuda"
        else "bytes of live tensors (on CPU the allocator adds its own overhead)",
    )
    nccl = f" + {plan.collectives / GiB:.2f} GiB (NCCL buffers, several GPUs)" if plan.collectives else ""
    row("needed", plan.required(), f"peak + 5% + 0.5 GiB (CUDA context, allocator fragmentation){nccl}")
    return "\n".join(lines + verdict_lines(plan, gpu))


def weights_rows(plan: MemoryPlan, share: str) -> list[tuple[str, int, str]]:
    """The table's weights row, and with --quantize the part of it held quantized."""
    r, c, s = plan.inputs, plan.counts, plan.inputs.param_dtype.itemsize
    if not r.quantize:
        return [("weights", plan.weights, f"{c.total:,} x {s} B{share} + rotary tables")]
    n, kind = sum(o * i for o, i in c.frozen_linears), QUANTIZE[r.quantize]
    layout = f"4-bit codes + a float32 scale per {NF4_BLOCK} weights" if r.quantize == "nf4" else ""
    layout = layout or "a byte per weight + a float32 scale per output row"
    return [
        ("weights", plan.weights, f"{c.total - n:,} x {s} B + {n:,} in {kind} + rotary tables"),
        (f"  of which {kind}", plan.quantized, f"the frozen linear weights: {layout}"),
    ]


def gradients_note(r: PlanInputs, share: str) -> str:
    if r.shard:
        return f"this process's rows{share}, reduce-scattered in float32"
    if r.world_size > 1:  # distributed.float32_all_reduce: low-precision buckets are averaged in float32
        reduced = "all-reduced in float32" if r.param_dtype.itemsize < FP32 else "all-reduced"
        return f"views of DDP's all-reduce buckets, kept between steps, {reduced}"
    return "kept while micro-batches accumulate" if r.grad_accum > 1 else "from backward to the optimizer step"


def verdict_lines(plan: MemoryPlan, gpu: tuple[str, int] | None) -> list[str]:
    """Whether the plan fits `gpu` (name, bytes); if not, what does not and what would (see advise)."""
    if gpu is None:
        if plan.inputs.device_type == "cpu":
            return ["  planned for the CPU (--device cpu): not checked against its memory"]
        dtype = str(plan.inputs.param_dtype).removeprefix("torch.")
        check = "give --gpu-memory GiB to check a card"
        return [f"  not checked: no GPU here and no --gpu-memory; planned for a {dtype} GPU ({check})"]
    name, total = gpu
    verdict = "FITS" if plan.fits(total) else "DOES NOT FIT"
    spare = (total - plan.required()) / GiB
    lines = [f"  {verdict} on {name} ({total / GiB:.1f} GiB): {spare:+.1f} GiB to spare"]
    if plan.inputs.shard:
        lines.append(fewest_line(plan.inputs, total))
    return lines if plan.fits(total) else lines + advice_lines(advise(plan, total))


def fewest_line(r: PlanInputs, gpu_bytes: int) -> str:
    """Sharded: the smallest world size at which a run of `r` fits `gpu_bytes` a process, and what each then needs."""
    n = smallest_world(r, gpu_bytes)
    if n is None:
        return f"  sharded, it fits {in_gib(gpu_bytes)} on no world size up to 1024 processes"
    each = replan(r, {"world_size": n, "nodes": 1}).required()
    group = f" (shards of {r.shard_group})" if r.shard_group else ""
    return f"  smallest world size that fits, sharded{group}: {n} processes (GPUs), {in_gib(each)} each"


def refuse_unfit_replica(r: PlanInputs, gpu: tuple[str, int], model_ref: str) -> None:
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


def model_line(model_ref: str, train_last_arg: str | None, train_last: int | None) -> str:
    """The report's first line: the model, and for a preset how the plan reads it. One story: a preset with a
    published checkpoint (llama3-8b) is planned as that checkpoint (Meta's shapes, trained as pretrained weights
    are), the run a plan is usually made for; `--model llama3-8b` without --plan would draw random weights instead,
    so the line says what a run of this plan takes."""
    if plans_from_scratch(model_ref):
        return f"model {model_ref}, from random weights (it has no published checkpoint)"
    if model_ref not in PRESETS or Path(model_ref).exists():
        return f"model {model_ref}"
    shown = "all" if train_last is None else train_last
    default = f": --train-last {shown}, the default for pretrained weights" if train_last_arg is None else ""
    return (
        f"model {model_ref}, planned as its pretrained checkpoint (the same shapes){default}; a run of this plan "
        "takes that checkpoint's directory as --model"
    )


def planned_device(device: str, gpu_memory: float | None) -> tuple[bool, tuple[str, int] | None, str]:
    """What the plan is for: (a GPU?, the (name, bytes) to check it against, both in words). A GPU unless
    `--device cpu`: a plan is for the machine a run will have, which is rarely the one that plans it. The memory
    is `--gpu-memory`'s, else the detected GPU's, else none (nothing to check against)."""
    detected = detect_gpu()
    if device.startswith("cpu"):
        if gpu_memory is not None:
            raise ValueError("--gpu-memory checks a plan for a GPU, and --device cpu plans for this machine's CPU")
        return False, None, "this machine's CPU (--device cpu)"
    if gpu_memory is not None:
        gpu = (detected[0] if detected else "the given GPU", int(gpu_memory * GiB))
        name = detected[0] if detected else "a GPU"
        return True, gpu, f"{name} with {in_gib(gpu[1])} (--gpu-memory)"
    if detected:
        return True, detected, f"{detected[0]} ({in_gib(detected[1])}, detected)"
    return True, None, "a GPU (none here: give --gpu-memory GiB to check a card)"


def planned_dtype(arg: str, on_gpu: bool) -> tuple[torch.dtype, str]:
    """`--dtype` as a run on the planned device would choose it, and why in words: `auto` is bfloat16 on a GPU
    that computes it natively (devices.choose_dtype), or on a GPU only planned for; float32 on a CPU, or on a
    detected GPU without native bfloat16."""
    if arg != "auto":
        return parse_dtype(arg), f"--dtype {arg}"
    if not on_gpu:
        return torch.float32, "--dtype auto on a CPU"
    if detect_gpu() is None or torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.bfloat16, "--dtype auto on a GPU; --dtype float32 to plan that"
    return torch.float32, "--dtype auto: this GPU does not compute bfloat16 natively"


def plan_command(settings, cfg: LlamaConfig, train_last: int | None, lora: LoRASettings | None = None) -> dict:
    """`python -m llama_scratch.finetune_classifier ... --plan`: print the plan for these settings, load nothing.

    `settings` is the command's `FinetuneSettings` (finetune_settings.py; this layer reads its fields and imports
    nothing of the command).
    `cfg` is the model's config, which the command read (`sources.config_of`: a preset, or a config.json alone).
    `train_last` is what the command resolved `--train-last` to
    (None: everything; for a preset, what its checkpoint would train: see plans_from_scratch), `lora` its --lora
    flags (adapters in those blocks instead of their weights). The device and dtype are a GPU's (planned_device,
    planned_dtype) and printed as the plan's assumption. Raises PlanDoesNotFit, after printing, when the plan does
    not fit the memory it is checked against; with none known it returns, having said so.
    """
    recipe, compute, parallel, asked = settings.recipe, settings.compute, settings.parallel, settings.plan
    on_gpu, gpu, device_words = planned_device(settings.model.device, asked.gpu_memory)
    dtype, dtype_words = planned_dtype(settings.model.dtype, on_gpu)
    model_ref = settings.model.ref
    notes = []
    if settings.data.max_length is None:
        notes.append("no --max-length given: planned for 512 tokens a text (a batch holds at most batch size x that)")
    seq_len = settings.data.max_length or 512
    budget = recipe.batch_tokens
    rows = planned_rows(recipe.batch_size, budget, seq_len)
    if budget is not None:
        notes.append(
            f"--batch-tokens {budget}: planned as {planned_tokens(budget, seq_len):,} tokens a batch, padded inside "
            f"attention to {rows} texts of {seq_len} (a batch is cut so that its texts x its longest stay within the "
            "budget too)"
        )
    inputs = PlanInputs(
        cfg=cfg,
        batch_size=rows,
        seq_len=seq_len,
        tokens=planned_tokens(budget, seq_len),
        train_last=train_last,
        dtype=dtype,
        optimizer_state=compute.optimizer_state,
        gradient_checkpointing=compute.gradient_checkpointing,
        world_size=asked.world_size or int(os.environ.get("WORLD_SIZE", 1)),
        nodes=asked.nodes or 1,
        shard=parallel.shard,
        shard_group=parallel.shard_group,
        grad_accum=recipe.grad_accum,
        device_type="cuda" if on_gpu else "cpu",
        lora=lora,
        quantize=compute.quantize,
        pooling=recipe.pooling,
    )
    plan = plan_memory(inputs)
    cache = compute.cache_frozen  # the frozen-prefix cache (prefix_cache.py)
    if cache != "off" and inputs.train_last is not None and inputs.train_last < inputs.cfg.n_layers:
        per_token = inputs.cfg.dim * dtype.itemsize
        notes.append(
            f"--cache-frozen {cache} adds {per_token / 1024:.0f} KiB per token of the data set, kept on the device; "
            "the frozen forward then runs once, up front"
        )
    if int(os.environ.get("RANK", 0)) == 0:
        print(model_line(model_ref, recipe.train_last, train_last))
        print(f"planned for {device_words}, in {str(dtype).removeprefix('torch.')} ({dtype_words})")
        print(format_plan(plan, gpu))
        for note in notes:
            print(f"  note: {note}")
    if gpu is not None and not plan.fits(gpu[1]):
        raise PlanDoesNotFit(f"the plan needs {in_gib(plan.required())}, more than {gpu[0]}'s {in_gib(gpu[1])}")
    return plan.as_dict()

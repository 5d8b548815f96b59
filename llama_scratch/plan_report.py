"""The `--plan` report: a memory plan (plan.py) as a table, checked against the GPU at hand or a given size.

`finetune_classifier --plan` comes here before anything is loaded: only the model's config is read.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .config import PRESETS, LlamaConfig, parse_dtype
from .plan import FP32, GiB, MemoryPlan, Recipe, plan_memory

SCRATCH_PRESETS = ("tiny",)  # presets with no published checkpoint: only ever trained from random weights


def detect_gpu() -> tuple[str, int] | None:
    """(name, total memory in bytes) of the current CUDA device, or None without one. Reads properties only."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return props.name, props.total_memory


def _gib(n: int) -> str:
    return f"{n / GiB:9.2f} GiB"


def format_plan(plan: MemoryPlan, gpu: tuple[str, int] | None = None) -> str:
    """A readable table: each part, the phases, the peak, and whether it fits `gpu` (name, bytes)."""
    r, c = plan.recipe, plan.counts
    s = r.param_dtype.itemsize
    dtype = str(r.param_dtype).removeprefix("torch.")
    trained = "all blocks and the embedding" if r.train_last is None else f"last {r.train_last} block(s)"
    state = f"AdamW moments in {dtype}" if r.optimizer_state == "param" or s == FP32 else "float32 master + moments"
    ckpt = ", gradient checkpointing" if r.gradient_checkpointing else ""
    lines = [
        f"Memory plan per GPU: batch {r.batch_size} x {r.seq_len} tokens, train {trained}{ckpt}, {dtype}, "
        f"world size {r.world_size}",
        f"  parameters {c.total:,} ({c.backbone:,} backbone + {c.head:,} head); training {c.trainable:,}",
        "",
        f"  {'part':<28}{'size':>13}   what",
    ]

    def row(name: str, n: int, what: str) -> None:
        lines.append(f"  {name:<28}{_gib(n)}   {what}")

    row("weights", plan.weights, f"{c.total:,} x {s} B + rotary tables")
    row("optimizer state", plan.optimizer_state, f"{state}, {c.trainable:,} trained parameters")
    if r.world_size > 1:
        kept = "views of DDP's all-reduce buckets, kept between steps"
    elif r.grad_accum > 1:
        kept = "kept while micro-batches accumulate"
    else:
        kept = "from backward to the optimizer step"
    row("gradients", plan.gradients, f"{c.trainable:,} x {s} B, {kept}")
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
    row("needed", plan.required(), "peak + 5% + 0.5 GiB (CUDA context, allocator fragmentation)")
    if gpu is None:
        lines.append("  no GPU detected: pass --gpu-memory GiB to check a fit")
    else:
        name, total = gpu
        verdict = "FITS" if plan.fits(total) else "DOES NOT FIT"
        spare = (total - plan.required()) / GiB
        lines.append(f"  {verdict} on {name} ({total / GiB:.1f} GiB): {spare:+.1f} GiB to spare")
        if not plan.fits(total):
            lines.append(
                "  to shrink it: --gradient-checkpointing, a smaller --batch-size (with --grad-accum), fewer "
                "--train-last blocks, --optimizer-state param"
            )
    return "\n".join(lines)


# --- the command: finetune_classifier --plan -----------------------------------------------------------------------


def config_for(model_ref: str) -> LlamaConfig:
    """The config of a preset, a local checkpoint (directory or file) or a Hugging Face repo (config.json only)."""
    path = Path(model_ref)
    if model_ref in PRESETS and not path.exists():
        return LlamaConfig.from_name(model_ref)
    if path.exists():
        return LlamaConfig.from_hf(path if path.is_dir() else path.parent)
    from huggingface_hub import hf_hub_download

    try:
        return LlamaConfig.from_hf(hf_hub_download(model_ref, "config.json"))
    except Exception as e:  # offline, gated, misspelt: all end the same way for a plan
        raise FileNotFoundError(
            f"--model {model_ref}: not a preset or a local checkpoint, and its config.json could not be fetched "
            f"({type(e).__name__}: {e})"
        ) from None


def plans_from_scratch(model_ref: str) -> bool:
    """Whether `--plan` plans training from random weights. A preset named on --plan (llama3-8b) stands for its
    published checkpoint: a user plans the run they will make with its weights. Only 'tiny' has none."""
    return model_ref in SCRATCH_PRESETS and not Path(model_ref).exists()


def plan_command(args, train_last: int | None) -> dict:
    """`python -m llama_scratch.finetune_classifier ... --plan`: print the plan for these arguments, load nothing.

    Reads only the model's config.json (or preset). `train_last` is what the command resolved `--train-last` to
    (None: everything; for a preset, what its checkpoint would train: see plans_from_scratch). The device and dtype
    follow the command's `auto` choices, except that `--gpu-memory` means "plan for a GPU" on a machine without one
    (bfloat16, fused AdamW).
    """
    gpu = detect_gpu()
    if args.gpu_memory is not None:
        gpu = (gpu[0] if gpu else "the given GPU", int(args.gpu_memory * GiB))
    on_gpu = args.device.startswith("cuda") or (args.device == "auto" and gpu is not None)
    if args.dtype != "auto":
        dtype = parse_dtype(args.dtype)
    elif on_gpu and (not torch.cuda.is_available() or torch.cuda.is_bf16_supported()):
        dtype = torch.bfloat16
    else:
        dtype = torch.float32
    model_ref = args.model
    preset = model_ref in PRESETS and not Path(model_ref).exists() and not plans_from_scratch(model_ref)
    notes = []
    if args.max_length is None:
        notes.append("no --max-length given: planned for 512 tokens (training pads each batch to its longest text)")
    if preset:
        notes.append(
            f"--model {model_ref} alone trains the preset's random weights (all blocks by default); to train the real "
            "checkpoint, download it and pass its directory as --model"
        )
    recipe = Recipe(
        cfg=config_for(model_ref),
        batch_size=args.batch_size,
        seq_len=args.max_length or 512,
        train_last=train_last,
        dtype=dtype,
        optimizer_state=args.optimizer_state,
        gradient_checkpointing=args.gradient_checkpointing,
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        grad_accum=args.grad_accum,
        device_type="cuda" if on_gpu else "cpu",
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
    return plan.as_dict()

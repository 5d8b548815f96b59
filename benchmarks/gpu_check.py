"""The lent GPU's check: load memory, and the real training path's speed, syncs, attention kernel and memory.

    python benchmarks/gpu_check.py --out DIR                   # on a GPU: 8B-shaped and SmolLM2-shaped checkpoints
    python benchmarks/gpu_check.py --device cpu --quick --out DIR   # the same code on tiny shapes, in seconds

Offline, from the tracked tree alone: it writes what it needs under --dir (random-weight checkpoints in Hugging Face
layout, as gpu_8b.py writes them, each with a byte-level tokenizer: 256 byte tokens and Llama-3's specials, so every
text is its UTF-8 bytes, about 4x the tokens Llama-3's own tokenizer makes of it).

1. The streaming load (gpu_8b.measure_load) of the first recipe's checkpoint: peak max_memory_allocated over the
   checkpoint's bytes, and seconds.
2. Each recipe (RECIPES, one row each: finetune_classifier's own flags) runs what `finetune_classifier` runs, by its
   own functions: the bundled SMS data read and split (`read_data`), the model chosen and loaded (`choose_model`,
   `build_classifier`), tokenized (`tokenize`), the frozen-prefix cache (`use_cache`, `cache_splits`), the training
   settings (`train_settings`: packed batches, the default optimizer state), then the loop's own `train_epoch`
   stopped after a number of optimizer steps: warm-up steps (the first's loss kept, the last profiled for the
   attention backend, common.attention_backends), then --steps timed ones (tokens/s, MFU on gpu_8b.model_flops,
   host syncs counted by torch.cuda.set_sync_debug_mode("warn"), the last step's loss). Peak memory over all the
   steps is set beside `plan_memory`'s for the same run. Only evaluation and the output files are left out.
3. The peer (benchmarks/peer_step.py, unless --no-peer): after each recipe, transformers'
   `LlamaForSequenceClassification` (+ PEFT for LoRA) in a process of its own, on the same checkpoint, the same
   micro-batches (the rows of our timed steps), the same head's starting weights and the same trained parameters,
   timed the same way: `peer_tokens_per_s`, `ratio_vs_peer` (ours over the peer's), `peer_peak_gib`, and the first
   step's loss on both sides (equal but for rounding). Kernel launches per step (`launches_per_step`, the profiler's
   device events in one step) on both sides.
4. An end-to-end row (`epochs` in RECIPES; run when named with --recipes, and always under --quick): the recipe
   trained for whole epochs on --e2e-texts distinct texts (20,000 by default). Ours' `e2e_seconds` is two clocks
   summed: the frozen-prefix cache's pass (which also covers the few held-out texts) and every training step from
   the first (no warm-up left out, no evaluation); loading, tokenizing and the optimizer's construction are left
   out on both sides. The peer is timed over every step of the same epochs (`peer_e2e_seconds`). The tokens are
   the same on both sides, so `ratio_vs_peer` (and `train_tokens_per_s`, over `e2e_seconds` on this row) is the
   end-to-end speed-up. A peer that runs out of --peer-timeout leaves a lower bound (`ratio_vs_peer_at_least`).
5. DIR/gpu_check.json (rewritten after ours and after the peer, so a timeout still leaves what ran) and
   DIR/gpu_check.md (also printed). A recipe that fails (out of memory, say) is reported with its error and the
   next one runs; the exit status is 1 only if none ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

# Runnable from a fresh clone: this folder (common.py, gpu_8b.py) and the repository are importable.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import GiB, attention_backends  # noqa: E402
from gpu_8b import ensure_checkpoint, measure_load, model_flops, peak_tflops, sync  # noqa: E402

from llama_scratch import LlamaConfig  # noqa: E402
from llama_scratch.finetune_classifier import (  # noqa: E402
    build_classifier,
    choose_model,
    compile_token_wise,
    replica_plan_inputs,
    train_settings,
)
from llama_scratch.finetune_data import read_data, tokenize  # noqa: E402
from llama_scratch.finetune_job import Job  # noqa: E402
from llama_scratch.finetune_settings import parse_args as finetune_settings  # noqa: E402
from llama_scratch.parallel.strategy import Strategy, choose_strategy  # noqa: E402
from llama_scratch.planning.memory import MemoryPlan, plan_memory  # noqa: E402
from llama_scratch.training.loop import (  # noqa: E402
    Loop,
    TrainState,
    lr_factor,
    make_optimizer,
    train_epoch,
)
from llama_scratch.training.prefix_cache import cache_bytes, cache_splits, distinct_texts, use_cache  # noqa: E402
from llama_scratch.training.resume_points import RESUME_FILE  # noqa: E402
from llama_scratch.training.steps import check_enough_data, epoch_plan  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One line of the check: a model shape (a key of SHAPES) and finetune_classifier's flags for it."""

    name: str
    shape: str
    flags: tuple[str, ...]
    batch_tokens: int | None = None  # --batch-tokens on a GPU (QUICK_BATCH_TOKENS under --quick); None: --batch-size
    # Whole epochs end to end on --e2e-texts distinct texts (the cache and every step timed), not timed steps.
    epochs: int | None = None
    # In the run without --recipes on a GPU. An end-to-end row takes minutes there: run on its own (--recipes NAME).
    # --quick runs every row.
    default: bool = True


RECIPES = [
    Recipe("8b-last2", "8b", ("--train-last", "2")),
    Recipe("8b-lora8", "8b", ("--lora", "8")),  # default targets, in the default 2 trained blocks
    Recipe("small-all", "small", ("--train-last", "all")),
    Recipe("8b-nf4-lora8", "8b", ("--lora", "8", "--quantize", "nf4")),  # QLoRA: the frozen base in 4 bits
    # LoRA in every block: no frozen prefix to cache, every step runs the whole model, at a budget of tokens.
    Recipe("8b-lora8-all-8k", "8b", ("--lora", "8", "--train-last", "all"), batch_tokens=8192),
    Recipe("small-all-8k", "small", ("--train-last", "all"), batch_tokens=8192),
    # The default recipe end to end: three epochs of 20,000 texts, the frozen-prefix cache's one pass included,
    # against the peer running the frozen blocks in every step of the three epochs.
    Recipe("8b-last2-3epochs", "8b", ("--train-last", "2"), batch_tokens=8192, epochs=3, default=False),
]
E2E_TEXTS = (20_000, 120)  # --e2e-texts' default (on a GPU, under --quick)
E2E_HELD_OUT = (100, 20)  # validation and test texts each, beside them (on a GPU, under --quick)
QUICK_BATCH_TOKENS = 512  # the tiny shapes' budget: a few texts a batch, as 8,192 tokens are dozens on a GPU
PROFILE_STEPS = 3  # --profile: optimizer steps recorded by torch.profiler after the timed ones

# Each shape as (on a GPU, under --quick). "small" is SmolLM2-135M's, the default job's model; --quick's stand-in
# is a few blocks (one frozen below two trained, so the cache runs) and just the 512 ids the tokenizer makes.
QUICK = LlamaConfig(
    vocab_size=512, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=2048, dtype=torch.float32
)
SMOLLM2_135M = LlamaConfig(
    vocab_size=49_152,
    dim=576,
    n_layers=30,
    n_heads=9,
    n_kv_heads=3,
    ffn_dim=1536,
    rope_theta=100_000.0,
    max_seq_len=8192,
    tie_embeddings=True,
    dtype=torch.bfloat16,
)
SHAPES = {"8b": (LlamaConfig.from_name("llama3-8b", dtype=torch.bfloat16), QUICK), "small": (SMOLLM2_135M, QUICK)}

# Every recipe's entry holds these keys (null where a figure needs a GPU, or where the recipe failed).
RECIPE_KEYS = (
    "batch_tokens",
    "train_tokens_per_s",
    "mfu",
    "syncs_per_step",
    "sdpa_backend",
    "loss_first",
    "loss_last",
    "plan_peak_gib",
    "measured_peak_gib",
    "load_peak_over_checkpoint",
    "launches_per_step",
    "peer_tokens_per_s",
    "ratio_vs_peer",
    "peer_peak_gib",
    "epochs",  # an end-to-end row's (null for a row of timed steps)
    "e2e_seconds",  # ours end to end: the cache's pass and every step of the epochs (timed_seconds: the steps)
    "peer_e2e_seconds",  # the peer's: every step of the epochs
)

STARTED = time.perf_counter()


class NoBars(io.TextIOBase):
    """stderr without progress bars: the package's bars (loading, caching, each epoch) would fill the last 12,000
    characters, all the device sends back. A bar redraws itself with a carriage return; warnings and tracebacks
    pass."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        if "\r" not in text:
            self.stream.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def log(*parts) -> None:
    """A progress line with the time and the seconds since start: a cut-off output tail still says what happened."""
    stamp = f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - STARTED:6.1f}s]"
    print(stamp, *parts, file=sys.stderr, flush=True)


def byte_tokenizer(directory: Path) -> None:
    """A tiktoken `tokenizer.model` of the 256 single bytes (rank = byte value): Tokenizer adds Llama-3's 256
    special tokens after them, so ids stay below 512 and every text tokenizes, with no download."""
    import base64

    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    (directory / "tokenizer.model").write_text("\n".join(lines) + "\n")


def checkpoint_for(cfg: LlamaConfig, root: Path) -> Path:
    """A random checkpoint of `cfg` with the byte tokenizer, reused if a complete one of that shape is there."""
    directory = root / f"ckpt-{cfg.n_layers}x{cfg.dim}-{cfg.vocab_size}-{str(cfg.dtype).removeprefix('torch.')}"
    ensure_checkpoint(cfg, directory)
    byte_tokenizer(directory)
    return directory


def free(device: torch.device) -> None:
    """Give back what the last recipe left: its tensors are gone with its frames, the allocator's cache is not."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def step_flops(cfg: LlamaConfig, train_last: int | None, cached: bool, lora: bool, lengths: list[int]) -> float:
    """FLOPs of training on texts of these lengths (gpu_8b.model_flops, text by text: packed, each row is its own).
    With the frozen-prefix cache only the trained blocks run: the model counted is theirs alone.

    For one row, model_flops is a quadratic in the length (weights: linear; causal attention: L (L + 1) / 2), and
    each call counts the model's parameters on the meta device (a second for SmolLM2's 30 blocks): so three calls,
    and the quadratic through them, exact, gives every length.
    """
    if cached and train_last is not None:
        cfg = dataclasses.replace(cfg, n_layers=train_last)
    f1, f2, f3 = (model_flops(cfg, train_last, 1, n, lora=lora)["done"] for n in (1, 2, 3))
    return sum(f1 * (n - 2) * (n - 3) / 2 - f2 * (n - 1) * (n - 3) + f3 * (n - 1) * (n - 2) / 2 for n in lengths)


class Steps:
    """The shipped loop (`train_epoch`) run up to a given number of optimizer steps, as often as asked."""

    def __init__(self, model, split, settings, strategy: Strategy, total: int, work: Path) -> None:
        optimizer = make_optimizer(model, settings)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total, settings))
        self.loop = Loop(model, optimizer, scheduler, settings, strategy, total, work / RESUME_FILE, {})
        self.split, self.state = split, TrainState()
        model.train()

    def to(self, step: int) -> float:
        """Train until `step` optimizer steps in all, into the next epochs if need be; the mean loss of the steps
        this call ran."""
        before = list(self.state.row_sums)
        self.loop.total = step
        while self.state.step < step:
            if train_epoch(self.loop, self.split, self.state):  # the epoch's end: on to the next (no evaluation)
                self.state.epoch, self.state.batches_done = self.state.epoch + 1, 0
        loss, _, rows = (a - b for a, b in zip(self.state.row_sums, before, strict=True))
        return loss / rows if rows else math.nan


def planned_steps(split, settings, strategy: Strategy, n: int) -> list[list[list[int]]]:
    """The rows of the first `n` optimizer steps as `Steps` trains them (epoch after epoch): per step, its
    micro-batches (what the peer is given, and what the FLOPs count)."""
    lengths, out, epoch = [len(x) for x in split.ids], [], 0
    while len(out) < n:
        batches, _ = epoch_plan(lengths, epoch, settings, strategy.processes)
        a = settings.grad_accum
        out += [batches[k : k + a] for k in range(0, len(batches) // a * a, a)]
        epoch += 1
    return out[:n]


def steps_plan(job: Job, train, rows: list[list[list[int]]]) -> MemoryPlan:
    """The plan of the steps' largest micro-batch: each planned as the packed batch it is (its texts, the longest of
    them, its real tokens), the highest peak kept. Under a token budget no one shape stands for the batches: a batch
    of many short texts of mixed lengths pads more inside attention than one of long texts (the SMS data at 8,192
    tokens: 245 texts of 5 to 50 tokens, 12,250 slots). Every term grows with the texts, the longest and the tokens,
    so a shape another one matches or exceeds in all three is not planned."""
    shapes = {(len(b), max(len(train.ids[i]) for i in b), sum(len(train.ids[i]) for i in b)) for s in rows for b in s}
    top = [x for x in shapes if not any(y != x and all(v >= u for u, v in zip(x, y, strict=True)) for y in shapes)]
    base = replica_plan_inputs(job)
    plans = [plan_memory(dataclasses.replace(base, batch_size=n, seq_len=t, tokens=k)) for n, t, k in top]
    return max(plans, key=lambda p: p.peak)


def total_steps(args: argparse.Namespace) -> int:
    """Optimizer steps a recipe runs: warm-up, timed, and the profiled ones under --profile."""
    return args.warmup + args.steps + (PROFILE_STEPS if args.profile else 0)


def profile_steps(steps: Steps, first: int, device: torch.device, path: Path) -> None:
    """PROFILE_STEPS more steps under torch.profiler: where a step's time goes, by operator, host and device side
    (the question a slow tokens/s figure asks first: is the GPU busy, or waiting for the host?)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync(device)
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        steps.to(first + PROFILE_STEPS)
        sync(device)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    tables = [f"{PROFILE_STEPS} optimizer steps, {wall:.3f} s of wall time (profiler overhead included)\n"]
    keys = ["self_cpu_time_total"] + (["self_device_time_total", "self_cuda_time_total"] if len(activities) > 1 else [])
    for key in keys:
        try:
            tables.append(f"sorted by {key}\n" + events.table(sort_by=key, row_limit=30, max_name_column_width=70))
        except (AttributeError, KeyError, ValueError) as e:  # the key's name differs between torch versions
            tables.append(f"sorted by {key}: not available ({e})")
        else:
            if key != "self_cpu_time_total":
                break  # one device-side table is enough
    path.write_text("\n".join(tables) + "\n")
    log(f"profile of {PROFILE_STEPS} steps written to {path} ({wall:.2f} s)")


def timed_steps(steps: Steps, first: int, last: int, device: torch.device) -> dict:
    """Steps first+1..last timed, counting the host's waits for the GPU (each a warning under the debug mode)."""
    on_gpu = device.type == "cuda"
    tokens = steps.state.train_tokens
    sync(device)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if on_gpu:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            if last - 1 > first:
                steps.to(last - 1)
            loss_last = steps.to(last)  # alone, for its own loss
        finally:
            if on_gpu:
                torch.cuda.set_sync_debug_mode("default")
    sync(device)
    seconds = time.perf_counter() - start
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return {
        "seconds": seconds,
        "tokens": steps.state.train_tokens - tokens,
        "loss_last": loss_last,
        "syncs_per_step": syncs / (last - first) if on_gpu else None,
    }


def e2e_data(args: argparse.Namespace, to: Path) -> list[str]:
    """An end-to-end row's data as JSON lines in `to`: --e2e-texts training texts and a few held out; the flags
    that read them. The bundled SMS messages, cycled, each after its own number, so that no two texts are alike:
    the cache runs a repeated text once, which would flatter ours."""
    from llama_scratch.data.labelled import load_sms_spam

    sms, held_out = load_sms_spam(), E2E_HELD_OUT[args.quick]
    to.mkdir(parents=True)
    flags, first = [], 0
    for name, count, flag in (
        ("train", args.e2e_texts, "--data"),
        ("val", held_out, "--val-data"),
        ("test", held_out, "--test-data"),
    ):
        rows = []
        for i in range(first, first + count):
            k = i % len(sms.texts)
            rows.append(json.dumps({"text": f"{i}: {sms.texts[k]}", "label": sms.label_names[sms.labels[k]]}))
        (to / f"{name}.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
        flags += [flag, str(to / f"{name}.jsonl")]
        first += count
    return flags


def prepare(recipe: Recipe, ckpt: Path, args: argparse.Namespace, strategy: Strategy, work: Path):
    """finetune_classifier's phases up to the loop, by its own functions: data, model, tokens, cache, settings."""
    flags = ["--model", str(ckpt), "--device", args.device, "--batch-size", str(args.batch_size)]
    if recipe.epochs is None:  # the bundled SMS data, stopped after the steps run_recipe times
        flags += ["--epochs", "1", "--max-steps", str(total_steps(args))]
    else:
        flags += ["--epochs", str(recipe.epochs), *e2e_data(args, work / "e2e-data")]
    flags += ["--save-every", str(10**9), "--output", str(work)]
    budget = args.batch_tokens or recipe.batch_tokens
    if budget is not None:
        flags += ["--batch-tokens", str(min(budget, QUICK_BATCH_TOKENS) if args.quick else budget)]
    asked = finetune_settings([*flags, *recipe.flags, *args.flags.split()])
    data, parts, protocol = read_data(asked.data, asked.recipe.seed, log)
    choice = choose_model(asked, strategy, log)
    job = Job(asked, strategy, time.perf_counter(), data, parts, protocol, choice, work)
    labels = parts["train"].labels
    settings = train_settings(asked, choice.from_scratch, labels, data.num_classes, strategy.processes, log)
    free(strategy.device)  # the load's own peak: with --quantize, what the 4-bit base costs to stream in
    start = time.perf_counter()
    clf, tokenizer, _ = build_classifier(job, log)
    sync(strategy.device)
    figures = {"load_seconds": time.perf_counter() - start, "load_peak_over_checkpoint": None}
    if strategy.device.type == "cuda":
        ckpt_bytes = sum(f.stat().st_size for f in Path(ckpt).glob("*.safetensors"))
        figures["load_peak_over_checkpoint"] = torch.cuda.max_memory_allocated(strategy.device) / ckpt_bytes
    splits, max_length = tokenize(parts, tokenizer, clf.backbone.cfg.max_seq_len, asked.data.max_length, log)
    lengths = [len(x) for x in splits["train"].ids]
    # At least one step (Steps goes on into the next epochs); an end-to-end row runs the epochs' steps.
    figures = figures | {"steps_per_epoch": check_enough_data(len(lengths), settings, strategy.processes, lengths)}
    ids = {k: v.ids for k, v in splits.items()}
    start = time.perf_counter()
    cached = use_cache(asked.compute.cache_frozen, clf, ids, strategy, log)
    if cached:
        splits = cache_splits(clf, splits, settings.eval_rows, strategy)
        sync(strategy.device)
    figures |= {"cache_seconds": time.perf_counter() - start, "frozen_prefix_cache": cached, "cache_gib": None}
    if cached:  # after the clock: an end-to-end row times the cache's pass
        figures["cache_gib"] = cache_bytes(list(distinct_texts(s for v in ids.values() for s in v)), clf) / GiB
    if asked.compute.compile:  # where the command compiles: after the cache, before the wrapper
        compile_token_wise(clf)
    figures |= {"max_length": max_length, "train_texts": len(lengths)}
    return job, clf, strategy.wrap(clf), splits["train"], settings, figures


def peer_job(
    job: Job, clf, train, settings, rows: list, ckpt: Path, args: argparse.Namespace, to: Path, whole: bool
) -> None:
    """What peer_step.py needs to train as we do: the checkpoint, what trains, the head's starting weights, the
    optimizer's settings and every step's micro-batches (token ids and labels); `whole`: time every step from the
    first (an end-to-end row), not the steps after the warm-up."""
    from safetensors.torch import save_file

    to.mkdir(parents=True, exist_ok=True)
    save_file({"head.weight": clf.head.weight.detach().float().cpu().contiguous()}, to / "head.safetensors")
    choice = job.choice
    lora = choice.lora
    trained = clf.trainable_parameters()
    texts = [t for s in rows for b in s for i in b for t in train.ids[i]]
    if train.pad_id in texts:  # the peer pools at the last token before the first pad: one inside a text misleads it
        raise ValueError(f"the pad id {train.pad_id} occurs inside a text: the peer would pool at the wrong token")
    spec = {
        "checkpoint": str(ckpt),
        "device": str(job.strategy.device),
        "dtype": str(choice.dtype).removeprefix("torch."),
        "num_classes": job.data.num_classes,
        "pad_id": train.pad_id,
        "lora": None
        if lora is None
        else {
            "rank": lora.rank,
            "alpha": lora.alpha if lora.alpha is not None else 2 * lora.rank,
            "dropout": lora.dropout,
            "targets": list(lora.targets),
            "blocks": list(clf.lora_blocks),
        },
        "trained_blocks": sorted({int(k.split(".")[2]) for k in trained if k.startswith("backbone.blocks.")}),
        "final_norm": "backbone.final_norm.weight" in trained,
        "embeddings": "backbone.embed_tokens.weight" in trained,
        # transformers has no 4-bit base without bitsandbytes (not on the GPU machine): the peer's stays bfloat16.
        "note": "the peer's frozen base in the checkpoint's dtype, not 4-bit" if choice.quantize else None,
        "trained_params": sum(p.numel() for p in trained.values()),
        "lr": settings.lr,
        "weight_decay": settings.weight_decay,
        "clip_grad": settings.clip_grad if settings.clip_grad > 0 else float("inf"),
        "warmup": args.warmup,
        "whole": whole,
        "steps": [
            [{"ids": [train.ids[i] for i in b], "labels": [train.labels[i] for i in b]} for b in step] for step in rows
        ],
    }
    (to / "job.json").write_text(json.dumps(spec))


def run_peer(directory: Path, timeout: float) -> dict:
    """peer_step.py on the job in `directory`, in a process of its own; its figures, or its error."""
    script = Path(__file__).resolve().parent / "peer_step.py"
    try:
        proc = subprocess.run(
            [sys.executable, str(script), str(directory)], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"peer_error": f"timed out after {timeout:.0f} s", "peer_timed_out_after": timeout}
    if proc.returncode != 0:
        return {"peer_error": proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else "failed"}
    return json.loads((directory / "peer.json").read_text())


def compare(ours: dict, peer: dict, device: torch.device) -> dict:
    """The peer's figures beside ours: the ratio of tokens per second, and whether both sides began alike (the first
    step's loss, equal but for rounding: float32 on a CPU, bfloat16 kernels on a GPU; the trained parameters)."""
    if "peer_error" in peer:
        log(f"  peer failed: {peer['peer_error']}")
        if ours.get("epochs") and "peer_timed_out_after" in peer:  # its load counted too: a lower bound
            peer["ratio_vs_peer_at_least"] = peer["peer_timed_out_after"] / ours["e2e_seconds"]
        return peer
    tolerance = 0.02 if device.type == "cuda" else 1e-4  # bfloat16 keeps 8 bits of mantissa: 2^-7 per rounding
    same_start = math.isclose(ours["loss_first"], peer["peer_loss_first"], rel_tol=tolerance)
    same_params = ours["trainable_params"] == peer["peer_trainable_params"]
    ratio = ours["train_tokens_per_s"] / peer["peer_tokens_per_s"]
    log(
        f"  peer: {peer['peer_tokens_per_s']:,.0f} tokens/s (ours {ratio:.2f}x), first loss "
        f"{peer['peer_loss_first']:.4f} (ours {ours['loss_first']:.4f}), trained {peer['peer_trainable_params']:,} "
        f"(ours {ours['trainable_params']:,})"
    )
    out = peer | {"ratio_vs_peer": ratio, "same_first_loss": same_start, "same_trained_params": same_params}
    if ours.get("epochs"):  # the same tokens on both sides: the ratio is the peer's seconds over ours
        out["peer_e2e_seconds"] = peer["peer_seconds"]
    return out


def warm_then_timed(steps: Steps, args: argparse.Namespace, device: torch.device) -> dict:
    """A row of timed steps: the first step's loss, the warm-up (its last step profiled for the attention kernel
    and the launches), then --steps timed."""
    loss_first = steps.to(1)  # also allocates the optimizer's state
    steps.to(args.warmup - 1)
    attention = attention_backends(lambda: steps.to(args.warmup), device)  # the last warm-up step, profiled
    steps.to(args.warmup)  # nothing, unless the profiler failed before the step ran
    timed = timed_steps(steps, args.warmup, args.warmup + args.steps, device)
    return timed | {"loss_first": loss_first, "attention": attention}


def whole_epochs(steps: Steps, total: int, device: torch.device) -> dict:
    """An end-to-end row: every step timed from the first (its allocations and first kernels are part of a run),
    then one step more, after the clock and its tokens, profiled for the attention kernel and the launches."""
    sync(device)
    start = time.perf_counter()
    loss_first = steps.to(1)
    # Host syncs counted from step 2: the first step's allocations wait by design.
    rest = timed_steps(steps, 1, total, device) if total > 1 else {"loss_last": loss_first, "syncs_per_step": None}
    sync(device)
    out = rest | {"seconds": time.perf_counter() - start, "tokens": steps.state.train_tokens, "loss_first": loss_first}
    out["steps_run"] = steps.state.step
    return out | {"attention": attention_backends(lambda: steps.to(total + 1), device)}


def run_recipe(
    recipe: Recipe, ckpt: Path, args: argparse.Namespace, strategy: Strategy, peak: float | None, peer_dir: Path
) -> dict:
    """One recipe, start to end; its figures (see RECIPE_KEYS). Raises on failure: the caller reports it. With
    the peer asked for, its job is written to `peer_dir` (peer_job) before our steps change the head."""
    device, whole = strategy.device, recipe.epochs is not None
    with tempfile.TemporaryDirectory(prefix="gpu-check-run-") as work:
        job, clf, model, train, settings, out = prepare(recipe, ckpt, args, strategy, Path(work))
        total = recipe.epochs * out["steps_per_epoch"] if whole else total_steps(args)
        rows = planned_steps(train, settings, strategy, total)
        plan = steps_plan(job, train, rows)
        out |= {"plan_peak_gib": plan.peak / GiB, "trainable_params": plan.counts.trainable}
        if args.peer:
            given = rows if whole else rows[: args.warmup + args.steps]
            peer_job(job, clf, train, settings, given, ckpt, args, peer_dir, whole)
        free(device)  # the steps' peak is measured from here: weights, cache and whatever training adds
        steps = Steps(model, train, settings, strategy, total, Path(work))
        timed = whole_epochs(steps, total, device) if whole else warm_then_timed(steps, args, device)
        if args.profile:
            profile_steps(steps, steps.state.step, device, args.out / f"profile_{recipe.name}.txt")
    attention = timed["attention"]
    out |= {"sdpa_backend": attention["backend"], "sdpa": attention, "launches_per_step": attention["launches"]}
    on_gpu = device.type == "cuda"
    out["measured_peak_gib"] = torch.cuda.max_memory_allocated(device) / GiB if on_gpu else None
    # The plan leaves the cache out (--plan reports it per token of the data): added to it here.
    planned = out["plan_peak_gib"] + (out["cache_gib"] or 0)
    out["peak_over_plan_and_cache"] = out["measured_peak_gib"] / planned if on_gpu else None
    timed_rows = rows if whole else rows[args.warmup : args.warmup + args.steps]
    lengths = [len(train.ids[i]) for step in timed_rows for b in step for i in b]
    choice, cached = job.choice, out["frozen_prefix_cache"]
    if whole:  # the cache's pass and the training steps together: no one model's FLOPs, so no MFU
        seconds, tflops = out["cache_seconds"] + timed["seconds"], None
        out |= {"epochs": recipe.epochs, "e2e_seconds": seconds, "steps_run": timed["steps_run"]}
    else:
        seconds = timed["seconds"]
        flops = step_flops(clf.backbone.cfg, choice.train_last, cached, choice.lora is not None, lengths)
        tflops = flops / seconds / 1e12
    out |= {
        "dtype": str(choice.dtype).removeprefix("torch."),
        "train_last": choice.train_last,
        "lora_rank": choice.lora.rank if choice.lora else None,
        "batch_size": settings.batch_size,
        "batch_tokens": settings.batch_tokens,
        "rows_per_step": len(lengths) / len(timed_rows),
        "optimizer_state": settings.optimizer_state,
        "timed_steps": len(timed_rows),
        "timed_seconds": timed["seconds"],
        "train_tokens_per_s": timed["tokens"] / seconds,
        "model_tflops": tflops,
        "mfu": tflops / peak if peak and tflops is not None else None,
        "syncs_per_step": timed["syncs_per_step"],
        "loss_first": timed["loss_first"],
        "loss_last": timed["loss_last"],
    }
    return out


# --- the report -----------------------------------------------------------------------------------------------------


def fmt(value, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def markdown(result: dict) -> str:
    """The table printed and written to gpu_check.md."""
    lines = [
        f"### gpu_check on {result['device']} (torch {result['torch']}, CUDA {result['cuda']}), {result['date']}",
        "",
        f"`{result['command']}`",
        "",
        f"load_weights: {fmt(result['load_checkpoint_gib'])} GiB in {fmt(result['load_seconds'], '.1f')} s, peak/"
        f"checkpoint {fmt(result['load_peak_ratio'], '.3f')}; {result['total_seconds']:.0f} s in all",
        "",
        "| recipe | trained params | batch | max len | tokens/s | MFU | syncs/step | launches/step | attention "
        "| loss first -> last | peak GiB | plan GiB | cache GiB | load peak/ckpt | peer tokens/s | ours/peer "
        "| peer first loss | peer peak GiB |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: |",
    ]
    whole = []
    for r in result["recipes"]:
        if r["error"]:
            lines.append(f"| {r['name']} | {r['error']} |" + " |" * 16)
            continue
        if r.get("epochs"):
            whole.append(
                f"{r['name']}: {r['epochs']} epochs of {r['train_texts']:,} texts end to end: ours "
                f"{r['e2e_seconds']:.1f} s (the cache's pass {r['cache_seconds']:.1f} s), the peer "
                f"{fmt(r.get('peer_e2e_seconds'), '.1f')} s: ours {fmt(r.get('ratio_vs_peer'))}x as fast"
                f" (ours with {r['optimizer_state']} optimizer state, the peer's moments in its parameters' dtype)"
            )
        batch = f"{r['batch_tokens']:,} tokens" if r.get("batch_tokens") else str(r["batch_size"])
        peer = r.get("peer_error") or fmt(r.get("peer_tokens_per_s"), ",.0f")
        lines.append(
            f"| {r['name']} | {r['trainable_params'] / 1e6:,.1f}M | {batch} | {r['max_length']} | "
            f"{r['train_tokens_per_s']:,.0f} | {fmt(r['mfu'], '.1%')} | {fmt(r['syncs_per_step'])} | "
            f"{fmt(r.get('launches_per_step'), ',')} | {r['sdpa_backend']} | {r['loss_first']:.4f} -> "
            f"{r['loss_last']:.4f} | {fmt(r['measured_peak_gib'])} | {r['plan_peak_gib']:.2f} | "
            f"{fmt(r.get('cache_gib'))} | {fmt(r.get('load_peak_over_checkpoint'), '.3f')} | {peer} | "
            f"{fmt(r.get('ratio_vs_peer'), '.2f')} | {fmt(r.get('peer_loss_first'), '.4f')} | "
            f"{fmt(r.get('peer_peak_gib'))} |"
        )
    return "\n".join(lines + [""] * bool(whole) + whole)


def summary(recipes: list[dict]) -> dict:
    """Per headline figure, each recipe's value: one look at the top of the JSON."""
    ok = [r for r in recipes if not r["error"]]
    out = {"ran": [r["name"] for r in ok], "failed": {r["name"]: r["error"] for r in recipes if r["error"]}}
    return out | {key: {r["name"]: r[key] for r in ok} for key in RECIPE_KEYS}


def write_json(result: dict, out: Path) -> None:
    """The results so far, replacing the last copy in one rename: a run cut off by a timeout leaves a whole file."""
    result["total_seconds"] = time.perf_counter() - STARTED
    result["summary"] = summary(result["recipes"])
    tmp = out / ".gpu_check.json.tmp"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out / "gpu_check.json")


# --- the command ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu_check"), help="where gpu_check.json and .md go")
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--quick", action="store_true", help="tiny shapes (seconds on a CPU): the same code, no figures")
    p.add_argument(
        "--dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "llama_scratch_gpu_check",
        help="where the random checkpoints are written, and kept: a second run on the machine reuses them",
    )
    p.add_argument("--recipes", nargs="+", choices=[r.name for r in RECIPES], help="default: all")
    p.add_argument("--steps", type=int, help="timed optimizer steps per recipe (default: 20; 3 with --quick)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (at least 2; default 3)")
    p.add_argument(
        "--profile",
        action="store_true",
        help=f"then {PROFILE_STEPS} steps under torch.profiler: OUT/profile_RECIPE.txt",
    )
    p.add_argument("--batch-size", type=int, default=8, help="rows per optimizer step (default: 8)")
    p.add_argument(
        "--batch-tokens",
        type=int,
        metavar="N",
        help="every recipe at a budget of N tokens a micro-batch (default: each recipe's own: RECIPES)",
    )
    p.add_argument(
        "--flags",
        default="",
        help="more finetune flags for every recipe, one string: --flags=--compile (default: none)",
    )
    p.add_argument(
        "--e2e-texts",
        type=int,
        metavar="N",
        help=f"training texts of an end-to-end row (default: {E2E_TEXTS[0]:,}; {E2E_TEXTS[1]} with --quick)",
    )
    p.add_argument("--no-peer", dest="peer", action="store_false", help="skip transformers + PEFT beside each recipe")
    p.add_argument(
        "--peer-timeout",
        type=float,
        default=300,
        help="seconds the peer may take a recipe, its load included (default: 300)",
    )
    p.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, if gpu_8b's table lacks it")
    p.add_argument(
        "--no-cudnn-attention",
        action="store_true",
        help="switch cuDNN's fused attention off (flash then takes the calls): see benchmarks/sdpa_shapes.py",
    )
    args = p.parse_args(argv)
    if args.warmup < 2:
        p.error("--warmup must be at least 2: the first step allocates the optimizer's state, the last is profiled")
    args.steps = args.steps or (3 if args.quick else 20)
    args.e2e_texts = E2E_TEXTS[args.quick] if args.e2e_texts is None else args.e2e_texts
    if args.steps < 1 or args.batch_size < 1 or args.e2e_texts < 1 or args.peer_timeout <= 0:
        p.error("--steps, --batch-size, --e2e-texts and --peer-timeout must be positive")
    return args


def start(args: argparse.Namespace, argv: list[str] | None) -> tuple[Strategy, dict]:
    """The device (chosen as finetune_classifier chooses it) and the result's header."""
    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    strategy = choose_strategy(args.device)
    device = strategy.device
    on_gpu = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    result = {
        "command": " ".join(["python", "benchmarks/gpu_check.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": name,
        "device_memory_gib": torch.cuda.get_device_properties(device).total_memory / GiB if on_gpu else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if on_gpu else None,
        "peak_bf16_tflops": args.peak_tflops or (peak_tflops(name) if on_gpu else None),
        "quick": args.quick,
        "cudnn_attention": torch.backends.cuda.cudnn_sdp_enabled(),
        "tokenizer": "byte-level: 256 byte tokens + Llama-3's specials (~4x Llama-3's tokens per text)",
    }
    log(f"device {name}, torch {torch.__version__}, CUDA {result['cuda']}; checkpoints in {args.dir}")
    return strategy, result


def measure_first_load(cfg: LlamaConfig, ckpt: Path, device: torch.device) -> dict:
    """gpu_8b's load measurement on this checkpoint: peak over its bytes (GPU only), seconds."""
    model, load = measure_load(cfg, ckpt, device)
    del model
    free(device)
    ratio = load["peak_over_checkpoint"]
    log(f"load: {load['checkpoint_bytes'] / GiB:.2f} GiB in {load['seconds']:.1f} s, peak/checkpoint {ratio}")
    return {
        "load_peak_ratio": load["peak_over_checkpoint"],
        "load_seconds": load["seconds"],
        "load_checkpoint_gib": load["checkpoint_bytes"] / GiB,
        "load": load,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.stderr, stderr = NoBars(sys.stderr), sys.stderr
    try:
        return check(args, argv)
    finally:
        sys.stderr = stderr


def chosen_recipes(args: argparse.Namespace) -> list[Recipe]:
    """The rows named by --recipes, in RECIPES' order; without it the default rows, or every row under --quick."""
    if args.recipes:
        return [r for r in RECIPES if r.name in args.recipes]
    return [r for r in RECIPES if r.default or args.quick]


def check(args: argparse.Namespace, argv: list[str] | None) -> int:
    """The load, then each recipe in turn; 0 if any recipe ran."""
    args.out.mkdir(parents=True, exist_ok=True)
    strategy, result = start(args, argv)
    device = strategy.device
    if device.type != "cuda" and not args.quick:
        raise SystemExit(f"gpu_check: {device} has no GPU: pass --quick for the tiny shapes (8B would take hours)")
    recipes = chosen_recipes(args)
    shapes = {r.shape: SHAPES[r.shape][1 if args.quick else 0] for r in recipes}
    result |= {"load_peak_ratio": None, "load_seconds": None, "load_checkpoint_gib": None, "recipes": []}
    write_json(result, args.out)
    ckpts = {}
    for shape, cfg in shapes.items():
        log(f"checkpoint {shape}: {cfg.n_layers} blocks of {cfg.dim}, {cfg.dtype} ...")
        ckpts[shape] = checkpoint_for(cfg, args.dir)
    first = recipes[0].shape
    result |= measure_first_load(shapes[first], ckpts[first], device)
    write_json(result, args.out)
    for recipe in recipes:
        log(f"recipe {recipe.name}: {' '.join(recipe.flags)}")
        entry = {"name": recipe.name, "shape": recipe.shape, "flags": list(recipe.flags), "error": None}
        entry |= dict.fromkeys(RECIPE_KEYS)
        peer_dir = Path(tempfile.mkdtemp(prefix=f"gpu-check-peer-{recipe.name}-"))
        try:
            entry |= run_recipe(recipe, ckpts[recipe.shape], args, strategy, result["peak_bf16_tflops"], peer_dir)
        except Exception as e:  # out of memory or anything else: reported, and the next recipe runs
            entry["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
            entry["traceback"] = traceback.format_exc()[-3000:]
            print(entry["traceback"][-1500:], file=sys.stderr, flush=True)  # the device returns 12,000 characters
        free(device)  # all ours given back before the peer's process starts
        result["recipes"].append(entry)
        write_json(result, args.out)  # ours kept, whatever happens to the peer
        if args.peer and entry["error"] is None:
            log(
                f"recipe {recipe.name}: ours {entry['train_tokens_per_s']:,.0f} tokens/s; "
                "the peer (transformers + PEFT) in its own process ..."
            )
            entry |= compare(entry, run_peer(peer_dir, args.peer_timeout), device)
            write_json(result, args.out)
        shutil.rmtree(peer_dir, ignore_errors=True)
        log(f"recipe {recipe.name}: " + (entry["error"] or ", ".join(f"{k} {entry[k]}" for k in RECIPE_KEYS)))
    table = markdown(result)
    (args.out / "gpu_check.md").write_text(table + "\n")
    print(table, flush=True)
    return 0 if result["summary"]["ran"] else 1


if __name__ == "__main__":
    sys.exit(main())

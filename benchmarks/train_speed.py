"""Training-step speed of our `LlamaClassifier` against transformers' `LlamaForSequenceClassification`.

Run: python benchmarks/train_speed.py [--preset small|tiny|PRESET] [--batch-size 8] [--seq-len real|N]
                                      [--train-last 1 all] [--lora RANK] [--rounds 5] [--steps 3] [--threads N]
                                      [--ours packed|padded] [--profile]

Both models are read from one checkpoint written with `save_checkpoint` (ours through `load_weights`, theirs through
`from_pretrained` with `attn_implementation="sdpa"` and `use_cache=False`, its fastest training setup), and our
freshly initialised head is copied into their `score`. Both train on the same batches of real SMS texts (tokenized
with `Tokenizer.default()`, BOS added, right-padded by `batching.collate`), in float32 on the CPU, with the same step as
`train.py`: cross-entropy, backward, gradient clipping at 1.0, AdamW from `train.make_optimizer` over the same
trainable set. The first step must give the same loss and gradients on both sides (asserted), so the timing
compares the same work. `--ours packed` (the default, as training runs) feeds ours the same texts packed without
padding (`packing.py`); theirs always gets the padded batch. After warm-up, each round times `--steps` steps of
ours and of theirs, alternating which goes first; the table reports the median over rounds and the ratio
theirs / ours (above 1: ours is faster).

`small` is a Llama-3-shaped model of ~44M parameters (GQA 4:1, SwiGLU 3.5x, rope theta 500k, tied embeddings)
with a 32,768-row vocabulary: the texts' Llama-3 token ids are renumbered compactly (one-to-one over the ids the
batches use, pad included), so the texts and lengths are unchanged. Presets with the full vocabulary (`tiny`)
use the tokenizer's ids as they are.

`--lora R` times LoRA instead (settings `loraR-lastK`): ours is `LlamaClassifier(..., train_last=K,
lora=LoRASettings(R, alpha=2R))`, theirs the same transformers model wrapped by `peft.get_peft_model` with a
`LoraConfig` of the same rank, alpha, seven projections and blocks (`layers_to_transform`), the head as
`modules_to_save` and the final norm unfrozen by hand: on both sides the adapters, head and final norm train. Our
B (zero at creation) is first set to small random values, then A and B are copied into theirs, so the first-step
check covers the adapters' part of the output and their gradients.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import platform
import random
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from torch import nn

from llama_scratch import Llama, LlamaClassifier, LlamaConfig, Tokenizer
from llama_scratch.checkpoints.hf_layout import ours_to_hf
from llama_scratch.checkpoints.weights import load_weights, save_checkpoint
from llama_scratch.data.batching import collate
from llama_scratch.data.labelled import load_sms_spam
from llama_scratch.model.layout import Layout
from llama_scratch.model.lora import TARGETS, LoRASettings, lora_layers
from llama_scratch.model.packing import pack_ids
from llama_scratch.training.loop import TrainSettings, make_optimizer

BENCH_PRESETS = {
    # ~27M parameters in the blocks + 16.8M in the (tied) embedding: one step ~0.1-1 s on a 2-core CPU.
    "small": LlamaConfig(
        vocab_size=32_768,
        dim=512,
        n_layers=8,
        n_heads=8,
        n_kv_heads=2,
        ffn_dim=1792,
        tie_embeddings=True,
        max_seq_len=2048,
        dtype=torch.float32,
    ),
}


def bench_config(name: str) -> LlamaConfig:
    cfg = BENCH_PRESETS[name] if name in BENCH_PRESETS else LlamaConfig.from_name(name)
    return dataclasses.replace(cfg, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- data


def sms_batches(
    tok: Tokenizer, n_batches: int, batch_size: int, seq_len: int | None, seed: int
) -> list[list[list[int]]]:
    """`n_batches` batches of token-id rows (BOS, no EOS), texts drawn without replacement in a seeded order.

    `seq_len` None keeps the real lengths; an integer truncates each text to that many tokens.
    """
    texts = load_sms_spam().texts
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    if n_batches * batch_size > len(order):
        raise SystemExit(f"--batches x --batch-size = {n_batches * batch_size} exceeds the {len(order)} SMS texts")
    rows = [tok.encode(texts[i], bos=True)[:seq_len] for i in order[: n_batches * batch_size]]
    return [rows[k : k + batch_size] for k in range(0, len(rows), batch_size)]


def renumber(batches: list[list[list[int]]], pad_id: int, vocab_size: int) -> tuple[list[list[list[int]]], int]:
    """Map the token ids the batches use (and the pad id) one-to-one onto 0..k-1, for a vocabulary smaller than
    the tokenizer's. The sequences keep their lengths and their pattern of repeated tokens."""
    used = sorted({t for batch in batches for row in batch for t in row} | {pad_id})
    if len(used) > vocab_size:
        raise SystemExit(f"the batches use {len(used)} distinct token ids, more than the vocabulary ({vocab_size})")
    index = {t: i for i, t in enumerate(used)}
    return [[[index[t] for t in row] for row in batch] for batch in batches], index[pad_id]


def to_tensors(rows: list[list[int]], pad_id: int, pad_to: int | None) -> dict:
    """Right-padded batch from `batching.collate`; `pad_to` pads further to a fixed length (pad-to-global-maximum).
    The same texts packed without padding (`packing.pack_ids`) ride along for our packed layout."""
    batch = collate([(row, i % 2) for i, row in enumerate(rows)], pad_id, "right")  # labels alternate 0/1
    if pad_to is not None and batch["input_ids"].shape[1] < pad_to:
        extra = pad_to - batch["input_ids"].shape[1]
        batch["input_ids"] = F.pad(batch["input_ids"], (0, extra), value=pad_id)
        batch["attention_mask"] = F.pad(batch["attention_mask"], (0, extra), value=0)
    batch["packed_ids"], batch["packed"] = pack_ids(rows)
    return batch


# ---------------------------------------------------------------------------------------------- models


def build_pair(
    ckpt: Path, cfg: LlamaConfig, head: torch.Tensor, pad_id: int, train_last: int | None, lora: LoRASettings | None
):
    """Our classifier and transformers' from the same checkpoint and head, with the same parameters trainable.

    With `lora`, ours carries adapters in its trained blocks and theirs is wrapped by `peft.get_peft_model` with the
    same rank, alpha, targets and blocks (head as `modules_to_save`, final norm unfrozen by hand); our B is set to
    small random values first (it starts at zero) and both A and B are copied into theirs.
    """
    with torch.device("meta"):
        backbone = Llama(cfg)
    load_weights(backbone, ckpt, device="cpu", progress=False)
    ours = LlamaClassifier(backbone, num_classes=2, train_last=train_last, lora=lora)
    with torch.no_grad():
        ours.head.weight.copy_(head)

    theirs = transformers.LlamaForSequenceClassification.from_pretrained(
        ckpt, num_labels=2, pad_token_id=pad_id, use_cache=False, attn_implementation="sdpa", dtype=torch.float32
    )
    with torch.no_grad():
        theirs.score.weight.copy_(head)
    if lora is not None:
        theirs = peft_pair(ours, theirs, lora)
    else:
        theirs.requires_grad_(train_last is None)
        if train_last is not None:
            for module in [theirs.score, theirs.model.norm, *theirs.model.layers[cfg.n_layers - train_last :]]:
                module.requires_grad_(True)

    # Same weights, same trainable set: every parameter of theirs is ours under the name map (score = head).
    ours_params = {hf_name(n): p for n, p in ours.named_parameters()}
    for name, p in theirs.named_parameters():
        if (name := peft_name(name)) is None:
            continue
        mine = ours_params[name]
        assert torch.equal(p, mine), f"weights differ: {name}"
        assert p.requires_grad == mine.requires_grad, f"trainable set differs: {name}"
    n_ours = sum(p.numel() for p in ours.parameters() if p.requires_grad)
    n_theirs = sum(p.numel() for p in theirs.parameters() if p.requires_grad)
    assert n_ours == n_theirs, (n_ours, n_theirs)
    return ours.train(), theirs.train(), ours_params, n_ours


def peft_pair(ours: LlamaClassifier, theirs: nn.Module, lora: LoRASettings) -> nn.Module:
    """`theirs` wrapped by PEFT with ours' adapters: same rank, alpha, projections and blocks, A and B copied."""
    import peft

    with torch.no_grad():
        for layer in lora_layers(ours):
            layer.lora_b.normal_(std=0.02)  # B = 0 would make the check blind to how B A enters the output
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=[TARGETS[t].split(".")[1] for t in lora.targets],
        layers_to_transform=list(ours.lora_blocks),
        modules_to_save=["score"],
        bias="none",
        task_type="SEQ_CLS",
    )
    theirs = peft.get_peft_model(theirs, config)
    theirs.base_model.model.model.norm.weight.requires_grad_(True)
    ours_params = {hf_name(n): p for n, p in ours.named_parameters()}
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if (name := peft_name(name)) is not None and ".lora_" in name:
                p.copy_(ours_params[name])
    return theirs


def peft_name(name: str) -> str | None:
    """transformers' name (as `hf_name` gives) of a parameter of a PEFT-wrapped model; None for PEFT's frozen copy
    of the head. Names of an unwrapped model are returned as they are."""
    if ".original_module." in name:
        return None
    name = name.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
    return name.replace(".lora_A.default.weight", ".lora_a").replace(".lora_B.default.weight", ".lora_b")


def hf_name(ours: str) -> str:
    """transformers' name for one of our classifier's parameters (their `score` is our `head`); an adapter keeps
    its `lora_a`/`lora_b` suffix after its projection's name."""
    if ours == "head.weight":
        return "score.weight"
    base, dot, adapter = ours.removeprefix("backbone.").rpartition(".")
    if adapter in ("lora_a", "lora_b"):
        return ours_to_hf(base + ".weight").removesuffix(".weight") + dot + adapter
    return ours_to_hf(ours.removeprefix("backbone."))


class Trainer:
    """One model with its optimizer: `step(batch)` is exactly one optimizer step of `train.py` (no accumulation)."""

    def __init__(self, model: nn.Module, forward, settings: TrainSettings):
        self.model, self.forward = model, forward
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(model, settings)
        self.clip = settings.clip_grad

    def loss_and_grads(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.forward(self.model, batch)
        loss = F.cross_entropy(logits.float(), batch["labels"])
        loss.backward()
        return loss.detach()

    def update(self) -> None:
        nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = self.loss_and_grads(batch)
        self.update()
        return loss


def forward_ours(model, batch):
    """Ours on the padded batch; the side is known where the batch is built, as `batching.to_batch` passes it."""
    return model(batch["input_ids"], layout=Layout.padded(batch["attention_mask"], side="right"))


def forward_ours_packed(model, batch):
    """Ours on the same texts packed without padding (what `batching.to_batch` gives for the layout "packed")."""
    return model(batch["packed_ids"], layout=Layout.packed(batch["packed"]))


def forward_theirs(model, batch):
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


# ---------------------------------------------------------------------------------------------- timing


def timed(trainer: Trainer, batches: list[dict[str, torch.Tensor]], steps: int) -> float:
    """Seconds per step over `steps` steps, cycling through `batches` from the first."""
    gc.collect()
    start = time.perf_counter()
    for k in range(steps):
        trainer.step(batches[k % len(batches)])
    return (time.perf_counter() - start) / max(steps, 1)  # --warmup 0: nothing timed


def check_first_step(ours: Trainer, theirs: Trainer, ours_params: dict, batch: dict) -> tuple[float, float]:
    """Loss and gradients of the first step agree (same weights, same batch); then both take the step."""
    loss_a, loss_b = ours.loss_and_grads(batch), theirs.loss_and_grads(batch)
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-5)
    worst = 0.0
    for name, p in theirs.model.named_parameters():
        if p.requires_grad:
            g_ours, g_theirs = ours_params[peft_name(name)].grad, p.grad
            scale = g_theirs.abs().max().item() or 1.0
            worst = max(worst, (g_ours - g_theirs).abs().max().item() / scale)
    assert worst < 1e-3, f"first-step gradients differ (max relative difference {worst:.2e})"
    ours.update()
    theirs.update()
    return loss_a.item(), worst


def profile(trainer: Trainer, batches: list[dict[str, torch.Tensor]], steps: int, label: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for k in range(steps):
            trainer.step(batches[k % len(batches)])
    print(f"\n### profile: {label}, {steps} steps (self CPU time)\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48))


# ---------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", help=f"{', '.join(BENCH_PRESETS)} or a llama_scratch preset")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--seq-len",
        default="real",
        help="'real': each batch padded to its longest text; N: texts truncated to N tokens and every batch padded "
        "to N (pad-to-global-maximum)",
    )
    parser.add_argument("--batches", type=int, default=4, help="distinct batches, cycled through by both models")
    parser.add_argument("--train-last", nargs="+", default=["1", "all"], help="settings to time: K blocks, or all")
    parser.add_argument(
        "--lora",
        type=int,
        default=None,
        metavar="RANK",
        help="LoRA at this rank (alpha 2 x rank, all seven projections) in the trained blocks, against transformers "
        "+ PEFT with the same adapters",
    )
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per setting (ours and theirs each)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per model per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model before the rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ours", choices=["packed", "padded"], default="packed", help="our batch layout")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile (dynamic shapes) our token-wise modules: every block's feed-forward and norms "
        "(attention stays eager: a packed layout's lengths would recompile it per batch); the warm-up line "
        "shows the compile time",
    )
    parser.add_argument("--profile", action="store_true", help="also print a torch.profiler table of each model")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()  # "score.weight newly initialized": we copy our head into it
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning, module="transformers")
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")  # PEFT calls a deprecated name
    cfg = bench_config(args.preset)
    seq_len = None if args.seq_len == "real" else int(args.seq_len)
    tok = Tokenizer.default()
    rows = sms_batches(tok, args.batches, args.batch_size, seq_len, args.seed)
    pad_id = tok.pad_id
    if cfg.vocab_size < tok.n_words:
        rows, pad_id = renumber(rows, pad_id, cfg.vocab_size)
    batches = [to_tensors(r, pad_id, seq_len) for r in rows]
    real_tokens = statistics.mean(int(b["attention_mask"].sum()) for b in batches)
    padded = statistics.mean(b["input_ids"].numel() for b in batches)
    shape = "/".join(str(b["input_ids"].shape[1]) for b in batches)

    torch.manual_seed(args.seed)
    model = Llama(cfg)
    head = torch.randn(2, cfg.dim) * 0.02
    n_params = sum(p.numel() for p in model.parameters())
    settings = TrainSettings()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f}), python {platform.python_version()}"
    )
    print(
        f"model {args.preset}: {n_params / 1e6:.1f}M parameters (dim {cfg.dim}, {cfg.n_layers} layers, "
        f"{cfg.n_heads}/{cfg.n_kv_heads} heads, ffn {cfg.ffn_dim}, vocab {cfg.vocab_size:,}), float32"
    )
    print(
        f"batches: {args.batches} x {args.batch_size} SMS texts, right-padded to {shape} tokens; mean "
        f"{real_tokens:.0f} real of {padded:.0f} positions per batch; AdamW lr {settings.lr}, clip {settings.clip_grad}"
    )
    print(f"ours: {args.ours} batches (packed: no padding in norms, projections, feed-forward; attention per text)")

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = save_checkpoint(model, cfg, Path(tmp) / "ckpt")
        del model
        for setting in args.train_last:
            train_last = None if setting == "all" else int(setting)
            lora = None if args.lora is None else LoRASettings(args.lora, alpha=2 * args.lora, dropout=0.0)
            ours_model, theirs_model, ours_params, n_train = build_pair(ckpt, cfg, head, pad_id, train_last, lora)
            ours = Trainer(ours_model, forward_ours_packed if args.ours == "packed" else forward_ours, settings)
            theirs = Trainer(theirs_model, forward_theirs, settings)
            loss, grad_diff = check_first_step(ours, theirs, ours_params, batches[0])
            label = f"train_last={setting}" if lora is None else f"lora{lora.rank}-last{setting}"
            label += f", ours {args.ours}"
            print(
                f"\n{label}: {n_train / 1e6:.2f}M trainable; first step loss {loss:.6f} on both "
                f"(gradients agree to {grad_diff:.1e} relative)"
            )
            if args.compile:
                for block in ours_model.backbone.blocks:
                    for module in (block.ffn, block.attention_norm, block.ffn_norm):
                        module.compile(dynamic=True)
            warm = [timed(ours, batches, args.warmup) * args.warmup, timed(theirs, batches, args.warmup) * args.warmup]
            print(f"  warm-up ({args.warmup} steps, compile included): ours {warm[0]:.1f} s, theirs {warm[1]:.1f} s")
            times = {"ours": [], "theirs": []}
            for r in range(args.rounds):
                order = [("ours", ours), ("theirs", theirs)]
                for name, trainer in order if r % 2 == 0 else order[::-1]:
                    times[name].append(timed(trainer, batches, args.steps))
                print(
                    f"  round {r + 1}: ours {times['ours'][-1] * 1e3:.0f} ms, theirs {times['theirs'][-1] * 1e3:.0f} ms"
                )
            if args.profile:
                profile(ours, batches, args.steps, f"ours, {label}")
                profile(theirs, batches, args.steps, f"theirs, {label}")
            ours_ms = statistics.median(times["ours"]) * 1e3
            theirs_ms = statistics.median(times["theirs"]) * 1e3
            ratios = [t / o for o, t in zip(times["ours"], times["theirs"], strict=True)]
            results.append((label, ours_ms, theirs_ms, statistics.median(ratios)))
            del ours, theirs, ours_model, theirs_model, ours_params
            gc.collect()

    rows_per_batch = args.batch_size
    print(
        f"\n{args.rounds} rounds x {args.steps} steps per model after {args.warmup} warm-up steps; medians over "
        "rounds. ratio = theirs / ours ms per step (> 1: ours faster); tokens/s counts real (unpadded) tokens."
    )
    print(
        "\n| config | setting | batch | ours ms/step | theirs ms/step | ours rows/s | theirs rows/s | ours tok/s "
        "| theirs tok/s | ratio (median of rounds) |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, ours_ms, theirs_ms, ratio in results:
        print(
            f"| {args.preset} | {label} | {rows_per_batch} x {shape} | {ours_ms:.1f} | {theirs_ms:.1f} "
            f"| {rows_per_batch / ours_ms * 1e3:.1f} | {rows_per_batch / theirs_ms * 1e3:.1f} "
            f"| {real_tokens / ours_ms * 1e3:.0f} | {real_tokens / theirs_ms * 1e3:.0f} "
            f"| {theirs_ms / ours_ms:.2f}x ({ratio:.2f}x) |"
        )


if __name__ == "__main__":
    main()

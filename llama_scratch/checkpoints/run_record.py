"""The run record, `classifier.json`: what a finished fine-tuning run says about its weights. Written and read here
only, so its keys, its checks and its meaning cannot drift between the commands that use it.

A run's folder ends with two files: `classifier.safetensors` (the trained tensors, or every tensor of a model
trained from random weights) and this record, written last. It says which base model the weights go on (the path
as given, the path relative to the run so that a run moved together with its base still works, and the Hub repo
it came from), the model's config, the classes, how many blocks trained and which LoRA adapters are in them, the
tokenizer, the length and dtype of training, the settings, whether a text has several labels (`multi_label`, with
the `threshold` that decides each), what the head reads (`pooling`), and the run id that the weights file carries
too.

The record carries its schema `version` (`RECORD_VERSION`; `checkpoints.versions`), and every key is written, null
where there is nothing to say. A record written before versions were kept (version 1) lacks the keys added since
the first release; `upgrade_1` says what their absence meant (and `upgrade_2` what a version 2 record's lack of
`pooling` meant), so that everything past `read_record` sees one shape.

`finetune_classifier` builds a record from plain values (`new_record`) and writes it (`write_record`); `classify`
and `export_hf` read it (`read_run`) with every check made here, so a hand-edited, foreign or half-copied run is
one clear line naming the file and the key, before anything large is loaded. Finding or fetching the base model
through `sources` is the commands' part: they ask the record where it was (`RunRecord.find_base`).

The run folder's first mark, `RUN_MARKER` (written when a run starts), is named here beside the record: `sources`
recognises a run folder given as a model by either, and `run_dir` writes both.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError, safe_open

from ..model.classifier import POOLINGS
from ..model.config import PRESETS, LlamaConfig
from ..model.lora import TARGETS, LoRASettings
from ..model.quantize import KINDS as QUANTIZE_KINDS
from .atomic import write_text_atomic
from .hf_layout import CheckpointError
from .versions import upgraded, versioned

if TYPE_CHECKING:
    import torch

RECORD_FILE = "classifier.json"  # written last, when a run finishes
WEIGHTS_FILE = "classifier.safetensors"  # its metadata holds the run id the record holds
RUN_MARKER = ".llama_scratch-run"  # written when a run starts, finished or not

RECORD_VERSION = 3  # the shape `write_record` writes; `read_record` brings older ones to it (UPGRADES)

# What every version of the record held: a version 1 record lacking one of these is not a run's record.
REQUIRED_KEYS = (
    "base_model",
    "weights_include_backbone",
    "config",
    "num_classes",
    "label_names",
    "train_last",
    "tokenizer",
    "max_length",
    "dtype",
)
# The keys version 1 records may lack, added as the tool grew, and what a record without them meant: the base named
# by its path alone, whole blocks trained, settings and run id not recorded, the base in full precision, the data not
# recorded, one label per text.
ADDED_IN_VERSION_1 = {
    "base_model_relative": None,
    "base_model_repo": None,
    "lora": None,
    "settings": None,
    "run_id": None,
    "quantize": None,
    "data": None,
    "multi_label": False,
    "threshold": None,
}
LORA_KEYS = ("rank", "alpha", "dropout", "targets", "blocks")


def upgrade_1(meta: dict) -> dict:
    """A version 1 record (no `version`: written before versions were kept) as version 2: every key it lacks
    (`ADDED_IN_VERSION_1`) with the meaning its absence had."""
    return ADDED_IN_VERSION_1 | meta


# The key version 3 added, and what a version 2 record without it meant: the head read each text's last token.
ADDED_IN_VERSION_2 = {"pooling": "last"}


def upgrade_2(meta: dict) -> dict:
    """A version 2 record as version 3: `ADDED_IN_VERSION_2` with the meaning its absence had."""
    return ADDED_IN_VERSION_2 | meta


UPGRADES = {1: upgrade_1, 2: upgrade_2}  # version n -> n + 1, applied in turn by `checkpoints.versions.upgraded`


def is_run_folder(path: Path) -> bool:
    """A `finetune_classifier` output folder (finished, or started: its marker), and not also a checkpoint: no
    config.json, and no backbone weights unless it trained from random weights. Not a model to load, but what
    `classify --checkpoint` and `export_hf --checkpoint` read."""
    marks = (path / RUN_MARKER).is_file() or (path / RECORD_FILE).is_file()
    return path.is_dir() and marks and not (path / "config.json").is_file()


@dataclass(frozen=True)
class RecordedLoRA:
    """The LoRA adapters a run trained: their settings (`lora.LoRASettings`, as `--lora` made them) and the blocks
    they are in. The merge of an export needs alpha / rank; the blocks and targets say which adapters to expect."""

    settings: LoRASettings
    blocks: tuple[int, ...]

    def modules(self) -> list[str]:
        """Every module with an adapter, as the run names it: blocks.{i}.attention.q_proj, ... (`lora.TARGETS` maps
        the short target names a run records to these paths)."""
        return [f"blocks.{b}.{TARGETS[t]}" for b in self.blocks for t in self.settings.targets]

    def to_json(self) -> dict:
        """The record's "lora" entry: enough to rebuild the same adapters in the same blocks."""
        s = self.settings
        return {
            "rank": s.rank,
            "alpha": s.alpha,
            "dropout": s.dropout,
            "targets": list(s.targets),
            "blocks": list(self.blocks),
        }

    @classmethod
    def from_json(cls, entry: object, path: Path) -> RecordedLoRA | None:
        """The "lora" entry as written by a run (None: the run trained whole blocks)."""
        if entry is None:
            return None
        try:
            return cls(_lora_settings(entry), tuple(entry["blocks"]))
        except ValueError as e:  # LoRASettings names a rank, dropout or target it refuses
            raise CheckpointError(f"{path}: unreadable lora entry ({e})") from None


def _lora_settings(entry: object) -> LoRASettings:
    """LoRASettings from a "lora" entry whose keys have the types a run writes (ValueError saying which not)."""
    if not isinstance(entry, dict):
        raise ValueError(f"not an object but {type(entry).__name__}")
    if missing := [k for k in LORA_KEYS if k not in entry]:
        raise ValueError(f"no {', '.join(missing)}")
    number = (int, float)
    if not (isinstance(entry["blocks"], list) and all(type(b) is int for b in entry["blocks"])):
        raise ValueError("blocks is not a list of block numbers")
    given_rank = entry["rank"]  # a bool is an int to isinstance
    if type(given_rank) is not int:
        raise ValueError("rank is not a whole number")
    if not all(isinstance(entry[k], number) and not isinstance(entry[k], bool) for k in ("alpha", "dropout")):
        raise ValueError("alpha and dropout are not both numbers")
    if not (isinstance(entry["targets"], list) and all(isinstance(t, str) for t in entry["targets"])):
        raise ValueError("targets is not a list of names")
    return LoRASettings(entry["rank"], float(entry["alpha"]), float(entry["dropout"]), tuple(entry["targets"]))


@dataclass(frozen=True)
class RunRecord:
    """classifier.json, checked: field names are the file's keys, in the file's order. `path` is where it was read
    from (None for a record not yet written); messages name it."""

    base_model: str  # an absolute checkpoint path, or a preset's name (a model trained from random weights)
    base_model_relative: str | None  # base_model relative to the run's folder (None: a preset, or not recorded)
    base_model_repo: str | None  # the Hub repo the base was fetched from (None: not fetched from the Hub)
    weights_include_backbone: bool  # trained from random weights: the weights file holds the whole model
    config: dict  # the model's config.json fields (`LlamaConfig.to_hf_dict`)
    num_classes: int
    label_names: list[str]  # class i is label_names[i]
    train_last: int | None  # blocks trained (None: all)
    lora: RecordedLoRA | None  # adapters in those blocks instead of their weights
    tokenizer: str  # "llama3" (the llama-models vocabulary), else the path it was read from
    max_length: int  # texts were cut to this many tokens in training
    dtype: str  # the dtype it trained in, e.g. "bfloat16"
    quantize: str | None  # "nf4" or "int8": the frozen base weights were held quantized (None: full precision)
    data: dict | None  # per split, the file it came from and a digest of what was read (None: not recorded)
    settings: dict | None  # the TrainSettings it trained with (None: not recorded)
    run_id: str | None  # the weights file's metadata holds the same (None: neither records one)
    multi_label: bool  # --multi-label: a sigmoid per label (False: one label per text, a softmax)
    threshold: float | None  # --multi-label: a label is predicted at this probability or above
    pooling: str  # what the head reads: "last" (each text's last token) or "mean" (of its tokens; --pooling)
    path: Path | None = field(default=None, compare=False)

    def model_config(self) -> LlamaConfig:
        return LlamaConfig.from_hf_dict(self.config, source=str(self.path))

    def to_json(self) -> dict:
        """The record as written: its version, then every key in the order of the fields (null where none)."""
        record = {k: getattr(self, k) for k in RECORD_KEYS}
        return versioned(record | {"lora": self.lora.to_json() if self.lora else None}, RECORD_VERSION)

    def find_base(self, override: str | Path | None) -> str:
        """The base checkpoint: `--model` if given; else as recorded, relative to the run (a run moved together with
        its weights), then absolute, then the Hub repo it came from (or the preset); a clear error naming --model
        otherwise. A reference for `sources` to make local: nothing is fetched here."""
        run_dir = self.path.parent
        if override is not None:
            if not Path(override).exists():
                raise FileNotFoundError(f"--model {override}: no such file or directory")
            return str(override)
        candidates = [run_dir / self.base_model_relative] if self.base_model_relative else []
        candidates.append(Path(self.base_model))
        for path in candidates:
            if path.exists():
                return str(path)
        if self.base_model in PRESETS or self.base_model_repo:
            return self.base_model_repo or self.base_model
        raise FileNotFoundError(
            f"the base model of {run_dir} is no longer at {self.base_model} (moved or deleted?); pass --model PATH "
            "to point at its checkpoint directory"
        )


RECORD_KEYS = tuple(f.name for f in dataclasses.fields(RunRecord) if f.name != "path")  # the file's, in order


def base_model_fields(model_ref: str, repo_id: str | None, out: Path) -> dict:
    """Where a run finds its base model again: the path as given (absolute), the path relative to the run (a run
    moved together with its weights still works), and the Hub repo id it came from, if any."""
    path = Path(model_ref)
    if not path.exists():  # a preset: nothing on disk
        return {"base_model": model_ref, "base_model_relative": None, "base_model_repo": None}
    relative = os.path.relpath(path.resolve(), out.resolve())
    return {"base_model": str(path.resolve()), "base_model_relative": relative, "base_model_repo": repo_id or None}


def new_record(
    *,
    model_ref: str,
    repo_id: str | None,
    out: Path,
    from_scratch: bool,
    config: LlamaConfig,
    label_names: list[str],
    train_last: int | None,
    lora: LoRASettings | None,
    lora_blocks: list[int],
    tokenizer: str,
    max_length: int,
    dtype: torch.dtype,
    settings: object,
    quantize: str | None = None,
    data: dict | None = None,
    multi_label: bool = False,
    threshold: float | None = None,
    pooling: str = "last",
) -> RunRecord:
    """The record of a run writing its results into `out` (the run id is added when they are written). `settings`
    is the dataclass the run trained with (TrainSettings), recorded field by field."""
    return RunRecord(
        **base_model_fields(model_ref, repo_id, out),
        weights_include_backbone=from_scratch,
        config=config.to_hf_dict(),
        num_classes=len(label_names),
        label_names=list(label_names),
        train_last=train_last,
        lora=RecordedLoRA(lora, tuple(lora_blocks)) if lora else None,
        tokenizer=tokenizer,
        max_length=max_length,
        dtype=str(dtype).removeprefix("torch."),
        quantize=quantize,
        data=data,
        settings=dataclasses.asdict(settings),
        run_id=None,  # `write_results` adds it, with the other results
        multi_label=multi_label,
        threshold=threshold,
        pooling=pooling,
    )


def write_record(out: Path, record: RunRecord) -> Path:
    """classifier.json in `out`, atomically: a reader finds the whole record or none."""
    path = out / RECORD_FILE
    write_text_atomic(path, json.dumps(record.to_json(), indent=2) + "\n")
    return path


def read_run(run_dir: Path) -> RunRecord:
    """A finished run's record, checked against its weights file; cheap, so bad input fails before the model
    loads (classify needs the label names to read a labelled file)."""
    record_path, weights_path = run_dir / RECORD_FILE, run_dir / WEIGHTS_FILE
    if not run_dir.is_dir():  # a misspelt `runs/lastest` is not there at all: say that, not which file is missing
        raise FileNotFoundError(
            f"--checkpoint {run_dir}: {'not a directory' if run_dir.exists() else 'no such directory'}"
        )
    if (run_dir / "config.json").is_file() and not record_path.is_file():
        raise FileNotFoundError(
            f"--checkpoint {run_dir} is a model checkpoint, not a fine-tuning run's folder: --checkpoint takes "
            "the --output of finetune_classifier (runs/latest: the newest run)"
        )
    if (run_dir / RUN_MARKER).is_file() and not record_path.is_file():  # started, not finished (or still running)
        raise FileNotFoundError(f"{run_dir} holds an unfinished run: finish it with finetune_classifier --resume")
    for path in (record_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: is {run_dir} the --output of a finished fine-tuning run?")
    return read_record(record_path, weights_path)


def read_record(record_path: Path, weights_path: Path) -> RunRecord:
    """classifier.json, brought to the current shape (`UPGRADES`; a newer version is refused), checked to hold
    what loading needs, with the types a run writes, and to come from the same run as the weights file."""
    try:
        meta = json.loads(record_path.read_text(encoding="utf-8"))
        with safe_open(weights_path, framework="pt") as f:
            weights_run = (f.metadata() or {}).get("run_id")  # safetensors metadata: absent unless a run set it
    except (UnicodeDecodeError, json.JSONDecodeError, SafetensorError) as e:
        raise CheckpointError(f"{record_path.parent}: unreadable run files: {e}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{record_path} is not a classifier description (it lacks {', '.join(REQUIRED_KEYS)})")
    meta = upgraded(meta, record_path, RECORD_VERSION, UPGRADES)
    if missing := [k for k in RECORD_KEYS if k not in meta]:
        raise CheckpointError(f"{record_path} is not a classifier description (it lacks {', '.join(missing)})")
    if wrong := wrong_types(meta):
        raise CheckpointError(f"{record_path}: {', '.join(wrong)} not as a finished run writes them")
    if meta["run_id"] != weights_run:  # a record that names no run id matches only weights that name none
        raise CheckpointError(
            f"{record_path.parent}: {RECORD_FILE} and {WEIGHTS_FILE} come from different runs (run ids "
            f"{meta['run_id']} and {weights_run}); train again into a new --output"
        )
    return RunRecord(
        **{k: meta[k] for k in RECORD_KEYS} | {"lora": RecordedLoRA.from_json(meta["lora"], record_path)},
        path=record_path,
    )


def wrong_types(meta: dict) -> list[str]:
    """The keys of a record that do not have the type a run writes (a hand-edited or foreign file); "lora" is
    checked as it is read (`RecordedLoRA.from_json`)."""
    kinds = {
        "base_model": str,
        "weights_include_backbone": bool,
        "config": dict,
        "num_classes": int,
        "label_names": list,
        "tokenizer": str,
        "max_length": int,
        "dtype": str,
    }
    wrong = [k for k, kind in kinds.items() if not isinstance(meta[k], kind) or (kind is int and meta[k] is True)]
    if not ("num_classes" in wrong or "label_names" in wrong):
        if meta["num_classes"] < 2 or len(meta["label_names"]) != meta["num_classes"]:
            wrong.append("num_classes/label_names")
        elif not all(isinstance(n, str) for n in meta["label_names"]):
            wrong.append("label_names")
    if not (meta["train_last"] is None or type(meta["train_last"]) is int):
        wrong.append("train_last")
    optional = {"base_model_relative": str, "base_model_repo": str, "settings": dict, "run_id": str, "data": dict}
    wrong += [k for k, kind in optional.items() if meta[k] is not None and not isinstance(meta[k], kind)]
    if meta["quantize"] not in (None, *QUANTIZE_KINDS):
        wrong.append("quantize")
    if type(meta["multi_label"]) is not bool:
        wrong.append("multi_label")
    elif meta["multi_label"] and not (type(meta["threshold"]) is float and 0 < meta["threshold"] < 1):
        wrong.append("threshold")  # a multi-label run's labels are decided by it: a number between 0 and 1
    elif not meta["multi_label"] and meta["threshold"] is not None:
        wrong.append("threshold")
    if meta["pooling"] not in POOLINGS:
        wrong.append("pooling")
    return wrong

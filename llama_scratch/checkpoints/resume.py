"""Resume points: everything an interrupted run needs to continue exactly, in one safetensors file, no pickle.

`torch.save` writes a pickle, and `torch.load` of a pickle can run any code the file's author chose: a run folder
someone hands you must never be able to do that. So a resume point is a safetensors file (tensors only, with a
plain-JSON header): the trained parameters, the optimizer's moments and the random-number state are tensors;
the counters, settings and schedule go as JSON in the file's metadata. Reading it back parses JSON and copies
bytes, nothing else. It holds only what training changes (the frozen backbone is reloaded from its checkpoint),
each tensor written with just its own bytes.

The file is written like every other (`atomic.write_atomic`: temporary name, fsync, rename), so a crash or a full
disk mid-save leaves the previous resume point intact and no temporary file behind.

The record carries a schema version (`VERSION`; a point without one is version 1). Reading brings an older point
up to date one version at a time (`UPGRADES`), so that the loop reads one shape only; a newer one is refused in one
line naming its version, never half-read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .hf_layout import tensors_to_write, write_safetensors
from .weights import copy_named_tensors

FORMAT = "llama_scratch resume point v1"  # what kind of file this is; its schema's version is VERSION
VERSION = 3

# How a changed setting is named in the refusal: a command-line flag where there is one.
_WHAT = {
    "data_digest": "the data (texts or labels)",
    "world_size": "the number of processes",
    "label_names": "the label names",
    "num_classes": "the number of classes",
    "val_digest": "the --val-data file (texts or labels)",
    "test_digest": "the --test-data file (texts or labels)",
}


class ResumeError(ValueError):
    """A resume point that cannot be used: unreadable, from another version, or from a run with other settings."""


def _encode(value, tensors: dict[str, torch.Tensor]):
    """JSON for `value`, with each tensor replaced by a reference to an entry of `tensors` (filled here)."""
    if isinstance(value, torch.Tensor):
        if hasattr(value, "to_local"):  # a sharded tensor (sharding.py): this process saves its own rows
            value = value.to_local().clone()
        name = f"t{len(tensors)}"
        tensors[name] = value.detach().cpu().contiguous()
        return {"__tensor__": name}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _encode(v, tensors) for k, v in value.items()}
        if all(isinstance(k, int) for k in value):  # the optimizer numbers its parameters
            return {"__int_keys__": {str(k): _encode(v, tensors) for k, v in value.items()}}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"a resume point cannot hold a {type(value).__name__}")


def _decode(value, tensors):
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if value.keys() == {"__tensor__"}:
        return tensors[value["__tensor__"]]
    if value.keys() == {"__tuple__"}:
        return tuple(_decode(v, tensors) for v in value["__tuple__"])
    if value.keys() == {"__int_keys__"}:
        return {int(k): _decode(v, tensors) for k, v in value["__int_keys__"].items()}
    return {k: _decode(v, tensors) for k, v in value.items()}


def write_point(path: Path, trained: dict[str, torch.Tensor], optimizer, scheduler, **plain) -> Path:
    """Write trained parameters, optimizer and scheduler state, the RNG, and `plain` JSON values (state, settings,
    identity) to `path`, atomically."""
    tensors: dict[str, torch.Tensor] = {}
    record = {
        "format": FORMAT,
        "version": VERSION,
        "trained": _encode(dict(trained), tensors),
        "optimizer": _encode(optimizer.state_dict(), tensors),
        "scheduler": _encode(scheduler.state_dict(), tensors),
        "rng": _encode(torch.get_rng_state(), tensors),
        # The GPU's own generator (dropout on CUDA draws from it), for the device this process computes on.
        "cuda_rng": _encode(torch.cuda.get_rng_state(), tensors) if torch.cuda.is_initialized() else None,
        **plain,
    }
    metadata = {"llama_scratch": json.dumps(record)}
    return write_safetensors(path, tensors_to_write(tensors), metadata)


def read_raw(path: Path, tensors: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """The JSON record `write_point` wrote and the file's tensors by name (none with `tensors=False`: only the
    header is read), not yet put together: the form rank 0 sends to processes that do not see its disk, JSON as
    bytes and tensors one by one (strategy.Replicated.read_resume). Never unpickles."""
    try:
        with safe_open(path, framework="pt") as f:
            record = json.loads((f.metadata() or {}).get("llama_scratch", "null"))
            if not isinstance(record, dict) or record.get("format") != FORMAT:
                raise ResumeError(f"{path} is not a llama_scratch resume point ({FORMAT})")
            record = upgrade(record, path)
            return record, ({name: f.get_tensor(name) for name in f.keys()} if tensors else {})  # noqa: SIM118
    except (SafetensorError, OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ResumeError(f"{path} is not a readable resume point: {e}") from None


def _from_v1(record: dict) -> None:
    """Version 1 (no `version` key) to 2: what points written before these fields existed meant by their absence.
    - settings `select_by`: a point from before --select-by kept the weights of the best accuracy;
    - identity `multi_label`: a point the command wrote (its identity names the data) from before --multi-label had
      one label a text (a library caller's identity holds only what it gave, and stays as it is);
    - state `best_step`: a point from before it evaluated once an epoch, at the epoch's end: the kept weights are
      those of the last history row of `best_epoch`."""
    settings, identity, state = (record.get(k) for k in ("settings", "identity", "state"))
    if isinstance(settings, dict):
        settings.setdefault("select_by", "accuracy")
    if isinstance(identity, dict) and "data_digest" in identity:
        identity.setdefault("multi_label", False)
    if isinstance(state, dict) and state.get("best_step", -1) == -1 and state.get("best_epoch", -1) != -1:
        rows = [r for r in state.get("history", []) if isinstance(r, dict) and r.get("epoch") == state["best_epoch"]]
        if rows and "step" in rows[-1]:
            state["best_step"] = rows[-1]["step"]


def _from_v2(record: dict) -> None:
    """Version 2 to 3: identity `pooling` (--pooling) added; a point the command wrote before it pooled each text's
    last token."""
    identity = record.get("identity")
    if isinstance(identity, dict) and "data_digest" in identity:
        identity.setdefault("pooling", "last")


# From each version to the next, in place: a point of version v goes through UPGRADES[v], UPGRADES[v + 1], ...
UPGRADES = {1: _from_v1, 2: _from_v2}


def upgrade(record: dict, path: Path) -> dict:
    """`record` brought to `VERSION`, one step per version; a newer (or malformed) version refused in one line."""
    version = record.get("version", 1)
    if type(version) is not int or version < 1:
        raise ResumeError(f"{path} has a resume point version of {version!r}, not a number this version reads")
    if version > VERSION:
        raise ResumeError(
            f"{path} is a resume point of version {version}, newer than this llama_scratch reads (up to "
            f"{VERSION}): resume it with the version that wrote it"
        )
    for v in range(version, VERSION):
        UPGRADES[v](record)
    record["version"] = VERSION
    return record


def decode(record: dict, tensors: dict[str, torch.Tensor], path: Path) -> dict:
    """`read_raw`'s record with each tensor reference replaced by its tensor."""
    try:
        return _decode(record, tensors)
    except (KeyError, TypeError, AttributeError) as e:
        raise ResumeError(f"{path} is not a readable resume point: {e!r}") from None


def read_point(path: Path, tensors: bool = True) -> dict:
    """The record `write_point` wrote, tensors included (or, with `tensors=False`, only its JSON: counters, settings
    and identity, read from the header without touching the tensors' bytes). Never unpickles."""
    record, named = read_raw(path, tensors)
    return decode(record, named, path) if tensors else record


def check_same_run(path: Path, saved: dict, now: dict) -> None:
    """Refuse, naming each difference, when the run being resumed was started with other settings or data."""
    changed = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
    changed |= {k: (v, None) for k, v in saved.items() if k not in now}
    if changed:
        detail = "; ".join(
            f"{_WHAT.get(k, '--' + k.replace('_', '-'))} was {a!r}, now {b!r}" for k, (a, b) in changed.items()
        )
        raise ResumeError(f"{path} belongs to a run with other settings ({detail}); resume with the same settings")


def restore(record: dict, model: nn.Module, optimizer, scheduler, path: Path) -> None:
    """Put the trained tensors, optimizer and scheduler state and the RNG back, after checking names and shapes."""
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    copy_named_tensors(model, record["trained"], str(path), required=trained)
    try:
        kernels = [{k: g.get(k) for k in ("fused", "foreach")} for g in optimizer.param_groups]
        optimizer.load_state_dict(record["optimizer"])
        for group, kernel in zip(optimizer.param_groups, kernels, strict=True):  # this run's kernel, not the saved
            group.update(kernel)  # one's (a point from an older version would step one tensor at a time)
        scheduler.load_state_dict(record["scheduler"])
        torch.set_rng_state(record["rng"])
        if record.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(record["cuda_rng"])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise ResumeError(f"{path}: the optimizer state does not fit this run: {e}") from None

"""The weights of an export: the base checkpoint with a run's trained tensors over it and its LoRA adapters merged
in, written as the shards of a Hugging Face `LlamaForSequenceClassification`, one tensor at a time.

Every output tensor is planned from safetensors headers first (its name, its shape, which bytes it is made of), so
names, shapes and coverage are checked before anything is written, and each shard's header is known before its
data. Then each tensor is read, merged, cast and written before the next one is read: the process holds one tensor
(and its adapters) at a time, never a shard and never the model.

A run trained over a quantized base (`--quantize nf4|int8`, classifier.json's "quantize") needs nothing else here:
the base tensors are read from the base's own full-precision checkpoint, never from quantized values, so the export
is the full-precision base plus what trained (adapters merged). It differs from the quantized model `classify`
runs by the quantization error, and it is what an unquantized rebuild of the run computes
(tests/model/test_quantize.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model.config import LlamaConfig
from ..model.llama import Llama
from ..model.lora import merged_weight
from .atomic import write_text_atomic
from .hf_layout import (
    IGNORABLE,
    CheckpointError,
    TensorInfo,
    TensorToWrite,
    find_checkpoint_files,
    hf_to_ours,
    ours_to_hf,
    read_header,
    read_tensor,
    write_safetensors,
)
from .run_record import RecordedLoRA

HEAD = "score.weight"  # transformers' name for the classification head of LlamaForSequenceClassification
INDEX = "model.safetensors.index.json"
# An adapter of one projection, as a LoRA run saves it: backbone.blocks.{i}.{path}.lora_a / .lora_b
_ADAPTER = re.compile(r"backbone\.(?P<module>blocks\.\d+\..+)\.lora_(?P<part>[ab])")


@dataclass(frozen=True)
class Planned:
    """One output tensor: its name and shape, the file entry it starts from, and the adapter merged into it."""

    name: str
    shape: tuple[int, ...]
    source: TensorInfo
    adapter: tuple[TensorInfo, TensorInfo] | None = None  # (lora_a, lora_b)


def expected_shapes(cfg: LlamaConfig, num_classes: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the exported model in model order, Hugging Face names: the backbone without lm_head, and
    the head. Read off a model on the meta device, so they cannot drift from `model.py`."""
    with torch.device("meta"):
        model = Llama(dataclasses.replace(cfg, dtype=torch.float32))
    shapes = {ours_to_hf(n): tuple(p.shape) for n, p in model.named_parameters() if n != "lm_head.weight"}
    return shapes | {HEAD: (num_classes, cfg.dim)}


def base_tensors(base: Path) -> dict[str, TensorInfo]:
    """The base checkpoint's tensors by Hugging Face name; lm_head and recomputed rotary tables are left out."""
    found: dict[str, TensorInfo] = {}
    for file in find_checkpoint_files(base):
        for e in read_header(file).values():
            ours = hf_to_ours(e.name)
            if ours == "lm_head.weight" or (ours is None and IGNORABLE.fullmatch(e.name)):
                continue
            name = ours_to_hf(ours) if ours else e.name  # an unknown name is kept: the plan reports it
            if name in found:
                raise CheckpointError(f"{e.name} appears twice: in {found[name].file} and in {file}")
            found[name] = e
    return found


def run_tensors(weights: Path) -> tuple[dict[str, TensorInfo], dict[str, dict[str, TensorInfo]]]:
    """classifier.safetensors by Hugging Face name, and its LoRA adapters by the name of the weight they adapt."""
    trained: dict[str, TensorInfo] = {}
    adapters: dict[str, dict[str, TensorInfo]] = {}
    for name, e in read_header(weights).items():
        if m := _ADAPTER.fullmatch(name):
            target = ours_to_hf(m["module"] + ".weight") or name
            adapters.setdefault(target, {})[m["part"]] = e
        elif name == "head.weight":
            trained[HEAD] = e
        elif name != "backbone.lm_head.weight":  # a tied duplicate or the frozen LM head: no part of the export
            ours = name.removeprefix("backbone.")
            trained[(ours_to_hf(ours) if name.startswith("backbone.") else None) or name] = e
    return trained, adapters


def plan_export(
    cfg: LlamaConfig, num_classes: int, weights: Path, base: Path | None, lora: RecordedLoRA | None
) -> list[Planned]:
    """Each output tensor with its sources: the run's trained tensor, else the base's; every problem (a tensor
    missing, unknown or of the wrong shape, an adapter that does not fit) in one CheckpointError."""
    expected = expected_shapes(cfg, num_classes)
    trained, adapters = run_tensors(weights)
    sources = {**(base_tensors(base) if base is not None else {}), **trained}
    problems = [f"missing {n} {list(s)}" for n, s in expected.items() if n not in sources]
    problems += [f"unknown tensor {e.name} in {e.file}" for n, e in sources.items() if n not in expected]
    problems += [
        f"{e.name} in {e.file} is {list(e.shape)}, the model's {n} is {list(expected[n])}"
        for n, e in sources.items()
        if n in expected and e.shape != expected[n]
    ]
    problems += adapter_problems(adapters, lora, expected, weights)
    if problems:
        shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        raise CheckpointError(f"cannot export {weights.parent}: {shown}")
    return [
        Planned(n, s, sources[n], (adapters[n]["a"], adapters[n]["b"]) if n in adapters else None)
        for n, s in expected.items()
    ]


def adapter_problems(
    adapters: dict[str, dict[str, TensorInfo]],
    lora: RecordedLoRA | None,
    expected: dict[str, tuple[int, ...]],
    weights: Path,
) -> list[str]:
    """What keeps the adapters from an exact merge: settings and tensors that disagree, a half, a wrong shape."""
    if lora is None:
        return [f"{weights} holds LoRA adapters but classifier.json has no 'lora' settings"] if adapters else []
    if not adapters:
        return [f"classifier.json describes LoRA adapters but {weights} holds none"]
    problems, described, inner = [], lora.modules(), lora.settings.rank  # inner: the adapters' shared width
    for name, parts in adapters.items():
        a, b = parts.get("a"), parts.get("b")
        m = _ADAPTER.fullmatch((a or b).name)
        if a is None or b is None:
            problems.append(f"{(a or b).name} has no lora_{'b' if b is None else 'a'} beside it")
        elif name not in expected or len(expected[name]) != 2:
            problems.append(f"{a.name} adapts {name}, which is not a projection of the model")
        elif a.shape != (inner, expected[name][1]) or b.shape != (expected[name][0], inner):
            want = f"[{inner}, {expected[name][1]}] and [{expected[name][0]}, {inner}]"
            problems.append(f"{m['module']}: lora_a {list(a.shape)} and lora_b {list(b.shape)}, expected {want}")
        elif m["module"] not in described:
            settings = f"blocks {list(lora.blocks)}, targets {','.join(lora.settings.targets)}"
            problems.append(f"{m['module']} has an adapter that classifier.json's lora settings ({settings}) omit")
    # The other way round: a described adapter missing from the file would export the base weight unchanged.
    found = {_ADAPTER.fullmatch(e.name)["module"] for parts in adapters.values() for e in parts.values()}
    missing = [module for module in described if module not in found]
    problems += [
        f"classifier.json's lora settings describe an adapter on {module}, but {weights} has none" for module in missing
    ]
    return problems


def produce(p: Planned, dtype: torch.dtype, lora: RecordedLoRA | None) -> torch.Tensor:
    """One output tensor, read from its file, its adapter merged in, cast to the export's dtype."""
    t = read_tensor(p.source)
    if p.adapter is not None:
        lora_a, lora_b = (read_tensor(e) for e in p.adapter)
        t = merged_weight(t, lora_a, lora_b, lora.settings.scale)
        del lora_a, lora_b
    return t.to(dtype).contiguous()


def shard(planned: list[Planned], dtype: torch.dtype, max_shard_bytes: int) -> list[list[Planned]]:
    """Consecutive tensors in shards of at most `max_shard_bytes` (a larger tensor gets a shard of its own)."""
    shards: list[list[Planned]] = [[]]
    size = 0
    for p in planned:
        nbytes = math.prod(p.shape) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += nbytes
    return shards


def write_weights(
    out: Path, planned: list[Planned], dtype: torch.dtype, lora: RecordedLoRA | None, max_shard_bytes: int, log=print
) -> list[str]:
    """model.safetensors, or shards and their index, in `out`; returns the file names written."""
    shards = shard(planned, dtype, max_shard_bytes)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for items, name in zip(shards, names, strict=True):
        log(f"writing {name} ({len(items)} tensors)")
        entries = [TensorToWrite(p.name, tuple(p.shape), dtype, lambda p=p: produce(p, dtype, lora)) for p in items]
        write_safetensors(out / name, entries)
    if len(shards) == 1:
        return names
    total = sum(math.prod(p.shape) * dtype.itemsize for p in planned)
    weight_map = {p.name: name for items, name in zip(shards, names, strict=True) for p in items}
    write_text_atomic(
        out / INDEX, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    return [*names, INDEX]

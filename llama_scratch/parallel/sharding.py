"""Sharded training (FSDP2, `--shard`): each of N processes holds 1/N of every parameter, gradient and optimizer
moment, so a model N times larger than one GPU can train.

DistributedDataParallel (distributed.py) keeps a whole replica in every process. FSDP2 (`fully_shard`) keeps
only rows: parameter p of shape [n, ...] becomes a DTensor whose local part on process r is rows
[r * ceil(n / N), (r + 1) * ceil(n / N)) (the last process may hold fewer, or none). Around each block's forward
and backward it all-gathers the block's full parameters, runs it, and frees them again; after backward it
reduce-scatters the gradients, so each process keeps the gradient rows of its own parameter rows. The optimizer
steps local rows only. At any moment a process holds its shards plus one or two blocks in full.

This module shards a classifier, loads a checkpoint straight into the shards (each process reads only its own
rows of each tensor from the files), and moves tensors between the sharded and the full form one at a time:
to save the trained parameters on rank 0, to read the best weights back, and to resume.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from ..checkpoints.hf_layout import TensorInfo, TensorToWrite, find_checkpoint_files, read_into, write_safetensors
from ..checkpoints.progress import progress_bar
from ..checkpoints.weights import CheckpointError, LoadReport, match_tensors
from ..model.classifier import LlamaClassifier, new_head
from ..model.config import LlamaConfig
from ..model.llama import Llama, RMSNorm
from ..model.lora import LoRASettings, lora_layers, new_adapters
from ..sources.resolve import trains_from_scratch
from . import distributed
from .distributed import Processes

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# torch.distributed.fsdp and torch.distributed.tensor are imported where they are used: together they add about a
# second to every command's start, which runs that shard nothing need not pay (is_dtensor).


def is_dtensor(t) -> bool:
    """Whether `t` is sharded (a DTensor). Nothing is one unless the distributed-tensor package was imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def make_mesh(processes: Processes, device: torch.device, shard_group: int | None = None) -> DeviceMesh:
    """The processes as a device mesh: one dimension ("shard") of all N, or with `shard_group` G a 2-D mesh of
    N / G replicas x G shards (hybrid sharding: shards within a node of G GPUs over its fast links, replicas across
    nodes, whose links only carry the gradient all-reduce)."""
    from torch.distributed.device_mesh import init_device_mesh

    world_size = processes.world_size
    if shard_group is None or shard_group == world_size:
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    if shard_group < 1 or world_size % shard_group:
        raise ValueError(f"--shard-group {shard_group} must divide the number of processes ({world_size})")
    shape = (world_size // shard_group, shard_group)
    return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))


def shard_model(clf: LlamaClassifier, mesh: DeviceMesh, reduce_dtype: torch.dtype = torch.float32) -> None:
    """`fully_shard` every block and the embedding, then the root (final norm, head): each group's parameters are
    gathered for its own forward and backward only.

    Mixed precision: parameters stay in the dtype they were loaded in (bfloat16 on a GPU) and compute in it; the
    gradients are reduced in `reduce_dtype` (float32: a sum of N bfloat16 gradients would lose the small ones),
    then kept in the parameter's dtype, where the optimizer's float32 masters (optim.py) pick them up.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype)
    backbone = clf.backbone
    # Untied, the embedding goes on its own, so that it is gathered only around its own forward and backward, and so
    # does the unused next-token projection: never called, never gathered. Tied, they are one parameter, which must
    # stay in one group (the root).
    untied = [] if backbone.cfg.tie_embeddings else [backbone.embed_tokens, backbone.lm_head]
    groups = [*backbone.blocks, *untied]
    for module in groups:
        fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(clf, mesh=mesh, mp_policy=policy)  # the rest: final norm and head
    # The frozen-prefix pass (prefix_cache) enters through this method instead of forward: the same hooks.
    register_fsdp_forward_method(clf, "frozen_prefix")


def sharded_classifier(
    ref: str,
    dtype: torch.dtype,
    num_classes: int,
    train_last: int | None,
    lora: LoRASettings | None,
    mesh: DeviceMesh,
    device: torch.device,
    progress: bool,
) -> LlamaClassifier:
    """The classifier built on the meta device, sharded, then filled: from a checkpoint, each process reads only its
    rows (`load_sharded`); a preset's random weights are drawn tensor by tensor, each process keeping its rows
    (`draw_sharded`). No process ever holds the whole model."""
    from_scratch = trains_from_scratch(ref)
    cfg = LlamaConfig.from_name(ref) if from_scratch else LlamaConfig.from_hf(ref)
    cfg = dataclasses.replace(cfg, dtype=dtype)
    with torch.device("meta"):
        clf = LlamaClassifier(Llama(cfg), num_classes, train_last, lora)
    if from_scratch:
        shard_model(clf, mesh)
        draw_sharded(clf, device)
        return clf
    fresh = fresh_values(clf)
    shard_model(clf, mesh)
    load_sharded(clf, ref, device, fresh, progress)
    return clf


def draw_sharded(clf: LlamaClassifier, device: torch.device) -> None:
    """A sharded classifier on the meta device given a preset's random weights, equal to one process's
    (`load_model` on `device`, then `LlamaClassifier`): the generator is drawn from in the same order, with the
    same calls on tensors of the same shapes, on `device`, one whole tensor at a time, each process keeping its
    rows. Peak: this process's shards plus one whole tensor. One process's draws, which this replays: each layer's
    own initialisation as it is built (nn.Linear's Kaiming, nn.Embedding's normal), then Llama's
    `apply(_init_weights)` (children before their parent, a tied embedding drawn again as the next-token
    projection), then the head and the adapters (`fresh_values`)."""
    clf.to_empty(device=device)  # this process's shards, uninitialised; the rotary tables are recomputed
    with torch.no_grad():
        for m in clf.backbone.modules():  # the order they were built in: each drew once, to be overwritten
            if isinstance(m, nn.Linear):
                nn.Linear(m.in_features, m.out_features, bias=False, dtype=m.weight.dtype, device=device)
            elif isinstance(m, nn.Embedding):
                nn.Embedding(m.num_embeddings, m.embedding_dim, dtype=m.weight.dtype, device=device)
        for m in children_first(clf.backbone):
            if isinstance(m, (nn.Linear, nn.Embedding)):  # what model.llama._init_weights draws
                whole = torch.empty(m.weight.shape, dtype=m.weight.dtype, device=device)
                set_from_full(m.weight, nn.init.normal_(whole, mean=0.0, std=0.02))
                del whole
            elif isinstance(m, RMSNorm):
                local(m.weight).fill_(1.0)  # RMSNorm's gains start at one
        for name, value in fresh_values(clf, device).items():
            set_from_full(clf.get_parameter(name), value)


def children_first(module: nn.Module):
    """`module` and all below it in the order `nn.Module.apply` visits them: each module's children, then it."""
    for child in module.children():
        yield from children_first(child)
    yield module


def reshard(model: nn.Module) -> None:
    """Free every gathered parameter, leaving each process its rows. Needed after a forward without backward
    (evaluation): FSDP2 keeps the root's parameters gathered after its forward, for the backward it expects, and
    meanwhile `named_parameters` lists those whole tensors instead of the shards."""
    if not is_sharded(model):  # nothing to free, and no need to import FSDP
        return
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def is_sharded(model: nn.Module) -> bool:
    return any(is_dtensor(p) for p in model.parameters())


def local_rows(t: torch.Tensor) -> tuple[int, int]:
    """The rows [start, stop) of the full tensor that this process holds (all of them for a plain tensor)."""
    n = t.shape[0]
    if not is_dtensor(t):
        return 0, n
    from torch.distributed.tensor import Shard

    start, stop = 0, n
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0:
                raise ValueError(f"only row sharding is supported, got {t.placements}")
            size = math.ceil((stop - start) / t.device_mesh.size(dim))
            start = min(start + t.device_mesh.get_local_rank(dim) * size, stop)
            stop = min(start + size, stop)
    return start, stop


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of `t`: its rows for a DTensor, `t` itself otherwise."""
    return t.to_local() if is_dtensor(t) else t


@torch.no_grad()
def set_from_full(t: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this process's rows of `full` into the (sharded or plain) tensor `t`."""
    start, stop = local_rows(t)
    local(t).copy_(full[start:stop])


def fresh_values(clf: LlamaClassifier, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The head and the LoRA adapters (what no checkpoint holds), drawn on `device` in full exactly as
    LlamaClassifier and LoRALinear draw them on a loaded backbone, in the same order from the same generator: a
    sharded run starts from the weights a single process starts from (tests/parallel/test_sharding.py asserts it)."""
    cfg, head = clf.backbone.cfg, clf.head
    values = {"head.weight": new_head(cfg.dim, head.out_features, head.weight.dtype, device).weight.detach()}
    names = {id(m): name for name, m in clf.named_modules()}
    for layer in lora_layers(clf):
        a, b = new_adapters(layer.rank, layer.in_features, layer.out_features, layer.lora_a.dtype, device)
        values[f"{names[id(layer)]}.lora_a"], values[f"{names[id(layer)]}.lora_b"] = a, b
    return values


def row_slice(e: TensorInfo, start: int, stop: int) -> TensorInfo:
    """The rows [start, stop) of a stored tensor: row-major, so they are one contiguous run of bytes."""
    row_bytes = e.nbytes // max(e.shape[0], 1)
    shape = (stop - start, *e.shape[1:])
    return TensorInfo(e.name, e.file, e.dtype, shape, e.offset + start * row_bytes, (stop - start) * row_bytes)


def load_sharded(
    clf: LlamaClassifier, path, device: torch.device, fresh: dict[str, torch.Tensor], progress: bool = True
) -> LoadReport:
    """Fill a sharded classifier built on the meta device: each process reads from the checkpoint files only its
    own rows of each tensor, one tensor at a time, straight into its shard on `device` (peak memory: its shards
    plus one tensor's rows). Parameters no checkpoint holds come from `fresh` (see `fresh_values`)."""
    started = time.perf_counter()
    files = find_checkpoint_files(path)
    report = LoadReport(files=files)
    params = dict(clf.named_parameters())
    backbone = {n.removeprefix("backbone."): p for n, p in params.items() if n.startswith("backbone.")}
    in_files = {n: p for n, p in backbone.items() if f"backbone.{n}" not in fresh}
    entries, unexpected = match_tensors(files, in_files, report)
    entries.pop("lm_head.weight", None) if "lm_head.weight" not in in_files else None
    missing = [n for n in in_files if n not in entries] + [
        n for n in params if n not in fresh and not n.startswith("backbone.")
    ]
    wrong = [n for n, e in entries.items() if tuple(in_files[n].shape) != e.shape]
    if missing or unexpected or wrong:
        problems = [
            f"missing {', '.join(missing)}" if missing else "",
            f"unexpected {len(unexpected)} tensors" if unexpected else "",
            f"wrong shapes {', '.join(wrong)}" if wrong else "",
        ]
        raise CheckpointError(f"{path}: " + "; ".join(p for p in problems if p))
    clf.to_empty(device=device)  # this process's shards, uninitialised; the rotary tables are recomputed
    for name, value in fresh.items():
        set_from_full(params[name], value)
    total = sum(e.nbytes for e in entries.values())
    with progress_bar(total=total, unit="B", unit_scale=True, desc="loading my shards", disable=not progress) as bar:
        for name, e in sorted(entries.items(), key=lambda kv: (str(kv[1].file), kv[1].offset)):
            start, stop = local_rows(in_files[name])
            part = torch.empty((stop - start, *e.shape[1:]), dtype=e.dtype)
            with open(e.file, "rb", buffering=0) as fh:
                read_into(fh, row_slice(e, start, stop), part)
            with torch.no_grad():
                local(in_files[name]).copy_(part)
            report.loaded += 1
            report.bytes += part.nbytes
            bar.update(e.nbytes)
    report.seconds = time.perf_counter() - started
    return report


def resident_bytes(model: nn.Module) -> int:
    """Bytes of parameters this process holds (its shards under FSDP)."""
    return sum(local(p).numel() * p.element_size() for p in model.parameters())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor, gathered from every process's rows (a collective: every process must call it)."""
    return t.full_tensor() if is_dtensor(t) else t


def gathered(named: dict[str, torch.Tensor], processes: Processes):
    """(name, whole tensor on the CPU) one at a time, in order: on rank 0 the tensor, elsewhere None. Every process
    takes part in each gather; only one whole tensor exists at a time."""
    for name, t in named.items():
        whole = full_tensor(t.detach())
        yield name, (whole.cpu() if processes.is_main else None)
        del whole


def scatter_from_main(
    named: dict[str, torch.Tensor], source: Callable[[str], torch.Tensor] | None, processes: Processes
) -> None:
    """Set each tensor of `named` (sharded or not) to rank 0's `source(name)`: rank 0 sends each
    whole tensor in turn, every process keeps its rows. How the best weights reach every process without a shared
    disk."""
    for name, t in named.items():
        start, stop = local_rows(t)
        whole = (
            source(name).to(t.device, t.dtype)
            if processes.is_main
            else torch.empty(t.shape, dtype=t.dtype, device=local(t).device)
        )
        if processes.several:
            dist.broadcast(whole, src=0)
        with torch.no_grad():
            local(t).copy_(whole[start:stop])
        del whole


def like_param(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A saved local part made a DTensor again, sharded like `param` (plain tensors and scalars pass through)."""
    if not is_dtensor(param) or is_dtensor(value) or value.shape != local(param).shape:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())


def save_gathered(
    named: dict[str, torch.Tensor], path: Path, processes: Processes, metadata: dict | None = None
) -> None:
    """Write `named` (sharded or not) as one safetensors file on rank 0, gathering one tensor at a time: the
    header first (from the shapes), then each whole tensor as it arrives; never the whole model at once. Every
    process must call it (each gather is a collective)."""
    named = distinct(named, processes)
    if processes.is_main:
        meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()}
        entries = [
            TensorToWrite(n, tuple(t.shape), t.dtype, lambda t=t: full_tensor(t.detach())) for n, t in named.items()
        ]
        write_safetensors(path, entries, meta)
    else:
        for t in named.values():
            full_tensor(t.detach())


def distinct(named: dict[str, torch.Tensor], processes: Processes) -> dict[str, torch.Tensor]:
    """`named` with each tensor once, under its first name, as save_weights writes a single process's file. A tied
    embedding is one parameter, but `state_dict()` lists it twice (the embedding and the next-token projection),
    each a separate detached view: told apart by the memory they view, not by the Python object. Rank 0 decides,
    since it holds the first rows of every tensor (a process holding none of two tensors' rows sees two empty
    views alike), and tells the others: every process must gather the same tensors in the same order."""
    keep = None
    if processes.is_main:
        seen: set[tuple] = set()
        keep = []
        for name, t in named.items():
            mine = local(t)
            key = (mine.data_ptr(), mine.dtype, tuple(t.shape), mine.stride())
            if not (mine.numel() and key in seen):
                keep.append(name)
                seen.add(key)
    if processes.several:
        keep = distributed.broadcast_json(keep)
    return {name: named[name] for name in keep}


def read_from_main(named: dict[str, torch.Tensor], path: Path, processes: Processes) -> None:
    """Set `named` to the tensors of rank 0's safetensors file `path`, read there one tensor at a time and
    sent to every process, each keeping its rows: the other processes need not see rank 0's disk."""
    main = processes.is_main
    with safe_open(path, framework="pt") if main else contextlib.nullcontext() as f:
        stored = set(f.keys()) if main else set()
        missing = distributed.broadcast_json([n for n in named if n not in stored] if main else None)
        if missing:  # every process raises alike, none waits in a collective
            raise CheckpointError(f"{path} lacks {', '.join(missing[:5])}")
        scatter_from_main(named, f.get_tensor if main else None, processes)


# --- resume points: each process's part read back (where a point lives: training/resume_points.py) ------------


def as_sharded(record: dict, model: nn.Module, optimizer) -> None:
    """A read part's plain tensors (this process's rows) made DTensors again like the parameters they belong to,
    in place, so that resume.restore can copy them in as for a single process."""
    params = dict(model.named_parameters())
    record["trained"] = {n: like_param(t, params[n]) if n in params else t for n, t in record["trained"].items()}
    state = record["optimizer"]
    stepped = [p for g in optimizer.param_groups for p in g["params"]]
    for i, entry in state.get("state", {}).items():
        if 0 <= i < len(stepped):
            state["state"][i] = {k: like_param(v, stepped[i]) if torch.is_tensor(v) else v for k, v in entry.items()}
    if "master_weights" in state:
        state["master_weights"] = [
            like_param(m, p) for m, p in zip(state["master_weights"], optimizer.masters, strict=True)
        ]

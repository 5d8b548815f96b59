"""Getting weights into a Llama and out again: a streaming loader and atomic saving (the file layout: checkpoint_files).

The loader never holds a second copy of the model. It reads the safetensors headers first (a few kilobytes), checks
every name and shape against the model, and only then streams the tensors one at a time, in file order, each
straight into its final place on the target device. Peak memory is the model plus at most one tensor, by
construction, whether the model was built on the meta device (the normal case) or already materialized.

On CPU, when the file already holds the parameter's dtype, there is nothing to convert or move, and the parameter
becomes a private memory map of its bytes in the file: no copy at all, the page cache and the model share the same
memory, pages come in from the page cache (or disk) on first use, and a write (training) copies just that page.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..model.config import LlamaConfig
from ..model.llama import Llama
from ..model.quantize import QuantizedLinear, quantize_linears
from .atomic import write_text_atomic
from .hf_layout import (
    IGNORABLE,
    CheckpointError,
    TensorInfo,
    find_checkpoint_files,
    hf_to_ours,
    ours_to_hf,
    read_header,
    read_into,
    tensors_to_write,
    write_safetensors,
)
from .progress import progress_bar

# --- loading -------------------------------------------------------------------------------------------------------


@dataclass
class LoadReport:
    """What `load_weights` did: how many tensors and bytes it loaded, and what it left out and why."""

    loaded: int = 0
    bytes: int = 0
    seconds: float = 0.0
    files: list[Path] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # tensors in the files that were not loaded, with the reason
    missing: list[str] = field(default_factory=list)  # parameters the files lacked (only with strict=False)

    def __str__(self) -> str:
        s = f"loaded {self.loaded} tensors ({self.bytes / 2**30:.2f} GiB) from {len(self.files)} file(s)"
        s += f" in {self.seconds:.1f} s"
        if self.skipped:
            s += f"; skipped {len(self.skipped)}: {', '.join(self.skipped)}"
        if self.missing:
            s += f"; missing {len(self.missing)}: {', '.join(self.missing)}"
        return s


def load_weights(
    model: Llama,
    path: str | Path,
    device: str | torch.device | None = None,
    strict: bool = True,
    progress: bool | None = None,
    mmap: bool = True,
    quantize: str | None = None,
    keep_last: int = 0,
) -> LoadReport:
    """Stream a checkpoint's tensors into `model`, one at a time, converting each to its parameter's dtype.

    A parameter on the meta device (or on another device than `device`) gets a fresh tensor on `device`, filled
    from the file and put in place under every alias (tied embeddings stay tied); a materialized parameter already
    on `device` is overwritten in place, keeping its identity (optimizer and DDP references stay valid). Bytes are
    read straight into a CPU parameter of the file's dtype, otherwise through one temporary CPU tensor; with `mmap`,
    a new CPU parameter of the file's dtype maps the file instead (see the module docstring; pass False if the files
    may be overwritten in place while the model lives). `device` None: where the parameters are, CPU for meta ones.

    With `strict`, missing, unexpected and wrongly shaped tensors are all reported in one CheckpointError before
    any data is read; without, they are skipped and the missing parameters initialized as for training (listed in
    the report). `progress` None shows the bar on rank 0 only (the RANK environment variable).

    `quantize` "nf4" or "int8": the linear layers of every block but the last `keep_last`, and an untied LM head,
    become `QuantizedLinear` (model/quantize.py) and are quantized as they stream in, a few rows at a time on the
    target device, so their full-precision weights never exist whole (a model built on the meta device). The
    embedding and the norms load as they are. A model that already holds QuantizedLinear layers is filled alike.
    """
    start = time.perf_counter()
    files = find_checkpoint_files(path)
    report = LoadReport(files=files)
    if quantize is not None:
        quantize_linears(model, quantize, keep_last)
    params: dict = dict(model.named_parameters())  # a tied lm_head.weight is not listed: it is embed_tokens.weight
    # A quantized layer's weight is a target as a parameter is: named, shaped, filled by `_load_one`.
    params |= {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    entries, unexpected = match_tensors(files, params, report)
    tied_head = entries.pop("lm_head.weight", None) if "lm_head.weight" not in params else None
    missing = [n for n in params if n not in entries]
    wrong = [n for n, e in entries.items() if tuple(params[n].shape) != e.shape]
    if strict and (missing or unexpected or wrong):
        raise CheckpointError(_describe(path, params, entries, missing, unexpected, wrong))
    for n in wrong:  # strict=False: the parameter is treated as missing
        e = entries.pop(n)
        report.skipped.append(f"{e.name} (shape {list(e.shape)}, expected {list(params[n].shape)})")
        missing.append(n)
    report.skipped += [f"{e.name} (not a model parameter)" for e in unexpected]

    device = _normalize(device)
    aliases = _aliases(model)
    show = progress if progress is not None else int(os.environ.get("RANK", "0")) == 0
    _allocate_quantized(params.values(), device)
    _stream(files, entries, params, aliases, device, mmap, show, report)
    if quantize is not None and (device is None or device.type == "cpu"):
        return_freed_host_memory()
    if tied_head is not None:
        _check_tied_head(tied_head, model.embed_tokens.weight, strict, report)
    for name in missing:
        report.missing.append(name)
        _init_missing(params[name], aliases, device)
    _materialize_buffers(model, device or model.embed_tokens.weight.device)
    report.seconds = time.perf_counter() - start
    return report


def _allocate_quantized(targets: Iterable, device: torch.device | None) -> None:
    """Every quantized layer's codes and scales allocated on the target device now, before any weight is read.

    Allocated one layer at a time as the stream reaches it, on the CPU, each new layer's buffers land among the
    heap holes that the previous chunks' temporaries left (glibc serves blocks of these sizes from its heap once
    large blocks have been freed, and its heap shrinks from the top only): holes split this way no longer fit the
    next chunk's temporaries, which grow the heap instead, and the load's resident memory climbs far above what
    it ends with. Allocated first, together, the buffers stay apart from the temporaries, which then reuse the same
    few holes chunk after chunk."""
    for layer in targets:
        if isinstance(layer, QuantizedLinear) and (layer.codes.is_meta or device not in (None, layer.codes.device)):
            layer.to_empty(device=device or torch.device("cpu"))


def return_freed_host_memory() -> None:
    """Hand the C library's freed heap pages back to the system (glibc's `malloc_trim`; nothing elsewhere).

    Quantizing on the CPU frees a row chunk's temporaries (tens of MB) after every few rows, between the quantized
    weights, which stay. glibc keeps such holes in its heap instead of returning them: about 32 MiB a block, 1 GiB
    over Llama-3-8B's 32 (RSS 0.398x the checkpoint against 0.328x of arithmetic, benchmarks/RESULTS.md)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, Windows, musl): their allocators return memory their own way
        return
    libc.malloc_trim(0)


# The load bar: bytes loaded of the total (what the bar fills by), tensors, seconds so far. No rate and no time left:
# a memory-mapped file "loads" at tens of GB/s (its pages are read later, when first used), a figure nobody can use.
LOAD_BAR = "{desc}: {percentage:3.0f}%|{bar:20}| {n_fmt}B of {total_fmt}B{postfix} [{elapsed_s:.1f} s]"


def _stream(
    files: list[Path], entries: dict, params: dict, aliases: dict, device, mmap: bool, show: bool, report: LoadReport
) -> None:
    """Every tensor into its parameter, file by file in the order the bytes lie on disk, with a progress bar."""
    total = sum(e.nbytes for e in entries.values())
    # A quantized weight passes a few rows at a time (_quantize_streamed): the pinned buffers need not hold it.
    whole = [e.nbytes for n, e in entries.items() if not isinstance(params[n], QuantizedLinear)]
    staging = Staging(max(whole, default=0), device)
    bar = progress_bar(total=total, unit_scale=True, desc="loading weights", bar_format=LOAD_BAR, disable=not show)
    try:
        for file in files:
            todo = sorted((e.offset, n) for n, e in entries.items() if e.file == file)
            mapped: list[torch.UntypedStorage] = []  # the whole file, mapped privately on first need
            with open(file, "rb", buffering=0) as fh:
                for _, name in todo:
                    _load_one(fh, entries[name], params[name], aliases, device, mapped if mmap else None, staging)
                    report.loaded += 1
                    report.bytes += entries[name].nbytes
                    bar.set_postfix_str(f"{report.loaded} of {len(entries)} tensors", refresh=False)
                    bar.update(entries[name].nbytes)
    finally:  # after an error too: the copies under way end before their buffers are given back
        staging.finish()
        bar.close()


def match_tensors(
    files: list[Path], params: dict, report: LoadReport
) -> tuple[dict[str, TensorInfo], list[TensorInfo]]:
    """Map every tensor in the files to a parameter name; set aside the ignorable and the unknown."""
    entries: dict[str, TensorInfo] = {}
    unexpected = []
    for file in files:
        for e in read_header(file).values():
            ours = hf_to_ours(e.name)
            if ours in entries:
                raise CheckpointError(f"{e.name} appears twice: in {entries[ours].file} and in {file}")
            if ours in params or (ours == "lm_head.weight" and "embed_tokens.weight" in params):
                entries[ours] = e
            elif IGNORABLE.fullmatch(e.name):
                report.skipped.append(f"{e.name} (recomputed by the model)")
            else:
                unexpected.append(e)
    return entries, unexpected


def _describe(path, params: dict, entries: dict, missing: list, unexpected: list, wrong: list) -> str:
    lines = [f"checkpoint {path} does not fit the model ({len(missing) + len(unexpected) + len(wrong)} problems):"]
    lines += [f"  missing: {n} (expected shape {list(params[n].shape)}, file name {ours_to_hf(n)})" for n in missing]
    lines += [f"  unexpected: {e.name} (shape {list(e.shape)}) in {e.file}" for e in unexpected]
    for n in wrong:
        e = entries[n]
        found = f"found {list(e.shape)} ({e.name} in {e.file})"
        lines.append(f"  shape mismatch: {n} expects {list(params[n].shape)}, {found}")
    if missing and all(n == "lm_head.weight" for n in missing):
        lines.append("  (no lm_head.weight: was this checkpoint saved with tie_word_embeddings=true?)")
    return "\n".join(lines)


def _normalize(device: str | torch.device | None) -> torch.device | None:
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _aliases(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every (module, attribute) through which each parameter is reachable, so that a tie survives replacement."""
    found: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                found.setdefault(id(p), []).append((module, attr))
    return found


def pins(device: torch.device | None) -> bool:
    """Whether loading onto `device` stages bytes in page-locked host memory (a GPU: copies from it run
    asynchronously, and at full speed)."""
    return device is not None and device.type == "cuda"


def pinned_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of page-locked host memory, exactly. `torch.empty(pin_memory=True)` would go through CUDA's caching
    host allocator, which rounds each request up to a power of two (2 x 4 GiB for Llama-3-70B's 2.1 GB embedding)
    and keeps the blocks for the rest of the process once freed; an ordinary tensor pinned in place
    (cudaHostRegister) is as large as asked, and is returned to the system once unpinned (`unpin`) and freed."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0))
    return buffer


def unpin(buffer: torch.Tensor) -> None:
    """Undo `pinned_buffer`: the memory becomes ordinary again, freed with the tensor."""
    if buffer.numel():
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))


class Staging:
    """Host memory that a tensor's bytes pass through on their way to a GPU: two pinned buffers, each exactly as
    large as the largest tensor to load, used in turn, so that reading the next tensor from disk overlaps the copy
    of the last one, and a buffer is refilled only once its copy has finished. They live for one load: `finish`
    waits for the last copies and gives them back. Other targets get a fresh tensor each time."""

    def __init__(self, nbytes: int, device: torch.device | None):
        self.device = device  # the GPU the copies go to: their stream is that device's, whichever device is current
        self.buffers: list[torch.Tensor] = []
        self.copied: list = [None, None]  # the event recorded after each buffer's last copy
        self.turn = 0
        try:
            while pins(device) and len(self.buffers) < 2:
                self.buffers.append(pinned_buffer(nbytes))
        except BaseException:  # the second could not be pinned (too little page-locked memory left, Ctrl-C)
            self.release()  # the first stays pinned otherwise, for the rest of the process: no one holds it to undo
            raise

    def take(self, e: TensorInfo) -> torch.Tensor:
        """An empty tensor of `e`'s dtype and shape to read the bytes into."""
        if not self.buffers:
            return torch.empty(e.shape, dtype=e.dtype)
        self.turn ^= 1
        if self.copied[self.turn] is not None:
            self.copied[self.turn].synchronize()  # its previous copy must be done before new bytes go in
        return self.buffers[self.turn][: e.nbytes].view(e.dtype).view(e.shape)

    def send(self, staged: torch.Tensor, dest: torch.Tensor) -> None:
        """Copy `staged` (from `take`) into `dest`; from pinned memory without waiting for the copy to end."""
        if not self.buffers:
            dest.copy_(staged)
            return
        # The copy is queued on the destination GPU's current stream, so the event that says it is done must be
        # recorded on that stream: recorded on the current device's (cuda:0 under --device cuda:1, which no
        # command makes current), it would complete at once and the buffer be refilled while the copy still reads
        # it. The copy runs with that device current too, so both name the same stream.
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device)
            dest.copy_(staged, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self.copied[self.turn] = done

    def finish(self) -> None:
        """Wait for the copies still under way (the weights are all on the device when loading returns), then
        give the buffers back: pinned memory kept after loading is memory no one else can use."""
        for done in self.copied:
            if done is not None:
                done.synchronize()
        self.copied = [None, None]
        self.release()

    def release(self) -> None:
        """Unpin the buffers taken (no copy may still read them) and let them go."""
        while self.buffers:
            unpin(self.buffers.pop())


def _load_one(
    fh, e: TensorInfo, param: nn.Parameter, aliases: dict, device: torch.device | None, mapped, staging: Staging
) -> None:
    if isinstance(param, QuantizedLinear):
        _quantize_streamed(fh, e, param, device)
        return
    target = device or (param.device if not param.is_meta else torch.device("cpu"))
    in_place = not param.is_meta and param.device == target and param.is_contiguous()
    # safetensors aligns each tensor's data to its dtype; a file from a writer that did not gets a copy instead
    aligned = e.offset % e.dtype.itemsize == 0
    if mapped is not None and not in_place and target.type == "cpu" and param.dtype == e.dtype and aligned:
        if not mapped:
            mapped.append(torch.UntypedStorage.from_file(str(e.file), shared=False, nbytes=e.file.stat().st_size))
        _put(param, torch.empty(0, dtype=e.dtype).set_(mapped[0], e.offset // e.dtype.itemsize, e.shape), aliases)
        return
    dest = param.data if in_place else torch.empty(param.shape, dtype=param.dtype, device=target)
    with torch.no_grad():
        if dest.device.type == "cpu" and dest.dtype == e.dtype:
            read_into(fh, e, dest)
        else:
            staged = staging.take(e)
            read_into(fh, e, staged)
            staging.send(staged, dest)
            del staged
    if not in_place:
        _put(param, dest, aliases)


# Rows of a weight read, moved and quantized at a time: 2^22 values (8 MiB in bfloat16, 16 MiB as float32 while
# quantized), so the full-precision copy in flight is a few MiB, not the largest tensor (1 GiB: Llama-3-8B's head).
QUANTIZE_CHUNK = 1 << 22


def _quantize_streamed(fh, e: TensorInfo, layer: QuantizedLinear, device: torch.device | None) -> None:
    """A quantized layer's weight read from the file a chunk of rows at a time, each quantized on the target
    device into the layer's codes and scales (allocated there on first use)."""
    if layer.codes.is_meta or (device is not None and layer.codes.device != device):
        layer.to_empty(device=device or torch.device("cpu"))
    row_bytes = e.nbytes // e.shape[0]
    rows = max(1, QUANTIZE_CHUNK // e.shape[1])
    for start in range(0, e.shape[0], rows):
        n = min(rows, e.shape[0] - start)
        offset = e.offset + start * row_bytes
        part = dataclasses.replace(e, shape=(n, *e.shape[1:]), offset=offset, nbytes=n * row_bytes)
        staged = torch.empty(part.shape, dtype=e.dtype)
        read_into(fh, part, staged)
        layer.fill_rows(start, staged.to(layer.codes.device))


def _put(old: nn.Parameter, data: torch.Tensor, aliases: dict) -> nn.Parameter:
    """Swap a parameter for one holding `data`, under every name it has (a tied embedding stays tied)."""
    new = nn.Parameter(data, requires_grad=old.requires_grad)
    places = aliases.pop(id(old))
    for module, attr in places:
        module._parameters[attr] = new
    aliases[id(new)] = places
    return new


def _check_tied_head(e: TensorInfo, embed: torch.Tensor, strict: bool, report: LoadReport) -> None:
    """A tied model ignores a stored lm_head.weight, but only silently if it equals the embedding."""
    staged = torch.empty(e.shape, dtype=e.dtype)
    with open(e.file, "rb", buffering=0) as fh:
        read_into(fh, e, staged)
    if e.shape == tuple(embed.shape) and _equal_on_cpu(staged.to(embed.dtype), embed):
        report.skipped.append(f"{e.name} (equal to the tied embedding)")
        return
    why = f"{e.name} in {e.file} differs from model.embed_tokens.weight, but the config ties them"
    if strict:
        raise CheckpointError(f"{why}; set tie_word_embeddings=false in config.json (LlamaConfig.tie_embeddings)")
    report.skipped.append(f"{e.name} (differs from the tied embedding; tie kept)")


def _equal_on_cpu(a: torch.Tensor, b: torch.Tensor, rows: int = 4096) -> bool:
    """a (on the CPU) == b (anywhere), compared a few thousand rows at a time: copying all of `a` to a GPU to
    compare would put a second embedding there (1 GiB for Llama-3-8B) for a moment."""
    return all(torch.equal(a[i : i + rows], b[i : i + rows].cpu()) for i in range(0, a.shape[0], rows))


def _init_missing(param: nn.Parameter, aliases: dict, device: torch.device | None) -> None:
    """strict=False: a parameter the file lacked still leaves the meta device, initialized as for training."""
    target = device or torch.device("cpu")
    if isinstance(param, QuantizedLinear):  # a quantized layer the file lacked: a drawn weight, quantized
        if param.codes.is_meta:
            param.to_empty(device=target)
        param.fill_rows(0, torch.empty(param.shape, device=param.codes.device).normal_(0.0, 0.02))
        return
    if not param.is_meta and (device is None or param.device == device):
        return
    if not param.is_meta:
        _put(param, param.data.to(target), aliases)
        return
    data = torch.empty(param.shape, dtype=param.dtype, device=target)
    if data.dim() == 1:  # RMSNorm gains start at one; matrices as in model._init_weights
        data.fill_(1.0)
    else:
        data.normal_(0.0, 0.02)
    _put(param, data, aliases)


def _materialize_buffers(model: nn.Module, device: torch.device) -> None:
    """Bring meta buffers to the device. Ours are the rotary tables, which RotaryEmbedding recomputes (float32)."""
    for module in model.modules():
        if any(b.is_meta for b in module.buffers(recurse=False)):
            module.to_empty(device=device, recurse=False)
    if left := [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]:
        raise RuntimeError(f"still on the meta device after loading: {', '.join(left)}")


def copy_named_tensors(
    module: nn.Module, tensors: Mapping[str, torch.Tensor], source: str, required: Iterable[str] = ()
) -> None:
    """Copy saved tensors into `module`'s parameters by name, after checking every name and shape.

    A bare `copy_` would broadcast a [1, dim] head into [k, dim] without a word, and a parameter the file lacks
    would keep whatever memory it had (or its fresh initialisation). So unknown names, wrong shapes and
    `required` parameters that the file does not hold are reported in one CheckpointError naming `source`,
    before anything is copied.
    """
    params = dict(module.named_parameters(remove_duplicate=False))  # a tied weight answers to both its names
    _check_named(params, {n: tuple(t.shape) for n, t in tensors.items()}, source, required)
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value)


def copy_named_file(module: nn.Module, path: str | Path, required: Iterable[str] = ()) -> None:
    """`copy_named_tensors` from a safetensors file, one tensor at a time, each into its parameter in place.

    Names and shapes are checked from the header before anything is read. Then each tensor passes through host
    memory alone: reading the whole file first (safetensors' `load_file`) would hold a second copy of every
    tensor it holds, on the GPU beside the model for a run trained from random weights."""
    params = dict(module.named_parameters(remove_duplicate=False))
    entries = read_header(path)
    _check_named(params, {n: e.shape for n, e in entries.items()}, str(path), required)
    with open(path, "rb", buffering=0) as fh, torch.no_grad():
        for name, e in sorted(entries.items(), key=lambda kv: kv[1].offset):  # in file order
            staged = torch.empty(e.shape, dtype=e.dtype)
            read_into(fh, e, staged)
            params[name].copy_(staged)
            del staged


def _check_named(params: dict, shapes: dict[str, tuple], source: str, required: Iterable[str]) -> None:
    """Unknown names, wrong shapes and `required` parameters not covered, as one CheckpointError naming `source`."""
    unknown = [n for n in shapes if n not in params]
    wrong = [
        f"{n} {list(shape)} (the model's is {list(params[n].shape)})"
        for n, shape in shapes.items()
        if n in params and tuple(shape) != tuple(params[n].shape)
    ]
    covered = {id(params[n]) for n in shapes if n in params}
    missing = [n for n in required if id(params[n]) not in covered]
    problems = [
        f"{what}: {', '.join(names[:5])}" + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        for what, names in (("unknown tensors", unknown), ("wrong shapes", wrong), ("missing", missing))
        if names
    ]
    if problems:
        raise CheckpointError(f"{source} does not fit the model: {'; '.join(problems)}")


# --- saving ----------------------------------------------------------------------------------------------------------


def save_weights(state: dict[str, torch.Tensor], path: str | Path, metadata: dict | None = None) -> Path:
    """Write tensors to a safetensors file atomically: a temporary name in the same directory, then a rename.

    An interrupted save leaves the previous file untouched and no partial file behind. Entries that are the
    same tensor under two names (tied embeddings) are written once, under the first name.
    """
    tensors: dict[str, torch.Tensor] = {}
    seen = set()
    for name, t in state.items():
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if t.numel() and key in seen:
            continue
        seen.add(key)
        tensors[name] = t.detach().contiguous()
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()}
    return write_safetensors(Path(path), tensors_to_write(tensors), meta)


def save_checkpoint(
    state_or_model: dict[str, torch.Tensor] | nn.Module,
    cfg: LlamaConfig,
    out_dir: str | Path,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write a checkpoint in Hugging Face layout (config.json and model.safetensors, or shards and an index) that
    both `load_weights` and transformers' `from_pretrained` read. Keys may be our names or Hugging Face's."""
    state = state_or_model.state_dict() if isinstance(state_or_model, nn.Module) else dict(state_or_model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in state.items():
        hf = ours_to_hf(name)
        if hf is None:
            raise ValueError(f"save_checkpoint writes Llama weights; {name!r} is not a Llama parameter")
        if not (hf == "lm_head.weight" and cfg.tie_embeddings):  # a tied head is the embedding, stored once
            tensors[hf] = t
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for shard, name in zip(shards, names, strict=True):
        save_weights(shard, out / name)
    written = set(names) | {"config.json"}
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map = {n: f for shard, f in zip(shards, names, strict=True) for n in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_text_atomic(out / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
        written.add("model.safetensors.index.json")
    write_text_atomic(out / "config.json", json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        if stale.name not in written:  # left from an earlier save with other sharding; would shadow the new one
            stale.unlink(missing_ok=True)
    return out

"""The Hugging Face checkpoint layout: which tensor name is which parameter, and where each tensor sits in the files.

A checkpoint directory is one `model.safetensors` or several shards listed by `model.safetensors.index.json`; each
file starts with a small JSON header that gives every tensor's name, dtype, shape and byte range. Reading only the
headers tells the loader everything about a checkpoint before it reads a single weight. Hugging Face names the
tensors `model.layers.{i}.self_attn.q_proj.weight`, we name the same parameter `blocks.{i}.attention.q_proj.weight`;
one table (`NAME_MAP`) translates both ways, for loading and for saving.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import NamedTuple

import torch

from .atomic import replace_directory, write_atomic

# --- names -------------------------------------------------------------------------------------------------------

# (Hugging Face, ours). {i} stands for the layer number and {p} for a projection (q_proj, gate_proj, ...).
NAME_MAP = [
    ("model.embed_tokens.weight", "embed_tokens.weight"),
    ("model.layers.{i}.input_layernorm.weight", "blocks.{i}.attention_norm.weight"),
    ("model.layers.{i}.self_attn.{p}.weight", "blocks.{i}.attention.{p}.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "blocks.{i}.ffn_norm.weight"),
    ("model.layers.{i}.mlp.{p}.weight", "blocks.{i}.ffn.{p}.weight"),
    ("model.norm.weight", "final_norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
]
# Tensors some checkpoints carry that the model recomputes instead (older transformers saved rotary tables).
IGNORABLE = re.compile(r"(.+\.)?rotary_emb\.inv_freq")


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>[a-z]+_proj)"))


_HF_TO_OURS = [(_pattern(hf), ours) for hf, ours in NAME_MAP]
_OURS_TO_HF = [(_pattern(ours), hf) for hf, ours in NAME_MAP]


def _rename(name: str, table: list[tuple[re.Pattern, str]]) -> str | None:
    for pattern, template in table:
        if m := pattern.fullmatch(name):
            return template.format(**m.groupdict())
    return None


def hf_to_ours(name: str) -> str | None:
    """Our parameter name for a tensor name in a checkpoint (Hugging Face or already ours); None if unknown."""
    if _rename(name, _OURS_TO_HF) is not None:  # already one of our names (files written by save_weights)
        return name
    return _rename(name, _HF_TO_OURS)


def ours_to_hf(name: str) -> str | None:
    """The Hugging Face name of one of our parameters (a Hugging Face name is returned as is); None if unknown."""
    if _rename(name, _HF_TO_OURS) is not None:
        return name
    return _rename(name, _OURS_TO_HF)


# --- reading checkpoint files --------------------------------------------------------------------------------------


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the model; the message names the file and the tensors."""


_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, absolute byte offset, dtype and shape, as the safetensors header says."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


# safetensors' own limit on the JSON header; checked before the header is read, so a hostile length allocates nothing.
MAX_HEADER_BYTES = 100_000_000


def read_header(file: str | Path) -> dict[str, TensorInfo]:
    """Parse a safetensors header (8-byte little-endian length, then JSON) and check it against the file's size.

    We read the format ourselves instead of through `safetensors.safe_open`: safe_open memory-maps the whole file,
    and every page it touches stays in our resident memory until the file is closed, which would add a full shard
    to the peak when converting. Plain reads go through the page cache into the destination tensor and add nothing.
    Every field is checked, so a damaged or hostile header is one CheckpointError naming the file and the tensor.
    """
    file = Path(file)
    size = file.stat().st_size
    header, data_start = _read_json_header(file, size)
    _check_metadata(file, header.pop("__metadata__", {}))
    tensors = {name: _tensor_info(file, name, spec, data_start, size) for name, spec in header.items()}
    _check_layout(file, tensors)
    return tensors


def _read_json_header(file: Path, size: int) -> tuple[dict, int]:
    """The header as a dict and the byte where tensor data starts; the length is bounded before anything is read."""
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
            why = f"header length {n}, file {size} bytes"
            raise CheckpointError(f"{file} is truncated or not a safetensors file ({why})")
        try:
            header = json.loads(f.read(n), object_pairs_hook=_no_duplicate_keys)
        except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, a repeated name, absurd nesting
            raise CheckpointError(f"{file} is corrupt: its safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file} is corrupt: its header is a JSON {type(header).__name__}, not an object")
    return header, 8 + n


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    """json.loads keeps the last of two equal keys silently; a header naming a tensor twice is corrupt."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"{key!r} appears twice")
        out[key] = value
    return out


def _check_metadata(file: Path, metadata: object) -> None:
    """`__metadata__` is free text for the writer, but safetensors allows only strings in it."""
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{file} is corrupt: __metadata__ must map strings to strings, found {metadata!r:.200}")


def _is_count(value: object) -> bool:
    """A JSON integer >= 0 (bool is an int subclass in Python, and true/false are not sizes)."""
    return type(value) is int and value >= 0


def _tensor_info(file: Path, name: str, spec: object, data_start: int, size: int) -> TensorInfo:
    """One header entry checked field by field: dtype we know, a shape of sizes, a byte range that fits them."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{file} is corrupt: tensor {name!r}: {why}")

    if not isinstance(spec, dict):
        raise bad(f"entry is {spec!r:.200}, not an object with dtype, shape and data_offsets")
    dtype_name, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
        raise bad(f"dtype {dtype_name!r:.100} is not one of {', '.join(_DTYPES)}")
    if not isinstance(shape, list) or not all(_is_count(d) and d <= size for d in shape):
        raise bad(f"shape {shape!r:.200} is not a list of sizes (whole numbers from 0 to the file's size)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise bad(f"data_offsets {offsets!r:.200} is not a pair of byte offsets [begin, end]")
    begin, end = offsets
    if begin > end:
        raise bad(f"data_offsets {offsets} end before they begin")
    dtype = _DTYPES[dtype_name]
    nbytes = dtype.itemsize * math.prod(shape)
    if end - begin != nbytes:
        raise bad(f"{shape} {dtype_name} needs {nbytes} bytes, data_offsets {offsets} span {end - begin}")
    if data_start + end > size:
        raise CheckpointError(
            f"{file} is truncated: {name} ends at byte {data_start + end} but the file has {size} bytes "
            "(an interrupted download or copy? fetch the file again)"
        )
    return TensorInfo(name, file, dtype, tuple(shape), data_start + begin, nbytes)


def _check_layout(file: Path, tensors: dict[str, TensorInfo]) -> None:
    """No two tensors share bytes: writing one parameter in place must never change another."""
    previous = None
    for e in sorted(tensors.values(), key=lambda e: (e.offset, e.nbytes)):
        if previous is not None and e.offset < previous.offset + previous.nbytes:
            raise CheckpointError(f"{file} is corrupt: tensors {previous.name!r} and {e.name!r} overlap")
        previous = e


def read_into(fh, e: TensorInfo, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor `out` with the tensor's bytes, read straight from the file into its memory."""
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    fh.seek(e.offset)
    done = 0
    while done < e.nbytes:  # one read returns at most ~2 GiB on Linux
        n = fh.readinto(view[done:])
        if not n:
            raise CheckpointError(f"{e.file} is truncated: unexpected end of file while reading {e.name}")
        done += n


def read_tensor(e: TensorInfo) -> torch.Tensor:
    """One tensor as a new CPU tensor of its file dtype: a reader that holds one tensor, never the whole file."""
    out = torch.empty(e.shape, dtype=e.dtype)
    with open(e.file, "rb", buffering=0) as fh:
        read_into(fh, e, out)
    return out


def find_checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: a directory in Hugging Face layout, an index json, or one file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path} (get one with: python -m llama_scratch.download REPO_ID)")
    if path.is_file() and path.suffix == ".safetensors":
        return [path]
    index = path if path.is_file() else path / "model.safetensors.index.json"
    if index.is_file():
        files = [index.parent / name for name in _shard_names(index)]
        if missing := [f.name for f in files if not f.is_file()]:
            raise CheckpointError(f"{index} lists shard(s) missing from {index.parent}: {', '.join(missing)}")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    if files := sorted(path.glob("*.safetensors")):
        return files
    raise FileNotFoundError(
        f"no safetensors weights in {path} (expected model.safetensors or model.safetensors.index.json; "
        "Meta's original consolidated.*.pth format is not supported)"
    )


# A shard is a plain file name next to the index: no folder part, so an index cannot point outside its checkpoint.
_SHARD_NAME = re.compile(r"[^/\\:\x00]+\.safetensors")


def _shard_names(index: Path) -> list[str]:
    """The shard files an index lists, each once, in order; every entry checked before any shard is touched."""
    if index.stat().st_size > MAX_HEADER_BYTES:
        raise CheckpointError(f"{index} is not a valid safetensors index (over {MAX_HEADER_BYTES} bytes)")
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
    except (ValueError, RecursionError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index} is not a valid safetensors index (no readable weight_map: {e})") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: weight_map is a {type(weight_map).__name__}, not tensor name -> file name")
    for tensor, name in weight_map.items():
        if not isinstance(name, str) or not _SHARD_NAME.fullmatch(name) or ".." in name:
            raise CheckpointError(
                f"{index}: entry {tensor!r} -> {name!r:.200} is not a plain .safetensors file name "
                f"(shards must sit in {index.parent} itself)"
            )
    return list(dict.fromkeys(weight_map.values()))


# The weights, their index, the config and the tokenizer; not the original .pth files or other formats.
ALLOW_PATTERNS = [
    "*.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "original/tokenizer.model",
    "tokenizer.json",
    "tokenizer_config.json",
]


# --- writing safetensors files ---------------------------------------------------------------------------------------

_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class TensorToWrite(NamedTuple):
    """A tensor's header entry, and how to make its values when its turn comes (so only one is ever in memory)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]


def write_safetensors(path: Path, entries: list[TensorToWrite], metadata: dict[str, str] | None = None) -> Path:
    """A safetensors file, written atomically: the header from the entries, then each tensor as it is made.

    Our own writer rather than safetensors' `save_file`, for two reasons: it needs one tensor in memory at a time,
    not all of them, and `save_file` stages its bytes in a temporary file of its own (`.tmpXXXXXX`) beside the
    target, which a killed run would leave in the output directory under a name no one can prove is ours.
    """
    metadata, names = {"format": "pt", **(metadata or {})}, [e.name for e in entries]
    unknown = sorted({str(e.dtype) for e in entries if e.dtype not in _DTYPE_NAMES})
    strings = all(isinstance(v, str) for v in metadata.values())
    if unknown or len(set(names)) != len(names) or "__metadata__" in names or not strings:
        raise ValueError(
            f"{path}: not writable as safetensors: names must be unique and not __metadata__, metadata "
            f"values strings ({metadata}), dtypes known (not {', '.join(unknown) or '-'})"
        )
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for e in entries:
        nbytes = math.prod(e.shape) * e.dtype.itemsize
        header[e.name] = {
            "dtype": _DTYPE_NAMES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors itself writes it

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for e in entries:
                t = e.make().detach()
                if tuple(t.shape) != tuple(e.shape) or t.dtype != e.dtype:
                    raise ValueError(f"{e.name}: made {t.dtype} {tuple(t.shape)}, the header says {e.dtype} {e.shape}")
                t = t.resolve_neg().resolve_conj().cpu().contiguous()
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
                del t

    return write_atomic(path, write)


def tensors_to_write(tensors: dict[str, torch.Tensor]) -> list[TensorToWrite]:
    """Entries for tensors already in memory."""
    return [TensorToWrite(n, tuple(t.shape), t.dtype, lambda t=t: t) for n, t in tensors.items()]


# --- Whose directory is it? -----------------------------------------------------------------------------------------
# What a checkpoint directory may hold: what we write, what the Hub download fetches (ALLOW_PATTERNS) and what
# `hf download` or save_pretrained add; and in two subdirectories, Meta's tokenizer and the Hub's bookkeeping.
CHECKPOINT_FILES = [p for p in ALLOW_PATTERNS if "/" not in p] + ["special_tokens_map.json", "tokenizer.model"]
CHECKPOINT_FILES.append("SOURCE.md")  # ours
CHECKPOINT_SUBDIRS = {"original": {"tokenizer.model"}, ".cache": {"huggingface"}}


def written_by_us(path: Path) -> bool:
    """Our marker files: config.json and a SOURCE.md that names this tool (every checkpoint we write has both)."""
    source = path / "SOURCE.md"
    text = source.read_text(encoding="utf-8", errors="replace") if source.is_file() else ""
    return (path / "config.json").is_file() and "llama_scratch" in text


def foreign_entries(path: Path) -> list[str]:
    """What in `path` is not part of a checkpoint, by name ("notes.txt", "other-model/"). It looks into the two
    subdirectories a checkpoint may have and no deeper, so even a mistyped `--dir ~` is answered at once."""
    foreign = []
    for entry in sorted(path.iterdir()):
        if entry.is_dir() and not entry.is_symlink():
            allowed = CHECKPOINT_SUBDIRS.get(entry.name, set())
            if any(inner.name not in allowed for inner in entry.iterdir()):
                foreign.append(f"{entry.name}/")
        elif not any(fnmatch(entry.name, pattern) for pattern in CHECKPOINT_FILES):
            foreign.append(entry.name)
    return foreign


def replaceable(path: Path, force: bool = False) -> bool:
    """May a fetch or conversion replace the non-empty directory `path`?

    Only when it holds nothing but checkpoint files (`foreign_entries` is empty), and either this tool wrote it
    (`written_by_us`) or `force` is set. So --force lets a checkpoint we cannot recognise (fetched by an older
    version, by `hf download`, saved by hand) be replaced, yet never a directory holding anything else: the
    parent `weights/`, another checkpoint in a subdirectory, a fine-tuning run, a user's notes. A mistyped
    --dir costs nothing even with --force, and our own checkpoint with a file the user added is kept as well.
    """
    return not foreign_entries(path) and (force or written_by_us(path))


def check_target(target: str | Path, force: bool = False) -> None:
    """Refuse, with a FileExistsError that says why and what to do, a target that `replaceable` rejects.

    Called before any download or conversion work, so a refusal costs nothing; `replace_directory` asks again
    at the moment of the swap."""
    target = Path(target)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise FileExistsError(f"{target} exists and is not a directory; choose another place")
    if not target.is_dir() or not any(target.iterdir()) or replaceable(target, force):
        return
    if foreign := foreign_entries(target):
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise FileExistsError(
            f"{target} holds files that are not part of one checkpoint ({shown}); nothing was changed. "
            "Choose a new or empty directory, e.g. one inside it (--force never replaces such a directory)"
        )
    raise FileExistsError(
        f"{target} holds a checkpoint this tool did not write (no SOURCE.md from llama_scratch); nothing was "
        "changed. Pass --force to replace it, or choose another directory"
    )


def replace_checkpoint(target: str | Path, build: Callable[[Path], object], force: bool = False) -> Path:
    """Build a checkpoint with `build(tmp)` in a fresh directory beside `target`, then swap it in by renames.

    A failed build leaves `target` as it was; a target `replaceable` rejects is refused (FileExistsError)."""
    check_target(target, force)
    absolute = Path(os.path.abspath(target))  # so `.` and `..` have a name to put a temporary directory beside
    replace_directory(absolute, build, lambda path: replaceable(path, force))
    return Path(target)

"""The Hugging Face checkpoint layout: which tensor name is which parameter, and where each tensor sits in the files.

A checkpoint directory is one `model.safetensors` or several shards listed by `model.safetensors.index.json`; each
file starts with a small JSON header that gives every tensor's name, dtype, shape and byte range. Reading only the
headers tells the loader everything about a checkpoint before it reads a single weight. Hugging Face names the
tensors `model.layers.{i}.self_attn.q_proj.weight`, we name the same parameter `blocks.{i}.attention.q_proj.weight`;
one table (`NAME_MAP`) translates both ways, for loading and for saving.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

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


def read_header(file: str | Path) -> dict[str, TensorInfo]:
    """Parse a safetensors header (8-byte little-endian length, then JSON) and check it against the file's size.

    We read the format ourselves instead of through `safetensors.safe_open`: safe_open memory-maps the whole file,
    and every page it touches stays in our resident memory until the file is closed, which would add a full shard
    to the peak when converting. Plain reads go through the page cache into the destination tensor and add nothing.
    """
    file = Path(file)
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= size - 8:
            why = f"header length {n}, file {size} bytes"
            raise CheckpointError(f"{file} is truncated or not a safetensors file ({why})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{file} is corrupt: its safetensors header is not valid JSON ({e})") from None
    tensors = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = _DTYPES[spec["dtype"]], tuple(spec["shape"]), spec["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file} is corrupt or has an unsupported dtype: entry {name}: {spec}") from None
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        if end - begin != nbytes:
            raise CheckpointError(f"{file} is corrupt: {name} {list(shape)} {spec['dtype']} spans {end - begin} bytes")
        if 8 + n + end > size:
            raise CheckpointError(
                f"{file} is truncated: {name} ends at byte {8 + n + end} but the file has {size} bytes "
                "(an interrupted download or copy? fetch the file again)"
            )
        tensors[name] = TensorInfo(name, file, dtype, shape, 8 + n + begin, nbytes)
    return tensors


def find_checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: a directory in Hugging Face layout, an index json, or one file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path} (get one with: python -m llama_scratch.download REPO_ID)")
    if path.is_file() and path.suffix == ".safetensors":
        return [path]
    index = path if path.is_file() else path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index (no readable weight_map: {e})") from None
        files = [index.parent / name for name in dict.fromkeys(weight_map.values())]
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

"""Import a llama.cpp GGUF file as a Hugging Face-layout checkpoint, which every command then loads as usual.

A GGUF file holds metadata (`llama.block_count`, `tokenizer.ggml.tokens`, ...) and tensors, often quantized
(Q4_1: blocks of 32 weights sharing a scale and a minimum). Converting means:

1. metadata -> `LlamaConfig` (`config_from_gguf`) and tokenizer files (`llama_scratch.model.bpe.hf_tokenizer_files`);
2. each tensor -> float32 with the `gguf` package's dequantizer, renamed from llama.cpp's names to ours;
3. q/k projections: llama.cpp reorders their rows for its rotary kernel, which we undo (`unpermute_rows`);
4. everything written to a temporary directory that is renamed into place at the end.

Dequantized weights are exactly representable in float32, so the checkpoint reproduces the GGUF model exactly.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from ..model.bpe import hf_tokenizer_files
from ..model.config import LlamaConfig, RopeScaling
from ..model.llama import Llama, rope_frequencies
from .gguf_check import GGUFError, check_gguf
from .hf_layout import check_target, replace_checkpoint
from .progress import progress_bar
from .weights import save_checkpoint

# llama.cpp tensor names -> ours. {i} is the block number.
TENSOR_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "blk.{i}.attn_norm.weight": "blocks.{i}.attention_norm.weight",
    "blk.{i}.attn_q.weight": "blocks.{i}.attention.q_proj.weight",
    "blk.{i}.attn_k.weight": "blocks.{i}.attention.k_proj.weight",
    "blk.{i}.attn_v.weight": "blocks.{i}.attention.v_proj.weight",
    "blk.{i}.attn_output.weight": "blocks.{i}.attention.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "blocks.{i}.ffn_norm.weight",
    "blk.{i}.ffn_gate.weight": "blocks.{i}.ffn.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "blocks.{i}.ffn.up_proj.weight",
    "blk.{i}.ffn_down.weight": "blocks.{i}.ffn.down_proj.weight",
    "output_norm.weight": "final_norm.weight",
    "output.weight": "lm_head.weight",
}
# Llama-3.1's frequency scaling as a tensor (`rope_freqs.weight`); it goes into the config instead.
ROPE_FREQS = "rope_freqs.weight"


def our_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `blocks.3.attention.q_proj.weight`; None for names a Llama does not have."""
    layer = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    template = f"blk.{{i}}.{layer.group(2)}" if layer else gguf_name
    ours = TENSOR_NAMES.get(template)
    return ours.format(i=layer.group(1)) if ours and layer else ours


def read_metadata(reader) -> dict:
    """All key-value metadata of an open `gguf.GGUFReader` as plain Python values (lists, str, int, float)."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def open_gguf(path: str | Path):
    """A `gguf.GGUFReader` on `path` (memory-mapped: tensors are read only when used), after `check_gguf` has
    walked the file's structure: the reader trusts every count in the file, so it only sees files that fit."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    import gguf  # deferred: only GGUF conversion needs it; training on a machine without it must still import us

    try:
        check_gguf(path)
        return gguf.GGUFReader(path)
    except GGUFError:
        raise
    except Exception as e:  # the reader was not written for damaged files: any failure in it means one
        raise GGUFError(f"{path}: cannot read as GGUF: {type(e).__name__}: {e}") from None


def config_from_gguf(meta: dict, tensor_names: set[str], source: str = "GGUF") -> LlamaConfig:
    """The `LlamaConfig` described by the `llama.*` metadata; refuse what our model does not implement."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{source}: architecture {arch!r} is not supported; only 'llama' is")

    def get(key: str, default=None):
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise GGUFError(f"{source}: metadata llama.{key} is missing")
        return value

    if get("expert_count", 0):
        raise GGUFError(f"{source}: a mixture-of-experts model (llama.expert_count={get('expert_count')})")
    dim, n_heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", dim // n_heads)
    if get("rope.dimension_count", head_dim) != head_dim:
        raise GGUFError(f"{source}: rotary embedding on {get('rope.dimension_count')} of {head_dim} head channels")
    if (kind := meta.get("llama.rope.scaling.type", "none")) != "none":
        raise GGUFError(f"{source}: rope scaling type {kind!r} is not supported (only Llama-3.1-style rope_freqs)")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError(f"{source}: no tokenizer.ggml.tokens, so the vocabulary size is unknown")
    try:
        return LlamaConfig(
            vocab_size=len(tokens),
            dim=dim,
            n_layers=get("block_count"),
            n_heads=n_heads,
            n_kv_heads=get("attention.head_count_kv", n_heads),
            head_dim=head_dim,
            ffn_dim=get("feed_forward_length"),
            rope_theta=float(get("rope.freq_base", 10_000.0)),
            norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            max_seq_len=get("context_length"),
            tie_embeddings="output.weight" not in tensor_names,
            dtype=torch.float32,
        )
    except ValueError as e:  # e.g. a head size our rotary embedding cannot use
        raise GGUFError(f"{source}: {e}") from None


def rope_scaling_from_factors(factors: torch.Tensor, cfg: LlamaConfig, source: str = "GGUF") -> RopeScaling:
    """Llama-3.1 GGUFs store the per-frequency divisors of their rope scaling (`rope_freqs.weight`) instead of
    its parameters. Recover the parameters: the largest divisor is `factor`; the others are Meta's published
    values, which we check by recomputing the divisors."""
    scaling = RopeScaling(factor=float(factors.max()))
    plain = rope_frequencies(cfg.head_dim, cfg.rope_theta, None)
    expected = plain / rope_frequencies(cfg.head_dim, cfg.rope_theta, scaling)
    if factors.shape != expected.shape or not torch.allclose(factors.float(), expected, rtol=1e-3):
        raise GGUFError(f"{source}: rope_freqs.weight is not Llama-3.1-style frequency scaling")
    return scaling


def unpermute_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k projection rows.

    Our rotary embedding (like Hugging Face's) rotates channel j of a head against channel j + head_dim/2;
    llama.cpp rotates adjacent pairs (2j, 2j+1), so its converter interleaves each head's two halves
    (`permute` in convert_hf_to_gguf.py). This puts rows back: [h, pair j, half] -> [h, half, j].
    """
    rows = weight.shape[0]
    head_dim = rows // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def check_tensor_types(reader, source: str = "GGUF") -> None:
    """Fail before any work if a tensor uses a type that the gguf package cannot dequantize."""
    import gguf  # deferred, as in open_gguf

    failed: dict[str, list[str]] = {}
    tried = set()
    for t in reader.tensors:
        if t.tensor_type in tried:
            continue
        tried.add(t.tensor_type)
        try:
            gguf.quants.dequantize(t.data[:1] if t.data.ndim > 1 else t.data, t.tensor_type)  # one row will do
        except (NotImplementedError, ValueError, KeyError):
            failed[t.tensor_type.name] = [u.name for u in reader.tensors if u.tensor_type == t.tensor_type]
    if failed:
        what = "; ".join(f"{kind} (e.g. {', '.join(names[:3])})" for kind, names in failed.items())
        version = importlib.metadata.version("gguf")
        raise GGUFError(f"{source}: tensor type(s) the gguf package ({version}) cannot dequantize: {what}")


def dequantize(tensor) -> torch.Tensor:
    """A GGUF tensor as float32 in PyTorch's [out, in] shape (GGUF lists dimensions fastest-first)."""
    import gguf  # deferred, as in open_gguf

    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))  # np.array copies off the mmap


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    note: str = "",
    force: bool = False,
) -> Path:
    """Convert a Llama GGUF file into a checkpoint directory (config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json, and SOURCE.md with `note` added, e.g. where the file came from); return `out_dir`.

    float32 (the default) holds every dequantized value exactly; bfloat16 halves the size at the cost of rounding.
    Built beside `out_dir`, swapped in whole; the old `out_dir` goes only if
    `checkpoint_files.replaceable(out_dir, force)`."""

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    check_target(out_dir, force)  # refuse before the slow part, not after it
    source = str(gguf_path)
    reader = open_gguf(gguf_path)
    meta = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    cfg = config_from_gguf(meta, set(tensors), source)
    cfg.dtype = dtype
    if unknown := [name for name in tensors if our_name(name) is None and name != ROPE_FREQS]:
        raise GGUFError(f"{source}: tensor(s) a Llama does not have: {', '.join(unknown[:5])}")
    check_tensor_types(reader, source)
    try:
        tokenizer_json, tokenizer_config = hf_tokenizer_files(meta, source)
    except ValueError as e:
        raise GGUFError(str(e)) from None
    if ROPE_FREQS in tensors:
        cfg.rope_scaling = rope_scaling_from_factors(dequantize(tensors[ROPE_FREQS]), cfg, source)

    state: dict[str, torch.Tensor] = {}
    for name, tensor in progress_bar(tensors.items(), desc="dequantizing", unit="tensor", disable=not progress):
        if name == ROPE_FREQS:
            continue
        weight = dequantize(tensor)
        if name.endswith("attn_q.weight"):
            weight = unpermute_rows(weight, cfg.n_heads)
        elif name.endswith("attn_k.weight"):
            weight = unpermute_rows(weight, cfg.n_kv_heads)
        state[our_name(name)] = weight.to(dtype)
    _check_shapes(state, cfg, source)

    def build(tmp: Path) -> None:
        save_checkpoint(state, cfg, tmp, max_shard_bytes=5 * 2**30)  # shards of 5 GiB, as the hub uses
        # Token ids transformers' generate() and pipelines look for; our own reader ignores them.
        hf_config = json.loads((tmp / "config.json").read_text())
        for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
            if (value := meta.get(f"tokenizer.ggml.{key}")) is not None:
                hf_config[key.replace("padding", "pad")] = value
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        (tmp / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False), encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
        (tmp / "SOURCE.md").write_text(_source_note(gguf_path, meta, reader, dtype, note), encoding="utf-8")

    return replace_checkpoint(out_dir, build, force)


def _check_shapes(state: dict[str, torch.Tensor], cfg: LlamaConfig, source: str) -> None:
    """Every parameter present with the shape the config implies (catches metadata that lies)."""
    with torch.device("meta"):
        expected = {n: tuple(p.shape) for n, p in Llama(cfg).named_parameters()}
    if cfg.tie_embeddings:
        expected.pop("lm_head.weight", None)
    if missing := sorted(expected.keys() - state.keys()):
        raise GGUFError(f"{source}: missing tensor(s) for {', '.join(missing[:5])}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise GGUFError(f"{source}: {name} has shape {tuple(state[name].shape)}, the metadata implies {shape}")


def _source_note(path: Path, meta: dict, reader, dtype: torch.dtype, note: str) -> str:
    """SOURCE.md: where the weights came from, under which licence, and how they were converted."""
    types = Counter(t.tensor_type.name for t in reader.tensors)
    lines = [
        f"# {meta.get('general.name', path.stem)}",
        "",
        f"Converted by `python -m llama_scratch.convert_gguf` from `{path.name}`.",
        "",
        f"- organization: {meta.get('general.organization', 'unknown')}",
        f"- licence: {meta.get('general.license', 'not stated in the file')}",
        f"- tensor types in the file: {', '.join(f'{k} x{v}' for k, v in types.most_common())}",
        f"- weights here: {str(dtype).removeprefix('torch.')}, from the dequantized GGUF values"
        + (" (exact)" if dtype == torch.float32 else " (rounded)"),
        "- q/k projection rows: llama.cpp's rotary permutation undone (Hugging Face layout)",
    ]
    if note:
        lines += ["", note]
    return "\n".join(lines) + "\n"

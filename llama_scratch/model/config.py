"""The numbers that define a Llama-3 model: presets for the published sizes and a reader for Hugging Face configs."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1's rotary frequency scaling: stretches long wavelengths so the model reaches 128k tokens.

    Wavelengths shorter than `original_max_position_embeddings / high_freq_factor` are kept, longer than
    `original_max_position_embeddings / low_freq_factor` are divided by `factor`, and those between are blended.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class LlamaConfig:
    vocab_size: int = 128_256
    dim: int = 4096  # width of the residual stream ("hidden_size")
    n_layers: int = 32
    n_heads: int = 32  # query heads
    n_kv_heads: int = 8  # key/value heads, shared by n_heads // n_kv_heads query heads each
    head_dim: int | None = None  # None: dim // n_heads
    ffn_dim: int = 14_336  # inner width of the SwiGLU feed-forward ("intermediate_size")
    rope_theta: float = 500_000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    max_seq_len: int = 8192
    tie_embeddings: bool = False  # output projection shares the embedding matrix (Llama-3.2 1B/3B)
    dtype: torch.dtype = field(default=torch.bfloat16)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}; give head_dim")
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if isinstance(self.dtype, str):
            self.dtype = parse_dtype(self.dtype)

    @classmethod
    def from_name(cls, name: str, **overrides) -> LlamaConfig:
        """A preset by name (see `PRESETS`), with any field overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    @classmethod
    def from_hf(cls, path: str | Path) -> LlamaConfig:
        """Read a Hugging Face `config.json` (or a directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            hf = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(hf, source=str(path))

    @classmethod
    def from_hf_dict(cls, hf: dict, source: str = "config") -> LlamaConfig:
        """Translate the fields of a Hugging Face Llama config; refuse what this model does not implement."""

        def fail(why: str) -> ValueError:
            return ValueError(f"{source}: {why}")

        arch = hf.get("architectures") or []
        if hf.get("model_type") not in (None, "llama") or any(not a.startswith("Llama") for a in arch):
            raise fail(f"model_type {hf.get('model_type')!r} / architectures {arch} is not a Llama model")
        required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"]
        if missing := [k for k in required if k not in hf]:
            raise fail(f"missing field(s) {', '.join(missing)}")
        if hf.get("hidden_act", "silu") != "silu":
            raise fail(f"hidden_act {hf['hidden_act']!r} is not supported (Llama uses 'silu')")
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise fail(f"{flag}=true is not supported (Llama-3 has no biases)")
        # transformers >= 5 nests rope settings under rope_parameters; published checkpoints use the flat keys.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10_000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "llama3":
            fields = {f.name for f in dataclasses.fields(RopeScaling)}
            scaling = RopeScaling(**{k: v for k, v in rope.items() if k in fields})
        elif rope_type == "default":
            scaling = None
        else:
            raise fail(f"rope type {rope_type!r} is not supported (only 'default' and 'llama3')")
        dtype = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
        return cls(
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"),
            ffn_dim=hf["intermediate_size"],
            rope_theta=float(theta),
            rope_scaling=scaling,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_seq_len=hf.get("max_position_embeddings", 8192),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dtype=parse_dtype(dtype),
        )

    def to_hf_dict(self) -> dict:
        """The Hugging Face `config.json` fields for this config (the published, flat layout)."""
        s = self.rope_scaling
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.ffn_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": None if s is None else {"rope_type": "llama3", **dataclasses.asdict(s)},
            "rms_norm_eps": self.norm_eps,
            "max_position_embeddings": self.max_seq_len,
            "tie_word_embeddings": self.tie_embeddings,
            "torch_dtype": str(self.dtype).removeprefix("torch."),
        }


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bfloat16' / 'bf16' / 'float32' / 'fp32' / 'float16' -> torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    aliases = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "half": "float16", "float": "float32"}
    dtype = getattr(torch, aliases.get(name, name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unknown dtype {name!r}; use bfloat16, float16 or float32")
    return dtype


_LLAMA31_SCALING = RopeScaling(factor=8.0, original_max_position_embeddings=8192)
_LLAMA32_SCALING = RopeScaling(factor=32.0, original_max_position_embeddings=8192)

PRESETS: dict[str, LlamaConfig] = {
    "llama3-8b": LlamaConfig(),
    "llama3-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, ffn_dim=28_672),
    "llama3.1-8b": LlamaConfig(rope_scaling=_LLAMA31_SCALING, max_seq_len=131_072),
    "llama3.1-70b": LlamaConfig(
        dim=8192, n_layers=80, n_heads=64, ffn_dim=28_672, rope_scaling=_LLAMA31_SCALING, max_seq_len=131_072
    ),
    "llama3.2-1b": LlamaConfig(
        dim=2048,
        n_layers=16,
        n_heads=32,
        ffn_dim=8192,
        tie_embeddings=True,
        rope_scaling=_LLAMA32_SCALING,
        max_seq_len=131_072,
    ),
    "llama3.2-3b": LlamaConfig(
        dim=3072,
        n_layers=28,
        n_heads=24,
        ffn_dim=8192,
        tie_embeddings=True,
        rope_scaling=_LLAMA32_SCALING,
        max_seq_len=131_072,
    ),
    # A few million parameters with the real Llama-3 vocabulary: for tests and CPU demos, trained from scratch.
    "tiny": LlamaConfig(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=192,
        tie_embeddings=True,
        max_seq_len=2048,
        dtype=torch.float32,
    ),
}

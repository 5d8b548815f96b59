import json

import pytest
import torch

from llama_scratch import LlamaConfig
from llama_scratch.model.config import PRESETS, RopeScaling


def test_presets_have_published_shapes():
    cfg = LlamaConfig.from_name("llama3.2-3b")
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (3072, 28, 24, 8, 128)
    assert cfg.tie_embeddings and cfg.rope_scaling == RopeScaling(factor=32.0)
    assert LlamaConfig.from_name("llama3-8b").rope_scaling is None
    assert LlamaConfig.from_name("llama3.1-8b").max_seq_len == 131_072
    assert all(PRESETS[n].dtype == torch.bfloat16 for n in PRESETS if n != "tiny")


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ValueError, match="llama3-8b"):
        LlamaConfig.from_name("llama-9b")


def test_round_trip_through_hf_config_json(tmp_path):
    for name in PRESETS:
        cfg = LlamaConfig.from_name(name)
        (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
        assert LlamaConfig.from_hf(tmp_path) == cfg


def test_reads_published_llama31_config(tmp_path):
    published = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 128256,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(published))
    assert LlamaConfig.from_hf(path) == LlamaConfig.from_name("llama3.1-8b")


def test_reads_transformers_v5_rope_parameters():
    import transformers

    cfg = LlamaConfig.from_name("llama3.2-1b")
    written = transformers.LlamaConfig(**cfg.to_hf_dict()).to_dict()
    assert "rope_parameters" in written
    assert LlamaConfig.from_hf_dict(written) == cfg


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "not a Llama model"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_unsupported_fields_are_refused(tmp_path, change, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LlamaConfig.from_name("llama3-8b").to_hf_dict(), **change}))
    with pytest.raises(ValueError, match=message) as err:
        LlamaConfig.from_hf(path)
    assert str(path) in str(err.value)


def test_missing_fields_and_files_are_named(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ValueError, match="missing field.*vocab_size"):
        LlamaConfig.from_hf(path)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        LlamaConfig.from_hf(tmp_path / "nowhere")

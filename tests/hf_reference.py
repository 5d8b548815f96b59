"""Hugging Face transformers as an independent reference: build its Llama from our config (test-only)."""

import torch
import transformers

from llama_scratch import Llama, LlamaConfig


def hf_llama(cfg: LlamaConfig) -> transformers.LlamaForCausalLM:
    """A randomly initialised transformers Llama with the same shapes as `cfg`, float32, eval mode."""
    hf_cfg = transformers.LlamaConfig(**cfg.to_hf_dict())
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(1)
    return transformers.LlamaForCausalLM(hf_cfg).float().eval()


def real_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count real tokens only (what transformers' generate passes for left padding)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def padded_batch(rows: list[list[int]], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token-id rows to equal length on `side`; returns input_ids and the 1/0 attention mask."""
    T = max(map(len, rows))
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(T - len(row), T) if side == "left" else slice(0, len(row))
        ids[i, span] = torch.tensor(row)
        mask[i, span] = 1
    return ids, mask


def tiny_cfg(**overrides) -> LlamaConfig:
    """A small float32 config for parity tests: grouped-query attention by default."""
    base = dict(vocab_size=512, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=160, max_seq_len=128)
    return LlamaConfig(**{**base, "dtype": torch.float32, **overrides})


def ours_from_hf(cfg: LlamaConfig, hf: transformers.LlamaForCausalLM) -> Llama:
    """Our model holding the reference's weights (copied by name until load_weights exists)."""
    rename = {
        "model.embed_tokens": "embed_tokens",
        "model.norm": "final_norm",
        "model.layers": "blocks",
        "input_layernorm": "attention_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn": "attention",
        "mlp": "ffn",
    }
    state = {}
    for name, tensor in hf.state_dict().items():
        for old, new in rename.items():
            name = name.replace(old, new)
        state[name] = tensor
    model = Llama(cfg)
    model.load_state_dict(state, strict=False)
    return model.eval()

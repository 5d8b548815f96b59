"""Hugging Face transformers as an independent reference: build its Llama from our config (test-only)."""

import tempfile

import torch
import transformers

from llama_scratch import Llama, LlamaConfig, load_weights


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


def ours_from_hf(cfg: LlamaConfig, hf: transformers.PreTrainedModel) -> Llama:
    """Our model holding the reference's weights, passed through a checkpoint that transformers writes."""
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        with torch.device("meta"):
            model = Llama(cfg)
        load_weights(model, tmp, device="cpu", progress=False, mmap=False)
    return model.eval()

"""The model against Hugging Face transformers' LlamaForCausalLM: same weights, float32, max |logit diff| < 1e-4."""

import pytest
import torch

from llama_scratch import Llama, LlamaConfig
from llama_scratch.model.config import RopeScaling
from llama_scratch.model.llama import RMSNorm, rope_frequencies
from tests.hf_reference import hf_llama, ours_from_hf, padded_batch, real_positions, tiny_cfg

TOL = 1e-4

CONFIGS = {
    "grouped-query 8/2": tiny_cfg(),
    "multi-head": tiny_cfg(n_heads=4, n_kv_heads=4),
    "tied embeddings": tiny_cfg(tie_embeddings=True),
    # original context 16 tokens, sequences up to 40: positions beyond the original window exercise the scaling.
    "llama3.1 rope scaling": tiny_cfg(
        rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=16), rope_theta=500_000.0
    ),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request):
    cfg = CONFIGS[request.param]
    hf = hf_llama(cfg)
    return cfg, hf, ours_from_hf(cfg, hf)


def random_rows(cfg: LlamaConfig, lengths: list[int]) -> list[list[int]]:
    return [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in lengths]


@torch.no_grad()
def test_logits_match_without_padding(pair):
    cfg, hf, ours = pair
    ids = torch.randint(0, cfg.vocab_size, (3, 40))
    diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff < TOL


@pytest.mark.parametrize("side", ["left", "right"])
@torch.no_grad()
def test_logits_match_with_padding_at_real_positions(pair, side):
    cfg, hf, ours = pair
    rows = random_rows(cfg, [40, 23, 7])
    ids, mask = padded_batch(rows, side)
    got = ours(ids, attention_mask=mask)
    want = hf(ids, attention_mask=mask, position_ids=real_positions(mask)).logits
    real = mask.bool()
    assert (got[real] - want[real]).abs().max().item() < TOL
    assert torch.isfinite(got).all(), "pad positions must not produce NaN (they would leak into training)"
    # Independently of the reference: each padded row equals that row run alone.
    for i, row in enumerate(rows):
        alone = ours(torch.tensor([row]))[0]
        assert (got[i][real[i]] - alone).abs().max().item() < TOL


def test_parameter_counts_on_meta_device():
    expected = {
        "llama3-8b": 8_030_261_248,
        "llama3.2-1b": 1_235_814_400,
        "llama3.2-3b": 3_212_749_824,
        "llama3-70b": 70_553_706_496,
    }
    for name, count in expected.items():
        with torch.device("meta"):
            model = Llama(LlamaConfig.from_name(name))
        params = list(model.parameters())  # a tied embedding appears once
        assert sum(p.numel() for p in params) == count, name
        assert all(p.is_meta and p.dtype == torch.bfloat16 for p in params)
        assert all(b.is_meta for b in model.buffers())


def test_rope_tables_stay_float32_through_casts_and_to_empty():
    cfg = tiny_cfg(rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=16))
    reference = Llama(cfg).rope.cos.clone()
    with torch.device("meta"):
        model = Llama(LlamaConfig(**{**cfg.__dict__, "dtype": torch.bfloat16}))
    model.to_empty(device="cpu")
    assert model.rope.cos.dtype == torch.float32 and torch.equal(model.rope.cos, reference)
    model.to(torch.bfloat16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.rope.cos.dtype == torch.float32 and torch.equal(model.rope.cos, reference)
    assert "rope.cos" not in model.state_dict()


def test_llama31_frequency_scaling_matches_reference():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig.from_name("llama3.1-8b")
    hf_cfg = __import__("transformers").LlamaConfig(**cfg.to_hf_dict())
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    assert torch.allclose(rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), want, rtol=1e-6)


def test_rmsnorm_normalises_in_float32():
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16) * 300
    out = RMSNorm(64, 1e-5, torch.bfloat16)(x)
    want = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)


@pytest.mark.slow
def test_tiny_learns_to_reproduce_a_sequence():
    model = Llama(LlamaConfig.from_name("tiny"))
    seq = torch.tensor([[128000, 791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679, 13]])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(40):
        logits = model(seq[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), seq[0, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1
    assert torch.equal(model(seq[:, :-1]).argmax(-1), seq[:, 1:])

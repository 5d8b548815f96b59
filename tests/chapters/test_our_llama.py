"""The chapters' own model (`chapters/our_llama.py`) against the package, on small random configs: a fast guard
besides the notebooks (chapters 4, 6, 8 and 10 check it on SmolLM2 too)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llama_scratch import Llama, LlamaClassifier, LlamaConfig, load_model, save_checkpoint
from llama_scratch.generate import generate
from llama_scratch.model import llama as package
from llama_scratch.model.config import RopeScaling

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("our_llama", ROOT / "chapters" / "our_llama.py")
our_llama = importlib.util.module_from_spec(spec)
sys.modules["our_llama"] = our_llama
spec.loader.exec_module(our_llama)


def small(**overrides) -> LlamaConfig:
    fields = dict(vocab_size=300, dim=64, n_layers=3, n_heads=8, n_kv_heads=2, ffn_dim=160, max_seq_len=64)
    return LlamaConfig(**{**fields, "dtype": torch.float32, **overrides})


CONFIGS = {
    "grouped-query, untied": small(),
    "tied embeddings": small(tie_embeddings=True),
    "llama3.1 rope scaling": small(rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=16)),
}


def pair(cfg: LlamaConfig) -> tuple[Llama, "our_llama.OurLlama"]:
    """The package's model with random weights, and ours with the same weights."""
    torch.manual_seed(0)
    theirs = Llama(cfg).eval()
    ours = our_llama.OurLlama(cfg).eval()
    ours.load_state_dict(theirs.state_dict())  # strict: every name and shape the same
    return theirs, ours


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.no_grad()
def test_logits_equal_the_package(name):
    theirs, ours = pair(CONFIGS[name])
    ids = torch.randint(0, 300, (2, 40))
    torch.testing.assert_close(ours(ids), theirs(ids))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[0, :7] = 0  # left padding
    mask[1, 30:] = 0  # right padding
    real = mask.bool()
    torch.testing.assert_close(ours(ids, mask)[real], theirs(ids, mask)[real])


def test_pieces_equal_the_package():
    cfg = CONFIGS["llama3.1 rope scaling"]
    assert torch.equal(
        our_llama.rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
        package.rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
    )
    positions = torch.arange(40)[None]
    cos, sin = our_llama.rope_angles(positions, cfg)
    assert all(torch.equal(a, b) for a, b in zip((cos, sin), package.RotaryEmbedding(cfg)(positions), strict=True))
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    ours, theirs = our_llama.RMSNorm(64, 1e-5, torch.bfloat16), package.RMSNorm(64, 1e-5, torch.bfloat16)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
    assert torch.equal(ours(x), theirs(x))


def test_generation_equals_the_package():
    theirs, ours = pair(CONFIGS["tied embeddings"])
    prompt = [1, 5, 9, 200]
    assert our_llama.generate(ours, prompt, 20) == generate(theirs, prompt, 20)


def test_one_training_step_equals_the_package():
    theirs, ours = pair(CONFIGS["grouped-query, untied"])
    torch.manual_seed(1)
    clf_theirs = LlamaClassifier(theirs, num_classes=3, train_last=1)
    clf_ours = our_llama.OurClassifier(ours, num_classes=3, train_last=1)
    clf_ours.head.load_state_dict(clf_theirs.head.state_dict())
    trained = {n for n, p in clf_ours.named_parameters() if p.requires_grad}
    assert trained == set(clf_theirs.trainable_parameters())
    ids = torch.randint(0, 300, (4, 12))
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[1, 8:] = 0
    labels = torch.tensor([0, 2, 1, 2])
    losses, lr = [], 1e-3
    for clf in (clf_theirs, clf_ours):
        optimizer = torch.optim.AdamW([p for p in clf.parameters() if p.requires_grad], lr=lr)
        loss = F.cross_entropy(clf(ids, mask), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1])
    ours_params = dict(clf_ours.named_parameters())
    for name, p in clf_theirs.trainable_parameters().items():
        torch.testing.assert_close(ours_params[name].grad, p.grad, msg=name)
        # AdamW's first step moves a weight by lr * g / (|g| + eps): where |g| is near eps (1e-8), at noise level,
        # the last bits of g, which two correct implementations round differently, decide a visible part of the
        # update. The weights are compared where the gradient is at least 100 eps (chapter 8 does the same).
        clear = p.grad.abs() >= 100 * 1e-8
        assert clear.float().mean() > 0.9, name
        torch.testing.assert_close(ours_params[name][clear], p[clear], msg=name)


@pytest.mark.parametrize("name", ["grouped-query, untied", "tied embeddings"])
def test_load_checkpoint_equals_the_package(name, tmp_path):
    """`load_checkpoint` (chapter 8 builds your model with it) holds every tensor the package's loader holds."""
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    saved = save_checkpoint(Llama(cfg), cfg, tmp_path / "ckpt")
    theirs = load_model(saved, dtype=torch.float32, progress=False)
    ours = our_llama.load_checkpoint(saved)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert all(torch.equal(ours.state_dict()[n], p) for n, p in theirs.state_dict().items())
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == cfg.tie_embeddings

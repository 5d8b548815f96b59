"""Generation: the KV-cached step equals the full forward pass, and SmolLM2 answers a question."""

from __future__ import annotations

import re

import pytest
import torch

from llama_scratch import Llama, LlamaConfig, Tokenizer
from llama_scratch.checkpoints.weights import save_checkpoint
from llama_scratch.generate import chat_prompt, generate, main, pick_token
from llama_scratch.model.kv_cache import KVCache
from llama_scratch.sources.resolve import load_model

pytest_plugins = ["tests.smollm2"]  # the SmolLM2 fixtures: smollm2_gguf_file, smollm2_dir


def tiny(n_kv_heads: int = 2, **overrides) -> Llama:
    cfg = LlamaConfig(
        vocab_size=97,
        dim=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=n_kv_heads,
        ffn_dim=96,
        max_seq_len=64,
        dtype=torch.float32,
        **overrides,
    )
    torch.manual_seed(0)
    model = Llama(cfg).eval()
    with torch.no_grad():  # larger weights than the init, so that logits are far from uniform
        for p in model.parameters():
            p.mul_(4 if p.ndim == 2 else 1)
    return model


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_cached_steps_equal_full_forward(n_kv_heads):
    """Prefill in two chunks, then one token at a time: every position's logits as in one full forward pass."""
    model = tiny(n_kv_heads)
    ids = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(model, batch_size=2, max_len=20)
        pieces = [model(ids[:, :7], cache=cache), model(ids[:, 7:12], cache=cache)]
        pieces += [model(ids[:, t : t + 1], cache=cache) for t in range(12, 20)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 20
    with pytest.raises(ValueError, match="the cache holds 20 positions"):
        model(ids[:, :1], cache=cache)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cached_generation_equals_uncached(temperature):
    model = tiny()
    prompt = [5, 17, 3, 42, 8]
    runs = [
        generate(
            model,
            prompt,
            40,
            temperature=temperature,
            top_k=20,
            use_cache=use_cache,
            generator=torch.Generator().manual_seed(1),
        )
        for use_cache in (True, False)
    ]
    assert len(runs[0]) == 40 and runs[0] == runs[1]
    assert len(set(runs[0])) > 1  # not a degenerate repetition


def test_generation_stops_and_respects_context():
    model = tiny()
    first = generate(model, [1, 2, 3], 10)[0]
    assert generate(model, [1, 2, 3], 10, stop_ids=[first]) == [first]
    assert len(generate(model, list(range(60)), 100)) == 64 - 60 + 1  # context of 64, the last prediction included


def test_pick_token():
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0])
    assert pick_token(logits) == 1
    g = torch.Generator().manual_seed(0)
    assert {pick_token(logits, temperature=5.0, top_k=2, generator=g) for _ in range(200)} == {1, 2}
    assert {pick_token(logits, temperature=1.0, top_k=1, generator=g) for _ in range(20)} == {1}


@pytest.mark.slow
def test_smollm2_says_paris(smollm2_dir):
    tok = Tokenizer.for_checkpoint(smollm2_dir)
    model = load_model(smollm2_dir).eval()
    out = generate(model, chat_prompt(tok, "What is the capital of France?"), 24, stop_ids=tok.stop_ids)
    assert "Paris" in tok.decode(out)


@pytest.mark.slow
def test_generate_command(smollm2_dir, capsys):
    question = "What is the capital of France?"
    assert main(["--model", str(smollm2_dir), "--chat", "--max-new-tokens", "16", question]) == 0
    assert "Paris" in capsys.readouterr().out
    assert main(["--model", str(smollm2_dir / "missing"), "hi"]) == 1


def test_generate_without_model_takes_the_default_and_the_load_bar_shows_bytes_and_tensors(
    tmp_path, monkeypatch, capsys
):
    """No --model: the model finetune_classifier would take (`sources.default_model`: here the one checkpoint in
    weights/), named on stderr. The load bar shows MB and tensors loaded and seconds, not a memory-mapped "GB/s"."""
    cfg = LlamaConfig.from_name("tiny")
    save_checkpoint(Llama(cfg), cfg, tmp_path / "weights" / "mine")
    monkeypatch.chdir(tmp_path)
    assert main(["--max-new-tokens", "2", "hello"]) == 0
    out, err = capsys.readouterr()
    assert "model: weights/mine (8M parameters), the largest checkpoint in weights/ that fits" in err
    bar = err.replace("\r", "\n").split("\n")
    final = [line for line in bar if line.startswith("loading weights: 100%")][-1]
    assert re.search(r"\| 33\.6MB of 33\.6MB, 38 of 38 tensors \[\d+\.\d s\]$", final), final
    assert not [line for line in bar if "/s" in line or "it]" in line], err
    assert "model:" not in out and "loading" not in out  # stdout is the generated text alone

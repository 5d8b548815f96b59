"""One attention (issue 14) and its kernel rule (issue 20).

Training, the classifier's last-token shortcut and cached generation all run `model.Attention.forward`, which
calls `scaled_dot_product_attention` and never with both a mask and `enable_gqa=True` (on CUDA that pair falls
back to the math kernel, with float32 T x T scores). Every call is recorded here, and the shortcut and the cache
are checked against recomputing the whole sequence.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llama_scratch import Llama, LlamaClassifier, LlamaConfig
from llama_scratch.generate import generate
from llama_scratch.model.classifier import last_real_token
from llama_scratch.model.kv_cache import KVCache
from tests.hf_reference import padded_batch

CFG = LlamaConfig(
    vocab_size=97, dim=64, n_layers=3, n_heads=8, n_kv_heads=2, ffn_dim=96, max_seq_len=64, dtype=torch.float32
)
LENGTHS = [11, 4, 8]


def tiny() -> Llama:
    torch.manual_seed(0)
    model = Llama(CFG).eval()
    with torch.no_grad():  # larger weights than the init, so that logits are far from uniform
        for p in model.parameters():
            p.mul_(4 if p.ndim == 2 else 1)
    return model


def batch(side: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids of three texts of different lengths, padded on `side` ("none": three texts of one length)."""
    g = torch.Generator().manual_seed(1)
    if side == "none":
        return torch.randint(1, CFG.vocab_size, (3, 9), generator=g), None
    return padded_batch([torch.randint(1, CFG.vocab_size, (n,), generator=g).tolist() for n in LENGTHS], side)


@pytest.fixture
def sdpa_calls(monkeypatch) -> list[dict]:
    """Every call of F.scaled_dot_product_attention from now on: whether it had a mask, its flags, its shapes."""
    calls: list[dict] = []
    original = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append(dict(mask=attn_mask is not None, is_causal=is_causal, enable_gqa=enable_gqa, q=q.shape, k=k.shape))
        return original(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return calls


def assert_issue_20_rule(calls: list[dict]) -> None:
    assert calls, "no attention ran"
    both = [c for c in calls if c["mask"] and c["enable_gqa"]]
    assert not both, f"a mask together with enable_gqa=True: {both}"
    for c in calls:  # with a mask, every query head has its own key/value head
        assert not c["mask"] or c["k"][1] == c["q"][1] == CFG.n_heads, c


# ---------------------------------------------------------------------------------------------- the kernel rule


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_classifier_forward(sdpa_calls, side):
    clf = LlamaClassifier(tiny(), num_classes=3).eval()
    ids, mask = batch(side)
    with torch.no_grad():
        clf(ids, mask)
    assert_issue_20_rule(sdpa_calls)
    assert len(sdpa_calls) == CFG.n_layers
    full, last = sdpa_calls[:-1], sdpa_calls[-1]
    if side == "right":  # causal alone is exact for right padding: the fast kernel, grouped, no mask
        assert all(c["is_causal"] and not c["mask"] and c["enable_gqa"] for c in full)
    else:
        assert all(c["mask"] and not c["is_causal"] for c in full)
    assert last["mask"] and last["q"][2] == 1 and last["k"][2] == ids.shape[1]  # one query per row, every key


@pytest.mark.parametrize("train_last", [1, None])
@pytest.mark.parametrize("side", ["left", "right", "none"])
def test_training_step(sdpa_calls, train_last, side):
    clf = LlamaClassifier(tiny(), num_classes=3, train_last=train_last).train()
    ids, mask = batch(side)
    F.cross_entropy(clf(ids, mask), torch.tensor([0, 2, 1])).backward()
    assert_issue_20_rule(sdpa_calls)
    assert all(p.grad is not None for p in clf.trainable_parameters().values())
    if side == "none":  # no padding: every call is plain grouped attention, the last block's without a mask
        assert not any(c["mask"] for c in sdpa_calls) and all(c["enable_gqa"] for c in sdpa_calls)


def test_generation_prefill_and_decode(sdpa_calls):
    model = tiny()
    prompt = [5, 17, 3, 42, 8]
    generate(model, prompt, 6)
    assert_issue_20_rule(sdpa_calls)
    prefill, decode = sdpa_calls[: CFG.n_layers], sdpa_calls[CFG.n_layers :]
    assert all(c["is_causal"] and not c["mask"] and c["q"][2] == len(prompt) for c in prefill)
    # One new token sees the whole cache: no mask, and not is_causal (which would align it with key 0 only).
    assert len(decode) == 5 * CFG.n_layers
    assert all(not c["is_causal"] and not c["mask"] and c["q"][2] == 1 and c["enable_gqa"] for c in decode)


# ---------------------------------------------------------------------------------------------- same results


@pytest.mark.parametrize("train_last", [0, 1, None])
@pytest.mark.parametrize("side", ["left", "right", "none"])
def test_shortcut_equals_full_sequence(train_last, side):
    """The classifier's last block at the pooled token only gives the logits (and gradients) of running it at every
    position and then pooling."""
    clf = LlamaClassifier(tiny(), num_classes=3, train_last=train_last).train()
    ids, mask = batch(side)
    labels = torch.tensor([0, 2, 1])

    def full_sequence() -> torch.Tensor:  # every block at every position, then pooling
        return clf.head(last_real_token(clf.backbone.hidden_states(ids, mask), mask))

    def logits_and_grads(shortcut: bool):
        clf.zero_grad()
        logits = clf(ids, mask) if shortcut else full_sequence()
        F.cross_entropy(logits, labels).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in clf.trainable_parameters().items()}

    (fast, fast_grads), (full, full_grads) = logits_and_grads(True), logits_and_grads(False)
    torch.testing.assert_close(fast, full, rtol=1e-5, atol=1e-5)
    assert fast_grads.keys() == full_grads.keys()
    for name, g in fast_grads.items():
        torch.testing.assert_close(g, full_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_every_block_runs_as_a_module():
    """Hooks on the blocks (LoRA, FSDP2, activation checkpointing act through them) see the shortcut's last block
    and every generation step."""
    model = tiny()
    runs = []
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda module, args, i=i: runs.append(i))
    ids, mask = batch("right")
    with torch.no_grad():
        LlamaClassifier(model, num_classes=3)(ids, mask)
    assert runs == list(range(CFG.n_layers))
    runs.clear()
    generate(model, [5, 17, 3], 4)
    assert runs == list(range(CFG.n_layers)) * 4


def test_cached_greedy_generation_equals_recomputing():
    """Greedy decoding with the cache and by recomputing the whole sequence each step: the same tokens, and the
    logits of every step close."""
    model = tiny()
    prompt = torch.tensor([[5, 17, 3, 42, 8]])
    cache = KVCache(model, 1, 30)
    ids, new = prompt, prompt
    with torch.no_grad():
        for _ in range(20):
            cached, full = model(new, cache=cache)[0, -1], model(ids)[0, -1]
            torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)
            assert cached.argmax() == full.argmax()
            new = full.argmax().view(1, 1)
            ids = torch.cat([ids, new], dim=1)
    assert cache.length == ids.shape[1] - 1 and len(set(ids[0, 5:].tolist())) > 1


def test_left_padded_batch_generation_with_cache(sdpa_calls):
    """A left-padded batch, prefilled then decoded token by token with the cache and a growing attention mask:
    each step's logits equal a full forward pass with the mask, and every step needs a mask (the pads)."""
    model = tiny()
    ids, mask = batch("left")
    cache = KVCache(model, ids.shape[0], ids.shape[1] + 8)
    new = ids
    with torch.no_grad():
        for _ in range(8):
            cached = model(new, mask, cache=cache)[:, -1]
            full = model(ids, mask)[:, -1]
            torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)
            new = full.argmax(-1, keepdim=True)
            ids, mask = torch.cat([ids, new], dim=1), torch.cat([mask, torch.ones_like(new)], dim=1)
    assert_issue_20_rule(sdpa_calls)
    assert all(c["mask"] for c in sdpa_calls)


def test_chunked_prefill_after_cached_positions(sdpa_calls):
    """Several new tokens after cached ones: causal counted from the bottom right (is_causal would align the
    triangle with key 0), so a mask, with keys and values repeated."""
    model = tiny()
    ids = torch.randint(0, CFG.vocab_size, (2, 12))
    cache = KVCache(model, 2, 12)
    with torch.no_grad():
        pieces = [model(ids[:, :5], cache=cache), model(ids[:, 5:], cache=cache)]
        full = model(ids)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    assert_issue_20_rule(sdpa_calls)
    second = sdpa_calls[CFG.n_layers : 2 * CFG.n_layers]
    assert all(c["mask"] and not c["is_causal"] and c["q"][2] == 7 and c["k"][2] == 12 for c in second)


# ---------------------------------------------------------------------------------------------- repeat or share


def every_path() -> list[torch.Tensor]:
    """The outputs of every layout attention serves: no padding (is_causal), right and left padding, the
    classifier's last token (query rows), packed texts and their last tokens, a cache's prefill, chunked prefill
    (a mask after cached keys) and decoding, and a left-padded batch decoded with its mask."""
    from llama_scratch.model.layout import Layout
    from llama_scratch.model.packing import pack_ids

    model = tiny()
    clf = LlamaClassifier(model, num_classes=3, train_last=2).eval()
    outputs = []
    with torch.no_grad():
        outputs.append(model(batch("none")[0]))
        for side in ("right", "left"):
            ids, mask = batch(side)
            outputs += [model(ids, mask), clf(ids, mask)]
        g = torch.Generator().manual_seed(2)
        ids, texts = pack_ids([torch.randint(1, CFG.vocab_size, (n,), generator=g).tolist() for n in LENGTHS])
        outputs.append(clf(ids, layout=Layout.packed(texts)))
        ids = torch.randint(0, CFG.vocab_size, (2, 12), generator=g)
        cache = KVCache(model, 2, 13)
        outputs += [model(ids[:, :5], cache=cache), model(ids[:, 5:], cache=cache), model(ids[:, :1], cache=cache)]
        ids, mask = batch("left")
        cache = KVCache(model, ids.shape[0], ids.shape[1] + 1)
        outputs.append(model(ids, mask, cache=cache))
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        outputs.append(model(ids[:, -1:], mask, cache=cache))
    return outputs


def test_sharing_key_value_heads_equals_repeating_them_on_every_path(monkeypatch, sdpa_calls):
    """Where the kernel shares key/value heads (`enable_gqa`) and where they are repeated first is a speed choice
    (model.attention_kernels.kernel_shares_heads): every path's output is the same, in float32, to 1e-6, with the
    rule, with every call repeating, and with every call sharing (the CPU's kernel takes a mask with shared heads
    too)."""
    from llama_scratch.model import attention_kernels

    by_rule = every_path()
    assert any(c["enable_gqa"] for c in sdpa_calls) and any(c["mask"] and not c["enable_gqa"] for c in sdpa_calls)
    for always in (False, True):
        monkeypatch.setattr(attention_kernels, "kernel_shares_heads", lambda q, mask, always=always: always)
        sdpa_calls.clear()
        other = every_path()
        assert all(c["enable_gqa"] is always for c in sdpa_calls)
        for a, b in zip(by_rule, other, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_kernel_shares_heads_only_where_a_fast_kernel_takes_them():
    """No mask: shared on the CPU; on CUDA only in half precision (flash's dtypes). A mask: repeated everywhere.
    (The GPU's compute capability is asked only for a CUDA tensor; meta tensors stand in for the others.)"""
    from llama_scratch.model.attention_kernels import kernel_shares_heads

    q, mask = torch.zeros(1, 8, 4, 8), torch.ones(1, 1, 4, 4, dtype=torch.bool)
    assert kernel_shares_heads(q, None) and not kernel_shares_heads(q, mask)
    assert not kernel_shares_heads(q.to("meta"), None)
    if torch.cuda.is_available():
        cuda = q.cuda()
        assert not kernel_shares_heads(cuda, None) and not kernel_shares_heads(cuda.bfloat16(), mask.cuda())
        assert kernel_shares_heads(cuda.bfloat16(), None) == (torch.cuda.get_device_capability() >= (8, 0))

"""Padding-free batches (issue 19): the packed path gives the padded path's logits and gradients, and the forward
reads no device tensor back (issue 20: no host sync)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llama_scratch import Llama, LlamaClassifier, LlamaConfig
from llama_scratch.data.batching import TokenizedSplit, forward, to_batch
from llama_scratch.model.layout import Layout
from llama_scratch.model.lora import LoRASettings
from llama_scratch.model.packing import pack, pack_ids
from llama_scratch.parallel.strategy import Replicated
from llama_scratch.training import prefix_cache
from llama_scratch.training.prefix_cache import cache_splits, compute_frozen_states

CFG = LlamaConfig(
    vocab_size=97, dim=64, n_layers=3, n_heads=8, n_kv_heads=2, ffn_dim=96, max_seq_len=64, dtype=torch.float32
)
LENGTHS = [11, 4, 8, 1]


def tiny() -> Llama:
    torch.manual_seed(0)
    model = Llama(CFG)
    with torch.no_grad():  # larger weights than the init, so that logits are far from uniform
        for p in model.parameters():
            p.mul_(4 if p.ndim == 2 else 1)
    return model


def split() -> TokenizedSplit:
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(1, CFG.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    return TokenizedSplit(ids, [0, 2, 1, 2], pad_id=0)


def logits_and_grads(clf: LlamaClassifier, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    clf.zero_grad()
    logits = forward(clf, batch)
    F.cross_entropy(logits, batch["labels"]).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in clf.trainable_parameters().items()}


def test_pack_layout():
    layout = pack([3, 1, 2])
    assert layout.positions.tolist() == [[0, 1, 2, 0, 0, 1]]  # positions restart with every text
    assert layout.slots.tolist() == [0, 1, 2, 3, 6, 7]  # in a right-padded [3 texts x 3] layout
    assert layout.last.tolist() == [[2, 3, 5]]
    assert layout.last_sees[:, 0, 0].tolist() == [[True] * 3, [True, False, False], [True, True, False]]
    t = torch.arange(6.0).view(1, 1, 6, 1)
    assert layout.pad(t)[:, 0, :, 0].tolist() == [[0, 1, 2], [3, 0, 0], [4, 5, 0]]
    assert torch.equal(layout.unpad(layout.pad(t)), t)
    with pytest.raises(ValueError, match="at least one token"):
        pack([2, 0])


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("train_last", [1, None])
@pytest.mark.parametrize("side", ["right", "left"])
def test_packed_equals_padded(side, train_last, lora, pooling):
    """Logits and every trained parameter's gradient, packed vs padded on either side, to 1e-5 in float32, whichever
    vector the head reads."""
    settings = LoRASettings(rank=4, alpha=8, dropout=0.0) if lora else None
    clf = LlamaClassifier(tiny(), num_classes=3, train_last=train_last, lora=settings, pooling=pooling).train()
    if lora:  # adapters start at zero (lora_b); make them matter
        with torch.no_grad():
            for name, p in clf.named_parameters():
                if name.endswith("lora_b"):
                    p.normal_(std=0.1)
    data, rows = split(), [0, 1, 2, 3]
    padded, padded_grads = logits_and_grads(clf, to_batch(data, rows, side, torch.device("cpu")))
    packed, packed_grads = logits_and_grads(clf, to_batch(data, rows, "packed", torch.device("cpu")))
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    assert packed_grads.keys() == padded_grads.keys() and packed_grads
    for name, g in packed_grads.items():
        torch.testing.assert_close(g, padded_grads[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("train_last", [0, 1])
def test_packed_frozen_prefix_equals_padded(train_last, pooling):
    """The frozen-prefix pass packed gives the padded pass's states, and training on them packed the same logits
    (under train_last 0, the cache holds every block's output and the head reads it directly)."""
    clf = LlamaClassifier(tiny(), num_classes=3, train_last=train_last, pooling=pooling).eval()
    data = split()
    packed = compute_frozen_states(clf, data.ids, data.pad_id, batch_size=3, show=False, packed=True)
    padded = compute_frozen_states(clf, data.ids, data.pad_id, batch_size=3, show=False, packed=False)
    for a, b, n in zip(packed, padded, LENGTHS, strict=True):
        assert a.shape == (n, CFG.dim)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    cached = TokenizedSplit(data.ids, data.labels, packed, data.pad_id)
    with torch.no_grad():
        want = forward(clf, to_batch(data, [3, 0, 2], "left", torch.device("cpu")))
        got = forward(clf, to_batch(cached, [3, 0, 2], "packed", torch.device("cpu")))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cache_splits_runs_each_distinct_text_once(monkeypatch):
    """A text in two splits, or twice in one, runs through the frozen blocks once; its copies share that one tensor,
    equal to the text run alone, and the splits keep their order, ids and labels."""
    clf = LlamaClassifier(tiny(), num_classes=3, train_last=1).eval()
    a, b, c, d = split().ids
    splits = {
        "train": TokenizedSplit([a, b, a], [0, 1, 0], pad_id=0),
        "test": TokenizedSplit([c, b, d], [1, 1, 2], pad_id=0),
    }
    ran = []
    real = prefix_cache.compute_frozen_states

    def recording(clf, token_lists, *args, **kwargs):
        ran.append([list(t) for t in token_lists])
        return real(clf, token_lists, *args, **kwargs)

    monkeypatch.setattr(prefix_cache, "compute_frozen_states", recording)
    cached = cache_splits(clf, splits, rows=3, strategy=Replicated())
    assert ran == [[a, b, c, d]]  # once, every distinct text, in order of first appearance
    train, test = cached["train"].states, cached["test"].states
    assert train[0] is train[2] and train[1] is test[1]
    alone = [real(clf, [t], 0, batch_size=1, show=False, packed=True)[0] for t in (a, b, c, d)]
    for got, i in zip([*train, *test], [0, 1, 0, 2, 1, 3], strict=True):
        torch.testing.assert_close(got, alone[i], rtol=1e-5, atol=1e-5)
    for name in splits:
        assert (cached[name].ids, cached[name].labels) == (splits[name].ids, splits[name].labels)


def test_last_layer_hidden_states_match_an_unpadded_run():
    """Every token of the packed stream gets the hidden state of its text run alone."""
    model = tiny().eval()
    ids, texts = pack_ids(split().ids)
    with torch.no_grad():
        packed = model.run_blocks(model.embed_tokens(ids), Layout.packed(texts))
        for tokens, got in zip(split().ids, texts.split(packed), strict=True):
            alone = model.run_blocks(model.embed_tokens(torch.tensor([tokens])))[0]
            torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("layout", ["packed", "right", "left"])
def test_no_host_sync_in_a_classifier_forward(monkeypatch, layout, pooling):
    """No tensor is read back to the host during the forward and backward of a batch from `to_batch`."""
    clf = LlamaClassifier(tiny(), num_classes=3, train_last=None, pooling=pooling).train()
    batch = to_batch(split(), [0, 1, 2, 3], layout, torch.device("cpu"))
    reads = []
    for name in ("__bool__", "item", "tolist", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name: reads.append(_n) or _o(self, *a))
    F.cross_entropy(forward(clf, batch), batch["labels"]).backward()
    monkeypatch.undo()
    assert reads == []


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_packed_with_gradient_checkpointing(pooling):
    """Recomputing blocks in backward (the packed layout passed through `checkpoint`) gives the same gradients."""
    clf = LlamaClassifier(tiny(), num_classes=3, train_last=None, pooling=pooling).train()
    batch = to_batch(split(), [0, 1, 2, 3], "packed", torch.device("cpu"))
    _, plain = logits_and_grads(clf, batch)
    clf.backbone.gradient_checkpointing = True
    _, recomputed = logits_and_grads(clf, batch)
    for name, g in recomputed.items():
        torch.testing.assert_close(g, plain[name], rtol=1e-6, atol=1e-6, msg=name)

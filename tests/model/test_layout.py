"""The batch layout (model/layout.py): the same texts run padded on either side, packed, and through a KV cache
give every real token the same hidden state as the text run alone, and a layout read at its last tokens shows
the last block the keys each text's last token may see."""

from __future__ import annotations

import pytest
import torch

from llama_scratch import Llama, LlamaConfig
from llama_scratch.data.batching import collate
from llama_scratch.model.kv_cache import KVCache
from llama_scratch.model.layout import Layout
from llama_scratch.model.packing import pack_ids

CFG = LlamaConfig(
    vocab_size=97, dim=64, n_layers=3, n_heads=8, n_kv_heads=2, ffn_dim=96, max_seq_len=64, dtype=torch.float32
)
LENGTHS = [7, 3, 5, 1]
CPU = torch.device("cpu")


def tiny() -> Llama:
    torch.manual_seed(0)
    model = Llama(CFG).eval()
    with torch.no_grad():  # larger weights than the init, so that hidden states are far from alike
        for p in model.parameters():
            p.mul_(4 if p.ndim == 2 else 1)
    return model


def texts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, CFG.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]


def run(model: Llama, ids: torch.Tensor, layout: Layout | None = None) -> torch.Tensor:
    """Every block's output at every token of `ids` laid out as `layout` says (the residual stream, no final norm)."""
    return model.run_blocks(model.embed_tokens(ids), layout)


@pytest.fixture(scope="module")
def alone() -> list[torch.Tensor]:
    """Each text run by itself, one row, no padding: [length, dim] each, the reference."""
    with torch.no_grad():
        return [run(tiny(), torch.tensor([t]))[0] for t in texts()]


# Float32 on the CPU: the layouts change only the shapes the kernels see (a row's length, a batch of texts), so the
# sums run in other orders; 1e-5 is a few float32 ulps of these hidden states (their size is ~10).
CLOSE = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_equals_each_text_alone(alone, side):
    batch = collate([(t, 0) for t in texts()], pad_id=0, padding_side=side)
    mask = batch["attention_mask"]
    with torch.no_grad():
        told, looked = (run(tiny(), batch["input_ids"], Layout.padded(mask, side=s)) for s in (side, None))
    torch.testing.assert_close(told, looked, rtol=0, atol=0)  # the side told or read from the mask: one result
    for row, want in enumerate(alone):
        torch.testing.assert_close(told[row, mask[row].bool()], want, **CLOSE)


def test_packed_equals_each_text_alone(alone):
    ids, packed = pack_ids(texts())
    with torch.no_grad():
        got = packed.split(run(tiny(), ids, Layout.packed(packed)))
    for g, want in zip(got, alone, strict=True):
        torch.testing.assert_close(g, want, **CLOSE)


def test_cached_equals_each_text_alone(alone):
    """Each text in two pieces through a KV cache (the second after the first's cached keys and values), and the
    texts left-padded in one batch whose last token comes after the cached rest (the mask covers both)."""
    model = tiny()
    with torch.no_grad():
        for tokens, want in zip(texts(), alone, strict=True):
            ids, cache, pieces, cut = torch.tensor([tokens]), KVCache(model, 1, len(tokens)), [], (len(tokens) + 1) // 2
            for piece in (p for p in (ids[:, :cut], ids[:, cut:]) if p.shape[1]):  # a one-token text: one piece
                pieces.append(run(model, piece, Layout.unpadded(piece.shape[1], CPU, cache=cache)))
                cache.length += piece.shape[1]
            torch.testing.assert_close(torch.cat(pieces, dim=1)[0], want, **CLOSE)
        batch = collate([(t, 0) for t in texts()], pad_id=0, padding_side="left")
        ids, mask = batch["input_ids"], batch["attention_mask"]
        cache = KVCache(model, ids.shape[0], ids.shape[1])
        first = run(model, ids[:, :-1], Layout.padded(mask[:, :-1], cache=cache))
        cache.length += ids.shape[1] - 1
        last = run(model, ids[:, -1:], Layout.padded(mask, cache=cache))
    got = torch.cat([first, last], dim=1)
    for row, want in enumerate(alone):
        torch.testing.assert_close(got[row, mask[row].bool()], want, **CLOSE)


def test_a_cache_refuses_more_positions_than_it_holds():
    cache = KVCache(tiny(), 1, 4)
    cache.length = 3
    with pytest.raises(ValueError, match="the cache holds 4 positions; 3 used, 2 more asked"):
        Layout.unpadded(2, CPU, cache=cache)


def test_the_last_tokens_and_the_keys_they_see():
    """The classifier's rows: each text's last real token; at the last block only, with the keys it may see."""
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    right = Layout.padded(mask, side="right")
    assert right.mask is None and right.is_causal  # right padding: plain causal attention
    read = right.at_last_tokens()
    assert read.rows.tolist() == [[2], [0]]
    before, last = read.for_block(1, last=False), read.for_block(2, last=True)
    assert before.rows is None and before.mask is None and before.is_causal and before.block == 1
    assert last.mask[:, 0, 0].tolist() == [[True] * 3, [True, False, False]] and not last.is_causal
    assert isinstance(Layout.unpadded(3, CPU).at_last_tokens().rows, slice)  # no padding: the last column
    _, packed = pack_ids([[5, 6], [7]])
    texts_read = Layout.packed(packed).at_last_tokens().for_block(0, last=True)
    assert texts_read.rows.tolist() == [[1, 2]] and texts_read.mask is packed.last_sees

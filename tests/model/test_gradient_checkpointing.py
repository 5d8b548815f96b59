"""Gradient checkpointing recomputes block activations in backward: the gradients must be those of a plain run."""

import pytest
import torch
import torch.nn.functional as F

from llama_scratch import Llama, LlamaClassifier, LlamaConfig

CFG = LlamaConfig(
    vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=160, max_seq_len=64, dtype=torch.float32
)


def gradients(train_last: int | None, checkpointing: bool, mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    clf = LlamaClassifier(Llama(CFG), num_classes=3, train_last=train_last).train()
    clf.backbone.gradient_checkpointing = checkpointing
    ids = torch.randint(0, CFG.vocab_size, (3, 20), generator=torch.Generator().manual_seed(1))
    F.cross_entropy(clf(ids, mask), torch.tensor([0, 2, 1])).backward()
    return {name: p.grad for name, p in clf.trainable_parameters().items()}


@pytest.mark.parametrize("train_last", [None, 2])
@pytest.mark.parametrize("padding", ["none", "left"])
def test_same_gradients_with_and_without_checkpointing(train_last, padding):
    mask = None
    if padding == "left":  # an explicit attention mask: the other SDPA path, and rotary positions per row
        mask = torch.ones(3, 20, dtype=torch.long)
        mask[1, :7] = 0
    plain = gradients(train_last, False, mask)
    recomputed = gradients(train_last, True, mask)
    assert plain.keys() == recomputed.keys() and len(plain) > 0
    for name, g in plain.items():
        assert g is not None and recomputed[name] is not None, name
        assert torch.allclose(g, recomputed[name], atol=1e-5, rtol=0), name


def test_checkpointing_only_while_training_with_grad():
    """Evaluation and inference run the plain blocks: same outputs, nothing recomputed."""
    clf = LlamaClassifier(Llama(CFG), num_classes=2, train_last=2)
    ids = torch.randint(0, CFG.vocab_size, (2, 9))
    with torch.no_grad():
        want = clf.eval()(ids)
        clf.backbone.gradient_checkpointing = True
        assert torch.equal(clf(ids), want)
        assert torch.equal(clf.train()(ids), want)


def test_checkpointing_keeps_only_block_inputs():
    """With checkpointing, nothing inside a trained block is saved for backward (only what the final norm and the
    head need); the blocks' inputs are kept by the checkpoint itself."""

    def saved_bytes(checkpointing: bool) -> int:
        clf = LlamaClassifier(Llama(CFG), num_classes=2, train_last=None).train()
        clf.backbone.gradient_checkpointing = checkpointing
        params = {p.untyped_storage().data_ptr() for p in clf.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                seen[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            clf(torch.randint(0, CFG.vocab_size, (4, 32)))
        return sum(seen.values())

    assert saved_bytes(True) < saved_bytes(False) / 5

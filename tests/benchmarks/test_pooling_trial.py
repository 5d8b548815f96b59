"""benchmarks/pooling_trial.py's mean pooling against transformers: the masked mean of `LlamaModel`'s last hidden
state (after its final norm) through our head, for a batch packed, padded on either side, and one text alone."""

import sys
from pathlib import Path

import pytest
import torch
import transformers

from llama_scratch import LlamaClassifier
from llama_scratch.data.batching import TokenizedSplit, forward, to_batch
from tests.hf_reference import ours_from_hf, real_positions, tiny_cfg

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import pooling_trial  # noqa: E402


@pytest.mark.parametrize("side", ["packed", "right", "left"])
@torch.no_grad()
def test_the_mean_of_each_texts_vectors_as_transformers_computes_them(side, monkeypatch):
    cfg = tiny_cfg()
    torch.manual_seed(1)
    causal = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.to_hf_dict())).float().eval()
    clf = LlamaClassifier(ours_from_hf(cfg, causal), num_classes=3, train_last=1).eval()
    monkeypatch.setattr(LlamaClassifier, "forward", pooling_trial.mean_pooled)
    rows = [torch.randint(1, cfg.vocab_size, (n,)).tolist() for n in (17, 5, 30, 1)]
    batch = to_batch(TokenizedSplit(rows, [0, 1, 2, 0]), list(range(4)), side, torch.device("cpu"))
    got = forward(clf, batch)
    want = []
    for row in rows:  # each text alone: no padding for the reference to get wrong
        hidden = causal.model(
            torch.tensor([row]), position_ids=real_positions(torch.ones(1, len(row)))
        ).last_hidden_state
        want.append(clf.head(hidden[0].mean(0)))
    assert (got - torch.stack(want)).abs().max().item() < 1e-4

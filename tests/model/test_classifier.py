"""The classifier against transformers' LlamaForSequenceClassification (and, pooling the mean, its LlamaModel's hidden
states), and which parameters train."""

import pytest
import torch
import transformers

from llama_scratch import Llama, LlamaClassifier, LlamaConfig
from llama_scratch.data.batching import TokenizedSplit, forward, to_batch
from llama_scratch.model.layout import Layout
from tests.hf_reference import ours_from_hf, padded_batch, real_positions, tiny_cfg

PAD = 0  # the test's pad id; real tokens are drawn from 1..vocab-1 so that the reference can find them


@pytest.fixture(scope="module")
def pair():
    cfg = tiny_cfg()
    hf_cfg = transformers.LlamaConfig(**cfg.to_hf_dict(), num_labels=3, pad_token_id=PAD)
    torch.manual_seed(1)
    hf = transformers.LlamaForSequenceClassification(hf_cfg).float().eval()
    causal = transformers.LlamaForCausalLM(hf_cfg).float()
    causal.model.load_state_dict(hf.model.state_dict())
    clf = LlamaClassifier(ours_from_hf(cfg, causal), num_classes=3).eval()
    with torch.no_grad():
        clf.head.weight.copy_(hf.score.weight)
    return cfg, hf, clf


@pytest.mark.parametrize("side", ["left", "right"])
@torch.no_grad()
def test_logits_match_sequence_classification(pair, side):
    cfg, hf, clf = pair
    rows = [torch.randint(1, cfg.vocab_size, (n,)).tolist() for n in (17, 5, 30, 1)]
    ids, mask = padded_batch(rows, side)
    got = clf(ids, mask)
    want = hf(ids, attention_mask=mask, position_ids=real_positions(mask)).logits
    assert got.shape == (4, 3)
    assert (got - want).abs().max().item() < 1e-4
    # Padding must not change a row's scores: compare with each row alone.
    for i, row in enumerate(rows):
        assert (got[i] - clf(torch.tensor([row]))[0]).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_follows_backbone_dtype(dtype):
    model = Llama(tiny_cfg(dtype=dtype))
    clf = LlamaClassifier(model, num_classes=2)
    assert clf.head.weight.dtype == dtype and clf.head.weight.device == model.final_norm.weight.device
    ids = torch.randint(0, 512, (2, 6))
    assert clf(ids, torch.ones_like(ids)).dtype == dtype  # the seed bug: a float32 head here raised


def test_only_intended_parameters_train():
    cfg = tiny_cfg(n_layers=4)
    clf = LlamaClassifier(Llama(cfg), num_classes=2, train_last=1)
    trainable = set(clf.trainable_parameters())
    assert trainable == {
        "head.weight",
        "backbone.final_norm.weight",
        *(f"backbone.blocks.3.{n}" for n, _ in clf.backbone.blocks[3].named_parameters()),
    }
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    torch.nn.functional.cross_entropy(clf(ids), torch.tensor([0, 1])).backward()
    for name, p in clf.named_parameters():
        assert (p.grad is not None) == (name in trainable), name

    clf.set_trainable(None)
    names = set(clf.trainable_parameters())
    assert "backbone.embed_tokens.weight" in names and "backbone.lm_head.weight" not in names
    clf.set_trainable(0)
    assert set(clf.trainable_parameters()) == {"head.weight", "backbone.final_norm.weight"}
    with pytest.raises(ValueError, match="between 0 and 4"):
        clf.set_trainable(5)


def test_tied_backbone_keeps_its_embedding_trainable_when_training_all():
    clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), train_last=None)
    assert "backbone.embed_tokens.weight" in clf.trainable_parameters()


@pytest.mark.parametrize("device", ["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
def test_one_process_and_a_sharded_run_start_from_the_same_head_and_adapters(device):
    """The head and LoRA adapters are drawn from the CPU's generator wherever the model is: a sharded run draws
    them on the CPU (sharding.fresh_values) and one process on a GPU used to draw them from the GPU's generator."""
    from llama_scratch.model.lora import LoRASettings, lora_layers
    from llama_scratch.parallel.sharding import fresh_values

    cfg, lora = LlamaConfig.from_name("tiny"), LoRASettings(rank=4, alpha=8.0)
    backbone = Llama(cfg).to(device)
    torch.manual_seed(7)
    one = LlamaClassifier(backbone, num_classes=3, train_last=2, lora=lora)
    with torch.device("meta"):
        meta = LlamaClassifier(Llama(cfg), num_classes=3, train_last=2, lora=lora)
    torch.manual_seed(7)
    sharded = fresh_values(meta)
    assert len(lora_layers(one)) > 0 and sharded.keys() == {
        n for n, p in one.named_parameters() if "lora" in n or n == "head.weight"
    }
    for name, p in one.named_parameters():
        if name in sharded:
            assert p.device.type == device and torch.equal(p.detach().cpu(), sharded[name]), name


@pytest.mark.parametrize("side", ["packed", "right", "left"])
@torch.no_grad()
def test_mean_pooling_reads_the_mean_that_transformers_hidden_states_give(side):
    """`pooling="mean"`: the head reads the mean of each text's vectors after the final norm, as the masked mean of
    transformers' `LlamaModel` last hidden state is, for a batch packed or padded on either side (a pad weighs
    nothing), and the last block runs at every position (not at the last tokens only)."""
    cfg = tiny_cfg()
    torch.manual_seed(1)
    causal = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.to_hf_dict())).float().eval()
    clf = LlamaClassifier(ours_from_hf(cfg, causal), num_classes=3, train_last=1, pooling="mean").eval()
    rows = [torch.randint(1, cfg.vocab_size, (n,)).tolist() for n in (17, 5, 30, 1)]
    got = forward(clf, to_batch(TokenizedSplit(rows, [0, 1, 2, 0]), list(range(4)), side, torch.device("cpu")))
    want = []
    for row in rows:  # each text alone: no padding for the reference to get wrong
        hidden = causal.model(torch.tensor([row])).last_hidden_state
        want.append(clf.head(hidden[0].mean(0)))
    assert (got - torch.stack(want)).abs().max().item() < 1e-4


def test_an_unknown_pooling_is_refused_by_name():
    with pytest.raises(ValueError, match="pooling must be one of last, mean, got 'max'"):
        LlamaClassifier(Llama(tiny_cfg()), num_classes=2, pooling="max")
    clf = LlamaClassifier(Llama(tiny_cfg()), num_classes=2)
    with pytest.raises(ValueError, match="pooling must be one of last, mean, got 'Mean'"):  # set after a build
        clf.pooling = "Mean"
    assert clf.pooling == "last"


def test_a_padded_mean_in_bfloat16_is_the_mean_of_the_text_alone_past_256_tokens():
    """bfloat16 counts exactly only up to 256: a padded batch's mean must divide by the true count, as a text's own
    `mean` (and the packed path) does, so the same text gets the same vector whatever its batch."""
    torch.manual_seed(0)
    t = torch.randn(2, 257, 8).bfloat16()
    mask = torch.ones(2, 257, dtype=torch.long)
    mask[1, 200:] = 0
    got = Layout.padded(mask, side="right").text_means(t)
    assert torch.equal(got, torch.stack([t[0].mean(0), t[1, :200].mean(0)]))

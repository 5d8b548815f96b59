"""LoRA: the layer against its equation and its merge, which parameters train, the saved run read back by
classify, PEFT as the reference, DDP against one process, and resume refusing other LoRA settings."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file
from torch import nn

from llama_scratch import Llama, LlamaClassifier, LlamaConfig, classify, finetune_classifier
from llama_scratch.checkpoints.weights import save_checkpoint
from llama_scratch.data.labelled import load_dataset
from llama_scratch.data.splitting import split_dataset
from llama_scratch.model.lora import TARGETS, LoRALinear, LoRASettings, add_lora, merge_lora
from llama_scratch.planning.memory import PlanInputs, count_parameters, plan_memory
from tests.checkpoints.test_trust import interrupt_first_validation
from tests.commands.test_finetune import args_for, run_module
from tests.hf_reference import ours_from_hf, padded_batch, real_positions, tiny_cfg

PROJECTIONS = {t: path.split(".")[1] for t, path in TARGETS.items()}  # "q" -> "q_proj"


@pytest.mark.parametrize("bias", [False, True])
def test_layer_is_the_plain_layer_at_init_and_after_merge(bias):
    base = nn.Linear(24, 40, bias=bias)
    x = torch.randn(5, 3, 24)
    want = base(x).detach()
    layer = LoRALinear(base, rank=4, alpha=8.0)
    assert layer.weight is base.weight and not layer.weight.requires_grad  # the same Parameter, frozen: no copy
    assert layer.scale == 2.0 and not layer.lora_b.any() and layer.lora_a.std() > 0
    assert torch.equal(layer(x), want)  # B = 0: exactly the pretrained layer

    with torch.no_grad():
        layer.lora_b.normal_()
    adapted = layer(x).detach()
    by_hand = want + 2.0 * x @ (layer.lora_b @ layer.lora_a).T.detach()  # h = W x + b + (alpha / r) B A x
    assert (adapted - by_hand).abs().max() < 1e-5 and (adapted - want).abs().max() > 0.1
    merged = layer.merge()
    assert type(merged) is nn.Linear and merged.weight is base.weight
    assert (merged(x) - adapted).abs().max() < 1e-5
    assert (layer(x) - adapted).abs().max() < 1e-5  # B was zeroed: calling it again (or merging again) adds nothing


def test_merge_lora_gives_back_the_base_names_and_the_adapted_outputs():
    model = Llama(tiny_cfg(n_layers=3)).eval()
    names = set(model.state_dict())
    add_lora(model, rank=4, targets="q,v,down", blocks=[1, 2])
    for p in model.parameters():
        if p.shape[0] != 4 and p.ndim == 2 and p.requires_grad:  # each lora_b [out, rank]
            nn.init.normal_(p, std=0.1)
    ids = torch.randint(0, 512, (2, 9))
    adapted = model(ids)
    assert set(model.state_dict()) > names
    merge_lora(model)
    assert set(model.state_dict()) == names and not any(isinstance(m, LoRALinear) for m in model.modules())
    assert (model(ids) - adapted).abs().max() < 1e-4


def test_only_adapters_head_and_final_norm_train():
    cfg = tiny_cfg(n_layers=4)
    plain_names = set(Llama(cfg).state_dict())
    clf = LlamaClassifier(Llama(cfg), num_classes=2, train_last=2, lora=LoRASettings(4))
    adapters = {
        f"backbone.blocks.{i}.{path}.lora_{ab}" for i in (2, 3) for path in TARGETS.values() for ab in ("a", "b")
    }
    assert clf.lora_blocks == [2, 3]
    assert set(clf.trainable_parameters()) == {"head.weight", "backbone.final_norm.weight", *adapters}
    assert {f"backbone.{n}" for n in plain_names} <= set(clf.state_dict())  # the base weights keep their names
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    F.cross_entropy(clf(ids), torch.tensor([0, 1])).backward()
    for name, p in clf.named_parameters():
        assert (p.grad is not None) == (name in clf.trainable_parameters()), name

    every = LlamaClassifier(Llama(cfg), train_last=None, lora=LoRASettings(2, targets="q,v"))
    names = set(every.trainable_parameters())
    assert every.lora_blocks == [0, 1, 2, 3] and "backbone.embed_tokens.weight" not in names
    assert len(names) == 2 + 4 * 2 * 2  # head, final norm; per block q and v, A and B each
    with pytest.raises(ValueError, match="placed when the classifier was built"):
        every.set_trainable(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapters_share_the_wrapped_layers_device_and_dtype(dtype):
    model = Llama(tiny_cfg(dtype=dtype))
    add_lora(model, rank=4)
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert len(layers) == 2 * 7
    for layer in layers:
        for p in (layer.lora_a, layer.lora_b):
            assert p.dtype == dtype and p.device == layer.weight.device
    assert model(torch.randint(0, 512, (1, 5))).dtype == dtype
    with torch.device("meta"):  # built for planning: the adapters take no memory either
        planned = LlamaClassifier(Llama(tiny_cfg(dtype=dtype)), lora=LoRASettings(4))
    assert all(p.is_meta for p in planned.trainable_parameters().values())


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="among q,k,v,o,gate,up,down; got q,x"):
        LoRASettings(4, targets="q,x")
    with pytest.raises(ValueError, match="at least 1"):
        LoRASettings(0)
    assert LoRASettings(8).alpha == 16.0 and LoRASettings(8, targets="v, q").targets == ("q", "v")


# --- the same scores as a reference ------------------------------------------------------------------------------


def test_logits_equal_peft_on_transformers():
    import peft  # the reference LoRA implementation (test-only dependency)

    cfg, pad = tiny_cfg(n_layers=3), 0
    hf_cfg = transformers.LlamaConfig(**cfg.to_hf_dict(), num_labels=3, pad_token_id=pad)
    torch.manual_seed(1)
    hf = transformers.LlamaForSequenceClassification(hf_cfg).float().eval()
    causal = transformers.LlamaForCausalLM(hf_cfg).float()
    causal.model.load_state_dict(hf.model.state_dict())
    settings = LoRASettings(rank=4, alpha=12.0, targets=tuple(TARGETS))
    clf = LlamaClassifier(ours_from_hf(cfg, causal), num_classes=3, train_last=2, lora=settings).eval()
    with torch.no_grad():
        clf.head.weight.copy_(hf.score.weight)
    config = peft.LoraConfig(
        r=4, lora_alpha=12, lora_dropout=0.0, target_modules=list(PROJECTIONS.values()), layers_to_transform=[1, 2]
    )
    theirs = peft.get_peft_model(hf, config).eval()
    hf_layers = theirs.base_model.model.model.layers
    with torch.no_grad():
        for i in clf.lora_blocks:
            for target, path in TARGETS.items():
                ours = clf.backbone.blocks[i].get_submodule(path)
                ours.lora_b.normal_(std=0.05)  # B = 0 would hide a wrong B, a wrong scale or a swapped A and B
                parent = "self_attn" if path.startswith("attention") else "mlp"
                reference = hf_layers[i].get_submodule(f"{parent}.{PROJECTIONS[target]}")
                reference.lora_A["default"].weight.copy_(ours.lora_a)
                reference.lora_B["default"].weight.copy_(ours.lora_b)
    rows = [torch.randint(1, cfg.vocab_size, (n,)).tolist() for n in (17, 5, 30, 1)]
    ids, mask = padded_batch(rows, "right")
    with torch.no_grad():
        got = clf(ids, mask)
        want = theirs(input_ids=ids, attention_mask=mask, position_ids=real_positions(mask)).logits
    assert (got - want).abs().max().item() < 1e-4
    with theirs.disable_adapter(), torch.no_grad():
        plain = theirs(input_ids=ids, attention_mask=mask, position_ids=real_positions(mask)).logits
    assert (got - plain).abs().max().item() > 1e-3  # the adapters do change the scores


def test_planned_trainable_count_is_the_models():
    cfg = dataclasses.replace(LlamaConfig.from_name("tiny"), vocab_size=512)
    for train_last, settings in [(2, LoRASettings(8)), (None, LoRASettings(4, targets="q,v")), (1, None)]:
        clf = LlamaClassifier(Llama(cfg), num_classes=3, train_last=train_last, lora=settings)
        trainable = sum(p.numel() for p in clf.trainable_parameters().values())
        plan = plan_memory(PlanInputs(cfg, 2, 16, train_last, num_classes=3, device_type="cpu", lora=settings))
        assert plan.counts.trainable == trainable == count_parameters(cfg, train_last, 3, settings).trainable
        assert plan.counts.total == sum(p.numel() for p in clf.parameters())
        assert plan.gradients == 4 * trainable and plan.optimizer_state == 2 * 4 * trainable  # float32 AdamW


# --- the command: fine-tune, save, classify ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A small 'pretrained' checkpoint on disk (random weights, but not a preset: LoRA adapts it)."""
    cfg = LlamaConfig.from_name("tiny")
    out = tmp_path_factory.mktemp("base") / "tiny-base"
    torch.manual_seed(2)
    save_checkpoint(Llama(cfg), cfg, out)
    return out


def lora_args(data, out, base, *extra):
    return args_for(data, out, "--model", str(base), *extra)  # the last --model wins


@pytest.mark.slow
@pytest.mark.parametrize("lora", [["--lora", "4", "--lora-targets", "q,v,o,down"], []], ids=["lora", "whole-blocks"])
def test_saved_run_classifies_as_at_the_end_of_training(small_csv, base, tmp_path, lora):
    out = tmp_path / "run"
    assert finetune_classifier.main(lora_args(small_csv, out, base, "--batch-size", "8", *lora)) == 0
    meta, metrics = (json.loads((out / name).read_text()) for name in ("classifier.json", "metrics.json"))
    clf, tokenizer, _ = classify.load_classifier(out, device="cpu")
    saved = set(load_file(out / "classifier.safetensors"))
    assert saved == set(clf.trainable_parameters())
    if lora:
        assert meta["lora"] == {
            "rank": 4,
            "alpha": 8.0,
            "dropout": 0.0,
            "targets": ["q", "v", "o", "down"],
            "blocks": [2, 3],
        }
        assert len(saved) == 2 + 2 * 4 * 2 and "backbone.blocks.3.attention.q_proj.lora_a" in saved
        assert clf.backbone.blocks[3].attention.q_proj.lora_b.abs().sum() > 0  # B moved from zero: it trained
    else:
        assert meta["lora"] is None
    # The test split, read whole as the run evaluates it; its loss, recomputed from classify's probabilities, is the
    # run's: a head or an adapter left at its initialisation (or a base weight not loaded) would change it far beyond
    # 1e-5.
    test = split_dataset(load_dataset(str(small_csv)), "full", seed=123)["test"]
    probs = classify.predict_proba(clf, tokenizer, test.texts)
    loss = -probs[torch.arange(len(test)), torch.tensor(test.labels)].log().mean().item()
    assert loss == pytest.approx(metrics["test_loss"], abs=1e-5)
    confusion = [[0, 0], [0, 0]]
    for truth, predicted in zip(test.labels, probs.argmax(-1).tolist(), strict=True):
        confusion[truth][predicted] += 1
    assert confusion == metrics["test_confusion"]


@pytest.mark.slow
def test_ddp_two_processes_equal_one_process_with_lora(small_csv, base, tmp_path):
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    lora = ["--lora", "4", "--lora-alpha", "16"]
    one = run_module(*lora_args(small_csv, single, base, "--batch-size", "8", *lora))
    assert one.returncode == 0, one.stderr
    two = run_module(*lora_args(small_csv, ddp, base, "--batch-size", "4", *lora), torchrun=2)
    assert two.returncode == 0, two.stderr
    a, b = (load_file(d / "classifier.safetensors") for d in (single, ddp))
    assert a.keys() == b.keys() and any(k.endswith("lora_b") for k in a)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (single, ddp))
    assert mb["world_size"] == 2 and ma["steps"] == mb["steps"] and ma["test_confusion"] == mb["test_confusion"]
    assert abs(ma["test_loss"] - mb["test_loss"]) < 1e-5


@pytest.mark.slow
def test_resume_refuses_another_lora_rank_by_name(small_csv, base, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    interrupt_first_validation(monkeypatch)
    assert finetune_classifier.main(lora_args(small_csv, out, base, "--lora", "4")) == 130
    assert (out / "resume.safetensors").exists()
    assert finetune_classifier.main([*lora_args(small_csv, out, base, "--lora", "8"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--lora was 4, now 8" in err and "leave them out to continue with the run's own" in err, err
    # --lora left out: the run's own rank (run_flags.json), not "no LoRA"
    assert finetune_classifier.main([*lora_args(small_csv, out, base), "--resume"]) == 0
    assert json.loads((out / "classifier.json").read_text())["lora"]["rank"] == 4


def test_lora_flags_are_checked_by_name(small_csv, base, tmp_path, capsys):
    cases = [
        (["--model", "tiny", "--lora", "4"], "--lora adapts pretrained weights"),
        (["--lora-alpha", "4"], "--lora-alpha needs --lora RANK"),
        (["--lora", "4", "--lora-targets", "q,qq"], "LoRA targets are among"),
    ]
    for extra, message in cases:
        assert finetune_classifier.main([*lora_args(small_csv, tmp_path / "o", base), *extra]) == 2
        assert message in capsys.readouterr().err

"""export_hf against transformers: an export loads with AutoModelForSequenceClassification and AutoTokenizer and
gives our classifier's logits, for a from-scratch run, a LoRA run (adapters merged) and a SmolLM2 run; the weights
are streamed one tensor at a time; the output directory is refused unless it is new, empty or our own export."""

import csv
import json
import shutil
import weakref

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from llama_scratch import Llama, LlamaConfig, classify, export_hf, finetune_classifier
from llama_scratch.checkpoints import export_weights
from llama_scratch.checkpoints.hf_layout import find_checkpoint_files, ours_to_hf
from llama_scratch.checkpoints.weights import save_checkpoint
from llama_scratch.data.batching import collate
from llama_scratch.model.lora import TARGETS, merged_weight
from tests.commands.test_finetune import args_for

pytest_plugins = ["tests.smollm2"]

TEXTS = [
    "WINNER!! You have been selected to receive a £900 prize reward! Call 09061701461 now",
    "see you at lunch",
    "ok",
    "Hey, are we still on for tonight? Let me know   when you're free.\n\nThanks",
    "Special-token spellings stay text: <|im_end|> <|eot_id|> <|finetune_right_pad_id|> <|endoftext|>",
    "naïve café — 東京 😀 1234567",
]


def export_ok(run, out, *extra) -> None:
    assert export_hf.main(["--checkpoint", str(run), "--output", str(out), "--dtype", "float32", *extra]) == 0


def export_fails(capsys, run, out, *extra) -> str:
    """Run export_hf, expect one `error:` line and exit status 2, return that line."""
    capsys.readouterr()
    assert export_hf.main(["--checkpoint", str(run), "--output", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def hf_load(out) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """The export through transformers alone, every tensor accounted for."""
    model, info = transformers.AutoModelForSequenceClassification.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
    assert model.dtype == torch.float32
    return model.eval(), transformers.AutoTokenizer.from_pretrained(out)


@torch.no_grad()
def logit_gap(clf, model, ids: list[list[int]], pad_id: int, side: str) -> float:
    """The largest difference between transformers' logits for a batch padded on `side` and ours, padded right."""
    ours = collate([(x, 0) for x in ids], pad_id)
    theirs = collate([(x, 0) for x in ids], pad_id, padding_side=side)
    expected = clf(ours["input_ids"], ours["attention_mask"])
    got = model(input_ids=theirs["input_ids"], attention_mask=theirs["attention_mask"]).logits
    return (got - expected).abs().max().item()


def assert_same_classifier(run, out) -> tuple:
    """transformers' logits equal ours to 1e-4 with right and left padding, and from its own tokenizer's batch."""
    clf, tokenizer, meta = classify.load_classifier(run, device="cpu", dtype="float32")
    model, hf_tokenizer = hf_load(out)
    ids = [tokenizer.encode(t, bos=True) for t in TEXTS]
    assert hf_tokenizer(TEXTS)["input_ids"] == ids  # special-token spellings included: they stay text
    assert model.config.pad_token_id == hf_tokenizer.pad_token_id == tokenizer.pad_id
    assert hf_tokenizer.padding_side == "right"
    assert logit_gap(clf, model, ids, tokenizer.pad_id, "right") < 1e-4
    # transformers pools the last token that is not the pad token: with left padding that is the last position,
    # and its positions (counted from the first pad) differ from ours only by a shift, which rotary ignores.
    assert logit_gap(clf, model, ids, tokenizer.pad_id, "left") < 1e-4
    batch = hf_tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        got = model(**batch).logits
    assert (got.softmax(-1) - classify.predict_proba(clf, tokenizer, TEXTS)).abs().max() < 1e-4
    names = meta["label_names"]
    assert model.config.id2label == dict(enumerate(names))
    assert model.config.label2id == {name: i for i, name in enumerate(names)}
    return clf, tokenizer, model


# --- a from-scratch run ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(small_csv, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "tiny-run"
    assert finetune_classifier.main(args_for(small_csv, out, "--max-steps", "1")) == 0
    return out


@pytest.mark.slow
def test_a_from_scratch_run_exports_with_its_llama3_tokenizer(tiny_run, tmp_path):
    out = tmp_path / "export"
    export_ok(tiny_run, out)
    clf, tokenizer, _ = assert_same_classifier(tiny_run, out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["num_labels"] == 2
    names = set(load_file(out / "model.safetensors"))
    assert "score.weight" in names and "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    card = (out / "README.md").read_text()
    metrics = json.loads((tiny_run / "metrics.json").read_text())
    assert f"| test | {metrics['test_accuracy']:.2%} |" in card and "| 1 | spam |" in card
    assert f"export_hf --checkpoint {tiny_run} --output {out}" in card
    pipeline = transformers.pipeline("text-classification", model=str(out))
    ours = [["ham", "spam"][k] for k, _ in classify.predict(clf, tokenizer, TEXTS)]
    assert [r["label"] for r in pipeline(TEXTS)] == ours


@pytest.mark.slow
def test_a_bfloat16_export_holds_our_weights_rounded_to_bfloat16(tiny_run, tmp_path):
    out = tmp_path / "export"
    assert export_hf.main(["--checkpoint", str(tiny_run), "--output", str(out), "--dtype", "bfloat16"]) == 0
    clf, _, _ = classify.load_classifier(tiny_run, device="cpu", dtype="float32")
    saved = load_file(out / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert torch.equal(saved["score.weight"], clf.head.weight.bfloat16())
    down = clf.backbone.blocks[3].ffn.down_proj.weight
    assert torch.equal(saved["model.layers.3.mlp.down_proj.weight"], down.bfloat16())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.slow
def test_the_output_must_be_new_empty_or_our_export(tiny_run, tmp_path, capsys):
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("keep me")
    assert "did not write (mine.txt)" in export_fails(capsys, tiny_run, foreign)
    assert [p.name for p in foreign.iterdir()] == ["mine.txt"]

    out = tmp_path / "export"
    export_ok(tiny_run, out)
    assert "pass --overwrite" in export_fails(capsys, tiny_run, out)
    before = (out / "model.safetensors").stat().st_mtime_ns
    export_ok(tiny_run, out, "--overwrite")
    assert (out / "model.safetensors").stat().st_mtime_ns != before
    (out / "notes.md").write_text("a file the user added to the export")
    assert "notes.md" in export_fails(capsys, tiny_run, out, "--overwrite")  # never deleted, even when asked
    assert (out / "notes.md").is_file()
    assert "is a file" in export_fails(capsys, tiny_run, out / "notes.md")


# --- a LoRA run ----------------------------------------------------------------------------------------------------

RANK, ALPHA = 4, 8.0
ADAPTED = [(block, path) for block in (2, 3) for path in ("attention.q_proj", "attention.v_proj", "ffn.down_proj")]


@pytest.fixture(scope="module")
def pretrained_base(tmp_path_factory):
    """A tiny 'pretrained' checkpoint in two shards (random weights, but not a preset: LoRA may adapt it)."""
    base = tmp_path_factory.mktemp("lora") / "base"
    cfg = LlamaConfig.from_name("tiny")
    save_checkpoint(Llama(cfg), cfg, base, max_shard_bytes=20_000_000)
    return base


def finetune(base, data, run, *flags) -> None:
    """finetune_classifier as a user types it over `base`, kept short: two steps, short texts."""
    argv = ["--model", str(base), "--data", str(data), "--output", str(run), "--max-steps", "2", *flags]
    assert finetune_classifier.main(argv + ["--batch-size", "8", "--max-length", "32"]) == 0


@pytest.fixture(scope="module")
def pretrained_run(pretrained_base, small_csv):
    """A run of the last block over the two-shard base (the LoRA tests below add adapters to a copy)."""
    run = pretrained_base.parent / "run"
    finetune(pretrained_base, small_csv, run, "--train-last", "1")
    return run


def add_adapters(run, out) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A copy of `run` saved as a LoRA run: adapters with a nonzero lora_b on blocks 2 (frozen, from the base) and
    3 (trained), in the format a LoRA run writes; returns them by module."""
    shutil.copytree(run, out)
    with safe_open(out / "classifier.safetensors", framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(out / "classifier.safetensors")
    cfg = LlamaConfig.from_hf_dict(json.loads((out / "classifier.json").read_text())["config"])
    shapes = {
        "q_proj": (cfg.n_heads * cfg.head_dim, cfg.dim),
        "v_proj": (cfg.n_kv_heads * cfg.head_dim, cfg.dim),
        "down_proj": (cfg.dim, cfg.ffn_dim),
    }
    adapters = {}
    for block, path in ADAPTED:
        rows, cols = shapes[path.split(".")[-1]]
        a, b = torch.randn(RANK, cols) * 0.1, torch.randn(rows, RANK) * 0.1
        tensors[f"backbone.blocks.{block}.{path}.lora_a"] = a
        tensors[f"backbone.blocks.{block}.{path}.lora_b"] = b
        adapters[f"blocks.{block}.{path}"] = (a, b)
    save_file(tensors, out / "classifier.safetensors", metadata=metadata)
    meta = json.loads((out / "classifier.json").read_text())
    meta["lora"] = {"rank": RANK, "alpha": ALPHA, "dropout": 0.05, "targets": ["q", "v", "down"], "blocks": [2, 3]}
    (out / "classifier.json").write_text(json.dumps(meta))
    return adapters


def test_merge_lora_is_w_plus_alpha_over_rank_b_a():
    w, a, b = torch.randn(6, 5, dtype=torch.float64), torch.randn(2, 5), torch.randn(6, 2)
    merged = merged_weight(w.to(torch.bfloat16), a.to(torch.bfloat16), b.to(torch.bfloat16), 16.0 / 2)
    assert merged.dtype == torch.float32
    expected = w.to(torch.bfloat16).double() + 8.0 * (b.to(torch.bfloat16).double() @ a.to(torch.bfloat16).double())
    assert torch.allclose(merged.double(), expected, atol=1e-5)


@pytest.mark.slow
def test_a_lora_run_exports_with_its_adapters_merged(pretrained_run, tmp_path):
    lora_run, out = tmp_path / "lora-run", tmp_path / "export"
    adapters = add_adapters(pretrained_run, lora_run)
    export_ok(lora_run, out)
    clf, tokenizer, _ = classify.load_classifier(pretrained_run, device="cpu", dtype="float32")
    model, _ = hf_load(out)
    ids = [tokenizer.encode(t, bos=True) for t in TEXTS]
    assert logit_gap(clf, model, ids, tokenizer.pad_id, "right") > 1e-3  # the adapters change the answer ...
    for name, (a, b) in adapters.items():  # ... by what the unmerged adapters add, run beside each projection
        module = clf.get_submodule(f"backbone.{name}")
        module.register_forward_hook(lambda m, args, y, a=a, b=b: y + ALPHA / RANK * (args[0] @ a.T @ b.T))
    assert logit_gap(clf, model, ids, tokenizer.pad_id, "right") < 1e-4
    assert logit_gap(clf, model, ids, tokenizer.pad_id, "left") < 1e-4
    assert "LoRA: rank 4, alpha 8.0, targets q, v, down, blocks 2, 3" in (out / "README.md").read_text()


def test_adapters_without_lora_settings_are_refused(pretrained_run, tmp_path, capsys):
    lora_run = tmp_path / "lora-run"
    add_adapters(pretrained_run, lora_run)
    meta = json.loads((lora_run / "classifier.json").read_text())
    meta["lora"]["rank"] = 8
    (lora_run / "classifier.json").write_text(json.dumps(meta))
    assert "lora_a [4, 64] and lora_b [64, 4], expected [8, 64]" in export_fails(capsys, lora_run, tmp_path / "o")
    meta["lora"].update(rank=RANK, targets=["q_proj", "v"])  # module names, not the short names a run records
    (lora_run / "classifier.json").write_text(json.dumps(meta))
    assert "LoRA targets are among q,k,v,o,gate,up,down; got q_proj,v" in export_fails(capsys, lora_run, tmp_path / "o")
    meta["lora"]["targets"] = ["q", "v"]  # down_proj's adapters in the file, not in the settings
    (lora_run / "classifier.json").write_text(json.dumps(meta))
    err = export_fails(capsys, lora_run, tmp_path / "o")
    assert (
        "blocks.2.ffn.down_proj has an adapter that classifier.json's lora settings (blocks [2, 3], targets q,v)" in err
    )
    meta["lora"]["targets"] = ["q", "k", "v", "down"]  # k_proj in the settings, no adapter in the file
    (lora_run / "classifier.json").write_text(json.dumps(meta))
    assert "describe an adapter on blocks.2.attention.k_proj, but" in export_fails(capsys, lora_run, tmp_path / "o")
    meta["lora"] = None
    (lora_run / "classifier.json").write_text(json.dumps(meta))
    assert "has no 'lora' settings" in export_fails(capsys, lora_run, tmp_path / "o")
    older = {k: v for k, v in meta.items() if k not in ("version", "lora")}  # a record from before LoRA
    (lora_run / "classifier.json").write_text(json.dumps(older))
    assert "has no 'lora' settings" in export_fails(capsys, lora_run, tmp_path / "o")
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "blocks", "targets"),
    [
        (["--lora", "8"], [2, 3], list(TARGETS)),
        (["--lora", "8", "--train-last", "4"], [0, 1, 2, 3], list(TARGETS)),
        (["--lora", "8", "--lora-targets", "q,v"], [2, 3], ["q", "v"]),
    ],
    ids=["last-2-blocks", "train-last-4", "targets-q-v"],
)
def test_a_lora_run_from_the_command_exports_as_classify_predicts(
    pretrained_base, small_csv, tmp_path, flags, blocks, targets
):
    """finetune_classifier --lora, then export_hf, as a user types them: transformers answers as classify does."""
    run, out, scored = tmp_path / "run", tmp_path / "export", tmp_path / "scored.csv"
    finetune(pretrained_base, small_csv, run, *flags)
    meta = json.loads((run / "classifier.json").read_text())
    assert meta["lora"]["blocks"] == blocks and meta["lora"]["targets"] == targets
    assert export_hf.main(["--checkpoint", str(run), "--output", str(out)]) == 0
    _, _, model = assert_same_classifier(run, out)  # logits to 1e-4 padded on either side, probabilities to 1e-4
    batch = transformers.AutoTokenizer.from_pretrained(out)(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        theirs = model(**batch).logits.softmax(-1)
    argv = ["--checkpoint", str(run), *TEXTS, "--output", str(scored), "--device", "cpu", "--dtype", "float32"]
    assert classify.main(argv) == 0
    with scored.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    ours = torch.tensor([[float(r[f"p_{name}"]) for name in meta["label_names"]] for r in rows])
    assert [r["text"] for r in rows] == TEXTS
    assert (theirs - ours).abs().max() < 2e-6  # classify's CSV keeps 6 decimals
    # The adapters trained and were merged in: each adapted projection moved off the base weight, and no other
    # tensor of the backbone did (the final norm trains; the head is new).
    base = {}
    for file in find_checkpoint_files(pretrained_base):
        base |= load_file(file)
    adapted = {ours_to_hf(f"blocks.{b}.{TARGETS[t]}.weight") for b in blocks for t in targets}
    for name, tensor in load_file(out / "model.safetensors").items():
        if name not in ("score.weight", "model.norm.weight"):
            assert torch.equal(tensor, base[name]) == (name not in adapted), name


@pytest.mark.slow
def test_the_export_streams_one_tensor_at_a_time(pretrained_run, tmp_path, monkeypatch):
    """Every tensor read is tracked while it is alive: never more than one weight and its two adapters at once,
    and no safetensors file is ever loaded whole."""
    lora_run, out = tmp_path / "lora-run", tmp_path / "export"
    add_adapters(pretrained_run, lora_run)
    alive: dict[int, int] = {}  # id of a tensor read -> its bytes, while it lives
    peak_count, peak_bytes, read = [0], [0], [0]

    def tracked(info):
        t = real_read(info)
        alive[id(t)] = info.nbytes
        weakref.finalize(t, alive.pop, id(t))
        read[0] += info.nbytes
        peak_count[0], peak_bytes[0] = max(peak_count[0], len(alive)), max(peak_bytes[0], sum(alive.values()))
        return t

    def whole_file(*args, **kwargs):
        raise AssertionError("the export loaded a whole safetensors file")

    real_read = export_weights.read_tensor
    monkeypatch.setattr(export_weights, "read_tensor", tracked)
    monkeypatch.setattr("safetensors.torch.load_file", whole_file)
    export_hf.export(lora_run, out, "float32", max_shard_bytes=200_000, log=lambda *a: None)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and all((out / s).is_file() for s in shards)
    largest, adapters = 128_256 * 64 * 4, 2 * RANK * 192 * 4  # the embedding; down_proj's lora_a and lora_b
    assert read[0] >= index["metadata"]["total_size"] and not alive
    assert peak_count[0] == 3 and peak_bytes[0] <= largest + adapters


# --- SmolLM2 -------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_smollm2_run_exports_with_its_own_tokenizer(smollm2_dir, small_csv, tmp_path):
    run, out = tmp_path / "run", tmp_path / "export"
    argv = ["--model", str(smollm2_dir), "--data", str(small_csv), "--output", str(run), "--max-steps", "2"]
    assert finetune_classifier.main(argv + ["--batch-size", "8", "--max-length", "32", "--dtype", "float32"]) == 0
    export_ok(run, out)
    clf, tokenizer, model = assert_same_classifier(run, out)
    assert tokenizer.bos_id is None and model.config.pad_token_id == 2  # <|im_end|>, SmolLM2's own padding token
    copied, base = (json.loads((d / "tokenizer.json").read_text()) for d in (out, smollm2_dir))
    assert copied["model"] == base["model"]  # the base checkpoint's vocabulary and merges, copied


@pytest.mark.slow
def test_a_mean_pooling_run_classifies_by_its_mean_and_is_not_exported(pretrained_base, small_csv, tmp_path, capsys):
    """finetune_classifier --pooling mean, then classify and export_hf, as a user types them: classify reads the mean
    of each text's normed vectors (the record says so), and export refuses in one line, since transformers'
    classifier reads the last token only and would answer otherwise."""
    run, scored = tmp_path / "run", tmp_path / "scored.csv"
    finetune(pretrained_base, small_csv, run, "--pooling", "mean")
    meta = json.loads((run / "classifier.json").read_text())
    assert meta["pooling"] == "mean"
    argv = ["--checkpoint", str(run), *TEXTS, "--output", str(scored), "--device", "cpu", "--dtype", "float32"]
    assert classify.main(argv) == 0
    with scored.open(newline="", encoding="utf-8") as f:
        ours = torch.tensor([[float(r[f"p_{n}"]) for n in meta["label_names"]] for r in csv.DictReader(f)])
    clf, tokenizer, _ = classify.load_classifier(run, device="cpu", dtype="float32")
    assert clf.pooling == "mean"
    with torch.no_grad():  # each text alone: every position's vector after the final norm
        backbone = clf.backbone
        normed = [
            backbone.final_norm(
                backbone.run_blocks(backbone.embed_tokens(torch.tensor([tokenizer.encode(t, bos=True)])))
            )[0]
            for t in TEXTS
        ]
        expected = clf.head(torch.stack([h.mean(0) for h in normed])).softmax(-1)
        last = clf.head(torch.stack([h[-1] for h in normed])).softmax(-1)
    assert (ours - expected).abs().max() < 2e-6  # classify's CSV keeps 6 decimals
    assert (ours - last).abs().max() > 1e-3  # and it is not what the last token would say
    err = export_fails(capsys, run, tmp_path / "export")
    assert "--pooling mean" in err and "LlamaForSequenceClassification" in err
    assert not (tmp_path / "export").exists()

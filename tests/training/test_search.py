"""--search: the candidates, the shared frozen-prefix states, the weights put back, and the command end to end as a
user types it (then classify reads the run)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from llama_scratch import classify, finetune_classifier
from llama_scratch.checkpoints.weights import save_checkpoint
from llama_scratch.data.batching import TokenizedSplit
from llama_scratch.model.classifier import LlamaClassifier
from llama_scratch.model.config import LlamaConfig
from llama_scratch.model.llama import Llama
from llama_scratch.parallel.strategy import Replicated
from llama_scratch.training import search as search_module
from llama_scratch.training.loop import TrainSettings
from llama_scratch.training.prefix_cache import compute_frozen_states
from llama_scratch.training.search import Candidate, candidates_for, carry_up, search, search_epochs


def test_candidates_keep_what_was_typed_and_fit_the_model():
    assert candidates_for(30)[0] == Candidate(2, 1e-3), "the default recipe is tried first"
    assert {c.train_last for c in candidates_for(30, train_last=3)} == {3}
    assert {c.lr for c in candidates_for(30, lr=5e-4)} == {5e-4}
    assert len(candidates_for(30, train_last=3, lr=5e-4)) == 1  # nothing left to vary: one candidate
    assert max(c.train_last for c in candidates_for(4)) == 4
    assert [search_epochs(e) for e in (1, 2, 5, 6)] == [1, 1, 3, 3]


def test_carried_up_states_equal_a_deeper_frozen_pass():
    """States after 1 block carried through block 1 are the states after 2 blocks, computed from the tokens."""
    torch.manual_seed(0)
    backbone = Llama(LlamaConfig.from_name("tiny")).eval()
    texts = [[int(t) for t in torch.randint(1, 200, (n,))] for n in (5, 9, 3, 12, 7)]
    low = compute_frozen_states(LlamaClassifier(backbone, 2, train_last=3), texts, 0, 2, show=False, packed=True)
    high = compute_frozen_states(LlamaClassifier(backbone, 2, train_last=2), texts, 0, 2, show=False, packed=True)
    carried = carry_up(backbone, low, 1, 2, rows=2)
    for a, b in zip(carried, high, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def splits_of(n: int, seed: int) -> dict[str, TokenizedSplit]:
    """Token texts whose class is told by their first token, in three splits."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        label = i % 2
        rows.append(
            (
                [10 + label]
                + torch.randint(20, 200, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist(),
                label,
            )
        )
    cut = {"train": rows[: n // 2], "val": rows[n // 2 : 3 * n // 4], "test": rows[3 * n // 4 :]}
    return {k: TokenizedSplit([r[0] for r in v], [r[1] for r in v]) for k, v in cut.items()}


@pytest.mark.parametrize("cache", [True, False])
def test_search_scores_each_candidate_and_puts_the_weights_back(tmp_path, cache):
    torch.manual_seed(0)
    clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), 2, train_last=2)
    before = {k: v.clone() for k, v in clf.backbone.state_dict().items()}
    settings = TrainSettings(epochs=2, batch_size=8, lr=1e-3, seed=5)
    candidates = [Candidate(2, 1e-3), Candidate(3, 1e-4)]
    found = search(clf, splits_of(64, 1), settings, candidates, Replicated(), tmp_path, 10, cache, log=lambda _: None)
    assert [r["name"] for r in found.rows] == [c.name for c in candidates]
    assert all(0 <= r["val_accuracy"] <= 1 and r["epochs"] == 1 for r in found.rows)
    assert found.chosen in candidates
    after = clf.backbone.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "the backbone is as loaded for the final run"
    assert (found.splits is not None) == cache
    if cache:  # the chosen candidate's states: after the blocks it freezes
        frozen = 4 - found.chosen.train_last
        assert found.splits["train"].states[0].shape[-1] == clf.backbone.cfg.dim
        ref = compute_frozen_states(
            LlamaClassifier(clf.backbone, 2, found.chosen.train_last),
            [found.splits["train"].ids[0]],
            0,
            show=False,
            packed=True,
        )
        torch.testing.assert_close(found.splits["train"].states[0], ref[0], rtol=1e-5, atol=1e-5)
        assert frozen >= 0
    record = json.loads((tmp_path / "search.json").read_text())
    assert record["chosen"] == found.chosen.name and len(record["candidates"]) == 2
    assert not list(tmp_path.glob("search-*")), "the candidates' scratch folders are gone"

    # Resumed: the scored candidates are read back, not trained again; the same choice.
    monkey = pytest.MonkeyPatch()
    monkey.setattr(search_module, "train", lambda *a, **k: pytest.fail("a scored candidate was trained again"))
    again = search(clf, splits_of(64, 1), settings, candidates, Replicated(), tmp_path, 10, cache, log=lambda _: None)
    monkey.undo()
    assert again.chosen == found.chosen and again.rows == found.rows


def test_the_same_seed_chooses_alike(tmp_path):
    rows = []
    for k in range(2):
        torch.manual_seed(0)
        clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), 2, train_last=2)
        settings = TrainSettings(epochs=2, batch_size=8, seed=7)
        (tmp_path / str(k)).mkdir()
        found = search(
            clf,
            splits_of(48, 2),
            settings,
            candidates_for(4),
            Replicated(),
            tmp_path / str(k),
            10,
            True,
            log=lambda _: None,
        )
        rows.append([(r["name"], r["val_accuracy"], r["val_loss"]) for r in found.rows])
    assert rows[0] == rows[1]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny 'pretrained' checkpoint (random weights, but not a preset: the search may choose its blocks)."""
    base = tmp_path_factory.mktemp("search") / "base"
    cfg = LlamaConfig.from_name("tiny")
    save_checkpoint(Llama(cfg), cfg, base)
    return base


@pytest.mark.slow
def test_search_through_the_command_as_a_user_types_it(pretrained, small_csv, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--model", str(pretrained), "--data", str(small_csv), "--output", str(out), "--search"]
    assert finetune_classifier.main([*argv, "--epochs", "2", "--max-length", "32", "--search-minutes", "5"]) == 0
    log = capsys.readouterr()
    text = log.out + log.err
    assert "search (by validation accuracy)" in text and "<- chosen" in text and "chosen by --search" in text
    record = json.loads((out / "search.json").read_text())
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["search"]["chosen"] == record["chosen"]
    assert [r["name"] for r in metrics["search"]["candidates"]] == [c.name for c in candidates_for(4)]
    chosen = next(r for r in record["candidates"] if r["name"] == record["chosen"])
    meta = json.loads((out / "classifier.json").read_text())
    assert meta["train_last"] == chosen["train_last"], "the run trained the chosen recipe's blocks"
    assert "baseline" in metrics and "test_accuracy" in metrics
    assert classify.main(["--checkpoint", str(out), "WINNER! Claim your free prize now"]) == 0

    # --train-last typed: only the learning rate is searched.
    out2 = tmp_path / "run2"
    argv2 = ["--model", str(pretrained), "--data", str(small_csv), "--output", str(out2), "--search"]
    assert finetune_classifier.main([*argv2, "--epochs", "2", "--max-length", "32", "--train-last", "1"]) == 0
    record = json.loads((out2 / "search.json").read_text())
    assert {r["train_last"] for r in record["candidates"]} == {1} and len(record["candidates"]) >= 2


def test_more_blocks_whole_train_at_the_smaller_default_rate_through_the_command(pretrained, small_csv, tmp_path):
    """The rate a run used is the one classifier.json records: 1e-3 for the default 2 blocks, 2e-4 for 3 of them
    (training.loop.default_lr), as a user types the flags."""
    for flags, lr in (([], 1e-3), (["--train-last", "3"], 2e-4)):
        out = tmp_path / f"run{len(flags)}"
        argv = ["--model", str(pretrained), "--data", str(small_csv), "--output", str(out), "--max-steps", "1"]
        assert finetune_classifier.main([*argv, "--max-length", "32", *flags]) == 0
        assert json.loads((out / "classifier.json").read_text())["settings"]["lr"] == lr


@pytest.mark.parametrize(
    "flags, why",
    [
        (["--model", "tiny"], "from scratch"),
        (["--lora", "4"], "--lora or --quantize"),
        (["--train-last", "all"], "--train-last all"),
    ],
)
def test_search_refuses_what_it_cannot_vary_in_one_line(pretrained, small_csv, tmp_path, capsys, flags, why):
    argv = ["--model", str(pretrained), "--data", str(small_csv), "--output", str(tmp_path / "r"), "--search"]
    assert finetune_classifier.main([*argv, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --search:") and why in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists(), "refused before anything was written"


@pytest.mark.slow
def test_a_search_run_interrupted_in_its_final_training_resumes(pretrained, small_csv, tmp_path, monkeypatch, capsys):
    """The chosen recipe (other blocks, another rate than a plain run's) is the run's own once chosen: `--resume`
    after Ctrl-C in the final training continues it, and ends with the weights of a run never interrupted."""
    monkeypatch.setattr(search_module, "CANDIDATES", (Candidate(3, 1e-3),))
    argv = ["--model", str(pretrained), "--data", str(small_csv), "--search", "--epochs", "2", "--max-length", "32"]
    assert finetune_classifier.main([*argv, "--output", str(tmp_path / "whole")]) == 0
    out = tmp_path / "run"
    real = finetune_classifier.train

    def stopped_after_an_epoch(*args, **kwargs):
        kwargs["on_row"] = lambda row: (_ for _ in ()).throw(KeyboardInterrupt)
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(finetune_classifier, "train", stopped_after_an_epoch)
        assert finetune_classifier.main([*argv, "--output", str(out)]) == 130
    assert (out / "resume.safetensors").exists() and json.loads((out / "search.json").read_text())["chosen"]
    capsys.readouterr()
    assert finetune_classifier.main(["--resume", "--output", str(out)]) == 0, capsys.readouterr().err
    assert "was scored before this resume" in capsys.readouterr().out
    assert json.loads((out / "classifier.json").read_text())["train_last"] == 3
    a, b = load_file(tmp_path / "whole" / "classifier.safetensors"), load_file(out / "classifier.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

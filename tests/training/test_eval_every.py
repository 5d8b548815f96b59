"""Metrics during training (issue 30): `--eval-every` rows inside epochs, `--select-by` the measure the kept weights
are best at, `--patience` counted in evaluations, macro-F1 and ROC AUC, `--tensorboard`; resumed exactly."""

import csv
import itertools
import json
import random
import sys
import types

import pytest
import torch

from llama_scratch import Llama, LlamaClassifier, LlamaConfig, classify, finetune_classifier
from llama_scratch.data.batching import TokenizedSplit
from llama_scratch.data.labelled import load_dataset
from llama_scratch.data.splitting import split_dataset
from llama_scratch.parallel.strategy import Replicated
from llama_scratch.training import loop as train
from llama_scratch.training.evaluation import kept_row, macro_f1, roc_auc
from tests.commands.test_finetune import args_for


def pair_count_auc(scores: list[float], positive: list[int]) -> float:
    """ROC AUC by its definition: over every (positive, negative) pair, 1 if the positive scores higher, 1/2 on a
    tie."""
    pos = [s for s, p in zip(scores, positive, strict=True) if p]
    neg = [s for s, p in zip(scores, positive, strict=True) if not p]
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def f1_by_hand(true: list[int], predicted: list[int]) -> float:
    """Macro-F1 from the label lists (over the classes either list holds), the textbook way."""
    f1s = []
    for c in sorted(set(true) | set(predicted)):
        tp = sum(t == c and p == c for t, p in zip(true, predicted, strict=True))
        fp = sum(t != c and p == c for t, p in zip(true, predicted, strict=True))
        fn = sum(t == c and p != c for t, p in zip(true, predicted, strict=True))
        f1s.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
    return sum(f1s) / len(f1s)


def confusion_of(true: list[int], predicted: list[int], k: int) -> list[list[int]]:
    matrix = [[0] * k for _ in range(k)]
    for t, p in zip(true, predicted, strict=True):
        matrix[t][p] += 1
    return matrix


def test_roc_auc_is_the_pair_count_with_ties_counted_half():
    rng = random.Random(0)
    for n in (2, 7, 40):
        positive = [1, 0] + [rng.randint(0, 1) for _ in range(n - 2)]
        scores = [round(rng.random(), 1) for _ in range(n)]  # one decimal: many ties
        assert roc_auc(scores, positive) == pytest.approx(pair_count_auc(scores, positive), abs=1e-12)
        try:
            from sklearn.metrics import roc_auc_score
        except ImportError:  # not a test dependency: the pair count above is the reference then
            continue
        assert roc_auc(scores, positive) == pytest.approx(roc_auc_score(positive, scores), abs=1e-12)
    assert roc_auc([0.2, 0.9], [0, 1]) == 1.0 and roc_auc([0.5, 0.5], [0, 1]) == 0.5
    assert roc_auc([0.1, 0.2], [1, 1]) is None  # one class only: undefined


def test_macro_f1_is_the_mean_of_the_classes_f1():
    rng = random.Random(1)
    for k in (2, 3, 5):
        true = [rng.randrange(k) for _ in range(50)]
        predicted = [t if rng.random() < 0.6 else rng.randrange(k) for t in true]
        expected = f1_by_hand(true, predicted)
        assert macro_f1(confusion_of(true, predicted, k)) == pytest.approx(expected, abs=1e-12)
        try:
            from sklearn.metrics import f1_score
        except ImportError:
            continue
        assert macro_f1(confusion_of(true, predicted, k)) == pytest.approx(f1_score(true, predicted, average="macro"))
    # Always answering the common class: 90% accuracy, and a macro-F1 that says the rare class was never found.
    assert macro_f1([[90, 0], [10, 0]]) == pytest.approx((2 * 90 / 190 + 0) / 2)


def tiny_splits(n: int = 24) -> dict[str, TokenizedSplit]:
    ids = [[1 + (i * 7 + j) % 100 for j in range(4 + i % 5)] for i in range(n)]
    return {"train": TokenizedSplit(ids, [i % 2 for i in range(n)]), "val": TokenizedSplit(ids[:8], [0, 1] * 4)}


def run_loop(out, settings, resume=False, rows=None):
    out.mkdir(exist_ok=True)
    torch.manual_seed(0)
    clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), num_classes=2, train_last=1)
    on_row = None if rows is None else rows.append
    state = train.train(clf, tiny_splits(), settings, Replicated(), out, resume, None, lambda *a: 0, on_row=on_row)
    return state, {k: v.clone() for k, v in train.trainable_state(clf).items()}


def test_rows_inside_epochs_report_the_training_since_the_row_before(tmp_path):
    """Evaluating every 2 steps changes nothing in training (the same weights as evaluating at epochs' ends only);
    each row's train loss is the mean since the row before, so the epoch's rows, weighted by their steps, give the
    epoch's own figure."""
    epochs = train.TrainSettings(epochs=2, batch_size=2, grad_accum=2, save_every=100, lr=1e-3)
    every = train.TrainSettings(**{**vars(epochs), "eval_every": 2})
    by_epoch, weights = run_loop(tmp_path / "epochs", epochs)
    rows: list[dict] = []
    by_step, weights_every = run_loop(tmp_path / "every", every, rows=rows)
    assert all(torch.equal(weights[k], weights_every[k]) for k in weights)
    assert [r["step"] for r in by_step.history] == [2, 4, 6, 8, 10, 12]  # 6 steps an epoch: 2, 4 and its end
    assert rows == by_step.history  # on_row saw each row once, as recorded
    for epoch_row in by_epoch.history:
        inside = [r for r in by_step.history if r["epoch"] == epoch_row["epoch"]]
        assert inside[-1]["step"] == epoch_row["step"]
        assert inside[-1]["val_loss"] == epoch_row["val_loss"]
        mean = sum(r["train_loss"] * 2 for r in inside) / (2 * len(inside))  # every stretch here is 2 steps
        assert mean == pytest.approx(epoch_row["train_loss"], rel=1e-9)


def scripted_evaluations(monkeypatch, figures: list[tuple[float, float, float]]) -> list[int]:
    """train.evaluate replaced by one that answers (accuracy, macro-F1, loss) in turn; returns the calls' count."""
    calls: list[int] = []

    def scripted(*args, **kwargs):
        accuracy, f1, loss = figures[len(calls)]
        calls.append(1)
        return {"loss": loss, "accuracy": accuracy, "macro_f1": f1, "confusion": [], "count": 8}

    monkeypatch.setattr(train, "evaluate", scripted)
    return calls


@pytest.mark.parametrize(
    ("select_by", "best_row"), [("accuracy", 1), ("macro_f1", 2), ("loss", 3)], ids=["accuracy", "macro_f1", "loss"]
)
def test_the_kept_evaluation_is_the_best_by_the_measure_and_patience_counts_evaluations(
    tmp_path, monkeypatch, select_by, best_row
):
    figures = [(0.5, 0.4, 0.9), (0.9, 0.5, 0.8), (0.8, 0.7, 0.7), (0.6, 0.6, 0.5)] + [(0.1, 0.1, 2.0)] * 4
    calls = scripted_evaluations(monkeypatch, figures)
    kept: list[int] = []
    s = train.TrainSettings(epochs=3, batch_size=2, save_every=100, lr=1e-3, eval_every=1, patience=2)
    s.select_by = select_by
    torch.manual_seed(0)
    clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), num_classes=2, train_last=1)
    state = train.train(clf, tiny_splits(), s, Replicated(), tmp_path, False, kept.append, lambda *a: 0)
    assert state.best_step == state.history[best_row]["step"] == best_row + 1
    # Stopped two evaluations after the best one, inside the first epoch (12 steps an epoch here).
    assert len(calls) == len(state.history) == best_row + 3 and state.step == len(calls) and state.epoch == 0
    assert len(kept) == best_row + 1  # here each evaluation up to the best one improved on the one before
    said = kept_row(state.history, state.best_step, select_by)
    assert said.startswith(f"keeping step {state.best_step}'s weights, not step {state.step}'s")


@pytest.mark.slow
def test_an_interrupt_during_an_evaluation_inside_an_epoch_then_resume_equals_one_run(tmp_path, monkeypatch):
    """Ctrl-C during an evaluation between two epochs' ends, and once more in the middle of a step: the resumed run
    evaluates again where it stopped, and its history, kept evaluation and weights are the uninterrupted run's."""
    s = train.TrainSettings(epochs=2, batch_size=2, grad_accum=2, save_every=100, lr=1e-3, eval_every=2)
    s.select_by, s.patience = "macro_f1", 5  # at most 5 evaluations after the best: never stops before the end
    whole, whole_weights = run_loop(tmp_path / "whole", s)
    real_evaluate, real_to_batch, calls = train.evaluate, train.to_batch, []

    def second_evaluation_stops(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # step 4's, inside the first epoch
            raise KeyboardInterrupt
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(train, "evaluate", second_evaluation_stops)
    with pytest.raises(KeyboardInterrupt):
        run_loop(tmp_path / "cut", s)
    monkeypatch.setattr(train, "evaluate", real_evaluate)
    batches: list[int] = []

    def stops_in_step_10(*args, **kwargs):
        batches.append(1)
        if len(batches) == 11:  # resumed at step 4: the first micro-batch of step 10
            raise KeyboardInterrupt
        return real_to_batch(*args, **kwargs)

    monkeypatch.setattr(train, "to_batch", stops_in_step_10)
    with pytest.raises(KeyboardInterrupt):
        run_loop(tmp_path / "cut", s, resume=True)
    monkeypatch.setattr(train, "to_batch", real_to_batch)
    resumed, resumed_weights = run_loop(tmp_path / "cut", s, resume=True)
    assert resumed.history == whole.history and len(whole.history) == 6
    assert (resumed.best_step, resumed.best_val_macro_f1) == (whole.best_step, whole.best_val_macro_f1)
    assert all(torch.equal(whole_weights[k], resumed_weights[k]) for k in whole_weights)


class FakeWriter:
    """torch.utils.tensorboard.SummaryWriter's calls, written down."""

    made: list["FakeWriter"] = []

    def __init__(self, log_dir: str) -> None:
        self.log_dir, self.scalars, self.flushes = log_dir, [], 0
        FakeWriter.made.append(self)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def flush(self) -> None:
        self.flushes += 1


@pytest.mark.slow
def test_eval_every_select_by_macro_f1_end_to_end(small_csv, tmp_path, monkeypatch, capsys):
    """As a user types it: rows every 2 steps in history.csv, the weights of the best macro-F1 row kept (checked by
    running classify's own loading and prediction on the validation texts), macro-F1 and ROC AUC in metrics.json,
    and each row written to TensorBoard (a fake writer: the package is optional)."""
    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    FakeWriter.made.clear()
    out, board = tmp_path / "run", tmp_path / "board"
    argv = args_for(small_csv, out, "--batch-size", "8", "--eval-every", "2", "--select-by", "macro_f1")
    assert finetune_classifier.main([*argv, "--tensorboard", str(board)]) == 0
    with (out / "history.csv").open() as f:
        rows = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]
    # 67 training rows, 8 a step: 8 steps an epoch, evaluated at steps 2, 4, 6 and the epoch's end.
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert [int(r["epoch"]) for r in rows] == [1] * 4 + [2] * 4
    best = max(rows, key=lambda r: (r["val_macro_f1"], -r["val_loss"]))
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["select_by"], metrics["best_step"]) == ("macro_f1", int(best["step"]))
    assert metrics["val_macro_f1"] == pytest.approx(best["val_macro_f1"], abs=1e-9)
    assert 0.0 <= metrics["test_roc_auc"] <= 1.0 and 0.0 <= metrics["test_macro_f1"] <= 1.0
    names = metrics["label_names"]
    per_class = metrics["test_per_class"]
    assert metrics["test_macro_f1"] == pytest.approx(sum(per_class[n]["f1"] for n in names) / 2)

    # classifier.safetensors, loaded and run the way classify does, gives that row's validation figures.
    val = split_dataset(load_dataset(str(small_csv)), protocol="full", seed=123)["val"]
    clf, tokenizer, _ = classify.load_classifier(out, device="cpu")
    probs = classify.predict_proba(clf, tokenizer, val.texts)  # whole texts, as the run evaluates them
    labels = torch.tensor(val.labels)
    loss = -probs[torch.arange(len(labels)), labels].log().mean().item()
    assert loss == pytest.approx(best["val_loss"], abs=1e-4)
    assert f1_by_hand(val.labels, probs.argmax(-1).tolist()) == pytest.approx(best["val_macro_f1"], abs=1e-9)

    (writer,) = FakeWriter.made
    assert writer.log_dir == str(board) and writer.flushes == len(rows)
    logged = {(tag, step): value for tag, value, step in writer.scalars}
    for r in rows:
        assert logged["loss/train", r["step"]] == pytest.approx(r["train_loss"], rel=1e-12)
        assert logged["macro_f1/val", r["step"]] == pytest.approx(r["val_macro_f1"], rel=1e-12)
    assert len(writer.scalars) == 5 * len(rows)


def test_tensorboard_missing_or_a_bad_eval_every_is_one_line(small_csv, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # what `import` meets without the package
    argv = args_for(small_csv, tmp_path / "run", "--max-steps", "1")
    assert finetune_classifier.main([*argv, "--tensorboard", str(tmp_path / "tb")]) == 2
    assert not (tmp_path / "run").exists()  # refused before the output directory is made
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --tensorboard needs the tensorboard package") and "\n" not in err
    assert "pip install 'llama-scratch[tensorboard]'" in err
    assert finetune_classifier.main([*args_for(small_csv, tmp_path / "other"), "--eval-every", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --eval-every must be") and "\n" not in err

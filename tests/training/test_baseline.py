"""The bag-of-words baseline every run reports beside its own figures: its TF-IDF features and its logistic
regression checked against scikit-learn's, and its figure in the run's summary line and metrics.json."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression

from llama_scratch import finetune_classifier
from llama_scratch.data.labelled import load_sms_spam
from llama_scratch.training import baseline


@pytest.fixture(scope="module")
def sms():
    data = load_sms_spam()
    return data.texts[:400], np.array(data.labels[:400])


def test_features_are_scikit_learn_s_tf_idf(sms):
    texts, _ = sms
    vocab = baseline.Vocabulary.fit(texts)
    ours = vocab.features(texts).to_dense().numpy()
    reference = TfidfVectorizer(analyzer=baseline.ngrams, min_df=2, sublinear_tf=True)
    theirs = reference.fit_transform(texts).toarray()
    columns = [reference.vocabulary_[g] for g in sorted(vocab.index, key=vocab.index.get)]
    assert theirs.shape == ours.shape
    np.testing.assert_allclose(ours, theirs[:, columns], atol=1e-6)  # float32 against float64


@pytest.mark.parametrize("classes", [2, 3])
def test_the_fit_is_scikit_learn_s_logistic_regression(sms, classes):
    """Softmax over the classes with every class's weights penalised, as scikit-learn's multinomial fit. With two
    classes scikit-learn fits one weight vector, the difference of ours, whose penalty is then half: its C is 2C."""
    texts, labels = sms
    y = labels if classes == 2 else np.array([len(t) % 3 for t in texts])
    x = baseline.Vocabulary.fit(texts).features(texts)
    w, b = baseline.fit_logistic(x, torch.tensor(y), 1.0, classes, multi_label=False)
    fitted = LogisticRegression(C=2.0 if classes == 2 else 1.0, max_iter=5000, tol=1e-10)
    fitted.fit(x.to_dense().numpy(), y)
    if classes == 2:
        w, b = (w[:, 1] - w[:, 0])[None, :], (b[1] - b[0])[None]
    else:
        w = w.T
    scale = np.abs(fitted.coef_).max()
    np.testing.assert_allclose(w.numpy(), fitted.coef_, atol=1e-3 * scale)  # L-BFGS stops within tolerance
    intercepts = fitted.intercept_ - (0 if classes == 2 else fitted.intercept_.mean())  # theirs sum to 0, ours too
    np.testing.assert_allclose(b.numpy(), intercepts, atol=1e-3 * scale)


def test_multi_label_is_one_regression_per_label(sms):
    texts, labels = sms
    y = np.stack([labels, np.array([len(t) > 60 for t in texts], dtype=np.int64)], axis=1)
    x = baseline.Vocabulary.fit(texts).features(texts)
    w, b = baseline.fit_logistic(x, torch.tensor(y), 1.0, 2, multi_label=True)
    for k in range(2):
        fitted = LogisticRegression(C=1.0, max_iter=5000, tol=1e-10).fit(x.to_dense().numpy(), y[:, k])
        np.testing.assert_allclose(w[:, k].numpy(), fitted.coef_[0], atol=1e-3 * np.abs(fitted.coef_).max())


def test_every_run_reports_the_baseline_beside_its_own_figure(small_csv, tmp_path, capsys):
    """Through the command as a user types it: the summary line and metrics.json carry the baseline's figures."""
    out = tmp_path / "run"
    argv = ["--model", "tiny", "--data", str(small_csv), "--output", str(out), "--epochs", "1", "--max-length", "32"]
    assert finetune_classifier.main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    found = metrics["baseline"]
    assert set(found) == {"train_accuracy", "val_accuracy", "test_accuracy", "c", "features"}
    assert found["c"] in baseline.PENALTIES and 0.5 <= found["test_accuracy"] <= 1
    logged = capsys.readouterr().out
    assert f"(bag-of-words baseline {found['test_accuracy']:.2%}; val" in logged
    # A tiny model trained one epoch from random weights does not beat words that tell spam: the run says so.
    assert metrics["test_accuracy"] < found["test_accuracy"]
    assert "note: a bag-of-words logistic regression does at least as well on this test split" in logged
    assert "Try --pooling mean (the head reads every word, as the baseline does), --search (a few recipes" in logged
    assert "validation split), a longer --max-length" in logged
    said: list[str] = []  # a run that pooled the mean already is not told to
    baseline.warn_if_no_better(metrics, said.append, "mean")
    assert "Try --search" in said[0] and "--pooling" not in said[0]


def test_a_run_that_fits_its_training_rows_says_so():
    """The issue's own case (train 92.8% against validation 75.3%, epoch 3 kept) gets a note; SMS's does not."""
    from llama_scratch.training.evaluation import warn_if_overfit

    lines: list[str] = []
    warn_if_overfit({"train_accuracy": 0.928, "val_accuracy": 0.753, "best_epoch": 3}, lines.append)
    assert len(lines) == 1 and "92.80%" in lines[0] and "75.30%" in lines[0] and "epoch 3" in lines[0]
    warn_if_overfit({"train_accuracy": 0.9981, "val_accuracy": 0.9933, "best_epoch": 3}, lines.append)
    assert len(lines) == 1

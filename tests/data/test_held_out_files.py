"""A project's own validation and test files (`--val-data`, `--test-data`), as a user types them: what is given is
used, what is missing is cut from `--data`; the test figures are those classify gives on the same file; labels the
training data lacks are refused, rows it shares are counted; a resume with another file is refused."""

import csv
import json
import math
import re

import pytest

from llama_scratch import classify, finetune_classifier
from llama_scratch.checkpoints.resume import read_point
from llama_scratch.checkpoints.run_record import read_run

# Every test here trains a run end to end through the command: the `slow` tier (tests/README.md).
pytestmark = pytest.mark.slow

FLAGS = ["--model", "tiny", "--epochs", "2", "--train-last", "2", "--lr", "1e-3", "--max-length", "48"]


def write_table(path, rows, delimiter=","):
    with path.open("w", newline="") as f:
        csv.writer(f, delimiter=delimiter).writerows([("message", "category"), *rows])
    return path


@pytest.fixture
def files(small_csv, tmp_path):
    """train.csv (64 rows), val.csv (16) and test.tsv (16 of their own, then a training text again: 17)."""
    with open(small_csv, newline="") as f:
        rows = [(r["message"], r["category"]) for r in csv.DictReader(f)]
    ham, spam = rows[:48], rows[48:]
    train = write_table(tmp_path / "train.csv", ham[:32] + spam[:32])
    val = write_table(tmp_path / "val.csv", ham[32:40] + spam[32:40])
    test = write_table(tmp_path / "test.tsv", [ham[40], ham[0], *ham[41:48], *spam[40:48]], delimiter="\t")
    return train, val, test


def test_given_val_and_test_files_are_used_and_the_test_figures_are_classify_s(files, tmp_path, capsys):
    train, val, test = files
    out = tmp_path / "run"
    argv = [*FLAGS, "--data", str(train), "--val-data", str(val), "--test-data", str(test), "--output", str(out)]
    capsys.readouterr()
    assert finetune_classifier.main([*argv, "--batch-size", "8"]) == 0
    log = capsys.readouterr().out
    assert f"every row of {train} trains: train 64, val 16 ({val}), test 17 ({test})" in log
    assert f"{test}: 1 of 17 rows have a text that is also in the training rows (first: line 3, as line 2" in log
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["split"] is None and metrics["split_sizes"] == {"train": 64, "val": 16, "test": 17}
    sources = {k: v["file"] for k, v in metrics["split_files"].items()}
    assert sources == {"train": str(train), "val": str(val), "test": str(test)}
    record = json.loads((out / "classifier.json").read_text())
    assert record["data"] == metrics["split_files"] and len({v["digest"] for v in record["data"].values()}) == 3
    assert read_run(out).data == record["data"]  # classify and export read the record back with it

    # The test figures are classify's on the test file, as classify reads it: whole, not cut to the training length.
    scored = tmp_path / "scored.csv"
    capsys.readouterr()
    args = ["--checkpoint", str(out), "--file", str(test), "--labels", "--output", str(scored)]
    assert classify.main(args) == 0
    report = capsys.readouterr().out
    with scored.open(newline="") as f:
        rows = list(csv.DictReader(f))
    correct = sum(r["predicted"] == r["category"] for r in rows)
    assert re.search(rf"accuracy [\d.]+% \({correct} of 17\)", report)
    assert metrics["test_accuracy"] == pytest.approx(correct / 17)
    loss = sum(-math.log(float(r[f"p_{r['category']}"])) for r in rows) / len(rows)
    assert metrics["test_loss"] == pytest.approx(loss, rel=1e-4, abs=1e-5)
    names = metrics["label_names"]
    confusion = [[sum(r["category"] == t and r["predicted"] == p for r in rows) for p in names] for t in names]
    assert metrics["test_confusion"] == confusion


def test_what_is_missing_is_cut_from_data_and_bad_files_are_one_line(files, tmp_path, capsys):
    train, val, test = files
    out = tmp_path / "run"
    argv = [*FLAGS, "--data", str(train), "--split", "full", "--max-steps", "1", "--batch-size", "8"]
    capsys.readouterr()
    assert finetune_classifier.main([*argv, "--test-data", str(test), "--output", str(out)]) == 0
    assert f"split 'full': train 58, val 6, test 17 ({test})" in capsys.readouterr().out  # val: int(0.1 x 64)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["split_files"]["val"]["file"] == str(train) and metrics["split_files"]["test"]["file"] == str(test)
    assert finetune_classifier.main([*argv, "--val-data", str(val), "--output", str(tmp_path / "v")]) == 0
    assert f"split 'full': train 50, val 16 ({val}), test 14" in capsys.readouterr().out  # test: 64 - 44 - 6

    # A validation file of one class is no wrong label column (as --data of one class would be): it is read.
    hams = write_table(tmp_path / "hams.csv", [(f"see you at {h} o'clock", "ham") for h in range(1, 9)])
    assert finetune_classifier.main([*argv, "--val-data", str(hams), "--output", str(tmp_path / "h")]) == 0
    assert f"{hams}: 8 rows; ham 8, spam 0; 0 bad rows skipped" in capsys.readouterr().out

    eggs = write_table(tmp_path / "eggs.csv", [("hello there", "ham"), ("fresh eggs for sale", "eggs")])
    for extra, said in (
        (
            ["--test-data", str(eggs)],
            f"--test-data {eggs} line 3: label 'eggs' is not in the training data (ham, spam)",
        ),
        (["--val-data", str(tmp_path / "nope.csv")], f"--val-data {tmp_path / 'nope.csv'}: no such file"),
        (
            ["--val-data", str(val), "--test-data", str(test)],
            "--split cuts --data, but with --val-data and --test-data",
        ),
    ):
        assert finetune_classifier.main([*argv, *extra, "--output", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {said}") and err.count("\n") == 1, err


def test_resume_refuses_another_test_file_or_an_edited_one(files, tmp_path, monkeypatch, capsys):
    train, val, test = files
    out = tmp_path / "run"
    argv = [*FLAGS, "--data", str(train), "--val-data", str(val), "--test-data", str(test), "--output", str(out)]
    calls = []

    def interrupt_on_the_second_step(totals, *rest):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr("llama_scratch.training.loop.check_finite", interrupt_on_the_second_step)
        assert finetune_classifier.main([*argv, "--batch-size", "8"]) == 130
    identity = read_point(out / "resume.safetensors")["identity"]
    assert identity["test_data"] == str(test) and identity["val_digest"] and identity["test_digest"]
    monkeypatch.setattr(finetune_classifier, "build_classifier", lambda *a: pytest.fail("loaded before refusing"))
    capsys.readouterr()
    assert finetune_classifier.main(["--resume", "--output", str(out), "--test-data", str(val)]) == 2
    assert f"--test-data was {str(test)!r}, now {str(val)!r}" in capsys.readouterr().err
    test.write_text(test.read_text().replace("\tham", "\tspam", 2))
    assert finetune_classifier.main(["--resume", "--output", str(out)]) == 2
    assert "the --test-data file (texts or labels) was" in capsys.readouterr().err

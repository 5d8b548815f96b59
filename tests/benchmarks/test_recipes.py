"""benchmarks/recipes.py's own pieces: the capped, shortened task file, the table it prints from a results file, and
which seed cuts the splits and which trains (on the `tiny` preset; the runs' figures are measured, not tested:
benchmarks/RESULTS.md)."""

import csv
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import recipes  # noqa: E402


def test_capped_csv_draws_each_class_in_proportion_and_shortens_every_text(tmp_path):
    source = tmp_path / "task.csv"
    rows = [(f"text {i} " + "word " * i, "a" if i % 4 else "b") for i in range(200)]  # a: 150, b: 50
    with source.open("w", newline="") as f:
        csv.writer(f).writerows([("text", "label"), *rows])
    out = recipes.capped_csv(source, 40, tmp_path / "capped.csv", shorten=lambda text: text[:12])
    with out.open(newline="") as f:
        header, *kept = list(csv.reader(f))
    assert header == ["text", "label"] and len(kept) == 40
    assert sum(label == "b" for _, label in kept) == 10, "a quarter of the rows, as in the source"
    assert all(len(text) <= 12 for text, _ in kept)
    assert recipes.capped_csv(source, 1000, tmp_path / "all.csv", shorten=str).read_text() == source.read_text()


def test_the_table_marks_what_search_would_keep_and_leaves_blanks_where_nothing_ran():
    row = lambda name, val, loss, test: {"name": name, "val_accuracy": val, "val_loss": loss, "test_accuracy": test}  # noqa: E731
    record = {
        "tasks": {
            "one": {
                "split_sizes": {"train": 7, "val": 1, "test": 2},
                "baseline": {"test_accuracy": 0.5},
                "rows": [row("last 2, lr 0.0002", 0.8, 0.3, 0.6), row("last 2, lr 0.001", 0.8, 0.2, 0.9)],
                "trainer": {"test_accuracy": 0.75},
            },
            "two": {
                "split_sizes": {"train": 7, "val": 1, "test": 2},
                "baseline": {"test_accuracy": 0.25},
                "rows": [row("last 2, lr 0.0002", 0.5, 0.3, 0.5)],
            },
        }
    }
    lines = recipes.markdown(record).splitlines()
    assert lines[0].startswith("| task | train/val/test | bag-of-words | last 2, lr 0.0002 | last 2, lr 0.001 |")
    assert lines[2] == "| one | 7/1/2 | 50.0% | 60.0% | 90.0% | 90.0% (last 2, lr 0.001) | 75.0% |"  # ties: lower loss
    assert lines[3] == "| two | 7/1/2 | 25.0% | 50.0% |  |  |  |"
    # The means: over every task where each has a figure, blank where one has none.
    assert lines[4] == "| mean of 2 |  | **37.5%** | **55.0%** |  |  |  |"
    # A task run with other --candidates adds its recipe's column; the others leave it blank.
    record["tasks"]["three"] = {**record["tasks"]["two"], "rows": [row("last 30, lr 5e-05", 0.5, 0.3, 0.7)]}
    lines = recipes.markdown(record).splitlines()
    assert "| last 2, lr 0.001 | last 30, lr 5e-05 | best on val |" in lines[0]
    assert lines[2] == "| one | 7/1/2 | 50.0% | 60.0% | 90.0% |  | 90.0% (last 2, lr 0.001) | 75.0% |"
    assert lines[4] == "| three | 7/1/2 | 25.0% |  |  | 70.0% |  |  |"


def test_candidates_are_typed_as_last_at_rate_and_a_typo_is_one_clear_line():
    assert recipes.candidate_list("2@2e-4,4@1e-4") == [recipes.Candidate(2, 2e-4), recipes.Candidate(4, 1e-4)]
    with pytest.raises(recipes.argparse.ArgumentTypeError, match="expected LAST@LR"):
        recipes.candidate_list("2-2e-4")


def test_a_training_seed_keeps_the_split_and_trains_differently_and_pooling_reaches_the_candidates(small_csv, tmp_path):
    """`--train-seed T` must leave `--seed`'s split alone (the same texts in each part, so the runs compare on one
    split) and train with T: another head and row order, so other figures. Without it, training uses `--seed`."""
    kept = [recipes.Candidate(2, 1e-3)]

    def run(train_seed):
        return recipes.ours(small_csv, "tiny", tmp_path, kept, 32, 5, lambda *a: None, train_seed)

    plain, parts = run(None)
    same, _ = run(5)
    other, other_parts = run(7)
    assert {k: p.texts for k, p in parts.items()} == {k: p.texts for k, p in other_parts.items()}
    assert same["rows"][0]["val_loss"] == plain["rows"][0]["val_loss"]
    assert other["rows"][0]["val_loss"] != plain["rows"][0]["val_loss"]
    assert "train_seed" not in plain and other["train_seed"] == 7
    # --pooling mean reaches the candidates that search trains: on the same split and seed, other figures.
    mean, _ = recipes.ours(small_csv, "tiny", tmp_path, kept, 32, 5, lambda *a: None, None, "mean")
    assert mean["pooling"] == "mean" and "pooling" not in plain
    assert mean["rows"][0]["val_loss"] != plain["rows"][0]["val_loss"]

"""Trial (issue #39, not a product change): late fusion of our default recipe with the bag-of-words baseline.

For one task and seed, the data is capped and shortened exactly as benchmarks/recipes.py does it (its own
`capped_csv` and `shorten`, the same --rows, --max-length and --seed, so the same splits), our default recipe
(last 2 blocks at 1e-3, `--candidates 2@1e-3`) is trained through recipes.py's own `ours` (so the same figure as
recipes.py gives), and the model's class log-probabilities on the validation and test splits are read at the kept
(best-validation) epoch: `search.try_one` is wrapped so that, once it has put the kept weights back and scored the
test split, the same classifier is run once more over val and test. The bag-of-words baseline is fitted as
`training.baseline.bag_of_words` fits it (same vocabulary, same C chosen on validation) and its log-probabilities
are read too. Fused scores: model log p + w x BoW log p, w from W chosen by validation accuracy (ties: the smaller
w), then scored on test.

    python benchmarks/fusion_trial.py --task debates_2016 --rows 774 --seed 1

Results: benchmarks/suite/fusion_trial.json; benchmarks/RESULTS.md, "Fusing the model with the baseline". Kept to
reproduce them; the package has no fusion (the section says why).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import recipes  # noqa: E402  (benchmarks/recipes.py: capped_csv, ours)

from llama_scratch.data.batching import forward, length_sorted_batches, to_batch  # noqa: E402
from llama_scratch.model.tokenizer import Tokenizer  # noqa: E402
from llama_scratch.training import search as search_module  # noqa: E402
from llama_scratch.training.baseline import (  # noqa: E402
    Vocabulary,
    accuracy,
    bag_of_words,
    fit_chosen_on_validation,
)
from llama_scratch.training.search import Candidate  # noqa: E402

WEIGHTS = HERE.parent / "weights" / "smollm2-135m-instruct"  # `llama-scratch download smollm2-135m`
DATA = HERE / "suite" / "data"  # `python benchmarks/suite.py build`
W = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
DEFAULT = Candidate(2, 1e-3)

captured: dict = {}  # what the wrapped try_one read: the model's log-probabilities per split, and its row


@torch.no_grad()
def log_probs(clf, split, settings, strategy) -> torch.Tensor:
    """[texts, classes] float64 log-softmax of the classifier's logits, in the split's own row order, batched as
    `evaluate` batches (length-sorted, settings.eval_rows a batch, the run's padding side)."""
    out = torch.empty(len(split.ids), clf.head.out_features, dtype=torch.float64)
    was_training = clf.training
    clf.eval()
    with strategy.forwards_only(clf):
        for rows in length_sorted_batches([len(x) for x in split.ids], settings.eval_rows):
            batch = to_batch(split, rows, settings.padding_side, strategy.device)
            out[rows] = forward(clf, batch).float().log_softmax(-1).double().cpu()
    clf.train(was_training)
    return out


original_try_one = search_module.try_one


def try_one_reading(clf, c, splits, settings, epochs, strategy, log, score):
    row, seconds = original_try_one(clf, c, splits, settings, epochs, strategy, log, score)
    # try_one has copied the kept (best-validation) weights into clf to score `score`: read them now, before
    # search() puts the backbone back
    assert score, "recipes.ours passes the test split to score: the kept weights are then in clf"
    captured[c.name] = {
        "row": row,
        **{k: (log_probs(clf, splits[k], settings, strategy), torch.tensor(splits[k].labels)) for k in ("val", "test")},
    }
    return row, seconds


search_module.try_one = try_one_reading


def bow_log_probs(texts: dict, num_classes: int) -> dict:
    """`baseline.bag_of_words`'s fit (single label), with each split's log-probabilities at the chosen C."""
    vocab = Vocabulary.fit(texts["train"][0])
    x = {k: vocab.features(t) for k, (t, _) in texts.items()}
    y = {k: torch.tensor(targets, dtype=torch.long) for k, (_, targets) in texts.items()}
    c, w, b = fit_chosen_on_validation(x, y, num_classes, False)
    out = {"c": c}
    for k in ("val", "test"):
        logits = torch.sparse.mm(x[k], w) + b
        out[k] = F.log_softmax(logits.double(), -1)
        out[f"{k}_accuracy"] = accuracy(logits.argmax(-1), y[k], False)
    return out


def acc(scores: torch.Tensor, y: torch.Tensor) -> float:
    return (scores.argmax(-1) == y).double().mean().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", required=True)
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--pooling", default="last")
    p.add_argument("--json", type=Path, default=HERE / "suite" / "fusion_trial.json")
    args = p.parse_args()
    key = args.task if args.seed == 123 else f"{args.task} seed {args.seed}"
    if args.pooling != "last":
        key += f" pooling {args.pooling}"
    record = json.loads(args.json.read_text()) if args.json.exists() else {"w_grid": list(W), "runs": {}}
    if key in record["runs"]:
        print(f"{key}: in {args.json} already")
        return
    tokenizer = Tokenizer.from_hf_json(WEIGHTS / "tokenizer.json")

    def shorten(text: str) -> str:  # recipes.main's, verbatim
        ids = tokenizer.encode(text)
        return text if len(ids) <= args.max_length else tokenizer.decode(ids[: args.max_length]).rsplit(" ", 1)[0]

    torch.manual_seed(0)  # as recipes.main before each task
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        data = recipes.capped_csv(DATA / f"{args.task}.csv", args.rows, Path(tmp) / f"{args.task}.csv", shorten)
        result, parts = recipes.ours(
            data, WEIGHTS, Path(tmp), [DEFAULT], args.max_length, args.seed, print, None, args.pooling
        )
    trained = time.perf_counter()
    texts = {k: (v.texts, v.targets()) for k, v in parts.items()}
    n = len(parts["train"].label_names)
    reference_bow = bag_of_words(texts, n, False)  # the baseline exactly as recipes.py calls it
    bow = bow_log_probs(texts, n)
    got = captured[DEFAULT.name]
    row = got["row"]
    (m_val, y_val), (m_test, y_test) = got["val"], got["test"]
    assert torch.equal(y_val, torch.tensor(texts["val"][1])) and torch.equal(y_test, torch.tensor(texts["test"][1]))
    by_w = {}
    for w in W:
        by_w[w] = {"val": acc(m_val + w * bow["val"], y_val), "test": acc(m_test + w * bow["test"], y_test)}
    chosen = max(W, key=lambda w: (by_w[w]["val"], -w))
    out = {
        "task": args.task,
        "seed": args.seed,
        "rows": args.rows,
        "pooling": args.pooling,
        "split_sizes": result["split_sizes"],
        "model_best_epoch": row["best_epoch"],
        "model_val_acc_row": row["val_accuracy"],  # as recipes.py records it (the training loop's evaluation)
        "model_test_acc_row": row["test_accuracy"],  # as recipes.py records it (evaluate on the kept weights)
        "model_val_acc": acc(m_val, y_val),  # argmax of the log-probabilities read here
        "model_test_acc": acc(m_test, y_test),
        "bow_c": bow["c"],
        "bow_val_acc": bow["val_accuracy"],
        "bow_test_acc": bow["test_accuracy"],
        "bow_test_acc_baseline_py": reference_bow["test_accuracy"],
        "chosen_w": chosen,
        "fused_val_acc": by_w[chosen]["val"],
        "fused_test_acc": by_w[chosen]["test"],
        "by_w": {str(w): v for w, v in by_w.items()},
        "seconds_train": trained - began,
        "seconds": time.perf_counter() - began,
    }
    record = json.loads(args.json.read_text()) if args.json.exists() else {"w_grid": list(W), "runs": {}}
    record["runs"][key] = out
    args.json.write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"{key}: model {out['model_test_acc']:.2%} (row {row['test_accuracy']:.2%}), BoW {bow['test_accuracy']:.2%}"
        f" (baseline.py {reference_bow['test_accuracy']:.2%}), w {chosen:g}: fused val {out['fused_val_acc']:.2%},"
        f" test {out['fused_test_acc']:.2%} ({out['seconds']:.0f} s)"
    )


if __name__ == "__main__":
    main()

"""metrics.json carries a schema version (`training.run_dir`, `checkpoints.versions`): each older shape still reads,
brought to the current one by its upgrade step (written here as the code of that time wrote it), the model card reads
it without asking which version wrote it, a newer version is refused in one line naming the file and the version, and
the current shape reads back as written."""

import json

import pytest
import torch

from llama_scratch.checkpoints import run_record
from llama_scratch.checkpoints.hf_layout import CheckpointError
from llama_scratch.checkpoints.model_card import model_card
from llama_scratch.checkpoints.versions import VERSION_KEY
from llama_scratch.training import run_dir

from ..checkpoints.test_run_record import FIRST_RELEASE, LAST_SINGLE_LABEL

# metrics.json as earlier versions wrote it (version 1: no version key).
FIRST_METRICS = {  # the first finetune_classifier's
    "model": "tiny",
    "data": "data/sms.csv",
    "split": "stratified",
    "split_sizes": {"train": 80, "val": 10, "test": 10},
    "num_classes": 2,
    "label_names": ["ham", "spam"],
    "train_accuracy": 0.9,
    "val_accuracy": 0.8,
    "test_accuracy": 0.7,
    "train_loss": 0.3,
    "val_loss": 0.4,
    "test_loss": 0.5,
    "test_per_class": {n: {"precision": 0.7, "recall": 0.7, "f1": 0.7, "support": 5} for n in ("ham", "spam")},
    "test_confusion": [[4, 1], [2, 3]],
    "best_epoch": 2,
    "steps": 30,
    "seconds": 12.0,
    "train_seconds": 10.0,
    "tokens_per_second": 900.0,
    "dtype": "float32",
    "device": "cpu",
    "world_size": 1,
    "trainable_parameters": 1000,
    "run_id": "r1",
}
LAST_MULTI_METRICS = {  # the last version 1 of a --multi-label run: select_by, split_files, the threshold
    **{k: v for k, v in FIRST_METRICS.items() if k != "test_confusion"},
    "split_files": {k: {"file": "data/sms.csv", "digest": "d"} for k in ("train", "val", "test")},
    "multi_label": True,
    **{f"{k}_{m}": 0.6 for k in ("train", "val", "test") for m in ("micro_f1", "macro_f1")},
    "threshold": 0.35,
    "threshold_chosen_on": "validation",
    "best_step": 20,
    "select_by": "macro_f1",
}


@pytest.mark.parametrize("older", [FIRST_METRICS, LAST_MULTI_METRICS], ids=["first-release", "last-multi-label"])
def test_every_older_metrics_file_reads_in_the_current_shape(tmp_path, older):
    (tmp_path / "metrics.json").write_text(json.dumps(older))
    metrics = run_dir.read_metrics(tmp_path)
    assert VERSION_KEY not in metrics and metrics.items() >= older.items()  # nothing written is changed
    assert metrics["multi_label"] == (older is LAST_MULTI_METRICS)
    if older is FIRST_METRICS:  # what the keys added since meant when a file lacked them
        assert metrics["select_by"] == "accuracy" and metrics["best_step"] is None
        assert metrics["split_files"] == {k: {"file": "data/sms.csv", "digest": None} for k in ("train", "val", "test")}
        assert metrics["val_macro_f1"] is None
    # The model card reads either without asking which version wrote it.
    labels = {"multi_label": True, "threshold": 0.35} if metrics["multi_label"] else {}
    record = run_record.RunRecord(
        **run_record.ADDED_IN_VERSION_1 | run_record.ADDED_IN_VERSION_2 | LAST_SINGLE_LABEL | {"lora": None} | labels
    )
    card = model_card(record, metrics, torch.float32, "python -m llama_scratch.export_hf ...")
    assert "Data: `sms.csv`, split `stratified` (train 80, val 10, test 10 texts)." in card
    assert ("| split | exact match | micro-F1 | loss |" in card) == metrics["multi_label"]
    assert "- 30 optimizer steps, best epoch 2" in card


def test_metrics_are_written_with_their_version_and_read_back(tmp_path):
    history = [
        {"epoch": 1, "step": 10, "train_loss": 0.5, "train_accuracy": 0.6, "val_loss": 0.4, "val_accuracy": 0.7}
        | {"val_macro_f1": 0.6}
    ]
    metrics = FIRST_METRICS | {"select_by": "accuracy", "best_step": 10, "multi_label": False}
    record = run_record.RunRecord(**{**run_record.ADDED_IN_VERSION_1, **run_record.ADDED_IN_VERSION_2, **FIRST_RELEASE})
    run_dir.write_results(tmp_path, "r3", dict(metrics), record, history)
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert list(written)[0] == VERSION_KEY and written[VERSION_KEY] == run_dir.METRICS_VERSION
    assert run_dir.read_metrics(tmp_path) == metrics | {"run_id": "r3"}
    written[VERSION_KEY] = run_dir.METRICS_VERSION + 1
    (tmp_path / "metrics.json").write_text(json.dumps(written))
    with pytest.raises(
        CheckpointError,
        match=f"metrics.json was written by a newer llama_scratch \\(version {run_dir.METRICS_VERSION + 1};",
    ):
        run_dir.read_metrics(tmp_path)
    (tmp_path / "metrics.json").write_text("not json")
    assert run_dir.read_metrics(tmp_path) is None  # a report, not needed to load: an export says it has none

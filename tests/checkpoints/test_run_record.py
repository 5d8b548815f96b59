"""classifier.json carries a schema version (`checkpoints.run_record`, `checkpoints.versions`): each older shape
still reads, brought to the current one by its upgrade step (the older files here are written as the code of that
time wrote them), a newer version is refused in one line naming the file and the version, and the current shape reads
back as written. metrics.json's versions: tests/training/test_run_dir.py."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from llama_scratch import LlamaConfig, classify
from llama_scratch.checkpoints import run_record
from llama_scratch.checkpoints.hf_layout import CheckpointError
from llama_scratch.checkpoints.versions import VERSION_KEY
from llama_scratch.model.lora import LoRASettings
from llama_scratch.training.loop import TrainSettings

TINY = LlamaConfig.from_name("tiny").to_hf_dict()
SETTINGS = {"epochs": 5, "batch_size": 8, "lr": 5e-5, "seed": 0}

# classifier.json as each earlier version of finetune_classifier wrote it (version 1: no version key).
FIRST_RELEASE = {  # the first finetune_classifier: no run id, no relative path, no LoRA
    "base_model": "tiny",
    "weights_include_backbone": True,
    "config": TINY,
    "num_classes": 2,
    "label_names": ["ham", "spam"],
    "train_last": None,
    "tokenizer": "llama3",
    "max_length": 128,
    "dtype": "float32",
    "settings": SETTINGS,
}
WITH_LORA_AND_RUN_IDS = {  # the base found again by a relative path and its repo, LoRA, the run id
    "base_model": "/elsewhere/weights/smollm2",
    "base_model_relative": "../weights/smollm2",
    "base_model_repo": "HuggingFaceTB/SmolLM2-135M",
    "weights_include_backbone": False,
    "config": TINY,
    "num_classes": 2,
    "label_names": ["ham", "spam"],
    "train_last": 2,
    "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["q", "v"], "blocks": [2, 3]},
    "tokenizer": "llama3",
    "max_length": 48,
    "dtype": "bfloat16",
    "settings": SETTINGS,
    "run_id": "r1",
}
LAST_SINGLE_LABEL = {  # the last version 1: quantize and data; a single-label run wrote no multi_label
    **{k: v for k, v in WITH_LORA_AND_RUN_IDS.items() if k not in ("settings", "run_id")},
    "quantize": "nf4",
    "data": {"train": {"file": "sms.csv", "digest": "d1"}},
    "settings": SETTINGS,
    "run_id": "r1",
}
LAST_MULTI_LABEL = {**LAST_SINGLE_LABEL, "lora": None, "multi_label": True, "threshold": 0.35}
# The last record before --pooling: version 2, every key of its time written, the head read the last token.
LAST_BEFORE_POOLING = {VERSION_KEY: 2, **run_record.ADDED_IN_VERSION_1, **LAST_SINGLE_LABEL}


def write_run(run, record: dict, run_id: str | None) -> None:
    run.mkdir(exist_ok=True)
    (run / run_record.RECORD_FILE).write_text(json.dumps(record, indent=2))
    metadata = {"run_id": run_id} if run_id else None  # runs from before run ids set no metadata
    save_file({"x": torch.zeros(1)}, run / run_record.WEIGHTS_FILE, metadata=metadata)


@pytest.mark.parametrize(
    "older",
    [FIRST_RELEASE, WITH_LORA_AND_RUN_IDS, LAST_SINGLE_LABEL, LAST_MULTI_LABEL, LAST_BEFORE_POOLING],
    ids=["first-release", "lora-and-run-ids", "last-single-label", "last-multi-label", "before-pooling"],
)
def test_every_older_classifier_record_reads_in_the_current_shape(tmp_path, older):
    run = tmp_path / "run"
    write_run(run, older, older.get("run_id"))
    record = run_record.read_run(run)
    absent = {**run_record.ADDED_IN_VERSION_1, **run_record.ADDED_IN_VERSION_2}  # what a key's absence meant
    for key in run_record.RECORD_KEYS:  # as written where it was, else what its absence meant
        if key != "lora":
            assert getattr(record, key) == older.get(key, absent.get(key)), key
    assert (record.lora is None) == (older.get("lora") is None)
    if older.get("lora"):
        assert record.lora.settings == LoRASettings(4, 8.0, 0.0, ("q", "v")) and record.lora.blocks == (2, 3)
    assert record.multi_label == (older is LAST_MULTI_LABEL)
    # Written again, it is the current version with every key; read again, the same record.
    written = run_record.write_record(run, record)
    meta = json.loads(written.read_text())
    assert meta[VERSION_KEY] == run_record.RECORD_VERSION and list(meta) == [VERSION_KEY, *run_record.RECORD_KEYS]
    assert run_record.read_run(run) == record


def test_a_current_classifier_record_lacking_a_key_is_refused_by_name(tmp_path):
    run = tmp_path / "run"
    write_run(run, {VERSION_KEY: 2, **run_record.ADDED_IN_VERSION_1, **LAST_SINGLE_LABEL}, "r1")
    assert run_record.read_run(run).quantize == "nf4"
    meta = json.loads((run / run_record.RECORD_FILE).read_text())
    del meta["quantize"]  # version 2 writes every key: a missing one is not filled in, it is a broken file
    (run / run_record.RECORD_FILE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"is not a classifier description \(it lacks quantize\)"):
        run_record.read_run(run)


@pytest.mark.parametrize("version", [4, 99])
def test_a_newer_classifier_record_is_refused_in_one_line_naming_its_version(tmp_path, capsys, version):
    run = tmp_path / "run"
    write_run(run, {VERSION_KEY: version, **LAST_SINGLE_LABEL}, "r1")
    path = run / run_record.RECORD_FILE
    with pytest.raises(CheckpointError) as e:
        run_record.read_run(run)
    assert str(e.value) == (
        f"{path} was written by a newer llama_scratch (version {version}; this one reads up to "
        f"{run_record.RECORD_VERSION}): update llama_scratch to read it"
    )
    assert classify.main(["--checkpoint", str(run), "some text"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {e.value}\n"


@pytest.mark.parametrize("version", ["2", 0, True, 1.5])
def test_a_classifier_record_with_a_version_no_run_writes_is_refused(tmp_path, version):
    run = tmp_path / "run"
    write_run(run, {VERSION_KEY: version, **LAST_SINGLE_LABEL}, "r1")
    with pytest.raises(CheckpointError, match=f"version {version!r} is not a version this tool writes"):
        run_record.read_run(run)


def test_a_new_record_reads_back_as_written(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    record = run_record.new_record(
        model_ref="tiny",
        repo_id=None,
        out=run,
        from_scratch=True,
        config=LlamaConfig.from_name("tiny"),
        label_names=["music", "politics", "sports"],
        train_last=None,
        lora=None,
        lora_blocks=[],
        tokenizer="llama3",
        max_length=48,
        dtype=torch.float32,
        settings=TrainSettings(),
        multi_label=True,
        threshold=0.4,
        pooling="mean",
    )
    written = dataclasses.replace(record, run_id="r2")
    run_record.write_record(run, written)
    save_file({"x": torch.zeros(1)}, run / run_record.WEIGHTS_FILE, metadata={"run_id": "r2"})
    assert run_record.read_run(run) == written
    meta = json.loads((run / run_record.RECORD_FILE).read_text())
    assert meta["base_model_relative"] is None and meta["quantize"] is None and meta["threshold"] == 0.4
    assert meta["pooling"] == "mean"


def test_a_record_with_a_pooling_no_run_writes_is_refused_by_name(tmp_path):
    run = tmp_path / "run"
    write_run(run, {**LAST_BEFORE_POOLING, VERSION_KEY: 3, "pooling": "max"}, "r1")
    with pytest.raises(CheckpointError, match="pooling not as a finished run writes them"):
        run_record.read_run(run)

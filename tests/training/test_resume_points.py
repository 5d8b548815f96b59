"""Resume points carry a schema version: an older point is brought up to date in one place (resume.upgrade), a newer
one refused in one line naming its version and file; and where a point lives (training/resume_points.py)."""

import json

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from llama_scratch.checkpoints import resume
from llama_scratch.checkpoints.resume import ResumeError
from llama_scratch.parallel.strategy import Replicated
from llama_scratch.training import resume_points
from llama_scratch.training.loop import TrainState, load_resume_point, patience_spent, save_resume_point
from tests.commands.test_finetune import resume_parts


def rewrite(path, change) -> None:
    """The point at `path` with its JSON record changed by `change(record)`, as another version would write it."""
    tensors, record = load_file(path), json.loads(safe_open(path, "pt").metadata()["llama_scratch"])
    change(record)
    save_file(tensors, path, metadata={"llama_scratch": json.dumps(record)})


def test_a_point_is_written_with_its_version_and_a_newer_one_is_refused_by_version_and_file(tmp_path):
    clf, opt, sched, s = resume_parts()
    path = tmp_path / "resume.safetensors"
    save_resume_point(path, clf, opt, sched, TrainState(step=2), s, {"model": "a"})
    assert resume.read_point(path, tensors=False)["version"] == resume.VERSION
    rewrite(path, lambda record: record.update(version=resume.VERSION + 1))
    with pytest.raises(ResumeError) as refused:
        load_resume_point(path, clf, opt, sched, s, {"model": "a"})
    said = str(refused.value)
    assert f"version {resume.VERSION + 1}" in said and str(path) in said and "\n" not in said


def test_a_version_1_point_is_upgraded_to_what_it_meant(tmp_path):
    """Written before --select-by, --multi-label, best_step and --pooling (and with no version): it selected by
    accuracy, had one label a text, evaluated once an epoch and read the last token; it resumes as such, with no
    branch for it in the loop."""
    clf, opt, sched, s = resume_parts()
    path = tmp_path / "resume.safetensors"
    rows = [{"epoch": e, "step": 10 * e, "val_accuracy": 0.5} for e in (1, 2, 3)]
    state = TrainState(epoch=3, step=30, best_epoch=1, history=rows, evaluated_step=30)
    identity = {"model": "a", "data_digest": "d", "multi_label": False, "pooling": "last"}
    save_resume_point(path, clf, opt, sched, state, s, identity)

    def as_version_1(record):
        del record["version"], record["settings"]["select_by"], record["identity"]["multi_label"]
        del record["identity"]["pooling"]
        record["state"]["best_step"] = -1

    rewrite(path, as_version_1)
    resumed = load_resume_point(path, clf, opt, sched, s, identity)  # the command's: multi_label and pooling
    assert resumed.best_step == 10  # the step of epoch 1's row: two evaluations since
    s.patience = 2
    assert patience_spent(resumed, s)
    s.patience = 3
    assert not patience_spent(resumed, s)
    # A library caller's identity (no data named) is left as it was given.
    rewrite(path, lambda record: record.update(identity={"model": "a"}))  # still version 1
    assert "multi_label" not in resume.read_point(path, tensors=False)["identity"]


def test_a_version_2_point_pooled_the_last_token_and_resumes_only_as_such(tmp_path):
    """Written before --pooling: the command's run read each text's last token. It resumes under the default
    (`pooling` "last" in the identity) and is refused, by name, under --pooling mean."""
    clf, opt, sched, s = resume_parts()
    path = tmp_path / "resume.safetensors"
    identity = {"model": "a", "data_digest": "d", "multi_label": False, "pooling": "last"}
    save_resume_point(path, clf, opt, sched, TrainState(step=2), s, identity)

    def as_version_2(record):
        record["version"] = 2
        del record["identity"]["pooling"]

    rewrite(path, as_version_2)
    assert resume.read_point(path, tensors=False)["identity"]["pooling"] == "last"
    assert load_resume_point(path, clf, opt, sched, s, identity).step == 2
    with pytest.raises(ResumeError, match="pooling"):
        load_resume_point(path, clf, opt, sched, s, {**identity, "pooling": "mean"})


def test_a_point_of_the_other_kind_is_refused_by_name(tmp_path):
    (tmp_path / resume_points.RESUME_DIR).mkdir()
    sharded = type("Sharded", (Replicated,), {"state_per_process": True})()
    assert resume_points.location(Replicated(), tmp_path, resuming=False) == tmp_path / resume_points.RESUME_FILE
    with pytest.raises(ResumeError, match="saved by a sharded run of several processes: resume it with --shard"):
        resume_points.read(Replicated(), tmp_path)
    (tmp_path / resume_points.RESUME_DIR).rmdir()
    (tmp_path / resume_points.RESUME_FILE).write_bytes(b"")
    with pytest.raises(ResumeError, match="saved by a run without --shard"):
        resume_points.read(sharded, tmp_path)

"""A run folder, an output directory or a model reference handed over by someone else cannot run code, delete or
mix files, or fail with anything but one clear line. Each test here failed on the version before these checks."""

import errno
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llama_scratch import Llama, LlamaClassifier, LlamaConfig, classify, finetune_classifier
from llama_scratch.checkpoints import weights
from llama_scratch.checkpoints.resume import ResumeError
from llama_scratch.data.batching import TokenizedSplit
from llama_scratch.parallel.strategy import Replicated
from llama_scratch.sources import resolve as sources
from llama_scratch.training import loop as train
from tests.commands.test_finetune import args_for, resume_parts


class Payload:
    """Unpickling this creates a file: the proof that a pickle ran code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickled_resume_point_never_runs(small_csv, tmp_path, capsys):
    marker = tmp_path / "pwned"
    for name in ("checkpoint.pt", "resume.safetensors"):  # the old name, and a pickle under the new name
        out = tmp_path / name.replace(".", "-")
        out.mkdir()
        (out / name).write_bytes(pickle.dumps({"state": Payload(marker)}))
        assert finetune_classifier.main(args_for(small_csv, out, "--resume")) == 2
        assert not marker.exists(), f"{name} was unpickled"
        last = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bars
        assert last.startswith("error:") and str(out) in last


@pytest.mark.slow
def test_a_finished_run_survives_a_rerun_without_overwrite(small_csv, tmp_path, capsys):
    out = tmp_path / "run"
    assert finetune_classifier.main(args_for(small_csv, out, "--max-steps", "2")) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert finetune_classifier.main(args_for(small_csv, out, "--max-steps", "2")) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert finetune_classifier.main(args_for(small_csv, out, "--max-steps", "2", "--overwrite")) == 0
    after = json.loads((out / "metrics.json").read_text())
    assert after["run_id"] != json.loads(before["metrics.json"])["run_id"]
    assert load_file(out / "classifier.safetensors") is not None and not (out / "best.safetensors").exists()


def test_files_with_our_names_but_not_from_a_run_are_never_cleared(small_csv, tmp_path, capsys):
    """metrics.json and history.csv are common names: without a run's marker, a folder of them is not ours."""
    out = tmp_path / "report"
    out.mkdir()
    for name in ("metrics.json", "history.csv", "confusion.png"):
        (out / name).write_text("someone else's")
    for extra in ([], ["--overwrite"]):
        assert finetune_classifier.main(args_for(small_csv, out, "--max-steps", "1", *extra)) == 2
        assert "did not write" in capsys.readouterr().err
    assert all((out / n).read_text() == "someone else's" for n in ("metrics.json", "history.csv", "confusion.png"))
    (out / "history.png").mkdir()  # a directory by a result's name is not ours either
    (out / ".llama_scratch-run").write_text("")
    assert finetune_classifier.main(args_for(small_csv, out, "--max-steps", "1", "--overwrite")) == 2
    assert (out / "metrics.json").read_text() == "someone else's"


def test_an_output_directory_with_foreign_files_is_refused(small_csv, tmp_path, capsys):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "holiday.jpg").write_bytes(b"precious")
    (out / "metrics.json").write_text("{}")
    for extra in ([], ["--overwrite"], ["--resume"]):
        assert finetune_classifier.main(args_for(small_csv, out, "--max-steps", "1", *extra)) == 2
        assert "holiday.jpg" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["holiday.jpg", "metrics.json"]
    assert (out / "holiday.jpg").read_bytes() == b"precious"


@pytest.mark.slow
def test_classify_refuses_files_of_two_runs_and_tensors_that_do_not_fit(small_csv, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        assert finetune_classifier.main(args_for(small_csv, out, "--max-steps", "1")) == 0
    (a / "classifier.json").write_bytes((b / "classifier.json").read_bytes())  # a half-copied run
    with pytest.raises(weights.CheckpointError, match="different runs"):
        classify.load_classifier(a)
    weights_path = b / "classifier.safetensors"
    tensors, run_id = load_file(weights_path), json.loads((b / "classifier.json").read_text())["run_id"]
    good = dict(tensors)
    tensors["head.weight"] = tensors["head.weight"][:1]  # [1, dim] would broadcast into [2, dim]
    save_file(tensors, weights_path, metadata={"run_id": run_id})
    with pytest.raises(weights.CheckpointError, match="wrong shapes: head.weight"):
        classify.load_classifier(b)
    del tensors["head.weight"]  # tiny trains from scratch: every weight must be in the file
    save_file(tensors, weights_path, metadata={"run_id": run_id})
    with pytest.raises(weights.CheckpointError, match="missing: head.weight"):
        classify.load_classifier(b)
    save_file(good, weights_path, metadata={"run_id": run_id})
    assert classify.load_classifier(b)[0].head.weight.shape[0] == 2


def interrupt_first_validation(monkeypatch):
    """Make the first end-of-epoch evaluation raise Ctrl-C: the run stops with a resume point saved."""
    real = train.evaluate

    def once(*args, **kwargs):
        monkeypatch.setattr(train, "evaluate", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "evaluate", once)


@pytest.mark.slow
def test_resume_refuses_other_data_train_last_or_columns_by_name(small_csv, tmp_path, monkeypatch, capsys):
    data, out = tmp_path / "mine.csv", tmp_path / "run"
    data.write_bytes(small_csv.read_bytes())
    interrupt_first_validation(monkeypatch)
    assert finetune_classifier.main(args_for(data, out)) == 130
    assert (out / "resume.safetensors").exists()
    cases = [
        (["--train-last", "1"], "--train-last was '2', now '1'"),
        (["--text-column", "message", "--label-column", "category"], "--text-column was not given, now 'message'"),
    ]
    for extra, message in cases:
        assert finetune_classifier.main([*args_for(data, out, *extra), "--resume"]) == 2
        err = capsys.readouterr().err
        assert message in err and "leave them out to continue with the run's own" in err, err
    text = small_csv.read_text()
    last = text.rindex(",spam")
    data.write_text(text[:last] + ",ham" + text[last + 5 :])  # one label edited in place, same path
    assert finetune_classifier.main([*args_for(data, out), "--resume"]) == 2
    assert "the data (texts or labels) was" in capsys.readouterr().err
    assert (out / "resume.safetensors").exists()
    data.write_bytes(small_csv.read_bytes())
    assert finetune_classifier.main([*args_for(data, out), "--resume"]) == 0


@pytest.mark.slow
def test_a_run_started_under_another_default_rate_resumes_at_its_own(small_csv, tmp_path, monkeypatch, capsys):
    """A run started without --lr by a version whose default rate differed (2e-4 where it is 1e-3 now) was refused
    as "another run" on resume. It resumes at the rate it started with and says so; an --lr the user types that
    differs is still refused by name."""
    out = tmp_path / "run"
    flags = ["--model", "tiny", "--data", str(small_csv), "--split", "full", "--output", str(out)]
    flags += ["--epochs", "2", "--train-last", "2", "--max-length", "48"]  # no --lr: the default decides
    monkeypatch.setattr(finetune_classifier, "default_lr", lambda *_: 2e-4)  # an older version's default
    interrupt_first_validation(monkeypatch)
    assert finetune_classifier.main(flags) == 130
    monkeypatch.undo()
    capsys.readouterr()
    assert finetune_classifier.main([*flags, "--resume", "--lr", "5e-4"]) == 2
    assert "--lr was not given, now 0.0005" in capsys.readouterr().err
    assert finetune_classifier.main([*flags, "--resume"]) == 0
    said = capsys.readouterr()
    assert "resuming at the rate the run started with, 0.0002 (the default for these settings is now 0.001)" in (
        said.out + said.err
    )
    assert json.loads((out / "classifier.json").read_text())["settings"]["lr"] == 2e-4


def test_an_interrupt_during_the_last_evaluation_then_resume_records_that_epoch(tmp_path, monkeypatch):
    """A resume point saved after the run's last step but before its epoch's end was recorded: --resume must still
    evaluate that epoch (before, the loop saw no steps left and skipped it: a history row and maybe the best lost)."""
    ids = [[1 + (i * 7 + j) % 100 for j in range(4 + i % 5)] for i in range(16)]
    splits = {"train": TokenizedSplit(ids, [i % 2 for i in range(16)]), "val": TokenizedSplit(ids[:8], [0, 1] * 4)}
    settings = train.TrainSettings(epochs=2, batch_size=4, save_every=4, lr=1e-3)  # a save at the last step

    def run(out, resume=False):
        out.mkdir(exist_ok=True)
        torch.manual_seed(0)
        clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), num_classes=2, train_last=1)
        return train.train(clf, splits, settings, Replicated(), out, resume, None, lambda *a: 0)

    whole = run(tmp_path / "whole")
    real, calls = train.evaluate, []

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(train, "evaluate", second_fails)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "cut")
    monkeypatch.setattr(train, "evaluate", real)
    resumed = run(tmp_path / "cut", resume=True)
    assert resumed.history == whole.history and resumed.best_epoch == whole.best_epoch


def test_an_interrupt_while_the_best_weights_are_written_loses_nothing(tmp_path):
    """Ctrl-C arriving while on_best writes: the epoch's row, its best weights and the counters stay together."""
    ids = [[1 + (i * 7 + j) % 100 for j in range(4 + i % 5)] for i in range(16)]
    splits = {"train": TokenizedSplit(ids, [i % 2 for i in range(16)]), "val": TokenizedSplit(ids[:8], [0, 1] * 4)}
    settings = train.TrainSettings(epochs=2, batch_size=4, save_every=100, lr=1e-3)
    saved = []

    def run(out, on_best, resume=False):
        out.mkdir(exist_ok=True)
        torch.manual_seed(0)
        clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), num_classes=2, train_last=1)
        return train.train(clf, splits, settings, Replicated(), out, resume, on_best, lambda *a: 0)

    whole = run(tmp_path / "whole", lambda epoch: None)

    def slow_best(epoch):
        if not saved:
            os.kill(os.getpid(), signal.SIGINT)  # arrives while the weights are "being written"
        saved.append(epoch)

    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "cut", slow_best)
    resumed = run(tmp_path / "cut", slow_best, resume=True)
    assert resumed.history == whole.history  # no duplicated row
    assert saved[0] == 1 and len(set(saved)) == len(saved)  # epoch 1's best was written, once
    assert resumed.best_epoch == whole.best_epoch == saved[-1]


def test_a_failed_resume_save_leaves_the_previous_point_and_no_temporary_file(tmp_path, monkeypatch):
    from llama_scratch.checkpoints import resume

    clf, opt, sched, s = resume_parts()
    path = tmp_path / "resume.safetensors"
    train.save_resume_point(path, clf, opt, sched, train.TrainState(step=1), s, {})
    before = path.read_bytes()

    def disk_full():
        raise OSError(errno.ENOSPC, "No space left on device")

    every_entry = resume.tensors_to_write

    def entries_until_the_disk_is_full(tensors):  # the header and the first tensors are written, then no space
        entries = every_entry(tensors)
        return [*entries[:2], entries[2]._replace(make=disk_full)]

    monkeypatch.setattr(resume, "tensors_to_write", entries_until_the_disk_is_full)
    with pytest.raises(OSError, match="No space"):
        train.save_resume_point(path, clf, opt, sched, train.TrainState(step=2), s, {})
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["resume.safetensors"]


def test_a_resume_point_from_another_model_is_refused_before_anything_is_copied(tmp_path):
    clf, opt, sched, s = resume_parts()
    path = tmp_path / "resume.safetensors"
    train.save_resume_point(path, clf, opt, sched, train.TrainState(), s, {})
    other = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), num_classes=3, train_last=1)
    opt2 = train.make_optimizer(other, s)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda step: 1.0)
    head = other.head.weight.detach().clone()
    with pytest.raises(weights.CheckpointError, match="wrong shapes: head.weight"):
        train.load_resume_point(path, other, opt2, sched2, s, {})
    assert torch.equal(other.head.weight, head)
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ResumeError, match="not a llama_scratch resume point"):
        train.load_resume_point(path, clf, opt, sched, s, {})


def test_a_mistyped_local_path_is_not_downloaded(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()

    def no_download(*args, **kwargs):
        raise AssertionError("a local path was taken for a repository id")

    monkeypatch.setattr("llama_scratch.sources.resolve.fetch", no_download)
    for ref in ("runs/my-model", "./my-model", "../my-model", "weights/a/b"):
        with pytest.raises(FileNotFoundError, match="no such file or directory"):
            sources.load_model(ref)
        assert not sources.is_repo_id(ref)
    assert sources.is_repo_id("meta-llama/Llama-3.2-1B")
    assert finetune_classifier.main(["--model", "runs/my-model", "--output", "o", "--max-steps", "1"]) == 2
    assert "runs/my-model: no such file or directory" in capsys.readouterr().err


DIVERGE_SCRIPT = textwrap.dedent(
    """
    import os
    import tempfile
    from pathlib import Path

    import torch
    import torch.nn.functional as F

    from llama_scratch import Llama, LlamaClassifier, LlamaConfig
    from llama_scratch.data.batching import TokenizedSplit
    from llama_scratch.parallel.strategy import choose_strategy, teardown
    from llama_scratch.training.loop import TrainingDiverged, TrainSettings, train

    strategy = choose_strategy("cpu")
    rank = strategy.processes.rank
    if rank == 1:  # from the third step on, rank 1's loss reads NaN while its gradients stay finite
        real, calls = F.cross_entropy, []

        def nan_loss(*args, **kwargs):
            calls.append(1)
            loss = real(*args, **kwargs)
            return loss + loss.detach() * float("nan") if len(calls) >= 3 else loss

        F.cross_entropy = nan_loss
    ids = [[1 + (i * 7 + j) % 100 for j in range(5 + i % 4)] for i in range(64)]
    split = TokenizedSplit(ids, [i % 2 for i in range(64)])
    torch.manual_seed(0)
    clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), num_classes=2, train_last=1)
    model = strategy.wrap(clf)
    settings = TrainSettings(epochs=1, batch_size=4, save_every=1000)
    try:
        with tempfile.TemporaryDirectory() as out:
            train(model, {"train": split, "val": split}, settings, strategy, Path(out), log=lambda *a: None)
    except TrainingDiverged as e:
        assert "step 3" in str(e), e
        os.write(1, f"rank {rank} ok\\n".encode())
    teardown()
    """
)


@pytest.mark.slow
def test_a_nan_on_one_process_stops_every_process(tmp_path):
    from tests.parallel.test_distributed import run_on_two_processes

    run_on_two_processes(DIVERGE_SCRIPT, tmp_path / "diverge.py", timeout=120)


@pytest.mark.slow
def test_the_classify_command_reports_a_bad_run_in_one_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "classifier.json").write_text("[1, 2]")
    save_file({"x": torch.zeros(1)}, run / "classifier.safetensors")
    r = subprocess.run(
        [sys.executable, "-m", "llama_scratch.classify", "--checkpoint", str(run), "hello"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.startswith("error:") and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_run_record_reads_back_as_written_and_names_a_bad_key(tmp_path):
    """classifier.json is written and read by run_record alone: a record reads back as it was written (its LoRA entry
    as LoRASettings plus blocks), and a key a run would not write is one line naming the file and the key."""
    import dataclasses

    from llama_scratch.checkpoints import run_record
    from llama_scratch.model.lora import LoRASettings

    run = tmp_path / "run"
    run.mkdir()
    record = run_record.new_record(
        model_ref="tiny",
        repo_id=None,
        out=run,
        from_scratch=False,
        config=LlamaConfig.from_name("tiny"),
        label_names=["ham", "spam"],
        train_last=2,
        lora=LoRASettings(4, targets=("v", "q")),
        lora_blocks=[2, 3],
        tokenizer="llama3",
        max_length=48,
        dtype=torch.bfloat16,
        settings=train.TrainSettings(lr=1e-3),
    )
    written = dataclasses.replace(record, run_id="r1")
    path = run_record.write_record(run, written)
    save_file({"x": torch.zeros(1)}, run / run_record.WEIGHTS_FILE, metadata={"run_id": "r1"})
    read = run_record.read_run(run)
    assert read == written and read.path == path and read.lora.settings == LoRASettings(4, 8.0, 0.0, ("q", "v"))
    assert read.lora.modules() == [f"blocks.{b}.attention.{p}_proj" for b in (2, 3) for p in "qv"]
    meta = json.loads(path.read_text())
    assert meta["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["q", "v"], "blocks": [2, 3]}
    assert list(meta) == ["version", *run_record.RECORD_KEYS] and meta["dtype"] == "bfloat16"
    assert meta["version"] == run_record.RECORD_VERSION and list(meta)[1] == "base_model"
    assert list(meta)[-5:] == ["settings", "run_id", "multi_label", "threshold", "pooling"]
    for key, value, says in (
        ("lora", {**meta["lora"], "blocks": "2,3"}, "unreadable lora entry (blocks is not a list of block numbers)"),
        ("lora", {**meta["lora"], "targets": ["q_proj"]}, "unreadable lora entry (LoRA targets are among"),
        ("lora", {**meta["lora"], "rank": 0}, "unreadable lora entry (the LoRA rank must be at least 1"),
        ("num_classes", 3, "num_classes/label_names not as a finished run writes them"),
        ("settings", [], "settings not as a finished run writes them"),
        ("pooling", "max", "pooling not as a finished run writes them"),
    ):
        path.write_text(json.dumps(meta | {key: value}))
        with pytest.raises(weights.CheckpointError) as e:
            run_record.read_run(run)
        assert str(e.value).startswith(f"{path}: {says}"), e.value
    path.unlink()
    (run / run_record.RUN_MARKER).write_text("")
    with pytest.raises(FileNotFoundError, match="holds an unfinished run: finish it with finetune_classifier --resume"):
        run_record.read_run(run)


@pytest.mark.slow
def test_a_file_with_100k_labels_is_refused_before_training(tmp_path, capsys):
    """Before: loaded, then a 100k x 100k confusion matrix (~75 GiB) after the first epoch was paid for."""
    import time

    data = tmp_path / "ids.csv"
    data.write_text("text,label\n" + "".join(f"message number {i},id-{i}\n" for i in range(100_000)))
    started = time.perf_counter()
    assert finetune_classifier.main(["--model", "tiny", "--data", str(data), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "100,000 distinct labels in 100,000 rows" in err and "--label-column" in err, err
    assert time.perf_counter() - started < 30 and not (tmp_path / "o").exists()


def test_a_resume_point_of_an_unfused_optimizer_resumes_with_this_runs_kernel(tmp_path):
    """A point saved by a version that stepped one tensor at a time on the CPU carries `fused: None` in its groups;
    the resumed run keeps its own (fused) kernel rather than the saved one."""
    clf, opt, sched, s = resume_parts()
    for group in opt.param_groups:
        group["fused"] = None  # as an older version saved it
    path = tmp_path / "resume.safetensors"
    train.save_resume_point(path, clf, opt, sched, train.TrainState(step=1), s, {})
    clf2, opt2, sched2, _ = resume_parts()
    train.load_resume_point(path, clf2, opt2, sched2, s, {})
    assert all(g["fused"] is True for g in opt2.param_groups)

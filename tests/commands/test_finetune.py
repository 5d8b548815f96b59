"""The main job end to end, as a user runs it: one process, two DDP processes, interrupted and resumed."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from llama_scratch import classify, finetune_classifier
from llama_scratch.checkpoints.resume import read_point
from llama_scratch.model.config import parse_dtype
from llama_scratch.sources import resolve as sources


def args_for(data: Path, out: Path, *extra: str) -> list[str]:
    common = ["--model", "tiny", "--data", str(data), "--split", "full", "--output", str(out), "--epochs", "2"]
    return common + ["--train-last", "2", "--lr", "1e-3", "--max-length", "48", *extra]


def one_thread() -> dict[str, str]:
    """The environment for a test's command, read when it starts: one thread a process (the two cores are shared)."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def finetune_command(*args: str, torchrun: int = 0) -> list[str]:
    """The command line of `python -m llama_scratch.finetune_classifier ARGS`, under torchrun with that many
    processes if `torchrun`."""
    # --standalone: a free port each time, so that runs on two pytest workers (`pytest -n 2`) do not collide
    torchrun_args = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
    return [sys.executable, *(torchrun_args if torchrun else []), "-m", "llama_scratch.finetune_classifier", *args]


def run_module(*args: str, torchrun: int = 0, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        finetune_command(*args, torchrun=torchrun), capture_output=True, text=True, env=one_thread(), **kwargs
    )


@pytest.mark.slow
def test_one_process_run_writes_results_and_classify_reads_them(small_csv, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert finetune_classifier.main(args_for(small_csv, out, "--batch-size", "8")) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("train_accuracy", "val_accuracy", "test_accuracy", "test_loss", "num_classes", "model", "seconds"):
        assert key in metrics
    assert metrics["num_classes"] == 2 and metrics["label_names"] == ["ham", "spam"]
    assert sum(map(sum, metrics["test_confusion"])) == metrics["split_sizes"]["test"]
    assert set(metrics["test_per_class"]) == {"ham", "spam"}
    history = (out / "history.csv").read_text().splitlines()
    assert history[0].startswith("epoch,step,train_loss") and len(history) == 3
    assert not (out / "resume.safetensors").exists(), "a finished run leaves no resume point behind"
    assert not (out / "best.safetensors").exists()

    capsys.readouterr()
    assert classify.main(["--checkpoint", str(out), "WINNER! Claim your free prize now", "see you at lunch"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(line.split("\t")[0] in ("ham", "spam") for line in lines)

    # Where the device would run bfloat16 by default (a GPU; faked here), a model trained in float32 is run in
    # float32 (the precision its reported accuracy was measured in) unless asked otherwise.
    as_on_a_gpu = lambda name, device, *a, **k: torch.bfloat16 if name == "auto" else parse_dtype(name)  # noqa: E731
    monkeypatch.setattr(classify, "choose_dtype", as_on_a_gpu)
    assert classify.load_classifier(out)[0].head.weight.dtype == torch.float32
    assert classify.load_classifier(out, dtype="bfloat16")[0].head.weight.dtype == torch.bfloat16


def test_saves_only_trained_parameters_for_a_pretrained_backbone(small_csv, tmp_path):
    from llama_scratch import Llama, LlamaConfig
    from llama_scratch.checkpoints.weights import save_checkpoint

    cfg = LlamaConfig.from_name("tiny")
    base = tmp_path / "base"
    save_checkpoint(Llama(cfg), cfg, base)
    out = tmp_path / "run"
    argv = ["--model", str(base), "--data", str(small_csv), "--output", str(out), "--max-steps", "2"]
    assert finetune_classifier.main(argv + ["--batch-size", "8", "--train-last", "1"]) == 0
    saved = load_file(out / "classifier.safetensors")
    assert set(saved) == {"head.weight", "backbone.final_norm.weight"} | {
        f"backbone.blocks.3.{n}" for n, _ in Llama(cfg).blocks[3].named_parameters()
    }
    meta = json.loads((out / "classifier.json").read_text())
    assert meta["base_model"] == str(base.resolve()) and not meta["weights_include_backbone"]


@pytest.mark.slow
def test_ddp_two_processes_equal_one_process(small_csv, tmp_path):
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    one = run_module(*args_for(small_csv, single, "--batch-size", "8"))
    assert one.returncode == 0, one.stderr
    two = run_module(*args_for(small_csv, ddp, "--batch-size", "4"), torchrun=2)
    assert two.returncode == 0, two.stderr
    a, b = load_file(single / "classifier.safetensors"), load_file(ddp / "classifier.safetensors")
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (single, ddp))
    assert mb["world_size"] == 2
    for key in ("train_accuracy", "val_accuracy", "test_accuracy", "test_confusion", "test_macro_f1", "steps"):
        assert ma[key] == mb[key], key
    # Each process's probabilities in its own stretch, summed: the ranking is the whole test split's.
    assert abs(ma["test_roc_auc"] - mb["test_roc_auc"]) < 1e-9
    assert abs(ma["test_loss"] - mb["test_loss"]) < 1e-5


def test_batch_tokens_trains_plans_and_classifies_as_a_user_types_it(small_csv, tmp_path, capsys):
    """`--batch-tokens 400` end to end: micro-batches by a token budget (fewer, larger steps than 8 rows), the
    run's files, the setting in classifier.json, classify on the result; `--plan` counts the budget."""
    out = tmp_path / "run"
    assert finetune_classifier.main(args_for(small_csv, out, "--batch-tokens", "400", "--min-steps", "0")) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    texts = metrics["split_sizes"]["train"]
    # 80 texts of up to 48 tokens, about 2,000 in all: a handful of steps an epoch, not 80 / 8 = 10.
    assert 2 <= metrics["steps"] < 2 * texts // 8
    meta = json.loads((out / "classifier.json").read_text())
    assert meta["settings"]["batch_tokens"] == 400
    capsys.readouterr()
    assert classify.main(["--checkpoint", str(out), "WINNER! Claim your free prize now"]) == 0
    assert capsys.readouterr().out.split("\t")[0] in ("ham", "spam")

    plan = ["--model", "llama3-8b", "--plan", "--max-length", "512"]
    assert finetune_classifier.main([*plan, "--batch-size", "16"]) == 0
    rows = capsys.readouterr().out
    assert finetune_classifier.main([*plan, "--batch-tokens", "8192"]) == 0
    budget = capsys.readouterr().out
    assert "batch 16 x 512 tokens" in rows and "--batch-tokens 8192" in budget
    assert "batch 8,192 tokens packed (16 texts of up to 512 inside attention)" in budget
    with pytest.raises(SystemExit) as refused:  # refused while parsing, in one line, as any bad flag's value
        finetune_classifier.main(args_for(small_csv, tmp_path / "bad", "--batch-tokens", "0"))
    assert refused.value.code == 2
    assert "argument --batch-tokens: expected a positive whole number, got '0'" in capsys.readouterr().err


@pytest.mark.slow
def test_batch_tokens_on_two_processes_equals_accumulation_on_one(small_csv, tmp_path):
    """Two DDP processes each take every other micro-batch of one list; one process accumulating two micro-batches
    a step takes the same pairs: the same steps, the same weights (each micro-batch's loss counts its rows). Under
    --pooling mean, so that DDP is also shown with the head reading every token's mean."""
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    one = run_module(*args_for(small_csv, single, "--batch-tokens", "300", "--grad-accum", "2", "--pooling", "mean"))
    assert one.returncode == 0, one.stderr
    two = run_module(*args_for(small_csv, ddp, "--batch-tokens", "300", "--pooling", "mean"), torchrun=2)
    assert two.returncode == 0, two.stderr
    a, b = load_file(single / "classifier.safetensors"), load_file(ddp / "classifier.safetensors")
    # float32, a few steps: the two sum the same terms in another order (all-reduce against accumulation).
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (single, ddp))
    assert ma["steps"] == mb["steps"] and ma["test_confusion"] == mb["test_confusion"]


@pytest.mark.slow
def test_resume_after_kill_equals_uninterrupted_run(small_csv, tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    # Both runs in subprocesses with the same thread count, so every reduction sums in the same order.
    uninterrupted = run_module(*args_for(small_csv, full, "--batch-size", "4", "--save-every", "1"))
    assert uninterrupted.returncode == 0, uninterrupted.stderr

    argv = args_for(small_csv, killed, "--batch-size", "4", "--save-every", "1")
    proc = subprocess.Popen(finetune_command(*argv), env=one_thread())
    deadline = time.time() + 120
    while not (killed / "resume.safetensors").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.3)  # let it get a few steps further than the first save
    proc.kill()
    proc.wait()
    assert (killed / "resume.safetensors").exists(), "the run should have been killed before it finished"
    assert not (killed / "metrics.json").exists()

    again = run_module(*argv)
    assert again.returncode == 2 and "--resume" in again.stderr, "an unfinished run is not silently overwritten"
    resumed = run_module(*argv, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    a, b = load_file(full / "classifier.safetensors"), load_file(killed / "classifier.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    # The running train figures of the epoch that was cut cover all of its batches, not only those after the resume.
    assert (full / "history.csv").read_text() == (killed / "history.csv").read_text()
    assert json.loads((full / "metrics.json").read_text())["test_loss"] == pytest.approx(
        json.loads((killed / "metrics.json").read_text())["test_loss"], abs=1e-6
    )


@pytest.mark.slow
def test_ctrl_c_saves_a_resume_point(small_csv, tmp_path):
    out = tmp_path / "run"
    argv = args_for(small_csv, out, "--batch-size", "2", "--save-every", "1000", "--epochs", "200")
    proc = subprocess.Popen(finetune_command(*argv), env=one_thread(), stderr=subprocess.PIPE, text=True)
    # Training has started once the first epoch's evaluation has saved a point (in a log, progress bars write a
    # line only when one ends); 200 epochs leave it far from its end when the signal comes.
    deadline = time.time() + 120
    while not (out / "resume.safetensors").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    # Saving the point and leaving takes 1.5-4 s on a quiet host; CI's, with a notebook's training beside it on
    # two cores, once took over 60 s. A hang would still fail here, later.
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 130
    assert (out / "resume.safetensors").exists()
    assert read_point(out / "resume.safetensors")["state"]["step"] >= 1


@pytest.mark.slow
def test_bad_data_gives_a_clear_error(tmp_path):
    missing = tmp_path / "nope.csv"
    assert finetune_classifier.main(["--model", "tiny", "--data", str(missing), "--output", str(tmp_path)]) == 2
    one_class = tmp_path / "one.csv"
    one_class.write_text("text,label\n" + "".join(f"message {i},ham\n" for i in range(20)))
    r = run_module("--model", "tiny", "--data", str(one_class), "--output", str(tmp_path / "o"))
    assert r.returncode == 2 and "one.csv" in r.stderr and "class" in r.stderr


def test_float16_training_is_refused_in_one_line(small_csv, tmp_path, capsys):
    """float16 without loss scaling underflows small gradients to zero: refused before anything loads or is written,
    naming the flag and what to use instead."""
    out = tmp_path / "o"
    assert finetune_classifier.main(args_for(small_csv, out, "--dtype", "float16")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--dtype float16 cannot train" in err and "--dtype bfloat16" in err
    assert not out.exists()


@pytest.mark.slow
def test_too_little_data_for_the_processes_is_an_error(small_csv, tmp_path):
    r = run_module(*args_for(small_csv, tmp_path / "o", "--batch-size", "128"))
    assert r.returncode == 2 and "fewer than one step needs" in r.stderr


@pytest.mark.slow
def test_diverging_loss_stops_with_a_message(small_csv, tmp_path):
    r = run_module(*args_for(small_csv, tmp_path / "o", "--batch-size", "8", "--lr", "1e30", "--clip-grad", "0"))
    assert r.returncode == 2 and "loss became" in r.stderr


@pytest.mark.slow
def test_cached_frozen_prefix_trains_the_same_weights(small_csv, tmp_path):
    runs = {}
    for choice in ("on", "off"):
        out = tmp_path / choice
        argv = args_for(small_csv, out, "--batch-size", "8", "--cache-frozen", choice)
        assert finetune_classifier.main(argv) == 0
        runs[choice] = (load_file(out / "classifier.safetensors"), json.loads((out / "metrics.json").read_text()))
    (a, ma), (b, mb) = runs["on"], runs["off"]
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    assert ma["test_confusion"] == mb["test_confusion"]
    assert ma["test_loss"] == pytest.approx(mb["test_loss"], abs=1e-5)


def test_bad_train_last_is_a_clear_error(small_csv, tmp_path):
    argv = ["--model", "tiny", "--data", str(small_csv), "--output", str(tmp_path / "o"), "--train-last", "two"]
    assert finetune_classifier.main(argv) == 2


def resume_parts():
    """A tiny classifier with the optimizer, schedule and settings that a resume point saves."""
    from llama_scratch import Llama, LlamaClassifier, LlamaConfig
    from llama_scratch.training.loop import TrainSettings, make_optimizer

    clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), train_last=1)
    s = TrainSettings()
    opt = make_optimizer(clf, s)
    return clf, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0), s


def test_resume_refuses_another_world_size_or_model(tmp_path):
    from llama_scratch.training.loop import TrainState, load_resume_point, save_resume_point

    clf, opt, sched, s = resume_parts()
    path = tmp_path / "resume.safetensors"
    save_resume_point(path, clf, opt, sched, TrainState(), s, {"world_size": 4, "model": "a"})
    with pytest.raises(ValueError, match="the number of processes was 4, now 2"):
        load_resume_point(path, clf, opt, sched, s, {"world_size": 2, "model": "a"})
    with pytest.raises(ValueError, match="--model was 'a', now 'b'"):
        load_resume_point(path, clf, opt, sched, s, {"world_size": 4, "model": "b"})
    assert load_resume_point(path, clf, opt, sched, s, {"world_size": 4, "model": "a"}).step == 0


def test_a_resume_point_from_before_row_sums_still_loads(tmp_path):
    """Resume points written before TrainState.row_sums existed lack that key; they resume with the sums at zero."""
    from llama_scratch.training.loop import TrainState, load_resume_point, save_resume_point

    clf, opt, sched, s = resume_parts()
    path = tmp_path / "resume.safetensors"
    save_resume_point(path, clf, opt, sched, TrainState(step=7, batches_done=3), s, {"model": "a"})
    tensors, record = load_file(path), json.loads(safe_open(path, "pt").metadata()["llama_scratch"])
    del record["state"]["row_sums"]
    save_file(tensors, path, metadata={"llama_scratch": json.dumps(record)})
    state = load_resume_point(path, clf, opt, sched, s, {"model": "a"})
    assert (state.step, state.batches_done, state.row_sums) == (7, 3, [0.0, 0.0, 0.0])


def test_a_repo_id_is_told_apart_from_presets_and_paths(tmp_path):
    assert sources.is_repo_id("HuggingFaceTB/SmolLM2-360M")
    assert not sources.is_repo_id("tiny")
    assert not sources.is_repo_id(str(tmp_path))


def test_free_memory_without_proc_meminfo_falls_back(monkeypatch):
    """macOS has neither /proc/meminfo nor SC_AVPHYS_PAGES: the cache's room is then the budget alone."""
    import os

    from llama_scratch.sources import devices

    def no_file(self, *a, **k):
        raise FileNotFoundError(self)

    real_sysconf = os.sysconf

    def sysconf(name):
        if name == "SC_AVPHYS_PAGES":
            raise ValueError("unrecognized configuration name")
        return real_sysconf(name)

    monkeypatch.setattr(devices.Path, "read_text", no_file)
    monkeypatch.setattr(devices.os, "sysconf", sysconf)
    cpu = torch.device("cpu")
    assert devices.free_memory(cpu) == devices.memory_budget(cpu, fraction=1.0) > 0


@pytest.mark.slow
def test_ctrl_c_while_caching_keeps_the_flags_and_a_bare_resume_continues(small_csv, tmp_path, monkeypatch, capsys):
    """Ctrl-C before the first step (here while the frozen layers are cached) says so and keeps the run's folder
    with its flags; then `--resume` alone, as the message and docs/finetuning.md say, trains the same weights as a
    run that was never interrupted."""
    argv = [
        "--model",
        "tiny",
        "--data",
        str(small_csv),
        "--split",
        "full",
        "--epochs",
        "2",
        "--train-last",
        "1",
        "--lr",
        "1e-3",
        "--max-length",
        "48",
        "--batch-size",
        "8",
        "--cache-frozen",
        "on",
    ]
    assert finetune_classifier.main([*argv, "--output", str(tmp_path / "whole")]) == 0
    monkeypatch.chdir(tmp_path)  # the default output goes to runs/ here
    with monkeypatch.context() as m:
        m.setattr(finetune_classifier, "cache_splits", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
        capsys.readouterr()
        assert finetune_classifier.main(argv) == 130
    err = capsys.readouterr().err
    run = (tmp_path / "runs" / "latest").resolve()
    assert "while running the frozen layers once per text" in err and "nothing was trained yet" in err
    assert f"--resume --output runs/{run.name}" in err
    assert (run / "run_flags.json").is_file() and not (run / "resume.safetensors").exists()

    assert finetune_classifier.main(["--resume"]) == 0  # runs/latest, with the flags it was started with
    a, b = load_file(tmp_path / "whole" / "classifier.safetensors"), load_file(run / "classifier.safetensors")
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    assert not (run / "run_flags.json").exists(), "a finished run keeps only its results"


@pytest.mark.slow
def test_resume_refuses_other_flags_or_data_before_loading_anything(small_csv, tmp_path, monkeypatch, capsys):
    """A run interrupted mid-training, resumed with a flag typed differently or with its data file changed, is
    refused in one line before the weights load (it used to read, load and cache first, then refuse)."""
    data = tmp_path / "data.csv"
    data.write_bytes(small_csv.read_bytes())
    out = tmp_path / "run"
    argv = args_for(data, out, "--batch-size", "4", "--epochs", "3")
    calls = []

    def interrupt_on_the_third_step(totals, *rest):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr("llama_scratch.training.loop.check_finite", interrupt_on_the_third_step)
        assert finetune_classifier.main(argv) == 130
    assert "continue with: python -m llama_scratch.finetune_classifier --resume --output" in capsys.readouterr().err
    assert read_point(out / "resume.safetensors")["state"]["step"] == 2

    monkeypatch.setattr(finetune_classifier, "build_classifier", lambda *a: pytest.fail("loaded before refusing"))
    assert finetune_classifier.main(["--resume", "--output", str(out), "--lr", "5e-4"]) == 2
    err = capsys.readouterr().err
    assert "--lr was 0.001, now 0.0005" in err and len(err.strip().splitlines()) == 1
    assert finetune_classifier.main(["--resume", "--output", str(out), "--pooling", "mean"]) == 2
    err = capsys.readouterr().err  # what the head reads is what the weights were trained for
    assert "--pooling was 'last', now 'mean'" in err and len(err.strip().splitlines()) == 1
    data.write_text(data.read_text().replace("ham", "spam", 3))
    assert finetune_classifier.main(["--resume", "--output", str(out)]) == 2
    assert "the data (texts or labels) was" in capsys.readouterr().err


def test_the_kept_epoch_is_said_and_marked():
    from llama_scratch.training.evaluation import kept_row

    rows = [
        {"epoch": e, "step": 4 * e, "val_accuracy": acc, "val_loss": 0.1, "val_macro_f1": acc - 0.1}
        for e, acc in ((1, 0.9), (2, 0.95), (3, 0.93))
    ]
    said = kept_row(rows, 8, "accuracy")
    assert said.startswith("keeping epoch 2's weights, not epoch 3's (the best validation accuracy, 95.00%")
    assert kept_row(rows[:1] + rows[2:], 12, "accuracy").startswith("keeping the last epoch's weights (epoch 3")
    assert "the best validation macro-F1, 0.8500" in kept_row(rows, 8, "macro_f1")

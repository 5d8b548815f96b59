"""Several processes on machines that do not share a disk, and a stop asked of one process only (issue 29):
simulated with two CPU processes (gloo), where rank 1's view of the output folder is another, empty folder."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from llama_scratch.checkpoints.resume import read_point
from tests.commands.test_finetune import finetune_command, one_thread, run_module
from tests.parallel.test_distributed import run_on_two_processes
from tests.parallel.test_sharding import args_for, checkpoint  # noqa: F401 -- the fixture, shared

# Every test here starts two processes under torchrun: the `slow` tier (tests/README.md).
pytestmark = pytest.mark.slow

COMMON = """
import os
from pathlib import Path

import torch

from llama_scratch import Llama, LlamaClassifier, LlamaConfig
from llama_scratch.checkpoints.resume import ResumeError
from llama_scratch.data.batching import TokenizedSplit
from llama_scratch.parallel.strategy import choose_strategy, teardown
from llama_scratch.training import loop
from llama_scratch.training.loop import TrainSettings, train

ROOT = Path(ROOT_DIR)
ids = [[1 + (i * 7 + j) % 100 for j in range(5 + i % 4)] for i in range(48)]
splits = {"train": TokenizedSplit(ids, [i % 2 for i in range(48)]), "val": TokenizedSplit(ids[:8], [0, 1] * 4)}
quiet = lambda *a: None  # noqa: E731


def disk(name: str) -> Path:
    # Each rank's own disk: rank 1 never sees what rank 0 writes, as on two machines without a shared one.
    return ROOT / f"rank{rank}" / name
"""

REPLICATED_SCRIPT = (
    COMMON
    + """
strategy = choose_strategy("cpu")
rank = strategy.processes.rank
settings = TrainSettings(epochs=2, batch_size=4, save_every=1000, lr=1e-3)


def run(out: Path, resume: bool = False):
    torch.manual_seed(0)
    clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), num_classes=2, train_last=1)
    state = train(strategy.wrap(clf), splits, settings, strategy, out, resume, log=quiet)
    return state, {k: v.clone() for k, v in clf.trainable_parameters().items()}


whole, whole_weights = run(disk("whole"))
real_step, calls = loop.train_step, []


def stopping_step(*args, **kwargs):
    calls.append(1)
    if rank == 1 and len(calls) == 3:  # a SIGTERM reaching rank 1 alone, mid-step
        os.kill(os.getpid(), signal.SIGTERM)
    return real_step(*args, **kwargs)


import signal

loop.train_step = stopping_step
try:
    run(disk("cut"))
    raise AssertionError("the run should have stopped")
except KeyboardInterrupt:
    pass
loop.train_step = real_step
assert len(calls) == 3, calls  # both stopped at the end of step 3, together
assert disk("cut").joinpath("resume.safetensors").exists() == (rank == 0)
resumed, resumed_weights = run(disk("cut"), resume=True)  # rank 1 gets the point from rank 0
assert resumed.history == whole.history
assert all(torch.equal(whole_weights[k], resumed_weights[k]) for k in whole_weights)

# A disk both see: each reads the point from it, and nothing is sent (a point of several GB would cross the network).
calls.clear()
loop.train_step = stopping_step
try:
    run(ROOT / "shared")
    raise AssertionError("the run should have stopped")
except KeyboardInterrupt:
    pass
loop.train_step = real_step
from llama_scratch.parallel import distributed

distributed.broadcast_tensors = lambda tensors: (_ for _ in ()).throw(AssertionError("a point both see was sent"))
resumed, resumed_weights = run(ROOT / "shared", resume=True)
assert resumed.history == whole.history
assert all(torch.equal(whole_weights[k], resumed_weights[k]) for k in whole_weights)
os.write(1, f"rank {rank} ok\\n".encode())
teardown()
"""
)


def test_replicated_resume_with_or_without_a_shared_disk_equals_an_uninterrupted_run(tmp_path):
    script = REPLICATED_SCRIPT.replace("ROOT_DIR", repr(str(tmp_path)))
    run_on_two_processes(script, tmp_path / "replicated.py", timeout=300)


SHARDED_SCRIPT = (
    COMMON
    + """
strategy = choose_strategy("cpu", shard=True)
rank = strategy.processes.rank
settings = TrainSettings(epochs=1, batch_size=4, save_every=2, max_steps=3, lr=1e-3)


def run(out: Path, resume: bool = False):
    torch.manual_seed(0)
    clf = strategy.build_classifier("tiny", torch.float32, 2, 1, None)
    return train(clf, splits, settings, strategy, out, resume, log=quiet)


def refusal(out: Path, resume: bool) -> str:
    try:
        run(out, resume)
    except ResumeError as e:
        return str(e)
    raise AssertionError("not refused")


# Saving: rank 0 finds rank 1's part missing, and both refuse in the one line.
said = refusal(disk("apart"), resume=False)
assert "lacks 1 of the 2 processes' parts" in said and "a disk that every machine sees" in said, said
with open(ROOT / f"saving{rank}.txt", "w") as f:
    f.write(said.replace(str(disk("apart")), "OUT"))
# Resuming: a point on a shared disk (max_steps ends the run with it saved), which rank 1 then does not see.
run(ROOT / "shared")
out = ROOT / "shared" if rank == 0 else disk("empty")
said = refusal(out, resume=True)
assert "1 of 2 processes found their part" in said and "a disk that every machine sees" in said, said
with open(ROOT / f"resuming{rank}.txt", "w") as f:
    f.write(said.replace(str(out), "OUT"))  # the same path on two machines; two here
os.write(1, f"rank {rank} ok\\n".encode())
teardown()
"""
)


def test_sharded_runs_without_a_shared_disk_refuse_alike_on_every_process(tmp_path):
    script = SHARDED_SCRIPT.replace("ROOT_DIR", repr(str(tmp_path)))
    run_on_two_processes(script, tmp_path / "sharded.py", timeout=300)
    for what in ("saving", "resuming"):
        lines = [(tmp_path / f"{what}{r}.txt").read_text() for r in (0, 1)]
        assert lines[0] == lines[1] and "\n" not in lines[0], lines


def worker_pid(out: Path, local_rank: int) -> int | None:
    """The pid of torchrun's worker of `local_rank` in the run whose command line names `out`."""
    for entry in Path("/proc").iterdir():
        try:
            ours = entry.name.isdigit() and str(out) in (entry / "cmdline").read_bytes().decode(errors="replace")
            if ours and f"LOCAL_RANK={local_rank}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                return int(entry.name)
        except OSError:
            pass
    return None


def test_sigterm_to_one_sharded_process_stops_both_at_one_step_and_resumes(checkpoint, small_csv, tmp_path):  # noqa: F811
    full, cut = tmp_path / "full", tmp_path / "cut"
    common = ("--train-last", "2", "--batch-size", "4", "--save-every", "1000", "--epochs", "3", "--shard")
    argv = args_for(checkpoint, small_csv, cut, *common)
    launch = finetune_command(*argv, torchrun=2)
    with (tmp_path / "stdout.txt").open("w") as stdout, (tmp_path / "stderr.txt").open("w") as stderr:
        proc = subprocess.Popen(launch, env=one_thread(), start_new_session=True, stdout=stdout, stderr=stderr)
        deadline = time.time() + 240
        while not (cut / "resume.sharded" / "current").exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)  # until epoch 1's end is saved: the signal comes in epoch 2
        rank1 = worker_pid(cut, 1)
        assert rank1 is not None and proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
        os.kill(rank1, signal.SIGTERM)  # rank 1 alone, as a scheduler's or a user's kill of one process
        try:
            proc.wait(timeout=120)  # before: rank 1 saved alone through collectives rank 0 never joined
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("the run hung after SIGTERM reached one process") from None
    out_text = (tmp_path / "stdout.txt").read_text()
    assert proc.returncode != 0 and "interrupted at step" in out_text, out_text[-2000:]
    assert not (cut / "metrics.json").exists(), "the run should have stopped before it finished"
    point = cut / "resume.sharded" / (cut / "resume.sharded" / "current").read_text().strip()
    assert point.name != "point-00000001", "both processes saved a newer point than epoch 1's"
    steps = [read_point(point / f"rank-0000{r}-of-00002.safetensors", tensors=False)["state"]["step"] for r in (0, 1)]
    assert steps[0] == steps[1] and f"interrupted at step {steps[0]}" in out_text, (steps, out_text[-2000:])

    resumed = run_module(*argv, "--resume", torchrun=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step {steps[0]}" in resumed.stdout and "resuming from" in resumed.stdout
    uninterrupted = run_module(*args_for(checkpoint, small_csv, full, *common), torchrun=2)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    a, b = (load_file(d / "classifier.safetensors") for d in (full, cut))
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (full, cut))
    assert ma["steps"] == mb["steps"] and ma["test_accuracy"] == mb["test_accuracy"]


# --- a scheduler's SIGTERM reaches torchrun and every worker: the stop vote must still save --------------------------

SLOW_TRAINING = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    from llama_scratch import Llama, LlamaClassifier, LlamaConfig
    from llama_scratch.data.batching import TokenizedSplit
    from llama_scratch.parallel.strategy import choose_strategy, teardown
    from llama_scratch.training import loop
    from llama_scratch.training.interrupts import sigterm_as_ctrl_c
    from llama_scratch.training.loop import TrainSettings, train

    OUT = Path(sys.argv[1])
    sigterm_as_ctrl_c()  # as finetune_classifier.main does
    strategy = choose_strategy("cpu")
    rank = strategy.processes.rank
    ids = [[1 + (i * 7 + j) % 100 for j in range(5 + i % 4)] for i in range(400)]
    splits = {"train": TokenizedSplit(ids, [i % 2 for i in range(400)]), "val": TokenizedSplit(ids[:8], [0, 1] * 4)}
    real, calls = loop.train_step, []

    def slow_step(*args, **kwargs):  # from the third step on, a step of 2 s: an 8B step's order of time
        calls.append(1)
        if len(calls) == 3:
            (OUT / f"stepping{rank}").touch()
        time.sleep(2.0 if len(calls) >= 3 else 0)
        return real(*args, **kwargs)

    loop.train_step = slow_step
    torch.manual_seed(0)
    clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), num_classes=2, train_last=1)
    settings = TrainSettings(epochs=1, batch_size=2, save_every=1000, lr=1e-3)
    try:
        train(strategy.wrap(clf), splits, settings, strategy, OUT / "run", log=lambda *a: print(*a, flush=True))
    finally:
        teardown()
    """
)


def test_a_schedulers_sigterm_to_every_process_still_saves_a_resume_point(tmp_path):
    """slurmstepd (a time limit, scancel, preemption) sends SIGTERM to every process of the job step: torchrun and
    its workers alike (they are in the step's cgroup; torchrun's new session does not take them out). torchrun then
    forwards its own SIGTERM to the workers, so each worker gets two within one step. Every process must still
    save (found by review, 2026-11-26: a second SIGTERM used to mean "stop at once, without saving", so none did)."""
    script = tmp_path / "slow.py"
    script.write_text(SLOW_TRAINING)
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(script),
        str(tmp_path),
    ]
    with (tmp_path / "stdout").open("w") as out, (tmp_path / "stderr").open("w") as err:
        proc = subprocess.Popen(launch, env=one_thread(), stdout=out, stderr=err, start_new_session=True)
        deadline = time.time() + 120
        while not all((tmp_path / f"stepping{r}").exists() for r in (0, 1)) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # inside step 3 on both
        found = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        workers = [int(pid) for pid in found]
        assert len(workers) == 2 and proc.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
        for pid in (proc.pid, *workers):  # what slurmstepd does
            os.kill(pid, signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("hung") from None
    printed = (tmp_path / "stdout").read_text()
    assert (tmp_path / "run" / "resume.safetensors").exists(), printed[-2000:]
    assert "interrupted at step" in printed and "without saving" not in printed, printed[-2000:]

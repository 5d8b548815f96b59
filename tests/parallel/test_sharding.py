"""--shard (FSDP2) end to end, as a user runs it: two CPU processes (gloo) against one, the sharded load's memory,
and a sharded run killed and resumed."""

import dataclasses
import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llama_scratch.checkpoints.weights import save_checkpoint
from llama_scratch.model.config import LlamaConfig
from llama_scratch.model.llama import Llama
from tests.commands.test_finetune import finetune_command, one_thread, run_module
from tests.parallel.test_distributed import run_on_two_processes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A pretrained-looking float32 `tiny` checkpoint (random weights, saved as a user's directory would be), with
    an untied next-token projection as Llama-3-8B and 70B have (sharded in its own group; the tied case is the
    load test's and chapter 9's)."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    torch.manual_seed(1)
    cfg = dataclasses.replace(LlamaConfig.from_name("tiny"), tie_embeddings=False)
    save_checkpoint(Llama(cfg), cfg, path)
    return path


def assert_rounding_apart(a: dict, b: dict, steps: int, lr: float, dtype: torch.dtype = torch.float32) -> None:
    """Two runs' trained weights (`a`, `b`: name -> tensor) that differ only in the order of `dtype` sums, after
    `steps` AdamW steps at a peak learning rate `lr`.

    Where the order differs: MKL's sgemm chooses its kernel by the number of rows in a call, so a text's frozen
    states, computed in one batch or in another, differ in their last bits; and two processes' gradients summed
    each over its rows, then together, round otherwise than one sum over all the rows. Each step, a gradient
    element then differs by a few roundings of the terms it sums (eps relative to them). Adam divides it by its
    own RMS (m / sqrt(v)), so the difference counts relative to the element itself:
    - an element well above its rounding (almost every one) moves alike in both runs, its update differing by
      about eps times the terms' size over its own: within steps x lr x sqrt(eps) even where it cancels to a
      sqrt(eps)-th of its terms. Checked on 99.9% of the elements, which a systematic difference (another cache,
      another loss) would move by far more;
    - an element whose gradient is rounding noise in both runs moves as noise: by at most Adam's largest step, lr
      (Kingma & Ba's bound, for (1 - beta1) <= sqrt(1 - beta2): our betas are 0.9 and 0.95), each step, either
      way; decoupled weight decay only shrinks a difference. So no element is more than 2 x steps x lr apart.
    """
    assert a.keys() == b.keys()
    apart = torch.cat([(a[k].double() - b[k].double()).abs().flatten() for k in a])
    bulk = apart.kthvalue(math.ceil(0.999 * apart.numel())).values.item()
    assert bulk <= steps * lr * math.sqrt(torch.finfo(dtype).eps), (bulk, steps)
    assert apart.max().item() <= 2 * steps * lr, (apart.max().item(), steps)


def args_for(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--data",
        str(data),
        "--split",
        "full",
        "--output",
        str(out),
        "--epochs",
        "2",
        "--lr",
        "1e-3",
        "--max-length",
        "48",
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe",
    [
        ["--train-last", "all"],
        ["--train-last", "2"],
        ["--train-last", "2", "--lora", "4"],
        ["--train-last", "all", "--shard-group", "1"],  # hybrid: 2 replicas of 1 shard (the 2-D mesh)
    ],
    ids=str,
)
def test_two_sharded_processes_equal_one_process(checkpoint, small_csv, tmp_path, recipe):
    one_recipe = [a for a in recipe if a not in ("--shard-group", "1")]
    one = run_module(*args_for(checkpoint, small_csv, tmp_path / "one", *one_recipe, "--batch-size", "8"))
    two = run_module(
        *args_for(checkpoint, small_csv, tmp_path / "two", *recipe, "--batch-size", "4", "--shard"), torchrun=2
    )
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    assert "sharded across 2 processes" in two.stdout
    a, b = (load_file(tmp_path / d / "classifier.safetensors") for d in ("one", "two"))
    ma, mb = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("one", "two"))
    assert_rounding_apart(a, b, ma["steps"], lr=1e-3)
    for key in ("train_accuracy", "val_accuracy", "test_accuracy", "test_confusion", "steps", "trainable_parameters"):
        assert ma[key] == mb[key], key
    assert abs(ma["test_loss"] - mb["test_loss"]) < 1e-5


LOAD_SCRIPT = """
import dataclasses, sys, torch
from pathlib import Path
from llama_scratch.parallel import sharding
from llama_scratch.parallel.strategy import choose_strategy, teardown

def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

strategy = choose_strategy("cpu", shard=True)
rank = strategy.processes.rank
ckpt, small = sys.argv[1], SMALL
# The first use of every code path (meta device, FSDP, the reader) costs tens of MB of Python and torch state,
# whatever the checkpoint: paid here, on a small one, before the peak is measured.
strategy.build_classifier(small, torch.float32, 2, None, None)
Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
before = rss()
clf = strategy.build_classifier(ckpt, torch.float32, 2, None, None)
grown = peak_rss() - before
mine = sharding.resident_bytes(clf)
full = sum(p.numel() * p.element_size() for p in clf.parameters())
largest = max(p.numel() * p.element_size() for p in clf.parameters())
print(f"rank {rank}: holds {mine} of {full} bytes, largest tensor {largest}, load peak +{grown}")
assert abs(mine - full / 2) <= largest, (mine, full)
assert grown <= full / 2 + largest + 8 * 2**20, (grown, full)
print(f"rank {rank} ok")
teardown()
"""


@pytest.mark.slow
def test_sharded_load_holds_half_per_process(tmp_path):
    """12 blocks of many tensors: each of two processes holds half the bytes (+/- one tensor), and its memory grows
    by about that much while loading, not by the whole checkpoint."""
    cfg = LlamaConfig(
        vocab_size=512,
        dim=256,
        n_layers=12,
        n_heads=4,
        n_kv_heads=2,
        head_dim=64,
        ffn_dim=768,
        max_seq_len=128,
        tie_embeddings=True,
        dtype=torch.float32,
    )
    save_checkpoint(Llama(cfg), cfg, tmp_path / "ckpt")  # 38 MB
    small = dataclasses.replace(cfg, n_layers=1, dim=64, n_heads=2, n_kv_heads=1, head_dim=32, ffn_dim=128)
    save_checkpoint(Llama(small), small, tmp_path / "small")
    script = LOAD_SCRIPT.replace("sys.argv[1]", repr(str(tmp_path / "ckpt"))).replace(
        "SMALL", repr(str(tmp_path / "small"))
    )
    run_on_two_processes(script, tmp_path / "load.py")


def kill_every_process_of(out: Path) -> None:
    """SIGKILL every process whose command line names `out` (torchrun starts its workers in their own sessions)."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(out) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


@pytest.mark.slow
def test_sharded_run_killed_mid_epoch_resumes_to_the_same_weights(checkpoint, small_csv, tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    common = ("--train-last", "2", "--batch-size", "4", "--save-every", "1", "--shard")
    uninterrupted = run_module(*args_for(checkpoint, small_csv, full, *common), torchrun=2)
    assert uninterrupted.returncode == 0, uninterrupted.stderr

    argv = args_for(checkpoint, small_csv, killed, *common)
    launch = finetune_command(*argv, torchrun=2)
    proc = subprocess.Popen(
        launch, env=one_thread(), start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 120
    while not (killed / "resume.sharded" / "current").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.5)  # a few steps further than the first save
    kill_every_process_of(killed)  # torchrun and both workers at once, as when a node is lost
    proc.wait()
    point = killed / "resume.sharded" / (killed / "resume.sharded" / "current").read_text().strip()
    parts = sorted(p.name for p in point.iterdir())
    assert parts == ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
    assert not (killed / "metrics.json").exists(), "the run should have been killed before it finished"
    # A kill during a save leaves a newer point holding a part's temporary (whether this kill did depends on timing).
    cut = killed / "resume.sharded" / f"point-{int(point.name.removeprefix('point-')) + 1:08d}"
    cut.mkdir(exist_ok=True)
    (cut / ".rank-00001-of-00002.safetensors.4242.tmp").write_bytes(b"")

    alone = run_module(*argv[:-1], "--resume")  # one process, no --shard: refused by name, nothing restarted
    assert alone.returncode == 2 and "--shard under torchrun with 2 processes" in alone.stderr, alone.stderr
    resumed = run_module(*argv, "--resume", torchrun=2)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stdout
    a, b = (load_file(d / "classifier.safetensors") for d in (full, killed))
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    assert not (killed / "resume.sharded").exists(), "the spent resume point is removed with the results"


@pytest.mark.slow
def test_shard_group_needs_shard(checkpoint, small_csv, tmp_path):
    r = run_module(*args_for(checkpoint, small_csv, tmp_path / "x", "--shard-group", "2"))
    assert r.returncode == 2 and "--shard-group G needs --shard" in r.stderr


@pytest.mark.slow
def test_bfloat16_sharded_run_steps_float32_masters(checkpoint, small_csv, tmp_path):
    """The GPU default, on the CPU: bfloat16 shards, stepped through float32 master weights (optim.py) that are
    DTensors too; the saved weights are bfloat16 and have moved away from the checkpoint's."""
    out = tmp_path / "bf16"
    r = run_module(
        *args_for(
            checkpoint,
            small_csv,
            out,
            "--train-last",
            "2",
            "--batch-size",
            "4",
            "--epochs",
            "1",
            "--shard",
            "--dtype",
            "bfloat16",
        ),
        torchrun=2,
    )  # the last --dtype wins
    assert r.returncode == 0, r.stderr
    trained = load_file(out / "classifier.safetensors")
    base = load_file(checkpoint / "model.safetensors")
    assert {t.dtype for t in trained.values()} == {torch.bfloat16}
    name = "backbone.blocks.3.ffn.down_proj.weight"
    assert not torch.equal(trained[name], base["model.layers.3.mlp.down_proj.weight"].bfloat16())


def test_a_sharded_point_from_another_number_of_processes_is_refused(tmp_path):
    """Resharding is not supported: a point saved by 2 processes, resumed by 4, is one clear error naming both."""
    from llama_scratch.checkpoints.resume import ResumeError
    from llama_scratch.training import resume_points

    point = tmp_path / "resume.sharded" / "point-00000001"
    point.mkdir(parents=True)
    for r in range(2):
        (point / resume_points.part_name(r, 2)).write_bytes(b"")
    (tmp_path / "resume.sharded" / "current").write_text("point-00000001\n")
    assert resume_points.part_path(tmp_path / "resume.sharded", 1, 2).name == "rank-00001-of-00002.safetensors"
    with pytest.raises(ResumeError, match="saved by 2 processes, this run has 4"):
        resume_points.part_path(tmp_path / "resume.sharded", 0, 4)
    assert resume_points.is_resume_dir(tmp_path / "resume.sharded")
    (tmp_path / "resume.sharded" / "notes.txt").write_text("mine")  # a file we did not write: not ours to delete
    assert not resume_points.is_resume_dir(tmp_path / "resume.sharded")


FROZEN_PASS_SCRIPT = """
import os
import torch
from llama_scratch.model.classifier import LlamaClassifier
from llama_scratch.parallel import sharding
from llama_scratch.parallel.strategy import choose_strategy, teardown
from llama_scratch.sources.resolve import load_model
from llama_scratch.training.prefix_cache import compute_frozen_states

strategy = choose_strategy("cpu", shard=True)
device = strategy.device
# 9 texts in batches of 2: rank 0 takes 5 (3 batches), rank 1 takes 4 (2 batches, and a third only to take part in
# each frozen block's all-gather; without it rank 0 would wait forever in its third batch).
texts = [[1 + (i * 7 + j) % 100 for j in range(3 + i % 5)] for i in range(9)]
torch.manual_seed(0)
alone = LlamaClassifier(load_model("tiny", device, torch.float32), 2, train_last=1)
expected = compute_frozen_states(alone, texts, 0, batch_size=2, show=False)
torch.manual_seed(0)  # the same draw: the tiny preset ties its embedding, which then sits in the root's group
clf = strategy.build_classifier("tiny", torch.float32, 2, 1, None)
for packed in (True, False):
    got = compute_frozen_states(clf, texts, 0, batch_size=2, show=False, strategy=strategy, packed=packed)
    assert [s.shape for s in got] == [s.shape for s in expected] == [(len(t), 64) for t in texts]
    assert max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True)) < 1e-5, packed
    assert not any(sharding.is_dtensor(s) for s in got)
    assert all(sharding.is_dtensor(p) for p in clf.parameters()), "every gathered block is freed again"
os.write(1, f"rank {strategy.processes.rank} ok\\n".encode())  # one write: the two ranks share the pipe
teardown()
"""


@pytest.mark.slow
def test_sharded_frozen_pass_equals_one_process_with_uneven_shares(tmp_path):
    """The frozen-prefix pass under FSDP2: each process runs its share of the texts through the sharded frozen
    blocks, every process gets every text's states, equal to one unsharded process's."""
    run_on_two_processes(FROZEN_PASS_SCRIPT, tmp_path / "sharded_cache.py", timeout=180)


@pytest.mark.slow
def test_sharded_run_caches_the_frozen_layers_and_trains_as_without(checkpoint, small_csv, tmp_path):
    """--shard computes the frozen blocks' output once (it was silently off: issue 26) and trains to the weights
    and figures the sharded run without the cache reaches."""
    runs = {}
    for choice in ("on", "off"):
        argv = args_for(
            checkpoint,
            small_csv,
            tmp_path / choice,
            "--train-last",
            "2",
            "--batch-size",
            "4",
            "--shard",
            "--cache-frozen",
            choice,
        )
        runs[choice] = run_module(*argv, torchrun=2)
        assert runs[choice].returncode == 0, runs[choice].stderr
    assert "caching the output of the 2 frozen blocks for every text" in runs["on"].stdout
    assert "in each process" in runs["on"].stdout
    assert "caching" not in runs["off"].stdout
    a, b = (load_file(tmp_path / d / "classifier.safetensors") for d in ("on", "off"))
    ma, mb = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("on", "off"))
    # The cache runs the frozen blocks over evaluation-size batches, the uncached run over each micro-batch: float32
    # sums in another order (assert_rounding_apart says where, and how far that can take the weights); the figures
    # below must be equal.
    assert_rounding_apart(a, b, ma["steps"], lr=1e-3)
    for key in ("train_accuracy", "val_accuracy", "test_accuracy", "test_confusion", "steps"):
        assert ma[key] == mb[key], key
    assert abs(ma["test_loss"] - mb["test_loss"]) < 1e-5


@pytest.mark.slow
def test_sharded_run_from_random_weights_writes_the_file_one_process_writes(small_csv, tmp_path):
    """`--model tiny --train-last all` (random weights, a tied embedding: the whole classifier is saved), typed as
    a user types it, alone and under torchrun with --shard: the same tensors under the same names and shapes, and
    the same values. The sharded file held the tied embedding a second time, as backbone.lm_head.weight (issue 29 j)."""
    common = [
        "--model",
        "tiny",
        "--train-last",
        "all",
        "--data",
        str(small_csv),
        "--split",
        "full",
        "--epochs",
        "1",
        "--max-length",
        "48",
        "--lr",
        "1e-3",
    ]
    one = run_module(*common, "--output", str(tmp_path / "one"), "--batch-size", "8")
    two = run_module(*common, "--output", str(tmp_path / "two"), "--batch-size", "4", "--shard", torchrun=2)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    assert "sharded across 2 processes" in two.stdout
    a, b = (load_file(tmp_path / d / "classifier.safetensors") for d in ("one", "two"))
    assert {k: v.shape for k, v in b.items()} == {k: v.shape for k, v in a.items()}
    assert "backbone.embed_tokens.weight" in a and "backbone.lm_head.weight" not in a
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5


RANDOM_START_SCRIPT = """
import os, torch
from llama_scratch.model import llama
from llama_scratch.parallel import sharding
from llama_scratch.parallel.strategy import Replicated, choose_strategy, teardown

strategy = choose_strategy("cpu", shard=True)
built, init = [], llama.Llama.__init__
def noting_where(self, cfg):  # where each Llama is built: a whole one on a device is what must not happen
    init(self, cfg)
    built.append(self.embed_tokens.weight.device.type)
llama.Llama.__init__ = noting_where
torch.manual_seed(0)
clf = strategy.build_classifier("tiny", torch.float32, 2, None, None)
llama.Llama.__init__ = init
assert built == ["meta"], built
torch.manual_seed(0)
one = Replicated().build_classifier("tiny", torch.float32, 2, None, None)
mine = dict(clf.named_parameters(remove_duplicate=False))
assert mine.keys() == dict(one.named_parameters(remove_duplicate=False)).keys()
assert all(sharding.is_dtensor(p) for p in mine.values()), "sharded, not whole"
for name, p in one.named_parameters(remove_duplicate=False):
    assert torch.equal(sharding.full_tensor(mine[name].detach()), p.detach()), name
assert clf.backbone.lm_head.weight is clf.backbone.embed_tokens.weight, "still tied"
assert torch.equal(one.backbone.rope.cos, clf.backbone.rope.cos)
os.write(1, f"rank {strategy.processes.rank} ok\\n".encode())
teardown()
"""


@pytest.mark.slow
def test_sharded_random_weights_start_as_one_process_without_a_whole_copy(tmp_path):
    """--shard --model tiny: the classifier is built on the meta device, sharded, and each process draws its rows;
    every weight (the tied embedding, the norms' ones, the head) equals what one process draws from the same
    seed. Before, each process built the whole preset on its device first."""
    run_on_two_processes(RANDOM_START_SCRIPT, tmp_path / "random_start.py")


FOREACH_SCRIPT = """
import os
from pathlib import Path

import torch
from llama_scratch.data.batching import TokenizedSplit
from llama_scratch.parallel import sharding
from llama_scratch.parallel.strategy import choose_strategy, optimizer_kernels, teardown
from llama_scratch.training import loop
from llama_scratch.training.loop import TrainSettings, make_optimizer, train

strategy = choose_strategy("cpu", shard=True)
ids = [[1 + (i * 7 + j) % 100 for j in range(5 + i % 4)] for i in range(32)]
split = TokenizedSplit(ids, [i % 2 for i in range(32)])
one_at_a_time = lambda params: {**optimizer_kernels(params), "foreach": False}  # noqa: E731  (before this change)
# torch's AdamW on float32 weights; ours (float32 master weights) on bfloat16 ones; every layer and the last 2
for state, dtype, train_last in (("param", torch.float32, None), ("float32", torch.bfloat16, 2)):
    trained = {}
    for kernels in (optimizer_kernels, one_at_a_time):
        torch.manual_seed(0)
        clf = strategy.build_classifier("tiny", dtype, 2, train_last, None)
        loop.optimizer_kernels = kernels
        groups = make_optimizer(clf, TrainSettings()).param_groups
        assert [g["foreach"] for g in groups] == [kernels is optimizer_kernels] * 2, (state, groups)
        assert all(sharding.is_dtensor(p) for g in groups for p in g["params"])
        settings = TrainSettings(epochs=1, batch_size=4, lr=1e-3, save_every=1000, optimizer_state=state)
        # One folder both processes see (a sharded run's resume parts are counted there), one per run
        out = Path(__file__).with_suffix("") / f"{state}-{'foreach' if kernels is optimizer_kernels else 'one'}"
        train(clf, {"train": split, "val": split}, settings, strategy, out, log=lambda *a: None)
        trained[kernels] = {n: p.to_local().float() for n, p in clf.named_parameters() if p.requires_grad}
    foreach, before = trained[optimizer_kernels], trained[one_at_a_time]
    moved = max((p - q).abs().max().item() for p, q in zip(foreach.values(), before.values(), strict=True))
    os.write(1, f"rank {strategy.processes.rank} {state}: largest difference {moved:.3g}\\n".encode())
    assert moved == 0.0, (state, moved)
os.write(1, f"rank {strategy.processes.rank} ok\\n".encode())  # one write: the two ranks share the pipe
teardown()
"""


@pytest.mark.slow
def test_sharded_adamw_steps_all_tensors_at_once_as_it_did_one_at_a_time(tmp_path):
    """Sharded parameters (DTensors) take AdamW's multi-tensor (foreach) kernel, and two sharded processes train to
    the weights the one-tensor-at-a-time kernel reached before: float32 AdamW and the float32 masters of bfloat16
    weights alike."""
    run_on_two_processes(FOREACH_SCRIPT, tmp_path / "sharded_foreach.py", timeout=300)

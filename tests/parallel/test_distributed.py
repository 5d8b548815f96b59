"""Under DDP: gradients kept once (as views of the all-reduce buckets), and the frozen-prefix cache shared out
and decided on alike by all processes."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = str(Path(__file__).resolve().parents[2])  # the checkout whose package the processes import

# Every test here starts two processes under torchrun: the `slow` tier (tests/README.md).
pytestmark = pytest.mark.slow


def run_on_two_processes(script: str, path, timeout: float = 300) -> None:
    """Run `script` under torchrun with two CPU processes; each prints 'rank N ok' when its checks pass."""
    path.write_text(script)
    # The script lies outside the checkout: PYTHONPATH makes it import this checkout's package, not an installed one.
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
    }
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(path)]
    result = subprocess.run(run, capture_output=True, text=True, env=env, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0 ok" in result.stdout and "rank 1 ok" in result.stdout


GRADIENTS_SCRIPT = textwrap.dedent(
    """
    import os
    import tempfile
    from pathlib import Path

    import torch

    from llama_scratch import Llama, LlamaClassifier, LlamaConfig
    from llama_scratch.data.batching import TokenizedSplit
    from llama_scratch.parallel.strategy import choose_strategy, teardown
    from llama_scratch.training.loop import TrainSettings, train

    strategy = choose_strategy("cpu")
    ids = [[1 + (i * 7 + j) % 100 for j in range(5 + i % 4)] for i in range(32)]
    split = TokenizedSplit(ids, [i % 2 for i in range(32)])
    # torch's AdamW on float32 weights; ours (float32 master weights) on bfloat16 ones
    for state, dtype in (("param", torch.float32), ("float32", torch.bfloat16)):
        torch.manual_seed(0)
        clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny", dtype=dtype)), num_classes=2, train_last=2)
        model = strategy.wrap(clf)
        trained = [p for p in clf.parameters() if p.requires_grad]
        # From the start, before the first backward (which, under --grad-accum 2, skips the all-reduce).
        assert all(p.grad is not None and p.grad._base is not None for p in trained), state
        settings = TrainSettings(epochs=1, batch_size=4, grad_accum=2, save_every=1000, optimizer_state=state)
        with tempfile.TemporaryDirectory() as out:
            train(model, {"train": split, "val": split}, settings, strategy, Path(out), log=lambda *a: None)
        trained = [p for p in clf.parameters() if p.requires_grad]
        # After the last step the gradients are still there (zeroed, not freed), each a view of DDP's buckets.
        assert all(p.grad is not None and p.grad._base is not None for p in trained), state
        assert all(p.grad.count_nonzero() == 0 for p in trained), state
        buckets = {p.grad._base.untyped_storage().data_ptr() for p in trained}
        assert len(buckets) <= len(trained) // 2, buckets  # a few flat buckets, not one tensor per parameter
    os.write(1, f"rank {strategy.processes.rank} ok\\n".encode())  # one write: the two ranks share the pipe
    teardown()
    """
)


def test_gradients_are_views_of_ddp_buckets_through_training(tmp_path):
    run_on_two_processes(GRADIENTS_SCRIPT, tmp_path / "ddp_grads.py")


CACHE_SCRIPT = textwrap.dedent(
    """
    import os

    import torch

    from llama_scratch import Llama, LlamaClassifier, LlamaConfig
    from llama_scratch.parallel.strategy import Replicated, choose_strategy, teardown
    from llama_scratch.training import prefix_cache
    from llama_scratch.training.prefix_cache import compute_frozen_states

    strategy = choose_strategy("cpu")
    rank = strategy.processes.rank
    torch.manual_seed(0)
    clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), num_classes=2, train_last=1)
    texts = [[1 + (i * 7 + j) % 100 for j in range(3 + i % 5)] for i in range(11)]
    rows_run = []  # texts this process runs through the frozen blocks
    run_blocks = clf.backbone.run_blocks
    clf.backbone.run_blocks = lambda x, *a, **k: rows_run.append(x.shape[0]) or run_blocks(x, *a, **k)
    shared = compute_frozen_states(clf, texts, 0, batch_size=2, show=False, strategy=strategy)
    del clf.backbone.run_blocks
    assert 0 < sum(rows_run) < len(texts) and strategy.all_sum(torch.tensor(sum(rows_run))) == len(texts)
    alone = compute_frozen_states(clf, texts, 0, batch_size=2, show=False, strategy=Replicated())
    assert [s.shape for s in shared] == [s.shape for s in alone] == [(len(t), 64) for t in texts]
    assert max((a - b).abs().max().item() for a, b in zip(shared, alone, strict=True)) < 1e-5
    # One text for two processes: the second computes nothing and still receives it.
    one = compute_frozen_states(clf, texts[:1], 0, batch_size=2, show=False, strategy=strategy)
    assert len(one) == 1 and torch.allclose(one[0], alone[0], atol=1e-5)
    # Whether to cache is one decision for all: with room on rank 0 only, neither caches (else a deadlock).
    quiet = lambda *a: None  # noqa: E731
    prefix_cache.memory_budget = lambda device, fraction=0.25: 2**40 if rank == 0 else 0
    assert prefix_cache.use_cache("auto", clf, {"train": texts}, strategy, quiet) is False
    prefix_cache.memory_budget = lambda device, fraction=0.25: 2**40
    assert prefix_cache.use_cache("auto", clf, {"train": texts}, strategy, quiet) is True
    os.write(1, f"rank {rank} ok\\n".encode())  # one write: the two ranks share the pipe
    teardown()
    """
)


def test_frozen_prefix_cache_is_computed_in_shares_and_exchanged(tmp_path):
    run_on_two_processes(CACHE_SCRIPT, tmp_path / "ddp_cache.py")


REDUCTION_SCRIPT = textwrap.dedent(
    """
    import os

    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from llama_scratch import Llama, LlamaClassifier, LlamaConfig
    from llama_scratch.parallel import distributed
    from llama_scratch.parallel.strategy import choose_strategy, teardown

    strategy = choose_strategy("cpu")
    rank = strategy.processes.rank

    def hooks(model):
        return [hook.__name__ for hook, _ in model._comm_hooks]

    # The hook goes on low-precision models only: a float32 model's buckets are float32 already.
    for dtype, expected in ((torch.bfloat16, ["float32_all_reduce"]), (torch.float32, [])):
        torch.manual_seed(0)
        clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny", dtype=dtype)), num_classes=2, train_last=1)
        registered = hooks(strategy.wrap(clf))
        assert registered == expected, (dtype, registered)

    class Scale(nn.Module):  # d(w * x).sum() / dw = x: each process chooses its gradient exactly
        def __init__(self, n):
            super().__init__()
            self.w = nn.Parameter(torch.ones(n, dtype=torch.bfloat16))

        def forward(self, x):
            return (self.w * x).sum()

    # Both processes know both gradients: ordinary values, and the smallest bfloat16 ones (subnormal multiples of
    # 2**-133), which DDP's default halves in bfloat16 before summing, losing their last bit. (With two processes
    # that halving is all a bfloat16 reduction loses: the sum of two values rounds once, as float32's does.)
    tiny = 2.0**-133
    g = torch.Generator().manual_seed(1)
    grads = [torch.cat([torch.randn(64, generator=g), torch.full((4,), tiny), torch.tensor([tiny, 3 * tiny])])
             for _ in range(2)]
    grads = [t.bfloat16() for t in grads]
    float32_mean = ((grads[0].float() + grads[1].float()) / 2).bfloat16()

    def reduced(model):
        model(grads[rank]).backward()
        return next(model.parameters()).grad.clone()

    ours = reduced(distributed.wrap(Scale(70), strategy.processes, strategy.device))
    assert torch.equal(ours, float32_mean), (ours - float32_mean).abs().max()
    default = reduced(DistributedDataParallel(Scale(70)))
    assert not torch.equal(default, float32_mean) and torch.equal(default[:64], float32_mean[:64])
    assert default[64:68].count_nonzero() == 0 and float32_mean[64:68].count_nonzero() == 4
    os.write(1, f"rank {rank} ok\\n".encode())  # one write: the two ranks share the pipe
    teardown()
    """
)


def test_ddp_reduces_bfloat16_gradients_in_float32(tmp_path):
    run_on_two_processes(REDUCTION_SCRIPT, tmp_path / "ddp_reduction.py")


def test_what_one_process_sends_another_is_json_and_an_error_is_rebuilt_by_class():
    """on_main and on_each_node send JSON, never a pickle: a result JSON cannot hold is refused (alone too, so a
    caller's mistake shows without torchrun), and an error arrives as the same class with the same message."""
    import pytest

    from llama_scratch.checkpoints.resume import ResumeError
    from llama_scratch.parallel import distributed
    from llama_scratch.parallel.strategy import Replicated

    assert Replicated().on_main(lambda: ("a", 1)) == ["a", 1]  # as every process would receive it
    with pytest.raises(TypeError, match="PosixPath"):
        Replicated().on_main(lambda: Path("x"))
    with pytest.raises(ResumeError, match="^runs/x: refused$"):
        distributed.raise_sent({"error": distributed.error_json(ResumeError("runs/x: refused"))})
    with pytest.raises(RuntimeError, match="nowhere.Unknown: gone"):
        distributed.raise_sent({"error": {"module": "nowhere", "name": "Unknown", "message": "gone"}})
    assert distributed.raise_sent({"result": {"k": [1]}}) == {"k": [1]}

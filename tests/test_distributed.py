"""DDP's gradients: one copy per process, shared with the all-reduce buckets, and kept across training steps."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import tempfile
    from pathlib import Path

    import torch

    from llama_scratch import Llama, LlamaClassifier, LlamaConfig, distributed
    from llama_scratch.train import Split, TrainSettings, train

    env, device = distributed.setup("cpu")
    torch.manual_seed(0)
    clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), num_classes=2, train_last=2)
    model = distributed.wrap(clf, env, device)
    ids = [[1 + (i * 7 + j) % 100 for j in range(5 + i % 4)] for i in range(32)]
    split = Split(ids, [i % 2 for i in range(32)])
    settings = TrainSettings(epochs=1, batch_size=4, grad_accum=2, save_every=1000)
    with tempfile.TemporaryDirectory() as out:
        train(model, {"train": split, "val": split}, 2, 0, settings, env, device, Path(out), log=lambda *a: None)
    trained = [p for p in clf.parameters() if p.requires_grad]
    # After the last step the gradients are still there (zeroed, not freed), each a view of DDP's bucket storage.
    assert all(p.grad is not None and p.grad._base is not None for p in trained)
    assert all(p.grad.count_nonzero() == 0 for p in trained)
    buckets = {p.grad._base.untyped_storage().data_ptr() for p in trained}
    assert len(buckets) <= len(trained) // 2, buckets  # a few flat buckets, not one tensor per parameter
    print("rank", env.rank, "ok")
    distributed.teardown()
    """
)


def test_gradients_are_views_of_ddp_buckets_through_training(tmp_path):
    script = tmp_path / "ddp_grads.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(script)]
    result = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0 ok" in result.stdout and "rank 1 ok" in result.stdout

"""The training loop's pieces that the end-to-end runs (tests/test_finetune.py) do not pin down on their own."""

import math

import pytest
import torch

from llama_scratch.distributed import Dist
from llama_scratch.train import TrainSettings, check_enough_data, epoch_batches, lr_factor


def test_epoch_batches_are_seeded_and_shared_out_like_one_process():
    s1, s2 = TrainSettings(batch_size=8, seed=3), TrainSettings(batch_size=4, seed=3)
    single = epoch_batches(32, 0, s1, Dist())
    assert single == epoch_batches(32, 0, s1, Dist())  # the same seed and epoch, the same order
    before = torch.get_rng_state()
    assert epoch_batches(32, 1, s1, Dist()) != single  # each epoch its own order
    assert torch.equal(torch.get_rng_state(), before)  # and the global RNG is left alone
    assert sorted(i for b in single for i in b) == list(range(32))
    ranks = [epoch_batches(32, 0, s2, Dist(rank=r, world_size=2)) for r in (0, 1)]
    # Batch k of one process with 8 rows holds exactly the rows of batch k on each of two processes with 4.
    assert [sorted(a + b) for a, b in zip(*ranks, strict=True)] == [sorted(b) for b in single]


def test_incomplete_steps_are_dropped_and_too_little_data_is_an_error():
    s = TrainSettings(batch_size=4, grad_accum=2)
    assert len(epoch_batches(21, 0, s, Dist())) == 4  # 21 rows: two whole steps of 2 x 4, 5 rows left out
    assert check_enough_data(21, s, Dist()) == 2
    assert check_enough_data(15, s, Dist(world_size=2)) == 1  # the sampler repeats a row to give each process 8
    with pytest.raises(ValueError, match="fewer than one step"):
        check_enough_data(13, s, Dist(world_size=2))


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    s = TrainSettings(warmup=0.1)
    factors = [lr_factor(step, 100, s) for step in range(100)]
    assert factors[0] == 0.1 and factors[9] == 1.0  # 10 warm-up steps: 1/10 ... 10/10
    assert all(a >= b for a, b in zip(factors[9:], factors[10:], strict=False))
    assert math.isclose(lr_factor(100, 100, s), 0.1)

"""The training loop's pieces that the end-to-end runs (tests/commands/test_finetune.py) do not pin down on their
own."""

import math
from pathlib import Path

import pytest
import torch

from llama_scratch.data.batching import TokenizedSplit
from llama_scratch.parallel.strategy import Processes, Replicated
from llama_scratch.training.loop import TrainSettings, lr_factor
from llama_scratch.training.steps import budget_batches, check_enough_data, epoch_batches, epoch_plan


def test_epoch_batches_are_seeded_and_shared_out_like_one_process():
    s1, s2 = TrainSettings(batch_size=8, seed=3), TrainSettings(batch_size=4, seed=3)
    single = epoch_batches(32, 0, s1, Processes())
    assert single == epoch_batches(32, 0, s1, Processes())  # the same seed and epoch, the same order
    before = torch.get_rng_state()
    assert epoch_batches(32, 1, s1, Processes()) != single  # each epoch its own order
    assert torch.equal(torch.get_rng_state(), before)  # and the global RNG is left alone
    assert sorted(i for b in single for i in b) == list(range(32))
    ranks = [epoch_batches(32, 0, s2, Processes(rank=r, world_size=2)) for r in (0, 1)]
    # Batch k of one process with 8 rows holds exactly the rows of batch k on each of two processes with 4.
    assert [sorted(a + b) for a, b in zip(*ranks, strict=True)] == [sorted(b) for b in single]


def test_incomplete_steps_are_dropped_and_too_little_data_is_an_error():
    s = TrainSettings(batch_size=4, grad_accum=2)
    assert len(epoch_batches(21, 0, s, Processes())) == 4  # 21 rows: two whole steps of 2 x 4, 5 rows left out
    assert check_enough_data(21, s, Processes()) == 2
    assert check_enough_data(15, s, Processes(world_size=2)) == 1  # the sampler repeats a row to give each process 8
    with pytest.raises(ValueError, match="fewer than one step"):
        check_enough_data(13, s, Processes(world_size=2))


LENGTHS = [3 + (i * 37) % 61 for i in range(90)]  # 90 texts of 3-63 tokens, many lengths repeated


@pytest.mark.parametrize("padded", [False, True])
def test_token_budget_batches_hold_every_row_once_within_the_budget(padded):
    batches = budget_batches(LENGTHS, 200, seed=5, epoch=0, padded=padded)
    assert sorted(i for b in batches for i in b) == list(range(len(LENGTHS)))
    for b in batches:  # what the device holds: rows x longest padded, and packed in attention's padded copy too
        assert len(b) * max(LENGTHS[i] for i in b) <= 200 and sum(LENGTHS[i] for i in b) <= 200
    # Greedy in length order: no two neighbouring batches (by length) could have been one.
    assert len(batches) <= sum(LENGTHS) // 200 * 2 + 1
    # Short texts make big batches, long ones small: the rows differ, the tokens do not much.
    rows = sorted(len(b) for b in batches)
    assert rows[0] < rows[-1]
    # Seeded: the same seed and epoch, the same batches; another epoch another order, and as many batches.
    assert batches == budget_batches(LENGTHS, 200, seed=5, epoch=0, padded=padded)
    other = budget_batches(LENGTHS, 200, seed=5, epoch=1, padded=padded)
    assert other != batches and len(other) == len(batches)


def test_a_text_longer_than_the_budget_goes_alone():
    batches = budget_batches([5, 50, 6], 20, seed=0, epoch=0, padded=False)
    assert sorted(map(sorted, batches)) == [[0, 2], [1]]
    with pytest.raises(ValueError, match="--batch-tokens"):
        budget_batches([5], 0, seed=0, epoch=0, padded=False)


def test_token_budget_steps_are_shared_out_like_accumulation_on_one_process():
    """Two processes take every other batch of the one list: step k's micro-batches on both are exactly the two
    micro-batches one process accumulates in step k with --grad-accum 2, and each step's row count is shared."""
    s1 = TrainSettings(batch_tokens=150, grad_accum=2, seed=2)
    s2 = TrainSettings(batch_tokens=150, grad_accum=1, seed=2)
    one, rows_one = epoch_plan(LENGTHS, 3, s1, Processes())
    two = [epoch_plan(LENGTHS, 3, s2, Processes(rank=r, world_size=2)) for r in (0, 1)]
    assert rows_one == two[0][1] == two[1][1]
    pairs = [list(p) for p in zip(two[0][0], two[1][0], strict=True)]
    assert pairs == [[one[2 * k], one[2 * k + 1]] for k in range(len(rows_one))]
    assert rows_one == [len(one[2 * k]) + len(one[2 * k + 1]) for k in range(len(rows_one))]
    assert check_enough_data(len(LENGTHS), s1, Processes(), LENGTHS) == len(rows_one)
    with pytest.raises(ValueError, match="lengths"):
        check_enough_data(len(LENGTHS), s1, Processes())
    with pytest.raises(ValueError, match="fewer than one step"):
        check_enough_data(len(LENGTHS), TrainSettings(batch_tokens=10_000, grad_accum=2), Processes(), LENGTHS)


def test_a_token_budget_step_has_the_gradient_of_the_mean_over_all_its_rows():
    """Micro-batches of 3 and 9 rows in one step: the gradient is that of one batch of all 12 rows (a mean of the
    two means would weigh the 3 rows three times as much as the 9)."""
    from llama_scratch import Llama, LlamaClassifier, LlamaConfig
    from llama_scratch.training.loop import train_step

    torch.manual_seed(0)
    ids = [[1 + (i * 7 + j) % 100 for j in range(4 + i % 5)] for i in range(12)]
    split = TokenizedSplit(ids, [i % 2 for i in range(12)])
    clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), num_classes=2, train_last=1)
    s = TrainSettings(batch_tokens=64, grad_accum=2)

    def grads(step_rows, step_total, settings):
        clf.zero_grad(set_to_none=True)
        train_step(clf, split, step_rows, settings, Replicated(), step_total=step_total)
        return [p.grad.clone() for p in clf.parameters() if p.requires_grad]

    apart = grads([list(range(3)), list(range(3, 12))], 12, s)
    whole = grads([list(range(12))], None, TrainSettings())
    for a, w in zip(apart, whole, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-7)  # float32 sums in another order


def test_class_weights_hold_across_a_step_s_micro_batches():
    """--class-weights with micro-batches of one class each (--grad-accum 2, or a token budget's): the step's
    gradient is the weighted mean over all its rows, as one batch gives; a weighted mean per micro-batch would be
    each micro-batch's plain mean, the weights undone."""
    from llama_scratch import Llama, LlamaClassifier, LlamaConfig
    from llama_scratch.training.loop import row_weights, train_step

    torch.manual_seed(0)
    ids = [[1 + (i * 7 + j) % 100 for j in range(4 + i % 5)] for i in range(12)]
    split = TokenizedSplit(ids, [0] * 6 + [1] * 6)
    clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), num_classes=2, train_last=1)
    weighted = TrainSettings(batch_size=6, grad_accum=2, class_weights=[1.0, 3.0])
    weights = row_weights(split, weighted)
    assert weights == [1.0] * 6 + [3.0] * 6

    def grads(step_rows, step_total, settings):
        clf.zero_grad(set_to_none=True)
        train_step(clf, split, step_rows, settings, Replicated(), step_total=step_total)
        return [p.grad.clone() for p in clf.parameters() if p.requires_grad]

    apart = grads([list(range(6)), list(range(6, 12))], sum(weights), weighted)
    whole = grads([list(range(12))], None, TrainSettings(batch_size=12, class_weights=[1.0, 3.0]))
    for a, w in zip(apart, whole, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-7)  # float32 sums in another order
    # The plan gives each step its rows' summed weights, over every process's micro-batches.
    s2 = TrainSettings(batch_size=2, grad_accum=2, seed=4)
    lengths = [5] * 16
    one = epoch_plan(lengths, 0, s2, Processes(world_size=2), [float(i) for i in range(16)])[1]
    mine = [epoch_plan(lengths, 0, s2, Processes(rank=r, world_size=2))[0] for r in (0, 1)]
    expected = [sum(i for r in mine for b in r[k : k + 2] for i in b) for k in range(0, len(mine[0]), 2)]
    assert one == expected and sum(one) == sum(range(16))


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    s = TrainSettings(warmup=0.1)
    factors = [lr_factor(step, 100, s) for step in range(100)]
    assert factors[0] == 0.1 and factors[9] == 1.0  # 10 warm-up steps: 1/10 ... 10/10
    assert all(a >= b for a, b in zip(factors[9:], factors[10:], strict=False))
    assert math.isclose(lr_factor(100, 100, s), 0.1)


def test_an_interrupt_mid_step_then_resume_equals_one_run(tmp_path, monkeypatch):
    """Ctrl-C in the middle of an epoch (here, inside a step's gradient accumulation) and --resume give the same
    weights, history and token count as a run never interrupted: the half step is dropped and done again."""
    from llama_scratch import Llama, LlamaClassifier, LlamaConfig
    from llama_scratch.training import loop as train

    ids = [[1 + (i * 7 + j) % 100 for j in range(4 + i % 5)] for i in range(24)]
    splits = {"train": TokenizedSplit(ids, [i % 2 for i in range(24)]), "val": TokenizedSplit(ids[:8], [0, 1] * 4)}
    settings = train.TrainSettings(epochs=2, batch_size=2, grad_accum=2, save_every=100, lr=1e-3)

    def run(out, resume=False):
        out.mkdir(exist_ok=True)
        torch.manual_seed(0)
        clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), num_classes=2, train_last=1)
        state = train.train(clf, splits, settings, Replicated(), out, resume, log=lambda *a: None)
        return state, {k: v.clone() for k, v in train.trainable_state(clf).items()}

    whole, whole_weights = run(tmp_path / "whole")
    real_to_batch, calls = train.to_batch, []

    def interrupting_to_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 10:  # the second micro-batch of step 5 of 6 in the first epoch
            raise KeyboardInterrupt
        return real_to_batch(*args, **kwargs)

    monkeypatch.setattr(train, "to_batch", interrupting_to_batch)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "cut")
    monkeypatch.setattr(train, "to_batch", real_to_batch)
    resumed, resumed_weights = run(tmp_path / "cut", resume=True)
    assert all(torch.equal(whole_weights[k], resumed_weights[k]) for k in whole_weights)
    assert resumed.history == whole.history
    assert (resumed.step, resumed.train_tokens) == (whole.step, whole.train_tokens)


def host_reads(loop, split, monkeypatch) -> list[str]:
    """The reads of tensor values on the host (the calls that wait for a GPU) during one epoch of `loop`, outside
    the optimizer's own step (CPU AdamW reads its step counter; the GPU's fused AdamW does not)."""
    counted, counting_on = [], [True]
    real_step = loop.optimizer.step

    def uncounted_step(*args, **kwargs):
        counting_on[0] = False
        try:
            return real_step(*args, **kwargs)
        finally:
            counting_on[0] = True

    def counting(real, name):
        def read(self, *args, **kwargs):
            if counting_on[0]:
                counted.append(name)
            return real(self, *args, **kwargs)

        return read

    with monkeypatch.context() as m:
        m.setattr(loop.optimizer, "step", uncounted_step)
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
            m.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name), name))
        from llama_scratch.training import loop as train

        assert train.train_epoch(loop, split, train.TrainState())
    return counted


def test_the_loop_reads_the_device_once_per_optimizer_step(monkeypatch):
    """On a GPU every read of a device tensor on the host (`.item()`, `.tolist()`, `bool()`, `int()`, ...) waits
    for the GPU. One epoch of 3 optimizer steps x 2 micro-batches, packed and right-padded: the loop reads once a
    step (the summed loss, counts and gradient norm) plus once an epoch (the shuffled order), nothing per
    micro-batch or in the forward."""
    from llama_scratch import Llama, LlamaClassifier, LlamaConfig
    from llama_scratch.training import loop as train

    ids = [[1 + (i * 7 + j) % 100 for j in range(4 + i % 5)] for i in range(12)]
    split = TokenizedSplit(ids, [i % 2 for i in range(12)])
    for side in ("packed", "right"):
        settings = train.TrainSettings(epochs=1, batch_size=2, grad_accum=2, save_every=100, padding_side=side)
        torch.manual_seed(0)
        clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), num_classes=2, train_last=2)
        optimizer = train.make_optimizer(clf, settings)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        loop = train.Loop(clf, optimizer, scheduler, settings, Replicated(), 3, None, {})
        assert host_reads(loop, split, monkeypatch) == ["tolist"] * 4, side  # the order, then one a step


def test_the_divergence_message_gives_one_process_s_gradient_norm(monkeypatch):
    """The loss and norm are summed over the processes so that all stop together; the message divides the norm
    back: every process holds the whole model's norm, so the sum was the norm times the number of processes."""
    from dataclasses import dataclass

    from llama_scratch import Llama, LlamaClassifier, LlamaConfig
    from llama_scratch.training import loop as train

    @dataclass(frozen=True)
    class TwoAlike(Replicated):
        """Rank 0 of two processes that hold the same numbers: their sum is twice this one's."""

        def all_sum(self, values: torch.Tensor) -> torch.Tensor:
            return values * 2

    norms, real_clip, real_check = [], torch.nn.utils.clip_grad_norm_, train.check_finite
    monkeypatch.setattr(
        torch.nn.utils, "clip_grad_norm_", lambda *a, **k: norms.append(real_clip(*a, **k)) or norms[-1]
    )
    monkeypatch.setattr(train, "check_finite", lambda totals, *rest: real_check([math.nan, *totals[1:]], *rest))
    ids = [[1 + (i * 7 + j) % 100 for j in range(4 + i % 5)] for i in range(8)]
    settings = train.TrainSettings(epochs=1, batch_size=2, save_every=100)
    clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), num_classes=2, train_last=1)
    optimizer = train.make_optimizer(clf, settings)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    strategy = TwoAlike(processes=Processes(world_size=2))
    loop = train.Loop(clf, optimizer, scheduler, settings, strategy, 2, Path("point"), {})
    with pytest.raises(train.TrainingDiverged) as e:
        train.train_epoch(loop, TokenizedSplit(ids, [i % 2 for i in range(8)]), train.TrainState())
    assert f"(gradient norm {norms[0].double().item()})" in str(e.value) and norms[0] > 0

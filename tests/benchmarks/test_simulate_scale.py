"""benchmarks/simulate_scale.py at a small shape: one real sharded training step under a fake process group and fake
tensors, its per-process peak agreeing with the memory plan (the full-size figures are in benchmarks/RESULTS.md),
and the fake tensors counted exactly as real ones would be."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

# Every test here runs benchmarks/simulate_scale.py as a new Python process: the `slow` tier (tests/README.md).
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "simulate_scale.py"


def simulate(*args: str) -> dict:
    run = subprocess.run([sys.executable, str(SCRIPT), *args, "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "shape",
    [
        ["--model", "tiny", "--world-size", "4", "--train-last", "2"],
        ["--model", "tiny", "--world-size", "8", "--train-last", "2", "--lora", "4"],
        ["--model", "tiny", "--world-size", "8", "--train-last", "all", "--gradient-checkpointing"],
        ["--model", "tiny", "--world-size", "4", "--train-last", "2", "--no-shard"],
    ],
    ids=" ".join,
)
def test_simulated_peak_agrees_with_the_plan(shape):
    result = simulate(*shape)
    assert result["world_size"] == int(shape[3]) and result["shard"] == ("--no-shard" not in shape)
    assert 0.9 <= result["simulated_peak_gib"] / result["plan_peak_gib"] <= 1.1, result
    if result["plan_peak_phase"] != "optimizer step":  # there, float32 gradients count as optimizer state too
        opt = result["simulated_breakdown_gib"].get("OptState", result["simulated_breakdown_gib"].get("Optstate"))
        assert opt == pytest.approx(result["plan_gib"]["optimizer_state"], rel=0.01)  # and AdamW's step counts


def test_fake_tensors_are_counted_as_real_ones():
    """The same two steps on real tensors (--real) peak at the same bytes, kind by kind, as on fake ones."""
    shape = ["--model", "tiny", "--world-size", "4", "--train-last", "all", "--gradient-checkpointing"]
    fake, real = simulate(*shape), simulate(*shape, "--real")
    assert real["real"] and not fake["real"]
    assert fake["simulated_steps_gib"] == real["simulated_steps_gib"]
    assert fake["simulated_breakdown_gib"] == real["simulated_breakdown_gib"]

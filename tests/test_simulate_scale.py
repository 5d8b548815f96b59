"""benchmarks/simulate_scale.py at a small shape: one real sharded training step under a fake process group and fake
tensors, its per-process peak agreeing with the memory plan (the full-size figures are in benchmarks/RESULTS.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "simulate_scale.py"


@pytest.mark.parametrize(
    "shape",
    [
        ["--model", "tiny", "--world-size", "4", "--train-last", "2"],
        ["--model", "llama3.2-1b", "--world-size", "8", "--train-last", "all", "--gradient-checkpointing"],
    ],
    ids=str,
)
def test_simulated_peak_agrees_with_the_plan(shape):
    run = subprocess.run([sys.executable, str(SCRIPT), *shape, "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["world_size"] == int(shape[3])
    assert 0.9 <= result["simulated_peak_gib"] / result["plan_peak_gib"] <= 1.1, result

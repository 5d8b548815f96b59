"""benchmarks/gpu_check.py, the script the lent GPU runs blind: its CPU mode (--quick) on tiny shapes, as a
subprocess, so the script cannot rot between the rare runs on a GPU. gguf and llama-models are blocked, as the GPU
machine lacks them."""

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

# The GPU machine has neither package: nothing the script runs may import them.
RUN = """import runpy, sys
sys.modules["gguf"] = None
sys.modules["llama_models"] = None
sys.argv = ["benchmarks/gpu_check.py", *sys.argv[1:]]
runpy.run_path("benchmarks/gpu_check.py", run_name="__main__")
"""
TOP_KEYS = ("command", "date", "device", "torch", "cuda", "total_seconds", "load_peak_ratio", "load_seconds")


@pytest.mark.slow
def test_quick_cpu_mode_reports_every_recipe(tmp_path):
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--quick", "--out", str(out), "--dir", str(tmp_path / "ckpt")]
    proc = subprocess.run([sys.executable, "-c", RUN, *argv], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert all(key in result for key in (*TOP_KEYS, "summary", "recipes")), sorted(result)
    assert result["device"] == "CPU" and result["load_seconds"] > 0
    assert [r["name"] for r in result["recipes"]] == [r.name for r in gpu_check.RECIPES]
    for recipe in result["recipes"]:
        assert recipe["error"] is None, recipe.get("traceback")
        assert all(key in recipe for key in gpu_check.RECIPE_KEYS), sorted(recipe)
        assert math.isfinite(recipe["loss_first"]) and math.isfinite(recipe["loss_last"]), recipe
        assert recipe["train_tokens_per_s"] > 0 and recipe["plan_peak_gib"] > 0
        assert recipe["sdpa_backend"] not in ("unknown", "none seen"), recipe["sdpa"]
        # Only a GPU has these figures: null, never made up.
        assert recipe["mfu"] is recipe["syncs_per_step"] is recipe["measured_peak_gib"] is None
        assert recipe["launches_per_step"] is recipe["peer_peak_gib"] is None
        # The peer ran beside it, from the same start: the same trained parameters, and (float32 on the CPU) the
        # same first loss, but where our base is 4-bit and the peer's is not.
        assert recipe.get("peer_error") is None and recipe["peer_tokens_per_s"] > 0, recipe.get("peer_error")
        assert recipe["ratio_vs_peer"] == pytest.approx(recipe["train_tokens_per_s"] / recipe["peer_tokens_per_s"])
        assert recipe["same_trained_params"], (recipe["trainable_params"], recipe["peer_trainable_params"])
        assert recipe["same_first_loss"] == ("--quantize" not in recipe["flags"]), recipe["name"]
        budget = {r.name: r.batch_tokens for r in gpu_check.RECIPES}[recipe["name"]]
        assert recipe["batch_tokens"] == (gpu_check.QUICK_BATCH_TOKENS if budget else None)
    cached = {r["name"]: r["frozen_prefix_cache"] for r in result["recipes"]}
    assert cached == {
        "8b-last2": True,
        "8b-lora8": True,
        "small-all": False,
        "8b-nf4-lora8": True,
        "8b-lora8-all-8k": False,
        "small-all-8k": False,
        "8b-last2-3epochs": True,
    }  # the real path's cache, where it applies
    # The end-to-end row: three whole epochs of the --quick texts, ours timed from the cache's pass, the peer over
    # the same steps and tokens, so the ratio is the peer's seconds over ours.
    whole = next(r for r in result["recipes"] if r["name"] == "8b-last2-3epochs")
    assert whole["epochs"] == 3 and whole["train_texts"] == gpu_check.E2E_TEXTS[1] and whole["mfu"] is None
    # Both sides ran every step of the three epochs, over the same tokens; the cache's pass is in ours' clock.
    assert whole["steps_per_epoch"] > 1 and whole["cache_seconds"] > 0
    assert whole["steps_run"] == whole["peer_steps"] == 3 * whole["steps_per_epoch"]
    assert whole["peer_tokens"] == pytest.approx(whole["train_tokens_per_s"] * whole["e2e_seconds"])
    assert whole["ratio_vs_peer"] == pytest.approx(whole["peer_e2e_seconds"] / whole["e2e_seconds"])
    assert all(r["epochs"] is r["e2e_seconds"] is None for r in result["recipes"] if r is not whole)
    assert set(result["summary"]["ran"]) == set(cached) and not result["summary"]["failed"]
    table = (out / "gpu_check.md").read_text()
    assert table in proc.stdout and all(f"| {name} |" in table for name in cached)
    assert "8b-last2-3epochs: 3 epochs of 120 texts end to end" in table


def test_the_end_to_end_row_runs_only_when_named_on_a_gpu():
    """The default run on a GPU leaves the end-to-end row out (minutes there); --quick and --recipes NAME run it."""
    names = lambda *argv: [r.name for r in gpu_check.chosen_recipes(gpu_check.parse_args(list(argv)))]  # noqa: E731
    every = [r.name for r in gpu_check.RECIPES]
    assert names() == [n for n in every if n != "8b-last2-3epochs"]
    assert names("--quick") == every
    assert names("--recipes", "8b-last2-3epochs", "8b-last2") == ["8b-last2", "8b-last2-3epochs"]
    assert gpu_check.parse_args([]).e2e_texts == 20_000 and gpu_check.parse_args(["--quick"]).e2e_texts == 120


@pytest.mark.slow
def test_the_steps_ours_trains_are_the_steps_the_peer_is_given(tmp_path, monkeypatch):
    """The peer gets planned_steps' micro-batches; ours trains through the loop's own train_epoch. Over an epoch's
    end they must be the same rows in the same order (the end-to-end row's three epochs rest on it)."""
    from llama_scratch.parallel.strategy import choose_strategy
    from llama_scratch.training import loop

    args = gpu_check.parse_args(["--device", "cpu", "--quick", "--dir", str(tmp_path / "ckpt")])
    recipe = next(r for r in gpu_check.RECIPES if r.epochs)
    strategy = choose_strategy("cpu")
    ckpt = gpu_check.checkpoint_for(gpu_check.QUICK, args.dir)
    _, _, model, train, settings, out = gpu_check.prepare(recipe, ckpt, args, strategy, tmp_path / "work")
    total = 2 * out["steps_per_epoch"] + 1  # into a third epoch
    trained, real = [], loop.train_step
    monkeypatch.setattr(
        loop, "train_step", lambda m, split, batches, *a: trained.append(batches) or real(m, split, batches, *a)
    )
    gpu_check.Steps(model, train, settings, strategy, total, tmp_path / "work").to(total)
    assert trained == gpu_check.planned_steps(train, settings, strategy, total)
    assert trained[0] != trained[out["steps_per_epoch"]]  # the next epoch's order is another


def test_step_flops_is_model_flops_text_by_text():
    """The quadratic through three lengths gives model_flops at every length; the cache counts trained blocks only."""
    cfg, lengths = gpu_check.QUICK, [1, 2, 9, 50, 385]
    direct = sum(gpu_check.model_flops(cfg, None, 1, n, lora=False)["done"] for n in lengths)
    assert gpu_check.step_flops(cfg, None, False, False, lengths) == pytest.approx(direct, rel=1e-9)
    top = dataclasses.replace(cfg, n_layers=2)
    direct = sum(gpu_check.model_flops(top, 2, 1, n, lora=True)["done"] for n in lengths)
    assert gpu_check.step_flops(cfg, 2, True, True, lengths) == pytest.approx(direct, rel=1e-9)

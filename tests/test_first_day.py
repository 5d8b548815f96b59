"""What a new user meets on their first day with their own files: no silent truncation, one folder per run, a run
that still works after moving, one-line device errors. Each test failed on the version before these changes."""

import json
import shutil
import subprocess
import sys

import torch

from llama_scratch import Llama, LlamaConfig, classify, finetune_classifier
from llama_scratch.devices import choose_dtype
from llama_scratch.weights import save_checkpoint

from .test_finetune import args_for


def test_classify_does_not_cut_texts_to_the_training_length(small_csv, tmp_path):
    out = tmp_path / "run"
    argv = args_for(small_csv, out, "--max-steps", "2")
    argv[argv.index("--max-length") + 1] = "8"  # trained on 8 tokens
    assert finetune_classifier.main(argv) == 0
    clf, tok, meta = classify.load_classifier(out)
    assert meta["max_length"] == 8
    same_start = ["one two three four five six seven eight nine", "one two three four five six seven eight ten"]
    scores = classify.predict(clf, tok, same_start)
    assert scores[0][1] != scores[1][1], "texts that differ after the training length scored alike"
    assert classify.predict(clf, tok, same_start, max_length=8)[0] == classify.predict(clf, tok, same_start, 8)[1]


def test_each_run_gets_its_own_folder_and_runs_latest_points_at_the_newest(small_csv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    jsonl = tmp_path / small_csv.with_suffix(".jsonl").name
    with small_csv.open() as f:
        rows = [line.rstrip("\n").rsplit(",", 1) for line in f][1:]
    jsonl.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows))
    common = ["--model", "tiny", "--split", "full", "--max-steps", "1", "--max-length", "16"]
    for data in (small_csv, jsonl):
        assert finetune_classifier.main([*common, "--data", str(data)]) == 0
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir() if p.name != "latest")
    assert len(runs) == 2 and (tmp_path / "runs" / "latest").is_symlink(), runs  # two run folders and the pointer
    assert runs[0].startswith("tiny-sms-csv-") and runs[1].startswith("tiny-sms-jsonl-")
    assert (tmp_path / "runs" / "latest").resolve().name == runs[1]
    assert classify.main(["--checkpoint", "runs/latest", "free prize"]) == 0


def test_a_run_moved_with_its_weights_still_classifies_and_a_lost_base_names_the_flag(small_csv, tmp_path, capsys):
    cfg = LlamaConfig.from_name("tiny")
    base, out = tmp_path / "project" / "weights" / "base", tmp_path / "project" / "runs" / "r"
    save_checkpoint(Llama(cfg), cfg, base)
    assert finetune_classifier.main([*args_for(small_csv, out, "--max-steps", "1"), "--model", str(base)]) == 0
    expected = classify.predict(*classify.load_classifier(out)[:2], ["hello there"])
    moved = tmp_path / "elsewhere"
    shutil.move(tmp_path / "project", moved)  # the whole project: run and weights keep their relative place
    assert classify.predict(*classify.load_classifier(moved / "runs" / "r")[:2], ["hello there"]) == expected
    lone = tmp_path / "lone-run"
    shutil.copytree(moved / "runs" / "r", lone)  # the run alone: its base is no longer where either path says
    shutil.move(moved / "weights" / "base", tmp_path / "base-now")
    assert classify.main(["--checkpoint", str(lone), "hi"]) == 2
    assert "--model PATH" in capsys.readouterr().err
    assert classify.main(["--checkpoint", str(lone), "--model", str(tmp_path / "base-now"), "hi"]) == 0


def test_asking_for_a_missing_gpu_is_one_line(small_csv, tmp_path):
    if torch.cuda.is_available():
        return  # the message is for machines without one
    for module, argv in (
        ("finetune_classifier", ["--model", "tiny", "--data", str(small_csv), "--output", str(tmp_path / "o")]),
        ("classify", ["--checkpoint", str(tmp_path), "hello"]),
    ):
        r = subprocess.run([sys.executable, "-m", f"llama_scratch.{module}", *argv, "--device", "cuda"],
                           capture_output=True, text=True)  # fmt: skip
        assert (
            r.returncode == 2 and r.stderr.strip() == "error: --device cuda: no CUDA GPU is visible; use --device cpu"
        )


def test_auto_dtype_keeps_the_stored_dtype_when_a_float32_copy_would_not_fit(monkeypatch):
    from llama_scratch import devices

    cpu, lines = torch.device("cpu"), []
    monkeypatch.setattr(devices, "free_memory", lambda device: 20 * 2**30)
    assert choose_dtype("auto", cpu, torch.bfloat16, 8_000_000_000, lines.append) == torch.bfloat16
    assert "would not fit" in lines[0] and "--dtype float32" in lines[0]
    assert choose_dtype("auto", cpu, torch.bfloat16, 1_000_000_000, lines.append) == torch.float32
    assert choose_dtype("float32", cpu, torch.bfloat16, 8_000_000_000, lines.append) == torch.float32

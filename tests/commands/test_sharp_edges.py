"""What a new user hit with their own files and the `llama-scratch` command, round two: each test runs the command
with the flags they typed. A resume with nothing to resume, refused before anything loads; a misspelt flag in one
line; warnings and progress that read well in a log; the parameters of a quantized model; test figures that match
classify's; a table of ids and texts; plan advice that finds the one-card recipe; where runs/latest points."""

import csv
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llama_scratch import __main__ as cli
from llama_scratch import finetune_classifier, finetune_data, finetune_settings
from llama_scratch.checkpoints import progress
from llama_scratch.checkpoints.run_record import RECORD_FILE, RUN_MARKER
from llama_scratch.data.labelled import load_sms_spam
from llama_scratch.model.counts import count_parameters
from llama_scratch.model.lora import LoRASettings
from tests.commands.test_finetune import args_for, run_module

ROOT = Path(__file__).resolve().parents[2]


def sms_rows(n: int, start: int = 0) -> list[tuple[str, str]]:
    """n real SMS messages from `start` on, half spam, half ham, as (text, label)."""
    sms = load_sms_spam()
    ham = [t for t, y in zip(sms.texts, sms.labels, strict=True) if y == 0][start : start + n // 2]
    spam = [t for t, y in zip(sms.texts, sms.labels, strict=True) if y == 1][start : start + n - n // 2]
    return [(t, "ham") for t in ham] + [(t, "spam") for t in spam]


def write_csv(path: Path, header: list[str], rows: list) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def one_error_line(err: str) -> str:
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


# ---------------------------------------------------------------------------------------------- 1, 2: --resume


def test_resume_of_a_missing_or_finished_run_is_refused_before_anything_loads(tmp_path, monkeypatch, capsys):
    """`finetune --resume --output DIR` where DIR does not exist trained a new run on SMS; on a finished run it read
    and printed the data first. Both are one line and exit 2 now, with no data read and nothing created."""

    def no_data(*args, **kwargs):
        raise AssertionError("the data was read before --resume was refused")

    monkeypatch.setattr(finetune_data, "load_dataset", no_data)
    missing = tmp_path / "never-started"
    assert cli.main(["finetune", "--resume", "--output", str(missing)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "does not exist" in one_error_line(err) and str(missing) in err
    assert not missing.exists()

    finished = tmp_path / "finished"
    finished.mkdir()
    (finished / RUN_MARKER).write_text("llama_scratch fine-tuning run\n")
    (finished / RECORD_FILE).write_text("{}")
    assert cli.main(["finetune", "--resume", "--output", str(finished)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "finished run" in one_error_line(err) and "nothing left to resume" in err

    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["finetune", "--resume", "--output", str(empty)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "no run to continue" in one_error_line(err)
    assert list(empty.iterdir()) == []


# ---------------------------------------------------------------------------------------------- 6: flags


@pytest.mark.slow
def test_a_misspelt_or_shortened_flag_is_one_line_naming_the_nearest(tmp_path, capsys):
    """`--epoch 2` was taken as `--epochs 2` (argparse's prefixes) and a misspelt flag printed the whole usage
    first: every command refuses both in one line, naming the flag meant."""
    r = subprocess.run(
        [sys.executable, "-m", "llama_scratch", "finetune", "--epoch", "2", "--output", str(tmp_path / "o")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stdout == "" and not (tmp_path / "o").exists()
    assert "no flag --epoch (did you mean --epochs?)" in one_error_line(r.stderr) and "usage:" not in r.stderr
    typed = {
        "finetune": (["--lora-rank", "8"], "--lora"),
        "plan": (["--gpu-mem=12"], "--gpu-memory"),
        "classify": (["--checkpoint", "x", "--bach-size", "4", "hi"], "--batch-size"),
        "export": (["--checkpoint", "x", "--output", "y", "--overwrit"], "--overwrite"),
        "generate": (["--max-new", "3", "hi"], "--max-new-tokens"),
        "download": (["smollm2-135m", "--dri", "w"], "--dir"),
        "convert": (["a.gguf", "out", "--forc"], "--force"),
    }
    for command, (argv, meant) in typed.items():
        with pytest.raises(SystemExit) as stopped:
            cli.main([command, *argv])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and f"(did you mean {meant}?)" in one_error_line(err), (command, err)


# ---------------------------------------------------------------------------------------------- 7, 10: a log


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """`finetune` on a CSV with a broken row, its stderr a pipe (as `2> run.log` makes it): no terminal."""
    where = tmp_path_factory.mktemp("logged")
    data = write_csv(where / "mine.csv", ["message", "category"], sms_rows(96))
    with data.open("a", encoding="utf-8") as f:
        f.write("a row with three cells,ham,extra\n")
    out = where / "run"
    return run_module(*args_for(data, out, "--batch-size", "8")), data


@pytest.mark.slow
def test_a_bad_rows_warning_is_its_message_alone(logged_run):
    """The warning showed `.../finetune_args.py:433: DataWarning:` and a line of our source."""
    r, data = logged_run
    assert r.returncode == 0, r.stderr
    warned = [line for line in r.stderr.splitlines() if "bad rows" in line]
    assert warned == [f"warning: {data}: skipped 1 bad rows: line 98: expected 2 columns, found 3"], r.stderr
    assert "DataWarning" not in r.stderr and ".py:" not in r.stderr and "warnings.warn" not in r.stderr


@pytest.mark.slow
def test_progress_in_a_log_is_a_line_per_epoch_not_carriage_returns(logged_run):
    """A redirected log got hundreds of `\\r` redraws an epoch; now each epoch's bar is one line when it ends (a
    long one, also a line a quarter)."""
    r, _ = logged_run
    assert r.returncode == 0 and "\r" not in r.stderr, r.stderr
    epochs = [line for line in r.stderr.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in epochs] == ["epoch 1/2", "epoch 2/2"], r.stderr
    assert all(" 100%|" in line and "loss=" in line for line in epochs), epochs


def test_a_long_bar_in_a_log_writes_a_line_a_quarter(monkeypatch):
    """What a long epoch writes to a log: a line at each quarter, then its last, never a carriage return."""
    monkeypatch.setattr(progress, "LONG_SECONDS", 0.0)
    log = io.StringIO()
    bar = progress.progress_bar(total=8, desc="epoch 1/1", file=log)
    assert isinstance(bar, progress.LineBar)
    for _ in range(8):
        bar.update(1)
        bar.refresh()  # tqdm redraws at most every 0.1 s; each step here asks
    bar.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and [line.split("|")[0] for line in lines] == [
        "epoch 1/1:  25%",
        "epoch 1/1:  50%",
        "epoch 1/1:  75%",
        "epoch 1/1: 100%",
    ]


# ---------------------------------------------------------------------------------------------- 8: --quantize


@pytest.mark.slow
def test_a_quantized_run_counts_every_parameter(tmp_path, capsys):
    """Under --quantize nf4 the log counted the full-precision part only (35M of SmolLM2's 134.5M): the packed
    4-bit weights are buffers, not parameters. Now the total is the model's, and how many of them are in NF4."""
    from llama_scratch import Llama, LlamaConfig
    from llama_scratch.checkpoints.weights import save_checkpoint

    cfg = LlamaConfig.from_name("tiny")
    base = tmp_path / "base"
    save_checkpoint(Llama(cfg), cfg, base)
    data = write_csv(tmp_path / "d.csv", ["text", "label"], sms_rows(40))
    argv = ["--model", str(base), "--data", str(data), "--output", str(tmp_path / "run"), "--max-steps", "1"]
    assert cli.main(["finetune", *argv, "--lora", "4", "--quantize", "nf4", "--max-length", "16"]) == 0
    counts = count_parameters(cfg, train_last=2, lora=LoRASettings(4))  # the model unquantized, on the meta device
    total, trained = counts.total, counts.trainable
    in_blocks = sum(o * i for o, i in counts.frozen_linears)  # what --quantize holds in 4 bits
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("training "))
    assert line.startswith(f"training {trained:,} of {total:,} parameters ({in_blocks:,} of them frozen in nf4)")


# ---------------------------------------------------------------------------------------------- 3, 4: classify


@pytest.fixture(scope="module")
def own_files_run(tmp_path_factory) -> tuple[Path, Path]:
    """A run trained on texts cut to 8 tokens, with validation and test files of its own."""
    where = tmp_path_factory.mktemp("files")
    train = write_csv(where / "train.csv", ["text", "label"], sms_rows(60))
    val = write_csv(where / "val.csv", ["text", "label"], sms_rows(20, start=30))
    test = write_csv(where / "test.csv", ["text", "label"], sms_rows(40, start=40))
    out = where / "run"
    argv = ["--model", "tiny", "--data", str(train), "--val-data", str(val), "--test-data", str(test)]
    argv += ["--output", str(out), "--max-length", "8", "--max-steps", "3", "--lr", "1e-3", "--batch-size", "8"]
    assert finetune_classifier.main(argv) == 0
    return out, test


@pytest.mark.slow
def test_the_test_figures_are_what_classify_says_on_the_same_file(own_files_run, capsys):
    """metrics.json said 80.00% and `classify --labels` on the same test file 80.25%: the run evaluated its test
    texts cut to the training length, classify whole. Both read them whole now, and agree to the text."""
    out, test = own_files_run
    metrics = json.loads((out / "metrics.json").read_text())
    capsys.readouterr()
    assert cli.main(["classify", "--checkpoint", str(out), "--file", str(test), "--labels"]) == 0
    said = capsys.readouterr().out
    correct, n = map(int, re.search(r"accuracy [\d.]+% \((\d+) of (\d+)\)", said).groups())
    assert (correct, n) == (sum(metrics["test_confusion"][k][k] for k in range(2)), metrics["split_sizes"]["test"])
    matrix = [[int(c) for c in line.split()[1:]] for line in said.splitlines()[-2:]]
    assert matrix == metrics["test_confusion"], said
    # The texts cut to the training length would be judged otherwise: the test above can tell the two apart.
    assert cli.main(["classify", "--checkpoint", str(out), "--file", str(test), "--labels", "--max-length", "8"]) == 0
    cut = capsys.readouterr().out
    assert [[int(c) for c in line.split()[1:]] for line in cut.splitlines()[-2:]] != matrix


def test_classify_finds_the_text_beside_an_id_column(own_files_run, tmp_path, capsys):
    """`id,description` was refused ("neither is clearly the label"): classify needs no label, so the column that
    is not an id is the text."""
    out, _ = own_files_run
    rows = [(1000 + i, text) for i, (text, _) in enumerate(sms_rows(6))]
    table = write_csv(tmp_path / "to_score.csv", ["id", "description"], rows)
    capsys.readouterr()
    assert (
        cli.main(["classify", "--checkpoint", str(out), "--file", str(table), "--output", str(tmp_path / "s.csv")]) == 0
    )
    assert "text 'description'" in capsys.readouterr().err
    with (tmp_path / "s.csv").open(newline="", encoding="utf-8") as f:
        scored = list(csv.DictReader(f))
    assert [r["id"] for r in scored] == [str(i) for i, _ in rows] and all(r["predicted"] for r in scored)
    # With --labels a label is wanted, and two columns of distinct values still name none: asked for by name.
    assert cli.main(["classify", "--checkpoint", str(out), "--file", str(table), "--labels"]) == 2
    assert "--label-column" in one_error_line(capsys.readouterr().err)


# ---------------------------------------------------------------------------------------------- 5: --plan


@pytest.mark.slow
def test_plan_offers_lora_on_nf4_for_the_one_card_named(capsys):
    """`plan --model llama3-8b --dtype bfloat16 --gpu-memory 12` offered only --shard on 4 GPUs; LoRA on NF4
    weights fits that one card, and is offered before sharding, and fits when planned as offered."""
    assert cli.main(["plan", "--model", "llama3-8b", "--dtype", "bfloat16", "--gpu-memory", "12"]) == 2
    out = capsys.readouterr().out
    offered = re.findall(r"^    (--\S.*?)\s+needs ([\d.]+) GiB", out, re.MULTILINE)
    flags = [f for f, _ in offered]
    assert "--lora 8 --quantize nf4" in flags and flags[-1].startswith("--shard on "), out
    assert flags.index("--lora 8 --quantize nf4") < flags.index(flags[-1])
    argv = ["plan", "--model", "llama3-8b", "--dtype", "bfloat16", "--gpu-memory", "12", "--lora", "8"]
    assert cli.main([*argv, "--quantize", "nf4"]) == 0
    assert "FITS on the given GPU (12.0 GiB)" in capsys.readouterr().out
    helped = finetune_settings.build_parser()._option_string_actions["--gpu-memory"].help
    assert "GiB" in helped


@pytest.mark.parametrize("batch", [["--batch-size", "64"], ["--batch-tokens", "65536"]], ids=["rows", "tokens"])
def test_plan_advice_changes_the_flag_that_sizes_the_batch(batch, capsys):
    """Activations that do not fit: fewer rows a micro-batch, or under --batch-tokens a smaller budget, with more
    micro-batches a step (the same work a step); never --batch-size for a run that --batch-tokens sizes (it would
    ignore it). The option offered fits when planned as offered."""
    argv = ["plan", "--model", "llama3-8b", "--gpu-memory", "24", "--lora", "8", "--train-last", "all", *batch]
    assert cli.main([*argv, "--max-length", "512"]) == 2
    offered = re.findall(r"^    (--\S.*?)\s+needs ([\d.]+) GiB", capsys.readouterr().out, re.MULTILINE)
    option = offered[0][0]
    if batch[0] == "--batch-size":
        assert re.fullmatch(r"--batch-size \d+ --grad-accum \d+", option), option
        rows, accum = map(int, re.findall(r"\d+", option))
        assert rows * accum == 64
    else:
        assert re.fullmatch(r"--batch-tokens \d+ --grad-accum \d+", option), option
        tokens, accum = map(int, re.findall(r"\d+", option))
        assert tokens * accum == 65536
    kept = [a for a in argv if a not in batch]
    assert cli.main([*kept, "--max-length", "512", *option.split()]) == 0  # fits as offered


def test_plan_counts_the_last_block_at_every_token_under_pooling_mean(capsys):
    """`plan --pooling mean` plans the last block as a full one (the head reads every token), as a run with those
    flags measures (tests/planning/test_plan.py): more activations than the last token's plan, and says why."""
    argv = ["plan", "--model", "llama3-8b", "--train-last", "2", "--max-length", "256"]
    saved = {}
    for pooling in ("last", "mean"):
        assert cli.main([*argv, "--pooling", pooling]) == 0
        row = re.search(r"^  activations\s+([\d.]+) GiB\s+(.*)$", capsys.readouterr().out, re.MULTILINE)
        saved[pooling] = (float(row[1]), row[2])
    assert saved["mean"][0] > saved["last"][0]
    assert "2 full block(s)" in saved["mean"][1] and "--pooling mean" in saved["mean"][1]
    assert "1 full block(s)" in saved["last"][1] and "the last block" in saved["last"][1]


# ---------------------------------------------------------------------------------------------- 9: runs/latest


@pytest.mark.slow
def test_runs_latest_follows_generated_folders_only_and_a_bare_resume_says_so(tmp_path, monkeypatch, capsys):
    """A run given --output is not what runs/latest points at: a bare --resume then finds an older run, and says
    why and which flag continues the run meant. The docs say so, and no longer that nothing ran on a GPU."""
    monkeypatch.chdir(tmp_path)
    data = write_csv(tmp_path / "d.csv", ["text", "label"], sms_rows(40))
    common = ["--model", "tiny", "--data", str(data), "--max-steps", "1", "--max-length", "16"]
    assert cli.main(["finetune", *common]) == 0  # runs/tiny-d-csv-DATE-TIME, and runs/latest at it
    generated = (tmp_path / "runs" / "latest").resolve()
    assert cli.main(["finetune", *common, "--output", "mine"]) == 0
    assert (tmp_path / "runs" / "latest").resolve() == generated  # not at mine/
    capsys.readouterr()
    assert cli.main(["finetune", "--resume"]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert generated.name in err and "finished run" in err and "without --output" in err and "--output RUN" in err
    finetuning = (ROOT / "docs" / "finetuning.md").read_text()
    assert "a run given `--output` is not followed" in finetuning
    assert "None of this has run on a GPU" not in (ROOT / "docs" / "scaling.md").read_text()

"""What a new user meets on their first day with their own files: no silent truncation, one folder per run, a run
that still works after moving, one-line device errors. Each test failed on the version before these changes."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from llama_scratch import Llama, LlamaConfig, classify, finetune_classifier
from llama_scratch.checkpoints.weights import save_checkpoint
from llama_scratch.sources.devices import choose_dtype
from tests.commands.test_finetune import args_for

pytest_plugins = ["tests.smollm2"]  # the SmolLM2 fixtures: smollm2_dir


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_asking_for_a_missing_gpu_is_one_line(small_csv, tmp_path):
    if torch.cuda.is_available():
        return  # the message is for machines without one
    for module, argv in (
        ("finetune_classifier", ["--model", "tiny", "--data", str(small_csv), "--output", str(tmp_path / "o")]),
        ("classify", ["--checkpoint", str(tmp_path), "hello"]),
    ):
        r = subprocess.run(
            [sys.executable, "-m", f"llama_scratch.{module}", *argv, "--device", "cuda"], capture_output=True, text=True
        )
        assert (
            r.returncode == 2 and r.stderr.strip() == "error: --device cuda: no CUDA GPU is visible; use --device cpu"
        )


def test_auto_dtype_keeps_the_stored_dtype_when_a_float32_copy_would_not_fit(monkeypatch):
    from llama_scratch.sources import devices

    cpu, lines = torch.device("cpu"), []
    monkeypatch.setattr(devices, "free_memory", lambda device: 20 * 2**30)
    assert choose_dtype("auto", cpu, torch.bfloat16, 8_000_000_000, lines.append) == torch.bfloat16
    assert "would not fit" in lines[0] and "--dtype float32" in lines[0]
    assert choose_dtype("auto", cpu, torch.bfloat16, 1_000_000_000, lines.append) == torch.float32
    assert choose_dtype("float32", cpu, torch.bfloat16, 8_000_000_000, lines.append) == torch.float32


def test_a_resume_point_holds_only_what_trains(tmp_path):
    """On CPU the trained tensors are views of the memory-mapped checkpoint; a resume point must still hold their
    own bytes only (torch.save wrote the whole mapped file: 595 MB instead of ~85 MB for the default job)."""
    from llama_scratch import LlamaClassifier
    from llama_scratch.sources import resolve as sources
    from llama_scratch.training import loop as train

    cfg = LlamaConfig.from_name("tiny")
    save_checkpoint(Llama(cfg), cfg, tmp_path / "base")
    clf = LlamaClassifier(sources.load_model(tmp_path / "base"), num_classes=2, train_last=1)
    s = train.TrainSettings()
    opt = train.make_optimizer(clf, s)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    for p in clf.trainable_parameters().values():  # one step, so AdamW has its moments
        p.grad = torch.ones_like(p)
    opt.step()
    path = tmp_path / "resume.safetensors"
    train.save_resume_point(path, clf, opt, sched, train.TrainState(), s, {})
    trained = sum(p.numel() * p.element_size() for p in clf.trainable_parameters().values())
    state = sum(t.numel() * t.element_size() for v in opt.state.values() for t in v.values() if t.dim())
    checkpoint = (tmp_path / "base" / "model.safetensors").stat().st_size
    assert trained < checkpoint / 4  # the test means something: the mapped file is far larger
    assert path.stat().st_size <= 1.5 * trained + state, (path.stat().st_size, trained, state)


def test_every_option_names_one_default_and_it_is_the_code_s():
    import argparse
    import dataclasses

    from llama_scratch.finetune_settings import build_parser
    from llama_scratch.training.loop import TrainSettings

    parser_actions = build_parser()._actions
    settings = {f.name: f.default for f in dataclasses.fields(TrainSettings)}
    for action in parser_actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or action.dest == "help":
            continue
        flag, name = action.option_strings[0], action.dest.split(".")[-1]
        if isinstance(action, argparse._StoreTrueAction) or flag in ("--resume", "--overwrite", "--plan"):
            continue
        assert action.help.count("default") == 1, f"{flag}: {action.help}"
        if name in settings and name != "class_weights":  # "none" on the command line, None inside
            value = settings[name]
            if action.default is not None:  # the flag's default is the recipe's
                assert action.default == value, flag
            if value is not None:  # and the help names it
                shown = f"{value:g}" if isinstance(value, float) else str(value)
                assert f"default: {shown}" in action.help, f"{flag}: {action.help}"
    assert finetune_classifier.parse_args([]).recipe.epochs is None  # raised for small data unless given


@pytest.mark.parametrize(
    "flags, scratch, lr",
    [
        ([], False, 1e-3),  # the default recipe: the last 2 blocks
        (["--train-last", "1"], False, 1e-3),
        (["--train-last", "0"], False, 1e-3),  # the head alone
        (["--train-last", "4"], False, 2e-4),  # more pretrained blocks whole: smaller steps
        (["--train-last", "all"], False, 2e-4),
        (["--train-last", "all", "--lora", "8"], False, 1e-3),  # adapters start from nothing
        ([], True, 1e-3),  # random weights: every block, from nothing
        (["--train-last", "4", "--lr", "5e-4"], False, 5e-4),  # typed: kept
    ],
)
def test_the_default_rate_follows_what_trains(flags, scratch, lr):
    from llama_scratch.parallel.strategy import Processes

    args = finetune_classifier.parse_args(["--data", "x.csv", *flags])
    assert finetune_classifier.train_settings(args, scratch, [0, 1] * 520, 2, Processes(), print).lr == lr


def test_small_data_gets_more_epochs_and_a_useless_model_is_called_out():
    from llama_scratch.parallel.strategy import Processes

    args = finetune_classifier.parse_args(["--data", "x.csv"])
    lines = []
    settings = finetune_classifier.train_settings(args, False, [0, 1] * 21, 2, Processes(), lines.append)
    assert settings.epochs == 20 and "20 epochs instead of 5" in lines[0]  # 42 rows: 5 steps an epoch -> 100 steps
    big = finetune_classifier.train_settings(args, False, [0, 1] * 520, 2, Processes(), lines.append)
    assert big.epochs == 5 and len(lines) == 1  # the default job is left as it was
    fixed = finetune_classifier.train_settings(
        finetune_classifier.parse_args(["--epochs", "3"]), False, [0, 1] * 21, 2, Processes(), lines.append
    )
    assert fixed.epochs == 3
    finetune_classifier.warn_if_one_class(0.5, [0, 0, 1, 1], lines.append)
    assert "no better than always answering the commonest class" in lines[-1]
    finetune_classifier.warn_if_one_class(0.75, [0, 0, 1, 1], lines.append)
    assert len(lines) == 2


POSITIVE = [
    "loved",
    "great",
    "wonderful",
    "excellent",
    "fantastic",
    "delightful",
    "superb",
    "brilliant",
    "amazing",
    "perfect",
]
NEGATIVE = [
    "hated",
    "awful",
    "terrible",
    "dreadful",
    "horrible",
    "disappointing",
    "poor",
    "boring",
    "useless",
    "broken",
]
THINGS = ["the film", "this blender", "the hotel", "our dinner", "the service", "this phone"]


def made_up_reviews() -> list[tuple[str, str]]:
    """60 short reviews a person would label at a glance: 30 praising, 30 complaining."""
    rows = []
    for i in range(30):
        thing = THINGS[i % len(THINGS)]
        rows.append((f"{thing.capitalize()} was {POSITIVE[i % 10]}, I would recommend it to anyone.", "pos"))
        rows.append((f"{thing.capitalize()} was {NEGATIVE[i % 10]}, I want my money back.", "neg"))
    return rows


@pytest.mark.slow
def test_sixty_separable_reviews_learn_with_the_default_recipe(smollm2_dir, tmp_path):
    import csv

    data = tmp_path / "small.csv"
    with data.open("w", newline="") as f:
        csv.writer(f).writerows([("review", "sentiment"), *made_up_reviews()])
    out = tmp_path / "run"
    assert finetune_classifier.main(["--data", str(data), "--model", str(smollm2_dir), "--output", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] >= 100  # 42 training rows: the epochs were raised
    assert metrics["test_accuracy"] >= 0.9, metrics


def test_each_process_takes_a_gpu_it_can_see():
    from llama_scratch.parallel.distributed import Processes, process_device
    from llama_scratch.sources.devices import DeviceError

    # Slurm --gpus-per-task: every process sees one GPU (CUDA_VISIBLE_DEVICES of one), local ranks 0..7.
    assert process_device("auto", Processes(rank=13, local_rank=5, world_size=16), gpus=1) == torch.device("cuda", 0)
    # torchrun on a node of 8 GPUs, every process seeing all of them.
    assert process_device("cuda", Processes(rank=13, local_rank=5, world_size=16), gpus=8) == torch.device("cuda", 5)
    assert process_device("auto", Processes(rank=1, local_rank=1, world_size=2), gpus=0) == torch.device("cpu")
    for wrong in ("cuda:3", "cuda"):
        gpus = 8 if wrong == "cuda:3" else 0
        try:
            process_device(wrong, Processes(rank=1, local_rank=1, world_size=2), gpus=gpus)
        except DeviceError as e:
            assert "--device" in str(e)
        else:
            raise AssertionError(f"--device {wrong} under torchrun was accepted")


@pytest.mark.slow
def test_patience_stops_early_and_class_weights_weigh_the_rare_class(tmp_path):
    from llama_scratch import LlamaClassifier
    from llama_scratch.data.batching import TokenizedSplit
    from llama_scratch.parallel.strategy import Processes, Replicated
    from llama_scratch.training import loop as train

    assert train.balanced_weights([0, 0, 0, 1], 2) == [4 / 6, 2.0]
    ids = [[1 + (i * 7 + j) % 100 for j in range(4 + i % 5)] for i in range(24)]
    labels = [int(i % 4 == 0) for i in range(24)]  # one row in four is the rare class
    splits = {"train": TokenizedSplit(ids, labels), "val": TokenizedSplit(ids[:8], labels[:8])}

    def run(**settings):
        torch.manual_seed(0)
        clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), num_classes=2, train_last=1)
        s = train.TrainSettings(batch_size=4, save_every=100, **settings)
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        out.mkdir()
        state = train.train(clf, splits, s, Replicated(), out, log=lambda *a: None)
        return state, clf.head.weight.detach().clone()

    # Learning rate 0: validation never gets better after epoch 1, so patience 1 stops after epoch 2 of 5.
    stopped, _ = run(epochs=5, lr=0.0, patience=1)
    assert [row["epoch"] for row in stopped.history] == [1, 2]
    _, plain = run(epochs=1, lr=1e-3)
    _, weighted = run(epochs=1, lr=1e-3, class_weights=train.balanced_weights(labels, 2))
    assert not torch.equal(plain, weighted)  # the weights reached the loss
    args = finetune_classifier.parse_args(["--class-weights", "balanced"])
    settings = finetune_classifier.train_settings(args, False, labels, 2, Processes(), lambda *a: None)
    assert settings.class_weights == train.balanced_weights(labels, 2)


def test_deterministic_flag_turns_on_deterministic_kernels(monkeypatch):
    """--deterministic (for exact resume on CUDA) asks torch for deterministic kernels and fixes cuBLAS's
    workspace before any CUDA work; the flag is parsed and applied by the command."""
    from llama_scratch.finetune_settings import parse_args

    assert parse_args(["--deterministic"]).compute.deterministic and not parse_args([]).compute.deterministic
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(finetune_classifier, "run", lambda settings, progress=None: None)
    try:
        assert finetune_classifier.main(["--deterministic"]) == 0
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(False)


def test_each_node_makes_the_model_local_once(monkeypatch):
    """Two nodes of two processes, no shared disk: rank 0 fetches first, then rank 2 (the first process of node 2)
    fetches on its own disk; ranks 1 and 3 fetch nothing and take their node's path. An error on rank 0 reaches
    every process, instead of leaving them waiting in a collective."""
    from llama_scratch.parallel import distributed
    from llama_scratch.parallel.distributed import Processes, on_each_node

    node_paths = {0: "/node0/weights/m", 2: "/node2/weights/m"}
    for rank in range(4):
        env, made = Processes(rank=rank, local_rank=rank % 2, world_size=4), []

        def make(rank=rank, made=made):
            made.append(rank)
            return node_paths[rank]

        # What the collectives return (JSON): rank 0's outcome first, then every process's outcome in rank order.
        monkeypatch.setattr(distributed, "broadcast_json", lambda value: {"result": node_paths[0]})
        outcomes = [{"result": node_paths[r]} if r in node_paths else None for r in range(4)]
        monkeypatch.setattr(distributed, "all_gather_json", lambda value, o=outcomes: o)
        assert on_each_node(make, env) == node_paths[rank - rank % 2]
        assert made == ([rank] if rank % 2 == 0 else [])

    def fail():
        raise FileNotFoundError("weights/m: no such file or directory")

    gone = {"error": distributed.error_json(FileNotFoundError("weights/m: gone"))}  # rank 0's, as JSON
    monkeypatch.setattr(distributed, "broadcast_json", lambda value: gone)
    with pytest.raises(FileNotFoundError, match="gone"):
        on_each_node(lambda: "never made", Processes(rank=3, local_rank=1, world_size=4))
    with pytest.raises(FileNotFoundError, match="no such file"):
        on_each_node(fail, Processes())


@pytest.mark.slow
def test_compile_flag_compiles_the_token_wise_modules():
    """--compile wraps every block's feed-forward and norms in torch.compile (attention stays eager); nothing is
    compiled without it. (Compiling itself takes tens of seconds here, so the test stops before the first call.)"""
    from llama_scratch import LlamaClassifier
    from llama_scratch.finetune_classifier import compile_token_wise
    from llama_scratch.finetune_settings import parse_args

    assert parse_args(["--compile"]).compute.compile and not parse_args([]).compute.compile
    clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), num_classes=2)
    assert all(block.ffn._compiled_call_impl is None for block in clf.backbone.blocks)
    compile_token_wise(clf)
    for block in clf.backbone.blocks:
        assert all(m._compiled_call_impl is not None for m in (block.ffn, block.attention_norm, block.ffn_norm))
        assert block.attention._compiled_call_impl is None


@pytest.mark.slow
def test_a_compiled_run_trains_the_weights_an_eager_run_trains(small_csv, tmp_path, monkeypatch):
    """`--compile` end to end as a user types it: two epochs of the last 2 blocks, then the same trained weights and
    figures as the run without it. The compiled graphs (dynamo's capture of each feed-forward and norm, with
    dynamic shapes, and autograd's traced backward) run under aot_eager, PyTorch's own kernels: no C++ compiler,
    and seconds where inductor takes a minute here. Their decompositions may round otherwise than the eager
    modules, so the weights are held to the bound two runs that differ only in the order of float32 sums are held
    to (assert_rounding_apart: 99.9% within steps x lr x sqrt(eps), none beyond 2 x steps x lr)."""
    from torch._dynamo.utils import counters

    from tests.parallel.test_sharding import assert_rounding_apart

    real = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: real(self, **kw, backend="aot_eager"))
    torch._dynamo.reset()
    counters.clear()
    weights, metrics = {}, {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        out = tmp_path / name
        assert finetune_classifier.main(args_for(small_csv, out, "--batch-size", "8", *extra)) == 0
        weights[name] = load_file(out / "classifier.safetensors")
        metrics[name] = json.loads((out / "metrics.json").read_text())
        graphs = counters["stats"]["unique_graphs"]
        assert (graphs > 0) == (name == "compiled"), (name, graphs)  # the compiled run did run compiled modules
    a, b = metrics["eager"], metrics["compiled"]
    assert_rounding_apart(weights["eager"], weights["compiled"], a["steps"], lr=1e-3)
    for key in ("steps", "train_accuracy", "val_accuracy", "test_accuracy", "test_confusion"):
        assert a[key] == b[key], key
    assert a["test_loss"] == pytest.approx(b["test_loss"], abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "module", ["finetune_classifier", "classify", "export_hf", "generate", "download", "convert_gguf"]
)
def test_every_command_starts_without_a_warning(module):
    """`python -m llama_scratch.download --help` began with a RuntimeWarning ("found in sys.modules after import of
    package"): the package's __init__ imported sources, which imports download, before download ran as __main__."""
    command = [sys.executable, "-W", "error", "-m", f"llama_scratch.{module}", "--help"]
    r = subprocess.run(command, capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "" and r.stdout.startswith(f"usage: python -m llama_scratch.{module}")


def test_the_public_names_still_import_from_the_package():
    """The names ARCHITECTURE.md lists, imported lazily now: each one, and `import *`."""
    import llama_scratch
    from llama_scratch import load_model
    from llama_scratch.sources import resolve as sources

    assert sorted(llama_scratch._HOMES) == sorted(llama_scratch.__all__)
    names: dict = {}
    exec("from llama_scratch import *", names)
    assert set(llama_scratch.__all__) <= set(names) and load_model is sources.load_model
    assert set(llama_scratch.__all__) <= set(dir(llama_scratch))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        llama_scratch.nothing  # noqa: B018

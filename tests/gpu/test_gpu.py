"""On a CUDA GPU (`pytest -m gpu`): what the CPU suite cannot show. Weights streamed to the GPU arrive bit for bit; a
bfloat16 step there follows a float32 step on the CPU; packed batches match padded ones in bfloat16; attention at
the training shapes runs a fused kernel, not the math one; torchrun with NCCL trains (with and without --shard);
and a GPU-trained run classifies and exports to transformers with the same logits.

Everything uses a small checkpoint made here, with its own byte-level BPE tokenizer.json, so the GPU machine needs
no network, no llama-models and no gguf. Without a GPU these tests are skipped; LLAMA_SCRATCH_TEST_GPU=cpu runs
them on the CPU in float32 (tests/conftest.py), which checks their logic, not the GPU.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from llama_scratch import Llama, LlamaClassifier, LlamaConfig, classify, export_hf, finetune_classifier
from llama_scratch.checkpoints.weights import load_weights, save_checkpoint
from llama_scratch.data.batching import TokenizedSplit, forward, to_batch
from llama_scratch.model.bpe import PRE_TOKENIZERS, byte_level_bpe_json, token_spelling
from llama_scratch.parallel.strategy import Replicated
from llama_scratch.sources.resolve import load_model
from llama_scratch.training.loop import TrainSettings, make_optimizer, train_step
from llama_scratch.training.optim import MasterWeightAdamW

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]

# A byte-level BPE: the 256 bytes, a few merges, and one special token (end of text, which pads too).
MERGES = [["Ġ", "t"], ["h", "e"], ["Ġt", "he"], ["i", "n"], ["Ġ", "a"], ["e", "r"]]
VOCAB = 256 + len(MERGES) + 1
# head_dim 64 (as SmolLM2's; Llama-3's is 128) and grouped-query attention, 2 query heads per key/value head: the
# attention shapes of the real models, in a model that trains in a fraction of a second.
CFG = LlamaConfig(
    vocab_size=VOCAB, dim=128, n_layers=3, n_heads=2, n_kv_heads=1, ffn_dim=256, max_seq_len=256, dtype=torch.float32
)
# bfloat16 keeps 8 significant bits: one rounding is off by up to 2^-9 of the value. Through three blocks of matrix
# products (accumulated in float32 on GPUs) the errors stay within a few of those per layer.
BF16_RTOL = 2e-2


def write_tokenizer(out: Path) -> None:
    """tokenizer.json and tokenizer_config.json of a small byte-level BPE that both our Tokenizer and transformers'
    AutoTokenizer read (the layout a GGUF's vocabulary is written in, bpe.byte_level_bpe_json)."""
    vocab = {token_spelling(bytes([b])): b for b in range(256)}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    added = [{"id": len(vocab), "content": "<|endoftext|>", **flags}]
    tokenizer_json = byte_level_bpe_json(
        added_tokens=added, pre_tokenizer=PRE_TOKENIZERS["gpt-2"], vocab=vocab, merges=MERGES, ignore_merges=False
    )
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A 'pretrained' checkpoint (random weights, saved in float32) with its tokenizer: what --model is given."""
    out = tmp_path_factory.mktemp("gpu") / "base"
    torch.manual_seed(0)
    save_checkpoint(Llama(CFG), CFG, out)
    write_tokenizer(out)
    return out


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy on the CPU, never a view (.cpu() of a CPU tensor is the tensor itself, which a step would change)."""
    return t.detach().to("cpu", copy=True)


# --- 1, 2: streaming load ------------------------------------------------------------------------------------------

# Tensors of a few MB, so that the copies from the two pinned staging buffers take long enough to overlap the reads.
LOAD_CFG = LlamaConfig(
    vocab_size=8192, dim=512, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=1024, max_seq_len=128, dtype=torch.float32
)


@pytest.fixture(scope="module")
def load_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """The same random weights saved three ways: float32 in one file, bfloat16 in shards, untied float32."""
    root = tmp_path_factory.mktemp("load")
    torch.manual_seed(1)
    model = Llama(LOAD_CFG)
    state = model.state_dict()
    bf16 = {n: t.to(torch.bfloat16) for n, t in state.items()}
    untied = {**state, "lm_head.weight": torch.randn(LOAD_CFG.vocab_size, LOAD_CFG.dim) * 0.02}
    return {
        "float32": save_checkpoint(state, LOAD_CFG, root / "float32"),
        "bfloat16-shards": save_checkpoint(bf16, LOAD_CFG, root / "bf16", max_shard_bytes=4 << 20),
        "untied": save_checkpoint(untied, dataclasses.replace(LOAD_CFG, tie_embeddings=False), root / "untied"),
    }


def assert_loaded_alike(on_device: Llama, on_cpu: Llama, device: torch.device) -> None:
    """Every parameter on `device`, of the CPU load's dtype, equal bit for bit; the tie as on the CPU.

    The rotary tables are not loaded but computed where the model lives (RotaryEmbedding._apply): the GPU's cos/sin
    may differ from the CPU's in the last bit or two, so they get a tolerance of 1e-5 (float32 spacing near 1: 1.2e-7).
    """
    cpu_params = dict(on_cpu.named_parameters())
    assert cpu_params.keys() == dict(on_device.named_parameters()).keys()
    for name, p in on_device.named_parameters():
        assert p.device == device and p.dtype == cpu_params[name].dtype, name
        assert torch.equal(cpu_copy(p), cpu_params[name]), f"{name} differs from the CPU load"
    assert (on_device.lm_head.weight is on_device.embed_tokens.weight) == (
        on_cpu.lm_head.weight is on_cpu.embed_tokens.weight
    )
    for name, b in on_device.named_buffers():
        assert b.device == device and b.dtype == torch.float32, name
        torch.testing.assert_close(cpu_copy(b), dict(on_cpu.named_buffers())[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("saved", ["float32", "bfloat16-shards", "untied"])
def test_streaming_load_onto_the_gpu_equals_the_cpu_load(load_checkpoints, gpu_device, saved, dtype):
    """load_model (from the meta device, through the pinned buffers) and load_weights into a model already on the
    GPU (overwritten in place) both give the CPU's weights exactly: the same bytes, converted the same way
    (round to nearest even, float32 to bfloat16, on either device)."""
    path = load_checkpoints[saved]
    on_cpu = load_model(path, device="cpu", dtype=dtype)
    assert_loaded_alike(load_model(path, device=gpu_device, dtype=dtype), on_cpu, gpu_device)
    with gpu_device:
        there = Llama(dataclasses.replace(LlamaConfig.from_hf(path), dtype=getattr(torch, dtype)))
    before = {n: id(p) for n, p in there.named_parameters()}
    load_weights(there, path, progress=False)
    assert {n: id(p) for n, p in there.named_parameters()} == before  # in place: the same parameters
    assert_loaded_alike(there, on_cpu, gpu_device)


def test_streaming_load_onto_the_second_gpu(load_checkpoints, gpu_device):
    """`cuda:1` means cuda:1: every tensor lands there (not on the current device, cuda:0), bit for bit."""
    if gpu_device.type != "cuda" or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    second = torch.device("cuda", 1)
    for saved in ("float32", "bfloat16-shards"):
        path = load_checkpoints[saved]
        assert_loaded_alike(load_model(path, device="cuda:1"), load_model(path, device="cpu"), second)


# --- 3: a bfloat16 training step against float32 --------------------------------------------------------------------

LR = 1e-3  # the recipe's rate for fresh weights; 8 bfloat16 steps of a weight of 0.02, so no update rounds away


def texts(n: int, seed: int) -> TokenizedSplit:
    """`n` random texts of 5 to 47 tokens (the end-of-text id, which pads, never among them), labels alternating."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 48, (n,), generator=g).tolist()
    ids = [torch.randint(0, VOCAB - 1, (k,), generator=g).tolist() for k in lengths]
    return TokenizedSplit(ids, [i % 2 for i in range(n)], pad_id=VOCAB - 1)


def one_step(base: Path, device: torch.device, dtype: torch.dtype, head: torch.Tensor) -> dict:
    """One optimizer step of the recipe (train_step, clipping, AdamW) on 8 texts, last block trained: the loss, the
    gradient norm, and each trained parameter before and after, in float32 (the float32 master copy when the
    parameters are bfloat16: what the next step continues from)."""
    clf = LlamaClassifier(load_model(base, device=device, dtype=dtype), num_classes=2, train_last=1).train()
    with torch.no_grad():
        clf.head.weight.copy_(head)  # the same head on both devices
    settings = TrainSettings(lr=LR, batch_size=8)
    params = clf.trainable_parameters()
    before = {n: cpu_copy(p).float() for n, p in params.items()}
    opt = make_optimizer(clf, settings)
    sums, _ = train_step(clf, texts(8, seed=3), [list(range(8))], settings, Replicated(device=device))
    norm = torch.nn.utils.clip_grad_norm_(list(params.values()), settings.clip_grad)
    opt.step()
    if isinstance(opt, MasterWeightAdamW):
        stepped = {id(p): m for p, m in zip(opt.model_params, opt.masters, strict=True)}
    else:  # float32 parameters are stepped themselves
        stepped = {id(p): p for p in params.values()}
    after = {n: cpu_copy(stepped[id(p)]).float() for n, p in params.items()}
    for n, p in params.items():  # the model holds its master weights rounded to its dtype
        assert torch.equal(cpu_copy(p), after[n].to(p.dtype)), n
    return {"loss": (sums[0] / sums[2]).item(), "norm": norm.item(), "before": before, "after": after, "opt": opt}


def test_a_bfloat16_step_on_the_gpu_follows_a_float32_step_on_the_cpu(base, gpu_device, gpu_dtype):
    """Loss and gradient norm within 2% (bfloat16's rounding through three blocks, BF16_RTOL; measured on the CPU in
    bfloat16: 0.1%). AdamW's first step moves each weight by about LR x sign(gradient), so where a gradient is near
    zero bfloat16's noise can flip that sign. Hence: the updates point the same way as float32's (cosine over all
    trained weights > 0.95, per tensor > 0.8; measured: 0.99 and 0.94 for a 128-weight norm), and no weight lands
    further from float32's than one flipped step (2 x LR), plus bfloat16's rounding of the starting weight (2^-9 of
    it) and 0.2 x LR to spare (weight decay, float32 sums)."""
    torch.manual_seed(0)
    head = torch.randn(2, CFG.dim) * 0.02
    ref = one_step(base, torch.device("cpu"), torch.float32, head)
    got = one_step(base, gpu_device, gpu_dtype, head)
    if gpu_dtype == torch.bfloat16:  # float32 masters step, not the bfloat16 weights (optim.py)
        assert isinstance(got["opt"], MasterWeightAdamW)
    assert got["loss"] == pytest.approx(ref["loss"], rel=BF16_RTOL)
    assert got["norm"] == pytest.approx(ref["norm"], rel=BF16_RTOL)
    assert len(ref["after"]) == 11  # the last block's 9 tensors, the final norm and the head
    moves, moves_ref = [], []
    for name, want in ref["after"].items():
        moved, moved_ref = got["after"][name] - got["before"][name], want - ref["before"][name]
        assert (moved_ref.abs() > 0.5 * LR).float().mean() > 0.99, name  # the weights moved: the test means something
        cosine = F.cosine_similarity(moved.flatten(), moved_ref.flatten(), dim=0).item()
        assert cosine > 0.8, f"{name}: update cosine {cosine:.3f}"
        gap = (got["after"][name] - want).abs().max().item()
        assert gap <= 2.2 * LR + 2**-9 * ref["before"][name].abs().max().item(), f"{name}: {gap:.2e}"
        moves.append(moved.flatten())
        moves_ref.append(moved_ref.flatten())
    assert F.cosine_similarity(torch.cat(moves), torch.cat(moves_ref), dim=0) > 0.95


# --- 4: packed against padded in bfloat16 ---------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["right", "left"])
def test_packed_equals_padded_on_the_gpu(base, gpu_device, gpu_dtype, side):
    """The packed layout's logits (texts one after another, no padding) equal a padded batch's in the GPU's dtype, to
    3% of the logits' largest size: each layout rounds in its own places (other kernels, other matrix shapes), and
    bfloat16 against float32 on the same weights differs by under 1% of it here (measured on the CPU); a layout bug (a
    text seeing another's tokens, positions not restarting) moves logits by a good part of their size. In float32 on
    the CPU override, tests/model/test_packing.py's 1e-5 holds too."""
    clf = LlamaClassifier(load_model(base, device=gpu_device, dtype=gpu_dtype), num_classes=3, train_last=None).eval()
    data, rows = texts(12, seed=4), list(range(12))
    with torch.no_grad():
        packed = forward(clf, to_batch(data, rows, "packed", gpu_device))
        padded = forward(clf, to_batch(data, rows, side, gpu_device))
    assert packed.device.type == gpu_device.type and packed.dtype == gpu_dtype and packed.shape == (12, 3)
    packed, padded = packed.float(), padded.float()
    scale = padded.abs().max().item()
    assert (padded[:, 0] - padded[:, 1]).abs().max() > 0.1 * scale  # the texts' logits are not all alike
    torch.testing.assert_close(packed, padded, rtol=0, atol=0.03 * scale)


# --- 5: the attention kernel ----------------------------------------------------------------------------------------

FUSED = ("flash_attention", "efficient_attention", "cudnn_attention")


def attention_kernels(run) -> collections.Counter:
    """The scaled_dot_product_attention calls `run()` makes, and the kernels they went to, by the profiler's names of
    the aten operators (recorded on the host, whatever the device): aten::scaled_dot_product_attention once per call,
    then aten::_scaled_dot_product_flash_attention, ..._efficient_attention, ..._cudnn_attention (fused) or
    ..._attention_math (the slow path, float32 scores of T x T per head)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return collections.Counter(e.name for e in prof.events() if "scaled_dot_product" in e.name)


def test_attention_at_the_training_shapes_is_a_fused_kernel(base, gpu_device, gpu_dtype):
    """A training step and an evaluation forward as the loop runs them (packed batches of 8 and 16 texts, the last
    block trained, bfloat16, head_dim 64, grouped-query heads): every attention call goes to flash or the
    memory-efficient kernel, none to the math kernel (float32 T x T scores) nor to cuDNN's, which plans afresh for
    each new length (model.attention_kernels.CUDA_KERNEL_ORDER). No tolerance: a count of kernel calls."""
    clf = LlamaClassifier(load_model(base, device=gpu_device, dtype=gpu_dtype), num_classes=2, train_last=1)
    settings, strategy = TrainSettings(batch_size=8), Replicated(device=gpu_device)
    data = texts(16, seed=5)

    def step_and_evaluate():
        clf.train()
        train_step(clf, data, [list(range(8))], settings, strategy)
        clf.eval()
        with torch.inference_mode():
            forward(clf, to_batch(data, list(range(16)), settings.padding_side, gpu_device))

    seen = attention_kernels(step_and_evaluate)
    calls = seen.pop("aten::scaled_dot_product_attention", 0)
    forwards = {name: n for name, n in seen.items() if not name.endswith("_backward")}
    assert calls == 2 * CFG.n_layers, seen  # the detection saw every block's attention, training and evaluating
    assert sum(forwards.values()) == calls, seen  # and which kernel each call went to
    if gpu_device.type != "cuda":
        pytest.skip(
            f"on the CPU override: the detection works (saw {dict(seen)}), but the CPU's kernels say nothing "
            "about which kernel CUDA chooses"
        )
    assert not [name for name in seen if "math" in name or "cudnn" in name], seen
    assert all(any(kind in name for kind in FUSED) for name in forwards), seen


# --- 6, 7, 8: the commands on the GPU -------------------------------------------------------------------------------


def device_flag(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "cpu"


def finetune_flags(base: Path, data: Path, out: Path, device: torch.device) -> list[str]:
    """finetune_classifier as a user types it: our checkpoint, the SMS sample, a short run of the last block."""
    return [
        "--model",
        str(base),
        "--data",
        str(data),
        "--split",
        "full",
        "--output",
        str(out),
        "--device",
        device_flag(device),
        "--train-last",
        "1",
        "--max-steps",
        "6",
        "--batch-size",
        "8",
        "--max-length",
        "32",
        "--lr",
        "1e-3",
    ]


def torchrun(processes: int, *flags: str) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc_per_node N -m llama_scratch.finetune_classifier FLAGS`, importing this
    checkout's package (PYTHONPATH), as tests/parallel/test_distributed.py runs gloo on the CPU."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(processes),
        "-m",
        "llama_scratch.finetune_classifier",
        *flags,
    ]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def assert_trained(run: Path, base: Path, device: torch.device, dtype: torch.dtype, world_size: int) -> dict:
    """The run finished (metrics.json and classifier.json are written last), on `device` in `dtype`, took its 6 steps
    with finite losses, and its trained weights moved away from the base's (exactly: any step changes them)."""
    metrics = json.loads((run / "metrics.json").read_text())
    assert (run / "classifier.json").is_file() and (run / "history.csv").is_file()
    assert metrics["steps"] == 6 and metrics["world_size"] == world_size, metrics
    assert metrics["device"].startswith(device.type) and metrics["dtype"] == str(dtype).removeprefix("torch."), metrics
    assert all(0 < metrics[f"{split}_loss"] < 10 for split in ("train", "val", "test")), metrics
    trained = load_file(run / "classifier.safetensors")
    start = load_file(base / "model.safetensors")
    block = f"backbone.blocks.{CFG.n_layers - 1}.ffn.down_proj.weight"
    assert trained[block].dtype == dtype
    before = start[f"model.layers.{CFG.n_layers - 1}.mlp.down_proj.weight"].to(dtype)
    assert not torch.equal(trained[block], before), "the last block did not train"
    return metrics


@pytest.mark.slow
def test_torchrun_on_one_gpu_trains_over_nccl(base, small_csv, tmp_path, gpu_device, gpu_dtype):
    """One process under torchrun trains on the GPU and writes the run. One process makes no process group
    (distributed.setup joins one only for several), so this checks torchrun's environment on a GPU, not NCCL
    itself: that needs two GPUs (the --shard test below uses two when there are)."""
    run = tmp_path / "run"
    result = torchrun(1, *finetune_flags(base, small_csv, run, gpu_device))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"on {gpu_device.type}" in result.stdout, result.stdout[-2000:]
    assert_trained(run, base, gpu_device, gpu_dtype, world_size=1)


@pytest.mark.slow
def test_torchrun_with_shard_trains(base, small_csv, tmp_path, gpu_device, gpu_dtype):
    """--shard as a user adds it. On one GPU a --shard run is a plain one (strategy.choose_strategy: alone there is
    nothing to share out), so this checks that the flag is accepted under NCCL and the run completes and is written
    in the same form; on a machine with two GPUs it runs two processes, FSDP2 for real."""
    processes = 2 if gpu_device.type == "cuda" and torch.cuda.device_count() >= 2 else 1
    run = tmp_path / "run"
    result = torchrun(processes, *finetune_flags(base, small_csv, run, gpu_device), "--shard")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_trained(run, base, gpu_device, gpu_dtype, world_size=processes)


@pytest.fixture(scope="module")
def gpu_run(base, small_csv, tmp_path_factory, gpu_device, gpu_dtype) -> Path:
    """A run trained on the GPU by the command (in this process: one less start-up)."""
    run = tmp_path_factory.mktemp("gpu-run") / "run"
    assert finetune_classifier.main(finetune_flags(base, small_csv, run, gpu_device)) == 0
    assert_trained(run, base, gpu_device, gpu_dtype, world_size=1)
    return run


def test_a_gpu_run_classifies_and_exports_with_the_same_logits(gpu_run, tmp_path, gpu_device):
    """classify --checkpoint RUN on the GPU (the training dtype, bfloat16) gives the CPU's float32 probabilities
    within 0.02 (bfloat16's rounding, BF16_RTOL, moves a logit by about 2% of its size and a probability by at
    most a quarter of a logit's change); export_hf's float32 export gives the float32 logits in transformers to
    1e-4, its tokenizer the same ids (tests/commands/test_export.py's checks, on the GPU-trained run)."""
    from tests.commands.test_export import TEXTS, assert_same_classifier

    out_csv = tmp_path / "gpu.csv"
    argv = ["--checkpoint", str(gpu_run), "--device", device_flag(gpu_device), "--output", str(out_csv), *TEXTS]
    assert classify.main(argv) == 0
    with out_csv.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["text"] for r in rows] == TEXTS
    on_gpu = torch.tensor([[float(r["p_ham"]), float(r["p_spam"])] for r in rows])
    clf, tokenizer, _ = classify.load_classifier(gpu_run, device="cpu", dtype="float32")
    on_cpu = classify.predict_proba(clf, tokenizer, TEXTS)
    torch.testing.assert_close(on_gpu, on_cpu.float().cpu(), rtol=0, atol=0.02)
    export = tmp_path / "export"
    assert export_hf.main(["--checkpoint", str(gpu_run), "--output", str(export), "--dtype", "float32"]) == 0
    assert_same_classifier(gpu_run, export)


# --- the memory plan on the real device -----------------------------------------------------------------------------


def test_plan_checks_against_the_gpu_it_finds(base, gpu_device, capsys):
    """--plan on a machine with a GPU checks the plan against that GPU, by name and size, and this small run fits
    (exit 0). On the CPU override, --plan --device cpu plans for the CPU and says it checked nothing."""
    flags = ["--model", str(base), "--max-length", "32", "--plan", "--device", device_flag(gpu_device)]
    assert finetune_classifier.main(flags) == 0
    printed = capsys.readouterr().out
    if gpu_device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        assert f"FITS on {props.name} ({props.total_memory / 2**30:.1f} GiB)" in printed, printed
        assert "bfloat16" in printed
    else:
        assert "planned for the CPU (--device cpu)" in printed, printed

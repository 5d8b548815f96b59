"""A quantized frozen base (model/quantize.py): NF4 against torchao's independent implementation (codes, scales,
dequantized values), the error it costs, the streaming quantized load, QLoRA, and the commands end to end:
finetune_classifier --quantize, classify --checkpoint, export_hf and transformers."""

import csv
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llama_scratch import Llama, LlamaConfig, classify, export_hf, finetune_classifier, load_model
from llama_scratch.checkpoints import weights
from llama_scratch.checkpoints.weights import save_checkpoint
from llama_scratch.data.labelled import load_dataset
from llama_scratch.data.splitting import split_dataset
from llama_scratch.finetune_settings import parse_args, resumed_flags
from llama_scratch.model.classifier import LlamaClassifier
from llama_scratch.model.lora import LoRALinear, add_lora, merge_lora
from llama_scratch.model.quantize import (
    NF4,
    NF4_MIDPOINTS,
    QuantizedLinear,
    dequantize_int8,
    dequantize_linears,
    dequantize_nf4,
    quantize_int8,
    quantize_linears,
    quantize_nf4,
)
from llama_scratch.training.loop import TrainSettings
from tests.commands.test_export import TEXTS, hf_load, logit_gap


def unpack(codes: torch.Tensor) -> torch.Tensor:
    """Packed bytes -> one index per value, the high nibble first (bitsandbytes' and torchao's order)."""
    return torch.stack([codes >> 4, codes & 0xF], -1).reshape(-1)


# --- the format, against torchao ----------------------------------------------------------------------------------


def test_nf4_matches_torchao_codes_scales_and_dequantized_values():
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, get_block_absmax, to_nf4

    w = torch.randn(384, 512) * 0.02
    codes, scales = quantize_nf4(w)
    assert codes.dtype == torch.uint8 and codes.shape == (384, 256) and scales.shape == (384, 8)
    ref = to_nf4(w, block_size=64, scaler_block_size=256)
    # torchao's code book is ours rounded to 4 decimals
    assert torch.allclose(ref.nf4, NF4, atol=5e-5, rtol=0)
    # scales: each block's absolute maximum, exactly
    assert torch.equal(get_block_absmax(w.flatten(), 64), scales.flatten())
    # codes: torchao's nearest-level search (16 distances per value) given our exact levels gives the same bytes
    theirs = NF4Tensor.convert_to_norm_float_weight(w, w.numel() // 64, 64, NF4)
    assert torch.equal(theirs, codes.flatten())
    # with its own rounded levels, only values within 1e-4 of a boundary between two levels may differ
    normed = (w.reshape(-1, 64) / scales.reshape(-1, 1)).flatten()
    differ = unpack(ref.quantized_data) != unpack(codes)
    near = (normed[:, None] - NF4_MIDPOINTS).abs().min(-1).values < 1e-4
    assert not (differ & ~near).any() and differ.sum() < w.numel() * 1e-3
    # dequantized: torchao's own (with its double-quantized scales and levels) from our codes, to float rounding
    ref.quantized_data = codes.flatten()
    ref.nf4 = NF4
    their_scales = ref.dequantize_scalers(ref.quantized_scalers, ref.quantization_factor, ref.scaler_block_size)
    ours = dequantize_nf4(codes, their_scales.reshape(scales.shape))
    assert torch.allclose(ref.get_original_weight(), ours, rtol=1e-6, atol=1e-9)


def test_the_code_book_is_qlora_s_and_zero_stays_zero():
    assert NF4.shape == (16,) and NF4[0] == -1 and NF4[7] == 0 and NF4[15] == 1
    assert (NF4[1:] > NF4[:-1]).all()
    w = torch.randn(4, 128)
    w[1] = 0  # a zero row: scale 0, values 0 (not NaN)
    w[2, :64] = 0
    codes, scales = quantize_nf4(w)
    back = dequantize_nf4(codes, scales)
    assert torch.equal(back[1], torch.zeros(128)) and torch.equal(back[2, :64], torch.zeros(64))
    # every block's largest magnitude is exact (it maps to -1 or 1 times its own scale)
    big = w.reshape(-1, 64).abs().argmax(-1)
    rows = torch.arange(big.numel())
    assert torch.equal(back.reshape(-1, 64)[rows, big], w.reshape(-1, 64)[rows, big])


def test_quantization_error_on_gaussian_weights():
    """NF4 on normal weights: a relative (Frobenius) error of about 0.09-0.10, bound 0.11; int8 per row: ~0.0075,
    bound 0.01. The int8 rounding error is at most half a step per value."""
    w = torch.randn(1024, 1024) * 0.02
    nf4 = dequantize_nf4(*quantize_nf4(w))
    rel = ((nf4 - w).norm() / w.norm()).item()
    assert 0.07 < rel < 0.11, rel
    q, s = quantize_int8(w)
    int8 = dequantize_int8(q, s)
    assert ((int8 - w).norm() / w.norm()).item() < 0.01
    assert ((int8 - w).abs() <= s * 0.5001).all()  # half a step, and float rounding


def test_quantized_linear_computes_with_the_dequantized_weight():
    linear = nn.Linear(128, 32, bias=False)
    layer = QuantizedLinear.from_linear(linear, "nf4")
    assert not list(layer.parameters()) and layer.codes.shape == (32, 64)
    x = torch.randn(3, 128)
    assert torch.allclose(layer(x), x @ layer.dequantized().T, atol=1e-6)
    assert torch.equal(layer.dequantized(), dequantize_nf4(*quantize_nf4(linear.weight.detach())))
    assert layer(x.double()).dtype == torch.float64
    with pytest.raises(ValueError, match="multiple of 64"):
        QuantizedLinear(100, 4, "nf4", torch.float32)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_outputs_and_input_gradients_are_bit_identical_to_plain_autograd(kind, dtype):
    """The layer's own backward (dequantize again, grad_y W) against plain autograd through F.linear on the
    dequantized weight, the computation it replaces: the same bits, for a batch of rows and a [B, T, in] batch."""
    torch.manual_seed(0)
    layer = QuantizedLinear.from_linear(nn.Linear(128, 192, bias=False).to(dtype), kind)
    for shape in [(5, 128), (2, 7, 128)]:
        x = torch.randn(shape, dtype=dtype, requires_grad=True)
        plain_x = x.detach().clone().requires_grad_()
        grad_y = torch.randn(*shape[:-1], 192, dtype=dtype)
        y, plain_y = layer(x), F.linear(plain_x, layer.dequantized(dtype))
        y.backward(grad_y)
        plain_y.backward(grad_y)
        assert torch.equal(y, plain_y) and torch.equal(x.grad, plain_x.grad), shape
    assert not list(layer.parameters()) and not any(b.requires_grad for b in layer.buffers())


def saved_for_backward(forward) -> list[torch.Tensor]:
    """Every tensor autograd saves for backward while `forward()` runs."""
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_autograd_keeps_the_4_bit_codes_not_the_dequantized_weight(dtype):
    """Through an NF4 linear, alone and under a LoRA adapter, with an input that needs a gradient: of what autograd
    saves, nothing is the dequantized weight ([out, in] in the compute dtype) nor as large; the weight is kept as
    the layer's own codes and scales (its buffers: no new memory). Plain autograd on the dequantized weight, the
    path this replaces, saves that weight: the hook would see it."""
    torch.manual_seed(0)
    layer = QuantizedLinear.from_linear(nn.Linear(128, 192, bias=False).to(dtype), "nf4")
    x = torch.randn(3, 5, 128, dtype=dtype, requires_grad=True)
    weight_sized = 192 * 128

    def dense(t: torch.Tensor) -> bool:
        return t.dtype == dtype and t.numel() >= weight_sized

    plain = saved_for_backward(lambda: F.linear(x, layer.dequantized(dtype)))
    assert [t.numel() for t in plain if dense(t)] == [weight_sized]  # W, kept as its transpose [in, out]
    saved = saved_for_backward(lambda: layer(x))
    assert not any(dense(t) for t in saved)
    # all it keeps: its own codes and scales (x's gradient needs the weight only, not x)
    buffers = {layer.codes.data_ptr(), layer.scales.data_ptr()}
    assert len(saved) == 2 and {t.data_ptr() for t in saved} == buffers
    assert {(t.dtype, tuple(t.shape)) for t in saved} == {(torch.uint8, (192, 64)), (torch.float32, (192, 2))}
    adapted = LoRALinear(layer, rank=4, alpha=8)
    owned = {p.data_ptr() for p in adapted.parameters()} | buffers
    saved = saved_for_backward(lambda: adapted(x))
    assert not any(dense(t) for t in saved)
    assert all(t.data_ptr() in owned or t.numel() < weight_sized // 8 for t in saved)  # else activations only


def test_the_linear_matches_torchao_linear_nf4():
    """torchao's `linear_nf4` (forward dequantizes, backward dequantizes again and returns grad_y W) given our codes
    and its own scales, against our layer holding the same: outputs and input gradients to float rounding."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4

    torch.manual_seed(0)
    w = torch.randn(192, 256) * 0.02
    codes, _ = quantize_nf4(w)
    ref = to_nf4(w, block_size=64, scaler_block_size=256)
    ref.quantized_data, ref.nf4 = codes.flatten(), NF4
    their_scales = ref.dequantize_scalers(ref.quantized_scalers, ref.quantization_factor, ref.scaler_block_size)
    layer = QuantizedLinear(256, 192, "nf4", torch.float32)
    layer.codes.copy_(codes)
    layer.scales.copy_(their_scales.reshape(layer.scales.shape))
    x = torch.randn(2, 7, 256, requires_grad=True)
    theirs_x = x.detach().clone().requires_grad_()
    grad_y = torch.randn(2, 7, 192)
    y, theirs = layer(x), linear_nf4(theirs_x, ref)
    y.backward(grad_y)
    theirs.backward(grad_y)
    assert torch.allclose(y, theirs, rtol=1e-5, atol=1e-6)
    assert torch.allclose(x.grad, theirs_x.grad, rtol=1e-5, atol=1e-6)


def test_a_compiled_qlora_layer_computes_what_the_eager_one_does(monkeypatch):
    """--compile compiles each block's feed-forward, quantized projections included: the layer's Function traces
    in one graph (fullgraph) even on its first call on a device, when the code book is first copied there, and
    gives the eager bits. aot_eager: dynamo and autograd's tracing without a C++ compiler."""
    from llama_scratch.model import quantize

    monkeypatch.setattr(quantize, "_NF4_ON", {})
    torch.manual_seed(0)
    layer = LoRALinear(QuantizedLinear.from_linear(nn.Linear(128, 192, bias=False), "nf4"), rank=4, alpha=8)
    with torch.no_grad():
        layer.lora_b.normal_()
    x = torch.randn(3, 128, requires_grad=True)
    eager_x = x.detach().clone().requires_grad_()
    torch._dynamo.reset()
    y = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)
    y.sum().backward()
    eager = layer(eager_x)
    eager.sum().backward()
    assert torch.equal(y, eager) and torch.equal(x.grad, eager_x.grad)


def test_the_levels_are_copied_to_a_device_once(monkeypatch):
    """A copy of the code book in every forward is a blocking copy from host memory on a GPU: the host waits in
    every quantized layer (14 waits a step on an H200 before this, gpu_check 2026-11-26). Once per device."""
    from llama_scratch.model import quantize

    real, copies = quantize.NF4, []

    class Levels:  # the code book, its copies to a device counted
        def to(self, device):
            copies.append(device)
            return real.to(device)

    monkeypatch.setattr(quantize, "NF4", Levels())
    monkeypatch.setattr(quantize, "_NF4_ON", {})
    layer = QuantizedLinear.from_linear(nn.Linear(128, 32, bias=False), "nf4")
    x = torch.randn(3, 128)
    first = layer(x)
    assert torch.equal(layer(x), first) and copies == [torch.device("cpu")]


# --- a quantized model ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny 'pretrained' checkpoint (the Llama-3 vocabulary: its tokenizer is the fallback) with an untied LM
    head, in two shards."""
    path = tmp_path_factory.mktemp("quantize") / "base"
    cfg = LlamaConfig.from_name("tiny", tie_embeddings=False)
    save_checkpoint(Llama(cfg), cfg, path, max_shard_bytes=20_000_000)
    return path


@pytest.mark.slow
def test_the_streaming_load_quantizes_every_frozen_linear_as_from_the_full_weight(base, monkeypatch):
    full = load_model(base)
    monkeypatch.setattr(weights, "QUANTIZE_CHUNK", 64 * 50)  # several row chunks per tensor, one short at the end
    q = load_model(base, quantize="nf4", keep_last=1)
    quantized = {n for n, m in q.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(quantized) == 3 * 7 + 1 and "lm_head" in quantized and "blocks.2.ffn.down_proj" in quantized
    assert type(q.blocks[3].attention.q_proj) is nn.Linear and type(q.embed_tokens) is nn.Embedding
    for name in quantized:
        expected = QuantizedLinear.from_weight(full.get_submodule(name).weight.detach(), "nf4")
        got = q.get_submodule(name)
        assert torch.equal(got.codes, expected.codes) and torch.equal(got.scales, expected.scales), name
    # the quantized model computes what a full-precision model holding the dequantized weights computes
    ids = torch.randint(0, 128_256, (2, 12))
    full_copy = load_model(base)
    quantize_linears(full_copy, "nf4", keep_last=1)
    dequantize_linears(full_copy)
    assert not any(isinstance(m, QuantizedLinear) for m in full_copy.modules())
    with torch.no_grad():
        assert torch.allclose(q(ids), full_copy(ids), atol=1e-5)
        # and differs from the full-precision model by the quantization error: at most 0.3 of the logits' norm
        # here (random weights of std 0.02 through 4 blocks; ~0.19 measured)
        gap = ((q(ids) - full(ids)).norm() / full(ids).norm()).item()
        int8 = load_model(base, quantize="int8")
        gap8 = ((int8(ids) - full(ids)).norm() / full(ids).norm()).item()
    assert 0.01 < gap < 0.3 and gap8 < 0.03, (gap, gap8)


def test_every_quantized_layer_is_allocated_before_the_first_weight_is_read(base, monkeypatch):
    """The loader allocates all the quantized layers' codes and scales first, so that on the CPU they do not land
    among the heap holes that the row chunks' temporaries leave (which let the load's resident memory climb far
    above what it ends with: benchmarks/load_memory.py samples it during the load). Each layer once, all before
    the first chunk is quantized."""
    events = []
    real_fill, real_to_empty = QuantizedLinear.fill_rows, QuantizedLinear.to_empty

    def fill_rows(self, start, rows):
        events.append("fill")
        real_fill(self, start, rows)

    def to_empty(self, *args, **kwargs):
        events.append("allocate")
        return real_to_empty(self, *args, **kwargs)

    monkeypatch.setattr(QuantizedLinear, "fill_rows", fill_rows)
    monkeypatch.setattr(QuantizedLinear, "to_empty", to_empty)
    monkeypatch.setattr(weights, "QUANTIZE_CHUNK", 64 * 50)  # several chunks per weight
    q = load_model(base, quantize="nf4", keep_last=1)
    layers = [m for m in q.modules() if isinstance(m, QuantizedLinear)]
    first = events.index("fill")
    assert events[:first] == ["allocate"] * len(layers) and "allocate" not in events[first:]
    assert events.count("fill") > len(layers)


def test_a_tied_head_stays_the_embedding():
    model = Llama(LlamaConfig.from_name("tiny", vocab_size=512))
    names = quantize_linears(model, "int8")
    assert "lm_head" not in names and model.lm_head.weight is model.embed_tokens.weight
    with pytest.raises(ValueError, match="quantize is one of nf4, int8"):
        quantize_linears(model, "fp4")


def test_qlora_trains_adapters_over_the_quantized_weights_and_merges(base):
    q = load_model(base, quantize="nf4")
    clf = LlamaClassifier(q, num_classes=2, train_last=2, lora=None)
    add_lora(q, 4, blocks=[3])
    layer = q.blocks[3].attention.q_proj
    assert isinstance(layer, LoRALinear) and isinstance(layer.quantized, QuantizedLinear) and layer.weight is None
    with torch.no_grad():
        layer.lora_b.normal_()
    x = torch.randn(5, 64)
    expected = layer.quantized(x) + layer.scale * (x @ layer.lora_a.T @ layer.lora_b.T)
    assert torch.allclose(layer(x), expected, atol=1e-5)
    layer(x).sum().backward()
    assert layer.lora_a.grad is not None and layer.lora_b.grad is not None
    merged = layer.merge()
    assert torch.allclose(merged(x), expected, atol=1e-5) and not merged.weight.requires_grad
    merge_lora(clf)  # every other adapter too: plain layers again
    assert not any(isinstance(m, LoRALinear) for m in clf.modules())


def test_the_frozen_prefix_cache_runs_the_quantized_blocks(base):
    clf = LlamaClassifier(load_model(base, quantize="nf4", keep_last=1), num_classes=2, train_last=1).eval()
    ids = torch.randint(0, 128_256, (3, 10))
    with torch.no_grad():
        states = clf.frozen_prefix(ids)
        assert torch.allclose(clf(None, frozen_states=states), clf(ids), atol=1e-5)
    assert {n for n, p in clf.named_parameters() if p.requires_grad} >= {"backbone.blocks.3.attention.q_proj.weight"}


# --- the commands ---------------------------------------------------------------------------------------------------


def finetune(base, data, run, *flags) -> int:
    argv = ["--model", str(base), "--data", str(data), "--output", str(run), "--max-steps", "3", *flags]
    return finetune_classifier.main(argv + ["--batch-size", "8", "--max-length", "32"])


def test_quantize_needs_frozen_pretrained_weights(base, small_csv, tmp_path, capsys):
    assert finetune("tiny", small_csv, tmp_path / "a", "--quantize", "nf4") == 2
    assert "a model trained from random weights has none" in capsys.readouterr().err
    assert finetune(base, small_csv, tmp_path / "b", "--quantize", "nf4", "--train-last", "all") == 2
    assert "--quantize needs frozen weights" in capsys.readouterr().err


@pytest.mark.slow
def test_classify_refuses_to_quantize_a_run_trained_from_random_weights(small_csv, tmp_path, capsys):
    """Such a run trained every weight: there is no frozen base, and --quantize must not be silently ignored."""
    assert finetune("tiny", small_csv, tmp_path / "run", "--train-last", "all", "--max-steps", "1") == 0
    capsys.readouterr()
    assert classify.main(["--checkpoint", str(tmp_path / "run"), "--quantize", "nf4", "a text"]) == 2
    err = capsys.readouterr().err
    assert "trained from random weights and has none" in err and len(err.strip().splitlines()) == 1


def test_a_resume_with_another_quantize_is_refused(tmp_path):
    args = parse_args(["--quantize", "int8", "--resume", "--output", str(tmp_path)])
    with pytest.raises(ValueError, match="--quantize was 'nf4', now 'int8'"):
        resumed_flags(args, {"quantize": "nf4"}, tmp_path)  # a record of version 1: flat, by the flags' names


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--lora", "8"], ["--train-last", "1"]], ids=["qlora", "train-last-1"])
def test_a_quantized_run_classifies_as_it_evaluated_and_exports(base, small_csv, tmp_path, flags):
    run, out, scored, test_csv = tmp_path / "run", tmp_path / "export", tmp_path / "scored.csv", tmp_path / "t.csv"
    assert finetune(base, small_csv, run, "--quantize", "nf4", *flags) == 0
    record = json.loads((run / "classifier.json").read_text())
    metrics = json.loads((run / "metrics.json").read_text())
    assert record["quantize"] == "nf4"
    # classify --checkpoint RUN rebuilds the same quantized base: the run's test split scores as it evaluated
    data = load_dataset(str(small_csv))
    test = split_dataset(data, protocol=metrics["split"], seed=TrainSettings().seed)["test"]
    with test_csv.open("w", newline="") as f:
        labels = [data.label_names[y] for y in test.labels]
        csv.writer(f).writerows([["message", "category"], *zip(test.texts, labels, strict=True)])
    # The texts read whole, as the run evaluates them.
    argv = ["--checkpoint", str(run), "--file", str(test_csv), "--labels", "--output", str(scored)]
    assert classify.main([*argv, "--device", "cpu", "--dtype", "float32"]) == 0
    with scored.open(newline="") as f:
        rows = list(csv.DictReader(f))
    names = metrics["label_names"]
    # the scored file keeps the input's own columns: its labels are under "category"
    confusion = [[sum(r["category"] == a and r["predicted"] == b for r in rows) for b in names] for a in names]
    assert confusion == metrics["test_confusion"]
    clf, tokenizer, _ = classify.load_classifier(run, device="cpu", dtype="float32")
    assert isinstance(clf.backbone.blocks[0].ffn.up_proj, (QuantizedLinear, LoRALinear))
    # export_hf writes the full-precision base plus the trained weights: transformers answers as the same run on
    # an unquantized base does, and differs from the quantized model by the quantization error only
    assert export_hf.main(["--checkpoint", str(run), "--output", str(out), "--dtype", "float32"]) == 0
    model, _ = hf_load(out)
    ids = [tokenizer.encode(t, bos=True) for t in TEXTS]
    full_run = tmp_path / "full-run"
    shutil.copytree(run, full_run)
    record["quantize"] = None
    (full_run / "classifier.json").write_text(json.dumps(record))
    full, _, _ = classify.load_classifier(full_run, device="cpu", dtype="float32")
    assert logit_gap(full, model, ids, tokenizer.pad_id, "right") < 1e-4
    gap = logit_gap(clf, model, ids, tokenizer.pad_id, "right")
    with torch.no_grad():
        scale = max(full(torch.tensor([x])).abs().max().item() for x in ids)
    assert 0 < gap < 0.3 * max(scale, 1e-3), (gap, scale)

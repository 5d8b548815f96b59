"""--plan with a quantized base (--quantize nf4|int8): the bytes the quantized layout holds, counted by hand; what
autograd keeps of a quantized weight (its codes, no dequantized copy); the command as a user types it; and
docs/scaling.md's quantized table."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from llama_scratch import Llama, LlamaClassifier, LlamaConfig
from llama_scratch import finetune_classifier as command
from llama_scratch.model.lora import LoRASettings, lora_layers
from llama_scratch.model.quantize import QuantizedLinear, quantize_linears
from llama_scratch.planning.memory import GiB, PlanInputs, plan_memory

# Every linear's input a multiple of 64 (NF4's block), and an untied lm_head unless a test ties it.
TINY = LlamaConfig(
    vocab_size=320, dim=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=64, dtype=torch.float32
)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def hand_count(clf: LlamaClassifier, kind: str, quantized_blocks: range) -> tuple[int, int]:
    """(bytes of the quantized layout, elements of everything else), by name: the seven projections of each block
    in `quantized_blocks` and an untied lm_head, laid out as model/quantize.py stores them: NF4 codes [out, in / 2]
    uint8 and scales [out, in / 64] float32; int8 values [out, in] and scales [out, 1] float32."""
    cfg, held, names = clf.backbone.cfg, 0, set()
    shapes = {"q_proj": (cfg.n_heads * cfg.head_dim, cfg.dim), "k_proj": (cfg.n_kv_heads * cfg.head_dim, cfg.dim)}
    shapes |= {"v_proj": shapes["k_proj"], "o_proj": (cfg.dim, cfg.n_heads * cfg.head_dim)}
    shapes |= {"gate_proj": (cfg.ffn_dim, cfg.dim), "up_proj": (cfg.ffn_dim, cfg.dim)}
    shapes["down_proj"] = (cfg.dim, cfg.ffn_dim)
    where = {p: ("attention" if p[0] in "qkvo" else "ffn") for p in PROJECTIONS}
    linears = {f"blocks.{i}.{where[p]}.{p}.weight": shapes[p] for i in quantized_blocks for p in PROJECTIONS}
    if not cfg.tie_embeddings:
        linears["lm_head.weight"] = (cfg.vocab_size, cfg.dim)
    for name, (out, inp) in linears.items():
        names.add(name)
        held += out * inp // 2 + 4 * out * inp // 64 if kind == "nf4" else out * inp + 4 * out
    rest = sum(p.numel() for n, p in clf.named_parameters() if n.removeprefix("backbone.") not in names)
    return held, rest


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("lora", [None, LoRASettings(4)])
def test_quantized_weights_are_the_layout_counted_by_hand(kind, tie, lora):
    """The plan's weights against the layout counted by name on a meta-device classifier: without LoRA the frozen
    blocks' projections are quantized (the trained block stays whole), with LoRA every block's; a tied lm_head is
    the embedding and stays, the head and norms stay."""
    cfg = dataclasses.replace(TINY, tie_embeddings=tie)
    with torch.device("meta"):
        clf = LlamaClassifier(Llama(cfg), num_classes=3, train_last=1, lora=lora)
    rope = sum(b.numel() * b.element_size() for b in clf.backbone.buffers())
    held, rest = hand_count(clf, kind, range(3) if lora else range(2))
    r = PlanInputs(cfg, 2, 16, train_last=1, num_classes=3, device_type="cpu", lora=lora, quantize=kind)
    plan = plan_memory(r)
    assert plan.quantized == held and plan.weights == held + 4 * rest + rope
    bf16 = plan_memory(dataclasses.replace(r, dtype=torch.bfloat16))
    assert bf16.weights == held + 2 * rest + rope  # the scales are float32 whatever the compute dtype


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_quantized_lora_blocks_save_no_dequantized_weight(kind):
    """A quantized projection keeps its codes for backward and dequantizes again there (model/quantize.py), so a
    QLoRA step saves what the same LoRA step over full-precision weights saves: the plan's activations are the
    unquantized plan's. Checked on the live model, for the default targets and two subsets (the lowest trained
    block's input needs no gradient: which projections' inputs need one depends on them): no saved tensor is a
    weight that is not the model's own (a parameter, or a layer's codes and scales)."""
    for targets in [("q", "k", "v", "o", "gate", "up", "down"), ("v",), ("down",)]:
        settings = LoRASettings(4, targets=targets)
        torch.manual_seed(0)
        backbone = Llama(TINY)
        quantize_linears(backbone, kind)
        clf = LlamaClassifier(backbone, num_classes=2, train_last=2, lora=settings)
        adapted = lora_layers(clf)
        assert adapted and all(isinstance(m.quantized, QuantizedLinear) for m in adapted)
        owned = {t.untyped_storage().data_ptr() for t in [*clf.parameters(), *clf.buffers()]}
        fresh = []

        def pack(t: torch.Tensor, owned=owned, fresh=fresh) -> torch.Tensor:
            # a weight: 64 or more on both sides, where activations have 15 rows (3 x 5 tokens) or 3 (pooled), and
            # adapters' A x has 4 columns
            if t.dim() == 2 and min(t.shape) >= 64 and t.untyped_storage().data_ptr() not in owned:
                fresh.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            clf(torch.randint(0, TINY.vocab_size, (3, 5)))
        assert fresh == [], targets
        r = PlanInputs(TINY, 3, 5, train_last=2, device_type="cpu", lora=settings, quantize=kind)
        assert plan_memory(r).activations == plan_memory(dataclasses.replace(r, quantize=None)).activations


def plan(argv: list[str], capsys) -> tuple[int, str]:
    code = command.main(["--plan", "--lora", "8", *argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.slow
def test_8b_lora_on_12_gib_is_offered_nf4_which_fits(monkeypatch, capsys):
    """Issue #28: Llama-3-8B with LoRA does not fit 12 GiB in bfloat16 (15 GiB of weights alone); the plan offers
    --quantize nf4, and the same command with it fits and says what it holds."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out = plan(["--model", "llama3-8b", "--gpu-memory", "12"], capsys)
    assert code == 2 and "the first part that does not fit: the bfloat16 weights alone" in out
    offered = re.search(r"^    --quantize nf4 +needs ([\d.]+) GiB", out, re.MULTILINE)
    assert offered and float(offered.group(1)) <= 12
    code, out = plan(["--model", "llama3-8b", "--gpu-memory", "12", "--quantize", "nf4"], capsys)
    assert code == 0 and "FITS on the given GPU (12.0 GiB)" in out
    assert "weights: NF4 (frozen base)" in out and re.search(r"^    of which NF4 +\d", out, re.MULTILINE)
    assert float(figure(out, "needed")) == float(offered.group(1))  # the option offered is this plan


def figure(out: str, part: str) -> str:
    """A part of the plan's table ("weights", "needed") in GiB to one decimal, as the docs table gives it."""
    return f"{float(re.search(rf'^  {part} +([0-9.]+) GiB', out, re.MULTILINE).group(1)):.1f}"


def test_a_quantized_plan_refuses_what_a_run_refuses(capsys):
    """--quantize holds a whole base per GPU (not with --shard) and needs frozen weights (not --train-last all
    without --lora): one line, exit 2, as the run itself refuses them."""
    code, out = plan(["--model", "llama3-8b", "--quantize", "nf4", "--shard", "--world-size", "8"], capsys)
    assert code == 2 and "--quantize with --shard is not supported" in out and "Traceback" not in out
    code = command.main(["--plan", "--model", "llama3-8b", "--train-last", "all", "--quantize", "int8"])
    out = capsys.readouterr().err
    assert code == 2 and "--quantize needs frozen weights" in out and len(out.strip().splitlines()) == 1


def docs_quantized_table() -> list[list[str]]:
    """docs/scaling.md's quantized rows: model and GPU, --quantize, weights, needed, what --plan says."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "scaling.md").read_text()
    rows = re.findall(r"^\| (LoRA rank 8, Llama-3-\d+B, \d+ GiB GPU .*) \|$", page, re.MULTILINE)
    return [row.split(" | ") for row in rows]


@pytest.mark.slow
def test_docs_quantized_table_is_what_the_command_prints(monkeypatch, capsys):
    """Every cell of the quantized table through the command as typed: 8B on 12 GiB in bfloat16 (does not fit,
    offers NF4) and in NF4 (fits), 70B in NF4 on one 80 GiB GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    table = docs_quantized_table()
    assert len(table) == 3
    for name, quantize, weights, needed, says in table:
        model, gpu = re.match(r"LoRA rank 8, Llama-3-(\d+B), (\d+) GiB GPU", name).groups()
        argv = ["--model", f"llama3-{model.lower()}", "--gpu-memory", gpu]
        if quantize != "off":
            argv += ["--quantize", quantize.strip("`")]
        code, out = plan(argv, capsys)
        assert f"{figure(out, 'weights')} GiB" == weights and f"{figure(out, 'needed')} GiB" == needed, name
        if says == "fits":
            assert code == 0 and "FITS" in out
        else:
            assert code == 2 and says == "does not fit: offers `--quantize nf4`"
            assert re.search(r"^    --quantize nf4 +needs", out, re.MULTILINE)


def test_70b_lora_in_nf4_fits_one_80_gib_gpu(capsys):
    """Llama-3-70B's frozen linears in NF4 (69.5 billion weights at 4.5 bits) and the rest in bfloat16: 38.4 GiB,
    and the run fits one 80 GiB GPU; in bfloat16 it needs two, sharded, or NF4."""
    code, out = plan(["--model", "llama3-70b", "--gpu-memory", "80", "--quantize", "nf4"], capsys)
    assert code == 0 and "FITS on the given GPU (80.0 GiB)" in out
    assert "69,501,714,432 in NF4" in out
    r = PlanInputs(LlamaConfig.from_name("llama3-70b"), 8, 512, 2, dtype=torch.bfloat16, lora=LoRASettings(8))
    nf4 = plan_memory(dataclasses.replace(r, quantize="nf4"))
    assert nf4.quantized == 69_501_714_432 // 2 + 4 * 69_501_714_432 // 64
    assert nf4.fits(80 * GiB) and not plan_memory(r).fits(80 * GiB)


# --- --plan and the run disagree on --quantize from random weights ---------------------------------------------------


def test_plan_refuses_quantize_from_random_weights_as_the_run_does(capsys):
    """`finetune --model tiny --train-last 2 --quantize nf4` is refused ("a model trained from random weights has
    none"), and so is the same with --plan, with the same reason (it printed an NF4 plan and exited 0 before)."""
    code = command.main(["--plan", "--model", "tiny", "--train-last", "2", "--quantize", "nf4"])
    printed = capsys.readouterr()
    assert code == 2, printed.out[:400]
    assert "random weights" in printed.err


def test_a_run_from_random_weights_with_quantize_and_train_last_is_refused(small_csv, tmp_path, capsys):
    """The run's side of the pair above: the refusal the plan matches."""
    argv = ["--model", "tiny", "--train-last", "2", "--quantize", "nf4", "--data", str(small_csv)]
    assert command.main([*argv, "--output", str(tmp_path / "o"), "--max-steps", "1"]) == 2
    assert "a model trained from random weights has none" in capsys.readouterr().err

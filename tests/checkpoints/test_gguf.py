"""GGUF import: tensors, config and tokenizer against independent references.

Synthetic GGUF files (written with the gguf package's own writer, in llama.cpp's layout) check names, the q/k
row permutation, each tensor type and the error messages; SmolLM2-135M-Instruct checks the real thing against
transformers loading the same GGUF.
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

import llama_scratch
from llama_scratch import Llama, LlamaConfig, Tokenizer
from llama_scratch.checkpoints.gguf import GGUFError, convert_gguf, unpermute_rows
from llama_scratch.checkpoints.gguf_check import check_gguf
from llama_scratch.convert_gguf import main as convert_main
from llama_scratch.model.bpe import PRE_TOKENIZERS, default_system_prompt, hf_tokenizer_files, token_spelling
from llama_scratch.model.config import RopeScaling
from llama_scratch.model.tokenizer import default_model_path, llama3_special_tokens, read_tiktoken_bpe
from llama_scratch.sources.resolve import load_model

pytest_plugins = ["tests.smollm2"]  # the SmolLM2 fixtures: smollm2_gguf_file, smollm2_dir

Q = gguf.GGMLQuantizationType


def sms_texts() -> list[str]:
    """The texts of the bundled SMS dataset (lines `label<TAB>text`, split on the first TAB)."""
    path = Path(llama_scratch.__file__).parent / "data" / "sms_spam.tsv"
    lines = path.read_text(encoding="utf-8").split("\n")
    return [line.split("\t", 1)[1] for line in lines if "\t" in line]


EDGE_CASES = [
    "",
    " ",
    "  ",
    "     ",
    "\t",
    "\t\t x",
    "\n",
    "\n\n",
    "\r\n",
    "line1\r\nline2\r\n",
    " \n \n",
    "trailing   ",
    "   leading",
    "a  1",
    "a \t 12 b",
    "x\n\n3",
    "0",
    "1234567890",
    "3.14159 + 2,718",
    "٣ ½ ² Ⅻ",
    "😀",
    "👍🏽👨‍👩‍👧 🇫🇷",
    "日本語のテキスト",
    "中文测试，标点。",
    "안녕하세요",
    "مرحبا بالعالم",
    "שלום עולם",
    "Ελληνικά",
    "ﬁ e\u0301 Å",
    "don't I'M we'll 'S",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|>",
    "a<|im_end|>b",
    "<|im_start",
    "\u00a0 \u2009 \u3000 x",
    "\u2028\u2029",
    "\x1c\x1e\x1f",
    "\x00\x01\x7f",
    "a\x04b",
    "...!!!???",
    "$100 & 50%",
    "http://example.com/a?b=1&c=2",
    "x" * 3000,
    " " * 1000,
]


# --- synthetic GGUF files ---------------------------------------------------------------------------------------


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py `permute`: interleave each head's two rotary halves (the reference)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@functools.cache
def toy_vocab() -> tuple[list[str], list[int], list[str]]:
    """A small byte-level BPE vocabulary trained on the SMS texts with Hugging Face `tokenizers`, as GGUF lists
    it: tokens in id order (3 control tokens, the 256 bytes, then one per merge), token types, merges."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe = HFTokenizer(BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.train_from_iterator(sms_texts(), trainer)
    model = json.loads(bpe.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    assert [model["vocab"][t] for t in tokens] == list(range(len(tokens)))
    types = [3 if t in specials else 1 for t in tokens]
    return tokens, types, [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]


def tiny_model(vocab_size: int, tie: bool = True, **overrides) -> Llama:
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=128,
        max_seq_len=256,
        rope_theta=10_000.0,
        norm_eps=1e-5,
        tie_embeddings=tie,
        dtype=torch.float32,
        **overrides,
    )
    torch.manual_seed(0)
    model = Llama(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a swapped norm would show
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def gguf_name(ours: str) -> str:
    for old, new in [
        ("embed_tokens", "token_embd"),
        ("final_norm", "output_norm"),
        ("lm_head", "output"),
        ("blocks.", "blk."),
        ("attention_norm", "attn_norm"),
        ("attention.q_proj", "attn_q"),
        ("attention.k_proj", "attn_k"),
        ("attention.v_proj", "attn_v"),
        ("attention.o_proj", "attn_output"),
        ("ffn.gate_proj", "ffn_gate"),
        ("ffn.up_proj", "ffn_up"),
        ("ffn.down_proj", "ffn_down"),
    ]:
        ours = ours.replace(old, new)
    return ours


def write_gguf(
    path: Path,
    model: Llama,
    qtype=Q.Q8_0,
    *,
    arch: str = "llama",
    pre: str = "smollm",
    tokenizer_model: str = "gpt2",
    types: dict[str, Q] | None = None,
    rope_freqs=None,
) -> Path:
    """`model` as llama.cpp would write it: q/k rows permuted, 2-D weights as `qtype`, norms in F32."""
    cfg = model.cfg
    tokens, token_types, merges = toy_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    state = model.state_dict()
    if cfg.tie_embeddings:
        del state["lm_head.weight"]
    for name, t in state.items():
        t = t.detach().float()
        if "q_proj" in name:
            t = llama_cpp_permute(t, cfg.n_heads)
        elif "k_proj" in name:
            t = llama_cpp_permute(t, cfg.n_kv_heads)
        kind = (types or {}).get(gguf_name(name), qtype if t.ndim == 2 else Q.F32)
        data = t.numpy()
        if kind == Q.F64:
            w.add_tensor(gguf_name(name), data.astype(np.float64))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, kind), raw_dtype=kind)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.numpy().astype(np.float32), raw_dtype=Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def roundtrip(model: Llama, qtype: Q) -> Llama:
    """`model` with every 2-D weight quantized to `qtype` and back: what a converted GGUF must hold."""
    out = tiny_model(model.cfg.vocab_size, tie=model.cfg.tie_embeddings)
    out.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in out.parameters():
            if p.ndim == 2:
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), qtype), qtype)))
    return out


def test_unpermute_rows_inverts_llama_cpp_permute():
    w = torch.randn(4 * 16, 24)
    for heads in (1, 2, 4):
        permuted = llama_cpp_permute(w, heads)
        assert not torch.equal(permuted, w)
        assert torch.equal(unpermute_rows(permuted, heads), w)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_tiny_gguf_converts_to_the_same_model(tmp_path, qtype):
    model = tiny_model(len(toy_vocab()[0]))
    out = convert_gguf(write_gguf(tmp_path / "tiny.gguf", model, qtype), tmp_path / "ckpt", progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "SOURCE.md",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    ours = load_model(out).eval()
    cfg = ours.cfg
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size) == (64, 2, 4, 2, 128, 600)
    assert cfg.tie_embeddings and cfg.rope_theta == 10_000.0 and cfg.rope_scaling is None and cfg.max_seq_len == 256
    expected = roundtrip(model, qtype)
    ids = torch.randint(0, cfg.vocab_size, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), expected(ids), rtol=0, atol=1e-5)
    if qtype == Q.F32:  # lossless: the very same weights
        for (name, a), b in zip(ours.state_dict().items(), model.state_dict().values(), strict=True):
            assert torch.equal(a, b), name


def test_bfloat16_output(tmp_path):
    model = tiny_model(len(toy_vocab()[0]))
    out = convert_gguf(write_gguf(tmp_path / "t.gguf", model, Q.Q8_0), tmp_path / "c", dtype=torch.bfloat16)
    ours = load_model(out)
    assert ours.cfg.dtype == torch.bfloat16 and "bfloat16" in (out / "SOURCE.md").read_text()
    for (name, a), b in zip(ours.state_dict().items(), roundtrip(model, Q.Q8_0).state_dict().values(), strict=True):
        assert torch.equal(a, b.bfloat16()), name


def test_untied_head_and_llama31_rope_scaling(tmp_path):
    """A separate `output.weight` makes an untied head; `rope_freqs.weight` (how llama.cpp stores Llama-3.1's
    scaling) becomes `RopeScaling` again."""
    model = tiny_model(len(toy_vocab()[0]), tie=False, rope_scaling=RopeScaling(factor=8.0))
    # llama.cpp's convert_hf_to_gguf.py: the divisor of each rotary frequency
    factors = []
    for i in range(0, 16, 2):
        wavelen = 2 * math.pi / (1.0 / 10_000.0 ** (i / 16))
        smooth = (8192 / wavelen - 1) / (4 - 1)
        factors.append(1 if wavelen < 8192 / 4 else 8.0 if wavelen > 8192 else 1 / ((1 - smooth) / 8 + smooth))
    path = write_gguf(tmp_path / "t.gguf", model, Q.F32, rope_freqs=torch.tensor(factors))
    ours = load_model(convert_gguf(path, tmp_path / "ckpt", progress=False)).eval()
    assert not ours.cfg.tie_embeddings
    assert ours.cfg.rope_scaling == RopeScaling(factor=8.0)
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), model(ids), rtol=0, atol=1e-5)


def test_unsupported_architecture_is_named(tmp_path, capsys):
    path = write_gguf(tmp_path / "q.gguf", tiny_model(len(toy_vocab()[0])), arch="qwen2")
    with pytest.raises(GGUFError, match=r"architecture 'qwen2' is not supported"):
        convert_gguf(path, tmp_path / "out", progress=False)
    assert convert_main([str(path), str(tmp_path / "out")]) == 1
    assert "architecture 'qwen2' is not supported" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_unsupported_tensor_type_is_named(tmp_path):
    model = tiny_model(len(toy_vocab()[0]))
    path = write_gguf(tmp_path / "f.gguf", model, types={"blk.1.ffn_up.weight": Q.F64})
    with pytest.raises(GGUFError, match=r"F64 \(e\.g\. blk\.1\.ffn_up\.weight\)"):
        convert_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tokenizer_model": "llama"}, r"tokenizer.ggml.model 'llama' is not supported"),
        ({"pre": "deepseek-coder"}, r"tokenizer.ggml.pre='deepseek-coder' is not supported"),
    ],
)
def test_unsupported_tokenizer_is_named(tmp_path, kwargs, message):
    path = write_gguf(tmp_path / "t.gguf", tiny_model(len(toy_vocab()[0])), **kwargs)
    with pytest.raises(GGUFError, match=message):
        convert_gguf(path, tmp_path / "out", progress=False)


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="cannot read as GGUF"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out", progress=False)


@pytest.mark.parametrize("pre", list(PRE_TOKENIZERS))
def test_toy_tokenizer_matches_hf_tokenizers(pre):
    """Our tiktoken regex for each pre-tokenizer = the Hugging Face `tokenizers` library running the
    tokenizer.json we write (Digits / ByteLevel / Split pre-tokenizers, BPE merges in order)."""
    tokens, types, merges = toy_vocab()
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": 2,
    }
    tokenizer_json, config = hf_tokenizer_files(meta)
    ours = Tokenizer.from_hf(tokenizer_json, config)
    reference = HFTokenizer.from_str(json.dumps(tokenizer_json))
    texts = EDGE_CASES + ["the  12 3  123 and  then\n\n1", "it's the 1234 thing", "ééé 你好"] + sms_texts()[:300]
    for text in texts:
        reference.encode_special_tokens = False  # "<|im_end|>" in text is the special token
        assert ours.encode(text, allow_special=True) == reference.encode(text, add_special_tokens=False).ids
        reference.encode_special_tokens = True  # ... or cut up like any text
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False).ids, repr(text)
        assert ours.decode(ours.encode(text)) == text


@pytest.mark.slow
def test_llama3_vocabulary_via_gguf_metadata_matches_default_tokenizer():
    """A Llama-3 GGUF's vocabulary ('llama-bpe') gives the same ids as Meta's tokenizer. (The merges are left
    out here: tiktoken ranks by token id and the merges would only be checked for order.)"""
    ranks = read_tiktoken_bpe(default_model_path())
    special = llama3_special_tokens(len(ranks))
    meta = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "llama-bpe",
        "tokenizer.ggml.tokens": [token_spelling(b) for b in sorted(ranks, key=ranks.get)] + list(special),
        "tokenizer.ggml.token_type": [1] * len(ranks) + [3] * len(special),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": 128000,
        "tokenizer.ggml.eos_token_id": 128009,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}",
    }
    ours = Tokenizer.from_hf(*hf_tokenizer_files(meta))
    meta_tokenizer = Tokenizer.default()
    assert (ours.bos_id, ours.eos_id, ours.chat_format, ours.n_words) == (128000, 128009, "llama3", 128256)
    for text in sms_texts()[:1000] + EDGE_CASES:
        assert ours.encode(text, bos=True) == meta_tokenizer.encode(text, bos=True), repr(text)
        assert ours.encode(text, allow_special=True) == meta_tokenizer.encode(text, allow_special=True)
    dialog = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    assert ours.encode_chat(dialog) == meta_tokenizer.encode_chat(dialog)


# --- SmolLM2-135M-Instruct --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(smollm2_gguf_file):
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf_file.parent, gguf_file=smollm2_gguf_file.name)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.for_checkpoint(smollm2_dir)


@pytest.mark.slow
def test_smollm2_config(smollm2_dir):
    cfg = LlamaConfig.from_hf(smollm2_dir)
    assert (cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim) == (
        49152,
        576,
        30,
        9,
        3,
        1536,
    )
    assert cfg.tie_embeddings and cfg.rope_theta == 100_000.0 and cfg.max_seq_len == 8192
    assert cfg.dtype == torch.float32 and cfg.rope_scaling is None
    assert "apache-2.0" in (smollm2_dir / "SOURCE.md").read_text()


@pytest.mark.slow
def test_smollm2_logits_match_transformers_gguf(smollm2_dir, smollm2_gguf_file, smollm2_tokenizer):
    """Our model from the converted checkpoint = transformers' own GGUF loader (its dequantizer, its
    un-permutation, its Llama), in float32."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf_file.parent, gguf_file=smollm2_gguf_file.name, torch_dtype=torch.float32
    ).eval()
    ours = load_model(smollm2_dir).eval()
    tok = smollm2_tokenizer
    prompts = [
        tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}]),
        tok.encode(sms_texts()[2] + " " + sms_texts()[0]),
    ]
    with torch.no_grad():
        for ids in prompts:
            ids = torch.tensor([ids])
            expected = reference(ids).logits
            torch.testing.assert_close(ours(ids), expected, rtol=0, atol=1e-3)


def smollm_reference(hf_tokenizer):
    """transformers' GGUF tokenizer with the pre-tokenizer llama.cpp's 'smollm' names (each digit on its own,
    then GPT-2's split: SmolLM2's own tokenizer.json). transformers 5.x does not know 'smollm' and falls back
    to GPT-2's split alone, which differs on whitespace runs before a digit (see the next test)."""
    backend = HFTokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return backend


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers_gguf(smollm2_tokenizer, hf_gguf_tokenizer):
    """Token for token over the SMS dataset and the edge cases: special-token strings as text (our default) and
    as special tokens (`allow_special=True`, transformers' default)."""
    reference = smollm_reference(hf_gguf_tokenizer)
    ours = smollm2_tokenizer
    assert ours.n_words == len(hf_gguf_tokenizer) == 49152
    assert ours.bos_id is None  # the GGUF says add_bos_token = false
    assert (ours.eos_id, ours.pad_id, ours.chat_format) == (2, 2, "chatml")
    as_text = smollm_reference(hf_gguf_tokenizer)
    as_text.encode_special_tokens = True  # "<|im_end|>" in text is cut up like any text
    for text in sms_texts() + EDGE_CASES:
        expected = reference.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, allow_special=True) == expected, repr(text)
        assert ours.encode(text) == as_text.encode(text, add_special_tokens=False).ids, repr(text)
        assert ours.decode(expected) == hf_gguf_tokenizer.decode(expected), repr(text)


@pytest.mark.slow
def test_transformers_gguf_tokenizer_differs_only_before_digits(smollm2_tokenizer, hf_gguf_tokenizer):
    """Unpatched, transformers splits SmolLM2 text like GPT-2: "a  1" -> a, Ġ, Ġ, 1 where SmolLM2's own tokenizer
    and llama.cpp give a, ĠĠ, 1; likewise around non-ASCII numerals ("½"). Every other text is tokenized
    identically."""

    def near_numbers(text: str) -> bool:
        return bool(re.search(r"\s\s\d", text)) or any(c.isnumeric() and not c.isascii() for c in text)

    skipped = 0
    for text in sms_texts() + EDGE_CASES:
        if near_numbers(text):
            skipped += 1
            continue
        expected = hf_gguf_tokenizer.encode(text, add_special_tokens=False)
        assert smollm2_tokenizer.encode(text, allow_special=True) == expected, repr(text)
    assert skipped < 10
    assert hf_gguf_tokenizer.encode("a  1", add_special_tokens=False) == [81, 216, 216, 33]
    assert smollm2_tokenizer.encode("a  1") == [81, 256, 33]


@pytest.mark.slow
def test_unspellable_bytes_are_dropped_not_fatal(smollm2_tokenizer, hf_gguf_tokenizer):
    """SmolLM2's vocabulary has no token for a few control bytes (e.g. 0x04); like transformers we drop them."""
    for text in ["a\x04b", "\x1d", "x\x13\x14y"]:
        assert smollm2_tokenizer.encode(text) == hf_gguf_tokenizer.encode(text, add_special_tokens=False)
    assert smollm2_tokenizer.encode("!\x04!\U00050000") == [17, 17]


@pytest.mark.slow
def test_smollm2_chat_template(smollm2_tokenizer, hf_gguf_tokenizer, smollm2_dir):
    template = json.loads((smollm2_dir / "tokenizer_config.json").read_text())["chat_template"]
    system = default_system_prompt(template)
    assert system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    dialog = [{"role": "user", "content": "What is the capital of France?"}]
    expected = hf_gguf_tokenizer.apply_chat_template(dialog, add_generation_prompt=True, return_dict=False)
    assert smollm2_tokenizer.default_system_prompt == system  # the template's own, added when none is given
    assert smollm2_tokenizer.encode_chat(dialog) == list(expected)
    assert smollm2_tokenizer.encode_chat([{"role": "system", "content": system}, *dialog]) == list(expected)
    assert smollm2_tokenizer.eos_id in smollm2_tokenizer.stop_ids


@pytest.mark.slow
def test_converted_checkpoint_loads_in_transformers(smollm2_dir, smollm2_tokenizer):
    """The directory is a valid Hugging Face checkpoint: transformers reads weights and tokenizer alike."""
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    ours = load_model(smollm2_dir).eval()
    ids = torch.tensor([smollm2_tokenizer.encode("Hello world, 123 tokens")])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf_model(ids).logits, rtol=0, atol=1e-3)
    for text in sms_texts()[:500] + EDGE_CASES:
        assert smollm2_tokenizer.encode(text, allow_special=True) == hf_tok.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_smollm2_passes_the_structure_check_quickly(smollm2_gguf_file):
    """The walk that guards gguf.GGUFReader against hostile counts accepts the real file (49152 tokens, 272
    tensors) and costs little next to reading it."""
    start = time.perf_counter()
    check_gguf(smollm2_gguf_file)
    assert time.perf_counter() - start < 5

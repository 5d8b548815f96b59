"""Loading and saving weights: parity with Hugging Face through real checkpoint files, and every way a file breaks."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from llama_scratch.checkpoints import weights
from llama_scratch.checkpoints.hf_layout import (
    TensorToWrite,
    hf_to_ours,
    ours_to_hf,
    read_header,
    tensors_to_write,
    write_safetensors,
)
from llama_scratch.checkpoints.weights import CheckpointError, load_weights, save_checkpoint, save_weights
from llama_scratch.model.config import LlamaConfig
from llama_scratch.model.llama import Llama
from llama_scratch.sources.resolve import load_model

transformers = pytest.importorskip("transformers")

VOCAB = 1000


def small_config(tied: bool, dtype: torch.dtype = torch.float32) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=128,
        max_seq_len=64,
        tie_embeddings=tied,
        dtype=dtype,
    )


def hf_model(cfg: LlamaConfig, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.to_hf_dict())).eval()


def meta_model(cfg: LlamaConfig) -> Llama:
    with torch.device("meta"):
        return Llama(cfg)


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory) -> Path:
    """A real untied float32 checkpoint written by transformers, for the tests that break it."""
    out = tmp_path_factory.mktemp("untied")
    hf_model(small_config(tied=False)).save_pretrained(out)
    return out


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def assert_ready(model: Llama, tied: bool) -> None:
    """Nothing left on meta, the tie kept (or absent), rotary tables in float32."""
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    assert model.rope.cos.dtype == model.rope.sin.dtype == torch.float32


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("sharded", [False, True])
def test_parity_with_hf_through_save_pretrained(tmp_path, ids, tied, sharded):
    cfg = small_config(tied)
    hf = hf_model(cfg)
    hf.save_pretrained(tmp_path, max_shard_size="100KB" if sharded else "10GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    model = meta_model(cfg)
    report = load_weights(model, tmp_path, progress=False)
    assert_ready(model, tied)
    assert report.loaded == len(list(model.parameters())) and (len(report.files) > 1) == sharded
    with torch.no_grad():
        diff = (model(ids) - hf(ids).logits).abs().max().item()
    assert diff < 1e-4


def test_bf16_file_into_float32_model(tmp_path, ids):
    cfg = small_config(tied=False)
    hf = hf_model(cfg).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    model = meta_model(cfg)
    load_weights(model, tmp_path, progress=False)
    assert_ready(model, tied=False)
    assert model.blocks[1].attention.q_proj.weight.dtype == torch.float32
    assert torch.equal(model.blocks[1].attention.q_proj.weight, hf.model.layers[1].self_attn.q_proj.weight.float())
    hf.float()  # bf16 values widened exactly: the same weights in float32
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() < 1e-4


def test_float32_file_into_bf16_model(tmp_path):
    hf = hf_model(small_config(tied=True))
    hf.save_pretrained(tmp_path)
    model = meta_model(small_config(tied=True, dtype=torch.bfloat16))
    load_weights(model, tmp_path, progress=False)
    assert_ready(model, tied=True)
    for ours, theirs in [
        (model.embed_tokens.weight, hf.model.embed_tokens.weight),
        (model.blocks[0].ffn.down_proj.weight, hf.model.layers[0].mlp.down_proj.weight),
    ]:
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs.to(torch.bfloat16))


def test_materialized_model_is_overwritten_in_place(untied_dir, ids):
    cfg = small_config(tied=False)
    model = Llama(cfg)
    before = {n: p for n, p in model.named_parameters()}
    load_weights(model, untied_dir, device="cpu", progress=False)
    assert all(p is before[n] for n, p in model.named_parameters())  # optimizer and DDP references stay valid
    with torch.no_grad():
        assert (model(ids) - hf_model(cfg)(ids).logits).abs().max().item() < 1e-4


def test_copy_and_memory_map_load_the_same_and_training_never_writes_the_file(untied_dir):
    cfg = small_config(tied=False)
    copied, mapped = meta_model(cfg), meta_model(cfg)
    load_weights(copied, untied_dir, mmap=False, progress=False)
    load_weights(mapped, untied_dir, progress=False)
    for (name, a), b in zip(copied.named_parameters(), mapped.parameters(), strict=True):
        assert torch.equal(a, b), name
    before = (untied_dir / "model.safetensors").read_bytes()
    with torch.no_grad():
        for p in mapped.parameters():
            p.mul_(2)  # a private mapping: the write copies the page, the file stays as it was
    assert (untied_dir / "model.safetensors").read_bytes() == before
    assert torch.equal(mapped.final_norm.weight, 2 * copied.final_norm.weight)


def test_save_checkpoint_is_read_by_transformers_and_by_us(tmp_path, ids):
    cfg = small_config(tied=True)
    torch.manual_seed(3)
    ours = Llama(cfg).eval()
    save_checkpoint(ours, cfg, tmp_path, max_shard_bytes=60_000)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    again = meta_model(cfg)
    load_weights(again, tmp_path, progress=False)
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max().item() < 1e-4
        assert torch.equal(again(ids), ours(ids))
    save_checkpoint(ours.state_dict(), cfg, tmp_path)  # unsharded now: the old shards and index must go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_load_model_from_dir_with_dtype_override_and_from_preset(untied_dir):
    model = load_model(untied_dir, device="cpu", dtype="bfloat16", progress=False)
    assert model.cfg.dtype == torch.bfloat16 and model.final_norm.weight.dtype == torch.bfloat16
    assert_ready(model, tied=False)
    tiny = load_model("tiny", device="cpu")
    assert_ready(tiny, tied=True)


def test_load_model_names_what_it_could_not_find(tmp_path):
    with pytest.raises(FileNotFoundError, match="'nowhere' is neither a checkpoint path nor a preset"):
        load_model("nowhere")


def test_name_mapping_both_ways():
    assert hf_to_ours("model.layers.7.self_attn.k_proj.weight") == "blocks.7.attention.k_proj.weight"
    assert hf_to_ours("model.layers.3.mlp.gate_proj.weight") == "blocks.3.ffn.gate_proj.weight"
    assert hf_to_ours("blocks.3.ffn_norm.weight") == "blocks.3.ffn_norm.weight"
    assert hf_to_ours("model.rotary_emb.inv_freq") is None
    assert ours_to_hf("final_norm.weight") == "model.norm.weight"
    assert ours_to_hf("blocks.0.attention_norm.weight") == "model.layers.0.input_layernorm.weight"


# --- broken files ------------------------------------------------------------------------------------------------


def test_truncated_shard_names_the_file(tmp_path, untied_dir):
    ckpt = tmp_path / "ck"
    hf_model(small_config(tied=False)).save_pretrained(ckpt, max_shard_size="100KB")
    shard = sorted(ckpt.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=rf"{shard.name} is truncated: .* ends at byte \d+ but the file has"):
        load_weights(meta_model(small_config(tied=False)), ckpt, progress=False)


def test_garbage_file_is_not_a_safetensors_file(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"<html>rate limited</html>")
    with pytest.raises(CheckpointError, match="model.safetensors is truncated or not a safetensors file"):
        load_weights(meta_model(small_config(tied=False)), tmp_path, progress=False)


def test_missing_shard_listed_in_index(tmp_path):
    ckpt = tmp_path / "ck"
    hf_model(small_config(tied=False)).save_pretrained(ckpt, max_shard_size="100KB")
    gone = sorted(ckpt.glob("model-*.safetensors"))[-1]
    gone.unlink()
    with pytest.raises(CheckpointError, match=rf"lists shard\(s\) missing from .*: {gone.name}"):
        load_weights(meta_model(small_config(tied=False)), ckpt, progress=False)


def test_missing_tensor(tmp_path, untied_dir):
    ckpt = copy_ckpt(untied_dir, tmp_path / "ck")
    state = load_file(ckpt / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_weights(meta_model(small_config(tied=False)), ckpt, progress=False)
    assert "missing: blocks.1.ffn.up_proj.weight (expected shape [128, 64]" in str(err.value)


def test_untied_model_needs_lm_head(tmp_path, untied_dir):
    ckpt = copy_ckpt(untied_dir, tmp_path / "ck")
    state = load_file(ckpt / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing: lm_head.weight(.|\n)*tie_word_embeddings=true"):
        load_weights(meta_model(small_config(tied=False)), ckpt, progress=False)


def test_all_problems_reported_together(tmp_path, untied_dir):
    ckpt = copy_ckpt(untied_dir, tmp_path / "ck")
    state = load_file(ckpt / "model.safetensors")
    state["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(32, 64)
    del state["model.norm.weight"]
    state["model.layers.9.mlp.up_proj.weight"] = torch.zeros(128, 64)
    state["score.weight"] = torch.zeros(2, 64)
    save_file(state, ckpt / "model.safetensors")
    model = meta_model(small_config(tied=False))
    with pytest.raises(CheckpointError) as err:
        load_weights(model, ckpt, progress=False)
    msg = str(err.value)
    assert "does not fit the model (4 problems)" in msg
    assert "missing: final_norm.weight (expected shape [64], file name model.norm.weight)" in msg
    assert "unexpected: model.layers.9.mlp.up_proj.weight (shape [128, 64]) in " in msg
    assert "unexpected: score.weight (shape [2, 64])" in msg
    shape_line = "shape mismatch: blocks.0.attention.q_proj.weight expects [64, 64], found [32, 64]"
    assert f"{shape_line} (model.layers.0.self_attn.q_proj.weight in {ckpt / 'model.safetensors'})" in msg
    assert model.embed_tokens.weight.is_meta  # nothing was loaded: the error comes before any data is read

    report = load_weights(model, ckpt, strict=False, progress=False)
    assert_ready(model, tied=False)
    assert report.missing == ["final_norm.weight", "blocks.0.attention.q_proj.weight"]
    assert torch.equal(model.final_norm.weight, torch.ones(64))  # initialized as for training, not left on meta
    assert len(report.skipped) == 3


def test_extra_rotary_tensors_are_skipped_not_fatal(tmp_path, untied_dir):
    ckpt = copy_ckpt(untied_dir, tmp_path / "ck")
    state = load_file(ckpt / "model.safetensors")
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(state, ckpt / "model.safetensors")
    report = load_weights(meta_model(small_config(tied=False)), ckpt, progress=False)
    assert report.skipped == ["model.layers.0.self_attn.rotary_emb.inv_freq (recomputed by the model)"]


def test_tied_config_with_stored_lm_head(tmp_path, untied_dir):
    ckpt = copy_ckpt(untied_dir, tmp_path / "ck")
    with pytest.raises(CheckpointError, match="lm_head.weight in .* differs from model.embed_tokens.weight"):
        load_weights(meta_model(small_config(tied=True)), ckpt, progress=False)
    state = load_file(ckpt / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, ckpt / "model.safetensors")
    model = meta_model(small_config(tied=True))
    report = load_weights(model, ckpt, progress=False)
    assert report.skipped == ["lm_head.weight (equal to the tied embedding)"]
    assert_ready(model, tied=True)


def test_config_that_does_not_match_the_weights(tmp_path, untied_dir):
    ckpt = copy_ckpt(untied_dir, tmp_path / "ck")
    hf_cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**hf_cfg, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match="missing: blocks.2.attention.q_proj.weight"):
        load_model(ckpt, progress=False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model_type 'gpt2' .* is not a Llama model"),
        ({"hidden_size": None}, r"missing field\(s\) hidden_size"),
    ],
)
def test_wrong_config(tmp_path, untied_dir, change, message):
    ckpt = copy_ckpt(untied_dir, tmp_path / "ck")
    hf_cfg = {**json.loads((ckpt / "config.json").read_text()), **change}
    (ckpt / "config.json").write_text(json.dumps({k: v for k, v in hf_cfg.items() if v is not None}))
    with pytest.raises(ValueError, match=rf"config.json: {message}"):
        load_model(ckpt, progress=False)


def test_no_checkpoint_there(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*python -m llama_scratch.download"):
        load_weights(meta_model(small_config(tied=False)), tmp_path / "nothing", progress=False)
    with pytest.raises(FileNotFoundError, match="no safetensors weights in"):
        load_weights(meta_model(small_config(tied=False)), tmp_path, progress=False)


# --- saving ------------------------------------------------------------------------------------------------------


def test_save_weights_is_atomic(tmp_path):
    path = tmp_path / "head.safetensors"
    save_weights({"a": torch.arange(4.0), "b": torch.ones(2, 2)}, path, metadata={"step": 3})
    assert [p.name for p in tmp_path.iterdir()] == ["head.safetensors"]
    original = path.read_bytes()
    seen_while_writing = []

    def crash():
        seen_while_writing.extend(sorted(p.name for p in tmp_path.iterdir()))
        raise KeyboardInterrupt

    entries = [*tensors_to_write({"a": torch.zeros(4)}), TensorToWrite("b", (2, 2), torch.float32, crash)]
    with pytest.raises(KeyboardInterrupt):
        write_safetensors(path, entries)
    # Only our own temporary name existed meanwhile (safetensors' save_file would have made a `.tmpXXXXXX` of
    # its own, which a killed run leaves behind under a name that is not provably ours), and it is gone now.
    assert seen_while_writing == [f".head.safetensors.{os.getpid()}.tmp", "head.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["head.safetensors"]
    assert path.read_bytes() == original
    assert torch.equal(load_file(path)["a"], torch.arange(4.0))


def test_our_safetensors_writer_is_read_back_by_safetensors(tmp_path):
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7).bfloat16(),
        "i64": torch.tensor(9),
        "u8": torch.arange(5, dtype=torch.uint8),
        "flag": torch.tensor([True, False]),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(4, 6).t(),
    }
    write_safetensors(tmp_path / "x.safetensors", tensors_to_write(tensors), {"note": "kept"})
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    with safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt", "note": "kept"}
    wrong = [TensorToWrite("w", (2,), torch.float32, lambda: torch.zeros(3))]
    with pytest.raises(ValueError, match="w: made torch.float32 \\(3,\\), the header says"):
        write_safetensors(tmp_path / "y.safetensors", wrong)
    assert not (tmp_path / "y.safetensors").exists()
    refused = {
        "metadata that is not a string": (tensors_to_write({"a": torch.zeros(1)}), {"step": 3}),
        "a repeated name": (tensors_to_write({"a": torch.zeros(1)}) * 2, None),
        "the reserved name": (tensors_to_write({"__metadata__": torch.zeros(1)}), None),
        "a dtype safetensors has no name for here": (tensors_to_write({"a": torch.zeros(1, dtype=torch.uint16)}), None),
    }
    for why, (entries, meta) in refused.items():
        with pytest.raises(ValueError, match="not writable as safetensors"):
            write_safetensors(tmp_path / "z.safetensors", entries, meta)
        assert not (tmp_path / "z.safetensors").exists(), why


def test_save_weights_writes_tied_tensors_once(tmp_path):
    model = Llama(small_config(tied=True))
    save_weights(model.state_dict(), tmp_path / "w.safetensors")
    names = load_file(tmp_path / "w.safetensors").keys()
    assert "embed_tokens.weight" in names and "lm_head.weight" not in names
    again = meta_model(small_config(tied=True))
    load_weights(again, tmp_path / "w.safetensors", progress=False)  # our own names load too
    assert torch.equal(again.embed_tokens.weight, model.embed_tokens.weight)
    assert_ready(again, tied=True)


# --- download ----------------------------------------------------------------------------------------------------


def test_download_offline_without_cache_explains(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    from llama_scratch import download

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    assert download.main(["meta-llama/Llama-3.2-1B", "--dir", str(tmp_path / "w")]) == 1
    err = capsys.readouterr().err
    assert "offline mode is on (HF_HUB_OFFLINE=1) and meta-llama/Llama-3.2-1B is not in" in err
    assert "Traceback" not in err


def test_download_special_sources_dispatch(tmp_path, monkeypatch):
    from llama_scratch.sources import fetch as download

    monkeypatch.setitem(download.SPECIAL_SOURCES, "toy-model", lambda out: out / "converted")
    assert download.fetch("toy-model", tmp_path) == tmp_path / "converted"
    assert download.default_dir("meta-llama/Llama-3.2-1B") == Path("weights/Llama-3.2-1B")


def test_download_gated_repo_explains_how_to_get_access(tmp_path, monkeypatch, capsys):
    from huggingface_hub.errors import GatedRepoError

    from llama_scratch import download
    from llama_scratch.sources import fetch

    def gated(repo_id, **kwargs):
        # built without __init__, whose signature (an HTTP response object) changes between huggingface_hub versions
        raise GatedRepoError.__new__(GatedRepoError, "403 Client Error: access to model is restricted")

    monkeypatch.setattr(fetch, "snapshot_download", gated)
    monkeypatch.setattr(fetch, "get_token", lambda: None)
    assert download.main(["meta-llama/Meta-Llama-3-8B", "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "meta-llama/Meta-Llama-3-8B is a gated repository" in err
    assert "https://huggingface.co/meta-llama/Meta-Llama-3-8B" in err and "HF_TOKEN" in err


class FakeCuda:
    """The torch.cuda calls that `Staging` makes, stood in for (no GPU here): every event records the stream it was
    recorded on, every stream the device it belongs to, and the device that was current around each copy."""

    def __init__(self, monkeypatch):
        self.log: list[tuple] = []
        self.current = torch.device("cuda", 0)  # what a command that never calls set_device leaves current
        self.asked: list[int] = []  # the sizes of the pinned buffers asked for
        self.buffers: list = []  # weak references to them
        log, fake = self.log, self

        class Event:
            def __init__(self):
                self.n = sum(1 for entry in log if entry[0] == "record")

            def record(self, stream=None):
                device = fake.current if stream is None else stream  # no stream: the current device's
                log.append(("record", self.n, device))

            def synchronize(self):
                log.append(("wait", self.n))

        @contextlib.contextmanager
        def device(d):
            before, fake.current = fake.current, torch.device(d)
            try:
                yield
            finally:
                fake.current = before

        def pinned(nbytes):
            buffer = torch.zeros(nbytes, dtype=torch.uint8)
            self.asked.append(nbytes)
            self.buffers.append(weakref.ref(buffer))
            return buffer

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "device", device)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: torch.device(d) if d else fake.current)
        monkeypatch.setattr(weights, "pinned_buffer", pinned)
        monkeypatch.setattr(weights, "unpin", lambda buffer: log.append(("unpin", buffer.numel())))


def test_gpu_staging_alternates_two_buffers_and_waits_before_refilling_one(monkeypatch):
    """The pinned double buffer of GPU loads, its GPU parts stood in for: tensors go through the two buffers in
    turn, a buffer is refilled only after the event of its previous copy completed, the bytes arrive intact in
    every dtype, and `finish` waits for the last copies before giving the buffers back."""
    from llama_scratch.checkpoints.hf_layout import TensorInfo

    cuda = FakeCuda(monkeypatch)
    staging = weights.Staging(64, torch.device("cuda", 0))
    sources = [torch.arange(6, dtype=torch.float32), torch.arange(8).bfloat16(), torch.ones(3, 2, dtype=torch.float16)]
    used = []
    for i, src in enumerate(sources):
        e = TensorInfo(f"t{i}", Path("x"), src.dtype, tuple(src.shape), 0, src.numel() * src.element_size())
        staged = staging.take(e)
        used.append(staged.untyped_storage().data_ptr())
        staged.copy_(src)  # what read_into does from the file
        dest = torch.empty(src.shape, dtype=torch.float32)  # on a GPU, in a load
        staging.send(staged, dest)
        assert torch.equal(dest, src.float())
    staging.finish()
    assert used[0] != used[1] and used[0] == used[2]
    steps = [entry[:2] for entry in cuda.log]
    assert steps[:3] == [("record", 0), ("record", 1), ("wait", 0)]  # the third take waits for the first copy
    assert steps[4:] == [("wait", 1), ("wait", 2), ("unpin", 64), ("unpin", 64)]  # copies done, then given back
    assert staging.buffers == []


def test_gpu_staging_gives_back_its_first_buffer_when_the_second_cannot_be_pinned(monkeypatch):
    """cudaHostRegister can fail for the second buffer (too little page-locked memory left): the first, already
    pinned, is unpinned before the error goes on, rather than staying pinned for the life of the process."""
    cuda = FakeCuda(monkeypatch)
    pinned = weights.pinned_buffer

    def second_fails(nbytes):
        if cuda.asked:
            raise RuntimeError("CUDA error: out of memory (cudaHostRegister)")
        return pinned(nbytes)

    monkeypatch.setattr(weights, "pinned_buffer", second_fails)
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        weights.Staging(64, torch.device("cuda", 0))
    assert cuda.asked == [64] and cuda.log == [("unpin", 64)]
    assert [r() for r in cuda.buffers] == [None], "the first buffer outlived the failed staging"


def test_gpu_staging_waits_on_the_stream_of_the_gpu_it_copies_to(monkeypatch):
    """--device cuda:1 with cuda:0 current (no command calls set_device): the copy runs on cuda:1's stream, so the
    event a buffer's refill waits for must be recorded there, not on the current device's stream."""
    from llama_scratch.checkpoints.hf_layout import TensorInfo

    cuda = FakeCuda(monkeypatch)
    staging = weights.Staging(64, torch.device("cuda", 1))
    seen = []

    class Dest(torch.Tensor):  # a destination that notes which device was current when it was copied into
        def copy_(self, src, non_blocking=False):
            seen.append(cuda.current)
            return super().copy_(src)

    for i in range(3):
        e = TensorInfo(f"t{i}", Path("x"), torch.float32, (4,), 0, 16)
        staged = staging.take(e)
        staged.fill_(i)
        staging.send(staged, torch.empty(4).as_subclass(Dest))
    staging.finish()
    recorded = [entry[2] for entry in cuda.log if entry[0] == "record"]
    assert recorded == [torch.device("cuda", 1)] * 3, recorded
    assert seen == [torch.device("cuda", 1)] * 3, seen
    assert cuda.current == torch.device("cuda", 0)  # the current device is left as it was


def test_gpu_load_stages_through_buffers_of_the_largest_tensor_and_frees_them(monkeypatch, untied_dir):
    """The pinned buffers are exactly the largest tensor's bytes (not a power of two above) and none outlives the
    load: pinned memory kept for the process's life is memory no one else can use. The GPU is stood in for by
    making the CPU load stage its bytes as a GPU load does."""
    cuda = FakeCuda(monkeypatch)
    monkeypatch.setattr(weights, "pins", lambda device: True)
    model = meta_model(small_config(tied=False, dtype=torch.bfloat16))  # the float32 file is converted on its way
    weights.load_weights(model, untied_dir, device="cpu", progress=False)
    largest = max(e.nbytes for f in weights.find_checkpoint_files(untied_dir) for e in read_header(f).values())
    assert cuda.asked == [largest, largest]
    assert [r() for r in cuda.buffers] == [None, None], "a staging buffer outlived the load"
    assert [entry for entry in cuda.log if entry[0] == "unpin"] == [("unpin", largest)] * 2
    reference = meta_model(small_config(tied=False))
    weights.load_weights(reference, untied_dir, progress=False, mmap=False)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q.bfloat16()), name


def _status(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field))
    return int(line.split()[1]) * 1024


def test_best_weights_are_read_back_in_place_one_tensor_at_a_time(tmp_path):
    """The best weights of a run trained from random weights (the whole model) read back by `load_trained`: into
    the parameters themselves, one tensor at a time beside them, never a second copy of the model (safetensors'
    load_file put one on the GPU). Counted twice: tensors created (LiveTensorBytes, the dispatcher's view) and
    the process's peak resident memory (which also sees the memory-mapped file that load_file read through)."""
    import sys

    from llama_scratch.model.classifier import LlamaClassifier
    from llama_scratch.parallel.strategy import Replicated

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import gpu_8b

    cfg = LlamaConfig(
        vocab_size=512,
        dim=256,
        n_layers=12,
        n_heads=4,
        n_kv_heads=2,
        head_dim=64,
        ffn_dim=768,
        max_seq_len=64,
        tie_embeddings=True,
        dtype=torch.float32,
    )
    torch.manual_seed(0)
    trained = LlamaClassifier(Llama(cfg), 2, train_last=None)
    save_weights(dict(trained.named_parameters()), tmp_path / "best.safetensors")  # as save_classifier does
    torch.manual_seed(1)
    clf = LlamaClassifier(Llama(cfg), 2, train_last=None)
    named = dict(clf.named_parameters())
    places = {n: p.data_ptr() for n, p in named.items()}
    full = sum(p.numel() * p.element_size() for p in named.values())  # 38 MB in 111 tensors
    largest = max(p.numel() * p.element_size() for p in named.values())  # 0.75 MB
    with gpu_8b.LiveTensorBytes():  # its first use costs tens of MB (the dispatcher's Python side): paid here
        torch.ones(1).add_(1)
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    before = _status("VmRSS:")
    with gpu_8b.LiveTensorBytes() as live:
        Replicated().load_trained(clf, named, tmp_path / "best.safetensors")
    grown = _status("VmHWM:") - before
    assert live.peak <= largest, (live.peak, largest)
    assert grown <= full / 4, (grown, full)
    assert {n: p.data_ptr() for n, p in clf.named_parameters()} == places  # in place: the same memory
    for (name, p), q in zip(clf.named_parameters(), trained.parameters(), strict=True):
        assert torch.equal(p, q), name

"""Damaged and hostile files: each is one clear CheckpointError or GGUFError, quickly and in bounded memory.

Hand-made files check each kind of lie a header can tell (a shard outside the checkpoint, a shape that is not a
shape, a count of 2^40 elements); seeded fuzzing then checks that random damage to a small valid file either
still loads or fails with the module's own error, never a traceback from deeper down.
"""

from __future__ import annotations

import json
import random
import resource
import struct
import subprocess
import sys
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from llama_scratch.checkpoints.gguf import GGUFError, check_tensor_types, dequantize, open_gguf, read_metadata
from llama_scratch.checkpoints.hf_layout import CheckpointError, find_checkpoint_files, read_header
from llama_scratch.checkpoints.weights import load_weights, save_weights
from llama_scratch.model.config import LlamaConfig
from llama_scratch.model.llama import Llama

# --- safetensors: the index -----------------------------------------------------------------------------------


def tiny_config() -> LlamaConfig:
    return LlamaConfig.from_name("tiny", vocab_size=32, n_layers=1, ffn_dim=32)


def meta_model() -> Llama:
    with torch.device("meta"):
        return Llama(tiny_config())


def save_tiny(path: Path) -> Path:
    torch.manual_seed(0)
    return save_weights(Llama(tiny_config()).state_dict(), path)


_OPENED: list[str] | None = None  # while a list, every path Python opens is appended to it


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], str | Path):
        _OPENED.append(str(args[0]))


sys.addaudithook(_audit)  # audit hooks cannot be removed; this one does nothing outside `opened_paths`


def opened_paths(call) -> tuple[list[str], BaseException | None]:
    """Every file `call()` opened (through Python's audit hook for `open`), and what it raised."""
    global _OPENED
    _OPENED, raised = [], None
    try:
        call()
    except Exception as e:
        raised = e
    finally:
        opened, _OPENED = _OPENED, None
    return opened, raised


@pytest.mark.parametrize("where", ["../outside.safetensors", "ABSOLUTE", "sub/../../outside.safetensors"])
def test_index_cannot_point_outside_the_checkpoint(tmp_path, where):
    outside = save_tiny(tmp_path / "outside.safetensors")  # a valid file with every tensor: it would load
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    name = str(outside) if where == "ABSOLUTE" else where
    weight_map = {n: name for n in read_header(outside)}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    opened, raised = opened_paths(lambda: load_weights(meta_model(), ckpt, progress=False))
    assert isinstance(raised, CheckpointError), raised
    assert "model.safetensors.index.json" in str(raised) and repr(name) in str(raised)
    assert "is not a plain .safetensors file name" in str(raised)
    assert not [p for p in opened if "outside" in p]


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ({"weight_map": {"a": "sub\\x.safetensors"}}, r"'sub\\\\x.safetensors' is not a plain"),
        ({"weight_map": {"a": "model.bin"}}, "'model.bin' is not a plain .safetensors file name"),
        ({"weight_map": {"a": 5}}, "entry 'a' -> 5 is not a plain"),
        ({"weight_map": {"a": ["x.safetensors"]}}, r"entry 'a' -> \['x.safetensors'\] is not a plain"),
        ({"weight_map": ["x.safetensors"]}, "weight_map is a list, not tensor name -> file name"),
    ],
)
def test_index_entries_must_be_file_names(tmp_path, index, message):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=message):
        find_checkpoint_files(tmp_path)


# --- safetensors: the header ----------------------------------------------------------------------------------


def write_safetensors(path: Path, header: object, data: bytes = bytes(64)) -> Path:
    """A file in safetensors layout with any header: JSON text as given, anything else through json.dumps."""
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return path


def entry(dtype="F32", shape=(2,), offsets=(0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape, "data_offsets": offsets}


BAD_HEADERS = {
    "a list": ([entry()], "its header is a JSON list, not an object"),
    "a number": ("3", "its header is a JSON int, not an object"),
    "entry not an object": ({"w": [1, 2]}, r"tensor 'w': entry is \[1, 2\], not an object"),
    "no dtype": ({"w": {"shape": [2], "data_offsets": [0, 8]}}, "tensor 'w': dtype None is not one of"),
    "unknown dtype": ({"w": entry(dtype="F7")}, "tensor 'w': dtype 'F7' is not one of BF16"),
    "dtype not a string": ({"w": entry(dtype=["F32"])}, r"tensor 'w': dtype \['F32'\] is not one of"),
    "float dimension": ({"w": entry(shape=[2.0])}, r"tensor 'w': shape \[2.0\] is not a list of sizes"),
    "bool dimension": ({"w": entry(shape=[True, 2])}, r"tensor 'w': shape \[True, 2\] is not a list of sizes"),
    "negative dimension": ({"w": entry(shape=[-2, -1], offsets=[0, 8])}, r"shape \[-2, -1\] is not a list"),
    "nested shape": ({"w": entry(shape=[[2]])}, r"tensor 'w': shape \[\[2\]\] is not a list of sizes"),
    "shape not a list": ({"w": entry(shape="2")}, "tensor 'w': shape '2' is not a list of sizes"),
    "absurd shape": ({"w": entry(shape=[2**62, 2**62, 0])}, r"shape \[4611686018427387904, .* is not a list"),
    "huge zero-size shape": ({"w": entry(shape=[0, 2**70], offsets=[0, 0])}, "is not a list of sizes"),
    "one offset": ({"w": entry(offsets=[8])}, r"data_offsets \[8\] is not a pair of byte offsets"),
    "three offsets": ({"w": entry(offsets=[0, 4, 8])}, r"data_offsets \[0, 4, 8\] is not a pair"),
    "string offsets": ({"w": entry(offsets=["0", "8"])}, r"data_offsets \['0', '8'\] is not a pair"),
    "float offsets": ({"w": entry(offsets=[0, 8.0])}, r"data_offsets \[0, 8.0\] is not a pair"),
    "negative offsets": ({"w": entry(offsets=[-8, 0])}, r"data_offsets \[-8, 0\] is not a pair"),
    "end before begin": ({"w": entry(shape=[0], offsets=[8, 0])}, r"data_offsets \[8, 0\] end before they begin"),
    "size mismatch": ({"w": entry(shape=[3])}, r"tensor 'w': \[3\] F32 needs 12 bytes, data_offsets \[0, 8\] span 8"),
    "past the end": ({"w": entry(shape=[32], offsets=[0, 128])}, r"is truncated: w ends at byte \d+ but the file"),
    "overlap": ({"a": entry(offsets=[0, 8]), "b": entry(offsets=[4, 12])}, "tensors 'a' and 'b' overlap"),
    "metadata not an object": ({"__metadata__": "x", "w": entry()}, "__metadata__ must map strings to strings"),
    "metadata number": ({"__metadata__": {"step": 3}, "w": entry()}, "__metadata__ must map strings to strings"),
    "name twice": ('{"w": ENTRY, "w": ENTRY}'.replace("ENTRY", json.dumps(entry())), "'w' appears twice"),
    "deep nesting": ("[" * 100_000 + "]" * 100_000, "header is not valid JSON"),
}


@pytest.mark.parametrize(("header", "message"), BAD_HEADERS.values(), ids=BAD_HEADERS.keys())
def test_every_malformed_header_is_a_checkpoint_error(tmp_path, header, message):
    path = write_safetensors(tmp_path / "x.safetensors", header)
    with pytest.raises(CheckpointError, match=message) as err:
        read_header(path)
    assert str(path) in str(err.value)


def test_header_length_is_bounded_before_reading(tmp_path):
    """A length of 150 MB inside a (sparse) 200 MB file: refused before those bytes are read into memory."""
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:
        f.write((150_000_000).to_bytes(8, "little"))
        f.truncate(200_000_000)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="header length 150000000"):
            read_header(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10_000_000


def test_valid_header_still_reads(tmp_path):
    header = {"__metadata__": {"format": "pt"}, "a": entry(offsets=[0, 8]), "b": entry("I8", [0], [8, 8])}
    tensors = read_header(write_safetensors(tmp_path / "ok.safetensors", header))
    assert [(t.name, t.dtype, t.shape, t.nbytes) for t in tensors.values()] == [
        ("a", torch.float32, (2,), 8),
        ("b", torch.int8, (0,), 0),
    ]


# --- mutations ------------------------------------------------------------------------------------------------


def mutate(data: bytes, rng: random.Random, header_end: int) -> bytes:
    """One random kind of damage, mostly to the header, where a file's counts and lengths live."""
    data = bytearray(data)
    spot = rng.randrange(header_end) if rng.random() < 0.85 else rng.randrange(len(data))
    kind = rng.choice(["flip", "digit", "ff", "truncate", "zero"])
    if kind == "flip":
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(header_end)] ^= 1 << rng.randrange(8)
    elif kind == "digit":  # in JSON, a different number that still parses
        digits = [i for i in range(header_end) if chr(data[i]).isdigit()]
        data[rng.choice(digits)] = ord(rng.choice("0123456789"))
    elif kind == "ff":  # counts and lengths of 2^64 - 1
        n = rng.randint(1, 16)
        data[spot : spot + n] = b"\xff" * n
    elif kind == "zero":
        n = rng.randint(1, 8)
        data[spot : spot + n] = bytes(n)
    else:
        del data[spot:]
    return bytes(data)


# JSON values of every wrong kind, for the fields of a safetensors header.
ODD_VALUES = [-1, 0, 1.5, 2**64, True, None, "F32", "x", [], [0], [-8, 8], [1, 2, 3], [[4]], {}, {"a": 1}]


def retype(data: bytes, rng: random.Random) -> bytes:
    """A header that is still valid JSON, with one field of one entry (or the entry itself) swapped for an odd
    value: the damage a byte flip rarely makes but a hostile writer would."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    name = rng.choice(list(header))
    field = rng.choice(["dtype", "shape", "data_offsets", None])
    if field is None:
        header[name] = rng.choice(ODD_VALUES)
    elif isinstance(header[name], dict) and isinstance(values := header[name].get(field), list) and values:
        values[rng.randrange(len(values))] = rng.choice(ODD_VALUES)
    else:
        header[name][field] = rng.choice(ODD_VALUES)
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data[8 + n :]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def fuzz(tmp_path, suffix: str, mutated, read, error: type[Exception], seed: int) -> None:
    """200 files from `mutated(rng)`, each read by `read`: it succeeds or raises `error`, nothing else, within
    30 s and 200 MB for all of them."""
    rng, outcomes, other = random.Random(seed), Counter(), []
    start, rss = time.perf_counter(), peak_rss_mb()
    for i in range(200):
        path = tmp_path / f"m{i}{suffix}"
        path.write_bytes(mutated(rng, i))
        try:
            read(path)
            outcomes["read"] += 1
        except error:
            outcomes[error.__name__] += 1
        except Exception as e:
            other.append(f"m{i}: {type(e).__name__}: {e}")
        path.unlink()
    print(dict(outcomes), f"{time.perf_counter() - start:.1f} s", f"+{peak_rss_mb() - rss:.0f} MB peak")
    assert not other, other
    assert outcomes[error.__name__] > 100
    assert time.perf_counter() - start < 30 and peak_rss_mb() - rss < 200


@pytest.mark.slow
def test_fuzzed_safetensors_loads_or_is_a_checkpoint_error(tmp_path):
    original = save_tiny(tmp_path / "model.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(original[:8], "little")
    load_weights(meta_model(), tmp_path / "model.safetensors", progress=False)  # the first load's one-time costs

    def mutated(rng, i):
        return mutate(original, rng, header_end) if i % 2 else retype(original, rng)

    def read(path):
        load_weights(meta_model(), path, progress=False)

    fuzz(tmp_path, ".safetensors", mutated, read, CheckpointError, seed=1234)


# --- GGUF -----------------------------------------------------------------------------------------------------


def gguf_bytes(n_tensors: int = 0, n_kv: int = 0, body: bytes = b"", version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + body


def gstr(text: str | bytes, length: int | None = None) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def kv(key: str, value_type: int, value: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", value_type) + value


def array(element_type: int, count: int, elements: bytes = b"") -> bytes:
    return struct.pack("<IQ", element_type, count) + elements


def tensor_info(name: str, dims: list[int], type_code: int = 0, offset: int = 0, n_dims: int | None = None) -> bytes:
    n = len(dims) if n_dims is None else n_dims
    return gstr(name) + struct.pack(f"<I{len(dims)}QIQ", n, *dims, type_code, offset)


STRING, ARRAY, UINT8 = 8, 9, 0
THE_BOMB = gguf_bytes(n_kv=1, body=kv("a", ARRAY, array(UINT8, 2**40)))

HOSTILE_GGUF = {
    "kv count 2^63": (gguf_bytes(n_kv=2**63), "9223372036854775808 key-value pairs"),
    "tensor count 2^40": (gguf_bytes(n_tensors=2**40), "1099511627776 tensor infos"),
    "key length 2^40": (gguf_bytes(n_kv=1, body=gstr(b"k" * 16, 2**40)), "the name of key-value pair 0"),
    "string length 2^62": (gguf_bytes(n_kv=1, body=kv("s", STRING, gstr(b"x", 2**62))), "the value of s"),
    "string array count 2^40": (gguf_bytes(n_kv=1, body=kv("t", ARRAY, array(STRING, 2**40))), "t's 1099511627776"),
    "nested array count 2^40": (gguf_bytes(n_kv=1, body=kv("n", ARRAY, array(ARRAY, 2**40))), "n's 1099511627776"),
    "array of 3 million": (
        gguf_bytes(n_kv=1, body=kv("m", ARRAY, array(UINT8, 3_000_000, bytes(3_000_000)))),
        "over 2097152 array elements",
    ),
    "unknown value type": (gguf_bytes(n_kv=1, body=kv("u", 99, b"")), "u has value type 99"),
    "n_dims 2^31": (gguf_bytes(n_tensors=1, body=tensor_info("w", [4], n_dims=2**31)), "w has 2147483648 dim"),
    "tensor past the end": (gguf_bytes(n_tensors=1, body=tensor_info("w", [2**40])), r"w \[1099511627776\] ends at"),
    "unknown tensor type": (gguf_bytes(n_tensors=1, body=tensor_info("w", [4], 1234)), "w has type code 1234"),
    "version 7": (gguf_bytes(version=7), "version 7"),
    "value not UTF-8": (gguf_bytes(n_kv=1, body=kv("s", STRING, gstr(b"\xff\xfe"))), "the value of s is not UTF-8"),
}


@pytest.mark.parametrize(("data", "message"), HOSTILE_GGUF.values(), ids=HOSTILE_GGUF.keys())
def test_hostile_gguf_is_a_gguf_error(tmp_path, data, message):
    path = tmp_path / "x.gguf"
    path.write_bytes(data)
    start = time.perf_counter()
    with pytest.raises(GGUFError, match=message) as err:
        read_metadata(open_gguf(path))
    assert str(path) in str(err.value) and time.perf_counter() - start < 1


BOMB_SCRIPT = """
import resource, sys, time
from llama_scratch.checkpoints.gguf import GGUFError, open_gguf
import gguf  # imported before measuring
vm = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmSize"))) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 1_000_000_000, resource.RLIM_INFINITY))  # the old reader: MemoryError
before, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
try:
    open_gguf(sys.argv[1])
except GGUFError as e:
    print("GGUFError", e)
print(time.perf_counter() - start, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


@pytest.mark.slow
def test_gguf_bomb_fails_fast_in_little_memory(tmp_path):
    """49 bytes whose one metadata array claims 2^40 elements: gguf.GGUFReader alone allocates until killed."""
    path = tmp_path / "bomb.gguf"
    path.write_bytes(THE_BOMB)
    assert len(THE_BOMB) == 49
    run = subprocess.run([sys.executable, "-c", BOMB_SCRIPT, str(path)], capture_output=True, text=True, timeout=120)
    lines = run.stdout.splitlines()
    assert run.returncode == 0 and lines[0].startswith("GGUFError"), run.stdout + run.stderr
    assert "a's 1099511627776 elements (1 or more bytes each) needs 1099511627776 bytes but only 0 are left" in lines[0]
    seconds, extra_mb = map(float, lines[1].split())
    print(f"bomb: {seconds * 1000:.1f} ms, +{extra_mb:.1f} MB peak")
    assert seconds < 1 and extra_mb < 100


def write_small_gguf(path: Path, endianess=gguf.GGUFEndian.LITTLE) -> Path:
    """A valid GGUF with every kind of value (scalars, strings, arrays of both) and two tensors (Q8_0, F32)."""
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    w.add_block_count(1)
    w.add_rope_freq_base(10_000.0)
    w.add_bool("test.flag", True)
    w.add_uint64("test.big", 2**40)
    w.add_token_list([f"tok{i}" for i in range(40)])
    w.add_token_types([1] * 40)
    w.add_array("test.floats", [0.5, 1.5])
    embed = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    w.add_tensor(
        "token_embd.weight",
        gguf.quants.quantize(embed, gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    w.add_tensor("output_norm.weight", np.linspace(0.5, 1.5, 64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def read_all(path: Path) -> None:
    """What the converter reads before it writes anything: metadata, tensor types, every tensor's values."""
    reader = open_gguf(path)
    read_metadata(reader)
    check_tensor_types(reader, str(path))
    for t in reader.tensors:
        dequantize(t)


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG], ids=["little", "big"])
def test_small_gguf_reads(tmp_path, endianess):
    path = write_small_gguf(tmp_path / "ok.gguf", endianess)
    read_all(path)
    meta = read_metadata(open_gguf(path))
    assert meta["test.big"] == 2**40 and meta["tokenizer.ggml.tokens"][39] == "tok39"


def test_fuzzed_gguf_reads_or_is_a_gguf_error(tmp_path):
    original = write_small_gguf(tmp_path / "ok.gguf").read_bytes()
    header_end = gguf.GGUFReader(tmp_path / "ok.gguf").data_offset
    read_all(tmp_path / "ok.gguf")
    fuzz(tmp_path, ".gguf", lambda rng, i: mutate(original, rng, header_end), read_all, GGUFError, seed=4321)

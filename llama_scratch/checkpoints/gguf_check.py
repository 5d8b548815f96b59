"""Walk a GGUF file's structure before the gguf package reads it, so that a damaged or hostile file fails at once.

`gguf.GGUFReader` trusts every count in the file: a 49-byte file whose metadata array claims 2^40 elements makes it
loop and allocate until the machine kills the process. Here each count and length is checked against the bytes
left in the file before anything is read or allocated, and the first problem is one `GGUFError` naming the file,
the key or tensor and what is wrong. The layout (all integers little-endian unless the file is big-endian):

    magic "GGUF", version (uint32: 2 or 3), tensor count (uint64), key-value count (uint64)
    key-value pairs: key (string), value type (uint32), value
    tensor infos:    name (string), n_dims (uint32), dims (uint64 each), type (uint32), offset (uint64)
    padding to `general.alignment` (default 32), then the tensor data, each tensor at data start + offset

A string is a uint64 byte length followed by UTF-8 bytes; an array is an element type (uint32), a count (uint64)
and the elements.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO


class GGUFError(ValueError):
    """A GGUF file this converter cannot import (architecture, tensor type, tokenizer, damaged file)."""


# Value types: the scalars and their sizes in bytes, then string and array.
SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY, UINT32 = 8, 9, 4
MAX_DIMS = 8  # ggml itself uses 4
MAX_NESTING = 4  # arrays of arrays of ...: real files use none
# gguf.GGUFReader spends ~700 bytes and ~13 us on every array element, so a file with a few million one-byte
# elements would cost gigabytes. Real vocabularies (tokens, types, scores, merges) stay under a million in all.
MAX_ARRAY_ELEMENTS = 2**21


class _Cursor:
    """Reads through the file and refuses, before reading, anything longer than the bytes left."""

    def __init__(self, f: BinaryIO, path: Path, size: int, order: str = "<"):
        self.f, self.path, self.size, self.order = f, path, size, order
        self.elements = 0  # array elements seen so far (MAX_ARRAY_ELEMENTS)

    @property
    def left(self) -> int:
        return self.size - self.f.tell()

    def error(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: cannot read as GGUF: {what} (at byte {self.f.tell()} of {self.size})")

    def need(self, nbytes: int, what: str) -> None:
        if nbytes > self.left:
            raise self.error(f"{what} needs {nbytes} bytes but only {self.left} are left")

    def number(self, fmt: str, what: str) -> int | float | bool:
        size = struct.calcsize(fmt)
        self.need(size, what)
        return struct.unpack(self.order + fmt, self.f.read(size))[0]

    def string(self, what: str) -> str:
        n = self.number("Q", f"the length of {what}")
        self.need(n, f"{what} ({n} bytes)")
        try:
            return self.f.read(n).decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(f"{what} is not UTF-8 text") from None

    def skip(self, nbytes: int, what: str) -> None:
        self.need(nbytes, what)
        self.f.seek(nbytes, 1)


def check_gguf(path: str | Path) -> None:
    """Raise GGUFError unless every length and count in the file's header fits in the file (see the module doc)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        cursor = _Cursor(f, path, size)
        n_tensors, n_kv = _check_start(cursor)
        alignment = 32
        for i in range(n_kv):
            key = cursor.string(f"the name of key-value pair {i}")
            value_type = cursor.number("I", f"the type of {key}")
            if key == "general.alignment" and value_type == UINT32:
                alignment = cursor.number("I", key)
                if alignment == 0 or alignment & (alignment - 1):
                    raise cursor.error(f"general.alignment {alignment} is not a power of two")
            else:
                _skip_value(cursor, value_type, key, depth=0)
        tensors = [_tensor_info(cursor, i) for i in range(n_tensors)]
        data_start = -(-f.tell() // alignment) * alignment  # rounded up to the alignment
    _check_tensor_data(path, tensors, data_start, size)


def _check_start(cursor: _Cursor) -> tuple[int, int]:
    """Magic, version and the two counts; each counted item takes some bytes, so a count is bounded by the file."""
    if cursor.f.read(4) != b"GGUF":
        raise GGUFError(f"{cursor.path}: cannot read as GGUF: the file does not start with the magic bytes GGUF")
    cursor.need(20, "the rest of the GGUF header")
    version = cursor.number("I", "the version")
    if version & 0xFFFF == 0:  # written on a big-endian machine (the gguf package reads those too)
        cursor.order, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in (2, 3):
        raise cursor.error(f"version {version} (only 2 and 3 are supported)")
    n_tensors = cursor.number("Q", "the tensor count")
    n_kv = cursor.number("Q", "the key-value count")
    cursor.need(n_kv * 13, f"{n_kv} key-value pairs (at least 13 bytes each)")
    cursor.need(n_kv * 13 + n_tensors * 24, f"{n_tensors} tensor infos (at least 24 bytes each)")
    return n_tensors, n_kv


def _skip_value(cursor: _Cursor, value_type: int, key: str, depth: int) -> None:
    """Step over one value of `value_type`, checking strings' lengths and arrays' counts before stepping."""
    if value_type in SCALAR_FORMATS:
        cursor.skip(struct.calcsize(SCALAR_FORMATS[value_type]), f"the value of {key}")
    elif value_type == STRING:
        cursor.string(f"the value of {key}")
    elif value_type == ARRAY:
        _skip_array(cursor, key, depth)
    else:
        raise cursor.error(f"{key} has value type {value_type}, which GGUF does not define")


def _skip_array(cursor: _Cursor, key: str, depth: int) -> None:
    if depth >= MAX_NESTING:
        raise cursor.error(f"{key}: arrays nested more than {MAX_NESTING} deep")
    element_type = cursor.number("I", f"the element type of {key}")
    count = cursor.number("Q", f"the element count of {key}")
    if element_type in SCALAR_FORMATS:
        smallest = struct.calcsize(SCALAR_FORMATS[element_type])
    elif element_type in (STRING, ARRAY):
        smallest = 8 if element_type == STRING else 12  # an empty string, an empty array
    else:
        raise cursor.error(f"{key} is an array of value type {element_type}, which GGUF does not define")
    cursor.need(count * smallest, f"{key}'s {count} elements ({smallest} or more bytes each)")
    cursor.elements += count
    if cursor.elements > MAX_ARRAY_ELEMENTS:
        raise cursor.error(f"{key}: over {MAX_ARRAY_ELEMENTS} array elements in the metadata (this one has {count})")
    if element_type in SCALAR_FORMATS:
        cursor.skip(count * smallest, f"{key}'s {count} elements")
        return
    for i in range(count):
        _skip_value(cursor, element_type, f"{key}[{i}]", depth + 1)


def _tensor_info(cursor: _Cursor, i: int) -> tuple[str, list[int], int, int]:
    """One tensor's name, dims (fastest-varying first), type code and offset into the data section."""
    name = cursor.string(f"the name of tensor {i}")
    n_dims = cursor.number("I", f"the number of dimensions of {name}")
    if n_dims > MAX_DIMS:
        raise cursor.error(f"tensor {name} has {n_dims} dimensions (at most {MAX_DIMS})")
    dims = [cursor.number("Q", f"the dimensions of {name}") for _ in range(n_dims)]
    type_code = cursor.number("I", f"the type of {name}")
    offset = cursor.number("Q", f"the data offset of {name}")
    return name, dims, type_code, offset


def _check_tensor_data(path: Path, tensors: list, data_start: int, size: int) -> None:
    """Each tensor's bytes (elements / block size * bytes per block, for its type) lie inside the file."""
    # (elements per block, bytes per block) for each type code. Deferred: only GGUF files need the gguf package, and
    # a machine without it (the lent GPU) must still import the package to train.
    from gguf.constants import GGML_QUANT_SIZES

    sizes = {int(code): block for code, block in GGML_QUANT_SIZES.items()}
    for name, dims, type_code, offset in tensors:
        if type_code not in sizes:
            raise GGUFError(f"{path}: cannot read as GGUF: tensor {name} has type code {type_code}, which is unknown")
        block, block_bytes = sizes[type_code]
        if dims and dims[0] % block:
            raise GGUFError(f"{path}: cannot read as GGUF: tensor {name}'s rows of {dims[0]} are not whole blocks")
        elements = 1
        for d in dims:
            elements *= d
        end = data_start + offset + elements // block * block_bytes
        if end > size:
            raise GGUFError(
                f"{path}: cannot read as GGUF: tensor {name} {dims} ends at byte {end} but the file has {size} bytes "
                "(truncated?)"
            )

"""A GGUF file's header, read with the standard library only: what the orchestrator checks about a
model before it rents (``block_count``, ``check_complete``), without tinygrad.

GGUF (v2 and v3): the magic ``GGUF``, a version, the tensor and key-value counts, then the key-value
pairs, each a string key, a type and a value (arrays carry their element type and length), then
one record per tensor (its name, dimensions, ggml type and offset into the data), then the tensor
data from the next multiple of ``general.alignment``. Only the header is read, never a tensor.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

# value types: struct formats of the fixed-size ones (8: string, 9: array)
_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
MAX_KEYS = 1 << 16  # more key-value pairs than any model has: the file is not a GGUF
MAX_TENSORS = 1 << 20  # more tensors than any model has
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
ALIGNMENT = 32  # the data's alignment where the header names none (GGUF_DEFAULT_ALIGNMENT)
# in the general.name of every file pp-synth-gguf writes (stage/synth.py): its text is noise by design;
# here, so that a run can tell such a file by its metadata without importing the writer (numpy)
RANDOM_WEIGHTS = "random weights"

# ggml's types (ggml.h's enum ggml_type): (elements per block, bytes per block), as gguf-py's
# GGML_QUANT_SIZES lists them; a plain type is a block of one element
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}  # fmt: skip


class GGUFError(ValueError):
    """Not a GGUF file this reader understands, or one cut short; the message names the file and
    what was found."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's record in the header. ``offset``: from the start of the data."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int

    def nbytes(self, path: Path) -> int:
        """The tensor's size in the file, from its ggml type's block size."""
        if self.ggml_type not in GGML_TYPES:
            raise GGUFError(
                f"{path}: tensor {self.name!r} has ggml type {self.ggml_type}, which this reader does not know"
            )
        kind, per_block, block_bytes = GGML_TYPES[self.ggml_type]
        elements = math.prod(self.dims)
        if elements % per_block:
            raise GGUFError(
                f"{path}: tensor {self.name!r} has {elements} elements, "
                f"not a whole number of {kind} blocks of {per_block}"
            )
        return elements // per_block * block_bytes


@dataclass(frozen=True)
class Header:
    """A GGUF file's header: its values (arrays as None), its tensors, where their data starts,
    and the file's size."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    data_start: int
    file_size: int

    def data_end(self) -> int:
        """Where the furthest tensor's data ends (the data's start if there is no tensor)."""
        return self.data_start + max((t.offset + t.nbytes(self.path) for t in self.tensors), default=0)


def _read(f: BinaryIO, n: int, path: Path) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GGUFError(f"{path}: the GGUF header ends early")
    return data


def _string(f: BinaryIO, path: Path) -> str:
    (n,) = struct.unpack("<Q", _read(f, 8, path))
    return _read(f, n, path).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int, path: Path) -> Any:
    if kind in _FIXED:
        fmt = _FIXED[kind]
        return struct.unpack(fmt, _read(f, struct.calcsize(fmt), path))[0]
    if kind == _STRING:
        return _string(f, path)
    if kind == _ARRAY:
        item, n = struct.unpack("<IQ", _read(f, 12, path))
        if item in _FIXED:  # skipped whole: a tokenizer's scores are long
            f.seek(n * struct.calcsize(_FIXED[item]), 1)
            return None
        for _ in range(n):
            _value(f, item, path)
        return None
    raise GGUFError(f"{path}: unknown GGUF value type {kind}")


def _start(f: BinaryIO, path: Path) -> tuple[int, int, int]:
    """The version, tensor count and key-value count, checked."""
    if _read(f, 4, path) != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file (no GGUF magic)")
    version, tensors, count = struct.unpack("<IQQ", _read(f, 20, path))
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version}; expected 2 or 3")
    if count > MAX_KEYS:
        raise GGUFError(f"{path}: {count} key-value pairs in the header; the file is damaged")
    if tensors > MAX_TENSORS:
        raise GGUFError(f"{path}: {tensors} tensors in the header; the file is damaged")
    return version, tensors, count


def _values(f: BinaryIO, count: int, path: Path, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """``count`` key-value pairs from where ``f`` stands, or only ``keys`` (reading stops once all
    are found)."""
    out: dict[str, Any] = {}
    for _ in range(count):
        key = _string(f, path)
        (kind,) = struct.unpack("<I", _read(f, 4, path))
        value = _value(f, kind, path)
        if keys is None or key in keys:
            out[key] = value
            if keys is not None and all(k in out for k in keys):
                break
    return out


def metadata(path: str | Path, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The header's scalar and string values (arrays as None), or only ``keys`` (reading stops
    once all are found). GGUFError if the file is not GGUF v2 or v3."""
    path = Path(path)
    with path.open("rb") as f:
        _, _, count = _start(f, path)
        return _values(f, count, path, keys)


def header(path: str | Path) -> Header:
    """The whole header: values, tensor records and where the data starts. GGUFError if the file
    is not GGUF v2 or v3 or its header is cut short."""
    path = Path(path)
    with path.open("rb") as f:
        version, n_tensors, count = _start(f, path)
        meta = _values(f, count, path)
        tensors = []
        for _ in range(n_tensors):
            name = _string(f, path)
            (n_dims,) = struct.unpack("<I", _read(f, 4, path))
            if n_dims > MAX_DIMS:
                raise GGUFError(f"{path}: tensor {name!r} has {n_dims} dimensions; expected at most {MAX_DIMS}")
            dims = struct.unpack(f"<{n_dims}Q", _read(f, 8 * n_dims, path))
            ggml_type, offset = struct.unpack("<IQ", _read(f, 12, path))
            tensors.append(TensorInfo(name, dims, ggml_type, offset))
        align = meta.get("general.alignment", ALIGNMENT)
        if not isinstance(align, int) or isinstance(align, bool) or align < 1:
            raise GGUFError(f"{path}: general.alignment is {align!r}; expected a positive integer")
        data_start = -(-f.tell() // align) * align
        size = f.seek(0, 2)
    return Header(path, version, meta, tuple(tensors), data_start, size)


def check_complete(path: str | Path) -> Header:
    """The header, where the file holds every tensor's data; GGUFError naming the file and both
    sizes where a tensor runs past its end (a download or copy cut short)."""
    h = header(path)
    end = h.data_end()
    if end > h.file_size:
        raise GGUFError(
            f"{h.path} is cut short: its {len(h.tensors)} tensors run to byte {end:,}, "
            f"but the file has {h.file_size:,} bytes; download or copy it again"
        )
    return h


def blocks_of(meta: dict[str, Any], path: str | Path) -> int:
    """The model's transformer blocks (``<architecture>.block_count``) in a header's values."""
    arch = meta.get("general.architecture")
    blocks = meta.get(f"{arch}.block_count")
    if not isinstance(blocks, int) or isinstance(blocks, bool):
        raise GGUFError(f"{path}: the header names no {arch}.block_count")
    return blocks


def block_count(path: str | Path) -> int:
    """The model's transformer blocks (``<architecture>.block_count``)."""
    return blocks_of(metadata(path), path)

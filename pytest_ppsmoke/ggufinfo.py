"""A GGUF file's header, read with the standard library only: what the orchestrator checks about a
model before it rents (``block_count``), without tinygrad.

GGUF (v2 and v3): the magic ``GGUF``, a version, the tensor and key-value counts, then the key-value
pairs, each a string key, a type and a value; arrays carry their element type and length. Only the
header is read, never a tensor.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

# value types: struct formats of the fixed-size ones (8: string, 9: array)
_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
MAX_KEYS = 1 << 16  # more key-value pairs than any model has: the file is not a GGUF


class GGUFError(ValueError):
    """Not a GGUF file this reader understands; the message names the file and what was found."""


def _read(f: BinaryIO, n: int, path: Path) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GGUFError(f"{path}: the GGUF header ends early")
    return data


def _value(f: BinaryIO, kind: int, path: Path) -> Any:
    if kind in _FIXED:
        fmt = _FIXED[kind]
        return struct.unpack(fmt, _read(f, struct.calcsize(fmt), path))[0]
    if kind == _STRING:
        (n,) = struct.unpack("<Q", _read(f, 8, path))
        return _read(f, n, path).decode("utf-8", errors="replace")
    if kind == _ARRAY:
        item, n = struct.unpack("<IQ", _read(f, 12, path))
        if item in _FIXED:  # skipped whole: a tokenizer's scores are long
            f.seek(n * struct.calcsize(_FIXED[item]), 1)
            return None
        for _ in range(n):
            _value(f, item, path)
        return None
    raise GGUFError(f"{path}: unknown GGUF value type {kind}")


def metadata(path: str | Path, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The header's scalar and string values (arrays as None), or only ``keys`` (reading stops
    once all are found). GGUFError if the file is not GGUF v2 or v3."""
    path = Path(path)
    out: dict[str, Any] = {}
    with path.open("rb") as f:
        if _read(f, 4, path) != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file (no GGUF magic)")
        version, _tensors, count = struct.unpack("<IQQ", _read(f, 20, path))
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version}; expected 2 or 3")
        if count > MAX_KEYS:
            raise GGUFError(f"{path}: {count} key-value pairs in the header; the file is damaged")
        for _ in range(count):
            (n,) = struct.unpack("<Q", _read(f, 8, path))
            key = _read(f, n, path).decode("utf-8", errors="replace")
            (kind,) = struct.unpack("<I", _read(f, 4, path))
            value = _value(f, kind, path)
            if keys is None or key in keys:
                out[key] = value
                if keys is not None and all(k in out for k in keys):
                    break
    return out


def block_count(path: str | Path) -> int:
    """The model's transformer blocks (``<architecture>.block_count``)."""
    meta = metadata(path)
    arch = meta.get("general.architecture")
    blocks = meta.get(f"{arch}.block_count")
    if not isinstance(blocks, int):
        raise GGUFError(f"{path}: the header names no {arch}.block_count")
    return blocks

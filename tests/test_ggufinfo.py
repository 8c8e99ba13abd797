"""ggufinfo: a GGUF's header read with the standard library (values, tensor records, where the
data starts), each tensor's size from its ggml type, and a file cut short refused in a line that
names it and both sizes. gguf-py, which writes and reads the format on its own, is the reference."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from pytest_ppsmoke.ggufinfo import GGML_TYPES, GGUFError, blocks_of, check_complete, header
from pytest_ppsmoke.stage.catalog import resolve_model

from .helpers import SMOLLM2

pytestmark = pytest.mark.local


def cut_copy(src: str | Path, dst: Path, size: int) -> Path:
    """``src`` cut to ``size`` bytes, cheaply: its header copied, the rest a hole (the check reads
    only the header)."""
    with open(src, "rb") as f:
        head = f.read(min(size, header(src).data_start))
    with open(dst, "wb") as f:
        f.write(head)
        f.truncate(size)
    return dst


def test_the_ggml_type_table_is_gguf_pys() -> None:
    theirs = {int(t): (t.name, *sizes) for t, sizes in gguf.GGML_QUANT_SIZES.items()}
    assert theirs == GGML_TYPES


def agrees_with_gguf_py(path: str | Path) -> None:
    """Every tensor where gguf-py's reader finds it: its start and its size."""
    ours = check_complete(path)
    theirs = gguf.GGUFReader(path).tensors
    assert [t.name for t in ours.tensors] == [t.name for t in theirs]
    for mine, ref in zip(ours.tensors, theirs, strict=True):
        assert (ours.data_start + mine.offset, mine.nbytes(ours.path)) == (ref.data_offset, ref.n_bytes), mine.name
    padding = ours.file_size - ours.data_end()  # a writer may pad the last tensor to the alignment
    assert 0 <= padding < ours.metadata.get("general.alignment", 32)


def test_the_real_smollm2_file_holds_every_tensor(smollm2: str) -> None:
    path = resolve_model(smollm2)
    agrees_with_gguf_py(path)
    assert blocks_of(header(path).metadata, path) == SMOLLM2.blocks


def test_a_real_file_cut_to_half_is_refused_naming_the_file_and_both_sizes(smollm2: str, tmp_path: Path) -> None:
    path = resolve_model(smollm2)
    full = os.path.getsize(path)
    half = cut_copy(path, tmp_path / "half.gguf", full // 2)
    with pytest.raises(GGUFError) as e:
        check_complete(half)
    assert str(e.value) == (
        f"{half} is cut short: its 272 tensors run to byte {full:,}, "
        f"but the file has {full // 2:,} bytes; download or copy it again"
    )


def test_every_type_and_a_wide_alignment_are_sized_as_gguf_py_writes_them(tmp_path: Path) -> None:
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(3)
    w.add_custom_alignment(64)
    for t, (_, _, block_bytes) in GGML_TYPES.items():  # two rows of three blocks, as bytes
        w.add_tensor(f"t{t}", np.zeros((2, 3 * block_bytes), np.uint8), raw_dtype=gguf.GGMLQuantizationType(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    agrees_with_gguf_py(path)
    h = header(path)
    assert h.data_start % 64 == 0 and blocks_of(h.metadata, path) == 3
    with pytest.raises(GGUFError, match="is cut short"):
        check_complete(cut_copy(path, tmp_path / "cut.gguf", h.data_end() - 1))


def one_tensor(path: Path, dims: tuple[int, ...], ggml_type: int, data: int = 0) -> Path:
    """A GGUF v3 with no values and one tensor ``t``, and ``data`` bytes after the header."""
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 0)
    head += struct.pack("<Q", 1) + b"t" + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, 0)
    path.write_bytes(head + bytes(-len(head) % 32 + data))
    return path


def test_a_tensor_record_that_cannot_be_sized_is_named(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="tensor 't' has ggml type 99, which this reader does not know"):
        check_complete(one_tensor(tmp_path / "a.gguf", (32,), 99))
    with pytest.raises(GGUFError, match="tensor 't' has 33 elements, not a whole number of Q8_0 blocks of 32"):
        check_complete(one_tensor(tmp_path / "b.gguf", (33,), 8))
    with pytest.raises(GGUFError, match="tensor 't' has 5 dimensions; expected at most 4"):
        header(one_tensor(tmp_path / "c.gguf", (1, 1, 1, 1, 1), 0))
    good = one_tensor(tmp_path / "d.gguf", (32,), 8, data=34)  # one Q8_0 block
    assert check_complete(good).data_end() == good.stat().st_size
    good.write_bytes(good.read_bytes()[:20])
    with pytest.raises(GGUFError, match="the GGUF header ends early"):
        header(good)

"""pp-synth-gguf: the files it writes load as llama models with a working tokenizer, and pass the
pre-flight's check that a GGUF holds every tensor."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_ppsmoke.ggufinfo import GGUFError, check_complete
from pytest_ppsmoke.stage.model import Tokenizer, load_model
from pytest_ppsmoke.stage.synth import SHAPES, Shape, write

pytestmark = pytest.mark.local


def test_a_tiny_model_loads_and_its_tokenizer_round_trips_any_text(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write(path, SHAPES["tiny"], seed=3)
    model, kv = load_model(str(path), 64)
    assert (len(model.blk), kv["llama.embedding_length"], len(kv["tokenizer.ggml.tokens"])) == (4, 64, 512)
    tok = Tokenizer(kv)
    text = "Say héllo, wörld! 123 \u2603"
    assert tok.tok.decode(tok.tok.encode(text)) == text  # every byte is a token
    ids = tok.chat("Say hello")
    assert ids[0] == 256 and 260 in ids and tok.end_ids == {260}  # <|begin_of_text|>, <|eot_id|>


def test_as_in_llama_3_only_256_tokens_are_special_and_the_rest_encode_as_bytes(tmp_path: Path) -> None:
    """A vocabulary past the 256 bytes and 256 special tokens has normal tokens (a real Llama 3's
    tokenizer compiles a pattern of 256 special tokens, not of the whole vocabulary), which no
    text merges into: it still encodes byte by byte, and every id decodes."""
    path = tmp_path / "wide.gguf"
    write(path, Shape(blocks=1, dim=64, heads=4, kv_heads=2, ffn=8, vocab=2048), seed=3)
    _, kv = load_model(str(path), 64)
    types = list(kv["tokenizer.ggml.token_type"])
    assert (types[:256].count(1), types[256:512].count(3), types[512:].count(1)) == (256, 256, 1536)
    tok = Tokenizer(kv)
    assert len(tok.tok._special_tokens) == 256
    text = "Say héllo <|reserved_special_token_300|>"
    assert tok.tok.encode(text) == list(text.encode()) and tok.tok.decode(tok.tok.encode(text)) == text
    assert tok.chat("Say hello")[0] == 256 and tok.end_ids == {260}
    assert tok.tok.decode([2000]) == "<|reserved_special_token_1739|>"


def test_shapes_are_checked_and_the_1b_shape_is_llama_3_2s() -> None:
    assert round(SHAPES["llama-3.2-1b"].parameters / 1e6, 1) == 1498.5  # 1.24 B + an untied 128256 x 2048 head
    with pytest.raises(ValueError, match="dim 65 must split into 4 heads"):
        Shape(blocks=1, dim=65, heads=4, kv_heads=2, ffn=8, vocab=512)
    with pytest.raises(ValueError, match="vocab 100 must hold the 256 bytes"):
        Shape(blocks=1, dim=64, heads=4, kv_heads=2, ffn=8, vocab=100)


def test_the_command_refuses_what_it_cannot_write(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "pytest_ppsmoke.stage.synth"]
    out = subprocess.run([*run, str(tmp_path / "m.bin"), "--shape", "tiny"], capture_output=True, text=True)
    assert out.returncode == 2 and "the output must be a .gguf file" in out.stderr
    out = subprocess.run(
        [*run, str(tmp_path / "m.gguf"), "--shape", "tiny", "--dim", "66"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "dim 66 must split into 4 heads" in out.stderr
    out = subprocess.run(
        [*run, str(tmp_path / "m.gguf"), "--shape", "tiny", "--blocks", "2"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "M parameters" in out.stderr and (tmp_path / "m.gguf").stat().st_size > 100_000


def test_its_files_hold_every_tensor_and_a_cut_one_is_refused(tmp_path: Path) -> None:
    """The pre-flight's check of a GGUF (``ggufinfo.check_complete``) passes what it writes and
    refuses it cut to half."""
    path = tmp_path / "tiny.gguf"
    write(path, SHAPES["tiny"], seed=3)
    h = check_complete(path)
    assert len(h.tensors) > 0 and h.data_end() <= h.file_size
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: h.file_size // 2])
    with pytest.raises(
        GGUFError, match=rf"^{re.escape(str(cut))} is cut short: .* but the file has {h.file_size // 2:,} bytes"
    ):
        check_complete(cut)

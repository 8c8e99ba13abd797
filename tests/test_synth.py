"""pp-synth-gguf: the files it writes load as llama models with a working tokenizer, and pass the
pre-flight's check that a GGUF holds every tensor; its Q6_K files hold the types promised, in
blocks that a dequantizer written here from ggml's layout and tinygrad's read alike, and load
into a model with a tied head."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from tinygrad import Tensor, nn

from pytest_ppsmoke.ggufinfo import GGUFError, check_complete
from pytest_ppsmoke.stage.model import Tokenizer, load_model, realized_model, unsplit_generate
from pytest_ppsmoke.stage.synth import LIKE, SHAPES, Shape, write

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
    assert LIKE["llama3.2:1b"].shape == Shape(
        blocks=16, dim=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, context=131072
    )
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
        [*run, str(tmp_path / "q.gguf"), "--shape", "tiny", "--quant", "Q6_K"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "token_embd.weight: Q6_K stores rows of a multiple of 256 weights" in out.stderr
    assert "its rows have 64" in out.stderr and not (tmp_path / "q.gguf").exists()
    out = subprocess.run(
        [*run, str(tmp_path / "q.gguf"), "--shape", "tiny", "--dim", "256", "--quant", "Q6_K"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "blk.0.ffn_down.weight: " in out.stderr and "its rows have 128" in out.stderr
    out = subprocess.run(
        [*run, str(tmp_path / "q.gguf"), "--like", "llama3.2:1b", "--quant", "F16"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "not with --shape, --quant or --tied" in out.stderr
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


# --- Q6_K ------------------------------------------------------------------------------------

# the smallest shape of the tests whose rows split into Q6_K's blocks of 256
TINY_Q6_K = ["--shape", "tiny", "--blocks", "2", "--dim", "256", "--ffn", "512"]
SYNTH = [sys.executable, "-m", "pytest_ppsmoke.stage.synth"]


@pytest.fixture(scope="module")
def q6_k_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("q6k") / "tiny-q6k.gguf"
    out = subprocess.run([*SYNTH, str(path), *TINY_Q6_K, "--quant", "Q6_K", "--tied"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return path


@pytest.fixture(scope="module")
def like_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``--like llama3.2:1b`` in the tiny Q6_K shape (one block)."""
    path = tmp_path_factory.mktemp("like") / "like.gguf"
    shape = ["--blocks", "1", "--dim", "256", "--heads", "4", "--kv-heads", "2", "--ffn", "512", "--vocab", "512"]
    out = subprocess.run([*SYNTH, str(path), "--like", "llama3.2:1b", *shape], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return path


def dequantize_q6_k(data: np.ndarray) -> np.ndarray:
    """ggml's ``dequantize_row_q6_K``, written here from ``block_q6_K``: each block of 256
    weights is ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8), d (float16); in
    each half of the block (64 bytes of ql, 32 of qh), weight ``l + 32 k`` (l < 32) takes its low
    bits from ``ql[l]`` (k = 0, 2) or ``ql[l + 32]`` (k = 1, 3), low nibble for k < 2, high for
    k >= 2, its high bits from bits ``2k, 2k+1`` of ``qh[l]``, and its scale from ``scales[i/16]``
    (i its place in the block): ``d * scale * (q - 32)``. ``data``: a tensor's rows of blocks."""
    rows = data.shape[0]
    blocks = data.reshape(-1, 210)
    ql, qh = blocks[:, :128].astype(np.int32), blocks[:, 128:192].astype(np.int32)
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = blocks[:, 208:210].copy().view("<f2").astype(np.float32)
    y = np.empty((len(blocks), 256), dtype=np.float32)
    for half in range(2):
        low, high = ql[:, 64 * half : 64 * half + 64], qh[:, 32 * half : 32 * half + 32]
        for k in range(4):
            nibbles = low[:, 32 * (k % 2) : 32 * (k % 2) + 32]
            q = (nibbles & 0xF if k < 2 else nibbles >> 4) | (high >> (2 * k) & 3) << 4
            at = 128 * half + 32 * k + np.arange(32)
            y[:, at] = d * scales[:, at // 16] * (q - 32)
    return y.reshape(rows, -1)


def test_a_q6_k_tied_file_has_the_types_promised_and_no_head(q6_k_file: Path, like_file: Path) -> None:
    """Every matrix Q6_K, token_embd.weight included, every norm F32, no output.weight, and the
    file marked as llama.cpp marks a Q6_K file; ``--like llama3.2:1b`` adds rope_freqs.weight
    (head dim / 2 F32 factors) and the real model's context length."""
    reader = gguf.GGUFReader(q6_k_file)
    types = {t.name: (t.tensor_type.name, len(t.shape)) for t in reader.tensors}
    assert "output.weight" not in types and types["token_embd.weight"] == ("Q6_K", 2)
    assert {types[n] for n in types if "norm" in n} == {("F32", 1)}
    assert {types[n] for n in types if "norm" not in n} == {("Q6_K", 2)} and len(types) == 1 + 2 * 9 + 1
    q = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    assert [int(n) for n in q.shape] == [512, 256] and q.data.shape == (256, 2 * 210)  # 256 rows of 512
    assert int(reader.fields["general.file_type"].parts[-1][0]) == gguf.LlamaFileType.MOSTLY_Q6_K

    reader = gguf.GGUFReader(like_file)
    types = {t.name: (t.tensor_type.name, len(t.shape)) for t in reader.tensors}
    assert types.pop("rope_freqs.weight") == ("F32", 1) and "output.weight" not in types
    assert {v for n, v in types.items() if "norm" not in n} == {("Q6_K", 2)}
    factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight").data
    assert len(factors) == 32 and factors[0] == 1 and factors[-1] == 32  # head dim 64: 1 (high) .. 32 (low)
    assert int(reader.fields["llama.context_length"].parts[-1][0]) == 131072


def test_q6_k_blocks_dequantize_here_as_in_tinygrad_to_weights_of_spread_0_02(q6_k_file: Path) -> None:
    """tinygrad's dequantization (``gguf_load``, which ``Transformer.from_gguf`` calls) and this
    file's own, from the block layout, agree on every matrix to float16's rounding; the weights
    have mean about 0 and a spread about 0.02, as in the f16 files."""
    reader = gguf.GGUFReader(q6_k_file)
    _, state = nn.state.gguf_load(Tensor(q6_k_file).to("CPU"))
    matrices = [t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q6_K]
    assert len(matrices) == 2 * 7 + 1
    for t in matrices:
        ours = dequantize_q6_k(t.data)
        theirs = state[t.name].numpy()
        assert ours.shape == theirs.shape == tuple(int(n) for n in reversed(t.shape))
        np.testing.assert_allclose(theirs, ours, rtol=2**-11, atol=1e-9, err_msg=t.name)
        assert 0.01 < float(ours.std()) < 0.04 and abs(float(ours.mean())) < 0.002, t.name


def test_a_q6_k_tied_file_loads_into_a_model_whose_head_is_its_embedding(q6_k_file: Path, like_file: Path) -> None:
    """tinygrad 0.12's ``Transformer.from_gguf`` (as this package loads) makes
    token_embd.weight the head of a file without output.weight; the logits are finite, greedy
    decoding starts from them, and two loads answer the same tokens. A ``--like`` file loads
    too (its rope_freqs.weight unused)."""
    answers = []
    for path in (q6_k_file, q6_k_file, like_file):
        model, _, _ = realized_model(str(path), 64, 0, 1, None)
        assert np.array_equal(model.output.weight.numpy(), model.token_embd.weight.numpy())
        x = model.token_embd(Tensor([[256, 300, 301, 302]]))
        for block in model.blk:
            x = block(x, 0)
        logits = model.output(model.output_norm(x)).numpy()
        assert logits.shape == (1, 4, 512) and np.isfinite(logits).all() and logits.std() > 0
        answers.append(unsplit_generate(model, [256, 300, 301, 302], 4, set()))
        assert answers[-1][0] == int(logits[0, -1].argmax())  # tinygrad's greedy step, on the same logits
    assert answers[0] == answers[1] and len(answers[0]) == 4

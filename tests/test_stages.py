"""The layer split and what a stage keeps in memory (in this process, a synthetic model; SmolLM2's
split in a worker: test_worker.py's kv_info); SmolLM2's tokenizer and chat turn; the reference's
rounding and its independence from the stage code (the session's synthetic model)."""

from __future__ import annotations

import random
import re
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tinygrad import Tensor
from tinygrad.apps.llm import SimpleTokenizer

from pytest_ppsmoke.messages import WireDtype, round_to_wire
from pytest_ppsmoke.stage import model as model_module
from pytest_ppsmoke.stage import reference as reference_module
from pytest_ppsmoke.stage.cache import WeightCache
from pytest_ppsmoke.stage.model import (
    ModelError,
    StageModel,
    Tokenizer,
    layer_range,
    load_model,
    realized_model,
    resolve_model,
    unsplit_generate,
)
from pytest_ppsmoke.stage.reference import round_in_graph, run_reference
from pytest_ppsmoke.stage.synth import SHAPES, write

from .helpers import SYNTH

pytestmark = pytest.mark.local


@pytest.fixture(scope="module")
def smollm2_loaded(smollm2: str) -> tuple[Any, dict[str, Any]]:
    """SmolLM2 parsed once (lazily: nothing realized), for this module's tokenizer tests."""
    return load_model(smollm2, 256)


@pytest.mark.parametrize(
    ("total", "stages", "ranges"),
    [
        (30, 2, [(0, 15), (15, 30)]),
        (30, 4, [(0, 7), (7, 14), (14, 21), (21, 30)]),  # the last stage takes the remainder
        (16, 2, [(0, 8), (8, 16)]),  # llama3.2:1b
        (5, 5, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
    ],
)
def test_layer_ranges_follow_the_spec_formula(total: int, stages: int, ranges: list[tuple[int, int]]) -> None:
    assert [layer_range(total, i, stages) for i in range(stages)] == ranges


def test_layer_range_errors_name_the_values() -> None:
    with pytest.raises(ValueError, match="stage 2 of 2 is not a valid stage"):
        layer_range(30, 2, 2)
    with pytest.raises(ValueError, match="31 stages need at least as many blocks; the model has 30"):
        layer_range(30, 0, 31)


def test_model_names_resolve_or_say_what_is_expected() -> None:
    assert str(resolve_model("smollm2:135m")).endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert str(resolve_model("llama3.2:1b")).startswith("https://huggingface.co/")
    with pytest.raises(ModelError, match=r"unknown model 'llama9'; expected one of smollm2:135m, llama3.2:1b"):
        resolve_model("llama9")


def test_a_stage_realizes_only_what_it_owns(tmp_path: Path) -> None:
    """What a stage keeps in memory, on a synthetic model of 4 blocks (its tokens are not the
    point; SmolLM2's split is the pipeline tests'): stage 1 of 2 realizes blocks 2 and 3 and the
    head, and stage 0's blocks are never materialized."""
    path = tmp_path / "tiny.gguf"
    write(path, SHAPES["tiny"], seed=3)
    model, kv = load_model(str(path), 256)  # lazy: nothing realized yet
    dropped_block = model.blk[1].attn_q.weight
    kept_block = model.blk[3].attn_q.weight
    stage = StageModel(model, kv, 1, 2)
    assert (stage.lo, stage.hi, stage.first, stage.last) == (2, 4, False, True)
    assert not dropped_block.uop.is_realized, "a block of stage 0 was materialized on stage 1"
    assert kept_block.uop.is_realized
    assert model.blk[1] is None and model.blk[3] is not None
    assert stage.token_embd is None and stage.output is not None
    # what kv_info reads from tinygrad's objects: stage 0's blocks are gone, stage 1's realized, no cache yet
    info = stage.kv_info()
    assert (info.stage, info.first_block, info.end_block, info.prefill_len, info.writes) == (1, 2, 4, 0, ())
    seen = [(b.block, b.owned, b.present, b.weights_realized, b.cache_shape) for b in info.blocks]
    assert seen == [(i, i >= 2, i >= 2, i >= 2, ()) for i in range(4)]
    with pytest.raises(ValueError, match="stage 1 has no embedding"):
        stage.embed_and_forward([1, 2], 0)


def test_the_smollm2_chat_turn_matches_its_gguf_template(smollm2_loaded: tuple[Any, dict[str, Any]]) -> None:
    _, kv = smollm2_loaded
    tok = Tokenizer(kv)
    text = tok.tok.decode(tok.chat("Say hello"))
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nSay hello<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.end_ids == {2} and tok.decode([57, 5248, 2]) == "I'm"


def test_the_word_pattern_in_ranges_splits_every_text_as_tinygrads_does(
    smollm2_loaded: tuple[Any, dict[str, Any]],
) -> None:
    """Our tokenizer builds tinygrad's word-splitting pattern from ranges of code points, not one
    by one (milliseconds, not half a second in every worker). Each class holds exactly the code
    points of its Unicode category, and SmolLM2's whole tokenizer gives tinygrad's ids on every
    code point, in order and shuffled."""
    z, digits, letters = model_module._category_classes()
    for body, cat in ((z, "Z"), (digits, "N"), (letters, "L")):
        pattern = re.compile(f"[{body}]")
        got = {cp for cp in range(0x110000) if pattern.match(chr(cp))}
        assert got == {cp for cp in range(0x323B0) if unicodedata.category(chr(cp)).startswith(cat)}, cat
    ours = Tokenizer(smollm2_loaded[1]).tok
    theirs = SimpleTokenizer(*_vocab(smollm2_loaded[1]), ours.preset)  # built as tinygrad builds it
    # a tokenizer that only decodes (the last stage's) never builds what encoding needs
    lazy = Tokenizer(smollm2_loaded[1]).tok
    assert lazy.decode([1, 2, 3]) == theirs.decode([1, 2, 3])
    assert not {"_normal_tokens", "_split_to_word", "_split_to_sentence"} & set(vars(lazy))
    lazy.ready_to_encode()
    assert {"_normal_tokens", "_split_to_word", "_split_to_sentence"} <= set(vars(lazy))
    every = [chr(cp) for cp in range(0x323B0 + 64) if not 0xD800 <= cp < 0xE000]
    random.Random(5).shuffle(shuffled := every.copy())
    # tinygrad's pattern takes seconds on all of them: a sample, in order and shuffled
    for text in ("".join(every[::40]), "".join(shuffled[:5000]), "Say héllo, wörld! 123 4567 \u2603\r\n\t  x's"):
        assert ours._split_to_word.findall(text) == theirs._split_to_word.findall(text)
    for attr in ("_byte_decoder", "_normal_tokens", "_special_tokens", "_tok2bytes", "preset"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    sample = "Say héllo, wörld! 1234567 it's\r\n\t  naïve café<|im_end|>\n<|im_start|>assistant\n"
    assert ours.encode(sample) == theirs.encode(sample)


def _vocab(kv: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    types, normal, special = kv["tokenizer.ggml.token_type"], {}, {}
    for idx, tok in enumerate(kv["tokenizer.ggml.tokens"]):
        (normal if types[idx] == 1 else special)[tok] = idx
    return normal, special


def test_a_load_draws_no_random_numbers(monkeypatch: pytest.MonkeyPatch, synth_model: str, tmp_path: Path) -> None:
    """tinygrad's layers start with random weights, which the file's weights replace: drawn,
    they would run the random generator's kernels in every worker's load, for nothing. Neither a
    load from the GGUF nor one from the weight cache draws any, and ``Tensor.uniform`` is
    tinygrad's own again afterwards."""
    uniform = Tensor.uniform

    def drawn(*args: object, **kwargs: object) -> None:
        raise AssertionError("a load drew random numbers")

    monkeypatch.setattr(Tensor, "_threefry_random_bits", staticmethod(drawn))
    cache = WeightCache(tmp_path)
    for source in ("gguf", "cache"):
        model, kv, load = realized_model(synth_model, 64, 0, 1, cache)
        assert load.source == source
        StageModel(model, kv, 0, 1)  # realizes every tensor
    assert Tensor.uniform == uniform


@pytest.mark.parametrize("wire", [WireDtype.bf16, WireDtype.f16])
def test_rounding_in_the_graph_is_the_codecs_bit_for_bit(wire: WireDtype) -> None:
    """The reference rounds its hidden state inside tinygrad's graph; the pipeline rounds on the
    wire (``messages.round_to_wire``). The two must agree on every finite float32: magnitudes from
    subnormal to the largest, random bit patterns, exact ties, and values that overflow f16."""
    rng = np.random.default_rng(7)
    scaled = rng.standard_normal(50_000) * 10.0 ** rng.integers(-40, 38, 50_000)
    bits = rng.integers(0, 2**32, 50_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    ties = (np.arange(1, 2001, dtype=np.uint32) << 16 | 0x8000).view(np.float32)  # exactly halfway in bf16
    edges = [0.0, -0.0, 1.0, 65504.0, 65520.0, 6e-8, 3e-8, 3.4e38, -3.4e38, np.inf, -np.inf]
    x = np.concatenate([scaled.astype(np.float32), bits, ties, np.array(edges, np.float32)])
    x = x[~np.isnan(x)]  # NaNs aside: both keep them NaN, with different payloads
    with np.errstate(over="ignore"):
        want = round_to_wire(x, wire).view(np.uint32)
    got = round_in_graph(Tensor(x), wire).numpy().view(np.uint32)
    differ = np.flatnonzero(got != want)
    shown = [f"{x[i]!r}: {got[i]:#010x}, codec {want[i]:#010x}" for i in differ[:3]]
    assert differ.size == 0, f"{differ.size} values round differently, e.g. {shown}"


def test_the_reference_runs_no_stage_code(monkeypatch: pytest.MonkeyPatch, synth_model: str) -> None:
    """The reference is tinygrad's own ``generate`` on a model of its own: with every entry into
    the stage code broken, it still runs, and with an f32 wire it is exactly the unsplit model's
    greedy output (the hidden state rounded at the boundary with bf16)."""

    def broken(*args: object, **kwargs: object) -> None:
        raise AssertionError("the reference ran stage code")

    monkeypatch.setattr(StageModel, "__init__", broken)
    f32 = run_reference(synth_model, "Say hello", 6, WireDtype.f32, 2, 128)
    model, kv = load_model(synth_model, 128)
    tok = Tokenizer(kv)
    assert list(f32.prompt_token_ids) == tok.chat("Say hello")  # a ReferenceResult: tuples
    assert list(f32.token_ids) == unsplit_generate(model, tok.chat("Say hello"), 6, tok.end_ids)
    assert f32.method == "unsplit"
    bf16 = run_reference(synth_model, "Say hello", 6, WireDtype.bf16, 2, 128)
    assert bf16.method == "unsplit, boundaries rounded to bf16" and len(bf16.token_ids) == 6


def test_the_reference_rounds_at_each_stage_boundary_only_for_a_narrow_wire(
    monkeypatch: pytest.MonkeyPatch, synth_model: str
) -> None:
    """With bf16 or f16 the reference's hidden state is rounded where a stage hands it on (after
    block k-1 of the spec's split), over the prompt and the decode steps; with f32 never."""
    seen: list[tuple[tuple[int, ...], WireDtype]] = []

    def spy(x: Tensor, wire: WireDtype) -> Tensor:
        seen.append((tuple(x.shape), wire))
        return round_in_graph(x, wire)

    monkeypatch.setattr(reference_module, "round_in_graph", spy)
    for wire in (WireDtype.f32, WireDtype.bf16, WireDtype.f16):
        seen.clear()
        ref = run_reference(synth_model, "Say hello", 4, wire, 2, 128)
        if wire is WireDtype.f32:
            assert seen == []
            continue
        assert seen, f"the reference's hidden state was never rounded to {wire.name}"
        prompt = len(ref.prompt_token_ids)
        # the prompt, then decode steps until tinygrad's JIT replays its capture without Python
        assert seen[0] == ((1, prompt, SYNTH.dim), wire) and ((1, 1, SYNTH.dim), wire) in seen[1:], seen


@pytest.mark.parametrize("which", ["synth", "smollm2"])
def test_a_load_holds_tinygrads_own_tensors_and_same_sized_ones_share_their_kernels(
    which: str, request: pytest.FixtureRequest
) -> None:
    """``load_model`` gives, bit for bit, what tinygrad's own ``Transformer.from_gguf`` gives for
    each kind of tensor the file holds (SmolLM2: Q4_1 blocks, a Q8_0 embedding, f32 norms; the
    synthetic model: f16), while each tensor's bytes sit in a buffer of their own: the kernels
    that dequantize three blocks' same-sized tensors are one kernel, where tinygrad's carry each
    tensor's offset in the file."""
    from tinygrad import nn
    from tinygrad.apps.llm import Transformer
    from tinygrad.engine.realize import run_schedule
    from tinygrad.uop.ops import Ops

    name = request.getfixturevalue("synth_model" if which == "synth" else "smollm2")

    def tinygrads() -> dict[str, Tensor]:
        with model_module._no_initial_weights():
            model, _ = Transformer.from_gguf(Tensor(Path(model_module.model_file(name))), 64, realize=False)
        return nn.state.get_state_dict(model)

    def kernels(state: dict[str, Tensor]) -> list[bytes]:
        """The kernels that realize the first blocks' ``attn_q`` (run, so the tensors hold them)."""
        tensors = [state[f"blk.{i}.attn_q.weight"] for i in range(min(3, SYNTH.blocks if which == "synth" else 3))]
        schedule = Tensor.schedule(*tensors)
        run_schedule(list(schedule))
        return [si.ast.key for si in schedule if si.ast.op is Ops.SINK]

    a, b = nn.state.get_state_dict(load_model(name, 64)[0]), tinygrads()
    assert set(a) == set(b)
    ours, theirs = kernels(a), kernels(b)
    assert len(ours) >= 2 and len(set(ours)) == 1, ours  # one kernel, however many tensors
    assert len(theirs) >= 2 and len(set(theirs)) == len(theirs)  # one per tensor: the offsets differ
    # one of each kind: a quantized block weight, one whose rows tinygrad permutes for RoPE (attn_k),
    # a norm, and the embedding (SmolLM2: Q4_1, Q4_1, f32, Q8_0); tinygrad's own path makes
    # programs for each of its tensors, so the others would only cost time
    for k in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_norm.weight", "token_embd.weight"):
        x, y = a[k].numpy(), b[k].numpy()
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), k

"""The layer split and what a stage keeps in memory (in this process, real SmolLM2 weights)."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_ppsmoke.stage.model import ModelError, StageModel, Tokenizer, layer_range, load_model, resolve_model

pytestmark = pytest.mark.local


@pytest.fixture(scope="module")
def smollm2_loaded(smollm2: str) -> tuple[Any, dict[str, Any]]:
    """SmolLM2 parsed once (lazily: nothing realized), for this module's two tests."""
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


def test_a_stage_realizes_only_what_it_owns(smollm2_loaded: tuple[Any, dict[str, Any]]) -> None:
    model, kv = smollm2_loaded  # the only test that uses the model itself, which a StageModel trims
    dropped_block = model.blk[3].attn_q.weight
    kept_block = model.blk[20].attn_q.weight
    stage = StageModel(model, kv, 1, 2)
    assert (stage.lo, stage.hi, stage.first, stage.last) == (15, 30, False, True)
    assert not dropped_block.uop.is_realized, "a block of stage 0 was materialized on stage 1"
    assert kept_block.uop.is_realized
    assert model.blk[3] is None and model.blk[20] is not None
    assert stage.token_embd is None and stage.output is not None
    # what kv_info reads from tinygrad's objects: stage 0's blocks are gone, stage 1's realized, no cache yet
    info = stage.kv_info()
    assert (info["range"], info["prefill_len"], info["writes"]) == ([15, 30], 0, [])
    seen = [(b["block"], b["owned"], b["present"], b["weights_realized"], b["cache_shape"]) for b in info["blocks"]]
    assert seen == [(i, i >= 15, i >= 15, i >= 15, []) for i in range(30)]
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

"""The split forward pass across node processes: coherent, token-exact, KV-local, N stages, failures.

Real SmolLM2-135M weights, one pp-gpu-node process (with its tinygrad worker) per stage, iroh on
loopback. The references run in this process: tinygrad's own unsplit ``Transformer.generate``,
and for a bf16 wire the same split with the hidden state rounded to bf16 at the boundary.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from pytest_ppsmoke.harness.pipeline import InferenceResult, run_inference
from pytest_ppsmoke.protocol import PhaseError
from pytest_ppsmoke.runtime.cluster import LocalCluster
from pytest_ppsmoke.runtime.codec import InferenceRequest, InferenceResponse, StageStatsQuery, WireDtype, round_to_wire
from pytest_ppsmoke.runtime.errors import RemoteError
from pytest_ppsmoke.runtime.swim import SwimConfig
from pytest_ppsmoke.stage.model import StageModel, Tokenizer, load_model, unsplit_generate

pytestmark = [pytest.mark.local, pytest.mark.asyncio(loop_scope="module")]

PROMPT, MAX_TOKENS, SHORT = "Say hello", 64, 24
MODEL = "smollm2:135m"


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    model, kv = load_model(MODEL, 1024)
    tok = Tokenizer(kv)
    ids = tok.chat(PROMPT)
    f32 = unsplit_generate(model, ids, MAX_TOKENS, tok.end_ids)
    # bf16 on the wire: the same two stages, the hidden state rounded to bf16 at the boundary
    s0 = StageModel(load_model(MODEL, 1024)[0], kv, 0, 2)
    s1 = StageModel(load_model(MODEL, 1024)[0], kv, 1, 2)
    bf16 = [s1.forward_and_sample(round_to_wire(s0.embed_and_forward(ids, 0), WireDtype.bf16), 0)]
    while bf16[-1] not in tok.end_ids and len(bf16) < SHORT:
        pos = len(ids) + len(bf16) - 1
        bf16.append(s1.forward_and_sample(round_to_wire(s0.embed_and_forward([bf16[-1]], pos), WireDtype.bf16), pos))
    return {"prompt_ids": ids, "f32": f32, "bf16": bf16, "end_ids": tok.end_ids}


def pipeline(num_stages: int, wire: str) -> LocalCluster:
    env = {"MODEL": MODEL, "PP_WIRE_DTYPE": wire, "PP_LOG_LEVEL": "INFO"}
    return LocalCluster(
        num_stages=num_stages, node_module="pytest_ppsmoke.stage.gpu_node", extra_env=env, swim=SwimConfig.shared_cpu()
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def f32_cluster(reference: dict[str, Any]) -> AsyncIterator[LocalCluster]:
    # the reference is computed first: it runs tinygrad on this event loop's thread for tens of
    # seconds, and a seed that cannot answer that long is an orphaning orchestrator to its nodes
    async with pipeline(2, "f32") as cluster:
        yield cluster


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def f32_run(f32_cluster: LocalCluster) -> InferenceResult:
    assert f32_cluster.seed is not None
    return await run_inference(f32_cluster.seed, 2, PROMPT, MAX_TOKENS, timeout=280)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bf16_cluster(reference: dict[str, Any]) -> AsyncIterator[LocalCluster]:
    async with pipeline(2, "bf16") as cluster:
        yield cluster


async def test_two_stages_say_hello_coherently(f32_run: InferenceResult) -> None:
    text = f32_run.text
    assert text.strip(), "empty response"
    text.encode("utf-8")  # valid UTF-8 (no lone surrogates)
    words = re.findall(r"[A-Za-z']+", text)
    letters = sum(c.isalpha() for c in text if not c.isspace())
    assert len(words) >= 5 and letters / max(1, len(text.replace(" ", ""))) > 0.6, text
    assert 1 <= len(f32_run.token_ids) <= MAX_TOKENS


async def test_f32_wire_gives_exactly_the_unsplit_models_tokens(f32_run: InferenceResult, reference: dict) -> None:
    assert f32_run.prompt_token_ids == reference["prompt_ids"]
    assert f32_run.token_ids == reference["f32"]


async def test_kv_cache_lives_on_the_stage_that_owns_the_blocks(f32_run: InferenceResult) -> None:
    s0, s1 = f32_run.kv
    assert (s0.first_block, s0.end_block, s1.first_block, s1.end_block) == (0, 15, 15, 30)
    assert list(s0.blocks_cached) == list(range(0, 15))
    assert list(s1.blocks_cached) == list(range(15, 30))
    filled = len(f32_run.prompt_token_ids) + len(f32_run.token_ids) - 1
    assert s0.filled == s1.filled == filled
    acts = f32_run.stages[1]["activations_in"]
    assert acts[0]["seq_len"] == len(f32_run.prompt_token_ids) and acts[0]["position"] == 0
    decode = acts[1:]
    assert len(decode) == len(f32_run.token_ids) - 1
    assert {a["seq_len"] for a in decode} == {1}
    assert [a["position"] for a in decode] == list(range(len(f32_run.prompt_token_ids), filled))
    hop = f32_run.hops["pp-stage-0->pp-stage-1"]
    assert hop["prefill"]["bytes_each"] == [len(f32_run.prompt_token_ids) * 576 * 4]
    assert hop["decode"]["bytes_each"] == [576 * 4] and hop["decode"]["count"] == len(decode)


async def test_a_second_request_while_one_runs_is_refused_as_busy(f32_cluster: LocalCluster, reference: dict) -> None:
    seed = f32_cluster.seed
    assert seed is not None
    got: asyncio.Future[InferenceResponse] = asyncio.get_running_loop().create_future()

    class Collector:
        def on_inference_response(self, msg: InferenceResponse, ctx: object) -> None:
            got.set_result(msg)

        def on_first_token(self, msg: object, ctx: object) -> None:
            pass  # prefill is done: not what this test is about

    seed.add_actor("collector", Collector())
    entry = f32_cluster.names["pp-entry"]
    await seed.request(entry, InferenceRequest(seed.address("collector"), PROMPT, SHORT), timeout=30)
    with pytest.raises(RemoteError, match="busy: pp-stage-0 is serving request") as info:
        await seed.request(entry, InferenceRequest(seed.address("collector"), "Something else", 5), timeout=30)
    assert info.value.kind == "Busy"
    response = await asyncio.wait_for(got, 240)
    assert response.error is None
    assert list(response.token_ids) == reference["f32"][:SHORT]  # the refused request touched no cache


async def test_bf16_wire_matches_a_reference_rounded_at_the_same_boundary(
    bf16_cluster: LocalCluster, reference: dict
) -> None:
    assert bf16_cluster.seed is not None
    result = await run_inference(bf16_cluster.seed, 2, PROMPT, SHORT, timeout=280)
    assert result.token_ids == reference["bf16"]
    assert result.hops["pp-stage-0->pp-stage-1"]["decode"]["bytes_each"] == [576 * 2]


@pytest.mark.parametrize("stages", [3, 4])
async def test_more_stages_give_the_same_tokens(stages: int, reference: dict) -> None:
    async with pipeline(stages, "f32") as cluster:
        assert cluster.seed is not None
        result = await run_inference(cluster.seed, stages, PROMPT, SHORT, timeout=280)
    assert result.token_ids == reference["f32"][:SHORT]
    k = 30 // stages
    assert [(kv.first_block, kv.end_block) for kv in result.kv] == [
        (i * k, (i + 1) * k if i < stages - 1 else 30) for i in range(stages)
    ]
    assert all(list(kv.blocks_cached) == list(range(kv.first_block, kv.end_block)) for kv in result.kv)
    assert len(result.hops) == stages - 1


async def test_killing_the_last_workers_process_mid_decode_fails_promptly_naming_the_stage(
    bf16_cluster: LocalCluster,
) -> None:
    seed = bf16_cluster.seed
    assert seed is not None
    last = bf16_cluster.names["pp-exit"]
    worker_pid = bf16_cluster.ready[-1]["worker_pid"]
    before = json.loads((await seed.request(last, StageStatsQuery(), timeout=10)).json)  # type: ignore[attr-defined]
    run = asyncio.ensure_future(run_inference(seed, 2, PROMPT, MAX_TOKENS, timeout=280))
    for _ in range(600):  # wait until decode is under way: a few activations of this request on the last stage
        stats = json.loads((await seed.request(last, StageStatsQuery(), timeout=10)).json)  # type: ignore[attr-defined]
        if stats.get("request_id") != before.get("request_id") and len(stats.get("activations_in", [])) >= 4:
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail("decode never got under way")
    killed = asyncio.get_running_loop().time()
    os.kill(int(worker_pid), signal.SIGKILL)  # type: ignore[arg-type]
    with pytest.raises(PhaseError, match=r"pp-stage-1: pp-stage-1 worker was killed by signal 9") as info:
        await asyncio.wait_for(run, 30)
    assert info.value.phase == "decode"  # tokens had been sampled
    assert asyncio.get_running_loop().time() - killed < 30

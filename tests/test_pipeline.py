"""The split forward pass across node processes: coherent, token-exact, KV-local, N stages, failures.

Real SmolLM2-135M weights, one pp-gpu-node process (with its tinygrad worker) per stage, iroh on
loopback. The reference runs in this process: tinygrad's own unsplit ``Transformer.generate``.
A bf16 wire (the default) is checked token for token, against the same split with the hidden
state rounded to bf16 at the boundary, by the spec suite's ``test_tokens_equal_the_unsplit_reference``,
which this suite runs on SmolLM2 too (``testpaths``). The failure test checks orchestration,
not tokens: it kills a worker of a cluster of its own, on the session's synthetic model, so
that no other test depends on whether it has run.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from pytest_ppsmoke.harness.figures import KvFill
from pytest_ppsmoke.harness.pipeline import InferenceResult, request_reference, run_inference
from pytest_ppsmoke.messages import InferenceRequest, InferenceResponse, StageStats, StageStatsQuery
from pytest_ppsmoke.protocol import PhaseError
from pytest_ppsmoke.runtime.cluster import LocalCluster
from pytest_ppsmoke.runtime.errors import RemoteError
from pytest_ppsmoke.runtime.localproc import EventKind
from pytest_ppsmoke.runtime.swimconfig import SwimConfig

from .helpers import SMOLLM2

pytestmark = [pytest.mark.local, pytest.mark.asyncio(loop_scope="module")]

# the claims hold at any length and each token is some 0.1 s of CPU per stage and of the reference:
# 16 tokens make a sentence of ten words or so, 12 still decode well past the JIT's capture
PROMPT, MAX_TOKENS, SHORT = "Say hello", 16, 12
MODEL = SMOLLM2.name


REFERENCE = """
import json, sys
from pytest_ppsmoke.stage.cache import DEFAULT_ROOT, WeightCache, install_program_cache
from pytest_ppsmoke.stage.model import Tokenizer, realized_model, unsplit_generate
install_program_cache()
model, kv, _ = realized_model(sys.argv[1], 1024, 0, 1, WeightCache(DEFAULT_ROOT))
tok = Tokenizer(kv)
ids = tok.chat(sys.argv[2])
print(json.dumps({"prompt_ids": ids, "f32": unsplit_generate(model, ids, int(sys.argv[3]), tok.end_ids)}))
"""


def pipeline(num_stages: int, wire: str, model: str = MODEL) -> LocalCluster:
    env = {"MODEL": model, "PP_WIRE_DTYPE": wire, "PP_LOG_LEVEL": "INFO"}
    return LocalCluster(
        num_stages=num_stages, node_module="pytest_ppsmoke.stage.gpu_node", extra_env=env, swim=SwimConfig.shared_cpu()
    )


async def unsplit_reference() -> dict[str, Any]:
    """tinygrad's unsplit ``generate`` (the whole model, from the weight cache that the reference
    op fills too), in a process of its own: it runs beside the clusters' start instead of
    blocking this event loop (a seed that cannot answer for tens of seconds is an orphaning
    orchestrator to its nodes)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", REFERENCE, MODEL, PROMPT, str(MAX_TOKENS),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 280)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()[-3000:]
    return json.loads(out.decode().strip().splitlines()[-1])  # type: ignore[no-any-return]


@dataclass
class Runs:
    """What the module's SmolLM2 clusters gave, each outcome a result or the error it raised (so
    that a failure fails the tests that need it, not the module)."""

    outcomes: dict[str | int, Any]  # "reference": prompt_ids and the unsplit tokens; n stages: a run
    f32_cluster: LocalCluster  # two stages, an f32 wire: kept for the busy test

    def get(self, key: str | int) -> Any:
        outcome = self.outcomes[key]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


async def infer(cluster: LocalCluster, num_stages: int, max_tokens: int) -> InferenceResult:
    assert cluster.seed is not None
    return await run_inference(cluster.seed, num_stages, PROMPT, max_tokens, timeout=280)


async def one_request(num_stages: int) -> InferenceResult:
    """SHORT tokens from a cluster of ``num_stages``, closed as soon as it has answered."""
    async with pipeline(num_stages, "f32") as cluster:
        return await infer(cluster, num_stages, SHORT)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runs(smollm2: str) -> AsyncIterator[Runs]:
    """The reference and every SmolLM2 cluster of the module (2 stages for MAX_TOKENS, kept for
    the busy test; 3 for SHORT; both with an f32 wire), started and run together: a stage that
    loads or a request that decodes keeps one core busy, and this machine may have more. (Four
    stages and more: the synthetic model's tests, test_stages.py.)"""
    f32 = pipeline(2, "f32")

    async def first_request() -> InferenceResult:
        await f32.start()
        return await infer(f32, 2, MAX_TOKENS)

    try:
        outcomes = await asyncio.gather(unsplit_reference(), first_request(), one_request(3), return_exceptions=True)
        yield Runs(dict(zip(["reference", 2, 3], outcomes, strict=True)), f32)
    finally:
        await f32.close()  # safe on a cluster whose start failed half way


@pytest.fixture
def reference(runs: Runs) -> dict[str, Any]:
    return runs.get("reference")  # type: ignore[no-any-return]


@pytest.fixture
def f32_run(runs: Runs) -> InferenceResult:
    return runs.get(2)  # type: ignore[no-any-return]


@pytest.fixture
def f32_cluster(runs: Runs) -> LocalCluster:
    runs.get(2)  # started, and served its first request
    return runs.f32_cluster


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


def check_evidence(result: InferenceResult, num_stages: int) -> None:
    """What the spec suite's claim tests check, on a run of this module: each stage's caches (its
    own blocks, filled once over [0, P + G - 1), the prompt's digest kept; no other block), each
    hop's activations received as sent, and the decode loop past the orchestrator."""
    filled = len(result.prompt_token_ids) + len(result.token_ids) - 1
    summary = result.kv_summary()
    assert len(summary) == num_stages
    for k in summary:
        owned = [k.blocks]
        assert k.present == k.realized == k.cached == owned, k
        assert k.filled == [KvFill(blocks=owned, positions=[(0, filled)])], k
        assert (k.prefill_len, k.prefill_digest_kept, k.prefill_digest_changed) == (
            len(result.prompt_token_ids),
            owned,
            [],
        ), k
        assert k.writes == [(0, filled)], k
    for sender, receiver in zip(result.stages, result.stages[1:], strict=False):
        sent = [(h.request_id, h.position, h.seq_len, h.bytes, h.digest) for h in sender.hops_out]
        received = [(a.request_id, a.position, a.seq_len, a.bytes, a.digest) for a in receiver.activations_in]
        assert sent == received and len(sent) == len(result.token_ids)
        assert {r[0] for r in sent} == {result.request_id} and all(len(r[4]) == 16 for r in sent)
    seed = result.frames.orchestrator
    assert seed.decode is not None and seed.prefill is not None, seed
    assert seed.decode.received == {"InferenceResponse": 1} and seed.decode.sent == {}
    assert seed.prefill.received == {"Accepted": 1, "FirstToken": 1}
    assert seed.prefill.sent == {"InferenceRequest": 1}
    assert result.frames.stages["pp-stage-0"].received["NextToken"] == len(result.token_ids)


async def test_kv_cache_lives_on_the_stage_that_owns_the_blocks(f32_run: InferenceResult) -> None:
    s0, s1 = f32_run.kv
    half, blocks = SMOLLM2.blocks // 2, SMOLLM2.blocks
    assert (s0.first_block, s0.end_block, s1.first_block, s1.end_block) == (0, half, half, blocks)
    check_evidence(f32_run, 2)
    filled = len(f32_run.prompt_token_ids) + len(f32_run.token_ids) - 1
    acts = f32_run.stages[1].activations_in
    assert acts[0].seq_len == len(f32_run.prompt_token_ids) and acts[0].position == 0
    decode = acts[1:]
    assert len(decode) == len(f32_run.token_ids) - 1
    assert {a.seq_len for a in decode} == {1}
    assert [a.position for a in decode] == list(range(len(f32_run.prompt_token_ids), filled))
    hop = f32_run.hops["pp-stage-0->pp-stage-1"]
    assert hop.prefill.bytes_each == [len(f32_run.prompt_token_ids) * SMOLLM2.dim * 4]
    assert hop.decode.bytes_each == [SMOLLM2.dim * 4] and hop.decode.count == len(decode)


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


@pytest.mark.parametrize("stages", [3])
async def test_more_stages_give_the_same_tokens(stages: int, runs: Runs, reference: dict) -> None:
    result: InferenceResult = runs.get(stages)
    assert result.token_ids == reference["f32"][:SHORT]
    k = SMOLLM2.blocks // stages
    assert [(kv.first_block, kv.end_block) for kv in result.kv] == [
        (i * k, (i + 1) * k if i < stages - 1 else SMOLLM2.blocks) for i in range(stages)
    ]
    check_evidence(result, stages)
    assert len(result.hops) == stages - 1


WORKER = Path(__file__).resolve().parent.parent / "worker" / "pp_tinygrad_worker.py"
NO_REFERENCE_WORKER = """import os, runpy, sys
if os.environ.get("PP_WORKER_ROLE") == "reference":
    sys.exit("no reference worker on this node")
sys.argv[0] = {worker!r}
runpy.run_path({worker!r}, run_name="__main__")
"""


@pytest.mark.parametrize("starts", [True, False], ids=["starts", "never starts"])
async def test_the_reference_beside_stage_0_answers_or_says_why_it_cannot(
    synth_model: str, tmp_path: Path, starts: bool
) -> None:
    """``PP_REFERENCE=beside``: stage 0's node starts a reference worker with its stage's. The
    reference step's tokens are the pipeline's, from a model loaded beside and kept, and the
    worker's process ends with the node. One that cannot start is the step's error, naming the
    way round it, and the stage still serves."""
    env = {"MODEL": synth_model, "PP_WIRE_DTYPE": "bf16"}
    if not starts:  # the stage's worker as usual; the reference's exits at once
        wrapper = tmp_path / "worker.py"
        wrapper.write_text(NO_REFERENCE_WORKER.format(worker=str(WORKER)))
        env["PP_WORKER"] = str(wrapper)
    cluster = LocalCluster(
        num_stages=2, node_module="pytest_ppsmoke.stage.gpu_node", extra_env=env, swim=SwimConfig.shared_cpu(),
        reference="beside",
    )  # fmt: skip
    async with cluster:
        assert cluster.seed is not None
        result = await run_inference(cluster.seed, 2, PROMPT, 4, timeout=120)
        if not starts:
            with pytest.raises(RemoteError, match="the reference worker beside pp-stage-0 did not start") as e:
                await request_reference(cluster.seed, PROMPT, 4, timeout=60)
            assert "no reference worker on this node" in str(e.value) and "reference=after" in str(e.value)
            again = await run_inference(cluster.seed, 2, PROMPT, 4, timeout=120)
            assert again.token_ids == result.token_ids
            return
        ref = await request_reference(cluster.seed, PROMPT, 4, timeout=60)
        ready = await cluster.members[0].wait_event(lambda e: e.kind is EventKind.REFERENCE_READY, 10, "reference")
    assert (ref.loaded, ref.stage, list(ref.token_ids)) == ("beside", 0, result.token_ids)
    assert ref.mem_after > ref.mem_before  # the model stays in its worker
    with pytest.raises(ProcessLookupError):  # gone with its node
        os.kill(int(ready["pid"]), 0)


@pytest_asyncio.fixture(loop_scope="module")
async def synth_cluster(synth_model: str) -> AsyncIterator[LocalCluster]:
    """A cluster of its own for a test that breaks it."""
    async with pipeline(2, "bf16", model=synth_model) as cluster:
        yield cluster


async def test_killing_the_last_workers_process_mid_decode_fails_promptly_naming_the_stage(
    synth_cluster: LocalCluster,
) -> None:
    seed = synth_cluster.seed
    assert seed is not None
    last = synth_cluster.names["pp-exit"]
    worker_pid = synth_cluster.ready[-1]["worker_pid"]
    before = await seed.request(last, StageStatsQuery(), timeout=10)
    assert isinstance(before, StageStats)
    # many more tokens than the few the test waits for: decode is still under way when the kill comes
    run = asyncio.ensure_future(run_inference(seed, 2, PROMPT, 512, timeout=280))
    for _ in range(600):  # wait until decode is under way: a few activations of this request on the last stage
        stats = await seed.request(last, StageStatsQuery(), timeout=10)
        assert isinstance(stats, StageStats)
        if stats.request_id != before.request_id and len(stats.activations_in) >= 4:
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


async def test_an_answer_that_comes_before_stage_0s_accepted_is_taken_once_the_id_is_known() -> None:
    """Stage 0's Accepted (a reply) and the last stage's InferenceResponse travel apart: with few
    tokens on a loaded machine the answer can come first. It is kept until the request's id is
    known, then taken; an answer to another request is still ignored."""
    from types import SimpleNamespace

    from pytest_ppsmoke.harness.pipeline import _Orchestrator

    counts = iter([{1: (1, 1)}, {1: (2, 2)}])
    ctx: Any = SimpleNamespace(node=SimpleNamespace(frame_counts=lambda: next(counts)))
    orch = _Orchestrator(None)
    ours, stale = InferenceResponse(7, "Hello"), InferenceResponse(6, "an earlier run's")
    orch.on_inference_response(stale, ctx)
    orch.on_inference_response(ours, ctx)
    assert not orch.response.done()  # nothing taken before the id is known
    orch.accepted(7)
    assert orch.response.done() and orch.response.result() is ours
    assert orch.frames_at_response == {1: (2, 2)}  # the counts as ours came
    orch.on_inference_response(InferenceResponse(7, "again"), SimpleNamespace(node=SimpleNamespace(frame_counts=dict)))
    assert orch.response.result() is ours

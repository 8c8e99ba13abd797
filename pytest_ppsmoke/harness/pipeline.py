"""The orchestrator's side of one inference: send the request, await the answer, collect figures.

    async with LocalCluster(num_stages=2, node_module="pytest_ppsmoke.stage.gpu_node",
                            extra_env={"MODEL": "smollm2:135m"}) as cluster:
        result = await run_inference(cluster.seed, cluster.num_stages, "Say hello", 64, timeout=240)

The seed hosts an ``orchestrator`` actor that receives the ``InferenceResponse``. While waiting,
it watches membership: a stage declared dead fails the run at once with its name, instead of
waiting for the deadline. Prefill and decode are timed on this process's clock (the last stage's
``FirstToken``, then the response), so they hold across machines. Per-hop figures come from each
stage's ``StageStats`` (wall-clock timestamps: the latencies need synchronised clocks across
machines, the byte counts do not) and ``KvInfo``.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..protocol import ENTRY, ORCHESTRATOR_ACTOR, PhaseError
from ..runtime.codec import (
    Accepted,
    FirstToken,
    InferenceRequest,
    InferenceResponse,
    KvInfo,
    KvInfoQuery,
    ReferenceQuery,
    ReferenceResult,
    StageStats,
    StageStatsQuery,
)
from ..runtime.errors import RemoteError
from ..runtime.node import Context, Node
from ..runtime.swim import MemberEvent

log = logging.getLogger(__name__)


@dataclass
class InferenceResult:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    timings: dict[str, float]
    hops: dict[str, Any]
    kv: list[KvInfo]
    stages: list[StageStats] = field(repr=False)

    def kv_summary(self) -> list[dict[str, Any]]:
        """Each stage's cached block range and fill, as the reports give it."""
        return [{"stage": k.stage, "blocks_cached": [k.first_block, k.end_block], "filled": k.filled} for k in self.kv]


class _Orchestrator:
    def __init__(self, on_first_token: Callable[[float], None] | None) -> None:
        self.response: asyncio.Future[InferenceResponse] = asyncio.get_running_loop().create_future()
        self.request_id: int | None = None
        self.sent_at = time.monotonic()
        self.first_token_at: float | None = None  # this process's clock: no skew between machines
        self.first_token_callback = on_first_token

    @property
    def phase(self) -> str:
        return "prefill" if self.first_token_at is None else "decode"

    def on_first_token(self, msg: FirstToken, ctx: Context) -> None:
        if self.request_id in (None, msg.request_id) and self.first_token_at is None:
            self.first_token_at = time.monotonic()
            if self.first_token_callback is not None:
                self.first_token_callback(self.first_token_at - self.sent_at)

    def on_inference_response(self, msg: InferenceResponse, ctx: Context) -> None:
        if msg.request_id != self.request_id:  # a late answer to an earlier run
            log.info("ignoring an InferenceResponse for request %d", msg.request_id)
        elif not self.response.done():
            self.response.set_result(msg)


async def run_inference(
    seed: Node,
    num_stages: int,
    prompt: str,
    max_tokens: int,
    timeout: float,
    on_first_token: Callable[[float], None] | None = None,
) -> InferenceResult:
    """Send the request to ``pp-entry`` and await the response; ``on_first_token(seconds)`` is
    called when prefill is done (the last stage sampled its first token)."""
    orch = _Orchestrator(on_first_token)
    seed.actors.pop(ORCHESTRATOR_ACTOR, None)
    seed.add_actor(ORCHESTRATOR_ACTOR, orch)
    stage_ids = {}
    for i in range(num_stages):
        addr = seed.registry.lookup(f"pp-stage-{i}")
        if addr is None:
            raise PhaseError("resolve", f"pp-stage-{i} is not registered")
        stage_ids[addr.node] = i

    def on_member(ev: MemberEvent) -> None:
        if ev.kind == "dead" and ev.member.id in stage_ids and not orch.response.done():
            i = stage_ids[ev.member.id]
            orch.response.set_exception(
                PhaseError(orch.phase, f"pp-stage-{i} ({ev.member.id[:10]}) dropped out of the cluster mid-request")
            )

    seed.membership.add_listener(on_member)
    try:
        try:
            entry = await seed.resolve("pp-entry", 60)
        except LookupError as e:
            raise PhaseError("resolve", str(e)) from None
        started = time.time()
        orch.sent_at = time.monotonic()
        request = InferenceRequest(seed.address(ORCHESTRATOR_ACTOR), prompt, max_tokens)
        try:
            accepted = await seed.request(entry, request, timeout=30)
        except (RemoteError, TimeoutError, ConnectionError) as e:
            raise PhaseError("prefill", f"pp-entry did not take the request: {e}") from None
        if not isinstance(accepted, Accepted):
            raise PhaseError("prefill", f"pp-entry answered {type(accepted).__name__}, expected Accepted")
        orch.request_id = accepted.request_id
        try:
            response = await asyncio.wait_for(orch.response, timeout)
        except TimeoutError:
            raise PhaseError(orch.phase, f"no InferenceResponse within {timeout:.0f} s") from None
    finally:
        seed.membership.remove_listener(on_member)
    finished = time.time()
    done_at = time.monotonic()
    if response.error:  # a failure after the first sampled token is a decode failure
        raise PhaseError("decode" if response.token_ids else "prefill", response.error)
    if not response.text.strip():
        raise PhaseError("decode", f"the last stage reported done with no text (token ids {list(response.token_ids)})")

    stages, kv = [], []
    try:
        for i in range(num_stages):
            addr = seed.registry.lookup(f"pp-stage-{i}")
            if addr is None:
                raise LookupError(f"pp-stage-{i} is no longer registered")
            st = await seed.request(addr, StageStatsQuery(), timeout=30)
            info = await seed.request(addr, KvInfoQuery(), timeout=30)
            assert isinstance(st, StageStats) and isinstance(info, KvInfo)
            stages.append(st)
            kv.append(info)
    except (RemoteError, TimeoutError, ConnectionError, LookupError) as e:
        # the answer stands; only the per-stage figures are missing
        log.warning("the stages' figures are incomplete: %s", e)
        stages, kv = [], []
    result = _figures(response, stages, kv, started, finished)
    if orch.first_token_at is not None:  # on the orchestrator's own clock
        generated = len(response.token_ids)
        decode_s = done_at - orch.first_token_at
        result.timings.update(
            prefill=round(orch.first_token_at - orch.sent_at, 4),
            decode=round(decode_s, 4),
            decode_tokens_per_s=_rate(generated, decode_s),
            inference=round(done_at - orch.sent_at, 4),
        )
    return result


REFERENCE_SLACK = 5.0  # seconds the orchestrator waits beyond the node's deadline for its answer


async def request_reference(seed: Node, prompt: str, max_tokens: int, timeout: float) -> ReferenceResult:
    """The token-exact reference, computed on ``pp-entry``'s node (stage 0) after the request:
    its worker loads the model afresh and runs it in one piece on that node's device. The node
    gets ``timeout`` less a slack, so that its own error (a worker deadline, a busy stage) comes
    back before this one expires. Raises RemoteError, TimeoutError, ConnectionError or LookupError."""
    started = time.monotonic()
    entry = await seed.resolve(ENTRY, min(60.0, timeout))
    left = timeout - (time.monotonic() - started)
    node_s = max(1.0, left - min(REFERENCE_SLACK, left / 10))
    query = ReferenceQuery(prompt, max_tokens, int(node_s * 1000))
    reply = await seed.request(entry, query, timeout=max(1.0, left))
    if not isinstance(reply, ReferenceResult):
        raise RemoteError(entry, "bad_reply", f"answered {type(reply).__name__}, expected ReferenceResult")
    return reply


def _rate(generated: int, decode_s: float) -> float:
    """Decode tokens per second: the first token belongs to prefill."""
    return round((generated - 1) / decode_s, 3) if generated > 1 and decode_s > 0 else 0.0


def _figures(
    response: InferenceResponse, stages: list[StageStats], kv: list[KvInfo], started: float, finished: float
) -> InferenceResult:
    if not stages:
        inference = round(finished - started, 4)
        timings = {"prefill": inference, "decode": 0.0, "decode_tokens_per_s": 0.0, "inference": inference}
        return InferenceResult(response.text, list(response.token_ids), [], timings, {}, [], [])
    last = stages[-1]
    samples = [c for c in last.compute if c.op == "forward_and_sample"]
    first_token_at = samples[0].at + samples[0].s
    generated = len(response.token_ids)
    decode_s = finished - first_token_at
    timings = {
        "prefill": round(first_token_at - started, 4),
        "decode": round(decode_s, 4),
        "decode_tokens_per_s": _rate(generated, decode_s),
        "inference": round(finished - started, 4),
    }
    hops: dict[str, Any] = {}
    for i, st in enumerate(stages[:-1]):
        received = {(a.position, a.seq_len): a.at for a in stages[i + 1].activations_in}
        for phase, want_prefill in (("prefill", True), ("decode", False)):
            out = [h for h in st.hops_out if (h.position == 0) == want_prefill]
            lat = [received[(h.position, h.seq_len)] - h.at for h in out if (h.position, h.seq_len) in received]
            hops.setdefault(f"pp-stage-{i}->pp-stage-{i + 1}", {})[phase] = {
                "count": len(out),
                "bytes_each": sorted({h.bytes for h in out}),
                "bytes_total": sum(h.bytes for h in out),
                "median_s": round(statistics.median(lat), 6) if lat else None,
            }
    return InferenceResult(
        response.text,
        list(response.token_ids),
        list(stages[0].prompt_token_ids),
        timings,
        hops,
        kv,
        stages,
    )

"""The orchestrator's side of one inference: send the request, await the answer, collect figures.

    async with LocalCluster(num_stages=2, node_module="pytest_ppsmoke.stage.gpu_node",
                            extra_env={"MODEL": "smollm2:135m"}) as cluster:
        result = await run_inference(cluster.seed, cluster.num_stages, "Say hello", 64, timeout=240)

The seed hosts an ``orchestrator`` actor that receives the ``InferenceResponse``. While waiting,
it watches membership: a stage declared dead fails the run at once with its name, instead of
waiting for the deadline. A stage that fails the request says so in the response's ``error``,
naming the stages involved by name (``pp-stage-1``); given ``instances`` (each stage's place, e.g.
``instance 12400002 (ppsmoke-...-stage1)``), every message also says where each named stage ran.
Prefill and decode are timed on this process's clock (the last stage's ``FirstToken``, then the
response), so they hold across machines. Per-hop figures come from each stage's ``StageStats``
(wall-clock timestamps: the latencies need synchronised clocks across machines, the byte counts
do not) and ``KvInfo``.

Frames: the seed counts what it sends and receives by message type (``Node.frame_counts``) and
takes three snapshots: before it sends the request, when the ``FirstToken`` arrives (that frame
counted: the boundary), and when the ``InferenceResponse`` arrives (counted). Prefill is the
window between the first two, decode between the last two; each stage's counts cover its request
from the frame that began it. Membership traffic (``MEMBERSHIP_MESSAGES``) is counted apart, and so
are the stages' progress notes (``Progress``: counts of blocks and tokens, one way, for the live
line; ``on_progress`` hears each) and the reference's query and answer (``REFERENCE_MESSAGES``:
asked as stage 0 is ready, it may run beside the request), so that what is left is the request's
own traffic.
"""

from __future__ import annotations

import asyncio
import logging
import re
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..messages import (
    Accepted,
    BlockCache,
    FirstToken,
    InferenceRequest,
    InferenceResponse,
    KvInfo,
    KvInfoQuery,
    ProgramCounts,
    Progress,
    ReferenceQuery,
    ReferenceResult,
    Span,
    StageStats,
    StageStatsQuery,
)
from ..protocol import ENTRY, ORCHESTRATOR_ACTOR, REFERENCE_ACTOR, Phase, PhaseError, stage_name
from ..runtime.codec import MESSAGE_TYPES, ActorAddress
from ..runtime.errors import RemoteError
from ..runtime.node import Context, Node
from ..runtime.swim import MemberEvent
from .figures import Frames, FrameWindow, HopFigures, HopPhases, KvFigures, KvFill, OrchestratorFrames, ProgramFigures

log = logging.getLogger(__name__)

# SWIM and the name registry: what a node sends and receives whatever the pipeline does
MEMBERSHIP_MESSAGES = frozenset(
    {"Ping", "Ack", "PingReq", "Nack", "Join", "Sync", "Gossip", "Register", "ResolveQuery", "Resolved"}
)
NOTE_MESSAGES = frozenset({"Progress"})  # the stages' progress notes: counted apart, as membership is
# the reference, asked as stage 0 is ready: its query and answer may fall in the request's windows
REFERENCE_MESSAGES = frozenset({"ReferenceQuery", "ReferenceResult"})
FINISH_WAIT = 10.0  # how long the figures wait for stage 0 and the last stage to mark the request finished

Counts = dict[int, tuple[int, int]]  # message type code -> (sent, received)


@dataclass
class InferenceResult:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    timings: dict[str, float]
    hops: dict[str, HopPhases]
    kv: list[KvInfo]
    stages: list[StageStats] = field(repr=False)
    request_id: int | None = None
    # the orchestrator's prefill and decode windows, each stage's (by name): frames by type name
    frames: Frames = field(default_factory=Frames)
    # prefill's and decode's start and end on this process's monotonic clock (``timings``' own
    # figures), where the FirstToken came: the report's timeline
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)

    def kv_summary(self) -> list[KvFigures]:
        """Each stage's caches as its worker read them, as the reports give them: the blocks it
        owns; those present, realized and cached (as [start, end) ranges of block indices); the
        positions filled, blocks with the same fill grouped; the prompt's length and which caches
        kept their prefill digest; the writes its calls made."""
        return [
            KvFigures(
                stage=k.stage,
                blocks=(k.first_block, k.end_block),
                present=_ranges(b.block for b in k.blocks if b.present),
                realized=_ranges(b.block for b in k.blocks if b.weights_realized),
                cached=_ranges(b.block for b in k.blocks if b.cache_shape),
                cache_shapes=[
                    list(shape) for shape in sorted({tuple(b.cache_shape) for b in k.blocks if b.cache_shape})
                ],
                filled=_fills(k.blocks),
                prefill_len=k.prefill_len,
                prefill_digest_kept=_ranges(
                    b.block for b in k.blocks if b.prefill_digest and b.digest == b.prefill_digest
                ),
                prefill_digest_changed=_ranges(
                    b.block for b in k.blocks if b.prefill_digest and b.digest != b.prefill_digest
                ),
                writes=_spans(k.writes),
                programs=program_figures(k.programs),
            )
            for k in self.kv
        ]


def program_figures(counts: ProgramCounts | None) -> ProgramFigures | None:
    """A worker's program counts as the report gives them."""
    return ProgramFigures(counts.hits, counts.misses, counts.compiled) if counts is not None else None


def _ranges(indices: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted ints as [start, end) ranges of consecutive ones."""
    out: list[tuple[int, int]] = []
    for i in sorted(indices):
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _spans(spans: tuple[Span, ...]) -> list[tuple[int, int]]:
    return [(s.start, s.end) for s in spans]


def _fills(blocks: tuple[BlockCache, ...]) -> list[KvFill]:
    """The cached blocks grouped by the positions filled."""
    groups: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for b in blocks:
        if b.cache_shape:
            groups.setdefault(tuple((s.start, s.end) for s in b.filled), []).append(b.block)
    return [KvFill(blocks=_ranges(ids), positions=list(key)) for key, ids in groups.items()]


def type_name(code: int) -> str:
    cls = MESSAGE_TYPES.get(code)
    return cls.__name__ if cls is not None else f"type {code}"


def frame_window(pairs: dict[int, tuple[int, int]]) -> FrameWindow:
    """``{code: (sent, received)}`` counts of a window as the report gives them: by type name,
    membership traffic apart."""
    window = FrameWindow()
    for code in sorted(pairs):
        name = type_name(code)
        sent, received = pairs[code]
        if name in MEMBERSHIP_MESSAGES:
            window.membership.sent += sent
            window.membership.received += received
            continue
        if name in NOTE_MESSAGES:
            window.notes.sent += sent
            window.notes.received += received
            continue
        if name in REFERENCE_MESSAGES:
            window.reference.sent += sent
            window.reference.received += received
            continue
        if sent:
            window.sent[name] = sent
        if received:
            window.received[name] = received
    return window


def _between(before: Counts, after: Counts) -> Counts:
    return {
        code: (
            after.get(code, (0, 0))[0] - before.get(code, (0, 0))[0],
            after.get(code, (0, 0))[1] - before.get(code, (0, 0))[1],
        )
        for code in before.keys() | after.keys()
    }


OnProgress = Callable[[Progress], None]


class _Notes:
    """The orchestrator's actor for a reference's progress notes (request id 0)."""

    def __init__(self, on_progress: OnProgress | None) -> None:
        self.progress_callback = on_progress

    def on_progress(self, msg: Progress, ctx: Context) -> None:
        if self.progress_callback is not None and msg.request_id == 0:
            self.progress_callback(msg)


class _Orchestrator:
    def __init__(self, on_first_token: Callable[[float], None] | None, on_progress: OnProgress | None = None) -> None:
        self.response: asyncio.Future[InferenceResponse] = asyncio.get_running_loop().create_future()
        self.request_id: int | None = None
        self.sent_at = time.monotonic()
        self.first_token_at: float | None = None  # this process's clock: no skew between machines
        self.first_token_callback = on_first_token
        self.progress_callback = on_progress
        self.reference_notes: OnProgress | None = None  # a reference's (request id 0), asked before this request
        # the seed's frame counts when the request went out, the FirstToken came, the response came
        self.frames_at_send: Counts = {}
        self.frames_at_first_token: Counts | None = None
        self.frames_at_response: Counts | None = None
        # responses that came before stage 0's Accepted (its reply and the pipeline's answer travel
        # apart: with few tokens on a loaded machine the answer can be first), by request id
        self.early: dict[int, tuple[InferenceResponse, Counts]] = {}

    @property
    def phase(self) -> Phase:
        return Phase.PREFILL if self.first_token_at is None else Phase.DECODE

    def on_first_token(self, msg: FirstToken, ctx: Context) -> None:
        if self.request_id in (None, msg.request_id) and self.first_token_at is None:
            self.first_token_at = time.monotonic()
            self.frames_at_first_token = ctx.node.frame_counts()  # this FirstToken counted
            if self.first_token_callback is not None:
                self.first_token_callback(self.first_token_at - self.sent_at)

    def on_progress(self, msg: Progress, ctx: Context) -> None:
        """A stage's note of its work (counted apart in the frames): to ``on_progress``, if it
        is of this request, or of one whose id is not known yet."""
        if msg.request_id == 0:  # the reference's, asked before the request and still running
            if self.reference_notes is not None:
                self.reference_notes(msg)
        elif self.progress_callback is not None and self.request_id in (None, msg.request_id):
            self.progress_callback(msg)

    def on_inference_response(self, msg: InferenceResponse, ctx: Context) -> None:
        frames = ctx.node.frame_counts()  # this response counted
        if self.request_id is None:  # ours not known yet: kept until it is (``accepted``)
            self.early[msg.request_id] = (msg, frames)
        elif msg.request_id != self.request_id:  # a late answer to an earlier run
            log.info("ignoring an InferenceResponse for request %d", msg.request_id)
        else:
            self._answer(msg, frames)

    def accepted(self, request_id: int) -> None:
        """Stage 0 said the request's id: a response that came before is taken now."""
        self.request_id = request_id
        for early, (msg, frames) in self.early.items():
            if early == request_id:
                self._answer(msg, frames)
            else:
                log.info("ignoring an InferenceResponse for request %d", early)
        self.early.clear()

    def _answer(self, msg: InferenceResponse, frames: Counts) -> None:
        if not self.response.done():
            self.frames_at_response = frames
            self.response.set_result(msg)


def stage_at(stage: int, instances: Mapping[int, str], endpoint_id: str = "") -> str:
    """``pp-stage-1 on instance 12400002 (label)``: a stage by its name and where it runs (its
    endpoint id where the instance is not known)."""
    where = instances.get(stage)
    if where:
        return f"{stage_name(stage)} on {where}"
    return f"{stage_name(stage)} (endpoint {endpoint_id[:10]})" if endpoint_id else stage_name(stage)


def locate_stages(text: str, instances: Mapping[int, str]) -> str:
    """A node's error names stages by name only (it does not know the instances): the first
    mention of each stage gets where that stage runs."""
    for stage in sorted(instances):
        found = re.search(rf"\b{stage_name(stage)}\b(?!-)(?! on )", text)
        if found and instances[stage]:
            text = text[: found.start()] + stage_at(stage, instances) + text[found.end() :]
    return text


async def run_inference(
    seed: Node,
    num_stages: int,
    prompt: str,
    max_tokens: int,
    timeout: float,
    on_first_token: Callable[[float], None] | None = None,
    instances: Mapping[int, str] | None = None,
    on_progress: OnProgress | None = None,
) -> InferenceResult:
    """Send the request to ``pp-entry`` and await the response; ``on_first_token(seconds)`` is
    called when prefill is done (the last stage sampled its first token), ``on_progress`` with
    each stage's note of its work (``Progress``). ``instances``: where each stage runs, as
    failure messages name it (``instance 12400002 (label)``)."""
    places = dict(instances or {})
    orch = _Orchestrator(on_first_token, on_progress)
    before = seed.actors.pop(ORCHESTRATOR_ACTOR, None)
    if isinstance(before, _Notes):  # a reference in flight: its notes still reach its callback
        orch.reference_notes = before.progress_callback
    seed.add_actor(ORCHESTRATOR_ACTOR, orch)
    stage_ids = {}
    for i in range(num_stages):
        addr = seed.registry.lookup(stage_name(i))
        if addr is None:
            raise PhaseError(Phase.RESOLVE, f"{stage_name(i)} is not registered")
        stage_ids[addr.node] = i

    def on_member(ev: MemberEvent) -> None:
        if ev.kind == "dead" and ev.member.id in stage_ids and not orch.response.done():
            where = stage_at(stage_ids[ev.member.id], places, ev.member.id)
            orch.response.set_exception(
                PhaseError(
                    orch.phase,
                    f"{where} dropped out of the cluster mid-request: the orchestrator's SWIM declared it dead",
                )
            )

    seed.membership.add_listener(on_member)
    try:
        try:
            entry = await seed.resolve("pp-entry", 60)
        except LookupError as e:
            raise PhaseError(Phase.RESOLVE, str(e)) from None
        started = time.time()
        orch.frames_at_send = seed.frame_counts()
        orch.sent_at = time.monotonic()
        request = InferenceRequest(seed.address(ORCHESTRATOR_ACTOR), prompt, max_tokens)
        try:
            accepted = await seed.request(entry, request, timeout=30)
        except (RemoteError, TimeoutError, ConnectionError) as e:
            raise PhaseError(Phase.PREFILL, f"pp-entry did not take the request: {e}") from None
        if not isinstance(accepted, Accepted):
            raise PhaseError(Phase.PREFILL, f"pp-entry answered {type(accepted).__name__}, expected Accepted")
        orch.accepted(accepted.request_id)
        try:
            response = await asyncio.wait_for(orch.response, timeout)
        except TimeoutError:
            raise PhaseError(orch.phase, f"no InferenceResponse within {timeout:.0f} s") from None
    finally:
        seed.membership.remove_listener(on_member)
    finished = time.time()
    done_at = time.monotonic()
    if response.error:  # a failure after the first sampled token is a decode failure
        raise PhaseError(Phase.DECODE if response.token_ids else Phase.PREFILL, locate_stages(response.error, places))
    if not response.text.strip():
        raise PhaseError(
            Phase.DECODE, f"the last stage reported done with no text (token ids {list(response.token_ids)})"
        )

    stages, kv = [], []
    try:
        for i in range(num_stages):
            addr = seed.registry.lookup(stage_name(i))
            if addr is None:
                raise LookupError(f"{stage_name(i)} is no longer registered")
            info = await seed.request(addr, KvInfoQuery(), timeout=30)
            assert isinstance(info, KvInfo)
            ends = i in (0, num_stages - 1)  # the stages that mark the request finished
            stages.append(await _stage_stats(seed, addr, response.request_id, ends))
            kv.append(info)
    except (RemoteError, TimeoutError, ConnectionError, LookupError) as e:
        # the answer stands; only the per-stage figures are missing
        log.warning("the stages' figures are incomplete: %s", e)
        stages, kv = [], []
    result = _figures(response, stages, kv, started, finished)
    result.request_id = response.request_id
    result.frames = _frames(orch, stages)
    if orch.first_token_at is not None:  # on the orchestrator's own clock
        generated = len(response.token_ids)
        decode_s = done_at - orch.first_token_at
        result.timings.update(
            prefill=round(orch.first_token_at - orch.sent_at, 4),
            decode=round(decode_s, 4),
            decode_tokens_per_s=_rate(generated, decode_s),
            inference=round(done_at - orch.sent_at, 4),
        )
        result.spans = {"prefill": (orch.sent_at, orch.first_token_at), "decode": (orch.first_token_at, done_at)}
    return result


async def _stage_stats(seed: Node, addr: Any, request_id: int, wait_finished: bool) -> StageStats:
    """A stage's figures; with ``wait_finished``, once the stage has marked the request finished
    (stage 0 learns it from the last stage's done NextToken, which races the answer to the seed),
    or after ``FINISH_WAIT``."""
    deadline = time.monotonic() + FINISH_WAIT
    while True:
        st = await seed.request(addr, StageStatsQuery(), timeout=30)
        assert isinstance(st, StageStats)
        if not wait_finished or st.finished_at is not None or st.request_id != request_id:
            return st
        if time.monotonic() > deadline:
            log.warning(
                "%s did not mark request %d finished within %.0f s", stage_name(st.stage), request_id, FINISH_WAIT
            )
            return st
        await asyncio.sleep(0.02)


def _frames(orch: _Orchestrator, stages: list[StageStats]) -> Frames:
    """The frames of the request: the seed's prefill and decode windows, each stage's own."""
    seed = OrchestratorFrames()
    first, last = orch.frames_at_first_token, orch.frames_at_response
    if first is not None:
        seed.prefill = frame_window(_between(orch.frames_at_send, first))
        if last is not None:
            seed.decode = frame_window(_between(first, last))
    elif last is not None:  # no FirstToken: the whole request is one window
        seed.prefill = frame_window(_between(orch.frames_at_send, last))
    return Frames(
        orchestrator=seed,
        stages={
            stage_name(st.stage): frame_window({f.type_code: (f.sent, f.received) for f in st.frames}) for st in stages
        },
    )


REFERENCE_SLACK = 5.0  # seconds the orchestrator waits beyond the node's deadline for its answer


async def request_reference(
    seed: Node,
    prompt: str,
    max_tokens: int,
    timeout: float,
    on_progress: OnProgress | None = None,
    beside: str | None = None,
) -> ReferenceResult:
    """The token-exact reference, computed on stage 0's node: by its reference worker (loaded
    beside the stages: ``beside`` is that node's id, and its reference actor answers from its
    join on, before the request) or by ``pp-entry``'s stage worker after the request, which loads
    the model afresh; either runs it in one piece on that node's device. The node
    gets ``timeout`` less a slack, so that its own error (a worker deadline, a busy stage) comes
    back before this one expires; it notes its work (``Progress``, request id 0: ``loading``,
    then its ``tokens``) to the orchestrator's actor, which asks: ``on_progress`` hears each.
    Raises RemoteError, TimeoutError, ConnectionError or LookupError."""
    current = seed.actors.get(ORCHESTRATOR_ACTOR)
    if isinstance(current, _Orchestrator):  # a request's: it passes the reference's notes on
        current.reference_notes = on_progress
    else:
        seed.actors.pop(ORCHESTRATOR_ACTOR, None)
        seed.add_actor(ORCHESTRATOR_ACTOR, _Notes(on_progress))
    started = time.monotonic()
    if beside is not None:
        entry = ActorAddress(beside, REFERENCE_ACTOR)
    else:
        entry = await seed.resolve(ENTRY, min(60.0, timeout))
    left = timeout - (time.monotonic() - started)
    node_s = max(1.0, left - min(REFERENCE_SLACK, left / 10))
    query = ReferenceQuery(prompt, max_tokens, int(node_s * 1000))
    reply = await seed.request(entry, query, timeout=max(1.0, left), sender=ORCHESTRATOR_ACTOR)
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
    hops: dict[str, HopPhases] = {}
    for i, st in enumerate(stages[:-1]):
        received = {(a.position, a.seq_len): a.at for a in stages[i + 1].activations_in}
        phases = []
        for want_prefill in (True, False):
            out = [h for h in st.hops_out if (h.position == 0) == want_prefill]
            lat = [received[(h.position, h.seq_len)] - h.at for h in out if (h.position, h.seq_len) in received]
            phases.append(
                HopFigures(
                    count=len(out),
                    bytes_each=sorted({h.bytes for h in out}),
                    bytes_total=sum(h.bytes for h in out),
                    median_s=round(statistics.median(lat), 6) if lat else None,
                )
            )
        hops[f"{stage_name(i)}->{stage_name(i + 1)}"] = HopPhases(prefill=phases[0], decode=phases[1])
    return InferenceResult(
        response.text,
        list(response.token_ids),
        list(stages[0].prompt_token_ids),
        timings,
        hops,
        kv,
        stages,
    )

"""``pp-gpu-node``: one pipeline stage as a cluster member, configured by its environment.

Environment: :class:`~pytest_ppsmoke.nodeenv.NodeEnv` (the stage and stage count, the seed, the
model, the cluster keys, the wire dtype, the worker's settings and deadline, the node's own
time-to-live; the table is docs/nodeenv.md).

The node joins the cluster first (so the orchestrator sees it boot), starts the tinygrad worker,
and registers its names only once the worker is ready: resolving ``pp-entry`` then means the
stage can serve. The flow, for stage i of N:

- stage 0, on ``InferenceRequest``: tokenize, prefill, ``StageActivation`` to ``pp-stage-1``;
- middle stages, on ``StageActivation``: forward, ``StageActivation`` to ``pp-stage-{i+1}``;
- the last stage: forward and sample; ``NextToken`` to ``pp-stage-0``; on an end id or
  ``max_tokens``, that ``NextToken`` is marked done and then ``InferenceResponse`` goes to
  ``reply_to`` (which rides on the prefill activation): stage 0 is free before the answer is out;
- stage 0, on ``NextToken``: the decode step, ``StageActivation`` with ``seq_len`` 1.

Beside the flow, one-way progress notes to ``reply_to`` (``Progress``, ``notes.py``): each stage,
once its part of the prefill is done, the blocks the prompt has passed; the last stage in decode
the tokens sampled, at most one a second; in a reference, to the actor that asked, ``loading``
and then the reference's tokens as its worker says them.

The evidence a stage keeps of its request (``StageStats``): each activation sent and received
with the digest of its raw wire bytes, taken by the worker that produced them and by the worker
that decoded them; the frames the node sent and received, by type, from the frame that began
the request on. ``KvInfo`` is the worker's reading of its caches (``StageModel.kv_info``).

Any stage answers ``ReferenceQuery`` (``refquery.py``): the model runs in one piece on the node's
device, and ``ReferenceResult`` carries the tokens. On stage 0 a reference worker of its own
(``PP_REFERENCE=beside``: the orchestrator's choice on GPUs) loads it while the stages load, and
the node's reference actor answers from its start (the harness asks it as the node joins);
elsewhere, or with ``PP_REFERENCE=after``, the stage's worker loads it afresh after the request
(the harness asks ``pp-entry``).

One request at a time: a second ``InferenceRequest`` while one runs is refused with a "busy"
error and touches no cache. Any failure on a stage (a worker error or death, an unreachable next
stage) is sent to ``reply_to`` as an ``InferenceResponse`` whose ``error`` names the stage, and
for a stage lost mid-request, that stage by name and what detected it (``pp-stage-0: pp-stage-1
dropped out of the cluster mid-request: pp-stage-0's SWIM declared it dead``, ``pp-stage-0:
pp-stage-1 unreachable mid-request: a send to it failed: ...``).
The status actor (``account.py``) answers from the join: ``NodeStatusQuery`` and ``LogTailQuery``
(the node's own last log lines, kept by ``main``'s ``LogRing`` with its secrets redacted, and the
stalls its ``LoopWatch`` measured from the start; each stall also raises its local health score).
stdout carries JSON lines: ``{"event": "joined"}``, then ``{"event": "ready", ...}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .. import failpoints
from ..messages import (
    Accepted,
    ComputeRecord,
    FirstToken,
    FrameCount,
    Hidden,
    HopRecord,
    InferenceRequest,
    InferenceResponse,
    KvInfo,
    KvInfoQuery,
    NextToken,
    PeerPath,
    ProbeReport,
    ReferenceQuery,
    ReferenceResult,
    RelayProbe,
    Span,
    StageActivation,
    StageStats,
    StageStatsQuery,
    WireDtype,
)
from ..nodeenv import inherited
from ..protocol import REFERENCE_ACTOR, STAGE_ACTOR, STATUS_ACTOR, stage_name, stage_names
from ..runtime import scrub
from ..runtime.codec import ActorAddress, Message
from ..runtime.localproc import configure_child_logging, emit, stop_event
from ..runtime.logring import LogRing
from ..runtime.node import Context, Node
from ..runtime.stalls import LoopWatch
from ..runtime.swim import MemberEvent
from . import lifecycle, markers
from .account import StatusActor
from .beside import ReferenceBeside
from .bridge import WorkerBridge, WorkerDied, WorkerError
from .lifecycle import Lifecycle
from .lifetime import Settings, container_env, give_up, guard_lifetime, orchestrator_gone
from .notes import Notes
from .pipe import (
    DecodeStep,
    Detokenize,
    EmbedAndForward,
    Forward,
    ForwardAndSample,
    HiddenOut,
    ReadKvInfo,
    Ready,
    Request,
    Tokenize,
    ready_fields,
)
from .refquery import Busy, ReferenceActor, ReferenceGate, answer, query_seconds

log = logging.getLogger(__name__)
R = TypeVar("R")

HOP_TIMEOUT = 30.0  # a send to the next stage
NAME_TIMEOUT = 60.0  # the spec's deadline for a name
COMPUTE_TIMEOUT = 600.0  # one worker call (a cold prefill compiles kernels)


class StageLost(ConnectionError):
    """Another stage could not be reached mid-request; the message names it and how it was found."""


@dataclass
class Figures:
    """A stage's figures for its request as they grow (appends on the per-token path cost
    nothing); ``StageStats`` is their snapshot on the wire."""

    stage: int
    request_id: int | None = None
    accepted_at: float | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    activations_in: list[HopRecord] = field(default_factory=list)
    hops_out: list[HopRecord] = field(default_factory=list)
    compute: list[ComputeRecord] = field(default_factory=list)
    frames_at_start: dict[int, tuple[int, int]] = field(default_factory=dict)  # the node's counts before the request
    finished_at: float | None = None

    def snapshot(self, frames_now: dict[int, tuple[int, int]]) -> StageStats:
        """The figures, with the frames counted since the request began (``frames_now``: the
        node's counts now)."""
        frames = []
        for code in sorted(frames_now.keys() | self.frames_at_start.keys()):
            sent0, received0 = self.frames_at_start.get(code, (0, 0))
            sent, received = frames_now.get(code, (0, 0))
            if sent != sent0 or received != received0:
                frames.append(FrameCount(code, sent - sent0, received - received0))
        return StageStats(
            self.stage,
            self.request_id,
            self.accepted_at,
            tuple(self.prompt_token_ids),
            tuple(self.activations_in),
            tuple(self.hops_out),
            tuple(self.compute),
            tuple(frames),
            self.finished_at,
        )


class StageActor:
    def __init__(
        self,
        node: Node,
        bridge: WorkerBridge,
        stage: int,
        num_stages: int,
        wire: WireDtype,
        reference: ReferenceActor | None = None,
    ) -> None:
        assert bridge.ready is not None
        self.node, self.bridge, self.reference = node, bridge, reference
        self.stage, self.num_stages, self.wire = stage, num_stages, wire
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.dim, self.max_context = bridge.ready.dim, bridge.ready.max_context
        self.end_ids = set(bridge.ready.end_ids)
        self.name = stage_name(stage)
        self._ids = itertools.count(int(time.time() * 1000) % 1_000_000 * 1000)
        self.busy: int | None = None
        # one reference at a time: beside, the reference actor's; in the stage's worker, this one
        # (requests are refused meanwhile)
        self.gate = reference.gate if reference is not None else ReferenceGate(self.name)
        self.reply_to: ActorAddress | None = None
        self.max_tokens = 0
        self.tokens: list[int] = []
        self.stats = Figures(stage)  # the last request's, as they grow
        self._addr_cache: dict[str, ActorAddress] = {}
        self._failed: set[int] = set()
        self._progress_at = time.monotonic()
        self.notes = Notes(node, stage)  # the counts the orchestrator's live line shows
        self.life = Lifecycle(self.name)  # where it is, in its own log at any level
        span, blocks = bridge.ready.range, bridge.ready.num_blocks
        # what a stage's prefill note says: the blocks the prompt has passed, or the stages
        self.prefilled = ("blocks", span.end, blocks) if span and blocks else ("stages", stage + 1, num_stages)
        bridge.on_death = self._worker_died
        if self.first:
            node.membership.add_listener(self._member_event)
            node.spawn(self._watchdog())

    # --- helpers -----------------------------------------------------------------------------

    async def _addr(self, name: str) -> ActorAddress:
        # Names can move (a restarted stage); resolve once per request, from the registry.
        if name not in self._addr_cache:
            self._addr_cache[name] = await self.node.resolve(name, NAME_TIMEOUT)
        return self._addr_cache[name]

    def _hidden(self, reply: HiddenOut) -> Hidden:
        """The hidden state of a worker's reply: its raw bytes, as they go on the wire."""
        if reply.dtype is not self.wire:
            raise ValueError(f"the worker answered in {reply.dtype.name}, the wire is {self.wire.name}")
        return Hidden(int(self.wire), (reply.seq_len, self.dim), reply.hidden)

    async def _send_to(self, name: str, msg: StageActivation | NextToken) -> None:
        """A send to another stage; one that fails names that stage (StageLost)."""
        addr = await self._addr(name)
        try:
            await self.node.send(addr, msg, sender=STAGE_ACTOR, timeout=HOP_TIMEOUT)
        except ConnectionError as e:
            raise StageLost(f"{name} unreachable mid-request: a send to it failed: {e}") from None

    async def _send_activation(self, act: StageActivation, reply: HiddenOut) -> None:
        """Send ``act``, whose hidden state the worker's ``reply`` produced; the hop's record
        carries the worker's digest of those bytes."""
        started = time.time()
        await self._send_to(stage_name(self.stage + 1), act)
        hop = HopRecord(
            act.position,
            act.seq_len,
            len(act.hidden.data),
            started,
            round(time.time() - started, 6),
            act.request_id,
            reply.hidden_digest,
        )
        self.stats.hops_out.append(hop)

    def _new_request(
        self, request_id: int, reply_to: ActorAddress | None, max_tokens: int, began_with: Message, ctx: Context
    ) -> None:
        """Begin request ``request_id``; ``began_with``: the message that began it, a frame that
        the node has already counted when it came from another node (it belongs to the request)."""
        self.busy, self.reply_to, self.max_tokens, self.tokens = request_id, reply_to, max_tokens, []
        self._progress_at = time.monotonic()
        self.notes.reset()
        self.bridge.on_progress = self._programs_made
        self._addr_cache.clear()
        frames, code = self.node.frame_counts(), began_with.type_code
        if ctx.sender.node != self.node.id and code in frames:
            sent, received = frames[code]
            frames[code] = (sent, received - 1)
        self.stats = Figures(self.stage, request_id, frames_at_start=frames)

    def _programs_made(self, what: str, done: int, total: int) -> None:
        """The worker's count of the programs a call has read or generated (a cold prefill makes
        them): a note to the orchestrator, at most one a second."""
        if what == "programs" and self.busy is not None:
            self.notes.send(self.reply_to, self.busy, what, done, total)

    async def _compute(self, request: Request[R]) -> R:
        started = time.time()
        reply, worker_s = await self.bridge.timed_call(request, COMPUTE_TIMEOUT)
        call = ComputeRecord(
            request.op,
            getattr(request, "position", None),
            started,
            round(time.time() - started, 6),  # as the node sees it: bridge included
            worker_s,  # inside the worker
        )
        self.stats.compute.append(call)
        return reply

    async def _fail(self, request_id: int, error: BaseException | str) -> None:
        if request_id in self._failed:  # a worker death is seen by the call and by the bridge
            return
        self._failed.add(request_id)
        text = f"{self.name}: {error}"
        log.error("request %d failed: %s", request_id, text)
        reply_to, self.busy = self.reply_to, None
        if reply_to is not None:
            with contextlib.suppress(Exception):
                await self.node.send(
                    reply_to, InferenceResponse(request_id, "", tuple(self.tokens), text), timeout=HOP_TIMEOUT
                )
        if not self.first:  # free stage 0 for the next request
            with contextlib.suppress(Exception):
                await self.node.send(
                    await self._addr(stage_name(0)), NextToken(request_id, 0, 0, True), timeout=HOP_TIMEOUT
                )

    @contextlib.asynccontextmanager
    async def _ends_on_failure(self, request_id: int) -> AsyncIterator[None]:
        """Any failure inside ends the request with an error naming this stage; so does a
        cancellation (the node is stopping), which then carries on."""
        try:
            yield
        except asyncio.CancelledError:
            await asyncio.shield(self._fail(request_id, "node stopping"))
            raise
        except Exception as e:
            await self._fail(request_id, e)

    def _worker_died(self, err: WorkerDied) -> None:
        # stage 0 and the last stage know when a request ends; a middle stage learns of the death
        # from its next call, which fails at once
        if self.busy is not None and (self.first or self.last):
            self.node.spawn(self._fail(self.busy, err))

    def _member_event(self, ev: MemberEvent) -> None:
        """Stage 0: a downstream stage that leaves or dies ends the request in flight."""
        if self.busy is None or ev.kind != "dead":
            return
        name = self._downstream().get(ev.member.id)
        if name is not None:
            lost = f"{name} dropped out of the cluster mid-request: {self.name}'s SWIM declared it dead"
            self.node.spawn(self._fail(self.busy, lost))

    def _downstream(self) -> dict[str, str]:
        """The later stages' endpoint ids and names: those of this request (a dead member's
        names vanish from the registry with it), then the registry's."""
        found = {a.node: name for name, a in self._addr_cache.items() if name != self.name}
        for i in range(self.stage + 1, self.num_stages):
            addr = self.node.registry.lookup(stage_name(i))
            if addr is not None:
                found.setdefault(addr.node, stage_name(i))
        return found

    async def _watchdog(self) -> None:
        """Stage 0: no progress for a whole step's deadline frees it, whatever was lost."""
        limit = COMPUTE_TIMEOUT + 2 * HOP_TIMEOUT
        while True:
            await asyncio.sleep(min(5.0, limit / 10))
            if self.busy is not None and time.monotonic() - self._progress_at > limit:
                await self._fail(self.busy, f"no progress for {limit:.0f} s")

    # --- stage 0 -----------------------------------------------------------------------------

    async def on_inference_request(self, msg: InferenceRequest, ctx: Context) -> Accepted:
        if not self.first:
            raise ValueError(f"{self.name} is not the entry stage; send InferenceRequest to pp-entry")
        if self.busy is not None:
            raise Busy(f"busy: {self.name} is serving request {self.busy}; one request at a time")
        if self.gate.running and self.reference is None:  # in the stage's own worker
            raise Busy(f"busy: {self.name} is computing the reference; one request at a time")
        if msg.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {msg.max_tokens}")
        rid = next(self._ids)
        self._new_request(rid, msg.reply_to, msg.max_tokens, msg, ctx)
        self.stats.accepted_at = time.time()
        self.node.spawn(self._prefill(rid, msg.prompt))
        return Accepted(rid)

    async def _prefill(self, rid: int, prompt: str) -> None:
        async with self._ends_on_failure(rid):
            ids = (await self._compute(Tokenize(prompt))).token_ids
            if len(ids) + self.max_tokens - 1 > self.max_context:  # the last token is never fed back
                raise ValueError(
                    f"prompt of {len(ids)} tokens + max_tokens {self.max_tokens} "
                    f"exceed the context of {self.max_context}"
                )
            self.stats.prompt_token_ids = list(ids)
            self.life.prefill(rid, len(ids))
            emit({"event": "prefill", "request_id": rid, "stage": self.stage})
            reply = await self._compute(EmbedAndForward(ids, 0, prefill=True))
            act = StageActivation(rid, 0, len(ids), True, self._hidden(reply), self.reply_to, self.max_tokens)
            await self._send_activation(act, reply)
            self.notes.send(self.reply_to, rid, *self.prefilled, always=True)
            self.life.prefilled(rid)

    async def on_next_token(self, msg: NextToken, ctx: Context) -> None:
        if msg.request_id != self.busy:
            log.info("NextToken for request %d, which is not in flight (%s)", msg.request_id, self.busy)
            return
        self._progress_at = time.monotonic()
        self.tokens.append(msg.token_id)  # so that a failure report says how far decode got
        self.life.decode(msg.request_id, len(self.tokens), self.max_tokens, last=msg.done)
        if msg.done:
            self.life.done(msg.request_id, len(self.tokens))
            self.busy = None
            self.stats.finished_at = time.time()
            return
        async with self._ends_on_failure(msg.request_id):
            await _slow_decode()
            reply = await self._compute(DecodeStep(msg.token_id, msg.position))
            act = StageActivation(msg.request_id, msg.position, 1, False, self._hidden(reply))
            await self._send_activation(act, reply)

    # --- later stages ------------------------------------------------------------------------

    async def on_stage_activation(self, msg: StageActivation, ctx: Context) -> None:
        if self.first:
            raise ValueError("stage 0 does not take activations")
        if msg.is_prefill:
            self._new_request(msg.request_id, msg.reply_to, msg.max_tokens, msg, ctx)
        elif msg.request_id != self.busy:
            raise ValueError(f"activation for request {msg.request_id}, but {self.name} serves {self.busy}")
        h = msg.hidden
        arrived = time.time()

        def received(digest: bytes | None) -> None:  # the worker's digest of the bytes it decoded
            hop = HopRecord(msg.position, msg.seq_len, len(h.data), arrived, 0.0, msg.request_id, digest or b"")
            self.stats.activations_in.append(hop)

        async with self._ends_on_failure(msg.request_id):
            if h.wire_dtype is not self.wire or tuple(h.shape) != (msg.seq_len, self.dim):
                raise ValueError(
                    f"activation of shape {tuple(h.shape)} in {h.wire_dtype.name}; "
                    f"expected ({msg.seq_len}, {self.dim}) in {self.wire.name}"
                )
            if not msg.is_prefill and msg.seq_len != 1:
                raise ValueError(f"decode activation with seq_len {msg.seq_len}; decode carries one position")
            if not msg.is_prefill:
                await _slow_decode()
            else:
                self.life.prefill(msg.request_id, msg.seq_len)
                emit({"event": "prefill", "request_id": msg.request_id, "stage": self.stage})
                if failpoints.on("node.hold_prefill"):  # a loss or a freeze "as its prefill begins" lands in it
                    await asyncio.sleep(failpoints.value("node.hold_prefill"))
            # the bytes as received: the worker digests and decodes them
            step = (h.data, msg.position, msg.seq_len, msg.is_prefill, self.wire)
            if not self.last:
                reply = await self._compute(Forward(*step))
                received(reply.received_digest)
                await self._send_activation(
                    StageActivation(
                        msg.request_id,
                        msg.position,
                        msg.seq_len,
                        msg.is_prefill,
                        self._hidden(reply),
                        msg.reply_to,
                        msg.max_tokens,
                    ),
                    reply,
                )
                if msg.is_prefill:
                    self.notes.send(self.reply_to, msg.request_id, *self.prefilled, always=True)
                    self.life.prefilled(msg.request_id)
                return
            sampled = await self._compute(ForwardAndSample(*step))
            received(sampled.received_digest)  # before the next activation can arrive: the records stay in order
            token = sampled.token_id
            self.tokens.append(token)
            self.life.decode(msg.request_id, len(self.tokens), self.max_tokens)
            position = msg.position + msg.seq_len  # where the new token goes
            done = token in self.end_ids or len(self.tokens) >= self.max_tokens or position >= self.max_context
            if not done:  # the next step first: stage 0 computes it while this stage reports the token
                await self._send_to(stage_name(0), NextToken(msg.request_id, token, position, False))
            emit({"event": "token", "request_id": msg.request_id, "n": len(self.tokens)})
            if len(self.tokens) == 1 and self.reply_to is not None:  # the orchestrator sees decode begin
                self.notes.send(self.reply_to, msg.request_id, *self.prefilled, always=True)
                self.node.send_nowait(self.reply_to, FirstToken(msg.request_id, token), HOP_TIMEOUT, STAGE_ACTOR)
            elif not done:  # decode's count, one way: at most one note a second
                self.notes.send(self.reply_to, msg.request_id, "tokens", len(self.tokens), self.max_tokens)
            if done:
                text = (await self._compute(Detokenize(tuple(self.tokens)))).text
                # stage 0 first: it is free (and its figures final) before the orchestrator hears the answer
                await self._send_to(stage_name(0), NextToken(msg.request_id, token, position, True))
                if failpoints.on("node.empty_text"):
                    text = ""
                assert self.reply_to is not None
                await self.node.send(
                    self.reply_to, InferenceResponse(msg.request_id, text, tuple(self.tokens)), timeout=HOP_TIMEOUT
                )
                self.busy = None
                self.stats.finished_at = time.time()

    # --- introspection -----------------------------------------------------------------------

    async def on_relay_probe(self, msg: RelayProbe, ctx: Context) -> ProbeReport:
        h = msg.hidden
        if h.wire_dtype is not self.wire or len(h.shape) != 2 or h.shape[1] != self.dim:
            raise ValueError(
                f"probe of shape {tuple(h.shape)} in {h.wire_dtype.name}; expected (n, {self.dim}) in {self.wire.name}"
            )
        if not msg.to:
            return ProbeReport(self.name, h)
        reply = await self.node.request(await self._addr(msg.to), RelayProbe("", h), HOP_TIMEOUT, sender=STAGE_ACTOR)
        if not isinstance(reply, ProbeReport):
            raise ValueError(f"{msg.to} answered {type(reply).__name__}, expected ProbeReport")
        return reply

    async def on_kv_info_query(self, msg: KvInfoQuery, ctx: Context) -> KvInfo:
        info = await self.bridge.call(ReadKvInfo(), 30)
        if info.stage != self.stage:
            raise ValueError(f"the worker's kv_info is of stage {info.stage}, this node is stage {self.stage}")
        return info

    def on_stage_stats_query(self, msg: StageStatsQuery, ctx: Context) -> StageStats:
        paths = []
        for peer in self.node.transport.peers():
            p = self.node.transport.path(peer)
            if p is not None and p["path"] is not None:
                paths.append(
                    PeerPath(peer, p["path"], p["remote_addr"] or "", p["rtt_ms"], p["dialled_by"], p["selected"])
                )
        return dataclasses.replace(self.stats.snapshot(self.node.frame_counts()), paths=tuple(paths))

    async def on_reference_query(self, msg: ReferenceQuery, ctx: Context) -> ReferenceResult:
        """The model in one piece on this node's device, within ``msg.timeout_ms``. Beside (stage
        0's reference worker), the node's reference actor answers (``refquery.ReferenceActor``:
        the orchestrator asks it there as the node joins). Otherwise the stage's own worker runs
        it: on stage 0, the pipeline's gate, it first waits for the request in flight to end (the
        last stage answers the orchestrator before stage 0 hears the end), and requests are
        refused while it runs, so that the two never share the worker. One reference at a time."""
        if self.reference is not None:
            return await self.reference.on_reference_query(msg, ctx)
        timeout = query_seconds(msg)
        deadline = time.monotonic() + timeout
        if self.first:
            await self.gate.turn(timeout, lambda: self.busy)

        async def own(_: float) -> WorkerBridge:
            return self.bridge

        try:
            return await answer(own, msg, ctx, self.notes, self.life, self.stage, deadline)
        finally:
            if self.first:
                self.gate.done()


async def _slow_decode() -> None:
    """The failpoint ``node.slow_decode``: a decode step that takes this long more (and
    ``node.say``'s marker at each step)."""
    markers.say("decode step")
    if failpoints.on("node.slow_decode"):
        await asyncio.sleep(failpoints.value("node.slow_decode"))


async def _unless_stopped(coro: Any, stop: asyncio.Event) -> asyncio.Task[Any] | None:
    """Run ``coro`` until it finishes (its task is returned) or ``stop`` is set (None; cancelled)."""
    task: asyncio.Task[Any] = asyncio.ensure_future(coro)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([task, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if task.done():
        return task
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return None


async def run(settings: Settings, ring: LogRing) -> None:
    """The node, until it is stopped; ``ring``: the lines of its own log, kept for ``LogTail``."""
    stage, num_stages = settings.stage, settings.num_stages
    watch = LoopWatch(threshold=settings.config.swim.ping_timeout)  # first: its uptime is the node's
    stop, parent = stop_event(settings.env.exit_on_stdin_eof)
    node = Node(settings.config)
    status = StatusActor(stage, ring, watch)
    node.add_actor(STATUS_ACTOR, status)  # answers as soon as the node has joined
    worker_env = settings.env.for_worker()
    argv = [sys.executable, str(settings.worker)]
    if failpoints.on("node.stall_worker"):  # a worker that never prints its ready line
        said = "node.stall_worker: this worker never reports ready"
        argv = [
            sys.executable,
            "-c",
            f"import sys, time; print({said!r}, file=sys.stderr, flush=True); time.sleep(3600)",
        ]
    bridge = WorkerBridge(argv, {**inherited(), **worker_env.to_env()}, stage_name(stage))
    bridge.redact = ring.redactor.text  # the node's keys, out of its worker's words before it keeps them
    beside: ReferenceBeside | None = None
    reference: ReferenceActor | None = None
    guard: asyncio.Task[None] | None = None
    loading: asyncio.Future[Ready] | None = None
    try:
        watch.start()
        # the guard runs from the start: an orchestrator that dies before this node joins leaves
        # it orphaned too, and the time-to-live counts from the process's start
        guard = asyncio.ensure_future(guard_lifetime(node, settings, stop))
        if failpoints.on("node.crash"):  # an error nobody planned for (iroh's, a bug)
            raise RuntimeError("failpoint node.crash: an unexpected error in the node")
        # the workers load while the node joins (its endpoint bound, the seed dialled, SWIM's
        # join): a join over the internet (a relay, a hole punched) costs the load nothing
        bridge.on_progress = status.load_said  # the load's steps, blocks and programs, as they come
        loading = asyncio.ensure_future(bridge.start(settings.ready_timeout))
        if stage == 0 and settings.env.reference == "beside":
            ref_env = {**inherited(), **worker_env.replace(worker_role="reference").to_env()}
            ref_bridge = WorkerBridge(argv, ref_env, f"{stage_name(0)}'s reference")
            ref_bridge.redact = ring.redactor.text
            beside = ReferenceBeside(ref_bridge, settings.ready_timeout)
            reference = ReferenceActor(node, beside, stage)  # asked from the join on, as its worker loads
            node.add_actor(REFERENCE_ACTOR, reference)
        joining = await _unless_stopped(node.start(), stop)
        if joining is None:
            return
        joining.result()
        watch.on_stall.append(lambda stall: node.membership.loop_stalled(stall.seconds))  # local health
        emit({"event": "joined", "id": node.id, "stage": stage})
        life = Lifecycle(stage_name(stage))  # the node's own account of where it is (the actor's too)
        life.joined(node.id)
        markers.say("joined")
        markers.log_secrets(settings.env)
        life.loading()
        starting = await _unless_stopped(asyncio.shield(loading), stop)
        bridge.on_progress = None
        if starting is None:
            return
        try:
            ready = starting.result()
            if ready.wire_dtype is not settings.wire:
                theirs, ours = ready.wire_dtype.name, settings.wire.name
                raise WorkerError(f"the worker's wire dtype is {theirs}, the node's {ours}")
        except (TimeoutError, WorkerDied, WorkerError) as e:
            # stay in the cluster, failed, so that the orchestrator can ask why; the lifetime
            # guard (or the orchestrator's teardown) ends the node
            status.set("failed", str(e))
            emit({"event": "failed", "error": str(e)})
            log.error("the worker did not start: %s", e)
            await stop.wait()
            raise
        actor = StageActor(node, bridge, stage, num_stages, settings.wire, reference)
        node.add_actor(STAGE_ACTOR, actor)
        if not failpoints.on("node.no_names"):
            for name in stage_names(stage, num_stages):
                node.register(name, STAGE_ACTOR)
        status.ready(ready)
        span = ready.range or Span(0, 0)
        life.ready(span.start, span.end, ready.load_s)
        emit({"event": "ready", "id": node.id, **ready_fields(ready), "worker_pid": ready.pid})
        await stop.wait()
    finally:
        await watch.close()  # cannot fail: the rest of the teardown runs
        for task in (guard, parent, loading):
            if task is not None:
                task.cancel()
        if loading is not None and loading.done() and not loading.cancelled():
            loading.exception()  # a worker failed while the node was still joining: stopping now anyway
        # the workers end (each its own process, and a GPU's context to let go) while the node
        # leaves the cluster: each may wait for the others' answers, none needs another first
        # with the orchestrator gone (it leaves first at the teardown), the run is over: the other
        # nodes are being destroyed too, and a goodbye would wait on ones already closed
        leave = not orchestrator_gone(node, settings)
        closing = [bridge.close(), *([beside.close()] if beside is not None else []), node.close(leave)]
        for failed in await asyncio.gather(*closing, return_exceptions=True):
            if isinstance(failed, BaseException):
                log.warning("stopping: %s", failed)


def main() -> None:
    scrub.install(scrub.secrets_in_env())  # before the first line: stdout and stderr are vast.ai's logs
    try:
        settings = Settings.from_env()
    except ValueError as e:
        configure_child_logging("pp-gpu-node")
        give_up(e, container_env())
    ring = LogRing(settings.env.secrets())
    configure_child_logging("pp-gpu-node", settings.env.log_level, ring)
    lifecycle.switch_on(settings.env.log_level)
    try:
        asyncio.run(run(settings, ring))
    except (ValueError, TimeoutError, WorkerDied, WorkerError) as e:
        give_up(e, settings.env)
    except Exception as e:
        log.error("pp-gpu-node failed unexpectedly", exc_info=True)
        give_up(e, settings.env, f"{type(e).__name__}: ")


if __name__ == "__main__":
    main()

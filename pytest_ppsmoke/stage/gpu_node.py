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

The evidence a stage keeps of its request (``StageStats``): each activation sent and received
with the digest of its raw wire bytes, taken by the worker that produced them and by the worker
that decoded them; the frames the node sent and received, by type, from the frame that began
the request on. ``KvInfo`` is the worker's reading of its caches (``StageModel.kv_info``).

Any stage answers ``ReferenceQuery`` (the harness asks ``pp-entry``, after the request): the model
runs in one piece on the node's device, and ``ReferenceResult`` carries the tokens. On stage 0 a
reference worker of its own (``PP_REFERENCE=beside``: the orchestrator's choice on GPUs) has loaded
it while the stages loaded; elsewhere, or with ``PP_REFERENCE=after``, the stage's worker loads it
afresh then.

One request at a time: a second ``InferenceRequest`` while one runs is refused with a "busy"
error and touches no cache. Any failure on a stage (a worker error or death, an unreachable next
stage) is sent to ``reply_to`` as an ``InferenceResponse`` whose ``error`` names the stage, and
for a stage lost mid-request, that stage by name and what detected it (``pp-stage-0: pp-stage-1
dropped out of the cluster mid-request: pp-stage-0's SWIM declared it dead``, ``pp-stage-0:
pp-stage-1 unreachable mid-request: a send to it failed: ...``).
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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

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
    LoadFigures,
    NextToken,
    NodeStatus,
    NodeStatusQuery,
    PeerPath,
    ProbeReport,
    ReferenceQuery,
    ReferenceResult,
    RelayProbe,
    StageActivation,
    StageStats,
    StageStatsQuery,
    WireDtype,
    from_json,
)
from ..nodeenv import NodeEnv, inherited
from ..protocol import STAGE_ACTOR, STATUS_ACTOR, stage_name, stage_names
from ..runtime.codec import ActorAddress, MemberStatus, Message
from ..runtime.localproc import configure_child_logging, emit, stop_event
from ..runtime.node import Context, Node, NodeConfig
from ..runtime.swim import MemberEvent
from ..runtime.transport import PeerAddr
from .bridge import WorkerBridge, WorkerDied, WorkerError

log = logging.getLogger(__name__)

HOP_TIMEOUT = 30.0  # a send to the next stage
NAME_TIMEOUT = 60.0  # the spec's deadline for a name
COMPUTE_TIMEOUT = 600.0  # one worker call (a cold prefill compiles kernels)
IDLE_WAIT = HOP_TIMEOUT  # stage 0: how long a reference waits for the request in flight to end


class Busy(RuntimeError):
    pass


class StageLost(ConnectionError):
    """Another stage could not be reached mid-request; the message names it and how it was found."""


def default_worker_path() -> Path:
    here = Path(__file__).resolve().parent.parent  # the package: pytest_ppsmoke/stage/gpu_node.py
    installed = here / "worker" / "pp_tinygrad_worker.py"  # a wheel install
    return installed if installed.is_file() else here.parent / "worker" / "pp_tinygrad_worker.py"


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


class ReferenceBeside:
    """Stage 0's reference worker (``PP_REFERENCE=beside``, ``PP_WORKER_ROLE=reference``), started
    with the stage's worker: the whole model loads while the stages load, and a
    ``ReferenceQuery`` only generates. Its start is a task; the query waits for it within its
    own deadline, and a worker that did not start is the query's error, not the stage's."""

    def __init__(self, bridge: WorkerBridge, ready_timeout: float) -> None:
        self.bridge = bridge
        self.starting: asyncio.Future[dict[str, Any]] = asyncio.ensure_future(bridge.start(ready_timeout))
        self.starting.add_done_callback(self._started)

    def _started(self, fut: asyncio.Future[dict[str, Any]]) -> None:
        if fut.cancelled():
            return
        if fut.exception() is not None:
            log.error("the reference worker did not start: %s", fut.exception())
            return
        ready = fut.result()
        emit({"event": "reference_ready", "pid": ready["pid"], "load_s": ready["load_s"]})

    async def ready(self, timeout: float) -> WorkerBridge:
        """The worker, once it has loaded; TimeoutError or RuntimeError (it did not start) say why."""
        try:
            await asyncio.wait_for(asyncio.shield(self.starting), timeout)
        except (TimeoutError, WorkerDied, WorkerError, ValueError) as e:
            if not self.starting.done():
                raise TimeoutError(
                    f"the reference worker beside pp-stage-0 is still loading after this query's {timeout:.0f} s"
                ) from None
            raise RuntimeError(
                f"the reference worker beside pp-stage-0 did not start: {e}; with reference=after the stage's "
                "worker loads the model after the request instead"
            ) from None
        return self.bridge

    async def close(self) -> None:
        if not self.starting.done():
            self.starting.cancel()
        await self.bridge.close()


class StageActor:
    def __init__(
        self,
        node: Node,
        bridge: WorkerBridge,
        stage: int,
        num_stages: int,
        wire: WireDtype,
        reference: ReferenceBeside | None = None,
    ) -> None:
        assert bridge.ready is not None
        self.node, self.bridge, self.reference = node, bridge, reference
        self.stage, self.num_stages, self.wire = stage, num_stages, wire
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.dim: int = bridge.ready["dim"]
        self.end_ids = set(bridge.ready["end_ids"])
        self.max_context: int = bridge.ready["max_context"]
        self.name = stage_name(stage)
        self._ids = itertools.count(int(time.time() * 1000) % 1_000_000 * 1000)
        self.busy: int | None = None
        self.reference_running = False  # stage 0 refuses requests meanwhile: the worker is busy with it
        self.reply_to: ActorAddress | None = None
        self.max_tokens = 0
        self.tokens: list[int] = []
        self.stats = Figures(stage)  # the last request's, as they grow
        self._addr_cache: dict[str, ActorAddress] = {}
        self._failed: set[int] = set()
        self._progress_at = time.monotonic()
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

    def _hidden(self, reply: dict[str, Any]) -> Hidden:
        """The hidden state of a worker's reply: its raw bytes, as they go on the wire."""
        return Hidden(int(self.wire), (reply["seq_len"], self.dim), reply["hidden"])

    async def _send_to(self, name: str, msg: StageActivation | NextToken) -> None:
        """A send to another stage; one that fails names that stage (StageLost)."""
        addr = await self._addr(name)
        try:
            await self.node.send(addr, msg, sender=STAGE_ACTOR, timeout=HOP_TIMEOUT)
        except ConnectionError as e:
            raise StageLost(f"{name} unreachable mid-request: a send to it failed: {e}") from None

    async def _send_activation(self, act: StageActivation, reply: dict[str, Any]) -> None:
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
            bytes.fromhex(reply["hidden_digest"]),
        )
        self.stats.hops_out.append(hop)

    def _new_request(
        self, request_id: int, reply_to: ActorAddress | None, max_tokens: int, began_with: Message, ctx: Context
    ) -> None:
        """Begin request ``request_id``; ``began_with``: the message that began it, a frame that
        the node has already counted when it came from another node (it belongs to the request)."""
        self.busy, self.reply_to, self.max_tokens, self.tokens = request_id, reply_to, max_tokens, []
        self._progress_at = time.monotonic()
        self._addr_cache.clear()
        frames, code = self.node.frame_counts(), began_with.type_code
        if ctx.sender.node != self.node.id and code in frames:
            sent, received = frames[code]
            frames[code] = (sent, received - 1)
        self.stats = Figures(self.stage, request_id, frames_at_start=frames)

    async def _compute(self, op: str, **fields: Any) -> dict[str, Any]:
        started = time.time()
        reply = await self.bridge.call(op, COMPUTE_TIMEOUT, **fields)
        worker_s = reply.get("worker_s")
        call = ComputeRecord(
            op,
            fields.get("position"),
            started,
            round(time.time() - started, 6),  # as the node sees it: bridge included
            float(worker_s) if isinstance(worker_s, (int, float)) else None,  # inside the worker
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
                    await self._addr("pp-stage-0"), NextToken(request_id, 0, 0, True), timeout=HOP_TIMEOUT
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
        if self.reference_running:
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
            ids = (await self._compute("tokenize", prompt=prompt))["token_ids"]
            if len(ids) + self.max_tokens - 1 > self.max_context:  # the last token is never fed back
                raise ValueError(
                    f"prompt of {len(ids)} tokens + max_tokens {self.max_tokens} "
                    f"exceed the context of {self.max_context}"
                )
            self.stats.prompt_token_ids = list(ids)
            reply = await self._compute("embed_and_forward", tokens=ids, position=0, prefill=True)
            act = StageActivation(rid, 0, len(ids), True, self._hidden(reply), self.reply_to, self.max_tokens)
            await self._send_activation(act, reply)

    async def on_next_token(self, msg: NextToken, ctx: Context) -> None:
        if msg.request_id != self.busy:
            log.info("NextToken for request %d, which is not in flight (%s)", msg.request_id, self.busy)
            return
        self._progress_at = time.monotonic()
        self.tokens.append(msg.token_id)  # so that a failure report says how far decode got
        if msg.done:
            self.busy = None
            self.stats.finished_at = time.time()
            return
        async with self._ends_on_failure(msg.request_id):
            await _slow_decode()
            reply = await self._compute("decode_step", token_id=msg.token_id, position=msg.position)
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

        def received(reply: dict[str, Any]) -> None:  # the worker's digest of the bytes it decoded
            hop = HopRecord(
                msg.position, msg.seq_len, len(h.data), arrived, 0.0, msg.request_id,
                bytes.fromhex(reply["received_digest"]),
            )  # fmt: skip
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
            fields = {
                "hidden": h.data,  # the bytes as received: the worker digests and decodes them
                "position": msg.position,
                "seq_len": msg.seq_len,
                "prefill": msg.is_prefill,
            }
            if not self.last:
                reply = await self._compute("forward", dtype=self.wire.name, **fields)
                received(reply)
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
                return
            reply = await self._compute("forward_and_sample", dtype=self.wire.name, **fields)
            received(reply)  # before the next activation can arrive: the records stay in order
            token = reply["token_id"]
            self.tokens.append(token)
            position = msg.position + msg.seq_len  # where the new token goes
            done = token in self.end_ids or len(self.tokens) >= self.max_tokens or position >= self.max_context
            if not done:  # the next step first: stage 0 computes it while this stage reports the token
                await self._send_to("pp-stage-0", NextToken(msg.request_id, token, position, False))
            emit({"event": "token", "request_id": msg.request_id, "n": len(self.tokens)})
            if len(self.tokens) == 1 and self.reply_to is not None:  # the orchestrator sees decode begin
                self.node.send_nowait(self.reply_to, FirstToken(msg.request_id, token), HOP_TIMEOUT, STAGE_ACTOR)
            if done:
                text = (await self._compute("detokenize", token_ids=self.tokens))["text"]
                # stage 0 first: it is free (and its figures final) before the orchestrator hears the answer
                await self._send_to("pp-stage-0", NextToken(msg.request_id, token, position, True))
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
        info = from_json(KvInfo, await self.bridge.call("kv_info", 30), "the worker's kv_info")
        if info.stage != self.stage:
            raise ValueError(f"the worker's kv_info is of stage {info.stage}, this node is stage {self.stage}")
        return info

    def on_stage_stats_query(self, msg: StageStatsQuery, ctx: Context) -> StageStats:
        paths = []
        for peer in self.node.transport.peers():
            p = self.node.transport.path(peer)
            if p is not None and p["path"] is not None:
                paths.append(PeerPath(peer, p["path"], p["remote_addr"] or "", p["rtt_ms"], p["dialled_by"]))
        return dataclasses.replace(self.stats.snapshot(self.node.frame_counts()), paths=tuple(paths))

    async def on_reference_query(self, msg: ReferenceQuery, ctx: Context) -> ReferenceResult:
        """The model in one piece on this node's device, by its worker (``reference`` op), within
        ``msg.timeout_ms``. Stage 0 is the pipeline's gate: it first waits for the request in
        flight to end (the last stage answers the orchestrator before stage 0 hears the end) and
        refuses requests while the reference runs, so that the two never share the worker."""
        timeout = msg.timeout_ms / 1000
        if timeout <= 0:
            raise ValueError(f"timeout_ms must be positive, got {msg.timeout_ms}")
        deadline = time.monotonic() + timeout
        if self.first:
            waited_until = time.monotonic() + min(IDLE_WAIT, timeout)
            while self.busy is not None or self.reference_running:
                if time.monotonic() >= waited_until:
                    what = f"request {self.busy}" if self.busy is not None else "another reference"
                    raise Busy(f"busy: {self.name} is still serving {what}; the reference runs when it is idle")
                await asyncio.sleep(0.05)
            self.reference_running = True
        emit({"event": "reference", "stage": self.stage})
        try:
            if failpoints.on("node.slow_reference"):
                await asyncio.sleep(min(failpoints.value("node.slow_reference"), timeout))
            left = max(0.001, deadline - time.monotonic())
            worker = self.bridge if self.reference is None else await self.reference.ready(left)
            left = max(0.001, deadline - time.monotonic())
            reply = await worker.call("reference", left, prompt=msg.prompt, max_tokens=msg.max_tokens)
        finally:
            if self.first:
                self.reference_running = False
        ref = from_json(ReferenceResult, reply, "the worker's reference")
        if ref.stage != self.stage:
            raise ValueError(f"the worker's reference is of stage {ref.stage}, this node is stage {self.stage}")
        return ref


async def _slow_decode() -> None:
    """The failpoint ``node.slow_decode``: a decode step that takes this long more."""
    if failpoints.on("node.slow_decode"):
        await asyncio.sleep(failpoints.value("node.slow_decode"))


class StatusActor:
    """Answers ``NodeStatusQuery`` from the moment the node joins: how the orchestrator learns,
    across machines, that a worker is loading, ready (with its dim, blocks and context), or
    failed and why."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.state, self.detail = "loading", ""
        self.worker = (0, 0, 0, 0)  # dim, first block, end block, max context: once ready
        self.load: LoadFigures | None = None  # how the worker loaded: once ready
        self.since = time.monotonic()

    def set(self, state: str, detail: str = "") -> None:
        self.state, self.detail, self.since = state, detail, time.monotonic()

    def ready(self, worker: dict[str, Any]) -> None:
        """The worker's ready line (its ``dim``, block ``range`` and ``max_context``), and how it
        loaded (``LoadFigures``: fields, read as fields)."""
        lo, hi = worker["range"]
        self.worker = (worker["dim"], lo, hi, worker["max_context"])
        self.load = LoadFigures.from_ready(worker)
        self.set("ready")

    def on_node_status_query(self, msg: NodeStatusQuery, ctx: Context) -> NodeStatus:
        seconds = int(time.monotonic() - self.since)
        return NodeStatus(self.stage, self.state, self.detail, seconds, *self.worker, load=self.load)


@dataclass(frozen=True)
class Settings:
    """What the node runs with: its environment (every value and its default: ``NodeEnv``), the
    node's config made from it, and the worker script found."""

    env: NodeEnv
    config: NodeConfig = field(repr=False)
    worker: Path

    @property
    def stage(self) -> int:
        return self.env.stage

    @property
    def num_stages(self) -> int:
        return self.env.num_stages

    @property
    def wire(self) -> WireDtype:
        return WireDtype.parse(self.env.wire_dtype)

    @property
    def ready_timeout(self) -> float:
        return self.env.worker_ready_timeout

    @property
    def ttl(self) -> float:  # a hard limit on the node's life
        return self.env.ttl

    @property
    def orphan_grace(self) -> float:  # how long the node lives on once it has lost the orchestrator (the seed)
        return self.env.orphan_grace

    @classmethod
    def from_env(cls) -> Settings:
        """Everything the node reads from its environment, checked before anything starts."""
        env = NodeEnv.from_env()
        WireDtype.parse(env.wire_dtype)
        worker = Path(env.worker) if env.worker else default_worker_path()
        if not worker.is_file():
            raise ValueError(f"worker script {worker} not found; set {NodeEnv.var('worker')} to pp_tinygrad_worker.py")
        return cls(env, NodeConfig.from_nodeenv(env), worker)


async def guard_lifetime(
    node: Node, settings: Settings, stop: asyncio.Event, clock: Callable[[], float] = time.monotonic
) -> None:
    """The node's own time-to-live: it removes itself when it has lost the orchestrator for
    ``orphan_grace`` seconds, or when ``ttl`` has passed, so that no rented GPU outlives a run
    whose orchestrator died. On vast.ai it destroys its own instance (``NodeEnv.container_id`` and
    ``container_api_key``, set by vast.ai's host agent); anywhere it then exits.

    Where the orchestrator reaches the node (a seed given by its id alone: vast.ai, where the
    orchestrator may sit behind a NAT), the orphan clock starts at that first contact (the seed
    alive in the node's view): the orchestrator reaches the nodes only once every instance runs,
    so a node on a fast host may wait for a slower one. Until then the node waits the run's
    ``boot_window`` plus its grace, then removes itself: the orchestrator may have died during the
    boot. Where the node dials the seed itself (a ticket, with its address), nothing keeps the
    contact waiting, and the clock starts with the node."""
    seed = settings.config.seed
    peer = PeerAddr.parse(seed) if seed else None
    seed_id = peer.id if peer is not None else None
    reached = peer is not None and not (peer.addrs or peer.relay)  # the orchestrator dials this node
    started = clock()
    # the last time the orchestrator was alive in this node's view (None: it has not reached it yet)
    seen: float | None = None if reached else started
    contact = False
    while True:
        await asyncio.sleep(min(1.0, settings.orphan_grace / 4))
        now = clock()
        membership = getattr(node, "membership", None)  # None until the node has bound its endpoint
        member = membership.members.get(seed_id) if membership is not None and seed_id else None
        if member is not None and member.status in (MemberStatus.alive, MemberStatus.suspect):
            if not contact:
                emit({"event": "orchestrator", "after_s": round(now - started, 3)})
            seen, contact = now, True
        never = settings.env.boot_window + settings.orphan_grace
        if now - started > settings.ttl:
            reason = f"its time-to-live of {settings.ttl:g} s has passed"
        elif seed_id and seen is None and now - started > never:
            reason = (
                f"the orchestrator ({seed_id[:10]}) never reached it within the boot window "
                f"({settings.env.boot_window:g} s) plus its grace ({settings.orphan_grace:g} s)"
            )
        elif seed_id and seen is not None and now - seen > settings.orphan_grace:
            reason = f"it lost the orchestrator ({seed_id[:10]}) {settings.orphan_grace:g} s ago"
        else:
            continue
        log.warning("removing itself: %s", reason)
        emit({"event": "expired", "reason": reason})
        await destroy_own_instance(settings.env)
        stop.set()
        return


async def destroy_own_instance(env: NodeEnv) -> None:
    instance, key = env.container_id, env.container_api_key
    if instance is None or not key:
        return  # not on vast.ai (or its emulator): exiting is all there is to do
    from ..cloud.vast import DEFAULT_URL, VastClient, VastError  # aiohttp's client: only a node that outlived its run

    try:
        async with VastClient(key, env.vast_url or DEFAULT_URL, timeout=10, attempts=4) as vast:
            gone = await vast.destroy_instance(instance)
        log.warning("destroyed own instance %s%s", instance, "" if gone else " (it was already gone)")
    except (VastError, ValueError) as e:
        log.error("could not destroy own instance %s: %s; exiting anyway", instance, e)


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


async def run(settings: Settings) -> None:
    stage, num_stages = settings.stage, settings.num_stages
    stop, parent = stop_event(settings.env.exit_on_stdin_eof)
    node = Node(settings.config)
    status = StatusActor(stage)
    node.add_actor(STATUS_ACTOR, status)  # answers as soon as the node has joined
    worker_env = settings.env.for_worker()
    argv = [sys.executable, str(settings.worker)]
    if failpoints.on("node.stall_worker"):  # a worker that never prints its ready line
        argv = [sys.executable, "-c", "import time; time.sleep(3600)"]
    bridge = WorkerBridge(argv, {**inherited(), **worker_env.to_env()}, stage_name(stage))
    beside: ReferenceBeside | None = None
    guard: asyncio.Task[None] | None = None
    try:
        # the guard runs from the start: an orchestrator that dies before this node joins leaves
        # it orphaned too, and the time-to-live counts from the process's start
        guard = asyncio.ensure_future(guard_lifetime(node, settings, stop))
        if failpoints.on("node.crash"):  # an error nobody planned for (iroh's, a bug)
            raise RuntimeError("failpoint node.crash: an unexpected error in the node")
        joining = await _unless_stopped(node.start(), stop)
        if joining is None:
            return
        joining.result()
        emit({"event": "joined", "id": node.id, "stage": stage})
        if stage == 0 and settings.env.reference == "beside":
            ref_env = {**inherited(), **worker_env.replace(worker_role="reference").to_env()}
            beside = ReferenceBeside(WorkerBridge(argv, ref_env, "pp-stage-0's reference"), settings.ready_timeout)
        starting = await _unless_stopped(bridge.start(settings.ready_timeout), stop)
        if starting is None:
            return
        try:
            ready = starting.result()
        except (TimeoutError, WorkerDied, WorkerError) as e:
            # stay in the cluster, failed, so that the orchestrator can ask why; the lifetime
            # guard (or the orchestrator's teardown) ends the node
            status.set("failed", str(e))
            emit({"event": "failed", "error": str(e)})
            log.error("the worker did not start: %s", e)
            await stop.wait()
            raise
        actor = StageActor(node, bridge, stage, num_stages, settings.wire, beside)
        node.add_actor(STAGE_ACTOR, actor)
        if not failpoints.on("node.no_names"):
            for name in stage_names(stage, num_stages):
                node.register(name, STAGE_ACTOR)
        status.ready(ready)
        emit(
            {
                "event": "ready",
                "id": node.id,
                **{k: v for k, v in ready.items() if k != "status"},
                "worker_pid": ready["pid"],
            }
        )
        await stop.wait()
    finally:
        for task in (guard, parent):
            if task is not None:
                task.cancel()
        await bridge.close()
        if beside is not None:
            await beside.close()
        await node.close()


def main() -> None:
    try:
        settings = Settings.from_env()
    except ValueError as e:
        configure_child_logging("pp-gpu-node")
        _give_up(e, _container())
    configure_child_logging("pp-gpu-node", settings.env.log_level)
    try:
        asyncio.run(run(settings))
    except (ValueError, TimeoutError, WorkerDied, WorkerError) as e:
        _give_up(e, settings.env)
    except Exception as e:
        log.error("pp-gpu-node failed unexpectedly", exc_info=True)
        _give_up(e, settings.env, f"{type(e).__name__}: ")


def _give_up(error: BaseException, env: NodeEnv, kind: str = "") -> NoReturn:
    # a node that cannot serve does not keep a rented GPU: it destroys its own instance, whatever
    # ended it (the traceback, if any, is logged first; the exit line names the error)
    asyncio.run(destroy_own_instance(env))
    sys.exit(f"pp-gpu-node: {kind}{error}")


def _container() -> NodeEnv:
    """Just what the node needs to destroy its own instance, when the rest of its environment is bad."""
    try:
        return NodeEnv.from_env(only=("container_id", "container_api_key", "vast_url"))
    except ValueError:
        return NodeEnv()


if __name__ == "__main__":
    main()

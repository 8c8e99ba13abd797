"""A node's answer to ``ReferenceQuery`` (the token-exact reference), one for both ways it runs:

- stage 0's reference worker of its own (``PP_REFERENCE=beside``): :class:`ReferenceActor`
  (``protocol.REFERENCE_ACTOR``) answers from the node's start, before its stage's worker is
  ready: the orchestrator asks as soon as the node has joined, and the query waits for the
  reference worker's load within its own deadline; it runs beside a request;
- the stage's own worker, after the request (``StageActor``, which refuses a request meanwhile).

One reference at a time on a node, either way (:class:`ReferenceGate`). Its progress goes to the
actor that asked (``Progress``, request id 0): ``loading``, then its tokens as the worker says them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from .. import failpoints
from ..messages import ReferenceQuery, ReferenceResult
from ..protocol import stage_name
from ..runtime.localproc import emit
from ..runtime.node import Context, Node
from .beside import ReferenceBeside
from .bridge import WorkerBridge
from .lifecycle import Lifecycle
from .notes import Notes
from .pipe import RunReference

IDLE_WAIT = 30.0  # how long a reference waits for what the node serves (a request, another reference)


class Busy(RuntimeError):
    """A request or a reference refused while the node serves another (the asker sees ``Busy``)."""


def query_seconds(msg: ReferenceQuery) -> float:
    """The query's own deadline, in seconds; ValueError unless positive."""
    if msg.timeout_ms <= 0:
        raise ValueError(f"timeout_ms must be positive, got {msg.timeout_ms}")
    return msg.timeout_ms / 1000


class ReferenceGate:
    """One reference at a time on a node: :meth:`turn` waits, within its share of the query's
    deadline, for the other one (and for what ``serving`` names: a request in flight), then holds
    the node's reference until :meth:`done`."""

    def __init__(self, name: str) -> None:
        self.name, self.running = name, False

    async def turn(self, timeout: float, serving: Callable[[], int | None] = lambda: None) -> None:
        waited_until = time.monotonic() + min(IDLE_WAIT, timeout)
        while (busy := serving()) is not None or self.running:
            if time.monotonic() >= waited_until:
                what = f"request {busy}" if busy is not None else "another reference"
                raise Busy(f"busy: {self.name} is still serving {what}; the reference runs when it is idle")
            await asyncio.sleep(0.05)
        self.running = True

    def done(self) -> None:
        self.running = False


async def answer(
    worker: Callable[[float], Awaitable[WorkerBridge]],
    msg: ReferenceQuery,
    ctx: Context,
    notes: Notes,
    life: Lifecycle,
    stage: int,
    deadline: float,
) -> ReferenceResult:
    """The reference by the worker ``worker(seconds)`` gives (once it is there), before
    ``deadline``, its progress noted to ``ctx.sender``."""
    emit({"event": "reference", "stage": stage})
    life.reference(msg.max_tokens)
    notes.reset()  # its counts go to the asking actor (the orchestrator's), if it named one
    notes.send(ctx.sender, 0, "loading", 0, msg.max_tokens, always=True)
    bridge: WorkerBridge | None = None
    try:
        if failpoints.on("node.slow_reference"):
            await asyncio.sleep(min(failpoints.value("node.slow_reference"), deadline - time.monotonic()))
        bridge = await worker(max(0.001, deadline - time.monotonic()))

        def counted(what: str, done: int, total: int) -> None:  # the worker's progress lines
            # the first and the last of a count always go: a burst of blocks ends on its total
            notes.send(ctx.sender, 0, what, done, total, always=done == 0 or done == total)

        bridge.on_progress = counted
        ref = await bridge.call(RunReference(msg.prompt, msg.max_tokens), max(0.001, deadline - time.monotonic()))
    finally:
        if bridge is not None:
            bridge.on_progress = None
    if ref.stage != stage:
        raise ValueError(f"the worker's reference is of stage {ref.stage}, this node is stage {stage}")
    return ref


class ReferenceActor:
    """Stage 0's reference beside its stage (``PP_REFERENCE=beside``): answers ``ReferenceQuery``
    from the node's start on, by its own reference worker, once that has loaded."""

    def __init__(self, node: Node, beside: ReferenceBeside, stage: int = 0) -> None:
        self.beside, self.stage = beside, stage
        self.gate = ReferenceGate(stage_name(stage))
        self.notes = Notes(node, stage)
        self.life = Lifecycle(stage_name(stage))

    async def on_reference_query(self, msg: ReferenceQuery, ctx: Context) -> ReferenceResult:
        timeout = query_seconds(msg)
        deadline = time.monotonic() + timeout
        await self.gate.turn(timeout)
        try:
            return await answer(self.beside.ready, msg, ctx, self.notes, self.life, self.stage, deadline)
        finally:
            self.gate.done()

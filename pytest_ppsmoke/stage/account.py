"""What a node says of itself, from the moment it joins, on its status actor
(``protocol.STATUS_ACTOR``): ``NodeStatus`` (its worker loading, ready or failed, and how it
loaded) and ``LogTail``, its own account of a failure: its last log lines (redacted by its
``LogRing`` before they were stored), its uptime and the stalls of its event loop (its
``LoopWatch``). A peer that saw the node go quiet learns from it whether its loop was starved."""

from __future__ import annotations

import asyncio
import contextlib
import time

from ..messages import LoadFigures, LogTail, LogTailQuery, NodeStatus, NodeStatusQuery, Span, Stall
from ..runtime.logring import LogRing
from ..runtime.node import Context
from ..runtime.stalls import LoopWatch
from .pipe import Ready


class StatusActor:
    """Answers ``NodeStatusQuery`` from the moment the node joins: how the orchestrator learns,
    across machines, that a worker is loading, ready (with its dim, blocks and context), or
    failed and why; and ``LogTailQuery``, with the node's own log and loop stalls."""

    def __init__(self, stage: int, ring: LogRing, watch: LoopWatch) -> None:
        self.stage = stage
        self.ring, self.watch = ring, watch
        self.state, self.detail = "loading", ""
        self.worker = (0, 0, 0, 0)  # dim, first block, end block, max context: once ready
        self.load: LoadFigures | None = None  # how the worker loaded: once ready
        self.since = time.monotonic()
        self.loading = {"step": 0, "blocks": 0, "total_blocks": 0, "programs": 0}
        self._changed = asyncio.Event()  # set (and replaced) at each change: what a waiting query wakes on

    def _change(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def load_said(self, what: str, done: int, total: int) -> None:
        """A progress line of the worker's load (``protocol.LOAD_STEPS``): kept until the next."""
        if what == "blocks":
            self.loading["blocks"], self.loading["total_blocks"] = done, total
        elif what in ("step", "programs"):
            self.loading[what] = done
        self._change()

    def set(self, state: str, detail: str = "") -> None:
        self.state, self.detail, self.since = state, detail, time.monotonic()
        self._change()

    def ready(self, worker: Ready) -> None:
        """The worker's ready line (its ``dim``, block ``range`` and ``max_context``), and how it
        loaded (``LoadFigures``)."""
        blocks = worker.range or Span(0, 0)
        self.worker = (worker.dim, blocks.start, blocks.end, worker.max_context)
        self.load = worker.load_figures()
        self.set("ready")

    async def on_node_status_query(self, msg: NodeStatusQuery, ctx: Context) -> NodeStatus:
        """Where the node is now; while it loads, at the first change within ``msg.wait_ms``."""
        if msg.wait_ms and self.state == "loading":
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), msg.wait_ms / 1000)
        seconds = int(time.monotonic() - self.since)
        said = self.loading
        return NodeStatus(
            self.stage,
            self.state,
            self.detail,
            seconds,
            *self.worker,
            load=self.load,
            step=said["step"],
            blocks_loaded=said["blocks"],
            blocks=said["total_blocks"],
            programs=said["programs"],
        )

    def on_log_tail_query(self, msg: LogTailQuery, ctx: Context) -> LogTail:
        """The newest of the node's log lines within the query's ``lines`` and ``max_bytes``, how
        many older ones were left out, the node's uptime and its loop's kept stalls."""
        lines, dropped = self.ring.tail(msg.lines, msg.max_bytes)
        stalls = tuple(Stall(s.at, s.seconds) for s in self.watch.stalls())
        return LogTail(self.stage, tuple(lines), dropped, round(self.watch.uptime(), 3), stalls)

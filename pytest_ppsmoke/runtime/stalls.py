"""The loop watch: a process measuring its own event loop's lateness, so that a node can say
"my loop stalled for 4.2 s" when its peers only saw it go quiet.

A task sleeps a short tick and compares when it woke with when it asked to wake. Its lateness is
how long nothing on the loop ran that was due: the host's CPU given to others, the process
paused (SIGSTOP, a VM's steal, a swap storm), a call that blocked the loop. A lateness over the
threshold is a stall: logged at WARNING in one line and kept (the longest ones, a bounded
number). A loop that keeps stalling logs its first stalls, then one line a minute that says how
many it held back (``logbudget.LogBudget``), so that its stalls cannot push the node's other lines
out of its log ring; the count, the longest and the kept ones cover them all. The clock and the
sleep are injected, so that a test drives the watch with a fake clock that jumps, never with real
time.

A stall's measured length is at least the loop's real blockage less one tick (the sleep may
have been asked up to a tick before the loop blocked); never more than it, beyond the
scheduling of the wake-up itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .logbudget import LogBudget
from .swimconfig import SwimConfig

log = logging.getLogger(__name__)

# The tick only sets how finely a stall's start is placed and how much a stall's length is
# under-measured (at most one tick); 20 wake-ups a second cost nothing beside a node's traffic.
TICK = 0.05
# A stall longer than a ping timeout is one that a peer's probe of this member can meet: its Ack
# cannot leave while the loop is blocked, and the prober then asks helpers and may suspect us.
# Shorter ones are the ordinary jitter of a loaded machine. The default is the loopback timing's
# timeout; a node passes its own (``SwimConfig.ping_timeout``).
THRESHOLD = SwimConfig.loopback().ping_timeout
KEEP = 32  # stalls kept: the longest, when there were more
LOG_BURST, LOG_EVERY = 10, 60.0  # stall lines: the first ten, then one a minute


@dataclass(frozen=True)
class LoopStall:
    """One stall: the loop was due to run ``at`` seconds after the watch started and ran
    ``seconds`` late."""

    at: float
    seconds: float


class LoopWatch:
    """Measures this process's event loop (see the module's docstring). ``on_stall`` listeners
    are called with each stall as it is found (Lifeguard's local health takes them: a member that
    saw its own loop stall trusts its own probes less). ``stalls()`` are the kept ones, oldest
    first; ``count`` and ``longest`` cover all of them, kept or not. ``level``: the stall's log
    line's (a node's WARNING, in its own log; the orchestrator's INFO, in its report)."""

    def __init__(
        self,
        tick: float = TICK,
        threshold: float = THRESHOLD,
        keep: int = KEEP,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        level: int = logging.WARNING,
    ) -> None:
        for name, value in (("tick", tick), ("threshold", threshold)):
            if not 0 < value < float("inf"):
                raise ValueError(f"the loop watch's {name} must be a positive number of seconds, got {value!r}")
        if keep < 1:
            raise ValueError(f"the loop watch keeps at least one stall; keep={keep!r}")
        self.tick, self.threshold, self.keep = tick, threshold, keep
        self._clock, self._sleep, self.level = clock, sleep, level
        self.started = clock()
        self._log_budget = LogBudget(LOG_BURST, LOG_EVERY, clock)
        self._held_longest = 0.0  # the longest of the stalls not logged since the last line
        self.count = 0
        self.longest = 0.0
        self.on_stall: list[Callable[[LoopStall], None]] = []
        self._kept: list[LoopStall] = []
        self._due: float | None = None  # when the watch's sleep should end, while it sleeps
        self._task: asyncio.Task[None] | None = None

    def uptime(self) -> float:
        """Seconds since the watch was made (a node makes it first thing: the node's uptime)."""
        return self._clock() - self.started

    def stalls(self) -> list[LoopStall]:
        """The kept stalls, oldest first, and the one under way if the watch's wake-up is overdue
        past the threshold now: a caller that runs before the watch after a stall (a query that
        was waiting with it) still sees it, as long as it has lasted so far."""
        found = list(self._kept)
        if self._due is not None and (late := round(self._clock() - self._due, 3)) > self.threshold:
            found.append(LoopStall(round(self._due - self.started, 3), late))
        return sorted(found, key=lambda s: s.at)

    def summary(self) -> dict[str, object]:
        """The stalls for a report: how many, the longest, and the kept ones."""
        found = self.stalls()
        kept = [{"at": s.at, "seconds": s.seconds} for s in found]
        under_way = [s.seconds for s in found if s not in self._kept]  # the one not yet counted
        return {"count": self.count + len(under_way), "longest": max([self.longest, *under_way]), "stalls": kept}

    def start(self) -> None:
        """Watch from now on, in a task of the running loop."""
        if self._task is None:
            self._task = asyncio.ensure_future(self.run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def run(self) -> None:
        """Sleep a tick, measure the lateness of the wake-up, again, until cancelled."""
        while True:
            due = self._due = self._clock() + self.tick
            try:
                await self._sleep(self.tick)
            finally:
                self._due = None
            late = round(self._clock() - due, 3)  # to the millisecond: what a clock's sums can tell
            if late > self.threshold:
                self.found(LoopStall(round(due - self.started, 3), late))

    def found(self, stall: LoopStall) -> None:
        """Log ``stall`` (within the log budget), keep it (dropping the shortest kept one past
        ``keep``), tell the listeners."""
        held_longest = self._held_longest
        self._held_longest = max(self._held_longest, stall.seconds)
        if (held := self._log_budget.take()) is not None:
            self._held_longest = 0.0
            log.log(
                self.level,
                "the event loop stalled for %.3g s, %.1f s after the start (starved: the host's CPU, a paused "
                "process or a blocking call)%s",
                stall.seconds,
                stall.at,
                f"; {held} more stalls not logged before it, the longest {held_longest:.3g} s" if held else "",
            )
        self.count += 1
        self.longest = max(self.longest, stall.seconds)
        self._kept.append(stall)
        if len(self._kept) > self.keep:
            self._kept.remove(min(self._kept, key=lambda s: (s.seconds, s.at)))  # the shortest, the older first
        for listener in list(self.on_stall):
            try:
                listener(stall)
            except Exception:
                log.exception("a listener of the loop watch failed on a stall of %.3g s", stall.seconds)

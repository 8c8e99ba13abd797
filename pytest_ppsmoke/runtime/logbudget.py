"""A budget of log lines: a burst of them, then one per interval, so that a repeated line (a loop
that keeps stalling, a worker that spews on stderr) cannot push a node's earlier lines out of its
log ring (``logring.LogRing`` keeps the last 200) or flood its container's log.

The lines held back are not lost from the count: the next line let through says how many were
held back since the last one (``LogBudget.take`` returns that number). The clock is injected, so
that a test drives the budget with a fake one.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class LogBudget:
    """A token bucket of lines: ``burst`` lines at once, refilled at one line per ``every``
    seconds. ``take()`` is None for a line to hold back, else the number of lines held back since
    the last one let through (0 when none was)."""

    def __init__(self, burst: int, every: float, clock: Callable[[], float] = time.monotonic) -> None:
        if burst < 1:
            raise ValueError(f"a log budget lets at least one line through; burst={burst!r}")
        if not 0 < every < float("inf"):
            raise ValueError(f"a log budget's refill interval must be a positive number of seconds, got {every!r}")
        self.burst, self.every, self._clock = burst, every, clock
        self._tokens = float(burst)
        self._at = clock()
        self.held = 0  # held back since the last line let through
        self.held_total = 0

    def take(self) -> int | None:
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) / self.every)
        self._at = now
        if self._tokens < 1.0:
            self.held += 1
            self.held_total += 1
            return None
        self._tokens -= 1.0
        held, self.held = self.held, 0
        return held

"""Calls spaced by name, on an injected clock: a provider whose calls are rate limited (vast.ai
refuses a create sooner than 4.5 s after the last, then every create for a penalty) sends each
kind of call at least its spacing after the last, one at a time. The spacing is known beforehand
(the provider's documented limits: ``Provider.pace``) or learned (a 429 that names its
threshold); the waits read and spend the ``clock`` and ``sleep`` they are given, so a test runs
them on a virtual clock.

A paced call (:meth:`Pacer.call`) holds its name's turn until its answer is back, and the next
one of that name counts its spacing from that answer: a call reaches the provider before its
answer leaves it, so spacing from the answer keeps within the limit whatever the network's
delays (spacing from the send would not: a first call delayed on its way and a second one not
arrive closer than they were sent)."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping


class Pacer:
    """``spacing``: name -> the least seconds between two calls of that name; ``windows``: name
    -> (calls, seconds): at most so many calls in any such span (a limit by count, vast.ai's
    search's 10 a minute). Names in neither are not spaced, but their last call is still noted,
    so a spacing learned later counts from it."""

    def __init__(
        self,
        spacing: Mapping[str, float] | None = None,
        *,
        windows: Mapping[str, tuple[int, float]] | None = None,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]],
    ) -> None:
        self.spacing: dict[str, float] = dict(spacing or {})
        self.windows: dict[str, tuple[int, float]] = dict(windows or {})
        self.clock, self.sleep = clock, sleep
        self._locks: dict[str, asyncio.Lock] = {}
        self._last: dict[str, float] = {}
        self._ends: dict[str, deque[float]] = {}  # the answers of a windowed name's last calls

    @classmethod
    def of(
        cls,
        pace: Mapping[str, tuple[int, float]],
        *,
        margin: float = 1.0,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]],
    ) -> Pacer:
        """A pacer for a provider's documented pace (name -> (calls, seconds)), each span
        ``margin`` times longer."""
        spacing = {k: s * margin for k, (n, s) in pace.items() if n <= 1}
        windows = {k: (n, s * margin) for k, (n, s) in pace.items() if n > 1}
        return cls(spacing, windows=windows, clock=clock, sleep=sleep)

    def _wait(self, name: str) -> float:
        now = self.clock()
        wait = self._last.get(name, -math.inf) + self.spacing.get(name, 0.0) - now
        if name in self.windows:
            calls, span = self.windows[name]
            ends = self._ends.get(name, ())
            if len(ends) >= calls:
                wait = max(wait, list(ends)[-calls] + span - now)
        return wait

    def _paced(self, name: str) -> bool:
        return name in self.spacing or name in self.windows

    async def turn(self, name: str) -> float:
        """Wait for a call of ``name`` to be sent (one at a time, spaced from the last call's
        send: the lock is held for the wait, not the call); the seconds waited."""
        if not self._paced(name):
            self._last[name] = self.clock()
            return 0.0
        async with self._locks.setdefault(name, asyncio.Lock()):
            wait = self._wait(name)
            if wait > 0:
                await self.sleep(wait)
            self._last[name] = self.clock()
            self._note(name)
        return max(wait, 0.0)

    def _note(self, name: str) -> None:
        if name in self.windows:
            self._ends.setdefault(name, deque(maxlen=max(1, self.windows[name][0]))).append(self.clock())

    @contextlib.asynccontextmanager
    async def call(self, name: str) -> AsyncIterator[float]:
        """``async with pacer.call(name) as waited:`` one call of ``name``: its turn waited (the
        seconds given), the call made inside, its answer's time noted as the last of its name on
        the way out (an error too: it was sent). Calls of one name go one at a time."""
        if not self._paced(name):
            try:
                yield 0.0
            finally:
                self._last[name] = self.clock()
            return
        async with self._locks.setdefault(name, asyncio.Lock()):
            wait = self._wait(name)
            if wait > 0:
                await self.sleep(wait)
            try:
                yield max(wait, 0.0)
            finally:
                self._last[name] = self.clock()
                self._note(name)

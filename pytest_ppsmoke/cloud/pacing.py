"""Calls spaced by name, on an injected clock: a provider whose calls are rate limited (vast.ai
refuses a create sooner than 4.5 s after the last, then every create for a penalty) sends each
kind of call at least its spacing after the last, one at a time. The spacing is known beforehand
or learned (a 429 that names its threshold); the waits read and spend the ``clock`` and ``sleep``
they are given, so a test runs them on a virtual clock."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping


class Pacer:
    """``spacing``: name -> the least seconds between two calls of that name (names not in it are
    not spaced, but their last call is still noted, so a spacing learned later counts from it)."""

    def __init__(
        self,
        spacing: Mapping[str, float] | None = None,
        *,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]],
    ) -> None:
        self.spacing: dict[str, float] = dict(spacing or {})
        self.clock, self.sleep = clock, sleep
        self._locks: dict[str, asyncio.Lock] = {}
        self._last: dict[str, float] = {}

    async def turn(self, name: str) -> float:
        """Wait for a call of ``name`` to be sent (one at a time, spaced: the lock is held for the
        wait, not the call); the seconds waited."""
        if name not in self.spacing:
            self._last[name] = self.clock()
            return 0.0
        async with self._locks.setdefault(name, asyncio.Lock()):
            wait = self._last.get(name, -math.inf) + self.spacing[name] - self.clock()
            if wait > 0:
                await self.sleep(wait)
            self._last[name] = self.clock()
        return max(wait, 0.0)

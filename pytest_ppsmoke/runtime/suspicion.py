"""Lifeguard's (Dadgar, Phillips, Currey 2018) two local pieces, as hashicorp/memberlist implements
them: the suspicion timer of one member (memberlist's ``suspicion``: it starts at its maximum and
shrinks toward its minimum with independent confirmations) and the local health multiplier
(memberlist's ``awareness``: a score that stretches our own probes while we are the slow one),
and ``Suspicions``, the timers of every member we suspect. None knows the protocol;
``swim.Membership`` drives them and decides what an expired suspicion means."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable


class Suspicion:
    """The suspicion timer of one member: it starts at ``hi`` and is driven toward ``lo`` by
    independent confirmations, ``hi - (hi - lo) * log(c + 1) / log(k + 1)`` after ``c`` of the
    ``k`` expected (memberlist's ``remainingSuspicionTime``). ``accusers`` holds who already
    counted (the first accuser does not: our own suspicion may come back to us)."""

    def __init__(self, incarnation: int, accuser: str | None, k: int, lo: float, hi: float) -> None:
        self.incarnation = incarnation
        self.k, self.lo, self.hi = k, lo, hi
        self.accusers = {accuser} if accuser else set()
        self.confirmed = 0
        self.started = asyncio.get_running_loop().time()
        self.handle: asyncio.TimerHandle | None = None
        self.deferred = False

    def timeout(self) -> float:
        if self.k < 1:
            return self.lo
        frac = math.log(self.confirmed + 1) / math.log(self.k + 1)
        return max(self.lo, self.hi - frac * (self.hi - self.lo))

    def deadline(self) -> float:
        return self.started + self.timeout()

    def confirm(self, accuser: str) -> bool:
        """Count ``accuser`` once; False if it already counted or the minimum is reached."""
        if self.confirmed >= self.k or accuser in self.accusers:
            return False
        self.accusers.add(accuser)
        self.confirmed += 1
        return True

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


class Suspicions:
    """The suspicion of each member we suspect, its timer armed on the running loop: at its
    deadline ``expired(member_id, suspicion)`` is called (``current`` then tells whether that
    suspicion still stands)."""

    def __init__(self, expired: Callable[[str, Suspicion], None]) -> None:
        self._expired = expired
        self._held: dict[str, Suspicion] = {}

    def get(self, member_id: str) -> Suspicion | None:
        return self._held.get(member_id)

    def current(self, member_id: str, s: Suspicion) -> bool:
        return self._held.get(member_id) is s

    def start(self, member_id: str, s: Suspicion) -> None:
        """Hold ``s`` for ``member_id`` (replacing any earlier one) and arm its timer."""
        self.cancel(member_id)
        self._held[member_id] = s
        self._arm(member_id, s)

    def confirm(self, member_id: str, accuser: str) -> bool:
        """An independent accuser agrees: shorten the suspicion (True if it counted)."""
        s = self._held.get(member_id)
        if s is None or not s.confirm(accuser):
            return False
        self._arm(member_id, s)
        return True

    def defer(self, member_id: str, s: Suspicion, delay: float) -> None:
        """Call ``expired`` again ``delay`` seconds from now, once."""
        s.deferred = True
        s.handle = asyncio.get_running_loop().call_later(delay, self._expired, member_id, s)

    def cancel(self, member_id: str) -> None:
        s = self._held.pop(member_id, None)
        if s is not None:
            s.cancel()

    def clear(self) -> None:
        for s in self._held.values():
            s.cancel()
        self._held.clear()

    def _arm(self, member_id: str, s: Suspicion) -> None:
        s.cancel()
        s.handle = asyncio.get_running_loop().call_at(s.deadline(), self._expired, member_id, s)


class Awareness:
    """The local health score, 0 (healthy) .. ``limit - 1`` (memberlist's ``awareness``, whose
    ``max`` is our ``awareness_max``); timeouts and periods are stretched by ``score + 1``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.score = 0

    def apply(self, delta: int) -> bool:
        """Move the score by ``delta`` within its bounds; True if it changed."""
        score = min(max(self.score + delta, 0), self.limit - 1)
        if score == self.score:
            return False
        self.score = score
        return True

    def scale(self, seconds: float) -> float:
        """``seconds`` stretched by the local health multiplier."""
        return seconds * (self.score + 1)

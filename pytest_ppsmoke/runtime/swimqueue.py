"""SWIM's broadcast queue (memberlist's ``TransmitLimitedQueue``): the updates waiting to ride on
the protocol's messages, each sent a limited number of times. Apart from the protocol loop in
``swim.py``, which puts every change here and takes a few for every message it sends."""

from __future__ import annotations

import math

from .codec import MemberState


def transmissions(retransmit_mult: int, members: int) -> int:
    """How often an update is piggybacked in a cluster of ``members``: ``retransmit_mult *
    ceil(log10(members + 1))``, at least ``retransmit_mult`` (memberlist's ``retransmitLimit``)."""
    return retransmit_mult * max(1, math.ceil(math.log10(members + 1)))


class Broadcasts:
    """The updates waiting to be piggybacked, each with the transmissions it has left
    (memberlist's transmit-limited queue). ``take(k)`` returns the ``k`` with the most left, the
    oldest first among equals, and spends one of each: kept in a bucket per count (a few dozen
    at most), so taking is O(k), not a sort of the queue for every message."""

    def __init__(self) -> None:
        self._left: dict[str, int] = {}
        self._buckets: dict[int, dict[str, MemberState]] = {}

    def __len__(self) -> int:
        return len(self._left)

    def put(self, m: MemberState, transmissions: int) -> None:
        """Queue ``m``, replacing any update about the same member."""
        old = self._left.pop(m.id, None)
        if old is not None:
            del self._buckets[old][m.id]
        if transmissions > 0:
            self._left[m.id] = transmissions
            self._buckets.setdefault(transmissions, {})[m.id] = m

    def take(self, k: int) -> tuple[MemberState, ...]:
        picked: list[tuple[int, MemberState]] = []
        for left in sorted(self._buckets, reverse=True):
            for m in self._buckets[left].values():
                picked.append((left, m))
                if len(picked) == k:
                    break
            if len(picked) == k:
                break
        for left, m in picked:
            self.put(m, left - 1)
        for left in [n for n, b in self._buckets.items() if not b]:
            del self._buckets[left]
        return tuple(m for _, m in picked)

    def clear(self) -> None:
        self._left.clear()
        self._buckets.clear()

"""Cluster-wide names (``pp-entry``, ``pp-exit``, ``pp-stage-i``) on top of SWIM membership.

A member's names are part of its alive state, so they spread with membership gossip and vanish
the moment the member is declared dead. When two live members claim the same name, every node
picks the same winner, the claimant with the smallest endpoint id, and logs the conflict once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from .codec import ActorAddress, MemberStatus
from .swim import Membership

log = logging.getLogger(__name__)


class NameNotFound(LookupError):
    """``resolve`` reached its deadline; the message names the name and who was asked."""


@dataclass(frozen=True)
class NameConflict:
    name: str
    winner: ActorAddress
    losers: tuple[ActorAddress, ...]


class Registry:
    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        self._reported: set[tuple[str, tuple[str, ...]]] = set()

    def register(self, name: str, actor: str) -> None:
        """Claim ``name`` for the local ``actor``; replaces an earlier claim of the same name here."""
        if not name or not actor:
            raise ValueError(f"name and actor must be non-empty, got name={name!r} actor={actor!r}")
        names = dict(self.membership.me.names)
        names[name] = actor
        self.membership.set_names(names)

    def unregister(self, name: str) -> None:
        names = dict(self.membership.me.names)
        if names.pop(name, None) is not None:
            self.membership.set_names(names)

    def claims(self, name: str) -> list[ActorAddress]:
        """Every live claim of ``name``, winner first."""
        found = [
            ActorAddress(m.id, m.names[name])
            for m in self.membership.members.values()
            if m.status != MemberStatus.dead and name in m.names
        ]
        return sorted(found, key=lambda a: a.node)

    def lookup(self, name: str) -> ActorAddress | None:
        found = self.claims(name)
        if len(found) > 1:
            self._report(NameConflict(name, found[0], tuple(found[1:])))
        return found[0] if found else None

    def names(self) -> dict[str, ActorAddress]:
        every = {n for m in self.membership.alive() for n in m.names}
        return {n: a for n in sorted(every) if (a := self.lookup(n)) is not None}

    def conflicts(self) -> list[NameConflict]:
        every = {n for m in self.membership.alive() for n in m.names}
        out = []
        for n in sorted(every):
            found = self.claims(n)
            if len(found) > 1:
                out.append(NameConflict(n, found[0], tuple(found[1:])))
        return out

    async def resolve(self, name: str, timeout: float) -> ActorAddress:
        """Wait until ``name`` is known, at most ``timeout`` seconds."""
        started = time.monotonic()
        try:
            await self.membership.wait_until(lambda: self.lookup(name) is not None, timeout, f"name {name!r}")
        except TimeoutError:
            asked = ", ".join(f"{i[:10]}({s})" for i, s in self.membership.view())
            known = ", ".join(sorted(self.names())) or "none"
            raise NameNotFound(
                f"name {name!r} did not resolve within {timeout:.3g} s; members asked: {asked}; names known: {known}"
            ) from None
        addr = self.lookup(name)
        assert addr is not None
        log.debug("resolved %s to %s in %.3f s", name, addr, time.monotonic() - started)
        return addr

    def _report(self, c: NameConflict) -> None:
        key = (c.name, tuple(a.node for a in (c.winner, *c.losers)))
        if key not in self._reported:
            self._reported.add(key)
            log.warning(
                "name %r is claimed by %d members; %s wins (smallest endpoint id), ignoring %s",
                c.name,
                1 + len(c.losers),
                c.winner,
                ", ".join(str(a) for a in c.losers),
            )

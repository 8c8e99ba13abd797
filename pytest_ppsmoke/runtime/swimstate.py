"""SWIM's member state, apart from the protocol as memberlist keeps it: the table of members with
their incarnations and states (``MemberTable``, with the round-robin probe order over it), who
hears of a change (``Events``: event streams, listeners and ``wait_until``), and the rules that
apply an update to them (``SwimState``: refutation, suspicion, death). Nothing here sends a
message; ``swim.Membership``, the protocol, probes, gossips and answers, and hands what it hears
to ``SwimState.merge``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Protocol

from .codec import MemberState, MemberStatus
from .suspicion import Awareness, Suspicion, Suspicions
from .swimconfig import SwimConfig, SwimStats
from .swimqueue import Broadcasts, transmissions

log = logging.getLogger(__name__)

ALIVE, SUSPECT, DEAD = MemberStatus.alive, MemberStatus.suspect, MemberStatus.dead


@dataclass(frozen=True)
class MemberEvent:
    """``kind`` is one of joined, suspect, alive (refuted), dead, updated (metadata changed)."""

    kind: str
    member: MemberState
    at: float


class EventStream:
    """An async iterator of membership events; subscribed from creation until ``aclose``."""

    def __init__(self, subscribers: list[asyncio.Queue[MemberEvent]]) -> None:
        self._subscribers = subscribers
        self._queue: asyncio.Queue[MemberEvent] = asyncio.Queue()
        subscribers.append(self._queue)

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> MemberEvent:
        return await self._queue.get()

    async def aclose(self) -> None:
        if self._queue in self._subscribers:
            self._subscribers.remove(self._queue)


class Events:
    """Who hears of membership changes: the event streams, the listeners (called at once, in
    order) and the waiters of ``wait_until`` (woken by every change, the local health's
    included, through ``changed``)."""

    def __init__(self) -> None:
        self.subscribers: list[asyncio.Queue[MemberEvent]] = []
        self.listeners: list[Callable[[MemberEvent], None]] = []
        self.changed = asyncio.Event()

    def notify(self, kind: str, m: MemberState) -> MemberEvent:
        ev = MemberEvent(kind, m, time.monotonic())
        for q in self.subscribers:
            q.put_nowait(ev)
        for fn in self.listeners:
            fn(ev)
        self.changed.set()
        return ev

    def stream(self) -> EventStream:
        return EventStream(self.subscribers)

    def add_listener(self, fn: Callable[[MemberEvent], None]) -> None:
        self.listeners.append(fn)

    def remove_listener(self, fn: Callable[[MemberEvent], None]) -> None:
        if fn in self.listeners:
            self.listeners.remove(fn)

    async def wait_until(self, predicate: Callable[[], bool], timeout: float, what: Callable[[], str]) -> None:
        """Wait until ``predicate()`` holds after some change, or raise TimeoutError with
        ``what()``, called only then."""
        deadline = time.monotonic() + timeout
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"waited {timeout:.3g} s for {what()}")
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), left)


class MemberTable:
    """Every member we know, ours included, with its latest state (``members``, in the order we
    learnt them), and SWIM's round-robin probe order over those not dead."""

    def __init__(self, me: MemberState) -> None:
        self.me = me
        self.members: dict[str, MemberState] = {me.id: me}
        self.probe_order: list[str] = []
        self._others_cache: list[str] | None = None  # ids not dead but ours, in ``members``' order
        self._others_set: set[str] = set()

    def get(self, member_id: str) -> MemberState | None:
        return self.members.get(member_id)

    def alive(self) -> list[MemberState]:
        """Members not declared dead (suspects included: they may still refute)."""
        return [m for m in self.members.values() if m.status != DEAD]

    def view(self) -> tuple[tuple[str, str], ...]:
        """(id, status) of every member not dead, sorted: equal on members that agree."""
        return tuple(sorted((m.id, MemberStatus(m.status).name) for m in self.alive()))

    def describe(self) -> str:
        return ", ".join(f"{i[:10]}={s}" for i, s in self.view()) or "nobody"

    def set_me(self, me: MemberState) -> None:
        self.me = me
        self.put(me)

    def put(self, m: MemberState) -> None:
        cur = self.members.get(m.id)
        self.members[m.id] = m
        if m.id == self.me.id or (cur is not None and (cur.status == DEAD) == (m.status == DEAD)):
            return  # the members not dead stay the same
        if m.status == DEAD:
            self._others_cache = None
            return
        # a member new to us (or back) joins the current round at a random place, as in
        # memberlist: else it waits for the next round, N probe periods away
        if self.probe_order:
            self.probe_order.insert(random.randrange(len(self.probe_order) + 1), m.id)
        if cur is None and self._others_cache is not None:
            self._others_cache.append(m.id)  # a join: at a mass join, one for every member
            self._others_set.add(m.id)
        else:
            self._others_cache = None

    def others(self) -> list[str]:
        """The members not dead, but us, in ``members``' order; kept until one joins, dies or
        comes back (every probe and gossip tick asks: at a thousand members, rebuilding it each
        time was most of a member's work). Callers must not change it."""
        if self._others_cache is None:
            self._others_cache = [m.id for m in self.members.values() if m.status != DEAD and m.id != self.me.id]
            self._others_set = set(self._others_cache)
        return self._others_cache

    def next_target(self) -> str | None:
        """SWIM's round robin: every member once a round, in a new random order each round;
        those that died since the round began are skipped."""
        others = self.others()
        while self.probe_order:
            target = self.probe_order.pop()
            if target in self._others_set:
                return target
        self.probe_order = list(others)
        random.shuffle(self.probe_order)
        return self.probe_order.pop() if self.probe_order else None


class Peers(Protocol):
    def is_allowed(self, peer_id: str) -> bool: ...
    def forget(self, peer_id: str) -> None: ...


class Directory(Protocol):
    """What the member state tells the node it runs on: who is where, and who is gone."""

    @property
    def transport(self) -> Peers: ...
    def learn(self, m: MemberState) -> None: ...


class SwimState:
    """The member state and its rules, as memberlist's ``aliveNode``, ``suspectNode`` and
    ``deadNode`` apply them: an update wins by incarnation, alive over suspect over dead within
    one; a suspicion of us is refuted with a new incarnation; a suspicion of another starts its
    timer (``suspicion.Suspicions``), and an unrefuted one declares it dead. Every change is
    queued for piggybacking (``swimqueue.Broadcasts``) and told to ``events``. The protocol
    (``swim.Membership``) feeds it what it hears and asks it what to send."""

    def __init__(self, node: Directory, config: SwimConfig, me: MemberState) -> None:
        self.node = node
        self.config = config
        self.table = MemberTable(me)
        self.events = Events()
        self.suspicions = Suspicions(self._suspicion_expired)
        self.awareness = Awareness(config.awareness_max)
        self.stats = SwimStats()
        self.queue = Broadcasts()
        self.leaving = False  # a clean exit under way: no refutation, no acks (they could resurrect us)
        self.stopped = False

    @property
    def probe_timeout(self) -> float:
        """The direct ping's timeout, stretched by the local health multiplier."""
        return self.awareness.scale(self.config.ping_timeout)

    def merge(self, updates: Iterable[MemberState], source: str | None = None) -> None:
        """Apply updates. ``source`` is the member that sent them as its own news (a probe's or
        gossip's piggyback), whose suspicions count as its accusations; None for full states
        (join, push-pull), which relay what others said."""
        for u in updates:
            self._apply(u, source)

    def _apply(self, u: MemberState, source: str | None = None) -> None:
        me = self.table.me
        if u.id == me.id:
            if self.leaving or u.incarnation < me.incarnation:
                return
            stale_alive = u.status == ALIVE and (
                u.incarnation > me.incarnation or (u.addrs, u.names) != (me.addrs, me.names)
            )
            if u.status != ALIVE or stale_alive:
                # suspected, declared dead, or an older life of ours (a restart with the same key)
                # still circulating: outbid it so that our current state wins everywhere
                log.info("refuting %s about myself at incarnation %d", MemberStatus(u.status).name, u.incarnation)
                self.set_me(replace(me, incarnation=u.incarnation + 1))
                if u.status != ALIVE:  # others could not hear from us in time: maybe we are the slow one
                    self.count(refuted_about_me=1)
                    self.adjust_awareness(1)
            return
        if not self.node.transport.is_allowed(u.id):
            return
        cur = self.table.members.get(u.id)
        if cur is None:
            self.table.put(u)
            if u.status != DEAD:
                self.node.learn(u)
                if u.status == ALIVE:
                    self.enqueue(u)
                self.notify("joined", u)
                if u.status == SUSPECT:
                    self._start_suspicion(u, source)
            return
        if u.status == ALIVE:
            if u.incarnation <= cur.incarnation:
                return
            self.table.put(u)
            if self.suspicions.get(u.id) is not None:
                self.count(suspicions_refuted=1)
            self.suspicions.cancel(u.id)
            self.node.learn(u)
            self.enqueue(u)
            if cur.status == SUSPECT:
                self.notify("alive", u)
            elif cur.status == DEAD:
                self.notify("joined", u)
            elif (cur.names, cur.addrs) != (u.names, u.addrs):
                self.notify("updated", u)
            else:
                self.events.changed.set()
        elif u.status == SUSPECT:
            if cur.status == DEAD or u.incarnation < cur.incarnation:
                return
            if u.incarnation == cur.incarnation and cur.status == SUSPECT:
                if source is not None and source != u.id:
                    self.confirm(u.id, source)
                return
            # not passed on: members gossip only their own accusations, so that the sender of a
            # suspicion is an independent accuser (the suspect hears it from them)
            new = replace(cur, status=SUSPECT, incarnation=u.incarnation)
            self.table.put(new)
            self._start_suspicion(new, source)
            self.notify("suspect", new)
        else:
            if cur.status == DEAD or u.incarnation < cur.incarnation:
                return
            self._declare_dead(replace(cur, status=DEAD, incarnation=u.incarnation, names={}))

    def set_me(self, me: MemberState) -> None:
        self.table.set_me(me)
        self.enqueue(me)
        self.events.changed.set()

    def expel(self, member_id: str) -> bool:
        """Declare a member dead now, without a suspicion: the orchestrator revoked its id. Its
        names vanish, and the death is gossiped like any other. True if it was not dead already."""
        cur = self.table.members.get(member_id)
        if cur is None or cur.status == DEAD or member_id == self.table.me.id:
            return False
        log.info("member %s expelled: its id was revoked", member_id[:10])
        self._declare_dead(replace(cur, status=DEAD, names={}))
        return True

    def _declare_dead(self, dead: MemberState) -> None:
        self.table.put(dead)
        self.suspicions.cancel(dead.id)
        self.enqueue(dead)
        self.notify("dead", dead)
        self.node.transport.forget(dead.id)

    def suspect(self, target: MemberState) -> None:
        """Our own probe of ``target`` failed: suspect it, as its accuser."""
        new = replace(target, status=SUSPECT)
        self.table.put(new)
        self.count(suspicions_raised=1)
        self.enqueue(new)
        self._start_suspicion(new, self.table.me.id)
        self.notify("suspect", new)

    def _start_suspicion(self, m: MemberState, accuser: str | None) -> None:
        self.suspicions.cancel(m.id)
        if self.stopped:
            return
        n = len(self.table.others()) + 1
        lo, hi = self.config.suspicion_bounds(n)
        # confirmations to expect: as many as the helpers of one probe, from members other than
        # ourselves and the suspect (memberlist's k; with none to expect the minimum applies)
        k = min(self.config.indirect_checks, max(0, n - 2))
        self.suspicions.start(m.id, Suspicion(m.incarnation, accuser, k, lo, hi))

    def confirm(self, member_id: str, accuser: str) -> bool:
        """An independent accuser agrees: shorten the suspicion (True if it counted)."""
        if not self.suspicions.confirm(member_id, accuser):
            return False
        self.count(confirmations=1)
        return True

    def _suspicion_expired(self, member_id: str, s: Suspicion) -> None:
        if not self.suspicions.current(member_id, s):
            return
        if asyncio.get_running_loop().time() - s.deadline() > self.config.ping_timeout and not s.deferred:
            # our loop stalled past the deadline: a refutation that arrived meanwhile is still
            # queued behind this timer. Give it one probe timeout; the stall counts against us.
            self.adjust_awareness(1)
            self.suspicions.defer(member_id, s, self.probe_timeout)
            return
        self.suspicions.cancel(member_id)
        cur = self.table.members.get(member_id)
        if cur is not None and cur.status == SUSPECT and cur.incarnation == s.incarnation:
            log.info(
                "member %s did not refute suspicion in %.3g s (%d of %d confirmations): dead",
                member_id[:10],
                s.timeout(),
                s.confirmed,
                s.k,
            )
            self.count(deaths_declared=1)
            self._declare_dead(replace(cur, status=DEAD, names={}))

    def adjust_awareness(self, delta: int) -> None:
        before = self.awareness.score
        if self.awareness.apply(delta):
            log.debug("local health score %d -> %d", before, self.awareness.score)
            self.events.changed.set()  # wait_until may be waiting on it

    def count(self, **deltas: int) -> None:
        self.stats = replace(self.stats, **{k: getattr(self.stats, k) + v for k, v in deltas.items()})

    def notify(self, kind: str, m: MemberState) -> None:
        log.info("member %s %s (incarnation %d)", m.id[:10], kind, m.incarnation)
        self.events.notify(kind, m)

    def enqueue(self, m: MemberState) -> None:
        if m.status != ALIVE:  # suspect and dead need no addresses or names
            m = MemberState(m.id, m.status, m.incarnation)
        self.queue.put(m, transmissions(self.config.retransmit_mult, len(self.table.others()) + 1))

    def piggyback(self) -> tuple[MemberState, ...]:
        return self.queue.take(self.config.max_piggyback)

"""SWIM membership (Das, Gupta, Motivala 2002) with suspicion and incarnation refutation.

Each protocol period a member probes one other member, chosen round-robin over a shuffled list:
a direct ``Ping``, and if no ``Ack`` arrives within ``ping_timeout``, a ``PingReq`` through
``indirect_checks`` other members. A member that answers neither is *suspected*; a suspect that
does not refute within its suspicion timeout (dynamic, below) is declared *dead* and its names
vanish. A member
that hears it is suspected (or declared dead) while alive refutes by raising its incarnation.

Updates ride on every probe message (piggybacking, each retransmitted ``retransmit_mult *
ceil(log10(n + 1))`` times) and, as in memberlist, on a short gossip tick so that a join is known
everywhere within a few ticks. A periodic push-pull ``Sync`` repairs anything gossip missed.

From Lifeguard (Dadgar, Phillips, Currey 2018), as memberlist implements it, so that a member that
is itself slow (a starved event loop) does not blame healthy members:

- the ``Nack`` of an intermediary that cannot reach the target;
- the *local health multiplier* ("awareness"): a score that rises when our own probes fail
  without the helpers' Nacks that a healthy prober would have heard, and when we must refute a
  suspicion about ourselves, and falls with every successful probe. The probe period and the
  probe timeout are multiplied by ``score + 1``;
- *dynamic suspicion*: a suspicion starts at its maximum timeout and shrinks toward its minimum
  as other members independently confirm it (each member passes on only the suspicions its own
  probes raised or confirmed, so the sender of a suspicion is its accuser);
- the buddy system: a probe of a suspect carries the suspicion, so the suspect refutes at once.

The timer and the score are in ``suspicion.py``, the settings (``SwimConfig``) and counts in
``swimconfig.py``.

Member metadata (addresses and registered names) travels in the member's ``alive`` state; changing
it raises the incarnation, as memberlist does for node metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Protocol

from .codec import Ack, ActorAddress, Gossip, Join, MemberState, MemberStatus, Message, Nack, Ping, PingReq, Sync
from .errors import RemoteError
from .suspicion import Awareness, Suspicion
from .swimconfig import SwimConfig, SwimStats

log = logging.getLogger(__name__)

ALIVE, SUSPECT, DEAD = MemberStatus.alive, MemberStatus.suspect, MemberStatus.dead
SWIM_ACTOR = "swim"
STALL_FLOOR = 0.02  # seconds a timeout may fire late on a loaded machine before it means our loop stalled


class _Peers(Protocol):
    def is_allowed(self, peer_id: str) -> bool: ...
    def forget(self, peer_id: str) -> None: ...


class Host(Protocol):
    """What membership needs of the node it runs on (``runtime.node.Node`` is one)."""

    @property
    def id(self) -> str: ...
    @property
    def transport(self) -> _Peers: ...
    def address(self, actor: str, node: str | None = None) -> ActorAddress: ...
    def learn(self, m: MemberState) -> None: ...
    def send_nowait(self, to: ActorAddress, msg: Message, timeout: float, sender: str = "") -> None: ...
    async def request(
        self, to: ActorAddress, msg: Message, timeout: float | None = None, *, sender: str = ""
    ) -> Message: ...


class Context(Protocol):
    """Who sent the message being handled (``runtime.node.Context`` is one)."""

    @property
    def sender(self) -> ActorAddress: ...


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


class Membership:
    """The SWIM actor of a node (actor name ``swim``)."""

    def __init__(self, node: Host, config: SwimConfig, addrs: Iterable[str], relay: str | None) -> None:
        self.node = node
        self.config = config
        self.me = MemberState(node.id, ALIVE, 0, tuple(addrs), relay, {})
        self.members: dict[str, MemberState] = {node.id: self.me}
        self._suspicions: dict[str, Suspicion] = {}
        self._awareness = Awareness(config.awareness_max)
        self._stats = SwimStats()
        self._queue = Broadcasts()
        self._probe_order: list[str] = []
        self._seq = 0
        self._subscribers: list[asyncio.Queue[MemberEvent]] = []
        self._listeners: list[Callable[[MemberEvent], None]] = []
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._leaving = False
        self._stopped = False
        self._excused: set[str] = set()  # members whose last failed probe we blamed on our own stall
        self._others_cache: list[str] | None = None  # ids not dead but ours, in ``members``' order
        self._others_set: set[str] = set()

    # --- public view -------------------------------------------------------------------------

    def alive(self) -> list[MemberState]:
        """Members not declared dead (suspects included: they may still refute)."""
        return [m for m in self.members.values() if m.status != DEAD]

    def view(self) -> tuple[tuple[str, str], ...]:
        """(id, status) of every member not dead, sorted: equal on members that agree."""
        return tuple(sorted((m.id, MemberStatus(m.status).name) for m in self.alive()))

    def get(self, member_id: str) -> MemberState | None:
        return self.members.get(member_id)

    def events(self) -> EventStream:
        """Every membership event from this call on (``async for ev in m.events()``)."""
        return EventStream(self._subscribers)

    def add_listener(self, fn: Callable[[MemberEvent], None]) -> None:
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[MemberEvent], None]) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    async def wait_until(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Wait until ``predicate()`` holds after some membership change, or raise TimeoutError."""
        deadline = time.monotonic() + timeout
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"waited {timeout:.3g} s for {what}; last view: {self._describe()}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    @property
    def awareness(self) -> int:
        """The local health score: 0 when healthy, up to ``awareness_max - 1``."""
        return self._awareness.score

    @property
    def probe_interval(self) -> float:
        """The protocol period, stretched by the local health multiplier."""
        return self._awareness.scale(self.config.protocol_period)

    @property
    def probe_timeout(self) -> float:
        """How long a direct ping waits for its Ack, stretched by the local health multiplier
        (memberlist stretches only the period: over UDP a late ack is usually a lost one; over
        QUIC it is a late one, which waiting longer does catch)."""
        return self._awareness.scale(self.config.ping_timeout)

    def stats(self) -> SwimStats:
        """A snapshot of the failure detector's counts and the current awareness."""
        return replace(self._stats, awareness=self._awareness.score)

    def suspicion_timeout_of(self, member_id: str) -> float | None:
        """The current length of our suspicion of ``member_id`` (from its start; it shrinks as
        confirmations arrive), or None if we do not suspect it."""
        s = self._suspicions.get(member_id)
        return None if s is None else s.timeout()

    def _describe(self) -> str:
        return ", ".join(f"{i[:10]}={s}" for i, s in self.view()) or "nobody"

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [
            asyncio.ensure_future(self._probe_loop()),
            asyncio.ensure_future(self._gossip_loop()),
            asyncio.ensure_future(self._sync_loop()),
        ]

    async def leave(self, timeout: float = 0.5) -> None:
        """Tell every member we are going (a clean exit), so our names vanish at once."""
        self._leaving = True  # from now on: no refutation, no acks (they could resurrect us)
        bye = Gossip((MemberState(self.me.id, DEAD, self.me.incarnation),))
        # a request, not a one-way send: a written frame may still be lost when the endpoint closes
        sends = [self.node.request(self.node.address(SWIM_ACTOR, t), bye, timeout) for t in self._others()]
        for r in await asyncio.gather(*sends, return_exceptions=True):
            if isinstance(r, BaseException):
                log.info("leave message not delivered: %s", r)

    async def stop(self) -> None:
        self._stopped = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for s in self._suspicions.values():
            s.cancel()
        self._suspicions.clear()

    async def join(self, seed_id: str, timeout: float) -> None:
        """Join through the seed, retrying until ``timeout``; merge its full state."""
        deadline = time.monotonic() + timeout
        delay, last = 0.05, "no attempt"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"could not join through seed {seed_id[:10]} within {timeout:.3g} s: {last}")
            try:
                reply = await self.node.request(
                    self.node.address(SWIM_ACTOR, seed_id), Join(self.me), timeout=min(left, 2.0), sender=SWIM_ACTOR
                )
                if isinstance(reply, Sync):
                    self.merge(reply.members)
                    # announce ourselves to the members we now know, as memberlist's join does:
                    # those that joined just before us may not hear it from the seed's gossip,
                    # sent before they were known, and would wait for a push-pull
                    self._enqueue(self.me)
                    return
                last = f"unexpected reply {type(reply).__name__}"
            except (TimeoutError, ConnectionError, RemoteError) as e:
                last = str(e)
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 1.0)

    def set_addrs(self, addrs: Iterable[str], relay: str | None) -> None:
        """Announce where this member is now (its endpoint's addresses changed): a new incarnation."""
        addrs = tuple(addrs)
        if (addrs, relay) == (self.me.addrs, self.me.relay) or self._leaving:
            return
        self._set_me(replace(self.me, incarnation=self.me.incarnation + 1, addrs=addrs, relay=relay))
        self._notify("updated", self.me)

    def set_names(self, names: dict[str, str]) -> None:
        """Publish this member's names (a new incarnation, disseminated like any alive update)."""
        self._set_me(replace(self.me, incarnation=self.me.incarnation + 1, names=dict(names)))
        self._notify("updated", self.me)

    # --- handlers (dispatched by the node) ---------------------------------------------------

    def on_ping(self, msg: Ping, ctx: Context) -> Ack | None:
        if self._leaving:
            return None  # not an Ack: the prober treats us as gone
        self.merge(msg.updates, ctx.sender.node)
        updates = self._piggyback()
        if any(u.id == self.me.id and u.status != ALIVE for u in msg.updates) and self.me not in updates:
            # the prober still suspects us (the buddy system told us) though our refutation may
            # have left our queue: answer with our alive state, which outbids its suspicion
            updates = (*updates, self.me)
        return Ack(msg.seq, updates)

    async def on_ping_req(self, msg: PingReq, ctx: Context) -> Ack | Nack:
        self.merge(msg.updates, ctx.sender.node)
        try:
            # our own ping timeout, not stretched by our awareness: the prober expects our Nack
            # within it, and a late Nack counts against the prober's health
            ack = await self.node.request(
                self.node.address(SWIM_ACTOR, msg.target),
                Ping(msg.seq, self._piggyback()),
                self.config.ping_timeout,
                sender=SWIM_ACTOR,
            )
            if isinstance(ack, Ack):
                self.merge(ack.updates, msg.target)
                return Ack(msg.seq, self._piggyback())
        except (TimeoutError, ConnectionError, RemoteError):
            pass
        return Nack(msg.seq, self._piggyback())

    def on_join(self, msg: Join, ctx: Context) -> Sync:
        if msg.member.id != ctx.sender.node:
            raise PermissionError(f"{ctx.sender.node[:10]} tried to join as {msg.member.id[:10]}")
        self.merge([msg.member])
        return Sync(tuple(self.members.values()))

    def on_sync(self, msg: Sync, ctx: Context) -> Sync:
        self.merge(msg.members)
        return Sync(tuple(self.members.values()))

    def on_gossip(self, msg: Gossip, ctx: Context) -> None:
        self.merge(msg.updates, ctx.sender.node)

    def on_late_reply(self, msg: Message, ctx: Context) -> None:
        """A reply that came after our request gave up (the node hands it here). A slow member
        hears its acks late; they still carry news, the refutations of the members it suspects
        among them."""
        if isinstance(msg, (Ack, Nack)):
            self.merge(msg.updates, ctx.sender.node)
        elif isinstance(msg, Sync):
            self.merge(msg.members)

    # --- state machine -----------------------------------------------------------------------

    def merge(self, updates: Iterable[MemberState], source: str | None = None) -> None:
        """Apply updates. ``source`` is the member that sent them as its own news (a probe's or
        gossip's piggyback), whose suspicions count as its accusations; None for full states
        (join, push-pull), which relay what others said."""
        for u in updates:
            self._apply(u, source)

    def _apply(self, u: MemberState, source: str | None = None) -> None:
        if u.id == self.me.id:
            if self._leaving or u.incarnation < self.me.incarnation:
                return
            stale_alive = u.status == ALIVE and (
                u.incarnation > self.me.incarnation or (u.addrs, u.names) != (self.me.addrs, self.me.names)
            )
            if u.status != ALIVE or stale_alive:
                # suspected, declared dead, or an older life of ours (a restart with the same key)
                # still circulating: outbid it so that our current state wins everywhere
                log.info("refuting %s about myself at incarnation %d", MemberStatus(u.status).name, u.incarnation)
                self._set_me(replace(self.me, incarnation=u.incarnation + 1))
                if u.status != ALIVE:  # others could not hear from us in time: maybe we are the slow one
                    self._count(refuted_about_me=1)
                    self._adjust_awareness(1)
            return
        if not self.node.transport.is_allowed(u.id):
            return
        cur = self.members.get(u.id)
        if cur is None:
            self._put(u)
            if u.status != DEAD:
                self.node.learn(u)
                if u.status == ALIVE:
                    self._enqueue(u)
                self._notify("joined", u)
                if u.status == SUSPECT:
                    self._start_suspicion(u, source)
            return
        if u.status == ALIVE:
            if u.incarnation <= cur.incarnation:
                return
            self._put(u)
            if self._suspicions.get(u.id) is not None:
                self._count(suspicions_refuted=1)
            self._cancel_suspicion(u.id)
            self.node.learn(u)
            self._enqueue(u)
            if cur.status == SUSPECT:
                self._notify("alive", u)
            elif cur.status == DEAD:
                self._notify("joined", u)
            elif (cur.names, cur.addrs) != (u.names, u.addrs):
                self._notify("updated", u)
            else:
                self._changed.set()
        elif u.status == SUSPECT:
            if cur.status == DEAD or u.incarnation < cur.incarnation:
                return
            if u.incarnation == cur.incarnation and cur.status == SUSPECT:
                if source is not None and source != u.id:
                    self._confirm(u.id, source)
                return
            # not passed on: members gossip only their own accusations, so that the sender of a
            # suspicion is an independent accuser (the suspect hears it from them)
            new = replace(cur, status=SUSPECT, incarnation=u.incarnation)
            self._put(new)
            self._start_suspicion(new, source)
            self._notify("suspect", new)
        else:
            if cur.status == DEAD or u.incarnation < cur.incarnation:
                return
            self._declare_dead(replace(cur, status=DEAD, incarnation=u.incarnation, names={}))

    def _put(self, m: MemberState) -> None:
        cur = self.members.get(m.id)
        self.members[m.id] = m
        if m.id == self.me.id or (cur is not None and (cur.status == DEAD) == (m.status == DEAD)):
            return  # the members not dead stay the same
        if m.status == DEAD:
            self._others_cache = None
            return
        # a member new to us (or back) joins the current round at a random place, as in
        # memberlist: else it waits for the next round, N probe periods away (a member killed
        # right after a mass join of 300 went unprobed for 18 s)
        if self._probe_order:
            self._probe_order.insert(random.randrange(len(self._probe_order) + 1), m.id)
        if cur is None and self._others_cache is not None:
            self._others_cache.append(m.id)  # a join: at a mass join, one for every member
            self._others_set.add(m.id)
        else:
            self._others_cache = None

    def _set_me(self, me: MemberState) -> None:
        self.me = me
        self._put(me)
        self._enqueue(me)
        self._changed.set()

    def _declare_dead(self, dead: MemberState) -> None:
        self._put(dead)
        self._cancel_suspicion(dead.id)
        self._enqueue(dead)
        self._notify("dead", dead)
        self.node.transport.forget(dead.id)

    def _suspect(self, target: MemberState) -> None:
        """Our own probe of ``target`` failed: suspect it, as its accuser."""
        new = replace(target, status=SUSPECT)
        self._put(new)
        self._count(suspicions_raised=1)
        self._enqueue(new)
        self._start_suspicion(new, self.me.id)
        self._notify("suspect", new)

    def _start_suspicion(self, m: MemberState, accuser: str | None) -> None:
        self._cancel_suspicion(m.id)
        if self._stopped:
            return
        n = len(self._others()) + 1
        lo, hi = self.config.suspicion_bounds(n)
        # confirmations to expect: as many as the helpers of one probe, from members other than
        # ourselves and the suspect (memberlist's k; with none to expect the minimum applies)
        k = min(self.config.indirect_checks, max(0, n - 2))
        s = self._suspicions[m.id] = Suspicion(m.incarnation, accuser, k, lo, hi)
        self._arm(m.id, s)

    def _arm(self, member_id: str, s: Suspicion) -> None:
        s.cancel()
        loop = asyncio.get_running_loop()
        s.handle = loop.call_at(s.deadline(), self._suspicion_expired, member_id, s)

    def _confirm(self, member_id: str, accuser: str) -> bool:
        """An independent accuser agrees: shorten the suspicion (True if it counted)."""
        s = self._suspicions.get(member_id)
        if s is None or not s.confirm(accuser):
            return False
        self._count(confirmations=1)
        self._arm(member_id, s)
        return True

    def _cancel_suspicion(self, member_id: str) -> None:
        s = self._suspicions.pop(member_id, None)
        if s is not None:
            s.cancel()

    def _suspicion_expired(self, member_id: str, s: Suspicion) -> None:
        if self._suspicions.get(member_id) is not s:
            return
        loop = asyncio.get_running_loop()
        if loop.time() - s.deadline() > self.config.ping_timeout and not s.deferred:
            # our loop stalled past the deadline: a refutation that arrived meanwhile is still
            # queued behind this timer. Give it one probe timeout; the stall counts against us.
            s.deferred = True
            self._adjust_awareness(1)
            s.handle = loop.call_later(self.probe_timeout, self._suspicion_expired, member_id, s)
            return
        del self._suspicions[member_id]
        cur = self.members.get(member_id)
        if cur is not None and cur.status == SUSPECT and cur.incarnation == s.incarnation:
            log.info(
                "member %s did not refute suspicion in %.3g s (%d of %d confirmations): dead",
                member_id[:10],
                s.timeout(),
                s.confirmed,
                s.k,
            )
            self._count(deaths_declared=1)
            self._declare_dead(replace(cur, status=DEAD, names={}))

    def _adjust_awareness(self, delta: int) -> None:
        before = self._awareness.score
        if self._awareness.apply(delta):
            log.debug("local health score %d -> %d", before, self._awareness.score)
            self._changed.set()  # wait_until may be waiting on it

    def _count(self, **deltas: int) -> None:
        self._stats = replace(self._stats, **{k: getattr(self._stats, k) + v for k, v in deltas.items()})

    def _notify(self, kind: str, m: MemberState) -> None:
        ev = MemberEvent(kind, m, time.monotonic())
        log.info("member %s %s (incarnation %d)", m.id[:10], kind, m.incarnation)
        for q in self._subscribers:
            q.put_nowait(ev)
        for fn in self._listeners:
            fn(ev)
        self._changed.set()

    # --- dissemination -----------------------------------------------------------------------

    def _enqueue(self, m: MemberState) -> None:
        if m.status != ALIVE:  # suspect and dead need no addresses or names
            m = MemberState(m.id, m.status, m.incarnation)
        n = len(self._others()) + 1
        self._queue.put(m, self.config.retransmit_mult * max(1, math.ceil(math.log10(n + 1))))

    def _piggyback(self) -> tuple[MemberState, ...]:
        return self._queue.take(self.config.max_piggyback)

    # --- loops -------------------------------------------------------------------------------

    def _others(self) -> list[str]:
        """The members not dead, but us, in ``members``' order; kept until one joins, dies or
        comes back (every probe and gossip tick asks: at a thousand members, rebuilding it each
        time was most of a member's work). Callers must not change it."""
        if self._others_cache is None:
            self._others_cache = [m.id for m in self.members.values() if m.status != DEAD and m.id != self.me.id]
            self._others_set = set(self._others_cache)
        return self._others_cache

    def _next_target(self) -> str | None:
        """SWIM's round robin: every member once a round, in a new random order each round;
        those that died since the round began are skipped."""
        others = self._others()
        while self._probe_order:
            target = self._probe_order.pop()
            if target in self._others_set:
                return target
        self._probe_order = list(others)
        random.shuffle(self._probe_order)
        return self._probe_order.pop() if self._probe_order else None

    async def _probe_loop(self) -> None:
        while True:
            period = self.probe_interval
            started = time.monotonic()
            target = self._next_target()
            if target is not None:
                try:
                    await self._probe(target, started + period)
                except Exception:  # a bug here must not stop failure detection
                    log.exception("probe of %s failed unexpectedly", target[:10])
            await asyncio.sleep(max(0.0, started + period - time.monotonic()))

    async def _probe(self, target: str, period_end: float) -> None:
        """One probe: a direct ping, then ``indirect_checks`` helpers until the period ends (at
        least two ping timeouts, so their Nacks can come). Adjusts our awareness: -1 on an Ack;
        on failure +1 per helper that did not Nack (healthy helpers that could not reach the
        target either exonerate us), or +1 with no helper to ask."""
        self._seq += 1
        seq = self._seq
        cfg = self.config
        timeout = self.probe_timeout
        updates = self._piggyback()
        cur = self.members.get(target)
        if cur is not None and cur.status == SUSPECT:  # the buddy system: tell the suspect, so it refutes at once
            updates = (*(u for u in updates if u.id != target), MemberState(target, SUSPECT, cur.incarnation))
        sent = time.monotonic()
        try:
            ack = await self.node.request(
                self.node.address(SWIM_ACTOR, target), Ping(seq, updates), timeout, sender=SWIM_ACTOR
            )
            if isinstance(ack, Ack):
                self.merge(ack.updates, target)
                self._adjust_awareness(-1)
                self._excused.discard(target)
                return
        except TimeoutError:
            late = time.monotonic() - sent - timeout
            if late > max(STALL_FLOOR, timeout / 4) and target not in self._excused:
                # the deadline fired that much after its time: our own event loop stalled (a busy
                # core), and the Ack may be waiting unread. That is our slowness, not the target's:
                # it counts against our local health, and the target is not suspected. Once per
                # target until it answers again, so that a dead member on a loaded machine is
                # still found, one probe later
                log.info("probe of %s timed out %.3g s late: our own loop stalled; not suspecting", target[:10], late)
                self._excused.add(target)
                self._count(stalls_excused=1)
                self._adjust_awareness(1)
                return
        except (ConnectionError, RemoteError):
            pass
        helpers = [i for i in self._others() if i != target and self.members[i].status == ALIVE]
        helpers = random.sample(helpers, min(cfg.indirect_checks, len(helpers)))
        left = max(2 * timeout, period_end - time.monotonic())
        nacks = 0
        if helpers:

            async def ask(helper: str) -> tuple[str, Message | None]:
                req = PingReq(seq, target, self._piggyback())
                try:
                    return helper, await self.node.request(
                        self.node.address(SWIM_ACTOR, helper), req, left, sender=SWIM_ACTOR
                    )
                except (TimeoutError, ConnectionError, RemoteError):
                    return helper, None

            reqs = [asyncio.ensure_future(ask(h)) for h in helpers]
            try:
                for fut in asyncio.as_completed(reqs):
                    helper, reply = await fut
                    if isinstance(reply, (Ack, Nack)):
                        self.merge(reply.updates, helper)
                    if isinstance(reply, Ack):
                        self._adjust_awareness(-1)
                        return
                    if isinstance(reply, Nack):
                        nacks += 1
            finally:
                for r in reqs:
                    r.cancel()
        self._adjust_awareness(len(helpers) - nacks if helpers else 1)
        cur = self.members.get(target)
        if cur is None or self._stopped:
            return
        if cur.status == ALIVE:
            log.info("member %s did not answer direct or indirect probes: suspect", target[:10])
            self._suspect(cur)
        elif cur.status == SUSPECT and self._confirm(target, self.me.id):
            self._enqueue(cur)  # we accuse it too now: pass our accusation on

    async def _gossip_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.gossip_interval)
            if not self._queue:
                continue
            others = self._others()
            for t in random.sample(others, min(self.config.gossip_fanout, len(others))):
                updates = self._piggyback()
                if updates:
                    self.node.send_nowait(
                        self.node.address(SWIM_ACTOR, t), Gossip(updates), self.config.protocol_period
                    )

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.sync_interval)
            others = [i for i in self._others() if self.members[i].status == ALIVE]
            if not others:
                continue
            peer = random.choice(others)
            try:
                reply = await self.node.request(
                    self.node.address(SWIM_ACTOR, peer),
                    Sync(tuple(self.members.values())),
                    self.config.protocol_period * 4,
                    sender=SWIM_ACTOR,
                )
                if isinstance(reply, Sync):
                    self.merge(reply.members)
            except (TimeoutError, ConnectionError, RemoteError) as e:
                log.debug("push-pull with %s failed: %s", peer[:10], e)

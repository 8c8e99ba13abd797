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

The protocol is here; what it drives is apart, as memberlist keeps it: the member table and its
events in ``swimstate.py``, the broadcast queue in ``swimqueue.py``, the suspicion timers and the
local health score in ``suspicion.py``, the settings (``SwimConfig``) and counts in ``swimconfig.py``.

Member metadata (addresses and registered names) travels in the member's ``alive`` state; changing
it raises the incarnation, as memberlist does for node metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Protocol

from .codec import Ack, ActorAddress, Gossip, Join, MemberState, Message, Nack, Ping, PingReq, SwimTiming, Sync
from .errors import RemoteError
from .swimconfig import SwimConfig, SwimStats
from .swimqueue import Broadcasts
from .swimstate import ALIVE, DEAD, SUSPECT, EventStream, MemberEvent, Peers, SwimState

__all__ = ["SWIM_ACTOR", "Context", "Host", "MemberEvent", "Membership"]

log = logging.getLogger(__name__)

SWIM_ACTOR = "swim"
STALL_FLOOR = 0.02  # seconds a timeout may fire late on a loaded machine before it means our loop stalled


class Host(Protocol):
    """What membership needs of the node it runs on (``runtime.node.Node`` is one)."""

    @property
    def id(self) -> str: ...
    @property
    def transport(self) -> Peers: ...
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


class Membership:
    """The SWIM actor of a node (actor name ``swim``)."""

    def __init__(self, node: Host, config: SwimConfig, addrs: Iterable[str], relay: str | None) -> None:
        self.node = node
        self.config = config
        self.state = SwimState(node, config, MemberState(node.id, ALIVE, 0, tuple(addrs), relay, {}))
        self.table = self.state.table
        self._seq = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._excused: set[str] = set()  # members whose last failed probe we blamed on our own stall

    # --- public view -------------------------------------------------------------------------

    @property
    def me(self) -> MemberState:
        """This member's own latest state."""
        return self.table.me

    @property
    def members(self) -> dict[str, MemberState]:
        """Every member known, this one included, by id (read only)."""
        return self.table.members

    def alive(self) -> list[MemberState]:
        """Members not declared dead (suspects included: they may still refute)."""
        return self.table.alive()

    def view(self) -> tuple[tuple[str, str], ...]:
        """(id, status) of every member not dead, sorted: equal on members that agree."""
        return self.table.view()

    def get(self, member_id: str) -> MemberState | None:
        return self.table.get(member_id)

    def events(self) -> EventStream:
        """Every membership event from this call on (``async for ev in m.events()``)."""
        return self.state.events.stream()

    def add_listener(self, fn: Callable[[MemberEvent], None]) -> None:
        self.state.events.add_listener(fn)

    def remove_listener(self, fn: Callable[[MemberEvent], None]) -> None:
        self.state.events.remove_listener(fn)

    async def wait_until(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Wait until ``predicate()`` holds after some membership change, or raise TimeoutError."""
        await self.state.events.wait_until(predicate, timeout, lambda: f"{what}; last view: {self.table.describe()}")

    @property
    def awareness(self) -> int:
        """The local health score: 0 when healthy, up to ``awareness_max - 1``."""
        return self.state.awareness.score

    @property
    def probe_interval(self) -> float:
        """The protocol period, stretched by the local health multiplier."""
        return self.state.awareness.scale(self.config.protocol_period)

    @property
    def probe_timeout(self) -> float:
        """How long a direct ping waits for its Ack, stretched by the local health multiplier
        (memberlist stretches only the period: over UDP a late ack is usually a lost one; over
        QUIC it is a late one, which waiting longer does catch)."""
        return self.state.probe_timeout

    def stats(self) -> SwimStats:
        """A snapshot of the failure detector's counts and the current awareness."""
        return replace(self.state.stats, awareness=self.state.awareness.score)

    def loop_stalled(self, seconds: float) -> None:
        """Lifeguard's local health awareness, from our own measurement: our event loop stalled
        for ``seconds`` (``stalls.LoopWatch``), long enough that the Acks we were due to read
        meanwhile lie unread, so our next failed probes say as much about us as about their
        targets: +1 on the local health score (each answered probe takes one off again)."""
        log.debug("our own event loop stalled for %.3g s: local health score +1", seconds)  # the watch said it
        self.state.adjust_awareness(1)

    def suspicion_timeout_of(self, member_id: str) -> float | None:
        """The current length of our suspicion of ``member_id`` (from its start; it shrinks as
        confirmations arrive), or None if we do not suspect it."""
        s = self.state.suspicions.get(member_id)
        return None if s is None else s.timeout()

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [
            asyncio.ensure_future(self._probe_loop()),
            asyncio.ensure_future(self._gossip_loop()),
            asyncio.ensure_future(self._sync_loop()),
        ]

    async def leave(self, timeout: float = 0.5) -> None:
        """Tell every member we are going (a clean exit), so our names vanish at once."""
        self.state.leaving = True  # from now on: no refutation, no acks (they could resurrect us)
        bye = Gossip((MemberState(self.me.id, DEAD, self.me.incarnation),))
        # a request, not a one-way send: a written frame may still be lost when the endpoint closes
        sends = [self.node.request(self.node.address(SWIM_ACTOR, t), bye, timeout) for t in self._others()]
        for r in await asyncio.gather(*sends, return_exceptions=True):
            if isinstance(r, BaseException):
                log.info("leave message not delivered: %s", r)

    async def stop(self) -> None:
        self.state.stopped = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self.state.suspicions.clear()

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
                    self.state.merge(reply.members)
                    # announce ourselves to the members we now know, as memberlist's join does:
                    # those that joined just before us may not hear it from the seed's gossip,
                    # sent before they were known, and would wait for a push-pull
                    self.state.enqueue(self.me)
                    return
                last = f"unexpected reply {type(reply).__name__}"
            except (TimeoutError, ConnectionError, RemoteError) as e:
                last = str(e)
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 1.0)

    def set_addrs(self, addrs: Iterable[str], relay: str | None) -> None:
        """Announce where this member is now (its endpoint's addresses changed): a new incarnation."""
        addrs = tuple(addrs)
        if (addrs, relay) == (self.me.addrs, self.me.relay) or self.state.leaving:
            return
        self.state.set_me(replace(self.me, incarnation=self.me.incarnation + 1, addrs=addrs, relay=relay))
        self.state.notify("updated", self.me)

    def set_names(self, names: dict[str, str]) -> None:
        """Publish this member's names (a new incarnation, disseminated like any alive update)."""
        self.state.set_me(replace(self.me, incarnation=self.me.incarnation + 1, names=dict(names)))
        self.state.notify("updated", self.me)

    def expel(self, member_id: str) -> bool:
        """Declare ``member_id`` dead now, its names gone (its id was revoked; SwimState.expel).
        Its later alive states come in only if the transport allows it again."""
        return self.state.expel(member_id)

    async def push_pull(self, peer: str, timeout: float) -> None:
        """One push-pull with ``peer``: send our full state, merge its own (the periodic repair,
        here on demand: a member that may now accept members it dropped before)."""
        reply = await self.node.request(
            self.node.address(SWIM_ACTOR, peer), Sync(tuple(self.members.values())), timeout, sender=SWIM_ACTOR
        )
        if isinstance(reply, Sync):
            self.state.merge(reply.members)

    def retime(self, ping_timeout: float, protocol_period: float) -> bool:
        """Probe with at least this timeout and period (seconds), each taken only where it asks for
        more than this member has: a timing is never shortened here, so the start-up timing (and
        the local health multiplier on top of it) stays a floor. True if anything changed.
        ValueError, naming the values, for a timing that is not one (not positive, or a timeout
        not shorter than its period)."""
        for name, v in (("ping_timeout", ping_timeout), ("protocol_period", protocol_period)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf"):
                raise ValueError(f"SWIM timing {name} must be a positive number of seconds, got {v!r}")
        if ping_timeout >= protocol_period:
            raise ValueError(
                f"SWIM timing asks for ping_timeout {ping_timeout!r} s with protocol_period {protocol_period!r} s; "
                "expected a timeout shorter than its period"
            )
        before = self.config
        # each field its own maximum: both old and new have timeout < period, so the result does too
        after = replace(
            before,
            ping_timeout=max(before.ping_timeout, float(ping_timeout)),
            protocol_period=max(before.protocol_period, float(protocol_period)),
        )
        if after == before:
            return False
        self.config = self.state.config = after  # the state's probe timeout reads its own copy
        log.info(
            "SWIM re-timed: probe timeout %.3g -> %.3g s, period %.3g -> %.3g s",
            before.ping_timeout,
            after.ping_timeout,
            before.protocol_period,
            after.protocol_period,
        )
        return True

    # --- handlers (dispatched by the node) ---------------------------------------------------

    def on_swim_timing(self, msg: SwimTiming, ctx: Context) -> SwimTiming:
        """The orchestrator's timing (:meth:`retime`); the answer is the timing this member runs with."""
        self.retime(msg.ping_timeout, msg.protocol_period)
        return SwimTiming(self.config.ping_timeout, self.config.protocol_period)

    def on_ping(self, msg: Ping, ctx: Context) -> Ack | None:
        if self.state.leaving:
            return None  # not an Ack: the prober treats us as gone
        self.state.merge(msg.updates, ctx.sender.node)
        updates = self._piggyback()
        if any(u.id == self.me.id and u.status != ALIVE for u in msg.updates) and self.me not in updates:
            # the prober still suspects us (the buddy system told us) though our refutation may
            # have left our queue: answer with our alive state, which outbids its suspicion
            updates = (*updates, self.me)
        return Ack(msg.seq, updates)

    async def on_ping_req(self, msg: PingReq, ctx: Context) -> Ack | Nack:
        self.state.merge(msg.updates, ctx.sender.node)
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
                self.state.merge(ack.updates, msg.target)
                return Ack(msg.seq, self._piggyback())
        except (TimeoutError, ConnectionError, RemoteError):
            pass
        return Nack(msg.seq, self._piggyback())

    def on_join(self, msg: Join, ctx: Context) -> Sync:
        if msg.member.id != ctx.sender.node:
            raise PermissionError(f"{ctx.sender.node[:10]} tried to join as {msg.member.id[:10]}")
        self.state.merge([msg.member])
        return Sync(tuple(self.members.values()))

    def on_sync(self, msg: Sync, ctx: Context) -> Sync:
        self.state.merge(msg.members)
        return Sync(tuple(self.members.values()))

    def on_gossip(self, msg: Gossip, ctx: Context) -> None:
        self.state.merge(msg.updates, ctx.sender.node)

    def on_late_reply(self, msg: Message, ctx: Context) -> None:
        """A reply that came after our request gave up (the node hands it here). A slow member
        hears its acks late; they still carry news, the refutations of the members it suspects
        among them."""
        if isinstance(msg, (Ack, Nack)):
            self.state.merge(msg.updates, ctx.sender.node)
        elif isinstance(msg, Sync):
            self.state.merge(msg.members)

    def merge(self, updates: Iterable[MemberState], source: str | None = None) -> None:
        """Apply updates (``SwimState.merge``): ``source`` is the member that sent them as its own
        news, None for full states that relay what others said."""
        self.state.merge(updates, source)

    def _piggyback(self) -> tuple[MemberState, ...]:
        return self.state.piggyback()

    @property
    def _queue(self) -> Broadcasts:
        return self.state.queue

    # --- loops -------------------------------------------------------------------------------

    def _others(self) -> list[str]:
        """The members not dead, but us (``MemberTable.others``; callers must not change it)."""
        return self.table.others()

    def _next_target(self) -> str | None:
        return self.table.next_target()

    @property
    def _probe_order(self) -> list[str]:
        """What is left of the current probe round (``MemberTable.probe_order``)."""
        return self.table.probe_order

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
                self.state.merge(ack.updates, target)
                self.state.adjust_awareness(-1)
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
                self.state.count(stalls_excused=1)
                self.state.adjust_awareness(1)
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
                        self.state.merge(reply.updates, helper)
                    if isinstance(reply, Ack):
                        self.state.adjust_awareness(-1)
                        return
                    if isinstance(reply, Nack):
                        nacks += 1
            finally:
                for r in reqs:
                    r.cancel()
        self.state.adjust_awareness(len(helpers) - nacks if helpers else 1)
        cur = self.members.get(target)
        if cur is None or self.state.stopped:
            return
        if cur.status == ALIVE:
            log.info("member %s did not answer direct or indirect probes: suspect", target[:10])
            self.state.suspect(cur)
        elif cur.status == SUSPECT and self.state.confirm(target, self.me.id):
            self.state.enqueue(cur)  # we accuse it too now: pass our accusation on

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
                await self.push_pull(peer, self.config.protocol_period * 4)
            except (TimeoutError, ConnectionError, RemoteError) as e:
                log.debug("push-pull with %s failed: %s", peer[:10], e)

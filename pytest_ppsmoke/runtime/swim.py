"""SWIM membership (Das, Gupta, Motivala 2002) with suspicion and incarnation refutation.

Each protocol period a member probes one other member, chosen round-robin over a shuffled list:
a direct ``Ping``, and if no ``Ack`` arrives within ``ping_timeout``, a ``PingReq`` through
``indirect_checks`` other members. A member that answers neither is *suspected*; a suspect that
does not refute within ``suspicion_timeout`` is declared *dead* and its names vanish. A member
that hears it is suspected (or declared dead) while alive refutes by raising its incarnation.

Updates ride on every probe message (piggybacking, each retransmitted ``retransmit_mult *
ceil(log10(n + 1))`` times) and, as in memberlist, on a short gossip tick so that a join is known
everywhere within a few ticks. A periodic push-pull ``Sync`` repairs anything gossip missed.
From Lifeguard we take the ``Nack`` of an intermediary that cannot reach the target.

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
from dataclasses import dataclass, fields, replace
from typing import Protocol

from .codec import Ack, ActorAddress, Gossip, Join, MemberState, MemberStatus, Message, Nack, Ping, PingReq, Sync
from .errors import RemoteError

log = logging.getLogger(__name__)

ALIVE, SUSPECT, DEAD = MemberStatus.alive, MemberStatus.suspect, MemberStatus.dead
SWIM_ACTOR = "swim"


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
class SwimConfig:
    """Timing of the failure detector. Detection of a killed member takes at most about
    ``n * protocol_period`` (the probe round) plus ``suspicion_timeout``."""

    protocol_period: float = 0.25
    ping_timeout: float = 0.12
    indirect_checks: int = 2
    suspicion_timeout: float = 2.0
    gossip_interval: float = 0.05
    gossip_fanout: int = 3
    retransmit_mult: int = 4
    max_piggyback: int = 16
    sync_interval: float = 5.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not v > 0:
                raise ValueError(f"SWIM {f.name} must be positive, got {v!r}")
        if self.ping_timeout >= self.protocol_period:
            raise ValueError(
                f"SWIM ping_timeout ({self.ping_timeout}) must be shorter than protocol_period ({self.protocol_period})"
            )

    @classmethod
    def loopback(cls) -> SwimConfig:
        return cls()

    @classmethod
    def shared_cpu(cls) -> SwimConfig:
        """Loopback, with the stages' tinygrad workers on the same few cores: a node's event
        loop can be starved for seconds, which must not read as death (seen on 2 cores with
        seven workers busy: a live stage declared dead after the 2 s suspicion)."""
        return cls(suspicion_timeout=5.0)

    def to_env(self) -> str:
        """The ``PP_SWIM`` value that gives a member this configuration."""
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    @classmethod
    def wan(cls) -> SwimConfig:
        """Round trips of tens to hundreds of milliseconds between continents."""
        return cls(
            protocol_period=1.0,
            ping_timeout=0.5,
            indirect_checks=3,
            suspicion_timeout=6.0,
            gossip_interval=0.2,
            sync_interval=15.0,
        )

    def with_overrides(self, spec: str) -> SwimConfig:
        """Apply ``"name=value,name=value"`` (for example from the ``PP_SWIM`` variable)."""
        names = {f.name: f.type for f in fields(self)}
        changes: dict[str, float | int] = {}
        for item in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in names:
                raise ValueError(f"bad SWIM setting {item!r}; expected name=value with name in {sorted(names)}")
            try:
                changes[key] = int(value) if names[key] in (int, "int") else float(value)
            except ValueError:
                raise ValueError(f"SWIM setting {key} needs a number, got {value!r}") from None
        return replace(self, **changes)  # type: ignore[arg-type]


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


class Membership:
    """The SWIM actor of a node (actor name ``swim``)."""

    def __init__(self, node: Host, config: SwimConfig, addrs: Iterable[str], relay: str | None) -> None:
        self.node = node
        self.config = config
        self.me = MemberState(node.id, ALIVE, 0, tuple(addrs), relay, {})
        self.members: dict[str, MemberState] = {node.id: self.me}
        self._suspect_timers: dict[str, asyncio.TimerHandle] = {}
        self._queue: dict[str, list[object]] = {}  # id -> [update, transmissions left]
        self._probe_order: list[str] = []
        self._seq = 0
        self._subscribers: list[asyncio.Queue[MemberEvent]] = []
        self._listeners: list[Callable[[MemberEvent], None]] = []
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._leaving = False
        self._stopped = False

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
        for h in self._suspect_timers.values():
            h.cancel()
        self._suspect_timers.clear()

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
                    self.node.address(SWIM_ACTOR, seed_id), Join(self.me), timeout=min(left, 2.0)
                )
                if isinstance(reply, Sync):
                    self.merge(reply.members)
                    return
                last = f"unexpected reply {type(reply).__name__}"
            except (TimeoutError, ConnectionError, RemoteError) as e:
                last = str(e)
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 1.0)

    def set_names(self, names: dict[str, str]) -> None:
        """Publish this member's names (a new incarnation, disseminated like any alive update)."""
        self._set_me(replace(self.me, incarnation=self.me.incarnation + 1, names=dict(names)))
        self._notify("updated", self.me)

    # --- handlers (dispatched by the node) ---------------------------------------------------

    def on_ping(self, msg: Ping, ctx: Context) -> Ack | None:
        if self._leaving:
            return None  # not an Ack: the prober treats us as gone
        self.merge(msg.updates)
        return Ack(msg.seq, self._piggyback())

    async def on_ping_req(self, msg: PingReq, ctx: Context) -> Ack | Nack:
        self.merge(msg.updates)
        try:
            ack = await self.node.request(
                self.node.address(SWIM_ACTOR, msg.target), Ping(msg.seq, self._piggyback()), self.config.ping_timeout
            )
            if isinstance(ack, Ack):
                self.merge(ack.updates)
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
        self.merge(msg.updates)

    # --- state machine -----------------------------------------------------------------------

    def merge(self, updates: Iterable[MemberState]) -> None:
        for u in updates:
            self._apply(u)

    def _apply(self, u: MemberState) -> None:
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
            return
        if not self.node.transport.is_allowed(u.id):
            return
        cur = self.members.get(u.id)
        if cur is None:
            self.members[u.id] = u
            if u.status != DEAD:
                self.node.learn(u)
                self._enqueue(u)
                self._notify("joined", u)
                if u.status == SUSPECT:
                    self._start_suspicion(u)
            return
        if u.status == ALIVE:
            if u.incarnation <= cur.incarnation:
                return
            self.members[u.id] = u
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
                return
            new = replace(cur, status=SUSPECT, incarnation=u.incarnation)
            self.members[u.id] = new
            self._enqueue(new)
            self._start_suspicion(new)
            self._notify("suspect", new)
        else:
            if cur.status == DEAD or u.incarnation < cur.incarnation:
                return
            self._declare_dead(replace(cur, status=DEAD, incarnation=u.incarnation, names={}))

    def _set_me(self, me: MemberState) -> None:
        self.me = me
        self.members[me.id] = me
        self._enqueue(me)
        self._changed.set()

    def _declare_dead(self, dead: MemberState) -> None:
        self.members[dead.id] = dead
        self._cancel_suspicion(dead.id)
        self._enqueue(dead)
        self._notify("dead", dead)
        self.node.transport.forget(dead.id)

    def _start_suspicion(self, m: MemberState) -> None:
        self._cancel_suspicion(m.id)
        if self._stopped:
            return
        loop = asyncio.get_running_loop()
        self._suspect_timers[m.id] = loop.call_later(
            self.config.suspicion_timeout, self._suspicion_expired, m.id, m.incarnation
        )

    def _cancel_suspicion(self, member_id: str) -> None:
        h = self._suspect_timers.pop(member_id, None)
        if h is not None:
            h.cancel()

    def _suspicion_expired(self, member_id: str, incarnation: int) -> None:
        self._suspect_timers.pop(member_id, None)
        cur = self.members.get(member_id)
        if cur is not None and cur.status == SUSPECT and cur.incarnation == incarnation:
            log.info(
                "member %s did not refute suspicion in %.3g s: dead", member_id[:10], self.config.suspicion_timeout
            )
            self._declare_dead(replace(cur, status=DEAD, names={}))

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
        n = len(self.alive())
        self._queue[m.id] = [m, self.config.retransmit_mult * max(1, math.ceil(math.log10(n + 1)))]

    def _piggyback(self) -> tuple[MemberState, ...]:
        if not self._queue:
            return ()
        items = sorted(self._queue.values(), key=lambda e: -e[1])[: self.config.max_piggyback]  # type: ignore[operator]
        out = []
        for entry in items:
            m = entry[0]
            assert isinstance(m, MemberState)
            out.append(m)
            entry[1] -= 1  # type: ignore[operator]
            if entry[1] <= 0:  # type: ignore[operator]
                self._queue.pop(m.id, None)
        return tuple(out)

    # --- loops -------------------------------------------------------------------------------

    def _others(self) -> list[str]:
        return [m.id for m in self.members.values() if m.status != DEAD and m.id != self.me.id]

    def _next_target(self) -> str | None:
        others = set(self._others())
        self._probe_order = [i for i in self._probe_order if i in others]
        if not self._probe_order:
            self._probe_order = list(others)
            random.shuffle(self._probe_order)
        return self._probe_order.pop() if self._probe_order else None

    async def _probe_loop(self) -> None:
        period = self.config.protocol_period
        while True:
            started = time.monotonic()
            target = self._next_target()
            if target is not None:
                try:
                    await self._probe(target, started + period)
                except Exception:  # a bug here must not stop failure detection
                    log.exception("probe of %s failed unexpectedly", target[:10])
            await asyncio.sleep(max(0.0, started + period - time.monotonic()))

    async def _probe(self, target: str, period_end: float) -> None:
        self._seq += 1
        seq = self._seq
        cfg = self.config
        try:
            ack = await self.node.request(
                self.node.address(SWIM_ACTOR, target), Ping(seq, self._piggyback()), cfg.ping_timeout
            )
            if isinstance(ack, Ack):
                self.merge(ack.updates)
                return
        except (TimeoutError, ConnectionError, RemoteError):
            pass
        helpers = [i for i in self._others() if i != target and self.members[i].status == ALIVE]
        helpers = random.sample(helpers, min(cfg.indirect_checks, len(helpers)))
        left = max(cfg.ping_timeout, period_end - time.monotonic())
        if helpers:
            reqs = [
                asyncio.ensure_future(
                    self.node.request(self.node.address(SWIM_ACTOR, h), PingReq(seq, target, self._piggyback()), left)
                )
                for h in helpers
            ]
            try:
                for fut in asyncio.as_completed(reqs):
                    try:
                        reply = await fut
                    except (TimeoutError, ConnectionError, RemoteError):
                        continue
                    if isinstance(reply, (Ack, Nack)):
                        self.merge(reply.updates)
                    if isinstance(reply, Ack):
                        return
            finally:
                for r in reqs:
                    r.cancel()
        cur = self.members.get(target)
        if cur is not None and cur.status == ALIVE:
            log.info("member %s did not answer direct or indirect probes: suspect", target[:10])
            self._apply(MemberState(target, SUSPECT, cur.incarnation))

    async def _gossip_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.gossip_interval)
            if not self._queue:
                continue
            targets = self._others()
            random.shuffle(targets)
            for t in targets[: self.config.gossip_fanout]:
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
                )
                if isinstance(reply, Sync):
                    self.merge(reply.members)
            except (TimeoutError, ConnectionError, RemoteError) as e:
                log.debug("push-pull with %s failed: %s", peer[:10], e)

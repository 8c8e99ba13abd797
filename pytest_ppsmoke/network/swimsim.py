"""SWIM at scale on a virtual clock: ``swim.Membership``, the code every node runs, with many
members in one process on an in-memory network.

    result = simulate(SimSpec(members=300, profile="wan", config=SwimConfig.wan()))
    result.converge_s, result.detect_first_s, result.detect_all_s, result.false_deaths

What is real and what is modelled:

- Each member is a real ``Membership`` (probes, indirect probes, Lifeguard's awareness and
  dynamic suspicion, piggybacked gossip, push-pull), driven by the same asyncio timers as on a
  node. Only its ``Host`` is replaced: :class:`SimHost` hands each message to the network instead
  of iroh, and a request gets its reply, or its ``TimeoutError``, as the node's does.
- The network (:class:`SimNet`) delivers each message after the link's one-way delay plus a
  uniform jitter, and loses it with the link's loss (netem's correlation: with probability
  ``loss_corr`` a message shares the previous one's fate on that link). The figures are those of
  the emulated network's profiles (``profiles.PROFILES``). Bytes are counted as the wire
  frame each message would be (``codec.encode_frame``).
- A slowed member (Lifeguard's "slow event loop") handles each message that reaches it up to
  ``slow_s`` late, uniformly: its Acks and Nacks come late, and so do the replies it waits for.
  Its own timers are not delayed (a single event loop serves every member), so the stall
  excuse of a late timeout never fires here.
- Time is virtual: the event loop's clock (and ``time.monotonic`` as ``swim`` and ``swimstate`` read it) jumps to
  the next timer whenever nothing is ready (:class:`VirtualSelector`), so a simulated minute costs
  the members' Python work, not a minute. ``wall_s`` says what it cost.

A member killed (``kill``) stops at once, as a crashed host: its tasks are cancelled and nothing
reaches it or leaves it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import selectors
import time
import types
from collections.abc import Coroutine, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar, cast

from ..runtime import swim, swimstate
from ..runtime.codec import ActorAddress, Envelope, MemberState, MemberStatus, Message, Sync, encode_frame
from ..runtime.errors import RemoteError
from ..runtime.node import handler_name
from ..runtime.swim import SWIM_ACTOR, MemberEvent, Membership
from ..runtime.swimconfig import SwimConfig
from .profiles import PROFILES

T = TypeVar("T")


class VirtualSelector(selectors.BaseSelector):
    """A selector with no I/O: ``select(t)`` moves the virtual clock ``t`` on and reports
    nothing. An event loop built on it runs its timers in virtual time."""

    def __init__(self) -> None:
        self.now = 0.0
        self._map: dict[int, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._map[fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._map.pop(fileobj if isinstance(fileobj, int) else fileobj.fileno())

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise RuntimeError("the simulation has no timer left and would wait for I/O that never comes")
        self.now += max(0.0, timeout)
        return []

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._map

    def close(self) -> None:
        self._map.clear()


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock is virtual (its ``time()`` is the selector's)."""

    def __init__(self) -> None:
        self.clock = VirtualSelector()
        super().__init__(self.clock)

    def time(self) -> float:
        return self.clock.now

    def block(self, seconds: float) -> None:
        """The loop is blocked for ``seconds`` (a busy core): its clock moves on and nothing
        runs meanwhile; what was due then runs late, on the loop's next turn."""
        if not seconds >= 0:
            raise ValueError(f"a blocked loop's seconds must be 0 or more, got {seconds!r}")
        self.clock.now += seconds


def virtual_loop() -> VirtualLoop:
    """An event loop whose clock is virtual."""
    return VirtualLoop()


def run_virtual(main: Coroutine[Any, Any, T], seed: int = 1) -> T:
    """Run ``main`` on a fresh virtual loop, with ``swim``'s and ``swimstate``'s clock on it and
    ``random`` seeded (``swim`` draws its probe order and helpers from the module), so that its
    outcome depends on neither the machine's speed nor its load; what ``main`` leaves on the
    loop is cancelled before it closes."""
    random.seed(seed)
    loop = virtual_loop()
    try:
        with _swim_on(loop):
            try:
                return loop.run_until_complete(main)
            finally:
                loop.run_until_complete(_cancel_the_rest())
    finally:
        loop.close()


@contextlib.contextmanager
def _swim_on(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """``swim`` and ``swimstate`` read ``time.monotonic()``: make it the loop's virtual clock meanwhile."""
    modules = [vars(swim), vars(swimstate)]
    real = [module["time"] for module in modules]
    for module in modules:
        module["time"] = types.SimpleNamespace(monotonic=loop.time)
    try:
        yield
    finally:
        for module, was in zip(modules, real, strict=True):
            module["time"] = was


# QUIC's probe timeout adds the peer's maximum ACK delay (quinn's default, iroh's transport)
QUIC_MAX_ACK_DELAY = 0.025
TRANSPORTS = ("datagram", "quic")
MAX_ATTEMPTS = 8  # a stream's packet sent this often unanswered: ~2^8 probe timeouts, the connection times out
# before a connection has a round trip measured, QUIC's probe timeout starts from RFC 9002's initial
# RTT (333 ms, its variation half that): a lost handshake packet waits about a second
QUIC_HANDSHAKE_PTO = 0.333 + 4 * 0.333 / 2 + QUIC_MAX_ACK_DELAY
QUIC_SERVER_FLIGHT = 2  # the server's first flight (its Initial and Handshake packets): all must arrive


@dataclass(frozen=True)
class Link:
    delay: float = 0.0  # one way, seconds
    jitter: float = 0.0  # seconds, uniform on top of the delay
    loss: float = 0.0
    loss_corr: float = 0.0
    # 0: a lost packet is a lost message (UDP, as memberlist and the SWIM papers have it); else a
    # reliable stream's: the message is sent again after this long, doubling each time (QUIC's
    # probe timeout and its backoff), each attempt lost or not as the first
    retransmit_s: float = 0.0

    @classmethod
    def of_profile(cls, name: str, transport: str = "datagram") -> Link:
        if name not in PROFILES:
            raise ValueError(f"unknown network profile {name!r}; expected one of {', '.join(PROFILES)}")
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {transport!r}; expected one of {', '.join(TRANSPORTS)}")
        p = PROFILES[name]
        link = cls(delay=50e-6) if p is None else cls(p.delay_ms / 1000, p.jitter_ms / 1000, p.loss, p.loss_corr)
        if transport == "quic":  # RFC 9002's PTO: smoothed RTT + 4 x its variation + the peer's ACK delay
            link = replace(link, retransmit_s=2 * link.delay + 4 * link.jitter + QUIC_MAX_ACK_DELAY)
        return link


@dataclass
class Traffic:
    messages: int = 0
    bytes: int = 0


class _AnyPeer:
    def is_allowed(self, peer_id: str) -> bool:
        return True

    def forget(self, peer_id: str) -> None:
        pass


class _Ctx:
    def __init__(self, sender: str) -> None:
        self.sender = ActorAddress(sender, SWIM_ACTOR)


class SimNet:
    """The in-memory network: every member's inbox is a timer on the virtual loop."""

    def __init__(self, link: Link, rng: random.Random, count_bytes: bool = True) -> None:
        self.link, self.rng, self.count_bytes = link, rng, count_bytes
        self.members: dict[str, Membership] = {}
        self.dead: set[str] = set()
        self.slow: dict[str, float] = {}  # member -> seconds it may handle a message late
        self.traffic: dict[str, Traffic] = {}  # by sender
        self._lost_last: dict[tuple[str, str], bool] = {}
        self._corr = 0
        self.handling: set[asyncio.Task[Any]] = set()  # handlers under way (an indirect probe's)
        self._state_bytes: dict[tuple[str, int, int], int] = {}
        self._connected: set[tuple[str, str]] = set()  # (dialer, peer): a reliable transport's open connections
        self._stream_free: dict[tuple[str, str, bool], float] = {}  # (from, to, replies): when its last frame lands

    def _lost(self, src: str, dst: str) -> bool:
        link = self.link
        if not link.loss:
            return False
        key = (src, dst)
        if key in self._lost_last and self.rng.random() < link.loss_corr:
            return self._lost_last[key]
        lost = self.rng.random() < link.loss
        self._lost_last[key] = lost
        return lost

    def _delay(self, dst: str) -> float:
        d = self.link.delay + (self.rng.random() * self.link.jitter if self.link.jitter else 0.0)
        slow = self.slow.get(dst)
        return d + (self.rng.random() * slow if slow else 0.0)

    def size(self, msg: Message, corr: int, reply: bool) -> int:
        """The bytes of ``msg``'s wire frame. Its member states (a ``Sync``'s every member, a
        probe's or gossip's piggyback: most of the encoding work at a thousand members) are
        counted apart, each state's bytes kept per (id, status, incarnation): in a simulation a
        member's addresses and names never change. A list is its count and its items, so the
        frame is the message with its lists emptied plus their states' bytes."""
        if not self.count_bytes:
            return 0
        env = Envelope(SWIM_ACTOR, SWIM_ACTOR, corr, reply)
        lists = {f.name: getattr(msg, f.name) for f in fields(cast(Any, msg)) if _is_states(getattr(msg, f.name))}
        total = len(encode_frame(env, replace(msg, **dict.fromkeys(lists, ()))))  # type: ignore[type-var]
        for states in lists.values():
            for m in states:
                key = (m.id, m.status, m.incarnation)
                n = self._state_bytes.get(key)
                if n is None:
                    n = self._state_bytes[key] = len(encode_frame(env, Sync((m,)))) - len(encode_frame(env, Sync(())))
                total += n
        return total

    def _attempts(self, src: str, dst: str, backoff: float) -> float | None:
        """One packet's way from ``src`` to ``dst``: its delay, after any retransmissions
        (``backoff``, doubling; 0: none); None: lost."""
        delay = 0.0
        for _ in range(MAX_ATTEMPTS):
            if not self._lost(src, dst):
                return delay + self._delay(dst)
            if not backoff:
                return None
            delay, backoff = delay + backoff, 2 * backoff
        return None  # a reliable stream that long without an answer: its connection is gone

    def _transit(
        self, src: str, dst: str, now: float, reply: bool = False, deadline: float | None = None
    ) -> float | None:
        """How long a message sent at ``now`` from ``src`` takes to reach ``dst``; None: it is
        lost. On a reliable transport (as the nodes' transport works):

        - the first request from one member to another opens the connection: the handshake's
          flights come first, each sent again after QUIC's initial probe timeout when lost; a
          sender that gives up at its ``deadline`` first abandons it (the message is lost, the
          next one dials again); a reply travels on its request's connection;
        - a member's frames to another share one stream, in order: a frame held up by a lost
          packet holds up the frames behind it.
        """
        link = self.link
        first = 0.0
        if link.retransmit_s and not reply and (src, dst) not in self._connected:
            there = self._attempts(src, dst, QUIC_HANDSHAKE_PTO)
            back = [self._attempts(dst, src, QUIC_HANDSHAKE_PTO) for _ in range(QUIC_SERVER_FLIGHT)]
            if there is None or None in back:
                return None
            first = there + max(b for b in back if b is not None)
            if deadline is not None and first > deadline:
                return None
            self._connected.add((src, dst))
        took = self._attempts(src, dst, link.retransmit_s)
        if took is None:
            return None
        if not link.retransmit_s:
            return first + took
        stream = (src, dst, reply)
        arrives = max(now + first + took, self._stream_free.get(stream, 0.0))
        self._stream_free[stream] = arrives
        return arrives - now

    def send(
        self,
        src: str,
        dst: str,
        msg: Message,
        reply: asyncio.Future[Message] | None,
        corr: int = 0,
        deadline: float | None = None,
    ) -> None:
        t = self.traffic.setdefault(src, Traffic())
        t.messages += 1
        t.bytes += self.size(msg, corr, False)
        if src in self.dead or dst in self.dead or dst not in self.members:
            return
        loop = asyncio.get_running_loop()
        took = self._transit(src, dst, loop.time(), deadline=deadline)
        if took is not None:
            loop.call_later(took, self._arrive, src, dst, msg, reply, corr)

    def _arrive(self, src: str, dst: str, msg: Message, reply: asyncio.Future[Message] | None, corr: int) -> None:
        if dst in self.dead:
            return
        member = self.members[dst]
        handler = getattr(member, handler_name(type(msg)), None)
        if handler is None:
            return
        try:
            result = handler(msg, _Ctx(src))
        except Exception as e:  # the node answers a failed handler with an error reply
            self._answer(dst, src, e, reply, corr)
            return
        if asyncio.iscoroutine(result):
            task = asyncio.ensure_future(result)
            self.handling.add(task)

            def done(t: asyncio.Task[Any]) -> None:
                self.handling.discard(t)
                if not t.cancelled():
                    self._answer(dst, src, t.exception() or t.result(), reply, corr)

            task.add_done_callback(done)
        else:
            self._answer(dst, src, result, reply, corr)

    def _answer(self, src: str, dst: str, result: Any, reply: asyncio.Future[Message] | None, corr: int) -> None:
        if reply is None or result is None:
            return
        if isinstance(result, BaseException):
            err: BaseException = RemoteError(ActorAddress(src, SWIM_ACTOR), "handler_failed", str(result))
            self._deliver_reply(src, dst, err, reply)
            return
        t = self.traffic.setdefault(src, Traffic())
        t.messages += 1
        t.bytes += self.size(result, corr, True)
        self._deliver_reply(src, dst, result, reply)

    def _deliver_reply(self, src: str, dst: str, result: Any, reply: asyncio.Future[Message]) -> None:
        if src in self.dead or dst in self.dead:
            return
        took = self._transit(src, dst, asyncio.get_running_loop().time(), reply=True)
        if took is None:
            return

        def land() -> None:
            if dst in self.dead:
                return
            if reply.done():  # the request gave up: the node hands a late reply to the actor
                if isinstance(result, Message):
                    self.members[dst].on_late_reply(result, _Ctx(src))
                return
            if isinstance(result, BaseException):
                reply.set_exception(result)
            else:
                reply.set_result(result)

        asyncio.get_running_loop().call_later(took, land)

    def next_corr(self) -> int:
        self._corr += 1
        return self._corr


class SimHost:
    """A member's ``swim.Host``: its messages go through :class:`SimNet`."""

    def __init__(self, net: SimNet, member_id: str) -> None:
        self.net, self._id = net, member_id
        self._transport = _AnyPeer()

    @property
    def id(self) -> str:
        return self._id

    @property
    def transport(self) -> _AnyPeer:
        return self._transport

    def address(self, actor: str, node: str | None = None) -> ActorAddress:
        return ActorAddress(node or self._id, actor)

    def learn(self, m: Any) -> None:
        pass

    def send_nowait(self, to: ActorAddress, msg: Message, timeout: float, sender: str = "") -> None:
        self.net.send(self._id, to.node, msg, None, deadline=timeout)

    async def request(
        self, to: ActorAddress, msg: Message, timeout: float | None = None, *, sender: str = ""
    ) -> Message:
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self.net.send(self._id, to.node, msg, fut, self.net.next_corr(), deadline=timeout)
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise TimeoutError(f"no reply from {to} to {type(msg).__name__} within {timeout:.3g} s") from None


def _is_states(value: Any) -> bool:
    return isinstance(value, tuple) and bool(value) and isinstance(value[0], MemberState)


def member_id(i: int) -> str:
    return f"{i:064x}"


@dataclass(frozen=True)
class SimSpec:
    members: int
    profile: str = "wan"  # the link of every pair (network.profiles)
    config: SwimConfig = field(default_factory=SwimConfig.wan)
    slowed: float = 0.0  # the share of members whose loop is slow, once converged (from the watch on, if any)
    slow_s: float = 1.0  # how late a slowed member may handle a message
    kill: bool = True  # kill one healthy member once converged, and time its detection
    watch_s: float = 0.0  # then run this long more on ``watch_profile``'s links, slowed, counting false deaths
    watch_profile: str = ""  # "": ``profile``'s
    seed: int = 1
    count_bytes: bool = True
    limit_s: float = 600.0  # virtual seconds before the run gives up on a phase
    transport: str = "datagram"  # a lost packet: a lost message ("datagram"), or sent again ("quic", the nodes')
    join_at: tuple[float, ...] = ()  # members 1.. start and join at these seconds (a real run's schedule); () all at 0


@dataclass
class SimResult:
    spec: dict[str, Any]
    converge_s: float | None = None  # joins sent at 0: until every member sees every other alive
    converge_after_joins_s: float | None = None  # the last join's end (its Sync merged) to the same
    detect_first_s: float | None = None  # the kill to the first member that declares it dead
    detect_all_s: float | None = None  # ... to the last live member that knows
    detect_spread_s: float | None = None
    false_deaths: int = 0  # live members declared dead while watched (each member and incarnation once)
    false_deaths_per_member_hour: float | None = None
    suspicions: int = 0  # suspicions raised by probes while watched
    refuted: int = 0
    messages_per_member_s: float = 0.0
    bytes_per_member_s: float = 0.0
    virtual_s: float = 0.0
    wall_s: float = 0.0
    bounds: dict[str, float] = field(default_factory=dict)


def memberlist_figures(n: int, config: SwimConfig) -> dict[str, float]:
    """memberlist's formulas at ``n`` with this config's probe period, side by side with ours:
    its suspicion timeout ``4 x max(1, log10 n) x probe interval`` (our ``suspicion_timeout``
    plays its ``4 x probe interval``), and SWIM's expected time until some member probes a dead
    one, ``period x e / (e - 1)`` (each of n - 1 members probes one target a period)."""
    lo, hi = config.suspicion_bounds(n)
    first_probe = config.protocol_period * math.e / (math.e - 1)
    return {
        "memberlist_suspicion_s": round(4 * max(1.0, math.log10(n)) * config.protocol_period, 3),
        "ours_suspicion_min_s": round(lo, 3),
        "ours_suspicion_max_s": round(hi, 3),
        "expected_first_probe_s": round(first_probe, 3),
        "expected_detection_s": round(first_probe + config.ping_timeout + lo, 3),
        "detection_bound_s": round(config.detection_bound(n), 3),
    }


async def until(pred: Any, step: float, limit: float, what: str) -> float:
    """Wait, checking every ``step`` seconds of the running loop's clock (virtual in a
    simulation), until ``pred()``; its seconds, or TimeoutError after ``limit``."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not pred():
        if loop.time() - started > limit:
            raise TimeoutError(f"{what} did not happen within {limit:g} s")
        await asyncio.sleep(step)
    return loop.time() - started


async def _run(spec: SimSpec, rng: random.Random) -> SimResult:
    loop = asyncio.get_running_loop()
    n, cfg = spec.members, spec.config
    net = SimNet(Link.of_profile(spec.profile, spec.transport), rng, spec.count_bytes)
    ids = [member_id(i) for i in range(n)]
    for i in ids:
        net.members[i] = Membership(SimHost(net, i), cfg, (), None)
    slowed = rng.sample(ids[1:], round(spec.slowed * (n - 1)))  # slow from the watch on (or the kill, unwatched)
    result = SimResult(spec={**spec.__dict__, "config": cfg.__dict__}, bounds=memberlist_figures(n, cfg))

    deaths: dict[str, dict[str, float]] = {}  # dead member -> observer -> when
    false: set[tuple[str, int]] = set()

    alive_of: dict[str, set[str]] = {i: set() for i in ids}  # observer -> the others it holds alive
    complete: set[str] = set()  # observers that hold every other alive
    converged: list[float | None] = [None]  # since when every observer does

    def listener(observer: str) -> Any:
        def on(ev: MemberEvent) -> None:
            alive = alive_of[observer]
            if ev.member.status == MemberStatus.alive:
                alive.add(ev.member.id)
            else:
                alive.discard(ev.member.id)
            if len(alive) == n - 1:
                complete.add(observer)
            else:
                complete.discard(observer)
            converged[0] = (converged[0] or loop.time()) if len(complete) == n else None
            if ev.kind == "dead":
                deaths.setdefault(ev.member.id, {}).setdefault(observer, loop.time())
                if ev.member.id not in net.dead:
                    false.add((ev.member.id, ev.member.incarnation))

        return on

    for i in ids:
        net.members[i].add_listener(listener(i))
    started = loop.time()
    joined: list[float] = []

    async def join(i: str, at: float) -> None:
        await asyncio.sleep(at)  # a member starts as its process would: then joins at once
        net.members[i].start()
        await net.members[i].join(ids[0], spec.limit_s)
        joined.append(loop.time())

    net.members[ids[0]].start()
    offsets = spec.join_at or (0.0,) * (n - 1)
    joins = [asyncio.ensure_future(join(i, at)) for i, at in zip(ids[1:], offsets, strict=True)]

    try:
        await asyncio.gather(*joins)
        await until(lambda: converged[0] is not None, cfg.protocol_period / 4, spec.limit_s, "convergence (simulated)")
        at = converged[0]
        assert at is not None
        result.converge_s = round(at - started, 3)
        result.converge_after_joins_s = round(max(0.0, at - max(joined)), 3)
        if not spec.watch_s:
            net.slow = {i: spec.slow_s for i in slowed}
        if spec.kill:
            victim = rng.choice([i for i in ids[1:] if i not in slowed])
            net.dead.add(victim)
            killed = loop.time()
            await net.members[victim].stop()
            live = [i for i in ids if i != victim]
            await until(
                lambda: len(deaths.get(victim, {})) >= len(live),
                cfg.protocol_period / 4,
                spec.limit_s,
                "detection (simulated)",
            )
            seen = deaths[victim]
            result.detect_first_s = round(min(seen.values()) - killed, 3)
            result.detect_all_s = round(max(seen.values()) - killed, 3)
            result.detect_spread_s = round(result.detect_all_s - result.detect_first_s, 3)
        if spec.watch_s:
            false.clear()
            net.slow = {i: spec.slow_s for i in slowed}
            suspicions_before = sum(m.stats().suspicions_raised for m in net.members.values())
            net.link = Link.of_profile(spec.watch_profile or spec.profile, spec.transport)
            await asyncio.sleep(spec.watch_s)
            result.suspicions = sum(m.stats().suspicions_raised for m in net.members.values()) - suspicions_before
    finally:
        for j in joins:
            j.cancel()
        for m in net.members.values():
            await m.stop()
        for t in list(net.handling):
            t.cancel()
        await asyncio.gather(*net.handling, return_exceptions=True)
    result.virtual_s = round(loop.time() - started, 3)
    result.false_deaths = len(false)
    member_hours = (n - len(net.dead)) * spec.watch_s / 3600
    result.false_deaths_per_member_hour = round(len(false) / member_hours, 3) if member_hours else None
    result.refuted = sum(m.stats().refuted_about_me for m in net.members.values())
    member_s = n * result.virtual_s
    result.messages_per_member_s = round(sum(t.messages for t in net.traffic.values()) / member_s, 2)
    result.bytes_per_member_s = round(sum(t.bytes for t in net.traffic.values()) / member_s, 1)
    return result


async def _cancel_the_rest() -> None:
    """Cancel what is left on the loop (a probe's helpers, cancelled as their member stopped)."""
    left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in left:
        t.cancel()
    await asyncio.gather(*left, return_exceptions=True)


def simulate(spec: SimSpec) -> SimResult:
    """One run on a fresh virtual loop (``random`` seeded from ``spec.seed``: ``swim`` draws its
    probe order and helpers from the module, the network from its own generator)."""
    if spec.members < 2:
        raise ValueError(f"members must be at least 2, got {spec.members}")
    if spec.join_at and (len(spec.join_at) != spec.members - 1 or min(spec.join_at) < 0):
        raise ValueError(
            f"join_at has {len(spec.join_at)} offsets (min {min(spec.join_at):g} s): expected one per member "
            f"but the first, {spec.members - 1}, none negative"
        )
    wall = time.monotonic()
    result = run_virtual(_run(spec, random.Random(spec.seed)), spec.seed)
    result.wall_s = round(time.monotonic() - wall, 3)
    return result

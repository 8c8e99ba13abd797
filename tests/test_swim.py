"""Membership rules and configuration, in one process (the cross-process behaviour is in test_membership)."""

from __future__ import annotations

import asyncio
import inspect
import math
import re
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

import pytest

from pytest_ppsmoke.network.swimsim import VirtualLoop, member_id, run_virtual
from pytest_ppsmoke.protocol import stage_names
from pytest_ppsmoke.runtime.codec import (
    Ack,
    ActorAddress,
    Envelope,
    ErrorReply,
    MemberState,
    MemberStatus,
    Message,
    Ping,
    SwimTiming,
)
from pytest_ppsmoke.runtime.node import Node, NodeConfig
from pytest_ppsmoke.runtime.swim import SWIM_ACTOR, MemberEvent, Membership
from pytest_ppsmoke.runtime.swimconfig import SwimConfig
from pytest_ppsmoke.runtime.swimqueue import Broadcasts

from .helpers import cluster_configs

pytestmark = pytest.mark.local


async def test_the_event_stream_reports_join_update_and_leave(nodes) -> None:
    seed_cfg, a_cfg = cluster_configs(2)
    seed = await nodes(seed_cfg)
    events = seed.membership.events()
    a_cfg.seed = seed.ticket()
    a = await nodes(a_cfg)
    first = await asyncio.wait_for(anext(events), 5)
    assert (first.kind, first.member.id, first.member.status) == ("joined", a.id, MemberStatus.alive)
    a.register("pp-exit", "node")
    second = await asyncio.wait_for(anext(events), 5)
    assert (second.kind, second.member.names) == ("updated", {"pp-exit": "node"})
    await a.close()
    third = await asyncio.wait_for(anext(events), 5)
    assert (third.kind, third.member.id, third.member.names) == ("dead", a.id, {})
    await events.aclose()


async def test_incarnation_rules(nodes) -> None:
    node = await nodes(NodeConfig.generate())  # no allowlist: any member id is accepted
    m = node.membership
    other = NodeConfig.generate().id
    m.merge([MemberState(other, MemberStatus.alive, 3, ("127.0.0.1:1",))])
    m.merge([MemberState(other, MemberStatus.suspect, 2)])  # older news: ignored
    assert m.get(other).status == MemberStatus.alive  # type: ignore[union-attr]
    m.merge([MemberState(other, MemberStatus.suspect, 3)])
    assert m.get(other).status == MemberStatus.suspect  # type: ignore[union-attr]
    m.merge([MemberState(other, MemberStatus.alive, 3)])  # the same incarnation cannot refute
    assert m.get(other).status == MemberStatus.suspect  # type: ignore[union-attr]
    m.merge([MemberState(other, MemberStatus.alive, 4)])
    assert m.get(other).status == MemberStatus.alive  # type: ignore[union-attr]
    m.merge([MemberState(other, MemberStatus.dead, 4)])
    m.merge([MemberState(other, MemberStatus.alive, 4)])  # a stale alive does not resurrect
    assert m.get(other).status == MemberStatus.dead  # type: ignore[union-attr]
    # news of our own death is refuted with a higher incarnation
    m.merge([MemberState(node.id, MemberStatus.dead, m.me.incarnation)])
    assert m.me.status == MemberStatus.alive and m.me.incarnation == 1


async def test_a_member_whose_addresses_change_announces_them_with_a_new_incarnation(nodes) -> None:
    """What a node in internet mode does when its endpoint's addresses change (a relay came, a
    NAT's port was learned): the others learn the new addresses, the transport's book with them."""
    seed_cfg, a_cfg = cluster_configs(2)
    seed = await nodes(seed_cfg)
    a_cfg.seed = seed.ticket()
    a = await nodes(a_cfg)
    before = a.membership.me
    moved = ("203.0.113.7:41234", *before.addrs)
    a.membership.set_addrs(moved, None)
    assert (a.membership.me.incarnation, a.membership.me.addrs) == (before.incarnation + 1, moved)
    a.membership.set_addrs(moved, None)  # nothing changed: no new incarnation
    assert a.membership.me.incarnation == before.incarnation + 1

    def learned() -> bool:
        seen = seed.membership.get(a.id)
        return seen is not None and seen.addrs == moved and seen.incarnation == before.incarnation + 1

    await seed.membership.wait_until(learned, 10, "the seed learned the new addresses")
    assert seed.transport._book[a.id].addrs == moved


def test_swim_config_errors_name_the_setting() -> None:
    with pytest.raises(ValueError, match=r"ping_timeout \(0.5\) must be shorter than protocol_period \(0.25\)"):
        SwimConfig(ping_timeout=0.5)
    with pytest.raises(ValueError, match="SWIM suspicion_timeout must be positive, got 0"):
        SwimConfig(suspicion_timeout=0)
    with pytest.raises(ValueError, match="bad SWIM setting 'suspicion=3'; expected name=value with name in"):
        SwimConfig().with_overrides("suspicion=3")
    with pytest.raises(ValueError, match="SWIM setting indirect_checks needs a number, got 'two'"):
        SwimConfig().with_overrides("indirect_checks=two")
    cfg = SwimConfig().with_overrides("suspicion_timeout=3, indirect_checks=4")
    assert (cfg.suspicion_timeout, cfg.indirect_checks) == (3.0, 4)
    assert SwimConfig.wan().protocol_period > SwimConfig.loopback().protocol_period
    with pytest.raises(ValueError, match=r"SWIM suspicion_max_mult must be at least 1 .* got 0.5"):
        SwimConfig(suspicion_max_mult=0.5)
    with pytest.raises(ValueError, match=r"SWIM awareness_max must be a whole number >= 1, got 2\.5"):
        SwimConfig(awareness_max=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="SWIM awareness_max must be positive, got 0"):
        SwimConfig().with_overrides("awareness_max=0")
    for preset in (SwimConfig.loopback(), SwimConfig.shared_cpu(), SwimConfig.wan()):  # PP_SWIM carries every knob
        assert SwimConfig().with_overrides(preset.to_env()) == preset
    tuned = SwimConfig().with_overrides("suspicion_max_mult=6,awareness_max=4")
    assert (tuned.suspicion_max_mult, tuned.awareness_max) == (6.0, 4)
    assert tuned.suspicion_bounds(3) == (2.0, 12.0) and tuned.suspicion_bounds(100) == (4.0, 24.0)


def test_node_environment_is_validated_without_echoing_the_key() -> None:
    key = "ab" * 31 + "zz"
    with pytest.raises(ValueError, match="PP_NODE_KEY must be 64 hex characters") as info:
        NodeConfig.from_env({"PP_NODE_KEY": key})
    assert key not in str(info.value)
    good = "cd" * 32
    with pytest.raises(ValueError, match="PP_TRANSPORT must be 'local' or 'wan', got 'lan'"):
        NodeConfig.from_env({"PP_NODE_KEY": good, "PP_TRANSPORT": "lan"})
    with pytest.raises(ValueError, match="PP_ALLOWED_IDS entry 'xyz' is not an endpoint id"):
        NodeConfig.from_env({"PP_NODE_KEY": good, "PP_ALLOWED_IDS": "xyz"})
    with pytest.raises(ValueError, match="PP_JOIN_TIMEOUT must be a positive number of seconds, got 'soon'"):
        NodeConfig.from_env({"PP_NODE_KEY": good, "PP_JOIN_TIMEOUT": "soon"})
    cfg = NodeConfig.from_env({"PP_NODE_KEY": good, "PP_TRANSPORT": "wan", "PP_SWIM": "suspicion_timeout=9"})
    assert not cfg.local and cfg.swim.suspicion_timeout == 9.0 and cfg.swim.protocol_period == 1.0
    assert good not in repr(cfg)


def test_stage_names_follow_the_design() -> None:
    assert stage_names(0, 2) == ["pp-entry", "pp-stage-0"]
    assert stage_names(1, 2) == ["pp-exit", "pp-stage-1"]
    assert stage_names(1, 3) == ["pp-stage-1"]
    with pytest.raises(ValueError, match=r"stage 2 is outside 0..1"):
        stage_names(2, 2)


async def test_a_member_restarted_with_the_same_key_republishes_its_state(nodes) -> None:
    seed_cfg, a_cfg = cluster_configs(2)
    seed = await nodes(seed_cfg)
    a_cfg.seed = seed.ticket()
    old = await nodes(a_cfg)
    old.register("pp-exit", "node")
    await seed.resolve("pp-exit", 5)
    # the process dies without leaving: its alive state (names, address) stays at the seed
    await old.membership.stop()
    await old.transport.close()
    new = await nodes(a_cfg)
    new.register("pp-stage-1", "node")
    await seed.resolve("pp-stage-1", 5)
    state = seed.membership.get(new.id)
    assert state is not None and state.names == {"pp-stage-1": "node"}
    assert state.addrs == new.transport.addr().addrs
    assert new.membership.me.incarnation > 1  # it outbid its previous life


# --- Lifeguard, on an in-memory network and a virtual clock -----------------------------------


def on_virtual_clock(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """Run the test on a virtual clock (``swimsim.run_virtual``): its pings time out, its
    periods and suspicions pass in virtual seconds, so that what it asserts about them holds on
    a loaded machine as on an idle one, to the timer."""

    def run() -> None:
        run_virtual(test())

    run.__name__, run.__qualname__, run.__doc__ = test.__name__, test.__qualname__, test.__doc__
    return run


def now() -> float:
    """The running loop's clock: virtual under ``on_virtual_clock``, as ``swim`` reads it there."""
    return asyncio.get_running_loop().time()


def stalled_loop() -> VirtualLoop:
    loop = asyncio.get_running_loop()
    if not isinstance(loop, VirtualLoop):
        raise TypeError(f"a stall needs the virtual clock's loop, got {type(loop).__name__}")
    return loop


class SimNet:
    """Members that talk through the event loop instead of iroh: each message reaches its
    member after that member's ``delay`` (a starved event loop handles everything late), and a
    member that is ``down`` neither receives nor answers. What ``Membership`` needs of a node."""

    def __init__(self, config: SwimConfig, n: int) -> None:
        self.hosts = [SimHost(self, member_id(i + 1)) for i in range(n)]
        self.members = [Membership(h, config, (f"sim:{i}",), None) for i, h in enumerate(self.hosts)]
        for h, m in zip(self.hosts, self.members, strict=True):
            h.membership = m
        for m in self.members:  # everybody knows everybody, as after a join
            m.merge([o.me for o in self.members if o is not m])

    def host(self, member_id: str) -> SimHost:
        return next(h for h in self.hosts if h.id == member_id)

    def deliver(self, src: SimHost, dst_id: str, msg: Message, reply: asyncio.Future[Message] | None) -> None:
        dst = self.host(dst_id)
        if src.down or dst.down:
            return
        asyncio.get_running_loop().call_later(dst.delay, self._handle, src, dst, msg, reply)

    def _handle(self, src: SimHost, dst: SimHost, msg: Message, reply: asyncio.Future[Message] | None) -> None:
        if dst.down:
            return
        handler = getattr(dst.membership, "on_" + re.sub(r"(?<!^)(?=[A-Z])", "_", type(msg).__name__).lower())
        result = handler(msg, SimContext(ActorAddress(src.id, SWIM_ACTOR)))
        if reply is None:
            return
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(result)
            src.tasks.add(task)
            task.add_done_callback(lambda t: self._answer(dst, src, t.result(), reply) if not t.cancelled() else None)
        elif result is not None:
            self._answer(dst, src, result, reply)

    def _answer(self, dst: SimHost, src: SimHost, result: Message, reply: asyncio.Future[Message]) -> None:
        if src.down or dst.down:
            return

        def arrive() -> None:
            if not reply.done():
                reply.set_result(result)
            else:  # the requester gave up: what a node does with a late reply
                src.membership.on_late_reply(result, SimContext(ActorAddress(dst.id, SWIM_ACTOR)))

        asyncio.get_running_loop().call_later(src.delay, arrive)

    async def run(self) -> None:
        for m in self.members:
            m.start()

    async def stop(self) -> None:
        for h in self.hosts:
            await h.membership.stop()
            for t in h.tasks:
                t.cancel()


@dataclass(frozen=True)
class SimContext:
    sender: ActorAddress


class SimHost:
    def __init__(self, net: SimNet, member_id: str) -> None:
        self.net, self.id = net, member_id
        self.delay, self.down = 0.0, False
        self.membership: Membership
        self.tasks: set[asyncio.Task[object]] = set()
        self.timeouts: list[float] = []  # of every Ping this member sent
        self.stall = 0.0  # seconds this member's own event loop blocks while its next request waits

    @property
    def transport(self) -> SimHost:
        return self

    def is_allowed(self, peer_id: str) -> bool:
        return True

    def forget(self, peer_id: str) -> None:
        pass

    def address(self, actor: str, node: str | None = None) -> ActorAddress:
        return ActorAddress(node or self.id, actor)

    def learn(self, m: MemberState) -> None:
        pass

    def send_nowait(self, to: ActorAddress, msg: Message, timeout: float, sender: str = "") -> None:
        self.net.deliver(self, to.node, msg, None)

    async def request(
        self, to: ActorAddress, msg: Message, timeout: float | None = None, *, sender: str = ""
    ) -> Message:
        if isinstance(msg, Ping):
            self.timeouts.append(timeout or 0.0)
        reply: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self.net.deliver(self, to.node, msg, reply)
        try:
            async with asyncio.timeout(timeout):
                if self.stall:  # our own loop blocks (a busy core): the deadline passes meanwhile
                    stalled_loop().block(self.stall)
                    self.stall = 0.0
                return await asyncio.shield(reply)
        except TimeoutError:
            reply.cancel()
            raise TimeoutError(f"no reply from {to.node[:10]} to {type(msg).__name__} within {timeout} s") from None


FAST = SwimConfig(protocol_period=0.05, ping_timeout=0.02, suspicion_timeout=0.3, suspicion_max_mult=6.0)


@on_virtual_clock
async def test_awareness_rises_when_our_probes_fail_stretches_them_and_falls_on_success() -> None:
    net = SimNet(replace(FAST, suspicion_timeout=60.0), 3)
    me, b, c = net.hosts
    m = me.membership
    try:
        # the target is down but the helper can tell: its Nack shows the fault is not ours
        b.down = True
        await m._probe(b.id, now() + FAST.protocol_period)
        assert m.awareness == 0 and m.get(b.id).status == MemberStatus.suspect  # type: ignore[union-attr]
        assert m.stats().suspicions_raised == 1
        b.down = False
        # we are cut off: neither the Ack nor the helper's Nack comes, each failed probe costs us
        me.down = True
        for expected in range(1, FAST.awareness_max + 2):
            await m._probe(c.id, now() + m.probe_interval)
            assert m.awareness == min(expected, FAST.awareness_max - 1)
            assert me.timeouts[-1] == pytest.approx(
                FAST.ping_timeout * min(expected, FAST.awareness_max)
            )  # the ping waited longer each time
        assert m.probe_interval == pytest.approx(FAST.protocol_period * FAST.awareness_max)
        assert m.probe_timeout == pytest.approx(FAST.ping_timeout * FAST.awareness_max)
        me.down = False
        for expected in range(FAST.awareness_max - 2, -1, -1):  # every answered probe heals one step
            await m._probe(c.id, now() + m.probe_interval)
            assert m.awareness == expected
        assert m.probe_interval == FAST.protocol_period and m.stats().awareness == 0
    finally:
        await net.stop()


@on_virtual_clock
async def test_a_probe_that_fails_because_our_own_loop_stalled_blames_us_not_the_target() -> None:
    """Two members, no helper to ask: the target answered at once, but our loop was blocked past
    the ping's deadline, so the timeout fired (late) before the Ack was read. Local health counts
    it; the healthy target is not suspected. Only once per target until it answers again: a
    second stall in a row is a failed probe like any other, so that a dead member on a loaded
    machine is still found, one probe later."""
    net = SimNet(replace(FAST, suspicion_timeout=60.0), 2)
    me, other = net.hosts
    m = me.membership
    try:
        me.stall = 5 * FAST.ping_timeout
        await m._probe(other.id, now() + FAST.protocol_period)
        assert m.get(other.id).status == MemberStatus.alive  # type: ignore[union-attr]
        assert (m.stats().stalls_excused, m.stats().suspicions_raised, m.awareness) == (1, 0, 1)
        me.stall = 5 * m.probe_timeout  # stalled again, before the target answered once: no second excuse
        await m._probe(other.id, now() + m.probe_interval)
        assert m.get(other.id).status == MemberStatus.suspect  # type: ignore[union-attr]
        assert (m.stats().stalls_excused, m.stats().suspicions_raised) == (1, 1)
        # once it answers, a later stall is excused again; a target that does not answer, on time, is not
        net2 = SimNet(replace(FAST, suspicion_timeout=60.0), 2)
        me2, other2 = net2.hosts
        m2 = me2.membership
        await m2._probe(other2.id, now() + FAST.protocol_period)  # an Ack
        me2.stall = 5 * FAST.ping_timeout
        await m2._probe(other2.id, now() + FAST.protocol_period)
        assert (m2.stats().stalls_excused, m2.stats().suspicions_raised) == (1, 0)
        await m2._probe(other2.id, now() + m2.probe_interval)  # an Ack: the excuse is spent
        other2.down = True
        await m2._probe(other2.id, now() + m2.probe_interval)
        assert (m2.stats().stalls_excused, m2.stats().suspicions_raised) == (1, 1)
        await net2.stop()
    finally:
        await net.stop()


@on_virtual_clock
async def test_a_stall_our_loop_watch_measured_lowers_our_own_local_health() -> None:
    """Lifeguard's local health awareness fed by the node's own loop watch: a measured stall
    stretches our probes (+1 on the score), and an answered probe heals it again."""
    net = SimNet(replace(FAST, suspicion_timeout=60.0), 2)
    me, other = net.hosts
    m = me.membership
    try:
        m.loop_stalled(0.5)
        assert m.awareness == 1 and m.probe_timeout == pytest.approx(2 * FAST.ping_timeout)
        assert m.stats().suspicions_raised == 0  # it blames nobody
        await m._probe(other.id, now() + m.probe_interval)  # an Ack
        assert m.awareness == 0
    finally:
        await net.stop()


@on_virtual_clock
async def test_confirmations_shorten_a_suspicion_toward_its_minimum() -> None:
    cfg = replace(FAST, indirect_checks=3)
    net = SimNet(cfg, 5)
    m = net.members[0]
    x, a, b, c = (h.id for h in net.hosts[1:])
    lo, hi = cfg.suspicion_bounds(5)
    assert (lo, hi) == (pytest.approx(0.3), pytest.approx(1.8))
    try:
        started = now()
        events: list[MemberEvent] = []
        m.add_listener(events.append)
        m.merge([MemberState(x, MemberStatus.suspect, 0)], a)  # the first accuser: the maximum
        assert m.suspicion_timeout_of(x) == pytest.approx(hi)
        for again in (a, x, None):  # the same accuser, the suspect itself, a full state: no confirmation
            m.merge([MemberState(x, MemberStatus.suspect, 0)], again)
        assert m.suspicion_timeout_of(x) == pytest.approx(hi)
        m.merge([MemberState(x, MemberStatus.suspect, 0)], b)  # 1 of k=3
        assert m.suspicion_timeout_of(x) == pytest.approx(hi - (hi - lo) * math.log(2) / math.log(4))
        m.merge([MemberState(x, MemberStatus.suspect, 0)], c)  # 2 of 3
        assert m.suspicion_timeout_of(x) == pytest.approx(hi - (hi - lo) * math.log(3) / math.log(4))
        net.host(x).down = True
        await m._probe(x, now() + cfg.protocol_period)  # our own failed probe: 3 of 3
        assert m.suspicion_timeout_of(x) == pytest.approx(lo)
        assert m.stats().confirmations == 3
        assert x in {u.id for u in m._piggyback()}, "our own accusation is passed on"
        await m.wait_until(lambda: m.get(x).status == MemberStatus.dead, hi, "the confirmed suspect dead")  # type: ignore[union-attr]
        assert now() - started == pytest.approx(lo)  # dead at the shortened suspicion's end, not later
        assert [e.kind for e in events] == ["suspect", "dead"] and m.stats().deaths_declared == 1
        # with no one else to confirm (two members) a suspicion runs its minimum at once
        pair = SimNet(cfg, 2)
        pair.members[0].merge([MemberState(pair.hosts[1].id, MemberStatus.suspect, 0)], None)
        assert pair.members[0].suspicion_timeout_of(pair.hosts[1].id) == pytest.approx(lo)
        await pair.stop()
    finally:
        await net.stop()


@on_virtual_clock
async def test_a_starved_member_does_not_declare_healthy_members_dead() -> None:
    net = SimNet(FAST, 3)
    slow, b, c = net.hosts
    lo, hi = FAST.suspicion_bounds(3)
    slow.delay = (lo + hi) / 3  # it hears everything later than the shortest suspicion: 0.7 s
    peak = 0
    try:
        await net.run()
        deadline = now() + hi + slow.delay  # a suspicion raised at the start has run out by then
        while now() < deadline:
            peak = max(peak, slow.membership.awareness)
            await asyncio.sleep(0.05)
        st = slow.membership.stats()
        assert st.suspicions_raised > 0 and st.suspicions_refuted > 0, st  # it did blame them, and heard back
        assert st.deaths_declared == 0, f"the slow member declared healthy members dead: {st}"
        assert all(slow.membership.get(h.id).status != MemberStatus.dead for h in (b, c))  # type: ignore[union-attr]
        assert peak == FAST.awareness_max - 1
        for healthy in (b, c):  # nor did they declare each other dead (a missed 20 ms ping on a busy box is no death)
            assert healthy.membership.get((c if healthy is b else b).id).status != MemberStatus.dead  # type: ignore[union-attr]
        slow.delay = 0.0
        await slow.membership.wait_until(lambda: slow.membership.awareness == 0, 10, "the slow member healed")
    finally:
        await net.stop()


@on_virtual_clock
async def test_a_dead_member_is_declared_dead_within_the_documented_bound() -> None:
    net = SimNet(FAST, 3)
    me, other, victim = net.hosts
    try:
        await net.run()
        await asyncio.sleep(4 * FAST.protocol_period)  # a few healthy rounds first
        events: list[MemberEvent] = []
        me.membership.add_listener(events.append)
        victim.down = True
        killed = now()
        bound = FAST.detection_bound(3)  # confirmed by the other live member
        await me.membership.wait_until(
            lambda: me.membership.get(victim.id).status == MemberStatus.dead,  # type: ignore[union-attr]
            bound,
            "the victim dead",
        )
        assert now() - killed >= FAST.suspicion_timeout  # not before its suspicion could be refuted
        assert [e.kind for e in events if e.member.id == victim.id] == ["suspect", "dead"]
        assert other.membership.get(victim.id).status != MemberStatus.alive  # type: ignore[union-attr]
    finally:
        await net.stop()


@on_virtual_clock
async def test_a_suspicion_that_ran_out_while_our_loop_stalled_waits_for_what_came_meanwhile() -> None:
    net = SimNet(FAST, 2)  # nobody else to confirm: the minimum suspicion
    m, x = net.members[0], net.hosts[1].id
    try:
        m.merge([MemberState(x, MemberStatus.suspect, 0)])
        loop = asyncio.get_running_loop()
        # its refutation arrived during the stall, two steps from being handled (read, dispatch)
        loop.call_soon(lambda: loop.call_soon(m.merge, [MemberState(x, MemberStatus.alive, 1)]))
        stalled_loop().block(FAST.suspicion_timeout + 0.1)  # our loop runs nothing past the deadline
        await asyncio.sleep(3 * FAST.ping_timeout)
        assert m.get(x).status == MemberStatus.alive, m.stats()  # type: ignore[union-attr]
        assert m.stats().deaths_declared == 0 and m.stats().suspicions_refuted == 1
        assert m.awareness == 1  # the stall counts against our own health
    finally:
        await net.stop()


def test_a_reply_after_its_request_gave_up_goes_to_the_actor_that_asked() -> None:
    node = Node(NodeConfig.generate())  # not started: dispatch alone
    got: list[tuple[Message, str]] = []

    class Asker:
        def on_late_reply(self, msg: Message, ctx: SimContext) -> None:
            got.append((msg, ctx.sender.node))

    node.actors[SWIM_ACTOR] = Asker()
    peer = NodeConfig.generate().id
    late = Ack(1, (MemberState(peer, MemberStatus.alive, 2),))
    node._dispatch(peer, Envelope(SWIM_ACTOR, SWIM_ACTOR, 99, True), late)  # corr 99: nobody waits any more
    node._dispatch(peer, Envelope("other", SWIM_ACTOR, 98, True), late)  # an actor without the hook: dropped
    node._dispatch(peer, Envelope(SWIM_ACTOR, SWIM_ACTOR, 97, True), ErrorReply("x", "y"))  # errors: dropped
    assert got == [(late, peer)]


@on_virtual_clock
async def test_a_member_takes_a_longer_swim_timing_and_refuses_a_shorter_one() -> None:
    """The orchestrator's ``SwimTiming`` to a member's SWIM actor: a longer probe timeout and period
    are taken (the next probe waits the new timeout), a shorter one is refused, each field on its
    own; the answer is the timing the member runs with; a value that is not a timing is an error."""
    net = SimNet(FAST, 2)
    orch, node = net.hosts
    m = node.membership
    to = ActorAddress(node.id, SWIM_ACTOR)
    try:
        assert await orch.request(to, SwimTiming(0.04, 0.1), 1.0) == SwimTiming(0.04, 0.1)
        assert (m.config.ping_timeout, m.config.protocol_period) == (0.04, 0.1)
        assert (m.probe_timeout, m.probe_interval) == (0.04, 0.1)
        await m._probe(orch.id, now() + m.probe_interval)
        assert node.timeouts[-1] == 0.04  # the ping waited the new timeout
        assert await orch.request(to, SwimTiming(0.03, 0.08), 1.0) == SwimTiming(0.04, 0.1)  # shorter: refused
        assert (m.probe_timeout, m.probe_interval) == (0.04, 0.1)
        assert m.retime(0.06, 0.08) and (m.config.ping_timeout, m.config.protocol_period) == (0.06, 0.1)
        assert not m.retime(0.06, 0.1) and not m.retime(0.01, 0.02)
        assert replace(m.config, ping_timeout=FAST.ping_timeout, protocol_period=FAST.protocol_period) == FAST
        with pytest.raises(ValueError, match=r"ping_timeout 0\.2 s with protocol_period 0\.1 s; expected a timeout"):
            m.retime(0.2, 0.1)
        with pytest.raises(ValueError, match="SWIM timing ping_timeout must be a positive number of seconds, got 0"):
            m.retime(0, 0.1)
        with pytest.raises(ValueError, match="protocol_period must be a positive number of seconds, got nan"):
            m.retime(0.1, math.nan)
        assert (m.config.ping_timeout, m.config.protocol_period) == (0.06, 0.1)
    finally:
        await net.stop()


@on_virtual_clock
async def test_probing_a_suspect_tells_it_and_its_ack_refutes() -> None:
    net = SimNet(replace(FAST, suspicion_timeout=60.0), 2)
    m, suspect = net.members
    x = suspect.me.id
    try:
        m.merge([MemberState(x, MemberStatus.suspect, 0)])  # heard from someone else: x does not know
        await m._probe(x, now() + FAST.protocol_period)  # the ping carries the suspicion
        assert suspect.me.incarnation == 1 and suspect.stats().refuted_about_me == 1
        assert m.get(x).status == MemberStatus.alive and m.stats().suspicions_refuted == 1  # type: ignore[union-attr]
        # a prober that still suspects x after x's refutation left its queue gets x's alive state back
        suspect._queue.clear()
        ack = suspect.on_ping(Ping(7, (MemberState(x, MemberStatus.suspect, 0),)), SimContext(m.node.address("swim")))
        assert ack is not None and suspect.me in ack.updates
    finally:
        await net.stop()


def test_the_broadcast_queue_sends_the_least_sent_first_and_each_update_its_count() -> None:
    q = Broadcasts()
    a, b, c = (MemberState(f"{i:064x}", MemberStatus.alive, 0) for i in range(3))
    q.put(a, 2)
    q.put(b, 3)
    q.put(c, 2)
    assert q.take(2) == (b, a)  # most transmissions left first; among equals, the oldest
    assert q.take(2) == (c, b)  # b and a now have 2 and 1 left; c was next at 2
    q.put(replace(a, incarnation=1), 1)  # a newer update replaces the queued one
    assert len(q) == 3
    sent = [m for _ in range(5) for m in q.take(3)]
    assert sent.count(b) == 1 and sent.count(c) == 1 and sent.count(replace(a, incarnation=1)) == 1
    assert a not in sent and len(q) == 0 and q.take(3) == ()


@on_virtual_clock
async def test_the_members_a_member_probes_and_gossips_to_follow_joins_deaths_and_returns() -> None:
    net = SimNet(FAST, 2)
    m = net.members[0]
    ids = [f"{i:064x}" for i in range(1, 6)]

    def expected() -> list[str]:
        return [i for i, s in m.members.items() if s.status != MemberStatus.dead and i != m.me.id]

    try:
        assert m._others() == expected()
        steps = [MemberState(i, MemberStatus.alive, 0) for i in ids]  # joins
        steps += [MemberState(ids[1], MemberStatus.suspect, 0), MemberState(ids[2], MemberStatus.dead, 0)]
        steps += [MemberState(ids[2], MemberStatus.alive, 1), MemberState(ids[0], MemberStatus.dead, 0)]
        for u in steps:
            m.merge([u])
            assert sorted(m._others()) == sorted(expected()), u
        probed = {m._next_target() for _ in range(len(expected()))}  # one round: each live member once
        assert probed == set(expected()) and ids[0] not in probed
    finally:
        await net.stop()


@on_virtual_clock
async def test_a_member_learnt_mid_round_is_probed_in_that_round() -> None:
    """As memberlist does: a new member takes a random place in the current round, instead of
    waiting a whole round (N probe periods) to be probed at all."""
    net = SimNet(FAST, 5)
    m = net.members[0]
    try:
        first = m._next_target()  # the round begins: the 4 others, in random order
        newcomer = MemberState(f"{99:064x}", MemberStatus.alive, 0)
        m.merge([newcomer])
        rest = [m._next_target() for _ in range(len(m._probe_order))]
        assert newcomer.id in rest and sorted([first, *rest]) == sorted(m._others())
    finally:
        await net.stop()

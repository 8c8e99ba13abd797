"""SWIM's own ``Membership`` at scale on a virtual clock (``network/swimsim.py``): the small-N
cases of ``bench/bench_swim_scale.py``, which runs up to a thousand members."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import types

import pytest

from pytest_ppsmoke.network.swimsim import (
    Link,
    SimNet,
    SimSpec,
    VirtualLoop,
    member_id,
    memberlist_figures,
    run_virtual,
    simulate,
    virtual_loop,
)
from pytest_ppsmoke.runtime import swim
from pytest_ppsmoke.runtime.codec import Ack, Envelope, Gossip, MemberState, Ping, PingReq, Sync, encode_frame
from pytest_ppsmoke.runtime.swimconfig import SwimConfig

pytestmark = pytest.mark.local

LIFEGUARD_OFF = dataclasses.replace(SwimConfig.wan(), awareness_max=1, suspicion_max_mult=1.0)


def test_the_virtual_clock_runs_timers_in_order_without_waiting() -> None:
    """A loop on the virtual selector: an hour of sleeps ends at the hour, in order."""
    loop = virtual_loop()
    seen: list[tuple[str, float]] = []

    async def sleeper(name: str, s: float) -> None:
        await asyncio.sleep(s)
        seen.append((name, loop.time()))

    async def main() -> None:
        await asyncio.gather(sleeper("hour", 3600), sleeper("second", 1), sleeper("minute", 60))

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert seen == [("second", 1.0), ("minute", 60.0), ("hour", 3600.0)]
    assert swim.time.monotonic is not loop.time  # the swim module's clock is the real one outside a run


def test_a_blocked_virtual_loop_runs_what_fell_due_late_in_order_and_run_virtual_cleans_up() -> None:
    """``VirtualLoop.block``: the clock moves on and nothing runs meanwhile, then what fell due
    runs late, in its order, as on a real loop that a busy core held; ``swim`` reads that clock
    during ``run_virtual``, whose leftover tasks are cancelled and whose ``random`` is seeded."""
    seen: list[tuple[str, float]] = []
    left: list[asyncio.Task[None]] = []

    async def main() -> float:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualLoop) and swim.time.monotonic() == loop.time() == 0.0
        loop.call_later(0.2, lambda: seen.append(("second", loop.time())))
        loop.call_later(0.1, lambda: seen.append(("first", loop.time())))
        loop.block(0.5)
        assert seen == []  # blocked: nothing ran
        await asyncio.sleep(0)
        left.append(asyncio.ensure_future(asyncio.sleep(3600)))
        with pytest.raises(ValueError, match="a blocked loop's seconds must be 0 or more, got -1"):
            loop.block(-1)
        return random.random()

    drawn = run_virtual(main(), seed=5)
    assert seen == [("first", 0.5), ("second", 0.5)]
    assert left[0].cancelled() and drawn == random.Random(5).random()
    assert isinstance(swim.time, types.ModuleType)  # the real clock again


@pytest.mark.parametrize("members", [10, 30])
def test_members_converge_and_a_killed_one_is_declared_dead_by_all_within_the_bound(members: int) -> None:
    """On wan's links: every join seen by every member, then a member killed is declared dead by
    every live member, the first within the detection bound's expected figure and all within
    the bound itself; no live member is declared dead meanwhile or over a watched minute."""
    r = simulate(SimSpec(members=members, profile="wan", config=SwimConfig.wan(), watch_s=60))
    bounds = memberlist_figures(members, SwimConfig.wan())
    assert r.converge_s is not None and r.converge_s < SwimConfig.wan().sync_interval + 1
    assert r.detect_first_s is not None and r.detect_all_s is not None
    lo, _ = SwimConfig.wan().suspicion_bounds(members)
    assert lo <= r.detect_first_s <= bounds["detection_bound_s"]
    assert r.detect_first_s <= r.detect_all_s <= bounds["detection_bound_s"]
    assert r.false_deaths == 0 and r.messages_per_member_s > 0 and r.bytes_per_member_s > 0


def test_lifeguard_cuts_false_deaths_under_loss_and_slow_members() -> None:
    """flaky's correlated 20% loss, one member in ten slow to answer: the same run with
    Lifeguard's local health and dynamic suspicion turned off (``awareness_max=1``,
    ``suspicion_max_mult=1``) declares live members dead several times as often."""
    spec = SimSpec(members=20, slowed=0.1, slow_s=1.0, kill=False, watch_s=300, watch_profile="flaky")
    on, off = simulate(spec), simulate(dataclasses.replace(spec, config=LIFEGUARD_OFF))
    assert on.converge_s is not None and off.converge_s is not None
    assert off.false_deaths >= 3 * max(1, on.false_deaths), (on.false_deaths, off.false_deaths)


def test_a_messages_bytes_are_its_wire_frame() -> None:
    """The byte count of a full state or a piggyback (built from each member's bytes, kept) is
    the length of the frame the codec writes."""
    net = SimNet(Link(), random.Random(1))
    states = tuple(MemberState(member_id(i), i % 3, i, ("10.0.0.1:7000",) if i % 2 else ()) for i in range(50))
    few = states[:16]
    messages = [Sync(states), Ping(3, few), Ack(3, few), Ack(4, ()), PingReq(5, member_id(9), few), Gossip(few)]
    for msg in messages:
        for corr, reply in ((7, True), (0, False)):
            exact = len(encode_frame(Envelope("swim", "swim", corr, reply), msg))
            assert net.size(msg, corr, reply) == exact == net.size(msg, corr, reply), msg


def test_bad_specs_are_named() -> None:
    with pytest.raises(ValueError, match="members must be at least 2, got 1"):
        simulate(SimSpec(members=1))
    with pytest.raises(ValueError, match="unknown network profile 'mars'; expected one of loopback, lan, wan"):
        Link.of_profile("mars")
    with pytest.raises(
        ValueError, match=r"join_at has 2 offsets \(min 0 s\): expected one per member but the first, 3"
    ):
        simulate(SimSpec(members=4, join_at=(0.0, 1.0)))


def test_a_replayed_join_schedule_starts_each_member_at_its_time() -> None:
    """Members that join late (a real run's schedule): convergence is counted from the last
    join's end, and the whole run from the first."""
    r = simulate(SimSpec(members=6, join_at=(0.0, 0.5, 1.0, 2.0, 7.5), kill=False))
    assert r.converge_s is not None and r.converge_after_joins_s is not None
    assert r.converge_s >= 7.5 + 0.04  # the last joiner's Join and the seed's Sync: a wan round trip at least
    assert r.converge_after_joins_s <= r.converge_s - 7.5


def test_a_reliable_transport_turns_loss_into_delay_and_opens_each_connection_first() -> None:
    """``quic``: the first request between two members pays the handshake (a round trip before
    its own way), unless its sender's deadline comes first; later ones and replies only their
    way, in order behind the frames before them; a lost packet arrives a probe timeout later,
    doubling, where ``datagram`` loses the message."""
    quic, datagram = Link(delay=0.02, retransmit_s=0.1), Link(delay=0.02)
    net = SimNet(quic, random.Random(1))
    assert net._transit("a", "b", 0.0, deadline=0.03) is None  # gave up before the handshake's round trip (0.04 s)
    assert net._transit("a", "b", 0.0) == pytest.approx(0.06)  # handshake there and back, then the request
    assert net._transit("a", "b", 1.0) == pytest.approx(0.02)
    assert net._transit("b", "a", 1.0, reply=True) == pytest.approx(0.02)  # on the request's connection
    assert net._transit("b", "a", 2.0) == pytest.approx(0.06)  # b's own requests dial their own
    lossy = SimNet(dataclasses.replace(quic, loss=0.5), random.Random(2))
    lossy._connected.add(("a", "b"))
    ways = [lossy._transit("a", "b", 10.0 * i) for i in range(400)]  # 10 s apart: none waits for another
    assert {round(w, 3) for w in ways if w is not None} >= {0.02, 0.12, 0.32}  # lost once, twice: 0.1 then 0.2 more
    assert sum(w is None for w in ways) < 10  # lost eight times in a row (1 in 256): the connection gives up
    held = [lossy._transit("a", "b", 5000.0) for _ in range(40)]  # sent together: in order, each behind the last
    landed = [w for w in held if w is not None]
    assert landed == sorted(landed) and max(landed) >= 0.12
    dropped = SimNet(dataclasses.replace(datagram, loss=0.5), random.Random(2))
    assert 150 < sum(dropped._transit("a", "b", 0.0) is None for _ in range(400)) < 250
    assert Link.of_profile("wan", "quic").retransmit_s == pytest.approx(2 * 0.02 + 4 * 0.002 + 0.025)
    with pytest.raises(ValueError, match="unknown transport 'tcp'; expected one of datagram, quic"):
        Link.of_profile("wan", "tcp")

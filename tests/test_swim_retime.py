"""SWIM re-timed at converge, on the orchestrator and on every node: the orchestrator's step
(``harness/reach.time_swim``) over members on an in-memory network with a round trip
(``network/swimsim``'s), each a real ``Membership``. It measures the round trips, raises its own
probe timeout and period, and tells every node; afterwards each node runs with at least the
orchestrator's timing, and the report's ``swim`` entry says what each one took."""

from __future__ import annotations

import dataclasses
import random
import types
from dataclasses import replace
from typing import Any

import jsonschema
import pytest

from pytest_ppsmoke.harness import reach
from pytest_ppsmoke.harness.figures import SwimFigures
from pytest_ppsmoke.harness.report import parse, schema
from pytest_ppsmoke.harness.runconfig import RunConfig, swim_for_rtt
from pytest_ppsmoke.network.swimsim import Link, SimHost, SimNet, member_id
from pytest_ppsmoke.protocol import stage_name
from pytest_ppsmoke.runtime.codec import Echo, Message
from pytest_ppsmoke.runtime.swim import Membership
from pytest_ppsmoke.runtime.swimconfig import SwimConfig

pytestmark = pytest.mark.local

ONE_WAY = 0.12  # seconds each message takes on the link: a round trip of 0.24 s, more than wan()'s timeout covers


class Actors:
    """A member's actors on the in-memory network: its SWIM actor and the node actor's ``Echo``,
    which the orchestrator times (the network hands a message to whichever handler its type names)."""

    def __init__(self, membership: Membership) -> None:
        self.membership = membership

    def __getattr__(self, name: str) -> Any:
        return getattr(self.membership, name)

    def on_echo(self, msg: Echo, ctx: object) -> Echo:
        return msg


class Member:
    """What the orchestrator's step needs of a node: ``request`` and ``membership``."""

    def __init__(self, net: SimNet, i: int, config: SwimConfig) -> None:
        self.host = SimHost(net, member_id(i))
        self.membership = Membership(self.host, config, (f"sim:{i}",), None)
        self.id = self.host.id
        net.members[self.id] = Actors(self.membership)  # type: ignore[assignment]

    async def request(self, to: Any, msg: Message, timeout: float | None = None, *, sender: str = "") -> Message:
        return await self.host.request(to, msg, timeout, sender=sender)


def as_reported(timing: dict[str, Any], seed: Member) -> None:
    """What the step measured, as the driver puts it in the report (the failure detector's counts
    added): every key and type a :class:`SwimFigures`, and valid as the schema's."""
    swim = parse(SwimFigures, {**timing, "stats": dataclasses.asdict(seed.membership.stats())})
    assert swim.nodes.keys() == timing["nodes"].keys() and swim.set_by == timing["set_by"]
    jsonschema.validate(dataclasses.asdict(swim), {"$defs": schema()["$defs"], "$ref": "#/$defs/SwimFigures"})


async def test_after_converge_every_node_runs_with_at_least_the_orchestrators_timing() -> None:
    config = RunConfig(transport="wan")
    start = config.swim  # what the nodes start with (their PP_SWIM), the orchestrator's too
    assert start.ping_timeout < 3 * 2 * ONE_WAY  # so the measured round trips ask for more
    net = SimNet(Link(delay=ONE_WAY), random.Random(7), count_bytes=False)
    seed = Member(net, 0, start)
    patient = replace(start, ping_timeout=5.0, protocol_period=10.0)  # started with more than any choice
    nodes = [Member(net, 1, start), Member(net, 2, start), Member(net, 3, patient)]
    instances = [
        types.SimpleNamespace(stage=i, endpoint_id=n.id, where=f"{stage_name(i)} on instance {i}")
        for i, n in enumerate(nodes)
    ]
    timing = await reach.time_swim(seed, instances, config)  # type: ignore[arg-type]

    assert timing["set_by"] == "the measured round trips"
    assert all(v >= 2 * ONE_WAY * 1e3 for v in timing["rtt_ms"].values())
    wanted = swim_for_rtt(timing["worst_rtt_ms"] / 1e3)  # the report's worst is rounded to 10 us
    chosen = seed.membership.config
    assert (chosen.ping_timeout, chosen.protocol_period) == pytest.approx(
        (wanted.ping_timeout, wanted.protocol_period), rel=1e-3
    )
    assert chosen.ping_timeout > start.ping_timeout and seed.membership.probe_timeout == chosen.ping_timeout
    assert (timing["ping_timeout"], timing["protocol_period"]) == (chosen.ping_timeout, chosen.protocol_period)
    for node, began in zip(nodes, (start, start, patient), strict=True):
        runs = node.membership.config
        # each field the longer of the node's own and the orchestrator's: never shortened
        assert runs.ping_timeout == max(began.ping_timeout, chosen.ping_timeout)
        assert runs.protocol_period == max(began.protocol_period, chosen.protocol_period)
        assert (
            node.membership.probe_timeout == runs.ping_timeout
            and node.membership.probe_interval == runs.protocol_period
        )
        assert replace(runs, ping_timeout=began.ping_timeout, protocol_period=began.protocol_period) == began
    assert timing["nodes"] == {
        stage_name(i): {
            "ping_timeout": n.membership.config.ping_timeout,
            "protocol_period": n.membership.config.protocol_period,
        }
        for i, n in enumerate(nodes)
    }
    assert timing["nodes"]["pp-stage-0"]["ping_timeout"] == chosen.ping_timeout
    assert timing["nodes"]["pp-stage-2"] == {"ping_timeout": 5.0, "protocol_period": 10.0}
    as_reported(timing, seed)


async def test_on_loopback_the_nodes_are_told_the_timing_they_already_run_with() -> None:
    """No path to time (members on one machine): nobody is re-timed, and the report still says
    what each node runs with."""
    config = RunConfig(transport="local")
    net = SimNet(Link(), random.Random(7), count_bytes=False)
    seed = Member(net, 0, config.swim)
    nodes = [Member(net, 1, config.swim), Member(net, 2, config.swim)]
    instances = [types.SimpleNamespace(stage=i, endpoint_id=n.id, where=stage_name(i)) for i, n in enumerate(nodes)]
    timing = await reach.time_swim(seed, instances, config)  # type: ignore[arg-type]
    assert timing["set_by"] == "the run's settings" and seed.membership.config == config.swim
    assert all(n.membership.config == config.swim for n in nodes)
    expected = {"ping_timeout": config.swim.ping_timeout, "protocol_period": config.swim.protocol_period}
    assert timing["nodes"] == {"pp-stage-0": expected, "pp-stage-1": expected}
    as_reported(timing, seed)


class Older(Actors):
    """A node that does not know the message (another release): its node answers an error."""

    def on_swim_timing(self, msg: Message, ctx: object) -> Message:
        raise ValueError("unknown message type 23")


async def test_a_node_that_refuses_the_timing_is_named_with_why_and_the_others_take_it() -> None:
    config = RunConfig(transport="wan")
    net = SimNet(Link(delay=ONE_WAY), random.Random(7), count_bytes=False)
    seed = Member(net, 0, config.swim)
    nodes = [Member(net, 1, config.swim), Member(net, 2, config.swim)]
    net.members[nodes[1].id] = Older(nodes[1].membership)  # type: ignore[assignment]
    instances = [types.SimpleNamespace(stage=i, endpoint_id=n.id, where=stage_name(i)) for i, n in enumerate(nodes)]
    timing = await reach.time_swim(seed, instances, config)  # type: ignore[arg-type]
    chosen = seed.membership.config
    assert timing["nodes"]["pp-stage-0"] == {
        "ping_timeout": chosen.ping_timeout,
        "protocol_period": chosen.protocol_period,
    }
    assert "unknown message type 23" in timing["nodes"]["pp-stage-1"]["error"]
    assert nodes[1].membership.config == config.swim  # it keeps its start-up timing
    as_reported(timing, seed)

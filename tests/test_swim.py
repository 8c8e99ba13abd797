"""Membership rules and configuration, in one process (the cross-process behaviour is in test_membership)."""

from __future__ import annotations

import asyncio

import pytest

from pytest_ppsmoke.protocol import stage_names
from pytest_ppsmoke.runtime.codec import MemberState, MemberStatus
from pytest_ppsmoke.runtime.node import NodeConfig
from pytest_ppsmoke.runtime.swim import SwimConfig

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


def test_node_environment_is_validated_without_echoing_the_key() -> None:
    key = "ab" * 31 + "zz"
    with pytest.raises(ValueError, match="PP_NODE_KEY must be 64 hex characters") as info:
        NodeConfig.from_env({"PP_NODE_KEY": key})
    assert key not in str(info.value)
    good = "cd" * 32
    with pytest.raises(ValueError, match="PP_NETWORK must be 'local' or 'wan', got 'lan'"):
        NodeConfig.from_env({"PP_NODE_KEY": good, "PP_NETWORK": "lan"})
    with pytest.raises(ValueError, match="PP_ALLOWED_IDS entry 'xyz' is not an endpoint id"):
        NodeConfig.from_env({"PP_NODE_KEY": good, "PP_ALLOWED_IDS": "xyz"})
    with pytest.raises(ValueError, match="PP_JOIN_TIMEOUT must be a number of seconds, got 'soon'"):
        NodeConfig.from_env({"PP_NODE_KEY": good, "PP_JOIN_TIMEOUT": "soon"})
    cfg = NodeConfig.from_env({"PP_NODE_KEY": good, "PP_NETWORK": "wan", "PP_SWIM": "suspicion_timeout=9"})
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

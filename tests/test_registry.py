"""Name registry rules, in one process: conflicts, clean leave, bad registrations."""

from __future__ import annotations

import logging

import pytest

from pytest_ppsmoke.runtime.codec import Echo
from pytest_ppsmoke.runtime.swimstate import MemberStatus

from .helpers import cluster_configs

pytestmark = pytest.mark.local


async def test_conflicting_names_settle_on_the_smallest_id_everywhere_and_are_reported(
    nodes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    seed_cfg, a_cfg, b_cfg = cluster_configs(3)
    seed = await nodes(seed_cfg)
    a_cfg.seed = b_cfg.seed = seed.ticket()
    a, b = await nodes(a_cfg), await nodes(b_cfg)
    a.register("pp-entry", "node")
    b.register("pp-entry", "node")
    winner = min(a.id, b.id)
    for n in (seed, a, b):
        await n.membership.wait_until(lambda n=n: len(n.registry.claims("pp-entry")) == 2, 5, "both claims")
        assert (await n.resolve("pp-entry", 1)).node == winner
        [conflict] = n.registry.conflicts()
        assert conflict.winner.node == winner and [x.node for x in conflict.losers] == [max(a.id, b.id)]
    assert "name 'pp-entry' is claimed by 2 members" in caplog.text
    assert f"wins (smallest endpoint id), ignoring node@{max(a.id, b.id)[:10]}" in caplog.text
    loser = a if a.id != winner else b
    await loser.close()  # a clean leave: the winner stays, the loser's claim goes at once
    await seed.membership.wait_until(lambda: len(seed.registry.claims("pp-entry")) == 1, 2, "one claim left")
    assert seed.registry.conflicts() == []


async def test_a_clean_leave_removes_the_names_without_waiting_for_suspicion(nodes) -> None:
    seed_cfg, a_cfg = cluster_configs(2)
    seed_cfg.swim = a_cfg.swim = type(seed_cfg.swim)(suspicion_timeout=30.0)
    seed = await nodes(seed_cfg)
    a_cfg.seed = seed.ticket()
    a = await nodes(a_cfg)
    a.register("pp-exit", "node")
    addr = await seed.resolve("pp-exit", 5)
    assert await seed.request(addr, Echo(b"hi"), 5) == Echo(b"hi")
    await a.close()
    await seed.membership.wait_until(lambda: seed.registry.lookup("pp-exit") is None, 2, "pp-exit gone")


async def test_registering_for_a_missing_actor_is_refused(nodes) -> None:
    (cfg,) = cluster_configs(1)
    node = await nodes(cfg)
    with pytest.raises(ValueError, match="cannot register 'pp-entry': no local actor 'stage'"):
        node.register("pp-entry", "stage")
    with pytest.raises(ValueError, match="name and actor must be non-empty"):
        node.registry.register("", "node")


async def test_a_node_closed_without_a_leave_tells_nobody(nodes) -> None:
    """``close(leave=False)`` (the orchestrator, once it has destroyed every instance: nobody is
    left to hear it) sends no farewell: a member still there keeps it alive in its view, where a
    clean leave (acknowledged before ``close`` returns) has it dead at once."""
    seed_cfg, a_cfg, b_cfg = cluster_configs(3)
    seed_cfg.swim = a_cfg.swim = b_cfg.swim = type(seed_cfg.swim)(suspicion_timeout=30.0)
    seed = await nodes(seed_cfg)
    a_cfg.seed = b_cfg.seed = seed.ticket()
    a, b = await nodes(a_cfg), await nodes(b_cfg)
    for n in (seed, a, b):
        await n.membership.wait_until(lambda n=n: len(n.membership.alive()) == 3, 5, "all three alive")
    await a.close(leave=False)
    gone = seed.membership.get(a.id)
    assert gone is not None and gone.status != MemberStatus.dead
    await b.close()
    left = seed.membership.get(b.id)
    assert left is not None and left.status == MemberStatus.dead

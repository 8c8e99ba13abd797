"""A node's own time-to-live (``guard_lifetime``): with in-process nodes and the emulator, the
guard destroys its own instance through the API with the container's key, and only when due."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from pytest_ppsmoke.cloud.fake_vast import FakeVast
from pytest_ppsmoke.cloud.vast import OfferQuery, VastClient
from pytest_ppsmoke.messages import WireDtype
from pytest_ppsmoke.nodeenv import NodeEnv
from pytest_ppsmoke.runtime.node import Node, NodeConfig
from pytest_ppsmoke.stage.gpu_node import Settings, guard_lifetime

from .helpers import SLEEPER, cluster_configs

pytestmark = pytest.mark.local


def settings(config: NodeConfig, ttl: float, grace: float) -> Settings:
    container = NodeEnv.from_env(only=("container_id", "container_api_key", "vast_url"))  # as rented() set them
    return Settings(config, 1, 2, WireDtype.bf16, Path(__file__), 10, ttl, grace, container)


async def rented(fake: FakeVast, monkeypatch: pytest.MonkeyPatch) -> int:
    """An instance on the emulator, and this process set up as its container (as vast.ai does)."""
    async with VastClient(fake.api_key, fake.url) as vast:
        offer = (await vast.search_offers(OfferQuery()))[0]
        iid = await vast.create_instance(offer.id, image="i", env={}, label="ppsmoke-ttl-stage1")
    monkeypatch.setenv("CONTAINER_ID", str(iid))
    monkeypatch.setenv("CONTAINER_API_KEY", fake.instances[iid].container_key)
    monkeypatch.setenv("VAST_URL", fake.url)
    return iid


async def seed_and_member(nodes: Any) -> tuple[Node, Node, NodeConfig]:
    """An orchestrator (the seed) and a member that joined through it, both in this process."""
    seed_cfg, cfg = cluster_configs(2)
    seed = await nodes(seed_cfg)
    cfg.seed = seed.ticket()
    return seed, await nodes(cfg), cfg


async def test_the_hard_limit_destroys_the_instance_even_with_the_orchestrator_alive(
    nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    _seed, node, cfg = await seed_and_member(nodes)
    async with FakeVast(faults="vast.boot_delay=0.05", node_argv=SLEEPER) as fake:
        iid = await rented(fake, monkeypatch)
        stop = asyncio.Event()
        t = time.monotonic()
        await asyncio.wait_for(guard_lifetime(node, settings(cfg, ttl=0.6, grace=60), stop), 10)
        assert stop.is_set() and 0.6 <= time.monotonic() - t < 5
        assert fake.live() == [] and [i.id for i in fake.destroyed] == [iid]
        assert ("DELETE", f"/api/v0/instances/{iid}/", 200) in fake.requests


async def test_losing_the_orchestrator_destroys_the_instance_after_the_grace_only(
    nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed, node, cfg = await seed_and_member(nodes)
    async with FakeVast(faults="vast.boot_delay=0.05", node_argv=SLEEPER) as fake:
        iid = await rented(fake, monkeypatch)
        stop = asyncio.Event()
        guard = asyncio.ensure_future(guard_lifetime(node, settings(cfg, ttl=600, grace=0.8), stop))
        await asyncio.sleep(2.0)  # the orchestrator is alive: the guard stays quiet
        assert not guard.done() and [i.id for i in fake.live()] == [iid]
        leaving = time.monotonic()
        await seed.close()  # a clean leave: the node sees it at once, then waits out the grace
        await asyncio.wait_for(guard, 10)
        # last seen alive at a check (every 0.2 s) before the leave began, or during it: never
        # sooner than the grace less one check period after it began (a second period: scheduling)
        assert stop.is_set() and time.monotonic() - leaving >= 0.8 - 2 * 0.2
        assert fake.live() == []


async def test_without_a_container_the_guard_only_stops_the_node(nodes, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CONTAINER_ID", "CONTAINER_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    (cfg,) = cluster_configs(1)
    node = await nodes(cfg)
    stop = asyncio.Event()
    await asyncio.wait_for(guard_lifetime(node, settings(cfg, ttl=0.3, grace=60), stop), 5)
    assert stop.is_set()

"""A node's own time-to-live (``guard_lifetime``): with in-process nodes and the emulator, the
guard destroys its own instance through the API with the container's key, and only when due."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_ppsmoke.cloud.emulator.server import FakeVast
from pytest_ppsmoke.cloud.own import own_instance
from pytest_ppsmoke.cloud.vast import VastClient
from pytest_ppsmoke.cloud.vastrecords import OfferQuery
from pytest_ppsmoke.nodeenv import NodeEnv
from pytest_ppsmoke.runtime.codec import MemberStatus
from pytest_ppsmoke.runtime.node import Node, NodeConfig
from pytest_ppsmoke.stage.lifetime import Settings, guard_lifetime, orchestrator_gone

from .helpers import SLEEPER, cluster_configs

pytestmark = pytest.mark.local


def settings(config: NodeConfig, ttl: float, grace: float) -> Settings:
    container = NodeEnv.from_env(only=("container_id", "container_api_key", "vast_url"))  # as rented() set them
    env = container.replace(stage=1, num_stages=2, worker_ready_timeout=10, ttl=ttl, orphan_grace=grace)
    return Settings(env, config, Path(__file__))


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
        assert stop.is_set() and time.monotonic() - t >= 0.6  # never early; the wait's 10 s only stops a hang
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


async def test_a_padded_container_key_still_destroys_its_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    """vast.ai pads the strings it serves: ``CONTAINER_API_KEY`` as " key\\n" is read stripped by
    ``NodeEnv``, and the emulator (which checks the container's key) takes the destroy it sends."""
    async with FakeVast(node_argv=SLEEPER) as fake:
        iid = await rented(fake, monkeypatch)
        key = fake.instances[iid].container_key
        monkeypatch.setenv("CONTAINER_API_KEY", f" {key}\n")
        monkeypatch.setenv("CONTAINER_ID", f"{iid}")
        env = NodeEnv.from_env(only=("container_id", "container_api_key", "vast_url"))
        assert env.container_api_key == key
        own = own_instance(env)
        assert own is not None and key not in repr(own)
        assert await own.destroy() is True
        assert fake.live() == [] and [i.id for i in fake.destroyed] == [iid]
        assert ("DELETE", f"/api/v0/instances/{iid}/", 200) in fake.requests


class Clock:
    """The guard's clock, moved by the test: the guard's own checks still sleep real (short) time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.reads = 0  # the guard reads it once at its start and once a check

    def __call__(self) -> float:
        self.reads += 1
        return self.now


class Viewer:
    """A node's view of the orchestrator, as the guard reads it (``membership.members``)."""

    def __init__(self) -> None:
        self.membership = SimpleNamespace(members={})

    def sees(self, seed_id: str, status: MemberStatus | None) -> None:
        self.membership.members = {} if status is None else {seed_id: SimpleNamespace(status=status)}


async def settle(guard: asyncio.Future[None], clock: Clock, checks: int = 2) -> None:
    """Until the guard has made ``checks`` checks at the clock's present time (or ended): counted
    by its reads of the clock, not by time, so that a loaded machine cannot skip one."""
    until = clock.reads + checks
    deadline = time.monotonic() + 30
    while clock.reads < until and not guard.done():
        assert time.monotonic() < deadline, "the guard made no check in 30 s"
        await asyncio.sleep(0.005)


async def test_a_node_the_orchestrator_never_reached_waits_the_boot_window_plus_its_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On vast.ai the orchestrator reaches the nodes only once every instance runs: a node on a
    fast host must not count the wait for a slow one as a lost orchestrator. Until its first
    contact it waits the boot window plus its grace (the orchestrator may have died during the
    boot), then destroys its own instance; after contact, the grace alone. The clock is virtual."""
    (cfg,) = cluster_configs(1)
    seed_id = cluster_configs(1)[0].id
    cfg = dataclasses.replace(cfg, seed=seed_id)
    async with FakeVast(faults="vast.boot_delay=0.05", node_argv=SLEEPER) as fake:
        iid = await rented(fake, monkeypatch)
        run = settings(cfg, ttl=10_000, grace=0.04)
        run = dataclasses.replace(run, env=run.env.replace(boot_window=100.0))
        clock, node, stop = Clock(), Viewer(), asyncio.Event()
        guard = asyncio.ensure_future(guard_lifetime(node, run, stop, clock))  # type: ignore[arg-type]
        await settle(guard, clock)  # started at 0
        clock.now = 100.0  # a whole boot window with no contact, within the grace after it: alive
        await settle(guard, clock)
        assert not guard.done() and [i.id for i in fake.live()] == [iid]
        clock.now = 100.05  # past the window plus the grace: the orchestrator died during the boot
        await asyncio.wait_for(guard, 10)
        assert stop.is_set() and fake.live() == [] and [i.id for i in fake.destroyed] == [iid]

    # reached once, the node's grace counts from the last time it saw the orchestrator
    clock, node, stop = Clock(), Viewer(), asyncio.Event()
    for name in ("CONTAINER_ID", "CONTAINER_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    run = dataclasses.replace(run, env=NodeEnv(ttl=10_000, orphan_grace=0.04, boot_window=100.0))
    guard = asyncio.ensure_future(guard_lifetime(node, run, stop, clock))  # type: ignore[arg-type]
    await settle(guard, clock)
    clock.now = 50.0
    node.sees(seed_id, MemberStatus.alive)
    await settle(guard, clock)
    node.sees(seed_id, MemberStatus.dead)
    clock.now = 50.03  # within the grace of the last sight
    await settle(guard, clock)
    assert not guard.done()
    clock.now = 50.1
    await asyncio.wait_for(guard, 10)
    assert stop.is_set()


async def test_a_node_that_fails_on_an_unexpected_error_destroys_its_own_instance() -> None:
    """Not only the errors the node plans for (a bad setting, a timeout, its worker's death): any
    exception (iroh's, a transport's, a bug; here the failpoint node.crash's RuntimeError) ends
    the node through the same door, and its instance does not bill on until a teardown or a reap."""
    (cfg,) = cluster_configs(1)
    env = NodeEnv(stage=0, num_stages=2, node_key=cfg.secret_key, seed=cluster_configs(1)[0].id, transport="wan")
    async with FakeVast(faults="vast.crash_node=0;vast.boot_delay=0.05") as fake:
        async with VastClient(fake.api_key, fake.url) as vast:
            offer = (await vast.search_offers(OfferQuery()))[0]
            iid = await vast.create_instance(offer.id, image="i", env=env.to_env(), label="ppsmoke-crash-stage0")
        deadline = time.monotonic() + 60
        while fake.live() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert fake.live() == [] and [i.id for i in fake.destroyed] == [iid]
        inst = fake.destroyed[0]
        assert inst.proc is not None
        await fake.torn_down()
        tail = inst.proc.stderr_tail()
        # the traceback first; the destroy it sent then ends the container (as vast.ai's does),
        # often before the node's last line
        assert "failed unexpectedly" in tail and "RuntimeError: failpoint node.crash" in tail, tail


def test_a_node_knows_the_run_is_over_once_the_orchestrator_is_dead_in_its_view() -> None:
    """``orchestrator_gone``: the seed dead in the node's view (it left first at the teardown, or
    died) is the run's end, and the node's own goodbye then waits on nobody; alive, suspected, not
    yet seen, or a node that never started: not gone."""
    seed_cfg, cfg = cluster_configs(2)
    run = Settings(NodeEnv(), dataclasses.replace(cfg, seed=seed_cfg.id), Path(__file__))
    node = Viewer()
    for status, gone in [(None, False), (MemberStatus.alive, False), (MemberStatus.suspect, False)]:
        node.sees(seed_cfg.id, status)
        assert orchestrator_gone(node, run) is gone, status  # type: ignore[arg-type]
    node.sees(seed_cfg.id, MemberStatus.dead)
    assert orchestrator_gone(node, run)  # type: ignore[arg-type]
    node.sees("someone else", MemberStatus.dead)
    assert not orchestrator_gone(node, run)  # type: ignore[arg-type]
    assert not orchestrator_gone(SimpleNamespace(), run)  # type: ignore[arg-type]  # not started: no membership

"""``pp-smoke-run`` over an emulated network: each instance's node in a network namespace of its
own behind the delay switch (``pytest_ppsmoke/network``), the orchestrator on the root
namespace's host address, vast.ai's API on a member of its own. A run over the WAN profile; a node
cut off mid-decode; the orchestrator cut off, and the nodes' orphan grace destroying their own
instances. On the session's synthetic model: these check what crosses the network and what is
left, not tokens (a token-exact run over wan and far: bench/bench_network.py)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pytest_ppsmoke.cloud.emulator.server import FakeVast
from pytest_ppsmoke.network import netns, unavailable
from pytest_ppsmoke.runtime.localproc import EventKind

from .smoke import Smoke, assert_nothing_left
from .test_lifecycle import assert_all_destroyed, assert_failed_at, detectors

NO_NETNS = unavailable()
pytestmark = [
    pytest.mark.local,
    pytest.mark.netns,
    pytest.mark.skipif(NO_NETNS is not None, reason=f"no network namespaces here: {NO_NETNS}"),
]


async def left_of(fake: FakeVast) -> list[str]:
    """The emulator closed: what is left of its network (namespaces and devices of its prefix)."""
    prefix = fake.network.prefix
    await fake.close()
    names = await asyncio.to_thread(netns.netns_names)
    links = await asyncio.to_thread(netns.root_links)
    return [n for n in [*names, *links] if n.startswith(prefix)]


async def test_a_run_over_an_emulated_wan_crosses_it_and_leaves_nothing(
    emulator: Callable[..., Any], tmp_path: Path
) -> None:
    fake = await emulator("", network="wan")
    async with Smoke(fake, tmp_path, "--network", "wan", "--max-tokens", "6", "--reference", "off") as smoke:
        assert await smoke.finish() == 0, smoke.stderr[-3000:]
    report = smoke.report()
    assert report["ok"] and report["network"]["spec"] == "wan"
    assert report["network"]["host_addr"] == fake.network.host_addr
    # every hop crossed the switch: the decode hop took at least the profile's 20 ms (less its 2 ms jitter)
    hop = report["hops"]["pp-stage-0->pp-stage-1"]
    assert hop["decode"]["median_s"] >= 0.018 and hop["prefill"]["median_s"] >= 0.018
    links = await fake.network.stats()
    for link in ("host->0", "host->1", "0->host", "1->host", "0->1", "1->0"):
        assert links[link]["delivered"] > 0 and links[link]["mean_delay_ms"] >= 18, (link, links[link])
    await assert_all_destroyed(fake, smoke, report, 2)
    assert await left_of(fake) == []


async def test_a_node_cut_off_mid_decode_fails_the_run_naming_it(emulator: Callable[..., Any], tmp_path: Path) -> None:
    fake = await emulator("vast.partition=1:both:0;vast.kill_after_tokens=3", network="lan")
    args = ("--network", "lan", "--max-tokens", "512", "--budget", "120")
    async with Smoke(fake, tmp_path, *args) as smoke:
        assert await smoke.finish() == 1, smoke.stderr[-3000:]
    report = smoke.report()
    legit = detectors(report, 1)
    del legit["vast.ai's record"]  # the host is up: only the network failed
    assert_failed_at(smoke, report, "decode", "|".join(f"(?:{m})" for m in legit.values()))
    assert (await fake.network.stats())["0->1"]["partitioned"] > 0
    await assert_all_destroyed(fake, smoke, report, 2)
    assert await left_of(fake) == []


async def test_the_orchestrator_cut_off_leaves_the_nodes_to_destroy_their_instances(
    emulator: Callable[..., Any], tmp_path: Path
) -> None:
    """The orchestrator loses its network mid-decode (its nodes, and vast.ai's API too): it
    cannot destroy anything and says so; each node, having lost the orchestrator for its orphan
    grace, destroys its own instance through the API with its container key."""
    fake = await emulator("vast.isolate_orchestrator=120;vast.kill_after_tokens=3", network="lan")
    args = ("--network", "lan", "--max-tokens", "512", "--orphan-grace", "2", "--teardown-timeout", "15")
    async with Smoke(fake, tmp_path, *args, "--budget", "120") as smoke:
        assert await smoke.finish() == 1, smoke.stderr[-3000:]
        deadline = time.monotonic() + 30
        while fake.live() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
    assert fake.live() == []  # each node DELETEd its own instance with its container key
    for inst in fake.destroyed:
        assert inst.proc is not None
        assert any(e.kind is EventKind.EXPIRED and "lost the orchestrator" in e["reason"] for e in inst.proc.events)
    # the orchestrator's calls got no answer, and it said that something may still be billing
    assert any(status == 0 for _, _, status in fake.requests)
    assert re.search(r"was NOT destroyed: .*no answer.*pp-smoke-run --reap", smoke.stderr), smoke.stderr[-3000:]
    await assert_nothing_left(fake, smoke, 2)
    assert await left_of(fake) == []

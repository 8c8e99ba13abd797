"""The emulator's hosts as varied as vast.ai's: the catalogue's spread (compute capability, CUDA
and drivers, downloads, ports, storage prices), every string served padded, ``dph_total`` priced
for the storage a search allocates, a boot time per host, heartbeat gaps, ports filled in late,
and destroyed records released. Driven over HTTP, raw where the wire is the point, else through
the client; checked by order of events, never by durations."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from pytest_ppsmoke.cloud.emulator.catalogue import default_catalogue, search
from pytest_ppsmoke.cloud.emulator.server import FakeVast
from pytest_ppsmoke.cloud.vast import VastClient
from pytest_ppsmoke.cloud.vastrecords import OfferQuery, going_away, search_body
from pytest_ppsmoke.protocol import COMPUTE_CAPS

from .helpers import SLEEPER, stripped
from .test_fake_vast import call
from .test_vast import KEY

pytestmark = pytest.mark.local

UDP = {"-p 7000:7000/udp": "1"}  # how vast-cli asks for a forwarded UDP port


@pytest_asyncio.fixture
async def fake(request: pytest.FixtureRequest) -> AsyncIterator[FakeVast]:
    faults = getattr(request, "param", "")
    # raw calls, one right after another, each checked for its answer: vast.ai's rate limits (on by
    # default) are off here; they have tests of their own (test_fake_vast.py, test_vastdoc.py)
    limits = "" if "vast.rate_limit" in faults else "vast.rate_limit=off;"
    async with FakeVast(api_key=KEY, faults=f"vast.boot_delay=0;{limits}{faults}", node_argv=SLEEPER) as vast:
        yield vast
    assert not vast.live()


def strings(data: Any) -> Iterator[str]:
    """Every string value in ``data``, however deep (not the keys)."""
    if isinstance(data, str):
        yield data
    elif isinstance(data, dict):
        for v in data.values():
            yield from strings(v)
    elif isinstance(data, list):
        for v in data:
            yield from strings(v)


def environ(pid: int) -> list[bytes]:
    """The variables a process was started with, as ``NAME=value`` bytes."""
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def unfiltered() -> dict[str, Any]:
    """The client's default query without the filters the image and the boot window need (its
    compute capability and download speed)."""
    q = search_body(OfferQuery())
    del q["compute_cap"], q["inet_down"]
    return q


async def create(fake: FakeVast, offer: int, stage: int = 0, disk: float = 10, **env: str) -> int:
    body = {"image": "img:1", "env": {"STAGE": str(stage), **env}, "label": f"t-stage{stage}", "disk": disk}
    status, data, _ = await call(fake, "PUT", f"/api/v0/asks/{offer}/", body)
    assert status == 200, data
    return int(data["new_contract"])


async def shown(fake: FakeVast, iid: int) -> Any:
    """The instance's record as served (raw, padded)."""
    status, data, _ = await call(fake, "GET", f"/api/v0/instances/{iid}/")
    assert status == 200, data
    return data["instances"]


async def offers(fake: FakeVast, query: dict[str, Any]) -> list[dict[str, Any]]:
    status, data, _ = await call(fake, "POST", "/api/v0/bundles/", query)
    assert status == 200, data
    return list(stripped(data["offers"]))


# --- the catalogue --------------------------------------------------------------------------------


def test_the_catalogue_has_vast_ais_spread_and_the_hosts_a_careful_query_skips() -> None:
    cat = default_catalogue()
    assert {o["compute_cap"] for o in cat} == {610, 700, 750, 800, 860, 890, 900, 1000, 1200}
    assert {o["gpu_name"] for o in cat} >= {
        "GTX 1080 Ti", "V100 SXM2", "Tesla T4", "RTX 2080 Ti", "A100 SXM4", "RTX 3090", "RTX A6000", "RTX 4090",
        "L40S", "H100 SXM", "B200", "RTX 5090",
    }  # fmt: skip
    assert min(o["cuda_max_good"] for o in cat) == 11.8 and max(o["cuda_max_good"] for o in cat) == 12.9
    drivers = {"11.8": "520.", "12.4": "550.", "12.8": "570."}  # each CUDA with the driver that serves it
    for o in cat:
        want = drivers.get(f"{o['cuda_max_good']:g}")
        assert want is None or o["driver_version"].startswith(want), o
    assert min(o["inet_down"] for o in cat) <= 50 and max(o["inet_down"] for o in cat) >= 10_000
    assert any(o["direct_port_count"] == 0 for o in cat)
    assert all(0.05 <= o["storage_cost"] <= 0.5 for o in cat) and len({o["storage_cost"] for o in cat}) > 3
    taken = {o["id"] for o in search(cat, search_body(OfferQuery()))}
    skipped = [o for o in cat if o["id"] not in taken]
    for why in (
        lambda o: not o["verified"],
        lambda o: o["reliability"] < 0.95,
        lambda o: o["num_gpus"] > 1,
        lambda o: o["cuda_max_good"] < 12.4,
    ):
        assert sum(map(why, skipped)) >= 2
    wan = search_body(OfferQuery(direct_ports=1))
    assert len(search(cat, wan)) >= 2 and all(o["direct_port_count"] >= 1 for o in search(cat, wan))


async def test_without_the_compute_cap_filter_the_cheapest_two_are_blackwell(fake: FakeVast) -> None:
    for extra in ({}, {"direct_port_count": {"gte": 1}}):  # a loopback run's query and a wan run's
        cheapest = (await offers(fake, {**unfiltered(), **extra}))[:2]
        assert [(o["gpu_name"], o["compute_cap"]) for o in cheapest] == [("RTX 5090", 1200), ("B200", 1000)]
        assert cheapest[0]["cuda_max_good"] >= 12.8
    async with VastClient(KEY, fake.url) as vast:
        filtered = await vast.search_offers(OfferQuery())
        assert all(min(COMPUTE_CAPS) <= o.raw["compute_cap"] <= max(COMPUTE_CAPS) for o in filtered)
        # a query that does not ask for a download speed would rent a slow host first ...
        assert (await vast.search_offers(OfferQuery(min_inet_down=0)))[0].raw["inet_down"] <= 100
        # ... the default one gets hosts that download in time
        careful = filtered[:2]
        assert [o.gpu_name for o in careful] == ["RTX 3090", "RTX 4090"]
        assert all(o.raw["compute_cap"] <= 900 and o.raw["inet_down"] >= 200 for o in careful)


# --- padded strings --------------------------------------------------------------------------------


async def test_every_string_is_served_padded_and_the_client_strips_them(fake: FakeVast) -> None:
    offer = (await offers(fake, unfiltered()))[0]["id"]
    iid = await create(fake, offer, MODEL="m", **UDP)
    inst = fake.instances[iid]
    async with VastClient(KEY, fake.url) as vast:
        rec = await vast.wait_running(iid, 200, 0.02)
        # through the client: stripped
        assert (rec.label, rec.actual_status, rec.intended_status) == ("t-stage0", "running", "running")
        assert rec.raw["public_ipaddr"] == "127.0.0.1" and rec.raw["gpu_name"] == "RTX 5090"
        assert rec.public_udp(7000) == f"127.0.0.1:{inst.public_ports['7000/udp']}"
        assert (await vast.search_offers(OfferQuery()))[0].gpu_name == "RTX 3090"
    # on the wire: every string value of every answer about offers and instances padded
    raw = await shown(fake, iid)
    answers = [
        raw,
        (await call(fake, "GET", "/api/v1/instances/"))[1],
        (await call(fake, "POST", "/api/v0/bundles/", search_body(OfferQuery())))[1],
    ]
    for answer in answers:
        values = list(strings(answer))
        assert len(values) > 10 and all(s != s.strip() for s in values), [s for s in values if s == s.strip()]
    padding = {(s[0].isspace(), s[-1]) for s in strings(raw)}  # leading space, trailing space or newline
    assert {(True, s) for s in " \n"} & padding and (False, " ") in padding and (False, "\n") in padding
    for key in ("label", "actual_status", "public_ipaddr", "status_msg", "gpu_name"):
        assert raw[key] != raw[key].strip() and raw[key].strip() == stripped(rec.raw)[key], key
    assert all(v != v.strip() for _, v in raw["extra_env"])
    assert raw["ports"]["7000/udp"][0]["HostPort"].strip() == str(inst.public_ports["7000/udp"])
    assert raw["ports"]["7000/udp"][0]["HostPort"] != str(inst.public_ports["7000/udp"])
    # what the emulator holds is not padded
    assert inst.label == "t-stage0" and inst.record()["actual_status"] == "running"
    assert all(s == s.strip() for s in strings(inst.record()))
    # the node's environment: PUBLIC_IPADDR padded, as vast.ai's host agent writes it
    assert inst.proc is not None
    assert b"PUBLIC_IPADDR=127.0.0.1\n" in await asyncio.to_thread(environ, inst.proc.pid)
    assert (await call(fake, "DELETE", f"/api/v0/instances/{iid}/"))[0] == 200


# --- prices ------------------------------------------------------------------------------------------


async def test_dph_total_is_priced_for_the_storage_the_search_allocates(fake: FakeVast) -> None:
    base = {k: v for k, v in unfiltered().items() if k not in ("allocated_storage", "dph_total")}
    small = await offers(fake, {**base, "allocated_storage": 8})
    big = await offers(fake, {**base, "allocated_storage": 1000})
    by_id = {o["id"]: o for o in big}
    assert {o["id"] for o in small} == set(by_id)
    for o in small:
        extra = o["storage_cost"] * (1000 - 8) / 720  # storage_cost is $/GB/month
        assert by_id[o["id"]]["dph_total"] == pytest.approx(o["dph_total"] + extra)
        assert o["dph_total"] == pytest.approx(o["dph_base"] + o["storage_cost"] * 8 / 720)
        assert by_id[o["id"]]["storage_total_cost"] == pytest.approx(o["storage_cost"] * 1000 / 720)
    # ordered by the priced value: the B200's dear storage puts it behind the RTX 3060 at 1,000 GB
    for found in (small, big):
        assert [o["dph_total"] for o in found] == sorted(o["dph_total"] for o in found)
    rank = {size: [o["gpu_name"] for o in found] for size, found in ((8, small), (1000, big))}
    assert rank[8].index("B200") < rank[8].index("RTX 3060") and rank[1000].index("B200") > rank[1000].index("RTX 3060")
    # no allocated_storage: vast.ai's default, 8 GB
    assert await offers(fake, base) == small
    # filtered by the priced value: the H100 costs under $2.20/h with 8 GB, not with 1,000
    capped = {**base, "dph_total": {"lte": 2.2}}
    assert "H100 SXM" in [o["gpu_name"] for o in await offers(fake, {**capped, "allocated_storage": 8})]
    assert "H100 SXM" not in [o["gpu_name"] for o in await offers(fake, {**capped, "allocated_storage": 1000})]
    status, data, _ = await call(fake, "POST", "/api/v0/bundles/", {**base, "allocated_storage": "lots"})
    # refused by vast.ai's description (the suite's strict validation), or else by the emulator itself
    assert status == 400 and data["error"] in ("openapi_violation", "invalid_args"), data
    assert "allocated_storage" in data["msg"]
    # an instance's record is priced for the disk its create rented
    offer = small[0]
    iid = await create(fake, offer["id"], disk=50)
    rec = stripped(await shown(fake, iid))
    assert rec["dph_total"] == pytest.approx(offer["dph_base"] + offer["storage_cost"] * 50 / 720)
    assert rec["storage_total_cost"] == pytest.approx(offer["storage_cost"] * 50 / 720)
    assert (await call(fake, "DELETE", f"/api/v0/instances/{iid}/"))[0] == 200


# --- boots, heartbeats, ports -----------------------------------------------------------------------


async def running_order(fake: FakeVast, ids: list[int], seconds: float = 20) -> list[int]:
    """The order in which the instances' records first show ``running`` (polled raw)."""
    order: list[int] = []
    deadline = time.monotonic() + seconds
    while len(order) < len(ids):
        assert time.monotonic() < deadline, f"only {order} of {ids} running"
        for iid in ids:
            if iid not in order and stripped(await shown(fake, iid))["actual_status"] == "running":
                order.append(iid)
        await asyncio.sleep(0.01)
    return order


@pytest.mark.parametrize("fake", ["vast.boot_delay=1.5,0.05"], indirect=True)
async def test_each_host_boots_in_its_own_time_in_create_order(fake: FakeVast) -> None:
    """The first created boots slowly, the second and the third (past the list: its last value)
    quickly: both run before the first, which was created before them."""
    cheap = [o["id"] for o in await offers(fake, unfiltered())][:3]
    ids = [await create(fake, offer, stage) for stage, offer in enumerate(cheap)]
    order = await running_order(fake, ids)
    assert order[-1] == ids[0] and set(order[:2]) == set(ids[1:])
    for iid in ids:
        assert (await call(fake, "DELETE", f"/api/v0/instances/{iid}/"))[0] == 200


@pytest.mark.parametrize("fake", ["vast.heartbeat_gap=0:1.5"], indirect=True)
async def test_a_heartbeat_gap_shows_unknown_then_running_while_the_node_runs(fake: FakeVast) -> None:
    cheap = [o["id"] for o in await offers(fake, unfiltered())][:2]
    gap, other = [await create(fake, offer, stage) for stage, offer in enumerate(cheap)]
    seen: dict[int, list[str]] = {gap: [], other: []}
    node_ran_in_gap = False
    deadline = time.monotonic() + 20
    while "running" not in seen[gap]:
        assert time.monotonic() < deadline, seen
        for iid in (gap, other):
            rec = stripped(await shown(fake, iid))
            status = str(rec["actual_status"])
            if not seen[iid] or seen[iid][-1] != status:
                seen[iid].append(status)
            if iid == gap and status == "unknown":
                assert rec["status_msg"] == "no recent heartbeat from the host"
                assert (rec["intended_status"], rec["cur_state"], rec["next_state"]) == ("running",) * 3
                inst = fake.instances[gap]
                proc = inst.proc.proc if inst.proc is not None else None
                node_ran_in_gap |= proc is not None and proc.returncode is None
        await asyncio.sleep(0.02)
    assert seen[gap][-2:] == ["unknown", "running"]  # unknown in place of its first running, then running
    assert "unknown" not in seen[other]  # another stage's host kept its heartbeat
    assert node_ran_in_gap  # its node was started, and ran underneath
    for iid in (gap, other):
        assert (await call(fake, "DELETE", f"/api/v0/instances/{iid}/"))[0] == 200


@pytest.mark.parametrize("fake", ["vast.late_ports=3600"], indirect=True)
async def test_ports_appear_in_the_record_a_while_after_running(fake: FakeVast) -> None:
    offer = (await offers(fake, unfiltered()))[0]["id"]
    iid = await create(fake, offer, **UDP)
    inst = fake.instances[iid]
    public = inst.public_ports["7000/udp"]
    async with VastClient(KEY, fake.url) as vast:
        first = await vast.wait_running(iid, 200, 0.02)
        assert first.raw["ports"] == {} and first.public_udp(7000) is None
        # the node has its forwarded port from the start: the host agent set it
        assert inst.proc is not None
        assert f"VAST_UDP_PORT_7000={public}".encode() in await asyncio.to_thread(environ, inst.proc.pid)
        again = await vast.show_instance(iid)  # an hour of no ports: still none, however slow this machine
        assert again is not None and again.raw["ports"] == {} and again.public_udp(7000) is None
        inst.late_ports = 0.0  # its time is up: the record fills them in
        rec = await vast.show_instance(iid)
        assert rec is not None and rec.public_udp(7000) == f"127.0.0.1:{public}"
        assert rec.actual_status == "running"
        await vast.destroy_instance(iid)


# --- destroyed and still listed -----------------------------------------------------------------------


@pytest.mark.parametrize("fake", ["vast.destroy_linger=60;vast.destroy_ignored=1:1"], indirect=True)
async def test_a_lingering_destroyed_instance_is_unloaded_and_an_ignored_destroy_changes_nothing(
    fake: FakeVast,
) -> None:
    cheap = [o["id"] for o in await offers(fake, unfiltered())][:2]
    zero, one = [await create(fake, offer, stage) for stage, offer in enumerate(cheap)]
    async with VastClient(KEY, fake.url) as vast:
        for iid in (zero, one):
            await vast.wait_running(iid, 200, 0.02)
            assert await vast.destroy_instance(iid)
        gone = await vast.show_instance(zero)
        assert gone is not None and (gone.intended_status, gone.cur_state, gone.next_state) == (
            "running", "unloaded", "unloaded"
        )  # fmt: skip
        assert gone.actual_status in ("running", "exited") and going_away(gone)
        kept = await vast.show_instance(one)  # its destroy was ignored: as before it
        assert kept is not None and (kept.actual_status, kept.intended_status, kept.cur_state, kept.next_state) == (
            "running", "running", "running", "running"
        )  # fmt: skip
        assert not going_away(kept)
        assert await vast.destroy_instance(one)
    await fake.torn_down()
    for iid in (zero, one):
        assert (stripped(await shown(fake, iid))["actual_status"], fake.lingering[iid].linger_until > 0) == (
            "exited", True
        )  # fmt: skip
        fake.lingering[iid].linger_until = 0.0

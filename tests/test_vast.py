"""The vast.ai client against the emulator (a real aiohttp server on port 0), and the official
``vastai`` CLI against the emulator. Instances here run a small stand-in process, not a node:
what is under test is the REST API and the instance lifecycle around a process."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from pytest_ppsmoke import failpoints
from pytest_ppsmoke.cloud.emulator.catalogue import default_catalogue, match_offer, search, widened
from pytest_ppsmoke.cloud.emulator.server import FakeVast
from pytest_ppsmoke.cloud.vast import VastClient
from pytest_ppsmoke.cloud.vastrecords import (
    Instance,
    Label,
    NeverRuns,
    OfferQuery,
    VastError,
    offer_from_json,
    search_body,
)

from .helpers import SLEEPER, stripped

pytestmark = pytest.mark.local
KEY = "vk-test-0123456789abcdef-DISTINCT"


@pytest_asyncio.fixture
async def fake(request: pytest.FixtureRequest) -> AsyncIterator[FakeVast]:
    faults = getattr(request, "param", None) or "vast.boot_delay=0.05"
    async with FakeVast(api_key=KEY, faults=faults, node_argv=SLEEPER) as vast:
        yield vast
    assert not vast.live()


def client(fake: FakeVast, **kw: float) -> VastClient:
    return VastClient(KEY, fake.url, **kw)  # type: ignore[arg-type]


async def wait_state(vast: VastClient, iid: int, state: str, seconds: float = 10) -> Instance:
    deadline = time.monotonic() + seconds
    while True:
        rec = await vast.show_instance(iid)
        assert rec is not None
        if rec.actual_status == state:
            return rec
        assert time.monotonic() < deadline, f"instance {iid} still {rec.actual_status!r}, wanted {state!r}"
        await asyncio.sleep(0.02)


async def test_offers_match_the_query_cheapest_first(fake: FakeVast) -> None:
    async with client(fake) as vast:
        offers = await vast.search_offers(OfferQuery(gpu_ram_gb=16, max_dph=1.5))
        names = ["RTX 3090", "RTX 4090", "RTX A6000", "L40S", "A100 SXM4"]  # the 4060 Ti downloads too slowly
        assert [o.gpu_name for o in offers] == names
        # each priced for the 20 GB the query allocates: dph_base and 20 GB of storage_cost ($/GB/month)
        want = [o.raw["dph_base"] + o.raw["storage_cost"] * 20 / 720 for o in offers]
        assert [o.dph_total for o in offers] == pytest.approx(want) and want == sorted(want)
        # each filter really filters: the unverified, unreliable, 2-GPU, old-CUDA and small offers stay out
        cheap = await vast.search_offers(OfferQuery(gpu_ram_gb=8, max_dph=0.2, min_reliability=0, min_cuda=0))
        assert [o.gpu_name for o in cheap] == ["GTX 1080 Ti", "Tesla T4", "RTX 3080", "V100 SXM2"]
        assert await vast.search_offers(OfferQuery(gpu_ram_gb=100)) == []
    ops = {"gpu_ram": {"gte": "24000"}, "geolocation": {"in": ["Sweden, SE", "Texas, US"]}, "num_gpus": {"eq": "1"}}
    assert sum(match_offer(o, ops) for o in default_catalogue()) == 2


def test_the_catalogue_widens_to_the_stage_count_only_where_the_query_takes_too_few() -> None:
    query = search_body(OfferQuery())
    size = len(default_catalogue())
    assert len(search(default_catalogue(), query)) == 5  # the default query takes 5 of the 18
    for n in (1, 2, 5):  # enough already: the default catalogue, offer for offer
        assert widened(n, query) == default_catalogue()
    for n in (6, 12, 16):
        offers = widened(n, query)
        assert offers[:size] == default_catalogue()  # the default's offers first, unchanged
        taken = search(offers, query)
        assert len(taken) == n
        for key in ("id", "ask_contract_id", "bundle_id", "machine_id", "host_id"):
            assert len({o[key] for o in offers}) == len(offers), key  # each a machine of its own
        # the copies are of the cheapest offer the query takes
        copies = offers[size:]
        assert {o["gpu_name"] for o in copies} == {"RTX 3090"} and {o["dph_base"] for o in copies} == {0.38}
        assert {o["dph_total"] for o in copies} == {default_catalogue()[4]["dph_total"]}  # as stored, not as priced
    # a query that allocates other storage widens the same way
    big = {**query, "allocated_storage": 200}
    assert len(search(widened(9, big), big)) == 9
    # a query that takes none: nothing to copy, the preflight says so
    assert widened(8, search_body(OfferQuery(gpu_ram_gb=100))) == default_catalogue()


@pytest.mark.parametrize("fake", ["vast.offers=1"], indirect=True)
async def test_too_few_offers_knob(fake: FakeVast) -> None:
    async with client(fake) as vast:
        assert len(await vast.search_offers(OfferQuery())) == 1


@pytest.mark.parametrize("fake", ["vast.boot_delay=1"], indirect=True)
async def test_instance_lifecycle_create_show_label_list_destroy(fake: FakeVast) -> None:
    async with client(fake) as vast:
        offer = (await vast.search_offers(OfferQuery()))[0]
        iid = await vast.create_instance(
            offer.id, image="img:1", env={"STAGE": "0", "MODEL": "m"}, label="ppsmoke-t-stage0", disk_gb=30
        )
        rec = await vast.show_instance(iid)
        assert rec is not None and rec.actual_status in (None, "loading") and rec.id == iid
        assert (rec.intended_status, rec.cur_state, rec.next_state) == ("running", "running", "running")
        rec = await wait_state(vast, iid, "running")
        assert rec.label == "ppsmoke-t-stage0" and rec.run_label == Label("t", 0)
        # priced for the 30 GB the create rents, where the search priced the query's 20 GB
        extra = offer.raw["storage_cost"] * 10 / 720
        assert rec.raw["dph_total"] == pytest.approx(offer.dph_total + extra) == rec.machine.dph_total
        assert (
            ["STAGE", "0"] in rec.raw["extra_env"] and rec.raw["disk_space"] == 30 and rec.raw["image_uuid"] == "img:1"
        )
        inst = fake.instances[iid]
        assert inst.proc is not None and inst.proc.proc is not None and inst.proc.proc.returncode is None
        assert inst.proc.env["CONTAINER_ID"] == str(iid) and inst.proc.env["VAST_URL"] == fake.url
        # a rented offer is no longer offered; a second create on it is refused as vast.ai does
        assert offer.id not in [o.id for o in await vast.search_offers(OfferQuery())]
        with pytest.raises(VastError, match=r"HTTP 404: invalid_args: error 404/3603: no_such_ask Instance type by id"):
            await vast.create_instance(offer.id, image="img:1", env={}, label="x")
        await vast.label_instance(iid, "renamed")
        assert [(r.id, r.label) for r in await vast.list_instances()] == [(iid, "renamed")]
        assert await vast.destroy_instance(iid) is True
        assert await vast.show_instance(iid) is None
        assert await vast.destroy_instance(iid) is False  # 404 not_found: already gone
        await asyncio.wait_for(inst.proc.proc.wait(), 10)  # its process group was killed
        assert offer.id in [o.id for o in await vast.search_offers(OfferQuery())]


async def test_status_goes_to_exited_when_the_process_dies() -> None:
    argv = [sys.executable, "-c", "import time, sys; time.sleep(0.3); sys.exit(3)"]
    async with FakeVast(api_key=KEY, faults="vast.boot_delay=0.05", node_argv=argv) as fake, client(fake) as vast:
        iid = await vast.create_instance(default_catalogue()[0]["id"], image="i", env={}, label="l")
        await wait_state(vast, iid, "running")
        rec = await wait_state(vast, iid, "exited")
        assert rec.status_msg == "container exited with status 3"
        # crashed, not destroyed: still intended running, its contract stopped
        assert (rec.intended_status, rec.cur_state, rec.next_state) == ("running", "stopped", "running")
        with pytest.raises(NeverRuns, match=r"is exited \(container exited with status 3\); it will never run"):
            await vast.wait_running(iid, 60, 0.02)
        await vast.destroy_instance(iid)


@pytest.mark.parametrize("fake", ["vast.never_running=0;vast.boot_delay=0.05"], indirect=True)
async def test_never_running_exhausts_the_polls(fake: FakeVast) -> None:
    async with client(fake) as vast:
        iid = await vast.create_instance(default_catalogue()[0]["id"], image="i", env={"STAGE": "0"}, label="l")
        with pytest.raises(
            TimeoutError, match=r"not running after 5 polls .* \(last status 'loading': Pulling image i\)"
        ):
            await vast.wait_running(iid, 5, 0.05)
        await vast.destroy_instance(iid)


async def test_list_follows_next_token_across_pages() -> None:
    catalogue = [dict(o) for o in default_catalogue() * 4]
    for i, o in enumerate(catalogue):
        o["id"] = 100 + i
    async with FakeVast(api_key=KEY, catalogue=catalogue, node_argv=SLEEPER) as fake, client(fake) as vast:
        ids = [await vast.create_instance(100 + i, image="i", env={}, label=f"l{i}") for i in range(30)]
        assert sorted(r.id or 0 for r in await vast.list_instances()) == ids
        assert sum(1 for m, p, _ in fake.requests if p == "/api/v1/instances/") == 2  # 25 + 5
        for iid in ids:
            await vast.destroy_instance(iid)


async def test_bad_key_is_refused_and_never_shown(fake: FakeVast) -> None:
    secret = "vk-WRONG-KEY-SHOULD-NOT-APPEAR"
    async with VastClient(secret, fake.url) as vast:
        with pytest.raises(VastError) as info:
            await vast.search_offers(OfferQuery())
    assert "HTTP 401: auth_error: Invalid user key" in str(info.value)  # vast.ai's words for a refused key
    assert secret not in str(info.value) and secret not in repr(vast)


async def test_a_container_key_acts_on_its_own_instance_only(fake: FakeVast) -> None:
    async with client(fake) as vast:
        a, b = [await vast.create_instance(o["id"], image="i", env={}, label="l") for o in default_catalogue()[:2]]
    key_a = fake.instances[a].container_key
    async with VastClient(key_a, fake.url) as own:
        with pytest.raises(VastError, match="HTTP 401"):
            await own.destroy_instance(b)
        with pytest.raises(VastError, match="HTTP 401"):
            await own.search_offers(OfferQuery())
        assert await own.destroy_instance(a) is True
    assert list(fake.instances) == [b]
    async with client(fake) as vast:
        await vast.destroy_instance(b)


@pytest.mark.parametrize("fake", ["vast.burst_429=3;vast.throttle_every=5"], indirect=True)
async def test_429_bursts_are_retried_with_backoff(fake: FakeVast) -> None:
    async with client(fake, rate_limit_first=0.01) as vast:
        for _ in range(4):
            assert len(await vast.search_offers(OfferQuery())) == 5
        assert vast.retries >= 6 and vast.calls == vast.retries + 4
    assert sum(s == 429 for _, _, s in fake.requests) == vast.retries


async def test_giving_up_names_the_call_and_the_attempts(fake: FakeVast) -> None:
    fake.faults = failpoints.parse("vast.burst_429=1000;vast.throttle_every=1001")
    async with client(fake, rate_limit_first=0.01, rate_limit_cap=0.02, rate_limit_window=0.2) as vast:
        with pytest.raises(
            VastError, match=r"POST /api/v0/bundles/: HTTP 429: rate limited: \d+ answers 429 over .*Too Many Requests"
        ):
            await vast.search_offers(OfferQuery())


async def test_every_call_has_a_timeout_and_a_dead_server_is_an_error() -> None:
    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(60)
        return web.Response()

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hang)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        async with VastClient(KEY, f"http://127.0.0.1:{port}", timeout=0.2, attempts=2, backoff=0.01) as vast:
            with pytest.raises(VastError, match=r"no answer: TimeoutError after 0.2 s \(after 2 attempts\)") as info:
                await asyncio.wait_for(vast.show_instance(1), 30)  # the 30 s only stops a hang: the message says
            # no aiohttp exception rides along: its request info holds the Authorization header
            assert info.value.__cause__ is None and info.value.__context__ is None
            assert KEY not in "".join(traceback.format_exception(info.value))
    finally:
        await runner.cleanup()
    async with VastClient(KEY, f"http://127.0.0.1:{port}", attempts=2, backoff=0.01) as vast:  # nothing listens now
        with pytest.raises(VastError, match=r"no answer: ClientConnectorError") as info:
            await vast.show_instance(1)
        assert KEY not in "".join(traceback.format_exception(info.value))


async def test_a_create_whose_answer_was_lost_is_found_by_its_label(fake: FakeVast) -> None:
    # the emulator rents the instance, then the answer is a 502 (a proxy dropped it)
    @web.middleware
    async def lossy(request: web.Request, handler: Any) -> web.StreamResponse:
        resp: web.StreamResponse = await handler(request)
        if request.method == "PUT" and request.path.startswith("/api/v0/asks/"):
            return web.Response(status=502, text="Bad Gateway")
        return resp

    app = fake.app()
    app.middlewares.append(lossy)  # inside the emulator's own: after its gate and the key
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        async with VastClient(KEY, f"http://127.0.0.1:{runner.addresses[0][1]}") as vast:
            iid = await vast.create_instance(default_catalogue()[0]["id"], image="i", env={}, label="ppsmoke-x-stage0")
            assert list(fake.instances) == [iid]  # one rented, not two
            await vast.destroy_instance(iid)
    finally:
        await runner.cleanup()


def test_offer_parsing_names_what_is_missing() -> None:
    with pytest.raises(VastError, match="an offer without a usable 'dph_total'"):
        offer_from_json({"id": 1})


# --- the official vastai CLI -------------------------------------------------------------------


def vastai(fake_url: str, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "VAST_URL": fake_url,  # also where the CLI's start-up GPU-name lookup goes
        "VAST_API_KEY": KEY,
        "VASTAI_NO_UPDATE_CHECK": "1",
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_CONFIG_HOME": str(home / ".config"),
    }
    out = subprocess.run(["vastai", *args], capture_output=True, text=True, env=env, timeout=60)
    assert "Traceback" not in out.stderr, out.stderr
    return out


def test_the_official_vastai_cli_works_against_the_emulator(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest_ppsmoke.cloud.emulator", "--node-command", shlex.join(SLEEPER)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "VAST_API_KEY": KEY},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")

        out = vastai(
            url, tmp_path, "search", "offers", "gpu_ram>=16 num_gpus=1 reliability>0.99", "-o", "dph+", "--raw"
        )
        offers = json.loads(out.stdout)
        assert [o["gpu_name"].strip() for o in offers] == [
            "RTX 5090", "B200", "RTX 3090", "RTX 4090", "RTX A6000", "L40S", "A100 SXM4", "H100 SXM"
        ]  # fmt: skip
        assert [o["dph_total"] for o in offers] == sorted(o["dph_total"] for o in offers)
        table = vastai(url, tmp_path, "search", "offers", "gpu_ram>=16", "-o", "dph+")
        assert "RTX_3090" in table.stdout and "Poland,_PL" in table.stdout  # the CLI's table shows _ for spaces
        assert " 24.6 " in table.stdout  # its VRAM column is GB; the REST answer's gpu_ram is MB (24576)

        assert len(json.loads(vastai(url, tmp_path, "search", "offers", "direct_port_count>=1", "--raw").stdout)) > 0
        env = "-e STAGE=0 -e MODEL=smollm2:135m -p 8080:8080 -p 7000:7000/udp"
        out = vastai(url, tmp_path, "create", "instance", str(offers[0]["id"]), "--image", "pp/gpu-node:1",
                     "--disk", "25", "--label", "cli-made", "--env", env, "--raw")  # fmt: skip
        created = json.loads(out.stdout)
        assert created["success"] is True
        iid = str(created["new_contract"])

        deadline = time.monotonic() + 20
        # this CLI prints vast.ai's padded strings as they come
        while (shown := stripped(json.loads(vastai(url, tmp_path, "show", "instance", iid, "--raw").stdout)))[
            "actual_status"
        ] != "running":
            assert time.monotonic() < deadline, shown["actual_status"]
            time.sleep(0.2)
        assert shown["label"] == "cli-made" and shown["image_uuid"] == "pp/gpu-node:1" and shown["disk_space"] == 25
        env = {k.strip(): v for k, v in dict(shown["extra_env"]).items()}  # the CLI made the padded pairs a dict
        assert env == {"STAGE": "0", "MODEL": "smollm2:135m"}  # -p is a port, not a variable
        # each port asked for, forwarded from a random public one, as docker writes its bindings
        assert sorted(shown["ports"]) == ["7000/udp", "8080/tcp"] and shown["public_ipaddr"] == "127.0.0.1"
        for bindings in shown["ports"].values():
            assert 20000 <= int(bindings[0]["HostPort"]) < 60000 and bindings[0]["HostIp"] == "0.0.0.0"

        out = vastai(url, tmp_path, "label", "instance", iid, "relabelled")
        assert f"label for {iid} set to relabelled." in out.stdout
        listed = stripped(json.loads(vastai(url, tmp_path, "show", "instances", "--raw").stdout))
        assert [(str(i["id"]), i["label"]) for i in listed] == [(iid, "relabelled")]
        assert vastai(url, tmp_path, "show", "instances", "-q").stdout.split() == [iid]
        assert "Traceback" not in vastai(url, tmp_path, "show", "instances").stderr  # the rich table renders

        out = vastai(url, tmp_path, "destroy", "instance", iid, "-y")
        assert f"destroying instance {iid}." in out.stdout
        assert json.loads(vastai(url, tmp_path, "show", "instances", "--raw").stdout) == []
        out = vastai(url, tmp_path, "show", "instance", iid)
        assert f"Instance {iid} not found" in out.stdout + out.stderr
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0

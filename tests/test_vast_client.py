"""The vast.ai client against vast.ai's misbehaviour: rate limits with penalty windows (retried on
their own jittered schedule, bounded by a window and the run's deadline, and paced once the
threshold is known), offers raced away between search and create, destroys of instances already
gone, lingering records. Against the emulator (instances are a small stand-in process), or a stub
server where an answer is needed that the emulator does not give. Limits are scaled down (tenths
of a second where vast.ai has seconds) to keep the tests fast. A test that counts 429s or holds a
wait to a window or a deadline runs the client, and the emulator's rate limiter, on a virtual clock
(:class:`Lockstep`): what it counts never depends on how busy the machine is."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web

from pytest_ppsmoke.cloud import vastdoc
from pytest_ppsmoke.cloud.emulator.catalogue import default_catalogue, search
from pytest_ppsmoke.cloud.emulator.server import FakeVast
from pytest_ppsmoke.cloud.vast import PACE_MARGIN, VastClient, endpoint_name, strip_strings
from pytest_ppsmoke.cloud.vastrecords import (
    ApiStats,
    Label,
    NeverRuns,
    OfferGone,
    OfferQuery,
    SearchQuotaExceeded,
    VastError,
    going_away,
    instance_from_json,
    search_body,
)
from pytest_ppsmoke.protocol import VAST_ENDPOINTS

from .helpers import SLEEPER

pytestmark = pytest.mark.local
KEY = "vk-test-0123456789abcdef-DISTINCT"
OFFERS = [int(o["id"]) for o in default_catalogue()]
TAKEN = len(search(default_catalogue(), search_body(OfferQuery())))  # the offers the default query takes


@asynccontextmanager
async def emulator(faults: str) -> AsyncIterator[FakeVast]:
    async with FakeVast(api_key=KEY, faults=f"vast.boot_delay=0.05;{faults}", node_argv=SLEEPER) as fake:
        yield fake
    assert not fake.live()


@asynccontextmanager
async def stub(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> AsyncIterator[str]:
    """A server that answers every request with ``handler``: answers the emulator does not give."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def refused(fake: FakeVast, path_part: str = "") -> int:
    return sum(s == 429 and path_part in p for _, p, s in fake.requests)


class Recording(random.Random):
    """A seeded Random that keeps each jittered wait it draws, with its bounds."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.drawn: list[tuple[float, float, float]] = []

    def uniform(self, a: float, b: float) -> float:
        v = super().uniform(a, b)
        self.drawn.append((a, b, v))
        return v


def test_endpoints_are_named_as_the_protocol_names_them() -> None:
    for (method, route), name in VAST_ENDPOINTS.items():
        assert endpoint_name(method, route.replace("{id}", "31337")) == name
    assert endpoint_name("PUT", "/api/v0/asks/7/") == "create"
    assert endpoint_name("GET", "/api/v0/instances/12/") == "show"
    assert endpoint_name("DELETE", "/api/v0/instances/12/") == "destroy"
    assert endpoint_name("GET", "/api/v9/odd/5/") == "GET /api/v9/odd/{id}/"


async def test_two_creates_back_to_back_get_through_the_penalty_window() -> None:
    # vast.ai: create's threshold 4.5 s, then a 12 s penalty; the 5xx schedule (here 2 attempts)
    # would give up inside it, the 429 schedule outlasts it
    async with on_lockstep("vast.rate_limit=create:0.4:1.2", attempts=2, backoff=0.01, rng=random.Random(1)) as (
        fake,
        vast,
    ):
        a = await vast.create_instance(OFFERS[0], image="i", env={}, label="ppsmoke-t-stage0")
        b = await vast.create_instance(OFFERS[1], image="i", env={}, label="ppsmoke-t-stage1")
        assert sorted(fake.instances) == sorted([a, b])  # one each: a 429 rents nothing
        create = vast.stats.of("create")
        assert create.rate_limited == refused(fake, "/asks/") >= 2  # refused, then refused in the penalty
        assert create.rate_limit_retries == create.rate_limited and create.retries == 0
        assert create.calls == create.rate_limited + 2 and create.retry_wait_s > 0
        assert vast.pace["create"] == pytest.approx(0.4 * PACE_MARGIN)  # learned from the 429's text
        assert vast.retries == create.rate_limited and vast.calls == vast.stats.total.calls
        summary = json.loads(json.dumps(vast.stats.summary()))
        assert summary["rate_limited"] == create.rate_limited == summary["endpoints"]["create"]["rate_limited"]
        assert summary["retry_wait_s"] == round(create.retry_wait_s, 3) > 0
        assert not any(p == "/api/v1/instances/" for _, p, _ in fake.requests)  # no label look-up on a 429
        for iid in (a, b):
            assert await vast.destroy_instance(iid) is True


async def test_a_threshold_known_beforehand_paces_from_the_first_call_and_no_create_is_refused() -> None:
    """``pace``: vast.ai's documented create threshold (scaled down here) spaces the creates from
    the first, so the second is never refused and no penalty is waited out; the wait is counted."""
    async with on_lockstep("vast.rate_limit=create:0.4:1.2", rng=random.Random(1), pace={"create": (1, 0.4)}) as (
        fake,
        vast,
    ):
        ids = [
            await vast.create_instance(o, image="i", env={}, label=f"ppsmoke-t-stage{i}")
            for i, o in enumerate(OFFERS[:2])
        ]
        create = vast.stats.of("create")
        assert (create.calls, create.rate_limited, refused(fake, "/asks/")) == (2, 0, 0)
        assert create.pace_wait_s == pytest.approx(vast.pace["create"]) and vast.pace["create"] == pytest.approx(
            0.4 * PACE_MARGIN
        )
        assert sorted(fake.instances) == sorted(ids)
        for iid in ids:
            assert await vast.destroy_instance(iid) is True
    with pytest.raises(ValueError, match="too small"):
        VastClient(KEY, pace={"create": (1, 0)})
    assert vastdoc.pace(scale=1)["create"] == (1, 4.5)  # vast.ai's documented create threshold


class Lockstep:
    """A virtual clock shared by a client (its ``clock`` and ``sleep``) and the emulator's rate
    limiter: time moves only when the client sleeps, and only once the emulator has answered every
    request the client has sent (the emulator's only client here). So the emulator sees each call
    at the time the client sent it: what it counts depends on the client's spacing alone, never on
    how the machine schedules the two. Without an emulator (a stub server) the clock is the
    client's alone."""

    def __init__(self, fake: FakeVast | None = None) -> None:
        self.now, self.fake = 1000.0, fake
        self.client: VastClient | None = None
        if fake is not None:
            fake.limiter.clock = self

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        assert self.client is not None, "Lockstep.client: the client that sleeps on this clock"
        try:
            async with asyncio.timeout(30):
                while self.fake is not None and len(self.fake.requests) < self.client.calls:
                    await asyncio.sleep(0.001)  # real time: the emulator answering the client's last call
        except TimeoutError:
            answered = len(self.fake.requests) if self.fake is not None else 0
            raise AssertionError(
                f"the emulator answered {answered} of the client's {self.client.calls} calls within 30 s"
            ) from None
        self.now += max(seconds, 0.0)
        await asyncio.sleep(0)


@asynccontextmanager
async def on_lockstep(faults: str, **client: Any) -> AsyncIterator[tuple[FakeVast, VastClient]]:
    """The emulator and a client on one :class:`Lockstep` clock."""
    async with emulator(faults) as fake:
        clock = Lockstep(fake)
        async with VastClient(KEY, fake.url, clock=clock, sleep=clock.sleep, **client) as vast:
            clock.client = vast
            yield fake, vast


async def test_pacing_learned_from_the_threshold_stops_further_429s() -> None:
    async with on_lockstep("vast.rate_limit=show:0.15", rng=random.Random(2), pace={}) as (fake, vast):
        a, b = [await vast.create_instance(o, image="i", env={}, label=f"l{o}") for o in OFFERS[:2]]
        await vast.show_instance(a)
        await vast.show_instance(b)  # too soon: one 429, then the endpoint is paced
        assert refused(fake) == 1 and vast.pace == {"show": pytest.approx(0.15 * PACE_MARGIN)}
        for _ in range(3):  # two instances polled together: sent one at a time, spaced
            recs = await asyncio.gather(vast.show_instance(a), vast.show_instance(b))
            assert [r.id for r in recs if r] == [a, b]
        show = vast.stats.of("show")
        assert refused(fake) == show.rate_limited == 1 and show.calls == 9
        assert show.pace_wait_s == pytest.approx(6 * vast.pace["show"])  # the 6 waited the pace, no more
        # the other endpoints are not paced
        await asyncio.gather(*(vast.search_offers(OfferQuery()) for _ in range(3)))
        assert vast.stats.of("search").pace_wait_s == 0 and vast.stats.of("create").pace_wait_s == 0
        for iid in (a, b):
            await vast.destroy_instance(iid)
        assert vast.stats.of("destroy").pace_wait_s == 0 and refused(fake) == 1


async def test_429_waits_are_jittered_within_half_to_full() -> None:
    waited = []
    for seed in (1, 2):
        rng = Recording(seed)
        async with (
            emulator("vast.burst_429=4;vast.throttle_every=1000") as fake,
            VastClient(KEY, fake.url, attempts=2, rate_limit_first=0.02, rate_limit_cap=0.1, rng=rng) as vast,
        ):
            assert len(await vast.search_offers(OfferQuery())) == TAKEN
            search = vast.stats.of("search")
        assert [(a, b) for a, b, _ in rng.drawn] == [(0.01, 0.02), (0.02, 0.04), (0.04, 0.08), (0.05, 0.1)]
        assert all(a <= v <= b for a, b, v in rng.drawn)
        assert search.rate_limited == search.rate_limit_retries == 4 and search.calls == 5
        assert search.retry_wait_s == pytest.approx(sum(v for *_, v in rng.drawn))
        waited.append(search.retry_wait_s)
    assert waited[0] != waited[1]  # two clients refused together do not come back together


async def test_a_retry_after_is_waited_exactly_and_one_past_a_minute_ends_the_call() -> None:
    """vast-cli's rule: a 429's Retry-After is the wait (no jitter) up to 60 s; a longer one is
    not waited out. The emulator sends it when vast.retry_after says so."""
    async with (
        emulator("vast.burst_429=2;vast.throttle_every=1000;vast.retry_after=0.3") as fake,
        VastClient(KEY, fake.url, rng=Recording(1)) as vast,
    ):
        assert len(await vast.search_offers(OfferQuery())) == TAKEN
        search = vast.stats.of("search")
        assert search.rate_limited == search.rate_limit_retries == 2 and search.calls == 3
        assert search.retry_wait_s == pytest.approx(0.6)  # 2 x 0.3 s, not the jittered schedule
        assert vast.rng.drawn == []  # type: ignore[attr-defined]
    async with on_lockstep("vast.burst_429=1;vast.throttle_every=1000;vast.retry_after=120") as (fake, vast):
        started = vast.clock()
        with pytest.raises(VastError) as info:
            await vast.search_offers(OfferQuery())
        assert vast.clock() == started and refused(fake) == 1  # no time waited at all
    assert "gave up: vast.ai asks to wait 120 s (Retry-After), more than 60 s" in str(info.value)


async def test_the_daily_search_quota_ends_the_search_at_once() -> None:
    async with emulator("vast.search_quota") as fake, VastClient(KEY, fake.url) as vast:
        with pytest.raises(SearchQuotaExceeded) as info:
            await vast.search_offers(OfferQuery())
        assert vast.stats.of("search").calls == 1  # not retried: it resets at midnight UTC
    message = str(info.value)
    assert info.value.status == 429 and "daily search quota is used up" in message and "resets at 20" in message


async def test_429s_give_up_at_the_window_naming_the_call_and_the_429s() -> None:
    schedule = {"rate_limit_first": 0.02, "rate_limit_cap": 0.05, "rate_limit_window": 0.3}
    async with on_lockstep("vast.burst_429=1000;vast.throttle_every=1001", **schedule) as (fake, vast):
        with pytest.raises(VastError) as info:
            await vast.search_offers(OfferQuery())
        search = vast.stats.of("search")
    assert info.value.status == 429 and KEY not in str(info.value)
    assert str(info.value).startswith(
        f"vast.ai POST /api/v0/bundles/: HTTP 429: rate limited: {search.rate_limited} answers 429 over "
    )
    assert str(info.value).endswith(
        "(Too Many Requests); gave up: the next retry would end past the 0.3 s rate-limit window"
    )
    assert search.rate_limited == refused(fake) >= 4 and search.rate_limit_retries == search.rate_limited - 1
    assert search.retry_wait_s <= 0.3


async def test_429s_give_up_at_the_runs_deadline_and_creates_do_too() -> None:
    async def always_429(request: web.Request) -> web.Response:
        return web.Response(status=429, text="API requests too frequent endpoint threshold=0.01")

    clock = Lockstep()
    schedule = {"rate_limit_first": 0.02, "rate_limit_cap": 0.05}
    async with stub(always_429) as url, VastClient(KEY, url, clock=clock, sleep=clock.sleep, **schedule) as vast:
        clock.client = vast
        vast.deadline = clock() + 0.3
        with pytest.raises(
            VastError, match=r"gave up: the next retry would end past the run's budget \(0\.\d s left\)"
        ):
            await vast.show_instance(5)
        vast.deadline = clock()  # the budget is spent: no retry at all
        with pytest.raises(
            VastError, match=r"PUT /api/v0/asks/7/: HTTP 429: rate limited: 1 answer 429 over .* past the run's budget"
        ):
            await vast.create_instance(7, image="i", env={}, label="l")
        assert vast.stats.of("create").calls == 1 and vast.stats.of("list").calls == 0
        vast.deadline = None
        vast.rate_limit_window = 0.2
        with pytest.raises(VastError, match=r"PUT /api/v0/asks/7/: HTTP 429: rate limited: .* rate-limit window"):
            await vast.create_instance(7, image="i", env={}, label="l")
        assert vast.stats.of("create").rate_limited >= 3 and vast.stats.of("list").calls == 0


async def test_5xx_keeps_the_sdk_schedule() -> None:
    async def bad_gateway(request: web.Request) -> web.Response:
        return web.Response(status=502, text="Bad Gateway")

    async with stub(bad_gateway) as url, VastClient(KEY, url, backoff=0.01) as vast:
        with pytest.raises(VastError, match=r"GET /api/v0/instances/5/: HTTP 502: Bad Gateway \(after 6 attempts\)"):
            await vast.show_instance(5)
        show = vast.stats.of("show")
        assert (show.calls, show.retries, show.rate_limited) == (6, 5, 0)
        assert show.retry_wait_s == pytest.approx(sum(0.01 * 1.5**k for k in range(5)))


async def test_a_raced_away_offer_is_offer_gone_and_other_rejections_are_not() -> None:
    async with emulator("vast.race_offers=1:410,2:404;vast.reject_create=5") as fake, VastClient(KEY, fake.url) as vast:
        for status, gone in (
            (410, "no_such_ask: error 410/3907: no_such_ask Instance type {} is no longer available."),
            (404, "invalid_args: error 404/3603: no_such_ask Instance type by id {} is not available."),
        ):  # create_instance.yaml's answers
            offer = (await vast.search_offers(OfferQuery()))[0].id
            with pytest.raises(OfferGone) as info:  # someone else rented it between our search and create
                await vast.create_instance(offer, image="i", env={}, label="a")
            assert str(info.value) == (
                f"vast.ai PUT /api/v0/asks/{offer}/: HTTP {status}: {gone.format(offer)} "
                "(the offer was taken between search and create)"
            )
            assert info.value.status == status and offer not in [o.id for o in await vast.search_offers(OfferQuery())]
        offer = (await vast.search_offers(OfferQuery()))[0].id
        iid = await vast.create_instance(offer, image="i", env={}, label="a")  # the next offer is there to rent
        with pytest.raises(
            OfferGone, match=r"HTTP 404: invalid_args: error 404/3603: no_such_ask Instance type by id \d+ "
        ):
            await vast.create_instance(offer, image="i", env={}, label="b")  # rented since (here, by us)
        with pytest.raises(VastError, match="HTTP 400: invalid_args") as other:
            await vast.create_instance(OFFERS[-1], image="i", env={}, label="c")
        assert not isinstance(other.value, OfferGone)
        assert vast.stats.of("create").calls == 5  # none is retried
        assert list(fake.instances) == [iid]
        await vast.destroy_instance(iid)

    async def answers(request: web.Request) -> web.Response:
        offer = int(request.match_info["tail"].split("/")[3])
        if offer == 410:
            return web.json_response(
                {"success": False, "error": "no_such_ask", "msg": "Offer 410 is no longer available"}, status=410
            )
        return web.json_response({"success": False, "error": "not_found", "msg": "no such thing"}, status=404)

    async with stub(answers) as url, VastClient(KEY, url) as vast:
        with pytest.raises(OfferGone, match=r"HTTP 410: no_such_ask: Offer 410 is no longer available \(the offer"):
            await vast.create_instance(410, image="i", env={}, label="l")
        with pytest.raises(VastError, match="HTTP 404: not_found") as info:
            await vast.create_instance(404, image="i", env={}, label="l")
        assert not isinstance(info.value, OfferGone)
        assert vast.stats.of("create").calls == 2  # neither is retried


async def test_a_list_of_instances_is_destroyed_in_one_call_and_a_refusal_fails_it() -> None:
    """vast-cli's SDK destroys a list with one ``DELETE /api/v0/instances/``: the client sends it,
    the emulator takes it (one already gone is no failure); an answer that says it failed fails
    it (the teardown then destroys each alone)."""
    async with emulator("") as fake, VastClient(KEY, fake.url) as vast:
        a, b = [await vast.create_instance(o, image="i", env={}, label=f"l{o}") for o in OFFERS[:2]]
        await vast.destroy_instances([a, 424242])
        assert [i.id for i in fake.live()] == [b] and vast.stats.of("destroy_many").calls == 1
        await vast.destroy_instances([b])
        assert fake.live() == [] and vast.stats.of("destroy").calls == 0

    async def refusing(request: web.Request) -> web.Response:
        assert request.method == "DELETE" and await request.json() == {"instance_ids": [1, 2]}
        return web.json_response({"success": False, "error": "invalid_args", "msg": "no such instances"})

    async with stub(refusing) as url, VastClient(KEY, url) as vast:
        with pytest.raises(VastError, match=r"DELETE /api/v0/instances/.*invalid_args: no such instances"):
            await vast.destroy_instances([1, 2])


async def test_destroy_of_an_instance_already_gone_is_false() -> None:
    async with emulator("") as fake, VastClient(KEY, fake.url) as vast:
        assert await vast.destroy_instance(424242) is False

    async def gone(request: web.Request) -> web.Response:
        if request.match_info["tail"].endswith("/1/"):  # vast.ai's documented answer
            return web.json_response({"success": False, "error": "not_found", "msg": "Instance not found"}, status=404)
        if request.match_info["tail"].endswith("/2/"):
            return web.Response(status=404, text="Not Found")  # a proxy's plain text
        return web.json_response({"success": False, "error": "forbidden", "msg": "not yours"}, status=403)

    async with stub(gone) as url, VastClient(KEY, url) as vast:
        assert await vast.destroy_instance(1) is False
        assert await vast.destroy_instance(2) is False
        with pytest.raises(VastError, match="HTTP 403: forbidden: not yours"):
            await vast.destroy_instance(3)


def test_going_away_reads_the_state_fields() -> None:
    def gone(record: dict[str, Any]) -> bool:
        return going_away(instance_from_json(record))

    lingering = {"actual_status": "running", "cur_state": "running", "intended_status": "stopped"}
    assert gone({**lingering, "next_state": "stopped"})
    assert gone({**lingering, "next_state": "stopped", "actual_status": "exited", "cur_state": "stopped"})
    assert going_away(None)  # not listed at all
    assert not gone({**lingering, "next_state": "running"})  # still on its way up
    assert not gone({"actual_status": "exited", "intended_status": "running", "next_state": "running"})  # crashed
    assert not gone(lingering)  # next_state missing: nothing says it is going away
    # as vast.ai's sources show a destroyed instance: its contract released (the docs' cur_state
    # "unloaded"), a status vast-cli reads as gone (destroyed, terminated, offline), padded or not
    held = {"actual_status": "running", "intended_status": "running", "next_state": "running", "cur_state": "running"}
    assert not gone(held)  # a destroy that was lost: everything still says running
    assert gone({**held, "cur_state": "unloaded"})
    assert gone({**held, "cur_state": " unloaded\n"}) is False  # Instance.from_json keeps what it is given ...
    assert going_away(instance_from_json(strip_strings({**held, "cur_state": " unloaded\n"})))  # ... the client strips
    for status in ("destroyed", "terminated"):
        assert gone({**held, "intended_status": status}) and gone({**held, "actual_status": status})
    assert gone({**held, "actual_status": "offline"})  # vast-cli's instance_exist: an offline host bills nothing
    assert not gone({"actual_status": "exited"})
    assert not gone({"intended_status": None, "next_state": "stopped"})
    assert not gone({"intended_status": 0, "next_state": "stopped"})  # not a state: as if missing
    # vast.ai's destroy releases the contract (cur_state unloaded) and leaves intended_status running
    assert gone({"actual_status": "running", "intended_status": "running", "cur_state": "unloaded"})
    assert gone({"actual_status": "destroyed"}) and gone({"intended_status": "terminated"})


def test_an_instance_record_is_decoded_once_tolerating_missing_and_extra_fields() -> None:
    record = {
        "id": 7,
        "label": "ppsmoke-20260101T000000-ab12cd-stage1",
        "actual_status": "running",
        "status_msg": None,
        "start_date": 1.5,
        "dph_total": 0.3,
        "gpu_name": "RTX 4090",
        "extra": [1],
    }
    inst = instance_from_json(record)
    assert (inst.id, inst.actual_status, inst.intended_status, inst.status_msg, inst.start_date) == (
        7, "running", None, "", 1.5,
    )  # fmt: skip
    assert inst.run_label == Label("20260101T000000-ab12cd", 1) and inst.raw is record
    assert inst.names() == {k: record.get(k) for k in ("id", "label", "actual_status", "intended_status", "next_state")}
    assert (inst.machine.dph_total, inst.machine.gpu_name, inst.machine.num_gpus) == (0.3, "RTX 4090", 1)
    bare = instance_from_json({})
    assert (bare.id, bare.label, bare.actual_status, bare.status_msg, bare.run_label) == (None, None, None, "", None)
    assert (bare.machine.id, bare.machine.gpu_name, bare.machine.dph_total) == (0, "?", 0.0)
    assert instance_from_json({"start_date": 17, "id": True}).start_date is None  # not a float, not an id
    with pytest.raises(VastError, match="expected an instance record, got a list of 0"):
        instance_from_json([])


def test_a_label_is_formatted_and_parsed_in_one_place() -> None:
    label = Label("20260101T000000-ab12cd", 3)
    assert label.format() == str(label) == "ppsmoke-20260101T000000-ab12cd-stage3"
    assert Label.parse(label.format()) == label and label.format().startswith(Label.prefix(label.run_id))
    assert Label.prefix() == "ppsmoke-" and Label.prefix("r") == "ppsmoke-r-"
    assert Label.parse("ppsmoke-r-stage12") == Label("r", 12)
    for other in (None, "", "renamed", "ppsmoke-r-stage", "ppsmoke-r-stagex", "ppsmoke--stage1", "x-r-stage1"):
        assert Label.parse(other) is None, other


async def test_gpu_ram_is_sent_and_kept_in_mb() -> None:
    assert search_body(OfferQuery(gpu_ram_gb=16))["gpu_ram"] == {"gte": 16000}
    async with emulator("") as fake, VastClient(KEY, fake.url) as vast:
        # 24,570 MB: the 3090's 24,576 MB passes, the 4090s' 24,564 MB do not (in GB or GiB, all or none would)
        offers = await vast.search_offers(OfferQuery(gpu_ram_gb=24.57))
        assert [(o.gpu_name, o.gpu_ram_mb) for o in offers] == [
            ("RTX 3090", 24576), ("RTX A6000", 49140), ("L40S", 46068), ("A100 SXM4", 81920)
        ]  # fmt: skip
        assert offers[0].summary()["gpu_ram_mb"] == 24576


async def test_a_padded_host_with_a_heartbeat_gap_runs_and_its_address_is_clean() -> None:
    """vast.ai pads the strings it serves, and a host may miss its heartbeats while it boots
    (``unknown``): the boot polls through the gap (vast-cli's wait fails on offline, stopped and
    exited only), reads ``" running\\n"`` as running, and the address it gives iroh has no
    whitespace. Without the strip the wait would never see running."""
    shown: list[str] = []
    states = [" loading\n", "unknown ", "unknown\n", "running \n"]

    async def show(request: web.Request) -> web.Response:
        state = states[min(len(shown), len(states) - 1)]
        shown.append(state)
        record = {
            "id": 7, "actual_status": state, "status_msg": " no recent heartbeat from the host\n",
            "label": " ppsmoke-r1-stage0\n", "public_ipaddr": "203.0.113.7\n", "cur_state": "running ",
            "ports": {"7000/udp": [{"HostIp": "0.0.0.0", "HostPort": " 41234\n"}]},
        }  # fmt: skip
        return web.Response(text=json.dumps({"instances": record}), content_type="application/json")

    async with stub(show) as url, VastClient(KEY, url) as vast:
        record = await vast.wait_running(7, 10, 0.01)
    assert len(shown) == 4 and record.actual_status == "running" and record.label == "ppsmoke-r1-stage0"
    assert record.public_udp(7000) == "203.0.113.7:41234" and record.run_label == Label("r1", 0)
    assert strip_strings({"a": [" x\n", {"b": " y"}], " k ": 3}) == {"a": ["x", {"b": "y"}], " k ": 3}


def test_the_query_admits_only_gpus_the_image_compiles_for_and_prices_the_disk_rented() -> None:
    """vast.ai prices ``dph_total`` for the search's ``allocated_storage`` (its default 8 GB): the
    query sends the disk the create rents, so the price filter, the pre-flight's worst case and the
    report's cost include it. ``compute_cap`` bounds the GPUs to what the image's NVRTC compiles for
    (Blackwell's 1000 and 1200 out), ``inet_down`` the hosts to those that download in time."""
    body = search_body(OfferQuery(disk_gb=35))
    assert body["allocated_storage"] == 35 and body["disk_space"] == {"gte": 35}
    assert body["compute_cap"] == {"gte": 600, "lte": 900} and body["inet_down"] == {"gte": 200.0}
    assert "inet_down" not in search_body(OfferQuery(min_inet_down=0))
    text = OfferQuery(disk_gb=35).describe()
    assert "compute capability 6-9" in text and "with 35 GB of storage" in text and ">= 200 Mbit/s" in text


def test_stats_summary_totals_the_endpoints() -> None:
    stats = ApiStats()
    stats.of("create").rate_limited, stats.of("create").retry_wait_s = 3, 1.23456
    stats.of("show").calls, stats.of("show").pace_wait_s = 4, 0.5
    summary = stats.summary()
    assert summary["rate_limited"] == 3 and summary["calls"] == 4
    assert summary["retry_wait_s"] == 1.235 and summary["pace_wait_s"] == 0.5
    assert list(summary["endpoints"]) == ["create", "show"] and summary["endpoints"]["create"]["retry_wait_s"] == 1.235
    assert json.loads(json.dumps(summary)) == summary


def test_the_schedule_is_checked() -> None:
    with pytest.raises(ValueError, match=r"0 < first <= cap"):
        VastClient(KEY, rate_limit_first=10, rate_limit_cap=8)
    with pytest.raises(ValueError, match=r"window > 0"):
        VastClient(KEY, rate_limit_window=0)


@pytest.mark.parametrize("state", ["stopped", "frozen", "loading"])
async def test_the_boot_wait_ends_at_once_on_stopped_and_frozen_and_polls_a_slow_host(state: str) -> None:
    """SkyPilot's reading: a ``stopped`` or ``frozen`` instance failed to provision; a host that
    is merely slow (``loading``, no error in its message) gets every poll."""
    shown = 0

    async def show(request: web.Request) -> web.Response:
        nonlocal shown
        shown += 1
        record = {"id": 7, "actual_status": state, "status_msg": "Pulling image x: 40%" if state == "loading" else ""}
        return web.json_response({"instances": record})

    async with stub(show) as url, VastClient(KEY, url) as vast:
        if state == "loading":
            with pytest.raises(TimeoutError, match="not running after 5 polls"):
                await vast.wait_running(7, 5, 0.01)
            assert shown == 5
        else:
            with pytest.raises(NeverRuns, match=f"instance 7 is {state} \\(no status message\\); it will never run"):
                await vast.wait_running(7, 60, 0.01)
            assert shown == 1


async def test_request_logs_reads_the_result_url_without_the_key_polling_until_it_is_uploaded() -> None:
    """vast-cli's two calls: ``request_logs`` (the key, ``tail`` as a string), then the result URL,
    read with no key, every 0.3 s while it answers anything but 200; on the client's clock, and
    given up at its deadline, naming the reads."""
    seen: list[tuple[str, str, str | None, Any]] = []  # method, path, Authorization, body
    uploaded_after = {"reads": 3}

    async def handler(request: web.Request) -> web.Response:
        body = await request.json() if request.body_exists else None
        seen.append((request.method, request.path, request.headers.get("Authorization"), body))
        if request.method == "PUT":
            url = f"{request.url.origin()}/uploads/log-token-1"
            return web.json_response({"success": True, "result_url": url, "msg": "logs uploaded"})
        reads = sum(1 for m, *_ in seen if m == "GET")
        if reads < uploaded_after["reads"]:
            return web.Response(status=404, text="NoSuchKey")
        return web.Response(text="line one\nmarker: here\n")

    async with stub(handler) as url:
        clock = Lockstep()
        async with VastClient(KEY, url, clock=clock, sleep=clock.sleep) as vast:
            clock.client = vast
            start = clock()
            assert await vast.request_logs(12, 50) == "line one\nmarker: here\n"
            assert clock() - start == pytest.approx(2 * 0.3)  # two reads too early, 0.3 s apart
            assert seen[0] == ("PUT", "/api/v0/instances/request_logs/12/", f"Bearer {KEY}", {"tail": "50"})
            assert [(m, p, a) for m, p, a, _ in seen[1:]] == [("GET", "/uploads/log-token-1", None)] * 3
            assert vast.stats.of("logs").calls == 1 and vast.stats.of("logs_result").calls == 3

            seen.clear()
            uploaded_after["reads"] = 1000  # never uploaded: the deadline ends the polls
            vast.deadline = clock() + 1.0
            with pytest.raises(VastError, match=r"not uploaded before the deadline \(4 reads; HTTP 404\)") as e:
                await vast.request_logs(12, 50)
            assert "log-token-1" not in str(e.value) and KEY not in str(e.value)
            assert all(a is None for m, _, a, _ in seen if m == "GET")
            with pytest.raises(ValueError, match="tail must be a number of lines >= 1, got 0"):
                await vast.request_logs(12, 0)


async def test_a_log_the_emulator_never_finishes_uploading_ends_the_client_s_reads_naming_them() -> None:
    """vast.log_upload past the client's reads: its 30 reads, 0.3 s apart on its own clock, each
    answered with S3's 404, then an error that names them; the token is not in it."""
    async with emulator("vast.log_upload=3600") as fake:
        clock = Lockstep()
        async with VastClient(KEY, fake.url, clock=clock, sleep=clock.sleep) as vast:
            clock.client = vast
            iid = await vast.create_instance(OFFERS[0], image="i", env={}, label="ppsmoke-t-stage0")
            with pytest.raises(VastError, match=r"the log was not uploaded after 30 reads \(HTTP 404\)") as e:
                await vast.request_logs(iid, 5)
            assert "/ppsmoke/logs/..." in str(e.value) and KEY not in str(e.value)
            reads = [s for m, p, s in fake.requests if m == "GET" and p.startswith("/ppsmoke/logs/")]
            assert reads == [404] * 30 and vast.stats.of("logs_result").calls == 30
            await vast.destroy_instance(iid)


async def test_a_result_url_that_redirects_forever_fails_without_its_token_in_the_error() -> None:
    """aiohttp's error for a redirect loop quotes the URL it was reading, signature and token
    included: the client's error quotes neither (it lands in a failure's words and the report)."""
    token, signature = "tok-5f2b9c1e", "X-Amz-Signature=sig-77aa"

    async def handler(request: web.Request) -> web.Response:
        if request.method == "PUT":
            url = f"{request.url.origin()}/uploads/{token}?{signature}"
            return web.json_response({"success": True, "result_url": url, "msg": "logs uploaded"})
        raise web.HTTPFound(str(request.url))  # itself, again and again

    async with stub(handler) as url:
        clock = Lockstep()
        async with VastClient(KEY, url, clock=clock, sleep=clock.sleep) as vast:
            clock.client = vast
            with pytest.raises(VastError, match=r"not uploaded after 30 reads \(TooManyRedirects") as e:
                await vast.request_logs(12, 50)
    said = str(e.value)
    assert token not in said and "sig-77aa" not in said and KEY not in said, said
    assert "/uploads/..." in said


async def test_request_logs_against_the_emulator_records_both_calls() -> None:
    async with emulator("") as fake, VastClient(KEY, fake.url) as vast:
        iid = await vast.create_instance(OFFERS[0], image="i", env={}, label="ppsmoke-t-stage0")
        assert vast.container_keys[iid] == fake.instances[iid].container_key
        text = await vast.request_logs(iid, 5)
        assert isinstance(text, str) and len(text.splitlines()) <= 5
        calls = [(m, p.split("/ppsmoke/logs/")[0], s) for m, p, s in fake.requests if "logs" in p]
        # the request, then the result URL read until its upload is done (404 until then)
        assert calls[0] == ("PUT", f"/api/v0/instances/request_logs/{iid}/", 200) and calls[-1] == ("GET", "", 200)
        assert {c[:2] for c in calls[1:]} == {("GET", "")} and {c[2] for c in calls[1:-1]} <= {404}, calls
        await vast.destroy_instance(iid)


async def test_a_404_without_no_such_ask_fails_the_create_naming_it() -> None:
    """Only a 404 whose ``msg`` names ``no_such_ask`` (create_instance.yaml's taken offer) or a
    410 ``no_such_ask`` is an offer gone; a 404 in the same shape that does not name it fails the
    create at once, not retried, naming its answer, so the rent ends there."""

    async def answers(request: web.Request) -> web.Response:
        offer = int(request.match_info["tail"].split("/")[3])
        msg = f"error 404/3603: no_such_ask Instance type by id {offer} is not available."
        if offer == 2:
            msg = "error 404/9999: Instance type by id 2 is unknown."
        return web.json_response({"success": False, "error": "invalid_args", "msg": msg, "ask_id": offer}, status=404)

    async with stub(answers) as url, VastClient(KEY, url) as vast:
        with pytest.raises(
            OfferGone, match=r"HTTP 404: invalid_args: error 404/3603: no_such_ask Instance type by id 1 "
        ):
            await vast.create_instance(1, image="i", env={}, label="l")
        with pytest.raises(VastError) as info:
            await vast.create_instance(2, image="i", env={}, label="l")
        assert not isinstance(info.value, OfferGone) and info.value.status == 404
        assert str(info.value) == (
            "vast.ai PUT /api/v0/asks/2/: HTTP 404: invalid_args: error 404/9999: Instance type by id 2 is unknown."
        )
        assert vast.stats.of("create").calls == 2

"""vast.ai's limits read from its OpenAPI files (``cloud/vastdoc.py``): the one table that both the
emulator's limiter and the client's pace come from."""

from __future__ import annotations

import asyncio
import itertools
import shutil
from pathlib import Path

import pytest

from pytest_ppsmoke.cloud import vastdoc
from pytest_ppsmoke.cloud.emulator.server import FakeVast
from pytest_ppsmoke.cloud.vast import PACE_MARGIN, VastClient
from pytest_ppsmoke.cloud.vastdoc import RateLimit
from pytest_ppsmoke.protocol import VAST_ENDPOINTS

from .memprovider import MemProvider, VirtualClock, offers
from .smoke import KEY
from .test_provider import rent_all, rental

pytestmark = pytest.mark.local


def test_the_table_is_read_from_the_vendored_files_by_endpoint_name() -> None:
    limits = vastdoc.rate_limits(scale=1, folder=vastdoc.DOCS)
    assert limits == {
        "create": RateLimit(4.5, 12.0),
        "show": RateLimit(2.0),
        "list": RateLimit(1.0),
        "label": RateLimit(1.0),
        "destroy": RateLimit(3.0),
        "search": RateLimit(requests=10, window=60.0),
        "destroy_many": RateLimit(3.0),  # not in the files (vast-cli's SDK calls it): held to a destroy's
    }
    assert set(vastdoc.endpoints(vastdoc.DOCS)) <= set(VAST_ENDPOINTS.values())
    inputs = vastdoc.input_limits(vastdoc.DOCS)
    assert inputs["create"]["label"]["max_length"] == 256 and inputs["label"]["label"]["max_length"] == 1024
    assert vastdoc.pace(scale=0.5, folder=vastdoc.DOCS)["create"] == (1, 2.25)
    assert vastdoc.pace(scale=1, folder=vastdoc.DOCS)["search"] == (10, 60.0)


async def test_a_changed_threshold_in_a_copy_moves_the_emulator_and_the_client_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / "openapi"
    shutil.copytree(vastdoc.DOCS, copy)
    create = copy / "create_instance.yaml"
    text = create.read_text()
    assert "  threshold: 4.5\n  penalty: 12\n" in text
    create.write_text(text.replace("  threshold: 4.5\n  penalty: 12\n", "  threshold: 7.5\n  penalty: 20\n"))
    monkeypatch.setenv(vastdoc.ENV_DIR, str(copy))
    monkeypatch.setenv(vastdoc.ENV_SCALE, "1")
    assert vastdoc.rate_limits()["create"] == RateLimit(7.5, 20.0)
    fake = FakeVast(api_key=KEY)  # its limits: the failpoint's default, the documented table
    assert fake.limiter.limits["create"] == RateLimit(7.5, 20.0)
    assert VastClient(KEY, "http://127.0.0.1:9").pace["create"] == pytest.approx(7.5 * PACE_MARGIN)
    monkeypatch.setenv(vastdoc.ENV_SCALE, "0.1")  # the suite's time scale: both sides again
    assert FakeVast(api_key=KEY).limiter.limits["create"] == RateLimit(0.75, 2.0)
    assert VastClient(KEY, "http://127.0.0.1:9").pace["create"] == pytest.approx(0.75 * PACE_MARGIN)
    monkeypatch.setenv(vastdoc.ENV_SCALE, "0")
    with pytest.raises(ValueError, match="PP_VAST_TIME_SCALE"):
        vastdoc.time_scale()


def within(times: list[float], limit: RateLimit) -> bool:
    """Whether calls made at ``times`` keep within ``limit`` as the provider counts them."""
    times = sorted(times)
    if limit.requests:
        return all(b - a >= limit.window for a, b in zip(times, times[limit.requests :], strict=False))
    return all(b - a >= limit.threshold for a, b in itertools.pairwise(times))


@pytest.mark.parametrize("stages", [2, 8])
async def test_the_boot_waits_lists_and_destroys_keep_within_vast_ais_documented_limits(stages: int) -> None:
    """vast.ai's own table (read from its files, at its own seconds) paces the shared code on a
    virtual clock: 2 and 8 stages rented, their boots watched with one list a round (not a show per
    instance: show's 2 s is per client), the hosts watched, then destroyed in parallel; every
    endpoint's calls keep within its limit, and none waited a penalty."""
    limits = vastdoc.rate_limits(scale=1)
    assert limits["create"] == RateLimit(4.5, 12.0) and limits["show"].threshold == 2.0
    clock = VirtualClock()
    provider = MemProvider(clock, catalogue=offers(stages + 2), boot_s=[20.0, 45.0], pace=vastdoc.pace(scale=1))
    r = rental(provider, clock, num_stages=stages)
    try:
        await rent_all(r)
        await asyncio.gather(*(r.wait_running(i) for i in r.instances))
        lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        watch = asyncio.ensure_future(r.watch(lost))
        await clock.sleep(30.0)
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        assert not lost.done()
    finally:
        torn = clock()
        await r.close()
    assert not provider.live() and provider.calls["create"] == stages
    for name, times in provider.times.items():
        if name in limits:
            assert within(times, limits[name]), (name, times)
    # the boot waits' polls were lists, one a round for all; the destroys went out in one call,
    # checked by one list: the teardown is not 3 s per instance more (one by one, 8 stages: 21 s)
    assert provider.calls["destroy_many"] == 1 and provider.calls["destroy"] == provider.calls["show"] == 0
    assert r.board.lists >= 2 and clock() - torn < limits["destroy"].threshold
    # ... and the creates spaced by create's threshold took (stages - 1) x 4.5 s at least
    assert provider.times["create"][-1] - provider.times["create"][0] >= (stages - 1) * 4.5


async def test_the_host_watch_leaves_the_list_to_the_teardowns_check() -> None:
    """A run that polls faster than vast.ai's list allows (a local run looks every 0.25 s) still
    watches its hosts at a third of the list's limit: the teardown's list after its destroys (what
    says nothing is left) then finds the list free more often than not, instead of waiting out the
    limit after the watch's last list every time."""
    limits = vastdoc.rate_limits(scale=1)
    clock = VirtualClock()
    provider = MemProvider(clock, catalogue=offers(4), boot_s=[1.0], pace=vastdoc.pace(scale=1))
    r = rental(provider, clock, num_stages=2, poll_interval=0.25)
    waits = []
    try:
        await rent_all(r)
        await asyncio.gather(*(r.wait_running(i) for i in r.instances))
        for _ in range(6):  # six teardowns' worth of moments, each a while into the watch
            lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            watch = asyncio.ensure_future(r.watch(lost))
            await clock.sleep(7.3)
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            before = clock()
            await provider.list_instances(r.label_prefix)  # the teardown's check, as it would come now
            waits.append(clock() - before)
    finally:
        await r.close()
    listed = provider.times["list"]
    spacing = limits["list"].threshold * PACE_MARGIN
    watched = [b - a for a, b in itertools.pairwise(listed) if b - a < 2 * spacing]
    assert len(listed) > 6 and len(watched) < len(listed) // 2, listed  # not a list at every turn of the limit
    assert sum(w > 0 for w in waits) < len(waits), waits


async def test_stages_released_before_the_teardown_go_in_one_call() -> None:
    """The reference asked after the request releases every stage but stage 0's: three of them go
    in one destroy of a list (one by one, vast.ai's 3 s destroy limit would space them 6 s), each
    then gone; the teardown destroys stage 0's alone."""
    limits = vastdoc.rate_limits(scale=1)
    clock = VirtualClock()
    provider = MemProvider(clock, catalogue=offers(6), boot_s=[1.0], pace=vastdoc.pace(scale=1))
    r = rental(provider, clock, num_stages=4)
    try:
        await rent_all(r)
        await asyncio.gather(*(r.wait_running(i) for i in r.instances))
        started = clock()
        await r.release([i for i in r.instances if i.stage != 0])
        assert clock() - started < limits["destroy"].threshold
        assert provider.calls["destroy_many"] == 1 and provider.calls["destroy"] == 0
        assert [i.state in ("destroyed", "destroying") for i in r.instances] == [False, True, True, True]
        assert r.released == {i.id for i in r.instances if i.stage != 0}
    finally:
        await r.close()
    assert not provider.live() and provider.calls["destroy"] == 1 and provider.calls["destroy_many"] == 1

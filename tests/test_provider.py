"""The shared code above the provider seam (``cloud/provider.py``), unchanged, against the
in-memory provider (``tests/memprovider.py``) on a virtual clock: the boot wait, the teardown's
destroys and checks, the sweep of a create whose answer was lost, the teardown's deadline, the
reap, and ``Deployment``'s boot phase. Time is virtual throughout: a wait of minutes is a few
turns of the loop, and every test asserts virtual seconds only."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from pytest_ppsmoke.cloud.pacing import Pacer
from pytest_ppsmoke.cloud.provider import Instance, Provider
from pytest_ppsmoke.cloud.rental import Rental, RentalConfig, reap
from pytest_ppsmoke.cloud.replace import SPEC
from pytest_ppsmoke.cloud.waits import wait_running
from pytest_ppsmoke.harness.deployment import Deployment
from pytest_ppsmoke.harness.runconfig import RunConfig
from pytest_ppsmoke.protocol import PhaseError

from .memprovider import MemProvider, VirtualClock

pytestmark = pytest.mark.local

ENV = {"PP_STAGE": "0"}


def rental(provider: MemProvider, clock: VirtualClock, **config: object) -> Rental:
    """A rental on the spec's error table (no replacement: tests/test_replace.py has it)."""
    config.setdefault("replacement", SPEC)
    c = RentalConfig(check_image="not asked", **config)  # type: ignore[arg-type]
    return Rental(provider, c, "t1", clock=clock, sleep=clock.sleep)


async def rent_all(r: Rental) -> None:
    offers = await r.check()
    for stage in range(r.config.num_stages):
        await r.rent(stage, ENV, offers, f"endpoint{stage}")


def test_the_in_memory_provider_is_a_provider() -> None:
    clock = VirtualClock()
    p: Provider = MemProvider(clock)  # mypy holds it to the Protocol
    assert p.where == "memory"


async def test_a_slow_host_gets_its_boot_window_and_a_fast_one_runs_first() -> None:
    clock = VirtualClock()
    provider = MemProvider(clock, boot_s=[20.0, 150.0])
    r = rental(provider, clock)
    try:
        await rent_all(r)
        assert r.preflight is not None and r.preflight.credit == 50.0 and len(r.preflight.offers) == 4
        first, second = r.instances
        await r.wait_running(first)
        assert 20 <= clock.elapsed < 20 + r.config.poll_interval + 1
        await r.wait_running(second)  # 150 s: inside the 180 s window, every poll given
        assert 150 <= clock.elapsed < 150 + r.config.poll_interval + 1
        assert (first.state, second.state) == ("running", "running")
    finally:
        await r.close()
    assert not provider.live() and [i.state for i in r.instances] == ["destroyed", "destroyed"]


async def test_a_host_that_never_boots_fails_the_boot_at_its_window_and_is_destroyed() -> None:
    clock = VirtualClock()
    provider = MemProvider(clock, boot_s=[10.0, None])
    r = rental(provider, clock)
    try:
        await rent_all(r)
        await r.wait_running(r.instances[0])
        with pytest.raises(PhaseError) as e:
            await r.wait_running(r.instances[1])
        assert e.value.phase == "boot"
        assert "stage 1: not running within its 180 s boot window (60 polls at vast.ai's 3 s)" in str(e.value)
        assert "(last status 'loading': Pulling image)" in str(e.value)
        assert 180 <= clock.elapsed <= 180 + 10 + 2 * r.config.poll_interval
    finally:
        await r.close()
    assert not provider.live() and [i.state for i in r.instances] == ["destroyed", "destroyed"]


@dataclass
class Unshown(MemProvider):
    """Shows each new instance as null (vast.ai's ``{"instances": null}``), and lists it not, for
    ``hidden_s`` after its create, then as it is."""

    hidden_s: float = 30.0

    def hidden(self, instance_id: int | None) -> bool:
        inst = self.instances.get(instance_id) if instance_id is not None else None
        return inst is not None and self.clock() < inst.created + self.hidden_s

    async def show_instance(self, instance_id: int) -> Instance | None:
        shown = await super().show_instance(instance_id)
        return None if self.hidden(instance_id) else shown

    async def list_instances(self, label_prefix: str | None = None) -> list[Instance]:
        return [i for i in await super().list_instances(label_prefix) if not self.hidden(i.id)]


async def test_a_new_instance_shown_as_null_for_30_s_is_waited_for_within_its_boot_window() -> None:
    """As vast-cli's wait loop: a null answer is polled through (ten of them at 3 s), never taken
    for an instance gone; the boot window stays the deadline."""
    clock = VirtualClock()
    provider = Unshown(clock, boot_s=[45.0])
    r = rental(provider, clock)
    try:
        await rent_all(r)
        seen: list[Instance | None] = []
        record = await wait_running(
            provider, r.instances[0].id or 0, 60, 3.0, lambda _, rec: seen.append(rec), clock=clock, sleep=clock.sleep
        )
        assert record.actual_status == "running" and 45 <= clock.elapsed <= 48
        assert seen[:10] == [None] * 10 and seen[10] is not None  # 0..27 s unshown, then loading
        await r.wait_running(r.instances[1])  # through the rental too (its create came later)
        assert r.instances[1].state == "running"
    finally:
        await r.close()
    assert not provider.live()


async def test_an_instance_never_shown_fails_at_its_boot_window_saying_so() -> None:
    clock = VirtualClock()
    provider = Unshown(clock, hidden_s=10_000.0)
    r = rental(provider, clock)
    try:
        await rent_all(r)
        with pytest.raises(PhaseError) as e:
            await r.wait_running(r.instances[0])
        assert "stage 0: not running within its 180 s boot window" in str(e.value)
        assert "(never shown: every poll answered null)" in str(e.value)
        assert 177 <= clock.elapsed <= 180 + r.config.poll_interval
    finally:
        await r.close()


async def test_an_image_that_fails_to_pull_ends_the_boot_at_once_naming_the_fix() -> None:
    clock = VirtualClock()
    provider = MemProvider(clock, pull_errors={0})
    r = rental(provider, clock, image="ghcr.io/x/missing:1")
    try:
        await rent_all(r)
        with pytest.raises(PhaseError) as e:
            await r.wait_running(r.instances[0])
        assert "stage 0: instance 7001 is loading, and its image pull failed: Error response" in str(e.value)
        assert "check that image ghcr.io/x/missing:1 exists and is public" in str(e.value)
        assert clock.elapsed == 0  # the first poll said it
    finally:
        await r.close()
    assert not provider.live()


async def test_a_create_whose_answer_was_lost_is_found_by_its_label_and_destroyed() -> None:
    clock = VirtualClock()
    provider = MemProvider(clock, lost_answers={1})
    r = rental(provider, clock)
    offers = await r.check()
    await r.rent(0, ENV, offers, "e0")
    with pytest.raises(PhaseError) as e:
        await r.rent(1, ENV, offers, "e1")
    assert e.value.phase == "rent" and "creating stage 1 on offer 101 was rejected" in str(e.value)
    assert len(provider.live()) == 2 and len(r.instances) == 1  # rented, but the run holds no id for it
    await r.close()
    assert not provider.live()
    orphan = r.instances[1]
    assert (orphan.stage, orphan.label, orphan.state) == (1, "ppsmoke-t1-stage1", "destroyed")
    assert orphan.offer.id == 101  # its machine, from the provider's record: the cost counts it


async def test_an_offer_taken_first_moves_the_rent_to_the_next() -> None:
    clock = VirtualClock()
    provider = MemProvider(clock, taken={100})
    r = rental(provider, clock)
    try:
        await rent_all(r)
        assert [i.offer.id for i in r.instances] == [101, 102]
        assert [(o["stage"], o["offer"], o["status"]) for o in r.offers_skipped] == [(0, 100, 410)]
    finally:
        await r.close()
    assert not provider.live()


async def test_destroys_that_linger_count_as_gone_and_a_lost_one_is_sent_again() -> None:
    clock = VirtualClock()
    provider = MemProvider(clock, linger_s=60.0, lost_destroys=1)
    r = rental(provider, clock)
    await rent_all(r)
    await r.close()
    assert [i.state for i in r.instances] == ["destroying", "destroying"]  # listed, on their way out
    # both in one call; the forgotten one, still intended running on the list after it, sent again alone
    assert provider.calls["destroy_many"] == 1 and provider.calls["destroy"] == 1 and not provider.live()
    assert r.close_line() == "2 of 2 destroyed"


async def test_a_provider_that_refuses_a_destroy_of_a_list_has_each_destroyed_alone() -> None:
    clock = VirtualClock()
    provider = MemProvider(clock, bulk_refused=True)
    r = rental(provider, clock)
    await rent_all(r)
    await r.close()
    assert provider.calls["destroy_many"] == 1 and provider.calls["destroy"] == 2 and not provider.live()
    assert [i.state for i in r.instances] == ["destroyed", "destroyed"] and r.close_line() == "2 of 2 destroyed"
    assert r.listed_after == []  # the sweep's list, read after both: what the run reports as left


async def test_a_destroy_never_taken_is_reported_with_the_reap_then_reaped() -> None:
    clock = VirtualClock()
    provider = MemProvider(clock, lost_destroys=99)
    r = rental(provider, clock)
    await rent_all(r)
    with pytest.raises(PhaseError) as e:
        await r.close()
    assert e.value.phase == "teardown" and str(e.value).count("was NOT destroyed") == 2
    assert "accepted 3 destroys but still shows it intended running" in str(e.value)
    assert "run pp-smoke-run --reap --run-id t1" in str(e.value)  # the sweep command, as the face names it
    provider.lost_destroys = 0
    swept = await reap(provider, "t1")
    assert [s["destroyed"] for s in swept] == [True, True] and not provider.live()


async def test_the_teardown_ends_at_its_deadline_on_the_rentals_clock() -> None:
    clock = VirtualClock()
    provider = MemProvider(clock)
    r = rental(provider, clock)
    await rent_all(r)
    provider.hang_destroys = True
    r.teardown_timeout = 45.0
    with pytest.raises(PhaseError) as e:
        await r.close()
    assert "the teardown did not finish within 45 s" in str(e.value)
    assert "no answer within the teardown's 45 s" in str(e.value)
    assert clock.elapsed == pytest.approx(45.0)
    provider.hang_destroys = False
    await reap(provider, "t1")
    assert not provider.live()


async def test_a_host_lost_mid_run_is_seen_by_the_watch() -> None:
    clock = VirtualClock()
    provider = MemProvider(clock, boot_s=[5.0])
    r = rental(provider, clock)
    try:
        await rent_all(r)
        for inst in r.instances:
            await r.wait_running(inst)
            inst.reached("running", clock.start, clock())
        provider.instances[r.instances[1].id or 0].exits_at = clock() + 30
        lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        await r.watch(lost)
        assert lost.result().startswith("pp-stage-1 on instance 7002 (ppsmoke-t1-stage1): vast.ai reports the")
        assert "exited (its host died); its host was lost mid-run" in lost.result()
    finally:
        await r.close()
    assert not provider.live()


# --- Deployment: the boot phase, each instance on its own, on the virtual clock ------------------


def deployment(provider: MemProvider, clock: VirtualClock) -> Deployment:
    config = RunConfig(check_image="not asked", replacement=SPEC)
    return Deployment(provider, config, run_id="d1", clock=clock, sleep=clock.sleep)


async def test_a_deployments_boot_waits_for_every_host_and_stamps_each_on_the_clock() -> None:
    clock = VirtualClock()
    provider = MemProvider(clock, boot_s=[12.0, 90.0])
    dep = deployment(provider, clock)
    try:
        await dep.rent()
        await dep.boot()
        first, second = dep.instances
        assert 12 <= first.timeline["running"] < 90 <= second.timeline["running"] < 90 + 2 * dep.config.poll_interval
        assert dep.timings["boot"] >= 90 - first.timeline["running"]
    finally:
        await dep.close()
    assert not provider.live() and [i.state for i in dep.instances] == ["destroyed", "destroyed"]


async def test_a_deployment_whose_host_never_boots_fails_at_boot_and_destroys_both() -> None:
    clock = VirtualClock()
    provider = MemProvider(clock, boot_s=[8.0, None])
    dep = deployment(provider, clock)
    try:
        await dep.rent()
        with pytest.raises(PhaseError) as e:
            await dep.boot()
        assert e.value.phase == "boot" and "stage 1: not running within its 180 s boot window" in str(e.value)
        assert "running" in dep.instances[0].timeline and "running" not in dep.instances[1].timeline
    finally:
        await dep.close()
    assert not provider.live() and dep.timings["teardown"] >= 0


async def test_a_deployments_lost_create_answer_is_swept_at_its_teardown() -> None:
    clock = VirtualClock()
    provider = MemProvider(clock, lost_answers={0})
    dep = deployment(provider, clock)
    try:
        with pytest.raises(PhaseError) as e:
            await dep.rent()
        assert e.value.phase == "rent" and dep.creates_sent == 1 and not dep.instances
    finally:
        await dep.close()
    assert not provider.live() and [(i.stage, i.state) for i in dep.instances] == [(0, "destroyed")]


async def test_the_shared_pacer_spaces_calls_of_a_name_on_the_clock() -> None:
    """The pacing a provider's transport applies (``cloud/pacing.py``): calls of a paced name are
    sent one at a time, its spacing apart; other names are not held."""
    clock = VirtualClock()
    pacer = Pacer({"create": 4.5}, clock=clock, sleep=clock.sleep)
    waits = await asyncio.gather(*(pacer.turn("create") for _ in range(3)), pacer.turn("show"))
    assert waits == [0.0, pytest.approx(4.5), pytest.approx(4.5), 0.0] and clock.elapsed == pytest.approx(9.0)
    pacer.spacing["show"] = 2.0  # learned: counted from the last call of its name
    assert await pacer.turn("show") == pytest.approx(0.0) and clock.elapsed == pytest.approx(9.0)

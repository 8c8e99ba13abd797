"""Replacing a host that never boots (``cloud/replace.py``, ``Rental.see_through``), on the
in-memory provider and a virtual clock: the per-host deadline, another machine, the slow
instance destroyed, unique labels that the sweep and the reap find, the budget that no
replacement may overrun, the join deadline, the run's most replacements, a spare's race. Every
figure asserted is virtual seconds or a count of calls."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import pytest

from pytest_ppsmoke.cloud.provider import Label
from pytest_ppsmoke.cloud.rental import Rental, RentalConfig, RentedInstance, reap
from pytest_ppsmoke.cloud.replace import SPEC, BootAssumption, Replaceable, ReplacePolicy
from pytest_ppsmoke.protocol import Phase, PhaseError

from .memprovider import MemProvider, VirtualClock, offers

pytestmark = pytest.mark.local

POLICY = ReplacePolicy(host_deadline=60.0, join_deadline=30.0, boot_estimate=60.0, rest_estimate=60.0)
AT_ONCE = dataclasses.replace(POLICY, keep_slow=False)  # a slow host destroyed as soon as it is replaced


class Run:
    """A rental of two stages whose nodes join at once (or as ``join`` says), renewed with
    numbered endpoint ids."""

    def __init__(
        self, provider: MemProvider, clock: VirtualClock, policy: ReplacePolicy = POLICY, run_id: str = "t1"
    ) -> None:
        self.clock, self.provider = clock, provider
        config = RentalConfig(check_image="not asked", replacement=policy)
        self.rental = Rental(provider, config, run_id, clock=clock, sleep=clock.sleep)
        self.renewed: list[tuple[int, str]] = []  # (stage, the id it replaced)
        self.joins: dict[str, float | None] = {}  # endpoint id -> seconds its join takes; None: never

    async def renew(self, old: RentedInstance) -> tuple[Mapping[str, str], str]:
        self.renewed.append((old.stage, old.endpoint_id))
        return {"PP_STAGE": str(old.stage)}, f"id{old.stage}-{len(self.renewed)}"

    async def join(self, inst: RentedInstance) -> None:
        seconds = self.joins.get(inst.endpoint_id, 1.0)
        await self.clock.sleep(10_000 if seconds is None else seconds)

    async def rent(self, stage: int) -> RentedInstance:
        offers_found = self.rental.offers or await self.rental.check()
        return await self.rental.rent(stage, {"PP_STAGE": str(stage)}, offers_found, f"id{stage}")

    async def through(self, inst: RentedInstance) -> RentedInstance:
        return await self.rental.see_through(inst, self.renew, self.join)


async def test_a_host_that_never_boots_is_replaced_at_its_deadline_on_another_machine() -> None:
    clock = VirtualClock()
    # the next offer after the slow host's is another GPU of the same machine: it is passed over
    catalogue = [*offers(2), dataclasses.replace(offers(3)[2], machine_id=501), *offers(4)[3:]]
    provider = MemProvider(clock, catalogue=catalogue, boot_s=[20.0, None, 30.0])
    run = Run(provider, clock, AT_ONCE)
    try:
        first, second = await run.rent(0), await run.rent(1)
        assert second.offer.machine_id == 501
        assert await run.through(first) is first
        new = await run.through(second)
        assert new is not second and new.stage == 1 and new.replaces == second.id and new.endpoint_id == "id1-1"
        assert new.offer.id == 103 and new.offer.machine_id == 503  # not offer 102, on the slow machine
        assert second.replaced is not None and "not running within its 60 s per-host deadline" in second.replaced
        assert second.replaced_at is not None and 60 <= second.replaced_at < 60 + 2 * run.rental.config.poll_interval
        # the slow instance is gone from the provider before the replacement runs; the labels differ
        slow = provider.instances[second.id or 0]
        assert slow.destroyed is not None and slow.destroyed <= provider.instances[new.id or 0].created
        assert (second.label, new.label) == ("ppsmoke-t1-stage1", "ppsmoke-t1-stage1r1")
        assert Label.parse(new.label) == Label("t1", 1, 1)
        assert run.renewed == [(1, "id1")] and run.rental.current == [first, new]
        summary = second.summary()
        assert summary["replaced"] == second.replaced and summary["replaced_at"] == second.replaced_at
        assert new.summary()["replaces"] == second.id and new.summary()["replacement"] == 1
    finally:
        await run.rental.close()
    assert not provider.live() and all(i.state == "destroyed" for i in run.rental.instances)


@pytest.mark.parametrize(
    ("slow_s", "new_s", "kept"),
    [(None, 30.0, "new"), (100.0, 60.0, "slow"), (100.0, 20.0, "new")],
    ids=["never boots", "nearly there", "slower than its replacement"],
)
async def test_a_slow_host_races_its_replacement_and_the_first_to_run_is_kept(
    slow_s: float | None, new_s: float, kept: str
) -> None:
    """A host past its per-host deadline that is still booting keeps booting beside its
    replacement (``keep_slow``): destroying it at once would throw away a boot nearly done."""
    clock = VirtualClock()
    provider = MemProvider(clock, boot_s=[slow_s, new_s])
    run = Run(provider, clock)
    try:
        slow = await run.rent(0)
        got = await run.through(slow)
        new = run.rental.instances[1]
        assert new.replaces == slow.id and new.label == "ppsmoke-t1-stage0r1" and run.rental.replacements == 1
        assert new.timeline.get("rented") is None  # stamped by the harness's stamp, not here
        winner, loser = (new, slow) if kept == "new" else (slow, new)
        assert got is winner and winner.replaced is None and run.rental.current == [winner]
        assert loser.replaced is not None and loser.replaced.endswith(
            f"instance {winner.id}, of the same stage, ran first"
        )
        if loser is slow:
            assert loser.replaced.startswith("stage 0: not running within its 60 s per-host deadline")
        assert (
            provider.instances[loser.id or 0].destroyed is not None
            and provider.instances[winner.id or 0].destroyed is None
        )
        ran = 60 + new_s if kept == "new" else slow_s
        assert ran is not None and ran <= clock.elapsed < ran + 2 * run.rental.config.poll_interval + 4 + 1
    finally:
        await run.rental.close()
    assert not provider.live()


async def test_with_replacement_off_the_same_host_fails_the_boot_at_its_window() -> None:
    clock = VirtualClock()
    provider = MemProvider(clock, boot_s=[20.0, None])
    run = Run(provider, clock, SPEC)
    try:
        await run.rent(0)
        second = await run.rent(1)
        with pytest.raises(PhaseError) as e:
            await run.through(second)
        assert e.value.phase is Phase.BOOT and "not running within its 180 s boot window" in str(e.value)
        assert provider.calls["create"] == 2 and not run.renewed and second.replaced is None
    finally:
        await run.rental.close()
    assert not provider.live()


async def test_no_replacement_that_the_budget_cannot_fit_the_slow_host_keeps_its_window() -> None:
    clock = VirtualClock()
    provider = MemProvider(clock, boot_s=[None, 100.0])
    run = Run(provider, clock)
    run.rental.deadline = clock() + 150.0  # at the 60 s deadline, 90 s left: a replacement needs 120
    try:
        inst = await run.rent(0)
        with pytest.raises(PhaseError) as e:
            await run.through(inst)
        said = str(e.value)
        assert "not running within its 180 s boot window" in said
        assert "not replaced: the budget has 90 s left, and a replacement needs about 135 s" in said
        assert provider.calls["create"] == 1 and not run.renewed
    finally:
        await run.rental.close()


async def test_a_node_that_never_joins_is_replaced_at_its_join_deadline() -> None:
    clock = VirtualClock()
    provider = MemProvider(clock, boot_s=[10.0])
    run = Run(provider, clock)
    run.joins["id0"] = None
    try:
        inst = await run.rent(0)
        new = await run.through(inst)
        assert new.endpoint_id == "id0-1" and inst.replaced is not None
        assert "its node did not join within 30 s of running" in inst.replaced
        assert inst.replaced_at is not None and 40 <= inst.replaced_at < 45
    finally:
        await run.rental.close()
    assert not provider.live()


async def test_a_join_that_says_it_can_be_replaced_is_and_the_runs_replacements_run_out() -> None:
    clock = VirtualClock()
    provider = MemProvider(clock, boot_s=[None])  # no host ever boots
    run = Run(provider, clock, dataclasses.replace(AT_ONCE, most=2))
    try:
        inst = await run.rent(0)
        with pytest.raises(PhaseError) as e:
            await run.through(inst)
        assert "not replaced: the run's 2 replacement(s) are spent" in str(e.value)
        assert [i.label for i in run.rental.instances] == [
            "ppsmoke-t1-stage0",
            "ppsmoke-t1-stage0r1",
            "ppsmoke-t1-stage0r2",
        ]
        machines = [i.offer.machine_id for i in run.rental.instances]
        assert len(set(machines)) == 3
    finally:
        await run.rental.close()
    assert not provider.live()

    async def refused(inst: RentedInstance) -> None:
        raise Replaceable(PhaseError(Phase.CONVERGE, "never joined"))

    run = Run(MemProvider(clock, boot_s=[5.0]), clock, dataclasses.replace(POLICY, most=1))
    try:
        inst = await run.rent(0)
        with pytest.raises(PhaseError) as e:
            await run.rental.see_through(inst, run.renew, refused)
        assert e.value.phase is Phase.CONVERGE and str(e.value).startswith("converge: never joined; not replaced")
        assert len(run.rental.instances) == 2
    finally:
        await run.rental.close()


async def test_an_image_that_cannot_be_pulled_is_not_replaced() -> None:
    """A pull's failure is the image's, the same on every host: the run ends at once."""
    clock = VirtualClock()
    provider = MemProvider(clock, pull_errors={0})
    run = Run(provider, clock)
    try:
        with pytest.raises(PhaseError) as e:
            await run.through(await run.rent(0))
        assert "image pull failed" in str(e.value) and provider.calls["create"] == 1
    finally:
        await run.rental.close()


async def test_the_sweep_and_the_reap_find_every_replacement() -> None:
    clock = VirtualClock()
    provider = MemProvider(clock, boot_s=[None, 10.0], lost_answers={1})  # the replacement's answer is lost
    run = Run(provider, clock)
    try:
        inst = await run.rent(0)
        with pytest.raises(PhaseError):
            await run.through(inst)
    finally:
        await run.rental.close()
    assert not provider.live()  # the sweep found the replacement by its own label
    assert sorted(i.label for i in run.rental.instances) == ["ppsmoke-t1-stage0", "ppsmoke-t1-stage0r1"]

    provider = MemProvider(clock, boot_s=[None, 10.0])
    run = Run(provider, clock, run_id="t2")
    first = await run.rent(0)
    await run.through(first)
    assert len(provider.live()) == 1  # the slow one destroyed, its replacement left running
    reaped = await reap(provider, "t2")
    assert [(r["label"], r["destroyed"]) for r in reaped] == [("ppsmoke-t2-stage0r1", True)]
    assert not provider.live()


async def test_a_spare_races_its_stage_and_the_loser_is_destroyed() -> None:
    clock = VirtualClock()
    provider = MemProvider(clock, boot_s=[None, 40.0])
    run = Run(provider, clock, dataclasses.replace(POLICY, on=False))
    try:
        inst = await run.rent(0)
        spare = await run.rental.rent(0, {}, run.rental.offers, "spare0", replacement=run.rental.next_replacement(0))
        got = await run.rental.see_through(inst, run.renew, run.join, spare=spare)
        assert got is spare and spare.label == "ppsmoke-t1-stage0r1"
        assert inst.replaced == f"instance {spare.id}, of the same stage, ran first" and inst.state == "destroyed"
        assert 40 <= clock.elapsed < 40 + 2 * run.rental.config.poll_interval + 2
    finally:
        await run.rental.close()
    assert not provider.live()


def test_labels_round_trip_and_refuse_a_bad_replacement_number() -> None:
    for label in (Label("r", 0), Label("r-x", 3, 2)):
        assert Label.parse(label.format()) == label
    for text in ("ppsmoke-r-stage1r", "ppsmoke-r-stage1r0", "ppsmoke-r-stage1x2", "ppsmoke-r-stager1"):
        assert Label.parse(text) is None, text


def test_the_policy_and_the_assumption_refuse_bad_values() -> None:
    with pytest.raises(ValueError, match="host_deadline must be a positive number of seconds, got 0"):
        ReplacePolicy(host_deadline=0)
    with pytest.raises(ValueError, match="most must be at least 0"):
        ReplacePolicy(most=-1)
    with pytest.raises(ValueError, match="p5 < p95"):
        BootAssumption(p5=300, p95=60)
    assert round(BootAssumption(60, 300).median) == 134 and offers(2)[1].machine_id == 501

"""Real members against the simulation (``network/swimreal.py``): the small-N case of
``bench/bench_swim_members.py``, which runs as many members as this machine holds."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pytest_ppsmoke.network import EmulatedNetwork, parse_network, unavailable
from pytest_ppsmoke.network.swimreal import RealResult, RealSpec, _Views, agreement, poisson_interval, run_members
from pytest_ppsmoke.network.swimsim import SimResult, SimSpec, simulate
from pytest_ppsmoke.runtime.swimconfig import SwimConfig

pytestmark = pytest.mark.local

_WHY = unavailable()


@pytest.mark.skipif(_WHY is not None, reason=f"no emulated network here: {_WHY}")
def test_real_members_on_wan_agree_with_the_simulation_of_the_same_schedule() -> None:
    """Four member processes (the seed here, three in namespaces) on wan: they converge, a
    killed one is declared dead by every live member no sooner than the suspicion allows, and
    nothing else dies; the simulation of the same N, configuration and join schedule puts each
    figure where the real one is."""
    cfg = SwimConfig.wan()

    async def real_run() -> RealResult:
        async with EmulatedNetwork(parse_network("wan"), seed=3) as net:
            return await run_members(net, RealSpec(members=4, config=cfg, hold_s=2.0, seed=3))

    real = asyncio.run(real_run())  # the simulation runs its own (virtual) loop: not inside one
    assert len(real.join_at) == 3 and min(real.join_at) == 0.0
    assert real.detect_first_s is not None and real.detect_all_s is not None
    assert cfg.suspicion_bounds(4)[0] <= real.detect_first_s <= real.detect_all_s <= cfg.detection_bound(4)
    assert real.false_deaths == 0 and real.member_rss_mb > 0
    sims = [
        simulate(SimSpec(4, "wan", cfg, join_at=real.join_at, watch_s=real.hold_s, seed=s, transport="quic"))
        for s in range(1, 11)
    ]
    # the bench's tolerance is 0.5 s; here the members share two cores with the suite's workers,
    # and a probe that times out late on a starved loop is excused once (a period more)
    agree = agreement(real, sims, slack_s=1.5)
    assert agree["agrees"], agree


def _sim(**figures: float | None) -> SimResult:
    return SimResult(spec={}, **figures)  # type: ignore[arg-type]


def test_agreement_is_the_simulated_range_widened_by_the_stated_tolerance() -> None:
    sims = [_sim(converge_after_joins_s=0.1, detect_first_s=v, detect_all_s=v + 0.5) for v in (6.0, 7.0, 10.0)]
    real = RealResult(members=16, profile="wan", converge_after_joins_s=0.5, detect_first_s=11.0, detect_all_s=9.0)
    got = agreement(real, sims)
    assert got["detect_first_s"]["tolerance_s"] == pytest.approx(1.05)  # 15 % of the median, 7 s
    assert got["detect_first_s"]["agrees"] and got["detect_all_s"]["agrees"] and got["converge_after_joins_s"]["agrees"]
    late = agreement(dataclasses.replace(real, detect_first_s=11.1), sims)
    early = agreement(dataclasses.replace(real, converge_after_joins_s=0.0, detect_all_s=5.3), sims)
    assert not late["detect_first_s"]["agrees"] and not late["agrees"]
    assert not early["detect_all_s"]["agrees"] and early["converge_after_joins_s"]["agrees"]  # 0.5 s floor
    missing = agreement(dataclasses.replace(real, detect_all_s=None), sims)
    assert not missing["detect_all_s"]["agrees"]
    with pytest.raises(ValueError, match="at least one simulated run"):
        agreement(real, [])


def test_false_deaths_agree_within_the_poisson_interval_of_the_simulated_rate() -> None:
    sims = [_sim(false_deaths_per_member_hour=r) for r in (10.0, 14.0)]  # 12 per member-hour
    real = RealResult(members=31, profile="flaky", hold_s=600.0, false_deaths=60)  # 5 member-hours: 60 expected
    assert agreement(real, sims)["false_deaths"] == {
        "real": 60,
        "simulated_rate_per_member_hour": 12.0,
        "expected": 60.0,
        "interval": [45, 76],
        "agrees": True,
    }
    assert not agreement(dataclasses.replace(real, false_deaths=30), sims)["false_deaths"]["agrees"]
    assert poisson_interval(0.0) == (0, 0) and poisson_interval(3.0) == (0, 7)


def test_a_view_is_complete_from_its_last_gap_and_deaths_are_timed_per_observer() -> None:
    v = _Views(3)
    v.add("a", 1.0, "joined", "b", 0, True)
    v.add("a", 2.0, "joined", "c", 0, True)
    assert v.complete_since("a") == 2.0
    v.add("a", 3.0, "suspect", "c", 0, False)
    assert v.complete_since("a") is None
    v.add("a", 4.0, "alive", "c", 1, True)
    v.add("b", 5.0, "dead", "c", 1, False)
    v.add("b", 6.0, "dead", "c", 1, False)
    assert v.complete_since("a") == 4.0 and v.complete_since("b") is None
    assert v.dead_at("c") == {"b": 5.0}
    assert v.about_live({"dead", "suspect"}, "b", 3.0) == [("c", 0), ("c", 1), ("c", 1)]

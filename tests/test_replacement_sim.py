"""The replacement simulation (``bench/replacement_sim.py``, imported by its path): it runs the
rental's own functions, not a copy of their waits (each counted through the provider's seam and
by a spy on the class), and its runs end as the rental decides: a host that never boots replaced
by one that boots in time passes, by one too slow fails on the budget, and without replacement
fails at its boot window. Virtual time only."""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from pytest_ppsmoke.cloud.rental import Rental
from pytest_ppsmoke.cloud.replace import SPEC, ReplacePolicy

from .helpers import load_bench

pytestmark = pytest.mark.local


sim = load_bench("replacement_sim")

DEFAULT = sim.Policy("default", ReplacePolicy())  # the harness's default policy
NONE = sim.Policy("none", SPEC)
LIMITS_OFF = sim.Cell("fast", 0.0, 0.0, limits=False)
LIMITS_ON = sim.Cell("fast", 0.0, 0.0, limits=True)


def draw(*boots: float | None) -> Any:
    """Each create's boot, in order (None: never), and no offer taken."""
    return sim.Draw(tuple(boots), frozenset())


async def run(cell: Any, policy: Any, boots: Any) -> tuple[Any, Rental, Any]:
    outcome, rental, provider = await sim.simulate(cell, policy, boots)
    assert not provider.live(), "the teardown destroyed every instance"
    return outcome, rental, provider


def spy(monkeypatch: pytest.MonkeyPatch, calls: Counter[str], name: str) -> None:
    """Count the calls of ``Rental.<name>``, the very function, which still runs."""
    original: Callable[..., Awaitable[Any]] = getattr(Rental, name)

    async def counted(self: Rental, *args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        if kwargs.get("spare") is not None:
            calls[f"{name} with a spare"] += 1
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(Rental, name, counted)


async def test_the_simulation_runs_the_rentals_own_waits_and_replacement(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: Counter[str] = Counter()
    names = (
        "check",
        "rent",
        "see_through",
        "wait_running",
        "_first_running",
        "_renewed",
        "_retire",
        "replace",
        "close",
    )
    for name in names:
        spy(monkeypatch, calls, name)
    outcome, rental, provider = await run(LIMITS_OFF, DEFAULT, draw(20.0, None, 60.0))
    assert outcome.ok and outcome.replacements == 1
    # stage 1's host never boots: at its deadline a replacement races it (two waits), and wins
    assert calls == Counter(
        check=1, rent=3, see_through=2, wait_running=4, _first_running=3, _renewed=1, _retire=1, close=1
    )
    # through the seam: the replacement's create, the boot waits' lists, the loser's destroy, the two left in one call
    assert provider.calls["create"] == 3 and provider.calls["destroy"] == provider.calls["destroy_many"] == 1
    assert provider.calls["list"] >= 30 and provider.calls["search"] == 1
    assert [i.label for i in rental.instances] == ["ppsmoke-sim-stage0", "ppsmoke-sim-stage1", "ppsmoke-sim-stage1r1"]


async def test_a_spare_races_the_last_stage_through_the_rentals_own_race(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: Counter[str] = Counter()
    spy(monkeypatch, calls, "see_through")
    spare = sim.Policy("spare", SPEC, spare=True)
    # stage 1's own host would miss its window (200 s); its spare runs at 50 s and is kept
    outcome, rental, _ = await run(LIMITS_ON, spare, draw(60.0, 200.0, 50.0))
    assert outcome.ok and outcome.replacements == 0 and outcome.creates == 3
    assert calls == Counter({"see_through": 2, "see_through with a spare": 1})
    slow, kept = rental.instances[1:]
    assert slow.replaced == f"instance {kept.id}, of the same stage, ran first" and kept.replaced is None
    assert kept.label == "ppsmoke-sim-stage1r1"


@pytest.mark.parametrize("cell", [LIMITS_OFF, LIMITS_ON], ids=["rate limits off", "rate limits on"])
async def test_at_the_real_defaults_a_replacement_that_boots_in_a_minute_passes(cell: Any) -> None:
    """The harness's defaults (the budget, the window, the per-host deadline): stage 1's host
    never boots; its replacement, rented at the deadline, boots in 60 s and the run passes."""
    outcome, rental, _ = await run(cell, DEFAULT, draw(20.0, None, 60.0))
    assert (outcome.ok, outcome.cause, outcome.replacements) == (True, None, 1)
    never, new = rental.instances[1:]
    assert str(never.replaced).startswith("stage 1: not running within its 30 s per-host deadline")
    assert str(never.replaced).endswith(f"instance {new.id}, of the same stage, ran first")
    created = 4.5 if cell.limits else 0.0  # creates are 4.5 s apart with the limits
    rented = new.timeline["rented"]
    assert created + 30 <= rented <= created + 30 + 4.5 + 3
    assert rented + 60 <= new.timeline["running"] <= rented + 60 + 3
    assert outcome.seconds <= sim.BUDGET


async def test_at_the_real_defaults_a_replacement_that_boots_in_5_minutes_fails_the_boot_naming_both() -> None:
    """The outcome docs/run.md names: the replacement is rented at the deadline (the budget
    fits its estimate), neither host runs within its own boot window, and the run fails at boot,
    naming both, when the replacement's window ends (207 s), before the budget's end (240 s)."""
    outcome, rental, provider = await run(LIMITS_OFF, DEFAULT, draw(20.0, None, 300.0))
    assert (outcome.ok, outcome.cause, outcome.replacements, outcome.creates) == (False, "boot", 1, 3)
    never, new = rental.instances[1:]
    assert outcome.error.startswith("stage 1: not running within its 180 s boot window")
    assert outcome.error.endswith(f"; nor did instance {new.id}, rented at 30 s, which raced it, within its own window")
    assert all("running" not in i.timeline for i in (never, new))
    assert outcome.seconds == 207.0 < sim.BUDGET - sim.TEARDOWN_S  # 30 s + the window's 60 polls, 3 s apart
    assert not provider.live()


async def test_a_slow_host_destroyed_at_once_loses_a_boot_that_the_race_keeps() -> None:
    """Why the default races: a host that runs at 100 s, past a 45 s deadline, passes when it
    races its replacement (it runs first); destroyed at once, its replacement (a boot of 120 s)
    misses the budget."""
    boots = draw(20.0, 100.0, 120.0)
    raced, _, _ = await run(LIMITS_OFF, sim.Policy("race", ReplacePolicy(host_deadline=45.0)), boots)
    at_once = sim.Policy("at once", ReplacePolicy(host_deadline=45.0, keep_slow=False))
    destroyed, _, _ = await run(LIMITS_OFF, at_once, boots)
    assert (raced.ok, raced.replacements) == (True, 1)
    assert (destroyed.ok, destroyed.cause, destroyed.replacements) == (False, "budget", 1)


async def test_without_replacement_a_host_that_never_boots_fails_at_its_boot_window() -> None:
    outcome, rental, _ = await run(LIMITS_OFF, NONE, draw(60.0, None))
    assert (outcome.ok, outcome.cause, outcome.replacements, outcome.creates) == (False, "boot", 0, 2)
    assert "not running within its 180 s boot window" in outcome.error
    assert rental.config.boot_window == 180.0
    assert outcome.seconds == 177.0  # the spec's 60 polls, 3 s apart, from its create at 0 s; no time to tear down


async def test_a_host_that_cannot_be_replaced_keeps_its_window_and_fails_at_its_end() -> None:
    spent = sim.Policy("spent", ReplacePolicy(most=0))
    outcome, _, _ = await run(LIMITS_OFF, spent, draw(60.0, None))
    assert outcome.cause == "boot", outcome.error
    assert "not running within its 180 s boot window" in outcome.error
    assert outcome.error.endswith("not replaced: the run's 0 replacement(s) are spent")


def test_a_small_sweep_gives_every_policy_the_same_draws_and_its_figures() -> None:
    cell = sim.Cell("fast", 0.2, 0.1)
    assert sim.Draw.of(cell, 3, 5) == sim.Draw.of(cell, 3, 5) != sim.Draw.of(cell, 4, 5)
    pols = sim.policies(30.0)
    table = sim.sweep([cell], pols, runs=3, jobs=1)
    assert {name for _, name in table} == {p.name for p in pols}
    assert all(len(runs) == 3 for runs in table.values())
    base = table[(cell, "none")]
    mine = sim.figures(base, base)
    assert (mine["usd_extra_vs_none"], mine["rescued_vs_none"], mine["harmed_vs_none"]) == (0.0, 0, 0)
    assert mine["replacements_mean"] == 0 and mine["runs"] == 3
    assert all(r.seconds > 0 and r.usd > 0 for runs in table.values() for r in runs)

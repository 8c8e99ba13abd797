"""A machine that never boots, end to end: ``pp-smoke-run --local`` against the emulator with
``vast.stuck_machines`` (any instance on that machine stays ``loading`` for ever). At the default
settings the run replaces the stuck host with one on another machine, whose node is admitted
by the cluster created before it, and passes token-exact. With the spec's setting the same
machine fails the boot and everything is destroyed, as the spec's error table says:
``tests/test_lifecycle.py::test_either_instance_never_running_names_it_and_destroys_both``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .smoke import Smoke
from .test_lifecycle import assert_all_destroyed

pytestmark = pytest.mark.local

STUCK = 31004  # the default catalogue's cheapest match: the first stage's first host


async def test_a_machine_that_never_boots_is_replaced_and_the_run_passes_token_exact(
    emulator: Callable[[str], Any], tmp_path: Path
) -> None:
    fake = await emulator(f"vast.stuck_machines={STUCK}")
    async with Smoke(fake, tmp_path) as smoke:
        assert await smoke.finish() == 0, smoke.stderr[-3000:]
    report = smoke.report()
    assert report["ok"] and report["text"] and report["reference"]["match"] is True, report["reference"]
    stuck = [i for i in report["instances"] if i["offer"]["machine_id"] == STUCK]
    assert len(stuck) == 1 and stuck[0]["stage"] == 0, [i["offer"] for i in report["instances"]]
    slow = stuck[0]
    assert slow["replaced"] and "not running within its 10 s per-host deadline" in slow["replaced"], slow
    assert "running" not in slow["timeline"] and slow["cost_usd"] > 0 and slow["replaced_at"] >= 10
    new = next(i for i in report["instances"] if i["replaces"] == slow["id"])
    assert new["stage"] == 0 and new["offer"]["machine_id"] != STUCK and new["replacement"] == 1
    assert new["label"] == slow["label"] + "r1" and new["endpoint_id"] != slow["endpoint_id"]
    assert list(new["timeline"]) == ["rented", "running", "reached", "joined", "loaded"]
    assert report["replacements"] == 1 and len(report["instances"]) == 3
    other = next(i for i in report["instances"] if i["stage"] == 1)
    assert [(s["stage"], s["instance"]) for s in report["split"]] == [(0, new["id"]), (1, other["id"])]
    # the stuck instance is gone from the emulator's own list, as is every other
    assert not fake.live() and slow["id"] in {i.id for i in fake.destroyed}
    said = smoke.stderr
    assert f"1 host(s) replaced: instance {slow['id']} (stage 0, " in said and f"on machine {STUCK})" in said
    # the replacement's node came later than the others, with its own key: admitted over the cluster
    await assert_all_destroyed(fake, smoke, report, 3)

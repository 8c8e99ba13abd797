"""``pp-smoke-run`` against the emulator, interrupted: SIGINT/SIGTERM during each phase of a run,
and the orchestrator killed outright, after which the nodes destroy their own instances. What is
rented and what runs is checked afterwards, and the API key must appear nowhere
(``tests/smoke.py``)."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pytest_ppsmoke.runtime.localproc import EventKind

from .helpers import node_processes
from .smoke import TAG, Smoke, assert_nothing_left

pytestmark = pytest.mark.local


# --- signals during each phase -----------------------------------------------------------------


async def _second_create_in_flight(smoke: Smoke) -> None:
    """The second instance is rented on the server, its answer held (the failpoint vast.hold_create)."""
    deadline = time.monotonic() + 60
    while len(smoke.fake.instances) < 2:
        assert smoke.proc.returncode is None and time.monotonic() < deadline, smoke.stderr
        await asyncio.sleep(0.01)


async def _tokens_flowing(smoke: Smoke) -> None:
    """The prefill line is out (the run is in decode from then on) and tokens are flowing."""
    await smoke.wait_line("prefill")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        events = [e for i in smoke.fake.live() if i.proc for e in i.proc.events]
        if any(e.kind is EventKind.TOKEN and e["n"] >= 2 for e in events):
            return
        await asyncio.sleep(0.02)
    pytest.fail("decode never got under way")


async def _reference_running(smoke: Smoke) -> None:
    """Stage 0's node has taken the reference query (held there by vast.slow_reference)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if any(e.kind is EventKind.REFERENCE for i in smoke.fake.live() if i.proc for e in i.proc.events):
            return
        await asyncio.sleep(0.02)
    pytest.fail("the reference never started")


async def _destroy_in_flight(smoke: Smoke) -> None:
    """A destroy call has reached the emulator for every instance (and waits there: vast.slow_destroy)."""
    deadline = time.monotonic() + 120
    # every instance's: pp-smoke-run destroys the stages the reference does not need while it runs
    while not (held := list(smoke.fake.instances.values())) or not all(i.destroy_attempts for i in held):
        # where the run was: its phase lines and its log (a cold suite on loaded cores once spent
        # the whole deadline before the teardown, with nothing on stderr to say where)
        assert smoke.proc.returncode is None and time.monotonic() < deadline, smoke.stdout + smoke.stderr[-2000:]
        await asyncio.sleep(0.02)


SIGNAL_CASES = {
    # phase: (signal, faults, extra args, how to get there)
    "rent": (signal.SIGINT, "vast.hold_create=2", [], _second_create_in_flight),
    "boot": (signal.SIGTERM, "vast.boot_delay=60", [], lambda s: s.wait_line("rent")),
    "converge": (signal.SIGINT, "vast.no_join=1", ["--converge-timeout", "60"], lambda s: s.wait_line("boot")),
    "load": (signal.SIGTERM, "", [], lambda s: s.wait_line("converge")),
    "prefill": (signal.SIGINT, "", [], lambda s: s.wait_line("resolve")),
    "decode": (signal.SIGTERM, "", ["--max-tokens", "512"], _tokens_flowing),  # still decoding when the signal comes
    # the reference and the teardown held long enough for the signal to land in them on a busy machine
    "reference": (signal.SIGTERM, "vast.slow_reference=30", ["--max-tokens", "3"], _reference_running),
    "teardown": (signal.SIGINT, "vast.slow_destroy=3", ["--max-tokens", "3"], _destroy_in_flight),
}


@pytest.mark.parametrize("phase", list(SIGNAL_CASES))
async def test_a_signal_during_each_phase_destroys_everything(
    phase: str, emulator: Callable[[str], Any], tmp_path: Path
) -> None:
    sig, faults, args, reach = SIGNAL_CASES[phase]
    fake = await emulator(faults)
    async with Smoke(fake, tmp_path, *args) as smoke:
        await reach(smoke)
        smoke.proc.send_signal(sig)
        assert await smoke.finish(120) == 1
    report = smoke.report()
    assert report["error"] == f"{phase}: interrupted by {sig.name}", (report["error"], smoke.stderr[-2000:])
    assert report["failed_phase"] == phase
    assert len(report["instances"]) == 2
    if phase == "rent":  # the create in flight was found by its label
        assert re.search(r"destroying instance \d+ \(ppsmoke-\S+-stage1\): created by this run", smoke.stderr)
    assert all(i["final_state"] == "destroyed" for i in report["instances"])
    await assert_nothing_left(fake, smoke, 2)


# --- the node's own time-to-live ---------------------------------------------------------------


@pytest.mark.parametrize("after", ["rent", "converge"])  # before the nodes joined, and after
async def test_nodes_destroy_their_own_instances_when_the_orchestrator_is_killed(
    after: str, emulator: Callable[[str], Any], tmp_path: Path
) -> None:
    fake = await emulator("vast.boot_delay=1")
    async with Smoke(fake, tmp_path, "--orphan-grace", "2") as smoke:
        await smoke.wait_line(after)
        smoke.proc.kill()  # no teardown at all: the nodes must notice on their own
        await smoke.finish(30)
    assert len(fake.live()) == 2
    deadline = time.monotonic() + 30
    while fake.live() and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert fake.live() == []  # each node DELETEd its own instance with CONTAINER_API_KEY
    deletes = [(m, p, s) for m, p, s in fake.requests if m == "DELETE"]
    assert sorted(deletes) == sorted(("DELETE", f"/api/v0/instances/{i.id}/", 200) for i in fake.destroyed)
    for inst in fake.destroyed:
        assert inst.proc is not None
        assert any(e.kind is EventKind.EXPIRED and "lost the orchestrator" in e["reason"] for e in inst.proc.events)
    deadline = time.monotonic() + 15
    while node_processes(TAG) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert node_processes(TAG) == []

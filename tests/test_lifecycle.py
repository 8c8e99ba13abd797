"""``pp-smoke-run`` against the emulator, as users run it: a subprocess, its exit status, its
report, and what is left rented or running afterwards.

The emulator runs in this test's event loop, so its records are checked directly; its instances
are real ``pp-gpu-node`` processes whose workers run the session's synthetic model (nothing here
checks tokens or text). Each row of the spec's error table
is driven through a failpoint, and SIGINT/SIGTERM are sent during each phase. Every run uses a
distinctive API key and checks that it appears nowhere: stdout, stderr (with -v logging), the
report, or the nodes' logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from pytest_ppsmoke.cloud.fake_vast import FakeVast

from .helpers import CLI, SMOLLM2, TEST_TAG, node_processes

pytestmark = pytest.mark.local

KEY = "vk-LIFECYCLE-7f3e9a1c55d0-NEVER-PRINT-ME"
TAG = f"lifecycle-{os.getpid()}"  # in the environment of every node this module starts


class Smoke:
    """One ``pp-smoke-run --local --vast-url <emulator>`` subprocess."""

    model = SMOLLM2.name  # the tests here set the synthetic model (_orchestration_only)

    def __init__(self, fake: FakeVast, tmp_path: Path, *args: str, mode: str = "--local") -> None:
        self.fake = fake
        self.report_path = tmp_path / "report.json"
        self.argv = [*CLI, mode, "--vast-url", fake.url, *args]
        if mode != "--reap":
            self.argv += ["--model", self.model, "--report", str(self.report_path), "-v"]
        self.lines: list[str] = []
        self.stderr = ""
        self._new = asyncio.Event()

    async def __aenter__(self) -> Smoke:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            env={**os.environ, "VAST_API_KEY": KEY},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        self._readers = [asyncio.ensure_future(self._out()), asyncio.ensure_future(self._err())]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    async def _out(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            self.lines.append(line.decode())
            self._new.set()
        self._new.set()

    async def _err(self) -> None:
        assert self.proc.stderr is not None
        self.stderr = (await self.proc.stderr.read()).decode()

    @property
    def stdout(self) -> str:
        return "".join(self.lines)

    async def wait_line(self, phase: str, timeout: float = 120) -> None:
        """Until the progress line of ``phase`` (printed when the phase ends) has appeared."""
        deadline = time.monotonic() + timeout
        while not any(f"] {phase} " in line for line in self.lines):
            assert self.proc.returncode is None, f"exited before {phase}:\n{self.stdout}\n{self.stderr[-3000:]}"
            assert time.monotonic() < deadline, f"no {phase} line:\n{self.stdout}"
            self._new.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._new.wait(), 0.5)

    async def finish(self, timeout: float = 240) -> int:
        rc = await asyncio.wait_for(self.proc.wait(), timeout)
        await asyncio.gather(*self._readers)
        return rc

    def report(self) -> dict[str, Any]:
        return json.loads(self.report_path.read_text())  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def _orchestration_only(synth_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run here uses the session's synthetic model: these tests check what is rented,
    destroyed, reported and left running, not tokens or text."""
    monkeypatch.setattr(Smoke, "model", synth_model)


@pytest_asyncio.fixture
async def emulator(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Callable[[str], Any]]:
    started: list[FakeVast] = []
    monkeypatch.setenv(TEST_TAG, TAG)  # the emulator's nodes inherit this process's environment

    async def start(faults: str) -> FakeVast:
        fake = FakeVast(api_key=KEY, faults=faults)
        started.append(fake)
        await fake.start()
        return fake

    yield start
    for fake in started:
        await fake.close()


async def assert_nothing_left(fake: FakeVast, smoke: Smoke, created: int) -> None:
    """Every instance created was destroyed, no node process is left, and the key was never shown."""
    assert fake.live() == [], f"still rented: {fake.live()}"
    assert len(fake.destroyed) == created, [i.id for i in fake.destroyed]
    deadline = time.monotonic() + 15
    while node_processes(TAG) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)  # the emulator stops destroyed instances behind its answer
    assert node_processes(TAG) == []
    logs = [i.proc.stderr_tail() for i in fake.destroyed if i.proc]
    report = smoke.report_path.read_text() if smoke.report_path.exists() else ""
    places = [("stdout", smoke.stdout), ("stderr", smoke.stderr), ("report", report)] + [
        ("a node's log", t) for t in logs
    ]
    for where, text in places:
        assert KEY not in text, f"the API key appears in {where}"
    assert "vk-LIFECYCLE" not in smoke.stderr + smoke.stdout + report + "".join(logs)
    # no cluster secret either: every 64-hex string printed or reported is a public endpoint id
    if report:
        public = {i["endpoint_id"] for i in json.loads(report)["instances"]}
        assert set(re.findall(r"\b[0-9a-f]{64}\b", smoke.stdout + smoke.stderr + report)) <= public


# --- the spec's error table, one row per test ---------------------------------------------------

ROWS = {
    "fewer than 2 offers": (
        "vast.offers=1",
        [],
        r"failed at rent: 1 offer\(s\) match \(1 GPU, >= 8 GB GPU RAM.*\); 2 are needed",
        0,
    ),
    "a create rejected": (
        "vast.reject_create=2",
        [],
        r"failed at rent: creating stage 1 on offer \d+ was rejected: vast.ai PUT /api/v0/asks/\d+/: HTTP 400",
        1,
    ),
    "an instance never running": (
        "vast.never_running=1",
        ["--polls", "12", "--poll-interval", "0.05"],
        r"failed at boot: stage 1: instance \d+ not running after 12 polls .*\(last status 'loading': Pulling image",
        2,
    ),
    "the cluster never converges": (
        "vast.no_join=1",
        ["--converge-timeout", "10"],
        r"failed at converge: 2 of 3 members alive after 10 s; missing: instance \d+ \(stage 1\), last seen running",
        2,
    ),
    "pp-entry never resolves": (
        "vast.no_names=0",
        ["--resolve-timeout", "3"],
        r"failed at resolve: name 'pp-entry' did not resolve within 3 s",
        2,
    ),
    "a worker never ready": (
        "vast.stall_worker=1",
        [],
        r"failed at load: pp-stage-1 on instance \d+ \(stage 1\): pp-stage-1 worker did not report ready within 3 s",
        2,
    ),
    "done with no text": (
        "vast.empty_text=1",
        ["--max-tokens", "3"],
        r"failed at decode: the last stage reported done with no text \(token ids \[\d+, \d+, \d+\]\)",
        2,
    ),
    "a node drops out mid-decode": (
        "vast.kill_stage=1;vast.kill_after_tokens=3",
        ["--max-tokens", "512"],  # still decoding when the kill comes
        r"failed at decode: pp-stage-(1 \(\w+\) dropped out of the cluster mid-request|0: )",
        2,
    ),
}


@pytest.mark.parametrize("row", list(ROWS))
async def test_error_table_row_exits_1_and_destroys_everything(
    row: str, emulator: Callable[[str], Any], tmp_path: Path
) -> None:
    faults, args, message, created = ROWS[row]
    fake = await emulator(faults)
    async with Smoke(fake, tmp_path, *args) as smoke:
        assert await smoke.finish() == 1, smoke.stderr[-3000:]
    assert re.search(message, smoke.stderr), smoke.stderr[-3000:]
    report = smoke.report()
    assert report["ok"] is False and report["exit_code"] == 1
    assert re.search(message.removeprefix("failed at "), report["error"])
    assert report["failed_phase"] == message.split()[2].rstrip(":")
    assert len(report["instances"]) == created
    assert all(i["final_state"] == "destroyed" for i in report["instances"])
    assert f"{created} of {created} instance(s) destroyed" in smoke.stderr
    await assert_nothing_left(fake, smoke, created)


async def test_destroy_that_fails_warns_exits_1_and_reap_sweeps_it(
    emulator: Callable[[str], Any], tmp_path: Path
) -> None:
    fake = await emulator("vast.destroy_fails=1:6")  # the client tries 6 times; the 7th would work
    async with Smoke(fake, tmp_path, "--max-tokens", "3") as smoke:
        assert await smoke.finish() == 1
    report = smoke.report()
    assert report["text"] and report["text"] in smoke.stdout  # the inference itself worked
    stuck = [i for i in report["instances"] if i["final_state"] != "destroyed"]
    assert [i["stage"] for i in stuck] == [1] and "HTTP 500" in stuck[0]["destroy_error"]
    assert re.search(rf"WARNING: teardown: instance {stuck[0]['id']} \(stage 1\) was NOT destroyed", smoke.stderr)
    assert "pp-smoke-run --reap" in smoke.stderr
    assert report["failed_phase"] == "teardown" and [i.id for i in fake.live()] == [stuck[0]["id"]]

    async with Smoke(fake, tmp_path, mode="--reap") as reaper:
        assert await reaper.finish(60) == 0, reaper.stderr
    assert f"destroyed instance {stuck[0]['id']} ({stuck[0]['label']}, was running)" in reaper.stdout
    await assert_nothing_left(fake, smoke, 2)


async def test_429_bursts_are_absorbed_and_the_run_succeeds(emulator: Callable[[str], Any], tmp_path: Path) -> None:
    fake = await emulator("vast.burst_429=2;vast.throttle_every=5")
    async with Smoke(fake, tmp_path, "--max-tokens", "3") as smoke:
        assert await smoke.finish() == 0, smoke.stderr[-3000:]
    assert sum(s == 429 for _, _, s in fake.requests) >= 4
    report = smoke.report()
    assert report["ok"] and report["text"].strip() and len(report["token_ids"]) == 3
    await assert_nothing_left(fake, smoke, 2)


# --- signals during each phase -----------------------------------------------------------------


async def _second_create_in_flight(smoke: Smoke) -> None:
    """The second instance is rented on the server, its answer held (the failpoint vast.hold_create)."""
    deadline = time.monotonic() + 60
    while len(smoke.fake.instances) < 2:
        assert smoke.proc.returncode is None and time.monotonic() < deadline, smoke.stderr
        await asyncio.sleep(0.01)


async def _tokens_flowing(smoke: Smoke) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        events = [e for i in smoke.fake.live() if i.proc for e in i.proc.events]
        if any(e.get("event") == "token" and e["n"] >= 2 for e in events):
            return
        await asyncio.sleep(0.02)
    pytest.fail("decode never got under way")


SIGNAL_CASES = {
    # phase: (signal, faults, extra args, how to get there)
    "rent": (signal.SIGINT, "vast.hold_create=2", [], _second_create_in_flight),
    "boot": (signal.SIGTERM, "vast.boot_delay=60", [], lambda s: s.wait_line("rent")),
    "converge": (signal.SIGINT, "vast.no_join=1", ["--converge-timeout", "60"], lambda s: s.wait_line("boot")),
    "load": (signal.SIGTERM, "", [], lambda s: s.wait_line("converge")),
    "prefill": (signal.SIGINT, "", [], lambda s: s.wait_line("resolve")),
    "decode": (signal.SIGTERM, "", ["--max-tokens", "512"], _tokens_flowing),  # still decoding when the signal comes
    "reference": (signal.SIGTERM, "", ["--max-tokens", "3"], lambda s: s.wait_line("decode")),
    "teardown": (signal.SIGINT, "vast.api_latency=0.3", ["--max-tokens", "3"], lambda s: s.wait_line("reference")),
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
        assert any(e.get("event") == "expired" and "lost the orchestrator" in e["reason"] for e in inst.proc.events)
    deadline = time.monotonic() + 15
    while node_processes(TAG) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert node_processes(TAG) == []

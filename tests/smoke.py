"""``pp-smoke-run`` against the emulator, as users run it, for the modules that drive it through
its failures (test_lifecycle) and its interruptions (test_signals): the subprocess, its output as
it comes, its report, and the check that nothing is left rented or running and that the API key
appeared nowhere. The ``emulator`` fixture (``tests/conftest.py``) starts the emulators."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from pytest_ppsmoke.cloud.emulator.server import FakeVast

from .helpers import CLI, SMOLLM2, node_processes

KEY = "vk-LIFECYCLE-7f3e9a1c55d0-NEVER-PRINT-ME"
TAG = f"lifecycle-{os.getpid()}"  # in the environment of every node the ``emulator`` fixture starts


class Smoke:
    """One ``pp-smoke-run --local --vast-url <emulator>`` subprocess."""

    model = SMOLLM2.name  # the ``emulator`` fixture sets the session's synthetic model

    def __init__(self, fake: FakeVast, tmp_path: Path, *args: str, mode: str = "--local") -> None:
        self.fake = fake
        self.report_path = tmp_path / "report.json"
        self.argv = [*CLI, mode, "--vast-url", fake.url, *args]
        if mode != "--reap":
            self.argv += ["--model", self.model, "--report", str(self.report_path), "-v"]
        self.lines: list[str] = []
        self.err_lines: list[str] = []
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
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while chunk := await self.proc.stderr.read(1 << 16):  # any length of line, read as it comes
            self.err_lines.append(decoder.decode(chunk))
        self.err_lines.append(decoder.decode(b"", final=True))

    @property
    def stdout(self) -> str:
        return "".join(self.lines)

    @property
    def stderr(self) -> str:
        return "".join(self.err_lines)

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
        """Its exit code, once it has exited and its output is read. A run still going after
        ``timeout`` fails the test with what it printed so far, so that slow and stuck can be told
        apart (the test's own budget, pytest's ``timeout``, would only dump the test's threads)."""
        try:
            rc = await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            raise AssertionError(
                f"pp-smoke-run still running after {timeout} s; its stdout:\n{self.stdout[-3000:]}\n"
                f"its stderr ends:\n{self.stderr[-6000:]}"
            ) from None
        await asyncio.gather(*self._readers)
        return rc

    def report(self) -> dict[str, Any]:
        return report_of(self.report_path)


def report_problems(report: Any) -> list[str]:
    """What makes ``report`` (a parsed JSON report) not one of the shipped schema's: each problem
    with its place in the report; none when it validates."""
    from pytest_ppsmoke.harness.report import schema_problems

    return schema_problems(report)


def is_report(value: Any) -> bool:
    """Whether a parsed JSON file is a run's report (pp-smoke-run --report, --ppsmoke-report)
    rather than another JSON file a test writes (a layout grid, a saved fit)."""
    return isinstance(value, dict) and {"mode", "exit_code", "instances", "timings"} <= set(value)


def report_of(path: Path) -> dict[str, Any]:
    """The report at ``path``, checked against the shipped schema."""
    report: dict[str, Any] = json.loads(path.read_text())
    problems = report_problems(report)
    assert not problems, f"{path} does not match the report's schema: {problems}"
    return report


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

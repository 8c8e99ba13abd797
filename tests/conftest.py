from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_ppsmoke.cloud.emulator.server import FakeVast
from pytest_ppsmoke.runtime.node import Node, NodeConfig

from .helpers import PYTESTER_INI, TEST_TAG
from .smoke import KEY, TAG, Smoke, is_report, report_problems

NodeFactory = Callable[..., "AsyncIterator[Node]"]


@pytest.fixture
async def nodes() -> AsyncIterator[Callable[..., object]]:
    """Start in-process nodes on loopback; every one is closed after the test, in reverse."""
    started: list[Node] = []

    async def start(config: NodeConfig, join: bool = True) -> Node:
        node = Node(config)
        started.append(node)
        await node.start(join=join)
        return node

    yield start
    errors = []
    for node in reversed(started):
        try:
            await node.close()
        except Exception as e:
            errors.append(e)
    assert not errors, errors


@pytest.fixture(scope="session")
def repo_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkout built into a wheel once (``pip wheel --no-deps``): what a wheel install gets,
    and what the image's ``pip install /src`` installs (pip builds the same wheel first)."""
    out = tmp_path_factory.mktemp("wheel")
    root = Path(__file__).resolve().parent.parent
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(root)]
    done = subprocess.run(build, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    [wheel] = out.glob("pytest_ppsmoke-*.whl")
    return wheel


@pytest.fixture
async def emulator(synth_model: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Callable[[str], Any]]:
    """Starts emulators (``start(faults)``) in the test's event loop, all closed after the test;
    their nodes carry ``tests.smoke.TAG``, and every ``Smoke`` run of the test uses the session's
    synthetic model: these runs check what is rented, destroyed, reported and left running, not
    tokens or text."""
    started: list[FakeVast] = []
    monkeypatch.setenv(TEST_TAG, TAG)  # the emulator's nodes inherit this process's environment
    monkeypatch.setattr(Smoke, "model", synth_model)

    async def start(faults: str, network: str = "loopback") -> FakeVast:
        fake = FakeVast(api_key=KEY, faults=faults, network=network)
        started.append(fake)
        await fake.start()
        return fake

    yield start
    for fake in started:
        await fake.close()


@pytest.fixture(autouse=True)
def _pytester_ini(request: pytest.FixtureRequest) -> None:
    """Every pytester project starts with :data:`tests.helpers.PYTESTER_INI` (a test that writes
    its own ini starts from it)."""
    if "pytester" in request.fixturenames:
        request.getfixturevalue("pytester").makeini(PYTESTER_INI)


@pytest.fixture(autouse=True)
def _reports_match_the_schema(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every run's JSON report that a test writes (under its ``tmp_path`` or its pytester
    project) matches the schema the package ships (``harness/report.schema.json``): checked
    after the test, whatever the test itself read of it."""
    places = [request.getfixturevalue(f) for f in ("tmp_path",) if f in request.fixturenames]
    if "pytester" in request.fixturenames:
        places.append(request.getfixturevalue("pytester").path)
    yield
    for place in places:
        for path in sorted(Path(place).rglob("*.json")):
            try:
                found = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # not JSON, or written half: not a report
            if is_report(found):
                problems = report_problems(found)
                assert not problems, f"{path} does not match the report's schema: {problems}"

"""One deployment per test session, whatever the runner: the plugin's scheduler under every
pytest-xdist ``--dist`` mode, the teardown's tests last under every reordering plugin, and real
sessions with ``-n 2`` that rent once (counted from the JUnit XML's run ids) and refuse ``--dist
each`` before anything rents."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from types import SimpleNamespace
from typing import Any

import pytest
from xdist.remote import Producer

from pytest_ppsmoke import failpoints, plugin
from pytest_ppsmoke.distributed import UNIT, XDIST, OneDeployment

from .helpers import PYTESTER_INI, TEST_TAG, node_processes

pytestmark = pytest.mark.local

# what the workers send the controller: each test that uses the deployment carries @ppsmoke
# (appended by the plugin after everything else, so after xdist's own @group under loadgroup)
COLLECTION = [
    "a.py::test_plain_a1",
    "a.py::test_dep_a@ppsmoke",
    "a.py::test_plain_a2",
    "b.py::Test::test_plain_b1",
    "b.py::Test::test_dep_b@ppsmoke",
    "b.py::test_plain_b2",
    "c.py::test_plain_c1@g",
    "c.py::test_plain_c2",
    "c.py::test_plain_c3",
    "e.py::test_plain_e@g",
    "e.py::test_dep_e@g@ppsmoke",
    "f.py::test_plain_f1",
    "f.py::test_plain_f2",
    "z.py::test_teardown@ppsmoke",
]
DEPLOYMENT = [n for n in COLLECTION if n.endswith("@ppsmoke")]
# the one unit, per mode: the deployment's tests and the rest of each scope that holds one
UNITS = {
    "load": set(DEPLOYMENT),
    "worksteal": set(DEPLOYMENT),
    "loadgroup": {*DEPLOYMENT, "c.py::test_plain_c1@g", "e.py::test_plain_e@g"},  # group g holds one
    "loadfile": {n for n in COLLECTION if n.startswith(("a.py", "b.py", "e.py", "z.py"))},
    "loadscope": {n for n in COLLECTION if n.startswith(("a.py", "b.py::Test::", "e.py", "z.py"))},
}


class FakeNode:
    """What xdist's schedulers use of a worker: its id, the tests sent, shutdown."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []

    def __repr__(self) -> str:
        return f"FakeNode({self.gateway.id})"

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def send_runtest_all(self) -> None:
        self.sent += range(len(COLLECTION))

    def shutdown(self) -> None:
        self.shutting_down = True


def _scheduler(pytester: pytest.Pytester, mode: str, collection: list[str]) -> tuple[OneDeployment, list[FakeNode]]:
    config = pytester.parseconfig("--tx", "2*popen", "--dist", mode)
    sched = OneDeployment(config, Producer("sched", enabled=False))
    nodes = [FakeNode("gw0"), FakeNode("gw1")]
    for node in nodes:
        sched.add_node(node)
    for node in nodes:
        sched.add_node_collection(node, collection)
    sched.schedule()
    return sched, nodes


def _run(sched: OneDeployment, nodes: list[FakeNode]) -> dict[str, list[str]]:
    """Each node runs what it was sent, one test at a time, until nothing is pending."""
    ran: dict[str, list[str]] = {n.gateway.id: [] for n in nodes}
    done: set[tuple[str, int]] = set()
    while True:
        busy = [(n, i) for n in nodes for i in n.sent if (n.gateway.id, i) not in done][:1]
        if not busy:
            return ran
        node, i = busy[0]
        done.add((node.gateway.id, i))
        ran[node.gateway.id].append(COLLECTION[i])
        sched.mark_test_complete(node, i)


@pytest.mark.parametrize("mode", ["load", "loadscope", "loadfile", "loadgroup", "worksteal"])
def test_every_dist_mode_runs_the_deployments_tests_in_one_worker(pytester: pytest.Pytester, mode: str) -> None:
    sched, nodes = _scheduler(pytester, mode, COLLECTION)
    ran = _run(sched, nodes)
    assert sorted(n for tests in ran.values() for n in tests) == sorted(COLLECTION)  # every test once
    [holder] = [w for w, tests in ran.items() if set(DEPLOYMENT) <= set(tests)]  # one worker has them all
    unit = [n for n in COLLECTION if n in UNITS[mode]]
    assert [n for n in ran[holder] if n in UNITS[mode]] == unit  # in collection order: the teardown's last
    assert {n for n in COLLECTION if sched.inner._split_scope(n) == UNIT} == UNITS[mode]
    other = next(w for w in ran if w != holder)
    assert ran[other], f"{mode}: the other tests were not spread: {ran}"
    # the mode's own promise holds for every other scope: a file, a module or class, a group together
    if mode in ("loadfile", "loadscope", "loadgroup"):
        for node_id in COLLECTION:
            scope = sched.inner._split_scope(node_id)
            together = {w for w, tests in ran.items() for n in tests if sched.inner._split_scope(n) == scope}
            assert len(together) == 1, (mode, scope, ran)


@pytest.mark.parametrize("mode", ["load", "loadscope", "loadfile", "loadgroup", "worksteal", "each"])
def test_without_the_deployments_tests_xdist_schedules_as_it_always_did(pytester: pytest.Pytester, mode: str) -> None:
    plain = [n.removesuffix("@ppsmoke") for n in COLLECTION]
    sched, _ = _scheduler(pytester, mode, plain)
    assert type(sched.inner) is XDIST[mode]


def test_dist_each_is_refused_before_anything_runs(pytester: pytest.Pytester) -> None:
    with pytest.raises(pytest.exit.Exception, match=r"--dist each runs every test in every worker") as e:
        _scheduler(pytester, "each", COLLECTION)
    assert e.value.returncode == pytest.ExitCode.USAGE_ERROR
    assert "would rent its own deployment of the tests that use it (4 of them). Pass --dist load" in str(e.value)


# --- the teardown's tests last, whoever reorders ------------------------------------------------

ORDERED = """
def test_a(ppsmoke_session): pass
def test_teardown(ppsmoke_teardown): pass
def test_b(ppsmoke_session): pass
def test_c(): pass
"""
MODULES = [f"test_order{i}" for i in range(4)]


@pytest.mark.parametrize(
    "args",
    [["-p", "randomly", "-p", "no:cacheprovider", "--randomly-seed=1"], ["--ff"]],
    ids=["randomly", "failed-first"],
)
def test_the_teardowns_tests_run_after_every_other_test_whoever_reorders(
    pytester: pytest.Pytester, args: list[str]
) -> None:
    """pytest-randomly shuffles before every other hook (four modules, shuffled within and
    between); --ff and --lf reorder after theirs, in wrappers: the plugin's order comes after
    both. For --ff a teardown's test failed last time, which would put it first."""
    pytester.makepyfile(**dict.fromkeys(MODULES, ORDERED))
    cache = pytester.path / ".pytest_cache" / "v" / "cache"
    cache.mkdir(parents=True)
    (cache / "lastfailed").write_text(json.dumps({"test_order2.py::test_teardown": True}))
    order = [line for line in pytester.runpytest("--collect-only", "-q", *args).outlines if "::test_" in line]
    assert len(order) == 4 * len(MODULES)
    teardowns = [i for i, line in enumerate(order) if line.endswith("::test_teardown")]
    assert teardowns == list(range(len(order) - len(MODULES), len(order))), order
    if "--ff" not in args:
        written = [f"{m}.py::test_{t}" for m in MODULES for t in "abc"] + [f"{m}.py::test_teardown" for m in MODULES]
        assert sorted(order[:-4]) == sorted(written[:-4]) and order != written, "not shuffled"


# --- real sessions with two workers -------------------------------------------------------------

SPREAD = {  # four of the six use the deployment: spread by xdist's own --dist load, two workers would each rent
    "test_one": """
def test_rents_one(ppsmoke_instances, record):
    record("one", ppsmoke_instances.run_id)

def test_plain(): pass

def test_rents_two(ppsmoke_instances, record):
    record("two", ppsmoke_instances.run_id)
""",
    "test_two": """
def test_rents_three(ppsmoke_instances, record):
    record("three", ppsmoke_instances.run_id)

def test_teardown(ppsmoke_teardown, record):
    record("teardown", ppsmoke_teardown.report.run_id)
    assert ppsmoke_teardown.report.left_after_teardown == []

def test_rents_four(ppsmoke_instances, record):
    record("four", ppsmoke_instances.run_id)
""",
    "conftest": """
import json, os, pathlib
import pytest

@pytest.fixture
def record(request):
    def write(what, run_id):
        with pathlib.Path("ran.jsonl").open("a") as f:
            f.write(json.dumps([what, os.environ.get("PYTEST_XDIST_WORKER"), run_id]) + "\\n")
    return write
""",
}


def _ran(pytester: pytest.Pytester) -> list[Any]:
    path = pytester.path / "ran.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_two_workers_rent_once_and_dist_each_is_refused(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, synth_model: str
) -> None:
    """``-n 2 --dist load -p randomly``, the deployment's tests in two files among others: one
    rental (one run id in the JUnit XML, whichever worker would have rented), on one worker, the
    teardown's test last; reports carry the plain node ids (what --lf and --sw record). ``--dist
    each`` stops before any test runs."""
    pytester.makepyfile(**SPREAD)
    pytester.makeini(f"{PYTESTER_INI}ppsmoke_mode = local\n")
    tag = f"xdist-{os.getpid()}"
    monkeypatch.setenv(TEST_TAG, tag)
    monkeypatch.setenv(failpoints.ENV, "vast.stall_worker=0,1")  # nodes with no tinygrad worker: rented, cheap
    junit = pytester.path / "out.xml"
    common = ["-n", "2", "-p", "no:cacheprovider", "--ppsmoke-model", synth_model, f"--junitxml={junit}"]
    result = pytester.runpytest_subprocess(*common, "--dist", "load", "-p", "randomly")
    cases = list(ET.fromstring(junit.read_text()).iter("testcase"))
    ids = {p.get("value") for c in cases for p in c.iter("property") if p.get("name") == "ppsmoke_run_id"}
    rentals = ids - {None, "None"}  # a session that never started has no run id
    assert len(rentals) == 1, f"rented {len(rentals)} times: {sorted(map(str, rentals))}"
    ran = _ran(pytester)
    assert sorted(what for what, _, _ in ran) == ["four", "one", "teardown", "three", "two"], ran
    assert ran[-1][0] == "teardown", ran
    assert len({(worker, run_id) for _, worker, run_id in ran}) == 1, ran  # one worker, one deployment
    assert not [c.get("name") for c in cases if "@" in (c.get("name") or "")]  # the plain node ids
    result.assert_outcomes(passed=6)
    assert node_processes(tag) == []

    (pytester.path / "ran.jsonl").unlink()
    result = pytester.runpytest_subprocess(*common, "--dist", "each")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stdout.fnmatch_lines(["*pytest-ppsmoke: --dist each runs every test in every worker, so every worker*"])
    assert _ran(pytester) == [] and node_processes(tag) == []


def test_a_pytest_that_ignores_the_mark_stops_the_session_instead_of_renting_twice() -> None:
    """pytest 9.2 moved the node id to a structured field, and the string field that xdist and
    this plugin set went unread: each worker then rented. Should a later pytest ignore the mark
    again, the session stops with a usage error before any test."""

    class Fixed:  # a node whose id no attribute changes
        nodeid = "t.py::test_x"

    with pytest.raises(pytest.UsageError, match=r"cannot mark t.py::test_x .* every worker would rent"):
        plugin._mark_for_scheduler(Fixed())  # type: ignore[arg-type]

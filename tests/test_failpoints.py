"""Failpoints: the one table, PP_FAILPOINTS's form, the in-process API, and the node's share."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pytest_ppsmoke import failpoints
from pytest_ppsmoke.cloud.emulator.server import FakeVast
from pytest_ppsmoke.nodeenv import NodeEnv

pytestmark = pytest.mark.local

DOCS = Path(__file__).resolve().parent.parent / "docs" / "lifecycle.md"
SPEC_ROWS = [getattr(failpoints, n) for n in dir(failpoints) if n.startswith(("ROW_", "RULE_"))]


@pytest.fixture(autouse=True)
def _no_failpoints_from_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(failpoints.ENV, raising=False)


def test_the_env_form_parses_into_typed_values_and_prints_back() -> None:
    text = "vast.reject_create=2;vast.destroy_fails=1:6;vast.boot_delay=1.5;vast.offers=1;node.no_names"
    s = failpoints.parse(text)
    assert s.value("vast.reject_create") == {2} and s.value("vast.destroy_fails") == {1: 6}
    assert s.value("vast.boot_delay") == (1.5,) and s.value("vast.offers") == 1 and s.on("node.no_names")
    assert failpoints.parse(str(s)) == s
    assert str(s) == "vast.offers=1;vast.reject_create=2;vast.boot_delay=1.5;vast.destroy_fails=1:6;node.no_names"
    # a mapping of typed values is the same scenario
    typed = {"vast.reject_create": {2}, "vast.destroy_fails": {1: 6}, "vast.boot_delay": 1.5, "vast.offers": 1}
    assert failpoints.parse({**typed, "vast.boot_delay": [1.5]}).value("vast.boot_delay") == (1.5,)
    assert failpoints.parse({**typed, "node.no_names": True}) == s
    # off: each point's default
    off = failpoints.parse("")
    assert not off and off.value("vast.boot_delay") == (0.2,) and off.value("vast.never_running") == frozenset()
    # one boot per host, in create order; the heartbeat gaps and late ports vast.ai's hosts show
    hosts = failpoints.parse("vast.boot_delay=1,75;vast.heartbeat_gap=1:5,0:2.5;vast.late_ports=3")
    assert hosts.value("vast.boot_delay") == (1.0, 75.0) and hosts.value("vast.heartbeat_gap") == {0: 2.5, 1: 5.0}
    assert str(hosts) == "vast.boot_delay=1,75;vast.heartbeat_gap=0:2.5,1:5;vast.late_ports=3"
    assert failpoints.parse(str(hosts)) == hosts
    assert failpoints.parse("node.no_names=off") == off and failpoints.parse(" ; ;") == off


def test_unknown_points_and_bad_values_are_named() -> None:
    with pytest.raises(ValueError, match=r"unknown failpoint 'vast.explode'; known: vast.offers, vast.reject_create"):
        failpoints.parse("vast.explode=1")
    with pytest.raises(ValueError, match=r"failpoint 'vast.offers' takes an integer >= 0, got 'many'"):
        failpoints.parse("vast.offers=many")
    with pytest.raises(ValueError, match=r"failpoint 'vast.destroy_fails' takes stage:count pairs"):
        failpoints.parse("vast.destroy_fails=1")
    for bad in ("1,,2", "1,-1", "soon", ""):
        with pytest.raises(ValueError, match=r"failpoint 'vast.boot_delay' takes seconds >= 0, one per instance"):
            failpoints.parse(f"vast.boot_delay={bad}")
    with pytest.raises(ValueError, match=r"failpoint 'vast.heartbeat_gap' takes stage:seconds pairs"):
        failpoints.parse("vast.heartbeat_gap=5")
    with pytest.raises(ValueError, match=r"failpoint 'vast.late_ports' takes a number of seconds >= 0"):
        failpoints.parse("vast.late_ports=-1")
    with pytest.raises(ValueError, match=r"failpoint 'node.no_names' takes nothing, 'on' or 'off', got 'yes'"):
        failpoints.parse("node.no_names=yes")
    with pytest.raises(ValueError, match=r"unknown failpoint 'node.typo'"):
        failpoints.on("node.typo")  # a typo at the point itself is caught too


def test_scoped_cfg_and_remove_change_this_process_only_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not failpoints.on("node.empty_text")
    with failpoints.scoped({"node.empty_text": True, "vast.offers": 1}) as s:
        assert failpoints.on("node.empty_text") and s.value("vast.offers") == 1
        with failpoints.scoped("vast.offers=3"):
            assert failpoints.value("vast.offers") == 3 and failpoints.on("node.empty_text")
        assert failpoints.value("vast.offers") == 1
        failpoints.remove("node.empty_text")
        assert not failpoints.on("node.empty_text")
    assert not failpoints.active()
    # PP_FAILPOINTS is the one switch from outside; cfg / remove override it in process
    monkeypatch.setenv(failpoints.ENV, "node.no_names;vast.no_join=1")
    assert failpoints.on("node.no_names") and failpoints.value("vast.no_join") == {1}
    with failpoints.scoped({}):
        failpoints.remove("node.no_names")
        failpoints.cfg("node.stall_worker")
        assert not failpoints.on("node.no_names") and failpoints.on("node.stall_worker")
    assert failpoints.on("node.no_names") and not failpoints.on("node.stall_worker")
    monkeypatch.setenv(failpoints.ENV, "node.nope")
    with pytest.raises(ValueError, match=r"PP_FAILPOINTS: unknown failpoint 'node.nope'"):
        failpoints.active()


def test_the_emulator_gives_a_stage_its_node_points_through_the_node_environment() -> None:
    s = failpoints.parse("vast.no_names=0;vast.empty_text=0,1;vast.stall_worker=1")
    assert str(s.for_stage(0)) == "node.no_names;node.empty_text"
    assert str(s.for_stage(1)) == "node.stall_worker;node.empty_text"
    assert not s.for_stage(2) and not s.for_stage(None)
    assert str(failpoints.parse("vast.slow_decode=2.5").for_stage(1)) == "node.slow_decode=2.5"  # every stage
    held = failpoints.parse("vast.hold_prefill=1:30")  # the picked stage's node, with its seconds
    assert str(held.for_stage(1)) == "node.hold_prefill=30" and not held.for_stage(0)
    # the round trip through the one variable
    env = NodeEnv(stage=1, failpoints=str(s.for_stage(1))).to_env()
    assert env[failpoints.ENV] == "node.stall_worker;node.empty_text"
    assert failpoints.parse(NodeEnv.from_env(env).failpoints) == s.for_stage(1)
    with pytest.raises(ValueError, match=r"PP_FAILPOINTS is not a failpoint setting: unknown failpoint 'x'"):
        NodeEnv.from_env({failpoints.ENV: "x"})


def test_the_emulator_takes_its_points_from_its_argument_or_from_this_process() -> None:
    assert FakeVast(faults="vast.offers=1").faults.value("vast.offers") == 1
    assert FakeVast(faults={"vast.hold_create": 2}).faults.value("vast.hold_create") == {2}
    with pytest.raises(ValueError, match="unknown failpoint 'offers'"):
        FakeVast(faults={"offers": 1})
    with failpoints.scoped("vast.reject_create=2"):
        assert FakeVast().faults.value("vast.reject_create") == {2}
    assert not FakeVast().faults


def test_every_point_serves_a_spec_row_and_is_documented() -> None:
    docs = DOCS.read_text()
    table = docs[docs.index("### Failpoints") :]
    for p in failpoints.POINTS.values():
        assert p.row in SPEC_ROWS, p.name
        assert re.search(rf"[`;]{re.escape(p.name)}[=`]", table), f"{p.name} is not in docs/lifecycle.md's table"
    assert {p.row for p in failpoints.POINTS.values()} == set(SPEC_ROWS)  # each row has its points

"""The false-failure benchmark's own logic, without its loads or runs (``bench/false_failures.py``,
imported by its path): causes classified from a report and a JUnit XML and grouped across runs,
a ``detect`` run judged against SWIM's bound, and parts merged, summed and refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .helpers import load_bench

pytestmark = pytest.mark.local


ff = load_bench("false_failures")

LOST = (
    "converge: pp-stage-1 on instance 12400002 (ppsmoke-20261204T044403-b471b0-stage1) (endpoint 48212fe3de) "
    "dropped out after 3.25 s; see /tmp/pytest-of-root/x/report.json"
)
SWIM = {"ping_timeout": 0.12, "protocol_period": 0.25, "suspicion_timeout": 3.0, "suspicion_max_mult": 4.0}


def test_one_cause_from_different_runs_is_one_key_and_stage_names_stay() -> None:
    other = LOST.replace("12400002", "12400007").replace("b471b0", "0f0f0f").replace("3.25", "11.5")
    other = other.replace("48212fe3de", "aa00bb11cc").replace("/x/", "/y/")
    assert ff.normalize(LOST) == ff.normalize(other)
    assert ff.normalize(LOST) == (
        "converge: pp-stage-1 on instance N (<label>) (endpoint <id>) dropped out after N s; see <path>"
    )
    assert ff.normalize(LOST) != ff.normalize(LOST.replace("pp-stage-1", "pp-stage-0"))


def test_a_reports_cause_is_its_failed_phase_and_first_line() -> None:
    report = {"ok": False, "failed_phase": "converge", "error": LOST + "\nmore"}
    assert ff.cli_cause(report, 1, "") == ff.normalize(LOST)
    assert ff.cli_cause({"ok": False, "failed_phase": "boot", "error": "stage 0: slow"}, 1, "") == "boot: stage N: slow"
    assert ff.cli_cause({"ok": True}, 0, "") is None
    assert ff.cli_cause(None, 1, "x\nTraceback: boom at 12\n") == "exit N, no report: Traceback: boom at N"


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="pytest_ppsmoke.spec.test_spec" name="test_passes" time="1.0"/>
<testcase classname="pytest_ppsmoke.spec.test_spec" name="test_tokens" time="40.1">
<failure message="AssertionError: decode took 41.5 s, over 30 s">trace</failure></testcase>
<testcase classname="pytest_ppsmoke.spec.test_spec" name="test_teardown" time="2.0">
<error message="failed on teardown">trace</error></testcase>
</testsuite></testsuites>"""


def test_a_spec_runs_causes_are_its_failing_tests_from_the_junit_xml() -> None:
    cause, failing = ff.spec_cause(JUNIT, 1, "")
    assert cause == "test_tokens: AssertionError: decode took N s, over N s"
    assert failing == [cause, "test_teardown: failed on teardown"]
    passed = JUNIT.replace('<failure message="AssertionError: decode took 41.5 s, over 30 s">trace</failure>', "")
    assert ff.spec_cause(passed.replace('<error message="failed on teardown">trace</error>', ""), 0, "") == (None, [])
    assert ff.spec_cause(None, 4, "ERROR: usage\n")[0] == "exit N, no failing test in the JUnit XML: ERROR: usage"


def test_swims_bound_for_the_runs_timing() -> None:
    # 3 members: probed within 2 x 2 periods (1.0 s), a probe of max(0.25, 3 x 0.12) s, then the suspicion
    # of 3 s (confirmed) or 4 x 3 s (a lone accuser)
    assert ff.swim_bound(SWIM, 3) == {"confirmed_s": 4.36, "lone_s": 13.36}
    assert ff.swim_bound({**SWIM, "suspicion_max_mult": 3.0}, 3)["lone_s"] == 10.36


def detect_report(killed: float, dead: float | None, **over: Any) -> dict[str, Any]:
    deaths = [] if dead is None else [{"member": "pp-stage-1", "at": dead}]
    return {
        "ok": False,
        "num_stages": 2,
        "failed_phase": "decode",
        "error": "decode: pp-stage-1 on instance 1 (l) dropped out of the cluster mid-request: ...",
        "emulator": {"host_losses": [{"instance": 1, "stage": 1, "how": "killed", "after_tokens": 3, "at": killed}]},
        "swim": {**SWIM, "deaths": deaths, "stats": {"awareness": 0}},
        **over,
    }


def test_a_detect_run_is_judged_by_its_phase_its_stage_and_swims_delay_against_the_bound() -> None:
    good = ff.detection(detect_report(100.0, 103.4), 1, "")
    assert good["cause"] is None and good["detection_s"] == 3.4 and good["within"]
    late = ff.detection(detect_report(100.0, 113.5), 1, "")
    assert late["cause"] == "SWIM declared pp-stage-1 dead after the bound" and not late["within"]
    assert ff.detection(detect_report(100.0, None), 1, "")["cause"] == (
        "no SWIM declared pp-stage-1 dead (swim.deaths, the error)"
    )
    by_stage0 = detect_report(
        100.0, None, failed_at=104.25, error="decode: x: pp-stage-1 dropped out: pp-stage-0's SWIM declared it dead"
    )
    found = ff.detection(by_stage0, 1, "")
    assert (found["cause"], found["detection_s"], found["declared_by"]) == (
        None,
        4.25,
        "pp-stage-0's SWIM, as the run learnt it",
    )
    assert ff.detection({**by_stage0, "failed_at": 200.0}, 1, "")["cause"] == (
        "SWIM declared pp-stage-1 dead after the bound"
    )
    # a decode failure of another cause, whose accounts name the killed stage (vast.ai still
    # shows it running): not the detection the run is for, though SWIM declared it dead
    words = "pp-stage-1 is hung, or cut off: no answer over the cluster within 4 s while vast.ai shows it running"
    other = detect_report(
        100.0,
        103.0,
        error=f"decode: pp-stage-0 on instance 1 (l): no token within 60 s; {words} "
        "(each node's log tail: the report's instances[].log_tail)",
        instances=[{"stage": 1, "node_words": words}],
    )
    assert ff.detection(other, 1, "")["cause"].startswith("decode: pp-stage-0 on instance N (l): no token within N s;")
    wrong = ff.detection(detect_report(100.0, 103.0, failed_phase="load", error="load: slow"), 1, "")
    assert wrong["cause"] == "load: slow"
    assert ff.detection({"ok": True}, 0, "")["cause"] == "the run passed: the killed stage was never noticed"


def part(commit: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    return ff.result([{"commit": commit, "machine": {"cores": 2}}], runs)


def run(load: str, kind: str, cause: str | None = None, **more: Any) -> dict[str, Any]:
    return {"load": load, "kind": kind, "wall_s": 50.0, "cause": cause, "false": cause is not None, **more}


def test_parts_merge_into_summed_cells_with_every_cause_and_refuse_other_commits() -> None:
    one = part("c1", [run("busy", "cli"), run("busy", "cli", "converge: x"), run("none", "cli")])
    two = part("c1", [run("busy", "cli", "converge: x"), run("busy", "cli", "timeout: no end within N s")])
    merged = ff.merge([one, two])
    busy = merged["cells"]["busy/cli"]
    assert (busy["runs"], busy["false_failures"]) == (4, 3)
    assert busy["causes"] == {"converge: x": 2, "timeout: no end within N s": 1}
    assert merged["cells"]["none/cli"]["runs"] == 1 and len(merged["parts"]) == 2 and merged["commits"] == ["c1"]
    other = part("c2", [run("none", "cli")])
    with pytest.raises(ValueError, match=r"2 commits .*--allow-commits"):
        ff.merge([one, other])
    allowed = ff.merge([one, other], allow_commits=True)
    assert allowed["commits"] == ["c1", "c2"] and allowed["commits_allowed_to_differ"]
    assert allowed["cells"]["none/cli"]["runs"] == 2


def test_the_table_shows_each_cell_with_its_causes_and_detections() -> None:
    doc = part(
        "c1",
        [
            run("busy", "detect", detection_s=3.4, bound={"lone_s": 13.36}),
            run("busy", "cli", "converge: x | y"),
        ],
    )
    lines = ff.table(doc).splitlines()
    assert lines[2] == "| busy | cli | 1 | 1 | 1 x converge: x / y | 50.0 | - | - |"
    assert lines[3] == "| busy | detect | 1 | 0 | - | 50.0 | 3.40 / 3.40 | 13.36 |"


def test_an_unknown_load_or_kind_is_named_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown load 'cpu'; expected one of busy, disk, memory, none"):
        ff.load_commands("cpu", Path("/tmp"), 1.0, 1.0)
    with pytest.raises(ValueError, match="unknown kind 'gpu'"):
        ff.command("gpu", Path("/tmp/x"))

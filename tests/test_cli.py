"""``pp-smoke-run --local`` as users run it: a subprocess, its exit status, its report."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.local


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest_ppsmoke.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0): look at its state
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.parametrize("stages", [2, 3])
def test_local_run_forms_the_cluster_reports_it_and_leaves_nothing(tmp_path: Path, stages: int) -> None:
    report_path = tmp_path / "r.json"
    out = run("--local", "--num-stages", str(stages), "--report", str(report_path))
    assert out.returncode == 0, out.stderr
    for phase in ("boot", "converge", "resolve", "hop", "teardown"):
        assert f"] {phase}" in out.stdout
    assert "not built yet: rent, load, prefill, decode" in out.stdout
    report = json.loads(report_path.read_text())
    assert report["ok"] is True and report["exit_code"] == 0 and report["error"] is None
    assert report["num_stages"] == stages
    assert set(report["names"]) == {"pp-entry", "pp-exit", *(f"pp-stage-{i}" for i in range(stages))}
    ids = [inst["endpoint_id"] for inst in report["instances"]]
    assert report["names"]["pp-entry"]["node"] == ids[0]
    assert report["names"]["pp-exit"]["node"] == ids[-1]
    assert [report["names"][f"pp-stage-{i}"]["node"] for i in range(stages)] == ids
    hops = report["hops"]["round_trips"]
    assert [h["to"] for h in hops] == [f"pp-stage-{i}" for i in range(stages)]
    assert all(h["bytes"] == 32 * 576 * 2 for h in hops)  # seq_len x hidden x bf16
    assert set(report["timings"]) >= {"boot", "converge", "resolve", "hop", "teardown", "total"}
    assert not [i["pid"] for i in report["instances"] if alive(i["pid"])]


def test_f32_wire_doubles_the_bytes_per_hop(tmp_path: Path) -> None:
    out = run("--local", "--wire-dtype", "f32", "--report", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr
    hops = json.loads((tmp_path / "r.json").read_text())["hops"]["round_trips"]
    assert {h["bytes"] for h in hops} == {32 * 576 * 4}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--local", "--num-stages", "1"], "--num-stages must be at least 2, got 1"),
        (["--local", "--wire-dtype", "f8"], "invalid choice: 'f8'"),
        (["--local", "--budget", "0"], "--budget must be a positive number of seconds, got 0.0"),
        ([], "only --local is built so far"),
    ],
)
def test_bad_arguments_say_what_was_expected(args: list[str], message: str) -> None:
    out = run(*args, timeout=30)
    assert out.returncode == 2
    assert message in out.stderr


def test_no_secret_reaches_the_output_or_the_report(tmp_path: Path) -> None:
    """Every 64-hex string printed or reported must be a public endpoint id, never a secret key."""
    report_path = tmp_path / "r.json"
    out = run("--local", "-v", "--report", str(report_path))
    assert out.returncode == 0, out.stderr
    text = report_path.read_text()
    public = {i["endpoint_id"] for i in json.loads(text)["instances"]}
    seen = set(re.findall(r"[0-9a-f]{64}", out.stdout + out.stderr + text))
    assert seen <= public
    assert "member" in out.stderr  # -v really logged membership events, so the check saw them

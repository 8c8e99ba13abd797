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


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest_ppsmoke.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie still answers kill(0)


def test_local_run_says_hello_reports_everything_and_leaves_nothing(tmp_path: Path) -> None:
    report_path = tmp_path / "r.json"
    out = run("--local", "-v", "--max-tokens", "16", "--report", str(report_path))
    assert out.returncode == 0, out.stderr[-3000:]
    for phase in ("boot", "load", "converge", "resolve", "prefill", "decode", "teardown"):
        assert f"] {phase}" in out.stdout
    report = json.loads(report_path.read_text())
    assert report["ok"] is True and report["exit_code"] == 0 and report["error"] is None
    assert report["text"].strip() and report["text"] in out.stdout
    assert 1 <= len(report["token_ids"]) <= 16 and len(report["prompt_token_ids"]) > 5
    assert report["split"] == [{"stage": 0, "blocks": [0, 15]}, {"stage": 1, "blocks": [15, 30]}]
    assert set(report["timings"]) >= {
        "boot", "load", "converge", "resolve", "prefill", "decode", "teardown", "total", "decode_tokens_per_s"
    }  # fmt: skip
    hop = report["hops"]["pp-stage-0->pp-stage-1"]
    assert hop["prefill"]["bytes_each"] == [len(report["prompt_token_ids"]) * 576 * 2]  # bf16
    assert hop["decode"]["bytes_each"] == [576 * 2]
    filled = len(report["prompt_token_ids"]) + len(report["token_ids"]) - 1
    assert [k["filled"] for k in report["kv"]] == [filled, filled]
    assert report["cost_usd"] == 0.0 and report["not_built"] == ["rent"]
    pids = [p for i in report["instances"] for p in (i["pid"], i["worker_pid"])]
    assert len(pids) == 4 and not [p for p in pids if alive(p)]
    assert all(i["exit_status"] is not None for i in report["instances"])
    # no secret anywhere: every 64-hex string printed or reported is a public endpoint id
    public = {i["endpoint_id"] for i in report["instances"]}
    seen = set(re.findall(r"[0-9a-f]{64}", out.stdout + out.stderr + report_path.read_text()))
    assert seen <= public
    assert "member" in out.stderr  # -v really logged membership events, so the check saw them


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--local", "--num-stages", "1"], "--num-stages must be at least 2, got 1"),
        (["--local", "--wire-dtype", "f8"], "invalid choice: 'f8'"),
        (["--local", "--budget", "0"], "--budget must be a positive number of seconds, got 0.0"),
        (["--local", "--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
        (["--local", "--model", "gpt5:1t"], "unknown model 'gpt5:1t'; expected one of smollm2:135m"),
        ([], "only --local is built so far"),
    ],
)
def test_bad_arguments_say_what_was_expected(args: list[str], message: str) -> None:
    out = run(*args, timeout=60)
    assert out.returncode == 2
    assert message in out.stderr

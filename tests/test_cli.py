"""``pp-smoke-run --local`` as users run it: a subprocess, its exit status, its report."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .procs import TEST_TAG, node_processes

pytestmark = pytest.mark.local


TAG = f"cli-{os.getpid()}"


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "VAST_API_KEY"} | {TEST_TAG: TAG}
    return subprocess.run(
        [sys.executable, "-m", "pytest_ppsmoke.harness.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
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
    for phase in ("rent", "boot", "converge", "load", "resolve", "prefill", "decode", "teardown"):
        assert f"] {phase}" in out.stdout
    report = json.loads(report_path.read_text())
    assert report["ok"] is True and report["exit_code"] == 0 and report["error"] is None
    assert report["text"].strip() and report["text"] in out.stdout
    assert 1 <= len(report["token_ids"]) <= 16 and len(report["prompt_token_ids"]) > 5
    ids = [i["id"] for i in report["instances"]]
    assert report["split"] == [
        {"stage": 0, "blocks": [0, 15], "instance": ids[0]},
        {"stage": 1, "blocks": [15, 30], "instance": ids[1]},
    ]
    assert set(report["timings"]) >= {
        "rent", "boot", "converge", "load", "resolve", "prefill", "decode", "teardown", "total", "decode_tokens_per_s"
    }  # fmt: skip
    hop = report["hops"]["pp-stage-0->pp-stage-1"]
    assert hop["prefill"]["bytes_each"] == [len(report["prompt_token_ids"]) * 576 * 2]  # bf16
    assert hop["decode"]["bytes_each"] == [576 * 2]
    filled = len(report["prompt_token_ids"]) + len(report["token_ids"]) - 1
    assert [k["filled"] for k in report["kv"]] == [filled, filled]
    # the two cheapest offers that match, each destroyed, and the cost from dph_total x time
    assert [(i["offer"]["gpu_name"], i["dph_total"]) for i in report["instances"]] == [
        ("RTX 3090", 0.21), ("RTX 4090", 0.34)
    ]  # fmt: skip
    assert all(i["final_state"] == "destroyed" and i["label"].startswith("ppsmoke-") for i in report["instances"])
    expected = sum(i["dph_total"] * i["seconds"] / 3600 for i in report["instances"])
    assert report["cost_usd"] == pytest.approx(expected, abs=1e-6) and report["cost_usd"] > 0
    assert all(0 < i["seconds"] <= report["timings"]["total"] for i in report["instances"])
    assert report["emulator"] == {"live_instances": [], "destroyed_instances": ids}
    assert node_processes(TAG) == []
    # no secret anywhere: every 64-hex string printed or reported is a public endpoint id
    public = {i["endpoint_id"] for i in report["instances"]}
    seen = set(re.findall(r"[0-9a-f]{64}", out.stdout + out.stderr + report_path.read_text()))
    assert seen <= public
    assert "member" in out.stderr  # -v really logged membership events, so the check saw them


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--local", "--num-stages", "1"], "--num-stages = '1': expected an integer of at least 2"),
        (["--local", "--wire-dtype", "f8"], "unknown wire dtype 'f8'; expected one of bf16, f16, f32"),
        (["--local", "--budget", "0"], "--budget = '0': expected a positive number, got '0'"),
        (["--local", "--max-tokens", "0"], "--max-tokens = '0': expected an integer of at least 1"),
        (["--local", "--load-timeout", "-1"], "--load-timeout = '-1': expected a positive"),
        (["--local", "--model", "gpt5:1t"], "unknown model 'gpt5:1t'; expected one of smollm2:135m"),
        (["--local", "--min-reliability", "2"], "expected a number between 0 and 1, got '2'"),
        ([], "one of the arguments --vastai --local --reap is required"),
        (["--vastai"], "a vast.ai API key is needed: set VAST_API_KEY or pass --api-key"),
        (["--reap"], "a vast.ai API key is needed"),
        (
            ["--vastai", "--api-key", "k", "--model", "/tmp/m.gguf"],
            "--vastai needs a model name the instances can fetch",
        ),
        (["--local", "--vastai"], "argument --vastai: not allowed with argument --local"),
    ],
)
def test_bad_arguments_say_what_was_expected(args: list[str], message: str) -> None:
    out = run(*args, timeout=60)
    assert out.returncode == 2
    assert message in out.stderr


def _children(pid: int) -> set[int]:
    """Every descendant of ``pid`` (nodes and their workers)."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - found
        found |= frontier
    return found


def _start(tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    report = tmp_path / "r.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest_ppsmoke.harness.cli", "--local", "--report", str(report)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:  # the nodes have joined; their workers are loading the model
        if "] converge" in line:
            return proc, report
    pytest.fail(f"no converge line; stderr:\n{proc.stderr.read() if proc.stderr else ''}")


def _spawned(pid: int, want: int = 4, seconds: float = 30) -> set[int]:
    """The nodes and their workers, once all of them exist (a node starts its worker after joining)."""
    deadline = time.monotonic() + seconds
    while len(found := _children(pid)) < want and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def _wait_gone(pids: set[int], seconds: float) -> set[int]:
    deadline = time.monotonic() + seconds
    while (left := {p for p in pids if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_nodes_exit_when_the_orchestrator_is_killed_outright(tmp_path: Path) -> None:
    proc, _ = _start(tmp_path)
    spawned = _spawned(proc.pid)
    assert len(spawned) >= 4
    proc.kill()  # no teardown at all; the embedded emulator dies too, and its nodes see stdin EOF
    proc.wait()
    assert not _wait_gone(spawned, 30)

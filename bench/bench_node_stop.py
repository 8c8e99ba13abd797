"""How long the nodes take to end once the teardown destroys them, on this machine: the embedded
emulator's destroy stops each node (SIGTERM) and waits for it and its workers to end, so that
nothing is left running, and a local run's exit waits for that.

    python bench/bench_node_stop.py [--runs 3] [--baseline DIR] [--out FILE]

Each run is ``pp-smoke-run --local --reference-load beside --max-tokens 4`` at the suite's pace
(``PP_VAST_TIME_SCALE=0.01``), its emulator's ``instances.stop`` timed per instance and its close
(``Place.close``) as a whole. ``--baseline DIR``: the same runs with ``DIR`` (another checkout's
root) first on ``PYTHONPATH``, interleaved with this checkout's; ratios within the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchio import emit  # bench/ is this script's directory: first on sys.path

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--local", "--reference-load", "beside", "--max-tokens", "4"]

# run in the measured process: times the emulator's stop of each instance and the place's close
WRAPPER = r"""
import functools, json, sys, time
from pytest_ppsmoke.cloud.emulator import instances
from pytest_ppsmoke.harness import setup
seen = {"stops": [], "close": None}
def timed(owner, name, record):
    f = getattr(owner, name)
    @functools.wraps(f)
    async def g(*a, **k):
        t = time.monotonic()
        try:
            return await f(*a, **k)
        finally:
            record(time.monotonic() - t)
    setattr(owner, name, g)
timed(instances, "stop", seen["stops"].append)
timed(setup.Place, "close", lambda s: seen.__setitem__("close", s))
from pytest_ppsmoke.harness.cli import main
sys.argv = ["pp-smoke-run", *sys.argv[1:]]
try:
    main()
finally:
    print("NODE_STOP " + json.dumps(seen), file=sys.stderr, flush=True)
"""


def one(path: Path) -> dict[str, Any]:
    env = {**os.environ, "PP_VAST_TIME_SCALE": "0.01", "PYTHONPATH": str(path)}
    with tempfile.TemporaryDirectory() as home:
        done = subprocess.run(
            [sys.executable, "-c", WRAPPER, *ARGS, "--report", str(Path(home) / "r.json")],
            env=env,
            cwd=home,
            capture_output=True,
            text=True,
            timeout=600,
        )
    line = next((ln for ln in done.stderr.splitlines() if ln.startswith("NODE_STOP ")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"run under {path} failed ({done.returncode}): {done.stderr[-2000:]}")
    seen = json.loads(line.removeprefix("NODE_STOP "))
    return {"stops_s": [round(s, 3) for s in seen["stops"]], "close_s": round(seen["close"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--baseline", type=Path, help="another checkout's root, run interleaved with this one")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    kinds = {"new": ROOT, **({"baseline": a.baseline.resolve()} if a.baseline else {})}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for _ in range(a.runs):
        for kind, path in kinds.items():
            runs[kind].append(one(path))
    result: dict[str, Any] = {"command": " ".join(["pp-smoke-run", *ARGS]), "pace": 0.01, "runs": runs}
    for kind, rs in runs.items():
        result[f"{kind}_median_stop_s"] = statistics.median(s for r in rs for s in r["stops_s"])
        result[f"{kind}_median_close_s"] = statistics.median(r["close_s"] for r in rs)
    if a.baseline:
        result["close_ratio"] = round(result["new_median_close_s"] / result["baseline_median_close_s"], 3)
    emit(result, a.out)


if __name__ == "__main__":
    main()

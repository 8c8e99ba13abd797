"""Smoke runs over the emulated internet (NATs, forwarded ports, iroh's internet mode) against loopback.

    python bench/bench_internet.py [--points loopback,internet,internet-far,internet-far:3] [--out FILE]

Each point is one ``pp-smoke-run --local --network NET [--num-stages N]`` run of the default model
(SmolLM2-135M, the token-exact reference on), one after another; ``loopback`` first, in the same
invocation, is the baseline. Per point: pass or fail, the reference's match, the phases' times
(converge includes the endpoints' bounded wait for a relay that never answers here, and the
round trips measured for SWIM), the orchestrator's path to each stage (direct or relay, its
address and QUIC's round trip), the stages' own paths, the SWIM timing chosen and its counts,
and decode tokens per second as a ratio to the baseline's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchio import emit  # bench/ is this script's directory: first on sys.path

HERE = Path(__file__).resolve().parent

CLI = [sys.executable, "-m", "pytest_ppsmoke.harness.cli"]


def run_point(point: str) -> dict[str, Any]:
    network, _, stages = point.partition(":")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "r.json"
        argv = [*CLI, "--local", "--network", network, "--report", str(report)]
        if stages:
            argv += ["--num-stages", stages]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        rep = json.loads(report.read_text()) if report.exists() else {}
    return {
        "exit": done.returncode,
        "ok": rep.get("ok", False),
        "error": rep.get("error"),
        "reference_match": (rep.get("reference") or {}).get("match"),
        "timings": rep.get("timings", {}),
        "paths": rep.get("paths"),
        "swim": rep.get("swim"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default="loopback,internet,internet-far,internet-far:3")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "internet.json")
    args = ap.parse_args()
    results: dict[str, Any] = {}
    base = None
    for point in [p.strip() for p in args.points.split(",") if p.strip()]:
        res = run_point(point)
        rate = res["timings"].get("decode_tokens_per_s")
        if base is None and point == "loopback":
            base = rate
        res["decode_rate_vs_loopback"] = round(rate / base, 3) if rate and base else None
        results[point] = res
        links = (res["paths"] or {}).get("links", {})
        seen = {k: f"{v['path']} {v['rtt_ms']} ms" for k, v in links.items() if v}
        print(
            f"{point}: ok={res['ok']} match={res['reference_match']} converge={res['timings'].get('converge')} "
            f"decode x{res['decode_rate_vs_loopback']} {seen}",
            flush=True,
        )
    doc = {
        "bench": "internet",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "results": results,
    }
    emit(doc, args.out)


if __name__ == "__main__":
    main()

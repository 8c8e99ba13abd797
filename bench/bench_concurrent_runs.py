"""Smoke runs that share this machine's cores: does SWIM stay quiet when runs compete?

    python bench/bench_concurrent_runs.py [--runs 1,2,3] [--model smollm2:135m] [--out FILE]

For each count N, N ``pp-smoke-run --local`` processes of the default model (SmolLM2-135M, the
token-exact reference on) start at once; a CI runner often runs two jobs on one machine. Per run:
pass or fail, the error, the phases' times, decode tokens per second, and the orchestrator's
failure detector's counts (suspicions raised and refuted, deaths declared, probes excused
because its own event loop stalled). N = 1, measured first in the same invocation, is the
baseline the others' decode rates are compared with (a ratio: absolute speed drifts between
sessions).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchio import emit  # bench/ is this script's directory: first on sys.path

HERE = Path(__file__).resolve().parent

CLI = [sys.executable, "-m", "pytest_ppsmoke.harness.cli"]


def run_together(n: int, model: str, extra: list[str]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        reports = [Path(tmp) / f"r{i}.json" for i in range(n)]
        procs = [
            subprocess.Popen(
                [*CLI, "--local", "--model", model, "--report", str(r), *extra],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in reports
        ]
        started = time.monotonic()
        errs = [p.communicate(timeout=900)[1] for p in procs]
        wall = time.monotonic() - started
        out = []
        for p, r, err in zip(procs, reports, errs, strict=True):
            rep = json.loads(r.read_text()) if r.exists() else {}
            swim = rep.get("swim") or {}
            out.append(
                {
                    "exit": p.returncode,
                    "ok": rep.get("ok", False),
                    "error": rep.get("error")
                    or (err.strip().splitlines()[-1] if p.returncode and err.strip() else None),
                    "reference_match": (rep.get("reference") or {}).get("match"),
                    "timings": rep.get("timings", {}),
                    "swim_stats": swim.get("stats"),
                    "wall_s": round(wall, 2),
                }
            )
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="1,2,3", help="how many runs at once, each count in turn (1 first: the baseline)")
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "concurrent_runs.json")
    args, extra = ap.parse_known_args()
    counts = [int(c) for c in args.runs.split(",")]
    results: dict[str, Any] = {}
    base_rate = None
    for n in counts:
        runs = run_together(n, args.model, extra)
        rates = [r["timings"].get("decode_tokens_per_s") for r in runs if r["timings"].get("decode_tokens_per_s")]
        if n == 1 and rates:
            base_rate = rates[0]
        results[str(n)] = {
            "runs": runs,
            "all_passed": all(r["ok"] and r["exit"] == 0 for r in runs),
            "deaths_declared": sum((r["swim_stats"] or {}).get("deaths_declared", 0) for r in runs),
            "suspicions_raised": sum((r["swim_stats"] or {}).get("suspicions_raised", 0) for r in runs),
            "decode_rate_vs_alone": [round(x / base_rate, 3) for x in rates] if base_rate else None,
        }
        print(f"{n} at once: {json.dumps({k: v for k, v in results[str(n)].items() if k != 'runs'})}", flush=True)
    doc = {
        "bench": "concurrent_runs",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "model": args.model,
        "results": results,
    }
    emit(doc, args.out)


if __name__ == "__main__":
    main()

"""End-to-end benchmark: ``pp-smoke-run --local`` phase by phase, warm and cold, in one run.

    python bench/bench_lifecycle.py [--runs 2] [--max-tokens 64] [--out FILE]

Baseline, measured in the same run: one process that loads the whole model and generates the
same tokens with tinygrad's unsplit ``generate`` (what one machine would do end to end). The
lifecycle's overhead is the difference. "Cold" points tinygrad's kernel cache (``CACHEDB``) at an
empty file for the run and everything it starts, so every kernel is compiled again; "warm" uses
the machine's cache as the previous runs left it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PHASES = ("rent", "boot", "converge", "load", "resolve", "prefill", "decode", "teardown")

BASELINE = """
import json, sys, time
t = time.perf_counter()
from pytest_ppsmoke.stage.model import Tokenizer, load_model, unsplit_generate
model, kv = load_model("smollm2:135m", 1024)
tok = Tokenizer(kv)
loaded = time.perf_counter()
out = unsplit_generate(model, tok.chat("Say hello"), int(sys.argv[1]), tok.end_ids)
done = time.perf_counter()
print(json.dumps({"load_s": loaded - t, "generate_s": done - loaded, "generated": len(out)}))
"""


def run(cmd: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    return time.perf_counter() - started, out


def baseline(max_tokens: int, env: dict[str, str]) -> dict[str, Any]:
    wall, out = run([sys.executable, "-c", BASELINE, str(max_tokens)], env)
    if out.returncode:
        raise SystemExit(f"baseline failed:\n{out.stderr[-3000:]}")
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    return {"wall_s": round(wall, 3), **{k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}}


def smoke(max_tokens: int, env: dict[str, str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        report = Path(d) / "r.json"
        cmd = ["pp-smoke-run", "--local", "--max-tokens", str(max_tokens), "--report", str(report)]
        wall, out = run(cmd, env)
        if out.returncode:
            raise SystemExit(f"pp-smoke-run failed:\n{out.stderr[-3000:]}")
        r = json.loads(report.read_text())
    t = r["timings"]
    return {
        "wall_s": round(wall, 3),  # the command as a user times it: Python start-up and imports included
        "total_s": t["total"],
        "phases_s": {p: t[p] for p in PHASES},
        "decode_tokens_per_s": t["decode_tokens_per_s"],
        "generated": len(r["token_ids"]),
        "cost_usd": r["cost_usd"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=2, help="warm runs (default 2)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    env = dict(os.environ)
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "max_tokens": args.max_tokens,
    }
    with tempfile.TemporaryDirectory() as d:  # cold: empty kernel caches, the baseline's and the run's
        cold_env = {**env, "CACHEDB": str(Path(d) / "cold-baseline.db")}
        result["cold_baseline"] = baseline(args.max_tokens, cold_env)
        print("cold baseline", result["cold_baseline"], flush=True)
        cold_env["CACHEDB"] = str(Path(d) / "cold-run.db")
        result["cold"] = smoke(args.max_tokens, cold_env)
        print("cold run", result["cold"], flush=True)
    result["baseline"] = baseline(args.max_tokens, env)
    print("warm baseline", result["baseline"], flush=True)
    result["warm"] = [smoke(args.max_tokens, env) for _ in range(args.runs)]
    for w in result["warm"]:
        print("warm run", w, flush=True)
    walls = [w["wall_s"] for w in result["warm"]]
    result["summary"] = {
        "warm_wall_s_median": round(statistics.median(walls), 2),
        "warm_overhead_vs_baseline_s": round(statistics.median(walls) - result["baseline"]["wall_s"], 2),
        "cold_wall_s": result["cold"]["wall_s"],
        "target_s": 120,
    }
    print(json.dumps(result["summary"], indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

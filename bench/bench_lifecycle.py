"""End-to-end benchmark: ``pp-smoke-run --local`` (the README's main job, reference included)
phase by phase, cold, warm without our caches and warm with them, in one run.

    python bench/bench_lifecycle.py [--runs 3] [--max-tokens 64] [--out FILE]

Baseline, measured in the same run: one process that loads the whole model and generates the
same tokens with tinygrad's unsplit ``generate`` (what one machine would do end to end, with
tinygrad's own kernel cache warm). The configurations of the command:

- cold: tinygrad's kernel cache (``CACHEDB``) an empty file and the weight cache an empty
  directory, for the run and everything it starts: every kernel is generated and compiled, every
  tensor dequantized;
- uncached: ``--weight-cache off --program-cache off`` with the kernel cache warm (what a warm
  run was before the two caches);
- cached: the defaults, the caches as the previous runs left them.

The uncached and cached runs alternate, so that a drift of this machine's speed touches both.
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

PHASES = ("rent", "boot", "converge", "load", "resolve", "prefill", "decode", "reference", "teardown")

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


def smoke(max_tokens: int, env: dict[str, str], *flags: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        report = Path(d) / "r.json"
        cmd = ["pp-smoke-run", "--local", "--max-tokens", str(max_tokens), "--report", str(report), *flags]
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
        "reference": {k: r["reference"][k] for k in ("match", "load_s", "generate_s")},
        "load": [st.get("load") for st in r["split"]],
        "generated": len(r["token_ids"]),
        "cost_usd": r["cost_usd"],
    }


def median_phases(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Each phase's median over runs, and the median wall time."""
    out = {p: round(statistics.median(r["phases_s"][p] for r in runs), 3) for p in PHASES}
    out["wall_s"] = round(statistics.median(r["wall_s"] for r in runs), 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="runs of each warm configuration (default 3)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    env = dict(os.environ)
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "max_tokens": args.max_tokens,
    }
    with tempfile.TemporaryDirectory() as d:  # cold: empty kernel and weight caches, for the run and its nodes
        cold_env = {**env, "CACHEDB": str(Path(d) / "cold-baseline.db")}
        result["cold_baseline"] = baseline(args.max_tokens, cold_env)
        print("cold baseline", result["cold_baseline"], flush=True)
        cold_env["CACHEDB"] = str(Path(d) / "cold-run.db")
        result["cold"] = smoke(args.max_tokens, cold_env, "--weight-cache", str(Path(d) / "weights"))
        print("cold run", result["cold"], flush=True)
    result["baseline"] = baseline(args.max_tokens, env)
    print("warm baseline", result["baseline"], flush=True)
    smoke(args.max_tokens, env)  # fills the caches, if this machine has never run the command
    result["uncached"], result["cached"] = [], []
    for _ in range(args.runs):
        result["uncached"].append(smoke(args.max_tokens, env, "--weight-cache", "off", "--program-cache", "off"))
        print("uncached run", result["uncached"][-1], flush=True)
        result["cached"].append(smoke(args.max_tokens, env))
        print("cached run", result["cached"][-1], flush=True)
    before, after = median_phases(result["uncached"]), median_phases(result["cached"])
    result["summary"] = {
        "uncached_median": before,
        "cached_median": after,
        "cached_vs_uncached_wall": round(after["wall_s"] / before["wall_s"], 3),
        "cached_vs_baseline_wall": round(after["wall_s"] / result["baseline"]["wall_s"], 3),
        "baseline_wall_s": result["baseline"]["wall_s"],
        "cold_wall_s": result["cold"]["wall_s"],
        "target_s": 30,
    }
    print(json.dumps(result["summary"], indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

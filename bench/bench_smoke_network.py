"""Token-exact smoke runs of the real model over the WAN profiles, against the decode prediction.

    python bench/bench_smoke_network.py [--profiles wan,far] [--max-tokens 64] [--skip 3]
                                        [--fit bench/results/network.json] [--out FILE]

Each profile is one ``pp-smoke-run --local --network PROFILE --reference on`` run of the default
model (SmolLM2-135M), through the driver's ``SmokeRun`` in a process of its own
(``bench_network.py``'s point): pass or fail, the reference's match, the activation hop's median
latency against the profile's one-way delay, and the steady per-token decode time against the
prediction ``C + 2d + O``: ``C`` the compute per token of a loopback run of the same model
measured first, in the same invocation (the baseline), ``d`` the profile's one-way delay and
``O`` the overhead fitted by ``bench_network.py`` (``--fit``, its ``fit.overhead_ms``); and the
same with the run's own compute per token (``own_compute_*``): on a shared 2-core machine the
compute drifts between runs by more than the network adds, and this separates the two.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def run_point(network: str, max_tokens: int, skip: int, reference: str) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE / "bench_network.py"), "--point", network, "--reference", reference]
    cmd += ["--max-tokens", str(max_tokens), "--skip", str(skip)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise SystemExit(f"{network}: the point's process failed:\n{out.stderr[-3000:]}")
    res: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return res


def main() -> None:
    from pytest_ppsmoke.network import parse_network

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default="wan,far")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--fit", type=Path, default=HERE / "results" / "network.json")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "smoke_network.json")
    args = ap.parse_args()
    overhead = float(json.loads(args.fit.read_text())["fit"]["overhead_ms"])
    base = run_point("loopback", args.max_tokens, args.skip, "off")
    if not base["ok"]:
        raise SystemExit(f"the loopback baseline failed: {base['error']}")
    compute = base["per_token"]["compute_ms"]
    print(f"loopback baseline: {json.dumps(base['per_token'])}", flush=True)
    results: dict[str, Any] = {}
    for prof in [p.strip() for p in args.profiles.split(",") if p.strip()]:
        link = parse_network(prof).default
        assert link is not None, f"{prof}: a profile with links is needed"
        r = run_point(prof, args.max_tokens, args.skip, "on")
        pt = r.get("per_token", {})
        predicted = compute + 2 * link.delay_ms + overhead
        hop = r.get("hops", {}).get("pp-stage-0->pp-stage-1", {}).get("decode", {}).get("median_s")
        results[prof] = {
            "profile": link.describe(),
            "ok": r["ok"],
            "error": r["error"],
            "generated": r.get("generated"),
            "reference": r["reference"],
            "hop_decode_median_ms": round(hop * 1e3, 3) if hop is not None else None,
            "one_way_delay_ms": link.delay_ms,
            "per_token": pt,
            "predicted_token_ms": round(predicted, 3),
            "error_pct": round((pt["token_ms"] - predicted) / predicted * 100, 1) if pt else None,
            # the same with the run's own compute per token: what the network adds, the machine's drift apart
            "own_compute_predicted_ms": round(pt["compute_ms"] + 2 * link.delay_ms + overhead, 3) if pt else None,
            "own_compute_error_pct": (
                round((pt["token_ms"] / (pt["compute_ms"] + 2 * link.delay_ms + overhead) - 1) * 100, 1) if pt else None
            ),
            "decode_tokens_per_s": r.get("timings", {}).get("decode_tokens_per_s"),
            "wall_s": r["wall_s"],
            "network_stats": r["network_stats"],
        }
        print(f"{prof}: {json.dumps({k: v for k, v in results[prof].items() if k != 'network_stats'})}", flush=True)
    out = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()},
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "overhead_ms_from_fit": overhead,
        "baseline_loopback": {"per_token": base["per_token"], "generated": base.get("generated")},
        "profiles": results,
    }
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()

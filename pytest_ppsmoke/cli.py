"""``pp-smoke-run``: the one command that proves a pipeline-parallel deployment works.

What runs today (``--local``): the cluster layer of the spec's lifecycle on this machine. A seed
node in this process and one member process per stage boot, join over iroh on loopback, converge
under SWIM, resolve ``pp-entry``, ``pp-exit`` and every ``pp-stage-i``, carry an activation-sized
hidden state to each stage and back bit-identical, and are torn down. Each phase prints a line
with its time; ``--report`` writes them as JSON.

Not yet built, and said so in the output and the report: renting through vast.ai (or its
emulator), loading the model, prefill and decode. Those phases come with the stage workers and the
lifecycle issues.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from .cluster import LocalCluster, PhaseError
from .codec import Echo, Hidden, WireDtype

NOT_BUILT = ["rent", "load", "prefill", "decode"]
HIDDEN_DIM = 576  # SmolLM2-135M, the offline model
PROMPT_LEN = 32


def _progress(phase: str, seconds: float, started: float) -> None:
    print(f"[{time.monotonic() - started:7.2f}s] {phase:<9} {seconds:7.3f}s", flush=True)


async def run_local(args: argparse.Namespace, report: dict[str, Any]) -> None:
    started = time.monotonic()
    wire = WireDtype.parse(args.wire_dtype)
    cluster = LocalCluster(num_stages=args.num_stages, on_phase=lambda p, s: _progress(p, s, started))
    try:
        async with cluster:
            assert cluster.seed is not None
            report["instances"] = [
                {"stage": i, "endpoint_id": cluster.keys.ids[1 + i], "pid": m.pid}  # type: ignore[union-attr]
                for i, m in enumerate(cluster.members)
            ]
            rng = np.random.default_rng(0)
            hidden = Hidden.from_array(rng.standard_normal((PROMPT_LEN, HIDDEN_DIM), dtype=np.float32), wire)
            t = time.monotonic()
            hops = []
            for i in range(args.num_stages):
                addr = cluster.names[f"pp-stage-{i}"]
                t_hop = time.perf_counter()
                reply = await cluster.seed.request(addr, Echo(hidden.data), timeout=30)
                elapsed = time.perf_counter() - t_hop
                if not isinstance(reply, Echo) or reply.payload != hidden.data:
                    raise PhaseError("hop", f"the hidden state came back from pp-stage-{i} changed")
                hops.append({"to": f"pp-stage-{i}", "bytes": len(hidden.data), "round_trip_s": round(elapsed, 6)})
            cluster._phase_done("hop", t)
            report["hops"] = {"shape": list(hidden.shape), "wire_dtype": wire.name, "round_trips": hops}
            report["names"] = {n: {"node": a.node, "actor": a.actor} for n, a in cluster.names.items()}
    finally:
        report["timings"] = {**cluster.timings, "total": round(time.monotonic() - started, 4)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pp-smoke-run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--local", action="store_true", help="run on this machine over loopback (the only mode built so far)"
    )
    p.add_argument("--num-stages", type=int, default=2, help="pipeline stages, at least 2 (default 2)")
    p.add_argument(
        "--wire-dtype", default="bf16", choices=[d.name for d in WireDtype], help="hidden-state dtype on the wire"
    )
    p.add_argument("--budget", type=float, default=300.0, help="seconds for the whole run (default 300)")
    p.add_argument("--report", type=Path, help="write the JSON report here")
    p.add_argument("-v", "--verbose", action="store_true", help="log membership events to stderr")
    args = p.parse_args(argv)
    if not args.local:
        p.error("only --local is built so far; renting on vast.ai comes with the lifecycle")
    if args.num_stages < 2:
        p.error(f"--num-stages must be at least 2, got {args.num_stages}")
    if args.budget <= 0:
        p.error(f"--budget must be a positive number of seconds, got {args.budget}")
    return args


async def _main(args: argparse.Namespace, report: dict[str, Any]) -> None:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)  # teardown runs in the finally blocks
    try:
        async with asyncio.timeout(args.budget):
            await run_local(args, report)
    except TimeoutError:
        raise PhaseError("budget", f"the run did not finish within {args.budget:.0f} s") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    report: dict[str, Any] = {
        "ok": False,
        "exit_code": 1,
        "error": None,
        "mode": "local",
        "num_stages": args.num_stages,
        "wire_dtype": args.wire_dtype,
        "not_built": NOT_BUILT,
        "text": None,
    }
    try:
        asyncio.run(_main(args, report))
        report.update(ok=True, exit_code=0)
        print("cluster ok: boot, converge, resolve, hop and teardown passed; not built yet: " + ", ".join(NOT_BUILT))
    except PhaseError as e:
        report["error"] = str(e)
        print(f"pp-smoke-run: failed at {e}", file=sys.stderr)
    except (KeyboardInterrupt, asyncio.CancelledError):
        report["error"] = "interrupted"
        print("pp-smoke-run: interrupted; everything started was stopped", file=sys.stderr)
    if args.report:
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    return int(report["exit_code"])


if __name__ == "__main__":
    sys.exit(main())

"""``pp-smoke-run``: the one command that proves a pipeline-parallel deployment works.

``--local`` runs the spec's lifecycle on this machine: a seed node in this process and one
``pp-gpu-node`` process per stage (each with its tinygrad worker, on the CPU) boot, join over
iroh on loopback, load their layer ranges, converge under SWIM, resolve their names, run "Say
hello" through the chain (prefill, then decode with the token fed back from the last stage), and
are torn down. Each phase prints a line with its time; ``--report`` writes the JSON report.

Not built yet, and said so in the output and the report: renting instances (vast.ai, or its
emulator for ``--local``), which comes with the lifecycle issue. Local nodes are started directly.
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

from .cluster import LocalCluster, PhaseError
from .codec import WireDtype
from .pipeline import run_inference

NOT_BUILT = ["rent"]


def _progress(phase: str, seconds: float, started: float) -> None:
    print(f"[{time.monotonic() - started:7.2f}s] {phase:<9} {seconds:8.3f}s", flush=True)


async def run_local(args: argparse.Namespace, report: dict[str, Any]) -> None:
    started = time.monotonic()
    env = {"MODEL": args.model, "PP_WIRE_DTYPE": args.wire_dtype}
    cluster = LocalCluster(
        num_stages=args.num_stages,
        node_module="pytest_ppsmoke.gpu_node",
        extra_env=env,
        on_phase=lambda p, s: _progress(p, s, started),
    )
    try:
        async with asyncio.timeout(args.budget) as budget:  # teardown runs after, outside the budget
            await _start_and_infer(args, report, cluster, started)
    except TimeoutError:
        if budget.expired():
            raise PhaseError("budget", f"the run did not finish within {args.budget:.0f} s") from None
        raise
    finally:
        await cluster.close()
        timings = report.setdefault("timings", {})
        timings.update(cluster.timings)
        timings["total"] = round(time.monotonic() - started, 4)
        ids = cluster.keys.ids[1:] if cluster.keys else []
        report["instances"] = [
            {
                "stage": i,
                "endpoint_id": ids[i],
                "pid": m.proc.pid if m.proc else None,
                "worker_pid": cluster.ready[i].get("worker_pid") if i < len(cluster.ready) else None,
                "exit_status": m.proc.returncode if m.proc else None,  # None: never started or still running
            }
            for i, m in enumerate(cluster.members)
        ]


async def _start_and_infer(
    args: argparse.Namespace, report: dict[str, Any], cluster: LocalCluster, started: float
) -> None:
    await cluster.start()
    assert cluster.seed is not None
    report["split"] = [{"stage": r["stage"], "blocks": r["range"]} for r in cluster.ready]
    result = await run_inference(cluster.seed, args.num_stages, args.prompt, args.max_tokens, args.budget)
    for phase in ("prefill", "decode"):
        _progress(phase, result.timings[phase], started)
    report.update(
        text=result.text,
        prompt_token_ids=result.prompt_token_ids,
        token_ids=result.token_ids,
        hops=result.hops,
        kv=[{"stage": k.stage, "blocks_cached": [k.first_block, k.end_block], "filled": k.filled} for k in result.kv],
    )
    report["timings"] = dict(result.timings)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pp-smoke-run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--local", action="store_true", help="run on this machine over loopback (the only mode built so far)"
    )
    p.add_argument("--model", default="smollm2:135m", help="a model name or a GGUF path (default smollm2:135m)")
    p.add_argument("--prompt", default="Say hello")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-stages", type=int, default=2, help="pipeline stages, at least 2 (default 2)")
    p.add_argument(
        "--wire-dtype", default="bf16", choices=[d.name for d in WireDtype], help="hidden states on the wire"
    )
    p.add_argument("--budget", type=float, default=300.0, help="seconds for the whole run (default 300)")
    p.add_argument("--report", type=Path, help="write the JSON report here")
    p.add_argument("-v", "--verbose", action="store_true", help="log membership and stage events to stderr")
    args = p.parse_args(argv)
    if not args.local:
        p.error("only --local is built so far; renting on vast.ai comes with the lifecycle")
    if args.num_stages < 2:
        p.error(f"--num-stages must be at least 2, got {args.num_stages}")
    if args.max_tokens < 1:
        p.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.budget <= 0:
        p.error(f"--budget must be a positive number of seconds, got {args.budget}")
    from .stages import ModelError, resolve_model  # imports tinygrad: only once arguments are fine

    try:
        resolve_model(args.model)
    except ModelError as e:
        p.error(str(e))
    return args


async def _main(args: argparse.Namespace, report: dict[str, Any]) -> None:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()

    def stop(sig: signal.Signals) -> None:
        print(f"pp-smoke-run: {sig.name}: stopping everything that was started", file=sys.stderr, flush=True)
        report["error"] = f"interrupted by {sig.name}"
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # repeats must not cut the teardown
            loop.add_signal_handler(s, lambda: None)
        task.cancel()  # the teardown runs in run_local's finally

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop, sig)
    await run_local(args, report)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    report: dict[str, Any] = {
        "ok": False,
        "exit_code": 1,
        "error": None,
        "mode": "local",
        "model": args.model,
        "prompt": args.prompt,
        "max_tokens": args.max_tokens,
        "num_stages": args.num_stages,
        "wire_dtype": args.wire_dtype,
        "text": None,
        "prompt_token_ids": [],
        "token_ids": [],
        "cost_usd": 0.0,  # nothing rented in local mode
        "not_built": NOT_BUILT,
    }
    try:
        asyncio.run(_main(args, report))
        report.update(ok=True, exit_code=0)
        print(report["text"])
    except PhaseError as e:
        report["error"] = str(e)
        print(f"pp-smoke-run: failed at {e}", file=sys.stderr)
    except (KeyboardInterrupt, asyncio.CancelledError):
        report["error"] = report["error"] or "interrupted"
        print("pp-smoke-run: interrupted; everything started was stopped", file=sys.stderr)
    except Exception as e:  # a bug or an unexpected failure: still a clear line and a report
        report["error"] = f"{type(e).__name__}: {e}"
        print(f"pp-smoke-run: failed: {report['error']}", file=sys.stderr)
    if args.report:
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    return int(report["exit_code"])


if __name__ == "__main__":
    sys.exit(main())

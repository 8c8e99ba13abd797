"""``pp-smoke-run``: the one command that proves a pipeline-parallel deployment works.

    pp-smoke-run --vastai                 # rent on vast.ai (key from VAST_API_KEY or --api-key)
    pp-smoke-run --local --report r.json  # the same lifecycle against the vast.ai emulator, on loopback
    pp-smoke-run --reap                   # destroy every instance this tool labelled

The lifecycle: rent one instance per stage (cheapest matching offers), boot (each instance
running), converge (1 + N members under SWIM), load (every worker ready), resolve the stage
names, prefill and decode "Say hello" through the chain, teardown (destroy everything rented).
A line per phase with its time; the text on stdout; ``--report`` writes the JSON report.

Exit status: 0 when the response is non-empty and every instance was destroyed; 1 when a phase
failed (the message names it), when a destroy failed, or on SIGINT/SIGTERM/SIGHUP (everything
rented is destroyed first); 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ..cloud.fake_vast import FakeVast
from ..cloud.lifecycle import DEFAULT_IMAGE, Deployment, RunConfig, reap
from ..cloud.vast import DEFAULT_URL, OfferQuery, VastClient, VastError
from ..protocol import PhaseError
from ..runtime.codec import WireDtype
from .pipeline import run_inference

log = logging.getLogger(__name__)


class Run:
    """One invocation: its report, and whether teardown has begun (a signal then waits for it)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        self.tearing_down = False
        self.deployment: Deployment | None = None
        self.report: dict[str, Any] = {
            "ok": False,
            "exit_code": 1,
            "error": None,
            "failed_phase": None,
            "mode": "local" if args.local else "vastai",
            "vast_url": None,
            "run_id": None,
            "model": args.model,
            "prompt": args.prompt,
            "max_tokens": args.max_tokens,
            "num_stages": args.num_stages,
            "wire_dtype": args.wire_dtype,
            "text": None,
            "prompt_token_ids": [],
            "token_ids": [],
            "split": [],
            "timings": {},
            "hops": {},
            "kv": [],
            "instances": [],
            "cost_usd": 0.0,
        }

    def progress(self, phase: str, seconds: float, detail: str = "") -> None:
        line = f"[{time.monotonic() - self.started:7.2f}s] {phase:<9} {seconds:8.3f}s"
        print(f"{line}  {detail}" if detail else line, flush=True)

    def fail(self, phase: str | None, message: str) -> None:
        if self.report["error"] is None:  # the first failure is the cause; later ones are consequences
            self.report["error"] = message
            self.report["failed_phase"] = phase


async def execute(run: Run) -> None:
    args = run.args
    fake: FakeVast | None = None
    if args.local and not args.vast_url:
        fake = FakeVast(gpus=[g for g in args.gpus.split(",") if g] or None)
        await fake.start()
    url = fake.url if fake else (args.vast_url or DEFAULT_URL)
    key = fake.api_key if fake else args.api_key
    run.report["vast_url"] = url
    try:
        async with VastClient(key, url) as vast:
            dep = Deployment(vast, run_config(args), on_phase=run.progress)
            run.report["run_id"] = dep.run_id
            run.deployment = dep
            try:
                async with asyncio.timeout(args.budget) as budget:
                    await _start_and_infer(run, dep)
            except PhaseError as e:
                run.fail(e.phase, str(e))
            except TimeoutError:
                if not budget.expired():
                    raise
                run.fail(dep.phase, f"{dep.phase}: the run did not finish within its budget of {args.budget:.0f} s")
            finally:
                run.tearing_down = True
                try:
                    await dep.close()
                except PhaseError as e:
                    run.fail(e.phase, str(e))
                    print(f"pp-smoke-run: WARNING: {e}", file=sys.stderr, flush=True)
                finally:
                    run.report["timings"].update(dep.timings)
                    run.report["instances"] = [i.summary() for i in dep.instances]
                    run.report["cost_usd"] = round(dep.cost_usd(), 6)
    finally:
        if fake is not None:
            run.report["emulator"] = {
                "live_instances": [i.id for i in fake.live()],
                "destroyed_instances": [i.id for i in fake.destroyed],
            }
            await fake.close()
        run.report["timings"]["total"] = round(time.monotonic() - run.started, 4)


async def _start_and_infer(run: Run, dep: Deployment) -> None:
    args = run.args
    await dep.start()
    assert dep.seed is not None
    run.report["split"] = [{"stage": i, "instance": inst.id} for i, inst in enumerate(dep.instances)]
    remaining = args.budget - (time.monotonic() - run.started)

    def prefilled(seconds: float) -> None:
        dep.phase = "decode"
        run.progress("prefill", seconds, "first token sampled")

    result = await run_inference(
        dep.seed, args.num_stages, args.prompt, args.max_tokens, max(1.0, remaining), prefilled
    )
    run.progress("decode", result.timings["decode"], f"{result.timings['decode_tokens_per_s']} tokens/s")
    kv = {k.stage: k for k in result.kv}
    run.report["split"] = [
        {"stage": i, "blocks": [kv[i].first_block, kv[i].end_block] if i in kv else None, "instance": inst.id}
        for i, inst in enumerate(dep.instances)
    ]
    run.report.update(
        text=result.text,
        prompt_token_ids=result.prompt_token_ids,
        token_ids=result.token_ids,
        hops=result.hops,
        kv=result.kv_summary(),
    )
    run.report["timings"].update(result.timings)


def run_config(args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        num_stages=args.num_stages,
        model=args.model,
        wire_dtype=args.wire_dtype,
        image=args.image,
        disk_gb=args.disk,
        query=OfferQuery(
            gpu_ram_gb=args.gpu_ram,
            max_dph=args.max_price,
            min_reliability=args.min_reliability,
            min_cuda=args.min_cuda,
            disk_gb=args.disk,
        ),
        network="local" if args.local else "wan",
        polls=args.polls,
        poll_interval=args.poll_interval,
        converge_timeout=args.converge_timeout,
        load_timeout=args.load_timeout,
        resolve_timeout=args.resolve_timeout,
        node_ttl=args.node_ttl,
        orphan_grace=args.orphan_grace,
    )


async def do_reap(args: argparse.Namespace) -> int:
    async with VastClient(args.api_key, args.vast_url or DEFAULT_URL) as vast:
        try:
            swept = await reap(vast, args.run_id)
        except VastError as e:
            print(f"pp-smoke-run: reap failed: {e}", file=sys.stderr)
            return 1
    for entry in swept:
        if entry["destroyed"]:
            print(f"destroyed instance {entry['id']} ({entry['label']}, was {entry['status']})")
        else:
            print(f"could NOT destroy instance {entry['id']} ({entry['label']}): {entry['error']}", file=sys.stderr)
    print(f"reaped {sum(e['destroyed'] for e in swept)} of {len(swept)} labelled instance(s)")
    return 0 if all(e["destroyed"] for e in swept) else 1


def _positive(kind: type[float] | type[int]) -> Any:
    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pp-smoke-run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--vastai", action="store_true", help="rent real GPUs on vast.ai")
    mode.add_argument(
        "--local", action="store_true", help="this machine: the vast.ai emulator, nodes on loopback, CPU tinygrad"
    )
    mode.add_argument("--reap", action="store_true", help="destroy every instance labelled by pp-smoke-run")
    p.add_argument(
        "--api-key",
        default=os.environ.get("VAST_API_KEY", ""),
        help="vast.ai API key (default: $VAST_API_KEY; prefer the variable: arguments show in ps)",
    )
    p.add_argument("--vast-url", help=f"the REST base URL (default {DEFAULT_URL}; --local: an embedded emulator)")
    p.add_argument("--run-id", help="--reap: only this run's instances")
    p.add_argument("--gpus", default="", help="--local: this machine's GPUs (e.g. 0,1), one per instance in turn")
    p.add_argument("--report", type=Path, help="write the JSON report here")
    p.add_argument("--model", help="a model name or a GGUF path (default smollm2:135m local, llama3.2:1b on vast.ai)")
    p.add_argument("--prompt", default="Say hello")
    p.add_argument("--max-tokens", type=_positive(int), default=64)
    p.add_argument("--num-stages", type=int, default=2, help="pipeline stages, at least 2 (default 2)")
    p.add_argument(
        "--wire-dtype", default="bf16", choices=[d.name for d in WireDtype], help="hidden states on the wire"
    )
    p.add_argument("--budget", type=_positive(float), default=300.0, help="seconds for the whole run (default 300)")
    g = p.add_argument_group("instances")
    g.add_argument("--image", default=DEFAULT_IMAGE, help=f"the node image (default {DEFAULT_IMAGE})")
    g.add_argument("--disk", type=_positive(float), default=20.0, help="disk per instance, GB (default 20)")
    g.add_argument("--gpu-ram", type=_positive(float), default=8.0, help="least GPU RAM per instance, GB (default 8)")
    g.add_argument("--max-price", type=_positive(float), default=2.0, help="most $/hour per instance (default 2.0)")
    g.add_argument("--min-reliability", type=float, default=0.95, help="least host reliability, 0..1 (default 0.95)")
    g.add_argument("--min-cuda", type=float, default=12.0, help="least CUDA version the host supports (default 12.0)")
    d = p.add_argument_group("deadlines (the spec's by default)")
    d.add_argument("--polls", type=_positive(int), default=60, help="status polls until running (default 60)")
    d.add_argument("--poll-interval", type=_positive(float), help="seconds between polls (default 3; --local 0.25)")
    d.add_argument("--converge-timeout", type=_positive(float), default=120.0, help="SWIM convergence (default 120)")
    d.add_argument("--load-timeout", type=_positive(float), default=240.0, help="workers ready (default 240)")
    d.add_argument("--resolve-timeout", type=_positive(float), default=60.0, help="stage names (default 60)")
    d.add_argument("--node-ttl", type=_positive(float), default=900.0, help="a node's own time-to-live (default 900)")
    d.add_argument(
        "--orphan-grace",
        type=_positive(float),
        default=60.0,
        help="how long a node outlives a lost orchestrator (default 60)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log membership, stage and API events to stderr")
    args = p.parse_args(argv)
    if args.poll_interval is None:
        args.poll_interval = 0.25 if args.local else 3.0
    if args.model is None:
        args.model = "smollm2:135m" if args.local else "llama3.2:1b"
    if args.num_stages < 2:
        p.error(f"--num-stages must be at least 2, got {args.num_stages}")
    if not 0 <= args.min_reliability <= 1:
        p.error(f"--min-reliability must be between 0 and 1, got {args.min_reliability}")
    if (args.vastai or args.reap or args.vast_url) and not args.api_key:
        p.error("a vast.ai API key is needed: set VAST_API_KEY or pass --api-key")
    if not args.reap:
        from ..stage.model import (  # imports tinygrad: only once arguments are fine
            ModelError,
            model_names,
            resolve_model,
        )

        if args.vastai and args.model not in model_names():
            names = ", ".join(model_names())
            p.error(f"--vastai needs a model name the instances can fetch ({names}), got {args.model!r}")
        try:
            if args.local:
                resolve_model(args.model)
        except ModelError as e:
            p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    if args.reap:
        return asyncio.run(do_reap(args))
    run = Run(args)
    try:
        asyncio.run(_main(run))
    except (KeyboardInterrupt, asyncio.CancelledError):
        run.fail(None, "interrupted")
    except Exception as e:  # a bug or an unexpected failure: still a clear line and a report
        run.fail(None, f"{type(e).__name__}: {e}")
    r = run.report
    if r["text"]:
        print(r["text"])  # the answer, even when something failed afterwards (a destroy)
    if r["error"] is None and r["text"]:
        r.update(ok=True, exit_code=0)
    else:
        print(f"pp-smoke-run: failed at {r['error']}", file=sys.stderr)
    gone = [i for i in r["instances"] if i["final_state"] in ("destroyed", "destroying")]
    print(
        f"pp-smoke-run: {len(gone)} of {len(r['instances'])} instance(s) destroyed; cost ${r['cost_usd']:.4f}",
        file=sys.stderr,
    )
    if args.report:
        args.report.write_text(json.dumps(r, indent=2) + "\n")
    return int(r["exit_code"])


async def _main(run: Run) -> None:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()

    def stop(sig: signal.Signals) -> None:
        phase = run.deployment.phase if run.deployment else "start"
        run.fail(phase, f"{phase}: interrupted by {sig.name}")
        if run.tearing_down:  # let the teardown finish: cutting it short would leak instances
            print(f"pp-smoke-run: {sig.name}: already tearing down", file=sys.stderr, flush=True)
            return
        print(f"pp-smoke-run: {sig.name}: destroying everything that was rented", file=sys.stderr, flush=True)
        task.cancel()  # the teardown runs in execute's finally

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop, sig)
    with contextlib.suppress(asyncio.CancelledError):
        await execute(run)
    if run.report["error"] is None and not run.report["text"]:
        run.fail(None, "no text")


if __name__ == "__main__":
    sys.exit(main())

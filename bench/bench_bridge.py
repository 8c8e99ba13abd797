"""The bridge's own cost per call, in each framing: two workers (stage 0 and stage 1 of a 2-stage
split) driven through ``WorkerBridge`` from one event loop, no network.

    python bench/bench_bridge.py [--model smollm2:135m | PATH.gguf] [--steps 48] [--out FILE]

A prefill, then ``steps`` decode steps. Each step is computed twice in each stage, once in each
framing (JSON with base64, and the payload framing), in alternating order: a decode step at the
same position with the same input writes the same KV rows, so the two calls do the same work, and
paired per step they see the same load on the machine. For each call, the time the node sees
(``call``) and the time inside the worker's handler (``worker_s``, which in JSON includes the
worker's base64); ``bridge`` is their difference: the request's encoding and write, the worker's
read and parse, the reply's write, read and parse, and the event loop's hand-offs.
``saved_per_call``: the median over steps of the JSON call's time less the payload call's, all
of it included. Medians over the steps after the first three, in ms. The two framings must give
the same hidden states, digests and tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, TypeVar

from benchio import emit  # bench/ is this script's directory: first on sys.path

from pytest_ppsmoke.stage.bridge import WorkerBridge
from pytest_ppsmoke.stage.pipe import DecodeStep, EmbedAndForward, ForwardAndSample, Framing, Request, Tokenize

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "worker" / "pp_tinygrad_worker.py"
SKIP = 3
FRAMINGS = tuple(Framing)
R = TypeVar("R")


async def timed(bridge: WorkerBridge, framing: Framing, request: Request[R]) -> tuple[R, float, float]:
    """One call in ``framing``: the reply, the call's time as the node sees it, and in the worker."""
    bridge.framing = framing  # the worker answers each request in that request's framing
    started = time.perf_counter()
    reply, worker_s = await bridge.timed_call(request, 60)
    assert worker_s is not None, "the worker did not say its seconds"
    return reply, time.perf_counter() - started, worker_s


async def run(model: str, steps: int) -> dict[str, Any]:
    env = {**os.environ, "MODEL": model, "NUM_STAGES": "2", "PP_WIRE_DTYPE": "bf16", "PP_MAX_CONTEXT": "256"}
    bridges = [WorkerBridge([sys.executable, str(WORKER)], {**env, "STAGE": str(i)}, f"s{i}") for i in (0, 1)]
    times: dict[tuple[str, Framing], list[tuple[float, float]]] = defaultdict(list)  # (op, framing): [(call, worker)]
    try:
        await asyncio.gather(*(b.start(600) for b in bridges))
        assert all(b.framing is Framing.payload for b in bridges), "the worker does not offer the payload framing"
        s0, s1 = bridges
        ids = (await s0.call(Tokenize("Say hello"), 30)).token_ids
        h = await s0.call(EmbedAndForward(ids, 0, prefill=True), 300)
        token = (await s1.call(ForwardAndSample(h.hidden, 0, len(ids), prefill=True), 300)).token_id
        for i in range(steps):
            position = len(ids) + i
            order = FRAMINGS if i % 2 == 0 else FRAMINGS[::-1]
            hidden = {}
            for framing in order:
                reply, call, worker = await timed(s0, framing, DecodeStep(token, position))
                hidden[framing] = reply
                times["decode_step", framing].append((call, worker))
            a, other = (hidden[f] for f in FRAMINGS)
            assert (a.hidden, a.hidden_digest) == (other.hidden, other.hidden_digest), f"step {i}: stage 0"
            tokens = {}
            for framing in order:
                sampled, call, worker = await timed(s1, framing, ForwardAndSample(a.hidden, position, 1))
                tokens[framing] = (sampled.token_id, sampled.received_digest)
                times["forward_and_sample", framing].append((call, worker))
            json_, payload = tokens[Framing.json], tokens[Framing.payload]
            assert json_ == payload and json_[1] == a.hidden_digest, f"step {i}: stage 1"
            token = json_[0]
    finally:
        for b in bridges:
            await b.close()
    med = statistics.median
    out: dict[str, Any] = {}
    for op in ("decode_step", "forward_and_sample"):
        row: dict[str, Any] = {}
        for framing in FRAMINGS:
            t = times[op, framing][SKIP:]
            row[framing.value] = {
                "call": round(med(c for c, _ in t) * 1e3, 3),
                "in_worker": round(med(w for _, w in t) * 1e3, 3),
                "bridge": round(med(c - w for c, w in t) * 1e3, 3),
            }
        pairs = zip(times[op, Framing.json][SKIP:], times[op, Framing.payload][SKIP:], strict=True)
        row["saved_per_call"] = round(med(j[0] - p[0] for j, p in pairs) * 1e3, 3)
        out[op] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2:135m")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    before = os.getloadavg()
    per_call = asyncio.run(run(a.model, a.steps))
    report = {
        "bench": "bridge",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": a.model,
        "steps": a.steps,
        "load_average": {"before": before, "after": os.getloadavg()},
        "per_call_ms": per_call,
    }
    emit(report, a.out)


if __name__ == "__main__":
    main()

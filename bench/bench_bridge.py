"""The bridge's own cost per call: two workers (stage 0 and stage 1 of a 2-stage split) driven
through ``WorkerBridge`` from one event loop, in each framing, in one run.

    python bench/bench_bridge.py [--model smollm2:135m | PATH.gguf] [--steps 64] [--out FILE]

Per framing: a prefill, then ``steps`` decode steps (``decode_step`` on stage 0, its hidden state
to stage 1's ``forward_and_sample``, the token back), no network. For each call, the time the
node sees (``call``) and the time inside the worker's ``handle`` (``worker_s``); their difference
is the bridge: the request's encoding and write, the worker's read and parse, the reply's write,
read and parse, and the event loop's hand-offs. Medians over the decode steps after the first
three, in ms. The tokens of the two framings must agree (same model, same steps).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pytest_ppsmoke.stage.bridge import WorkerBridge

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "worker" / "pp_tinygrad_worker.py"
SKIP = 3


async def run(model: str, steps: int, framing: str) -> dict[str, Any]:
    env = {**os.environ, "MODEL": model, "NUM_STAGES": "2", "PP_WIRE_DTYPE": "bf16", "PP_MAX_CONTEXT": "256"}
    bridges = [WorkerBridge([sys.executable, str(WORKER)], {**env, "STAGE": str(i)}, f"s{i}", framing) for i in (0, 1)]
    try:
        await asyncio.gather(*(b.start(600) for b in bridges))
        s0, s1 = bridges
        ids = (await s0.call("tokenize", 30, prompt="Say hello"))["token_ids"]
        h = await s0.call("embed_and_forward", 300, tokens=ids, position=0, prefill=True)
        fields = {"seq_len": len(ids), "position": 0, "prefill": True}
        tokens = [(await s1.call("forward_and_sample", 300, hidden=h["hidden"], **fields))["token_id"]]
        rows: list[tuple[float, float, float, float]] = []
        for i in range(steps):
            position = len(ids) + i
            t0 = time.perf_counter()
            h = await s0.call("decode_step", 60, token_id=tokens[-1], position=position)
            t1 = time.perf_counter()
            r = await s1.call("forward_and_sample", 60, hidden=h["hidden"], seq_len=1, position=position)
            t2 = time.perf_counter()
            tokens.append(r["token_id"])
            rows.append((t1 - t0, h["worker_s"], t2 - t1, r["worker_s"]))
    finally:
        for b in bridges:
            await b.close()
    med = [statistics.median(col) * 1e3 for col in zip(*rows[SKIP:], strict=True)]
    return {
        "framing": framing,
        "stage0_call": round(med[0], 3),
        "stage0_in_worker": round(med[1], 3),
        "stage0_bridge": round(med[0] - med[1], 3),
        "stage1_call": round(med[2], 3),
        "stage1_in_worker": round(med[3], 3),
        "stage1_bridge": round(med[2] - med[3], 3),
        "tokens": tokens,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2:135m")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    results = [asyncio.run(run(a.model, a.steps, f)) for f in ("json", "payload")]
    if results[0]["tokens"] != results[1]["tokens"]:
        sys.exit(f"the framings gave different tokens: {results[0]['tokens']} against {results[1]['tokens']}")
    for r in results:
        r.pop("tokens")
    report = {
        "bench": "bridge",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": a.model,
        "steps": a.steps,
        "load_average": os.getloadavg(),
        "per_call_ms": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

"""Eight stages: a pipeline of 8 ``pp-gpu-node`` processes on a synthetic model of 8 blocks,
rented from the emulator (its catalogue widened to the stage count, ``catalogue.widened``: the
default query takes 4 of its offers), on loopback or an emulated network, checked token for token
against the reference on stage 0's node, with the per-hop figures.

    pp-synth-gguf /tmp/synth8.gguf --blocks 8 --dim 64 --heads 4 --kv-heads 2 --ffn 128 --vocab 512 --context 1024
    python bench/bench_stages8.py --model /tmp/synth8.gguf [--stages 2,4,8] [--network wan] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchio import emit  # bench/ is this script's directory: first on sys.path

PROMPT = "Say hello"


async def run(model: str, stages: int, network: str, max_tokens: int) -> dict[str, Any]:
    from pytest_ppsmoke.cloud.emulator.catalogue import widened
    from pytest_ppsmoke.cloud.emulator.server import FakeVast
    from pytest_ppsmoke.cloud.vast import VastClient
    from pytest_ppsmoke.harness.deployment import Deployment, RunConfig
    from pytest_ppsmoke.harness.pipeline import request_reference, run_inference
    from pytest_ppsmoke.harness.setup import rtt_of

    config = RunConfig(model=model, num_stages=stages, poll_interval=0.25)
    async with (
        FakeVast(catalogue=widened(stages, config.query.body()), network=network) as fake,
        VastClient(fake.api_key, fake.url) as vast,
    ):
        if fake.network is not None:
            config.bind, config.rtt = f"{fake.network.host_addr}:0", rtt_of(fake.network.spec)
        started = time.monotonic()
        async with Deployment(vast, config) as dep:
            assert dep.seed is not None
            up = time.monotonic() - started
            r = await run_inference(dep.seed, stages, PROMPT, max_tokens, timeout=240)
            ref = await request_reference(dep.seed, PROMPT, max_tokens, timeout=240)
            timings = dict(dep.timings)
    decode = [h["decode"]["median_s"] for h in r.hops.values()]
    return {
        "stages": stages,
        "network": network,
        "match": r.token_ids == list(ref.token_ids),
        "tokens": len(r.token_ids),
        "reference_method": ref.method,
        "lifecycle_s": timings,
        "up_s": round(up, 3),
        "timings": r.timings,
        "hops": len(r.hops),
        "decode_hop_median_s": decode,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--stages", default="2,4,8")
    ap.add_argument("--network", default="loopback")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rows = []
    for n in (int(s) for s in a.stages.split(",")):
        row = asyncio.run(run(a.model, n, a.network, a.max_tokens))
        print(row, flush=True)
        rows.append(row)
    emit(
        {
            "bench": "stages8",
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "model": a.model,
            "network": a.network,
            "rows": rows,
        },
        a.out,
    )


if __name__ == "__main__":
    main()

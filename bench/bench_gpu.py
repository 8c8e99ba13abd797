"""GPU benchmark: 2 stages on 2 GPUs against the unsplit model on one GPU, in one run.

    CUDA=1 python bench/bench_gpu.py --model /tmp/llama-1b.gguf --gpus 0,1 [--max-tokens 64] [--out FILE]

The two stages run through the same local lifecycle as ``pp-smoke-run --local``: the vast.ai
emulator rents two instances, each a ``pp-gpu-node`` process that gets one GPU
(``CUDA_VISIBLE_DEVICES``), iroh on loopback. One warm-up request compiles and captures the
JIT; the measured request follows. The baseline is tinygrad's unsplit ``generate`` on the first
GPU, in its own process, also after a warm-up (``bench_pipeline.baseline``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import PROMPT, figures
from benchio import emit  # bench/ is this script's directory: first on sys.path


async def pipeline(model: str, max_tokens: int, gpus: list[str], wire: str) -> dict[str, Any]:
    from pytest_ppsmoke.cloud.emulator.server import FakeVast
    from pytest_ppsmoke.cloud.vast import VastClient
    from pytest_ppsmoke.harness.deployment import Deployment, RunConfig
    from pytest_ppsmoke.harness.pipeline import run_inference

    async with FakeVast(gpus=gpus) as fake, VastClient(fake.api_key, fake.url) as vast:
        config = RunConfig(model=model, wire_dtype=wire, poll_interval=0.25, load_timeout=900)
        async with Deployment(vast, config) as dep:
            assert dep.seed is not None
            started = time.monotonic()
            await run_inference(dep.seed, 2, PROMPT, max_tokens, timeout=900)  # compiles, captures the JIT
            warmup_s = time.monotonic() - started
            r = await run_inference(dep.seed, 2, PROMPT, max_tokens, timeout=900)
            timings = dict(dep.timings)
            gpus_seen = [i.proc.env.get("CUDA_VISIBLE_DEVICES") for i in fake.live() if i.proc]
    return {
        "lifecycle_s": timings,
        "gpus": gpus_seen,
        "warmup_request_s": round(warmup_s, 3),
        **figures(r),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model name or GGUF path (pp-synth-gguf makes one)")
    p.add_argument("--gpus", default="0,1")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--wire-dtype", default="bf16")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    gpus = a.gpus.split(",")
    here = Path(__file__).resolve().parent
    argv = [sys.executable, str(here / "bench_pipeline.py"), "--baseline-only", "--model", a.model]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus[0]}
    out = subprocess.run([*argv, "--max-tokens", str(a.max_tokens)], capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"baseline failed:\n{out.stderr[-4000:]}")
    base = json.loads(out.stdout.strip().splitlines()[-1])
    print("baseline", {k: v for k, v in base.items() if k != "token_ids"}, flush=True)
    pipe = asyncio.run(pipeline(a.model, a.max_tokens, gpus, a.wire_dtype))
    report = {
        "bench": "gpu",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "gpus": gpus},
        "model": a.model,
        "wire_dtype": a.wire_dtype,
        "baseline_unsplit_generate_1_gpu": base,
        "pipeline_2_stages_2_gpus": pipe,
        "ratios": {
            "decode_vs_unsplit": round(pipe["steady_tokens_per_s"] / base["steady_tokens_per_s"], 3),
            "decode_vs_unsplit_all_tokens": round(pipe["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3),
        },
        "goal": {"decode_vs_unsplit_at_least": 0.9, "stretch": 0.95},
    }
    emit(report, a.out)


if __name__ == "__main__":
    main()

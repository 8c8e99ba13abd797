"""Pipeline benchmark: 2-stage decode against the unsplit model, on this machine, in one run.

    python bench/bench_pipeline.py [--model smollm2:135m] [--max-tokens 64] [--out FILE]

1. baseline: tinygrad's unsplit ``Transformer.generate`` (compiled decode) in its own process;
2. the 2-stage pipeline, compiled: seed + two pp-gpu-node processes (each with its worker), iroh
   on loopback, the default bf16 wire; one warm-up request, then the measured one;
3. the same pipeline with the spec's uncompiled forward (``PP_JIT=0``), fewer tokens.

Decode rate is (generated - 1) / (time from the first token to the last), so prefill is apart.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchio import emit  # bench/ is this script's directory: first on sys.path

PROMPT = "Say hello"
SKIP = 3


def baseline(model_name: str, max_tokens: int) -> dict[str, Any]:
    from pytest_ppsmoke.stage.model import Tokenizer, load_model, unsplit_generate

    model, kv = load_model(model_name, 1024)
    tok = Tokenizer(kv)
    ids = tok.chat(PROMPT)
    unsplit_generate(model, ids, max_tokens, tok.end_ids)  # warm-up: compile and capture the JIT
    started = time.perf_counter()
    stamps, out = [], []
    for t in model.generate(list(ids)):
        stamps.append(time.perf_counter())
        out.append(t)
        if t in tok.end_ids or len(out) >= max_tokens:
            break
    decode_s = stamps[-1] - stamps[0]
    return {
        "prefill_s": round(stamps[0] - started, 4),
        "generated": len(out),
        "decode_s": round(decode_s, 4),
        "decode_tokens_per_s": round((len(out) - 1) / decode_s, 3),
        "steady_tokens_per_s": steady_rate(stamps),
        "per_token_ms": round(statistics.median(b - a for a, b in itertools.pairwise(stamps[SKIP:])) * 1e3, 2),
        "token_ids": out,
    }


def steady_rate(stamps: list[float], skip: int = SKIP) -> float:
    """Tokens per second after the first ``skip`` decode tokens. ``generate`` resets its JIT on
    every call, so its first decode steps run uncompiled while the JIT captures; a warm pipeline
    has captured already. Skipping them on both sides compares compiled against compiled."""
    s = stamps[skip:]
    return round((len(s) - 1) / (s[-1] - s[0]), 3)


async def pipeline(model_name: str, max_tokens: int, jit: bool, warm: bool) -> dict[str, Any]:
    from pytest_ppsmoke.harness.pipeline import run_inference
    from pytest_ppsmoke.runtime.cluster import LocalCluster

    env = {"MODEL": model_name, "PP_WIRE_DTYPE": "bf16", "PP_JIT": "1" if jit else "0"}
    async with LocalCluster(num_stages=2, node_module="pytest_ppsmoke.stage.gpu_node", extra_env=env) as cluster:
        assert cluster.seed is not None
        if warm:
            await run_inference(cluster.seed, 2, PROMPT, max_tokens, timeout=900)
        r = await run_inference(cluster.seed, 2, PROMPT, max_tokens, timeout=900)
        load = cluster.timings.get("load")
    return {**figures(r), "load_s": load}


def figures(r: Any) -> dict[str, Any]:
    """A measured request's figures (``r``: a pipeline.InferenceResult)."""
    return {
        "prefill_s": r.timings["prefill"],
        "generated": len(r.token_ids),
        "decode_s": r.timings["decode"],
        "decode_tokens_per_s": r.timings["decode_tokens_per_s"],
        "steady_tokens_per_s": steady_rate([c.at + c.s for c in r.stages[-1].compute if c.op == "forward_and_sample"]),
        "hops": r.hops,
        "per_token_ms": breakdown(r.stages),
        "token_ids": r.token_ids,
    }


def breakdown(stages: list[Any]) -> dict[str, float]:
    """Medians over decode steps (after the first SKIP) of where one token's time goes (2 stages).
    ``stageN_bridge``: a call's time as the node sees it less the time inside the worker's
    handler (the request's and reply's encoding, the pipe both ways, the parsing, the hand-offs);
    ``outside_workers``: the period less both workers' handlers (bridges, hops, the nodes)."""
    med = statistics.median

    def calls(stage: Any, op: str) -> list[Any]:
        """``stage``: a messages.StageStats; its compute records of ``op`` in decode."""
        return [c for c in stage.compute if c.op == op and (c.position or 0) > 0][SKIP:]

    s0, s1 = calls(stages[0], "decode_step"), calls(stages[-1], "forward_and_sample")
    ends = [c.at + c.s for c in s1]
    received = {a.position: a.at for a in stages[-1].activations_in}
    hops = [received[h.position] - h.at for h in stages[0].hops_out[1 + SKIP :] if h.position in received]
    out = {
        "period": med(b - a for a, b in itertools.pairwise(ends)),
        "stage0_call": med(c.s for c in s0),
        "stage0_in_worker": med(c.worker_s or 0.0 for c in s0),
        "stage1_call": med(c.s for c in s1),
        "stage1_in_worker": med(c.worker_s or 0.0 for c in s1),
        "stage0_bridge": med(c.s - (c.worker_s or 0.0) for c in s0),
        "stage1_bridge": med(c.s - (c.worker_s or 0.0) for c in s1),
        "activation_hop": med(hops),
    }
    out["rest"] = out["period"] - out["stage0_call"] - out["stage1_call"] - out["activation_hop"]
    out["outside_workers"] = out["period"] - out["stage0_in_worker"] - out["stage1_in_worker"]
    return {k: round(v * 1e3, 2) for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2:135m")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--uncompiled-tokens", type=int, default=12, help="0: skip the uncompiled run")
    p.add_argument("--out", type=Path)
    p.add_argument("--baseline-only", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.baseline_only:
        print(json.dumps(baseline(a.model, a.max_tokens)))
        return
    argv = [sys.executable, __file__, "--baseline-only", "--model", a.model, "--max-tokens", str(a.max_tokens)]
    base = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    compiled = asyncio.run(pipeline(a.model, a.max_tokens, jit=True, warm=True))
    uncompiled = (
        asyncio.run(pipeline(a.model, a.uncompiled_tokens, jit=False, warm=False)) if a.uncompiled_tokens else None
    )
    report = {
        "bench": "pipeline",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "device": "CPU (clang)"},
        "load_average": os.getloadavg(),  # at the end: other work on the machine shifts every figure
        "model": a.model,
        "prompt": PROMPT,
        "baseline_unsplit_generate": base,
        "pipeline_2_stages_compiled": compiled,
        "pipeline_2_stages_uncompiled": uncompiled,
        "ratios": {
            "compiled_decode_vs_unsplit": round(compiled["steady_tokens_per_s"] / base["steady_tokens_per_s"], 3),
            "compiled_decode_vs_unsplit_all_tokens": round(
                compiled["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3
            ),
            "uncompiled_decode_vs_unsplit": uncompiled
            and round(uncompiled["steady_tokens_per_s"] / base["steady_tokens_per_s"], 3),
        },
        "goal": {"compiled_decode_vs_unsplit_at_least": 0.95},
    }
    emit(report, a.out)


if __name__ == "__main__":
    main()

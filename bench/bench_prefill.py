"""Prefill: eager (what a stage does) against a compiled graph of the exact length and of a
padded length bucket, in one process, on one stage.

    python bench/bench_prefill.py [--model smollm2:135m] [--bucket 64] [--repeats 3] [--out FILE]

A stage runs its prefill eagerly: each call builds the graph in Python, schedules it and runs
it. ``TinyJit`` replays a captured graph instead, but it captures on its second call and replays
from its third, for one input shape; a prompt of another length needs a graph of its own, hence
length buckets: pad the prompt to the bucket, run the bucket's graph, keep the first rows. This
measures what each costs per call (medians after the warm-up), and whether the bucket's hidden
state is the exact-length one bit for bit: padding changes the shapes the kernels see, and so
possibly their reduction order, and the pipeline is checked token for token against the
unsplit model.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
from benchio import emit  # bench/ is this script's directory: first on sys.path
from tinygrad import Tensor, TinyJit

from pytest_ppsmoke.stage.cache import WeightCache, install_program_cache
from pytest_ppsmoke.stage.model import StageModel, Tokenizer, realized_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2:135m")
    p.add_argument("--bucket", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    install_program_cache()
    model, kv, _ = realized_model(a.model, 1024, 0, 2, WeightCache.from_setting(""))
    stage = StageModel(model, kv, 0, 2)
    ids = Tokenizer(kv).chat("Say hello")
    n = len(ids)

    def timed(fn: object, calls: int) -> tuple[list[float], np.ndarray]:
        times, out = [], np.empty(0)
        for _ in range(calls):
            stage._begin_sequence()
            t = time.perf_counter()
            out = fn()  # type: ignore[operator]
            times.append(time.perf_counter() - t)
        return times, out

    eager_t, eager = timed(lambda: stage.embed_and_forward(ids, 0, prefill=True), a.repeats + 1)
    exact_jit = TinyJit(stage._embed_blocks)
    x = Tensor(np.array([ids], dtype=np.int32)).realize()
    exact_t, exact = timed(lambda: exact_jit(x, 0).numpy()[0], a.repeats + 2)
    bucket_jit = TinyJit(stage._embed_blocks)
    padded = Tensor(np.array([ids + [ids[-1]] * (a.bucket - n)], dtype=np.int32)).realize()
    bucket_t, bucket = timed(lambda: bucket_jit(padded, 0).numpy()[0][:n], a.repeats + 2)
    med = statistics.median
    report = {
        "bench": "prefill",
        "model": a.model,
        "stage": "0 of 2",
        "prompt_tokens": n,
        "bucket": a.bucket,
        "eager_s": {"first": round(eager_t[0], 3), "median_after": round(med(eager_t[1:]), 3)},
        "jit_exact_s": {
            "capture_calls": [round(t, 3) for t in exact_t[:2]],
            "replay_median": round(med(exact_t[2:]), 3),
        },
        "jit_bucket_s": {
            "capture_calls": [round(t, 3) for t in bucket_t[:2]],
            "replay_median": round(med(bucket_t[2:]), 3),
        },
        "exact_equals_eager": bool(np.array_equal(exact, eager)),
        "bucket_equals_eager": bool(np.array_equal(bucket, eager)),
        "bucket_max_abs_diff": float(np.abs(bucket - eager).max()),
    }
    emit(report, a.out)


if __name__ == "__main__":
    main()

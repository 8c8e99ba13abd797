"""Where a decode token's time goes inside the stages, in one process on one device.

    CUDA=1 python bench/profile_stages.py --model /tmp/llama-1b.gguf [--steps 40]

For each decode step of a 2-stage split: stage 0's input (the token into its kept device buffer),
its JIT call (launch only), its output to the host (the sync), then stage 1's input (the hidden
state), JIT call and sampled id (the sync); and, for comparison, what a fresh input tensor costs
(what each step did before ``StageModel._decode_input``). Against the unsplit model's own step (its JIT call
and ``.item()``), measured in the same process. Medians in milliseconds, after a warm-up.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import numpy as np
from tinygrad import Tensor

from pytest_ppsmoke.messages import WireDtype, round_to_wire
from pytest_ppsmoke.stage.model import StageModel, Tokenizer, load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args()
    model, kv = load_model(a.model, 1024)
    tok = Tokenizer(kv)
    ids = tok.chat("Say hello")
    s0 = StageModel(load_model(a.model, 1024)[0], kv, 0, 2)
    s1 = StageModel(load_model(a.model, 1024)[0], kv, 1, 2)

    rows: list[dict[str, float]] = []
    h = s0.embed_and_forward(ids, 0)
    token = s1.forward_and_sample(round_to_wire(h, WireDtype.bf16), 0)
    for step in range(a.steps):
        pos = len(ids) + step
        f0 = time.perf_counter()
        Tensor([[token]], dtype="int32").realize()  # what each step used to do: a fresh tensor
        fresh = time.perf_counter() - f0
        t0 = time.perf_counter()
        x0 = s0._decode_input(np.array([[token]], dtype=np.int32))  # what it does now
        t1 = time.perf_counter()
        out0 = s0._jit_embed(x0, s0._start_pos.bind(pos))
        t2 = time.perf_counter()
        h = np.asarray(out0.float().numpy()[0])
        t3 = time.perf_counter()
        hw = round_to_wire(h, WireDtype.bf16)
        x1 = s1._decode_input(np.ascontiguousarray(hw, dtype=np.float32)[None])
        t4 = time.perf_counter()
        out1 = s1._jit_sample(x1, s1._start_pos.bind(pos))
        t5 = time.perf_counter()
        token = int(out1.item())
        t6 = time.perf_counter()
        rows.append(
            {
                "s0_input": t1 - t0,
                "s0_jit_launch": t2 - t1,
                "s0_output_sync": t3 - t2,
                "s1_input": t4 - t3,
                "s1_jit_launch": t5 - t4,
                "s1_sample_sync": t6 - t5,
                "total": t6 - t0,
                "fresh_tensor_input_instead": fresh,
            }
        )
    # the unsplit model's own decode step, as generate does it
    gen = model.generate(list(ids))
    stamps = []
    for _ in range(a.steps + 4):
        next(gen)
        stamps.append(time.perf_counter())
    unsplit = statistics.median(b - q for q, b in itertools.pairwise(stamps[4:]))
    warm = rows[5:]
    med = {k: round(statistics.median(r[k] for r in warm) * 1e3, 3) for k in warm[0]}
    print(json.dumps({"split_step_ms": med, "unsplit_step_ms": round(unsplit * 1e3, 3)}, indent=2))


if __name__ == "__main__":
    main()

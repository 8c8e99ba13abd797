"""Stage count 1 of a grid: the model in one piece, tinygrad's own ``generate``, in this process.

    python -m pytest_ppsmoke.layout.unsplit --model smollm2:135m --target 128 --max-tokens 12 --repeats 2

Prints one JSON line: the prompt's tokens, each repeat's time to first token and time per output
token (the median gap after the first two, as the grid times the pipeline's: ``generate`` runs
its first decode steps uncompiled on every call), and the calls as ``StageSample``s (the whole
model: every block, the embedding and the head). One warm-up call first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from .grid import _tpot, prompt_text
from .points import StageSample


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2:135m")
    p.add_argument("--target", type=int, required=True, help="prompt tokens, chat template included")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args(argv)
    from ..messages import to_json
    from ..stage.cache import WeightCache, install_program_cache
    from ..stage.model import Tokenizer, realized_model

    install_program_cache()
    model, kv, load = realized_model(a.model, 1024, 0, 1, WeightCache.from_setting(""))
    tok = Tokenizer(kv)
    word = max(1, len(tok.chat("hello hello")) - len(tok.chat("hello")))
    ids = tok.chat(prompt_text(a.target, len(tok.chat("hello")) - word, word))
    dim, blocks = int(model.token_embd.weight.shape[1]), len(model.blk)

    def run(n: int) -> list[float]:
        stamps = [time.perf_counter()]
        for i, _ in enumerate(model.generate(list(ids))):
            stamps.append(time.perf_counter())
            if i + 1 >= n:
                break
        return stamps

    run(4)  # warm-up: the programs, the weights in memory
    out: dict[str, list[Any]] = {"ttft_s": [], "tpot_s": [], "compute": []}
    for _ in range(a.repeats):
        stamps = run(a.max_tokens)
        out["ttft_s"].append(stamps[1] - stamps[0])
        out["tpot_s"].append(_tpot(stamps[1:]))
        out["compute"].append(
            dataclasses.asdict(StageSample(0, blocks, True, True, "prefill", len(ids), stamps[1] - stamps[0]))
        )
        decode = StageSample(0, blocks, True, True, "decode", 1, out["tpot_s"][-1], context=len(ids))
        out["compute"].append(dataclasses.asdict(decode))
    weights = to_json(load)  # the record; the grid reads its fields (messages.from_json)
    print(json.dumps({"prompt_tokens": len(ids), "dim": dim, "num_blocks": blocks, "weights": weights, **out}))


if __name__ == "__main__":
    main()

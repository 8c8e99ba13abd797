"""What a worker process costs, from its start to its reference, on empty caches and on warm ones,
with the program and schedule caches on and, as the baseline in the same run, off.

    python bench/bench_worker_start.py [--model smollm2:135m | PATH.gguf] [--repeats 2] [--out FILE]

Each case starts stage 0 of a 2-stage split (``worker/pp_tinygrad_worker.py``), sends a prefill of
the chat prompt, three decode steps and a reference of 8 tokens, and shuts it down:

- ``cold``: a fresh weight cache and a fresh tinygrad database (a new host);
- ``warm``: the same directories again, after ``cold`` (the caches hold what it made);
- ``warm_no_schedules``: as ``warm``, on a copy of the database without its schedules (the
  programs cached, each graph scheduled anew: the program cache alone);
- ``warm_no_program_cache``: the same weight cache, ``PP_PROGRAM_CACHE=0`` (no program and no
  schedule from the database: tinygrad's own behaviour in a new process).

For each: the process's CPU seconds (user + system, from ``wait4``), its wall time, and what its
ready line and shutdown reply say (load, warm-up, weights' source, programs and schedules read and
made). Every case's tokens and digests must be equal. ``repeats`` runs the warm cases that many
times, alternating, and reports each one's median.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TypeVar

from benchio import emit  # bench/ is this script's directory: first on sys.path

from pytest_ppsmoke.stage.pipe import (
    DecodeStep,
    EmbedAndForward,
    ErrorReply,
    Framing,
    Request,
    RunReference,
    Shutdown,
    Tokenize,
    decode_reply,
    encode_request,
    read_ready,
)

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "worker" / "pp_tinygrad_worker.py"
R = TypeVar("R")


def one(env: dict[str, str]) -> dict[str, Any]:
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(WORKER)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    ready = read_ready(proc.stdout.readline)
    rid = itertools.count(1)

    def ask(request: Request[R]) -> R:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(encode_request(next(rid), request, Framing.json))
        proc.stdin.flush()
        reply = decode_reply(request.reply, json.loads(proc.stdout.readline()))
        assert not isinstance(reply, ErrorReply), reply
        return reply

    ids = ask(Tokenize("Say hello")).token_ids
    answers: list[Any] = [ask(EmbedAndForward(ids, 0, prefill=True)).hidden_digest.hex()]
    answers += [ask(DecodeStep(42 + i, len(ids) + i)).hidden_digest.hex() for i in range(3)]
    ref = ask(RunReference("Say hello", 8))
    answers.append(list(ref.token_ids))
    bye = ask(Shutdown())
    _, status, usage = os.wait4(proc.pid, 0)
    assert status == 0, status
    return {
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "wall_s": round(time.perf_counter() - started, 2),
        "load_s": ready.load_s,
        "warm_up_s": ready.warm_up_s,
        "weights": ready.weights.source if ready.weights else None,
        "programs": dataclasses.asdict(bye.programs) if bye.programs else None,
        "schedules": dataclasses.asdict(bye.schedules) if bye.schedules else None,
        "reference_s": round(ref.load_s + ref.generate_s, 2),
        "answers": answers,
    }


def without_schedules(db: str) -> str:
    """A copy of tinygrad's database ``db`` without the schedules the workers kept in it."""
    copy = db + ".no-schedules"
    with contextlib.suppress(FileNotFoundError):
        os.remove(copy)
    with sqlite3.connect(db) as src, sqlite3.connect(copy) as conn:
        src.backup(conn)  # with what its write-ahead log holds
        for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE name LIKE 'ppsmoke_schedule%'").fetchall():
            conn.execute(f"DROP TABLE '{table}'")
    return copy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "CPU": "1",
            "HALF": os.environ.get("HALF", "0"),
            "MODEL": args.model,
            "STAGE": "0",
            "NUM_STAGES": "2",
            "PP_WEIGHT_CACHE": str(Path(tmp) / "weights"),
            "CACHEDB": str(Path(tmp) / "tinygrad.db"),
        }
        cases: dict[str, list[dict[str, Any]]] = {
            "cold": [one(env)], "warm": [], "warm_no_schedules": [], "warm_no_program_cache": []
        }  # fmt: skip
        for _ in range(args.repeats):
            cases["warm"].append(one(env))
            cases["warm_no_schedules"].append(one({**env, "CACHEDB": without_schedules(env["CACHEDB"])}))
            cases["warm_no_program_cache"].append(one({**env, "PP_PROGRAM_CACHE": "0"}))
    answers = {json.dumps(run.pop("answers")) for runs in cases.values() for run in runs}
    assert len(answers) == 1, "the cases' tokens or digests differ"
    report: dict[str, Any] = {"model": args.model, "half": env["HALF"], "repeats": args.repeats, "cases": {}}
    for name, runs in cases.items():
        report["cases"][name] = {
            **runs[0],
            "cpu_s": statistics.median(r["cpu_s"] for r in runs),
            "wall_s": statistics.median(r["wall_s"] for r in runs),
            "cpu_s_each": [r["cpu_s"] for r in runs],
        }
    warm = report["cases"]["warm"]["cpu_s"]
    report["warm_over_no_schedules"] = round(warm / report["cases"]["warm_no_schedules"]["cpu_s"], 3)
    report["warm_over_no_program_cache"] = round(warm / report["cases"]["warm_no_program_cache"]["cpu_s"], 3)
    emit(report, args.out)


if __name__ == "__main__":
    main()

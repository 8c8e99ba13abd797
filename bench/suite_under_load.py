"""The whole suite, several times in a row, each in its own random order, with busy loops beside
it: a test that depends on the machine's speed or load, or on the order of the tests, fails in
one of the runs. Each run is the README's test command under pytest-randomly with its own seed
(``python -m pytest -m local -p randomly --randomly-seed=S``) while ``--busy`` processes spin
on the cores; they are killed at the end, whatever happens.

    python bench/suite_under_load.py --runs 5 --busy 2 --out bench/results/suite_under_load.json
    python bench/suite_under_load.py --runs 2 --busy 2 -- tests/test_swim.py -n 0   # a subset

Arguments after ``--`` go to pytest. The JSON (stdout, and ``--out``): each run's seed, exit
code, passed/failed/skipped/error counts, the ids of the tests that failed, its wall time. A
failed run's whole output is kept in the temporary directory (``suite_under_load-seedS.log``). It
stops at the first run that fails (``--keep-going`` runs them all); the exit code is 1 if any
failed. Run on a machine with the node image built (``.ci/run`` builds it first), else its tests
skip.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchio import emit  # bench/ is this script's directory: first on sys.path

ROOT = Path(__file__).resolve().parents[1]
COUNTS = ("passed", "failed", "skipped", "error", "xfailed", "xpassed")
SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)\b")
FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)
BUSY = "while True:\n    pass\n"


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def not_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number of 0 or more, got {text!r}")
    return value


def command(seed: int, extra: list[str]) -> list[str]:
    """The README's test command, in pytest-randomly's order for ``seed``; ``-rfE`` lists each
    failed test's id in the summary, where :func:`outcome` reads it."""
    return [sys.executable, "-m", "pytest", "-m", "local", "-p", "randomly", f"--randomly-seed={seed}", "-rfE", *extra]


def outcome(output: str) -> dict[str, Any]:
    """The counts of pytest's last summary line and the failed tests' ids."""
    lines = [line for line in output.splitlines() if SUMMARY.search(line)]
    counts = dict.fromkeys(COUNTS, 0)
    for n, word in SUMMARY.findall(lines[-1] if lines else ""):
        counts["error" if word.startswith("error") else word] = int(n)
    return {**counts, "failed_ids": sorted(set(FAILED.findall(output)))}


def start_busy(k: int) -> list[subprocess.Popen[bytes]]:
    """``k`` processes that each keep a core busy, in their own sessions (so that pytest's
    process checks and a Ctrl-C at the terminal leave them to :func:`stop_busy`)."""
    return [subprocess.Popen([sys.executable, "-c", BUSY], start_new_session=True) for _ in range(k)]


def stop_busy(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(timeout=30)


def run_once(seed: int, extra: list[str], limit_s: float) -> dict[str, Any]:
    """One run of the suite; past ``limit_s`` its process group is killed and the run counts as
    failed (exit code None, ``timed_out``)."""
    started = time.monotonic()
    proc = subprocess.Popen(
        command(seed, extra),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # interrupted: the suite's process group goes with us
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    code = None if timed_out else proc.returncode
    if code != 0:  # the whole output of a failed run, for its tracebacks (the JSON keeps a tail)
        kept = Path(tempfile.gettempdir()) / f"suite_under_load-seed{seed}.log"
        kept.write_text(output)
        print(f"run with seed {seed} failed: its output is in {kept}", file=sys.stderr)
    return {
        "seed": seed,
        "exit_code": code,
        "timed_out": timed_out,
        **outcome(output),
        "wall_s": round(time.monotonic() - started, 1),
        "tail": output.splitlines()[-15:] if code != 0 else [],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=positive, default=5, help="runs in a row (default 5)")
    ap.add_argument("--busy", type=not_negative, default=2, help="busy loops beside the suite (default 2)")
    ap.add_argument("--seed", type=not_negative, default=None, help="the first run's seed; the next ones count up")
    ap.add_argument("--keep-going", action="store_true", help="run every run, past a failed one")
    ap.add_argument("--run-limit", type=positive, default=3600, help="seconds a run may take (default 3600)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("pytest_args", nargs="*", help="after --: more arguments for pytest (a test path, -n 0, ...)")
    args = ap.parse_args(argv)
    first = random.SystemRandom().randrange(2**31) if args.seed is None else args.seed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally below still kills the loops
    busy = start_busy(args.busy)
    runs: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        for i in range(args.runs):
            run = run_once(first + i, args.pytest_args, args.run_limit)
            runs.append(run)
            print(
                f"run {i + 1}/{args.runs}: seed {run['seed']}, exit {run['exit_code']}, "
                f"{run['passed']} passed, {run['failed']} failed, {run['wall_s']} s",
                *[f"\n  failed: {t}" for t in run["failed_ids"]],
                *[f"\n  | {line}" for line in run["tail"]],
                file=sys.stderr,
                sep="",
            )
            if run["exit_code"] != 0 and not args.keep_going:
                break
    finally:
        stop_busy(busy)
    ok = len(runs) == args.runs and all(r["exit_code"] == 0 for r in runs)
    emit(
        {
            "command": command(first, args.pytest_args)[1:],
            "busy_loops": args.busy,
            "cpus": os.cpu_count(),
            "runs_asked": args.runs,
            "all_passed": ok,
            "wall_s": round(time.monotonic() - started, 1),
            "runs": runs,
        },
        args.out,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

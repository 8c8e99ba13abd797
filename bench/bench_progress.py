"""How long a person at a terminal waits without the live line's count of work moving.

Runs ``pp-smoke-run --local`` on a pty (as a person's terminal is), once with cold caches (a fresh
weight cache and tinygrad cache: every node on vast.ai starts so) and once warm, stamps every
drawing of the live line as it arrives, and reports, per phase and for the whole run, the longest
stretch in which neither the phase nor the drawing's count of work (the sum of its "n of m" and
"n programs") moved. The baseline, from the same drawings: the load counted as it was before its
workers said their steps (only "n of m workers ready"), so that the two figures are of one run.

    python bench/bench_progress.py --out bench/results/progress.json
"""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path
from typing import Any

from benchio import emit  # bench/ is this script's directory: first on sys.path

from pytest_ppsmoke.harness.progress import CLEAR
from pytest_ppsmoke.protocol import Phase

DRAWING = re.compile(rf"({'|'.join(p.value for p in Phase)}) \d+\.\d s(?:: (?P<count>[^;]*))?")
COUNT = re.compile(r"(\d+) (?:of \d+|programs)")
READY = re.compile(r"(\d+) of \d+ workers ready")


def stamped_run(argv: list[str], env: dict[str, str], timeout: float) -> tuple[list[tuple[float, str]], float, int]:
    """The command on a pty of 200 columns: each chunk it wrote with its seconds since the start,
    the seconds to its exit, and its exit status."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    chunks: list[tuple[float, str]] = []
    started = time.monotonic()

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            chunks.append((time.monotonic() - started, data.decode(errors="replace")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave, env=env)
    os.close(slave)
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ended = time.monotonic() - started
    reader.join(10)
    os.close(master)
    return chunks, ended, rc


def drawings(chunks: list[tuple[float, str]]) -> list[tuple[float, str, str]]:
    """Each drawing of the live line: (seconds, phase, its count's text)."""
    out = []
    for at, text in chunks:
        for segment in text.split(CLEAR)[1:]:
            m = DRAWING.match(re.split(r"[\r\n]", segment, maxsplit=1)[0])
            if m:
                out.append((at, m.group(1), m.group("count") or ""))
    return out


def still(drawn: list[tuple[float, str, str]], ended: float, counted: Any) -> dict[str, Any]:
    """The longest stretch with neither the phase nor ``counted(phase, count)`` moving: the whole
    run's (from the start to the exit) and each phase's, with where it began."""
    longest: dict[str, float] = {}
    last_at, last = 0.0, ("", -1)
    worst = {"seconds": 0.0, "phase": "", "from": 0.0}
    for at, phase, count in [*drawn, (ended, "exit", "")]:
        now = (phase, counted(phase, count) if phase != "exit" else -1)
        if now != last:
            gap = at - last_at
            longest[last[0] or "start"] = max(longest.get(last[0] or "start", 0.0), gap)
            if gap > worst["seconds"]:
                worst = {"seconds": round(gap, 2), "phase": last[0] or "start", "from": round(last_at, 2)}
            last_at, last = at, now
    return {"longest": worst, "by_phase": {p: round(s, 2) for p, s in longest.items()}}


def every_count(phase: str, count: str) -> int:
    return sum(int(n) for n in COUNT.findall(count))


def before(phase: str, count: str) -> int:
    """The count as the load line had it before the workers said their load: workers ready only."""
    if phase == "load":
        return sum(int(n) for n in READY.findall(count))
    return every_count(phase, count)


def one(label: str, cold: bool, args: list[str], timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="ppsmoke-progress-") as tmp:
        argv = [sys.executable, "-m", "pytest_ppsmoke.harness.cli", "--local", *args]
        if cold:
            env["XDG_CACHE_HOME"] = tmp
            env["CACHEDB"] = str(Path(tmp) / "tinygrad.db")
            argv += ["--weight-cache", str(Path(tmp) / "weights")]
        chunks, ended, rc = stamped_run(argv, env, timeout)
    drawn = drawings(chunks)
    return {
        "run": label,
        "exit": rc,
        "seconds": round(ended, 2),
        "drawings": len(drawn),
        "with_load_counts": still(drawn, ended, every_count),
        "baseline_workers_ready_only": still(drawn, ended, before),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("args", nargs="*", help="more pp-smoke-run arguments (after --)")
    a = ap.parse_args()
    runs = [one("cold", True, a.args, a.timeout), one("warm", False, a.args, a.timeout)]
    emit({"bench": "progress", "machine": f"{os.cpu_count()} cores", "runs": runs}, a.out)


if __name__ == "__main__":
    main()

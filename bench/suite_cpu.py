"""Where a command's CPU goes, process by process: every process on the machine is sampled from
``/proc`` while the command runs, and its CPU seconds (user + system) are kept under its kind
(a worker, a node, ``pp-smoke-run``, an inner pytest session, clang, ...) and under the test that
started it (``PYTEST_CURRENT_TEST`` in its environment, which the processes a test starts
inherit).

    python bench/suite_cpu.py --out cpu.json -- .ci/run --durations=30
    python bench/suite_cpu.py --show cpu.json

The suite is CPU-bound on 2 cores, so its time follows its CPU: this is how to find what to cut.
A process that lives under one sampling interval (0.25 s) is missed; xdist's own workers (the
tests that run in-process) show as ``xdist`` with no test. The machine's other processes are
sampled too: run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
KINDS = (
    ("pp_tinygrad_worker", "worker"),
    ("gpu_node", "node"),
    ("pp-gpu-node", "node"),
    ("harness.cli", "pp-smoke-run"),
    ("pp-smoke-run", "pp-smoke-run"),
    ("pp-fake-vast", "emulator"),
    ("execnet", "xdist"),
    ("python -u -c", "xdist"),
    ("pytest", "pytest"),
    ("clang", "clang"),
    ("buildah", "buildah"),
)


def kind(cmdline: str) -> str:
    for needle, name in KINDS:
        if needle in cmdline:
            return name
    words = cmdline.split()
    return (" ".join(words[:2]) if words else "?")[:60]


def sample(seen: dict[tuple[int, str], list]) -> None:
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            fields = stat[stat.rfind(")") + 2 :].split()
            cpu, started = int(fields[11]) + int(fields[12]), fields[19]
            key = (int(d), started)
            if key in seen:
                seen[key][0] = cpu
                continue
            cmdline = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = Path(f"/proc/{d}/environ").read_bytes().split(b"\0")
            test = next(
                (e.split(b"=", 1)[1].decode(errors="replace") for e in env if e.startswith(b"PYTEST_CURRENT_TEST=")), ""
            )
            seen[key] = [cpu, kind(cmdline), test.split(" ")[0]]
        except (OSError, IndexError, ValueError):
            pass  # gone between the listing and the read


def show(rows: list[list], top: int) -> None:
    total = sum(r[0] for r in rows)
    by_kind, count = collections.Counter(), collections.Counter()
    by_file = collections.Counter()
    for cpu, k, test in rows:
        by_kind[k] += cpu
        count[k] += 1
        if test:
            by_file[test.split("::")[0]] += cpu
    print(f"{total:8.1f} s of CPU in {len(rows)} processes")
    for k, v in by_kind.most_common(top):
        print(f"{v:8.1f} s  {count[k]:5d}  {k}")
    print("by the test file that started them:")
    for f, v in by_file.most_common(top):
        print(f"{v:8.1f} s  {f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="the processes as JSON: [cpu_s, kind, test] each")
    ap.add_argument("--show", type=Path, help="summarise a JSON written before, and run nothing")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("command", nargs="*")
    args = ap.parse_args()
    if args.show:
        show(json.loads(args.show.read_text()), args.top)
        return
    if not args.command:
        ap.error("a command to run (after --), or --show FILE")
    seen: dict[tuple[int, str], list] = {}
    proc = subprocess.Popen(args.command)
    while proc.poll() is None:
        sample(seen)
        time.sleep(0.25)
    rows = [[cpu / TICK, k, test] for cpu, k, test in seen.values()]
    if args.out:
        args.out.write_text(json.dumps(rows))
    show(rows, args.top)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()

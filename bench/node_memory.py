"""What one local node costs this machine: a ``pp-smoke-run --local`` run, its process tree
sampled from /proc while it runs, and the peak resident memory (RSS) and CPU time of each kind of
process in it (the orchestrator, a stage's node, a node's worker, the reference's worker beside
stage 0's), per stage.

    python bench/node_memory.py [--out FILE] -- --num-stages 2 [pp-smoke-run's other flags]

The per-node figures that ``harness/check.py``'s capacity check uses are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")


def children() -> dict[int, list[int]]:
    """Each process's children, from /proc."""
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def tree(root: int) -> list[int]:
    kids, todo, seen = children(), [root], []
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo += kids.get(pid, [])
    return seen


def sample(pid: int) -> tuple[str, int, float] | None:
    """A process's command line, resident bytes and CPU seconds (user + system)."""
    try:
        cmd = (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")).strip()
        rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return cmd, rss, (int(fields[11]) + int(fields[12])) / TICK


def kind(cmd: str) -> str:
    if "pp-smoke-run" in cmd or "harness.cli" in cmd:
        return "orchestrator (pp-smoke-run, the emulator in it)"
    if "worker" in cmd:
        return "worker"
    if "gpu_node" in cmd or "pp-gpu-node" in cmd:
        return "node"
    return cmd[:60]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("args", nargs="*", help="pp-smoke-run's flags after --local (put them after --)")
    a = p.parse_args()
    run = subprocess.Popen(["pp-smoke-run", "--local", *a.args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak: dict[int, tuple[str, int, float]] = {}
    started = time.monotonic()
    while run.poll() is None:
        for pid in tree(run.pid):
            if (got := sample(pid)) is not None:
                cmd, rss, cpu = got
                old = peak.get(pid)
                if old is not None:
                    cmd, rss, cpu = old[0] or cmd, max(rss, old[1]), max(cpu, old[2])
                peak[pid] = (cmd, rss, cpu)
        time.sleep(a.interval)
    _, err = run.communicate()
    kinds: dict[str, list[dict[str, Any]]] = {}
    for pid, (cmd, rss, cpu) in peak.items():
        kinds.setdefault(kind(cmd), []).append({"pid": pid, "cmd": cmd, "peak_rss_mib": rss / 2**20, "cpu_s": cpu})
    result = {
        "argv": ["pp-smoke-run", "--local", *a.args],
        "exit": run.returncode,
        "wall_s": time.monotonic() - started,
        "kinds": kinds,
        "stderr_tail": err.decode(errors="replace")[-1500:],
    }
    for name, procs in sorted(kinds.items()):
        rss = [x["peak_rss_mib"] for x in procs]
        cpu = [x["cpu_s"] for x in procs]
        print(f"{name}: {len(procs)} process(es), peak RSS {min(rss):.0f}-{max(rss):.0f} MiB, CPU {sum(cpu):.1f} s")
    print(f"exit {run.returncode}, {result['wall_s']:.1f} s")
    if a.out:
        a.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

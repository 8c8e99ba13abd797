"""False failures on a loaded machine: the spec suite (``pytest --pyargs pytest_ppsmoke.spec -m
local``) and ``pp-smoke-run --local`` run many times under each load, every failure counted and
classified by its cause; and, under each load, a run with a stage SIGKILLed mid-decode, whose
detection by SWIM is timed against SWIM's bound.

    python bench/false_failures.py --runs 50 --loads busy,disk,memory,none --kinds spec,cli,detect --out part1.json
    python bench/false_failures.py merge part1.json part2.json ... --out merged.json [--allow-commits]
    python bench/false_failures.py show merged.json          # the Markdown table for docs/benchmarks.md

The loads, each a child process group of its own, started before a load's runs and killed after
them (also on Ctrl-C, SIGTERM or an error):

- ``busy``: one busy loop per core (``os.cpu_count()`` processes);
- ``disk``: a writer that writes a file of ``--disk-gb`` (1.5 GB) in 8 MB chunks, fsyncs it and
  removes it, in a loop, in the runs' own temporary directory (the same disk);
- ``memory``: a process that allocates ``--memory-gb`` (6 GB) and writes one byte in every page
  of it, pass after pass;
- ``none``: nothing (the baseline, measured in the same part).

The kinds of run, each with a deadline of its own (its process group killed when it passes; a
timeout is a cause like any other):

- ``spec``: the spec suite, classified from its JUnit XML (each failing test and its message);
- ``cli``: ``pp-smoke-run --local --report FILE``, classified from the report (its failed phase
  and the error's first line);
- ``detect``: ``pp-smoke-run --local`` with stage 1's instance SIGKILLed once 3 tokens were
  sampled (``vast.kill_stage=1;vast.kill_after_tokens=3``) and vast.ai's record of it lagging by
  60 s (``vast.status_lag=60``: the host watch would otherwise be first to know, and SWIM's delay
  would go unmeasured). It must fail in the decode phase naming pp-stage-1, and the orchestrator's
  SWIM must declare pp-stage-1 dead within SWIM's detection bound for a lone accuser
  (``SwimConfig.detection_bound``) from the kill (``emulator.host_losses``): the orchestrator's
  declaration (``swim.deaths``), or, where stage 0's SWIM ended the run first, the failure's time
  (``failed_at``: stage 0's declaration and one message to the orchestrator, an upper bound).

A failure is false unless the run was meant to fail (a ``detect`` run that fails as it should is
no failure; one that does anything else is a false failure). Causes are normalised (numbers,
instance labels, endpoint ids and paths replaced) so that one cause from many runs is one key.
The JSON is written after every run, so that an interrupted part keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchio

ROOT = Path(__file__).resolve().parent.parent
LOADS = ("busy", "disk", "memory", "none")
KINDS = ("spec", "cli", "detect")
DEADLINES = {"spec": 1200.0, "cli": 300.0, "detect": 300.0}
KILLED_STAGE = 1
DETECT_FAULTS = f"vast.kill_stage={KILLED_STAGE};vast.kill_after_tokens=3;vast.status_lag=60"
DETECT_TOKENS = 512  # still decoding when SWIM declares the stage dead
CHUNK_MB = 8
PAGE = 4096

# --- the loads --------------------------------------------------------------------------------

BUSY = "while True: pass"
DISK = """
import os, sys
path, size, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
block = os.urandom(chunk)
while True:
    with open(path, "wb") as f:
        for _ in range(max(1, size // chunk)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    os.unlink(path)
"""
MEMORY = """
import sys
size, page = int(sys.argv[1]), int(sys.argv[2])
mem = bytearray(size)
n = len(range(0, size, page))
for i in range(1 << 62):
    mem[::page] = bytes([i & 255]) * n
"""


def load_commands(name: str, workdir: Path, disk_gb: float, memory_gb: float) -> tuple[list[list[str]], dict[str, Any]]:
    """The processes of load ``name`` and its description for the JSON (what, how many, sizes)."""
    py = sys.executable
    if name == "busy":
        n = os.cpu_count() or 1
        return [[py, "-c", BUSY]] * n, {"what": "a busy loop per core", "processes": n}
    if name == "disk":
        size = int(disk_gb * 1e9)
        chunk = CHUNK_MB * 1_000_000
        path = workdir / "disk-load.bin"
        what = f"a writer that writes a {disk_gb:g} GB file in {CHUNK_MB} MB chunks, fsyncs and removes it, in a loop"
        return [[py, "-c", DISK, str(path), str(size), str(chunk)]], {
            "what": what,
            "processes": 1,
            "file_gb": disk_gb,
            "chunk_mb": CHUNK_MB,
            "dir": str(workdir),
        }
    if name == "memory":
        size = int(memory_gb * 2**30)
        what = f"a process that allocates {memory_gb:g} GiB and writes a byte in every {PAGE} B page, in a loop"
        return [[py, "-c", MEMORY, str(size), str(PAGE)]], {"what": what, "processes": 1, "memory_gib": memory_gb}
    if name == "none":
        return [], {"what": "nothing (the baseline)", "processes": 0}
    raise ValueError(f"unknown load {name!r}; expected one of {', '.join(LOADS)}")


class Load:
    """A load's processes, each in a process group of its own; :meth:`stop` kills every group."""

    def __init__(self, commands: list[list[str]]) -> None:
        self.commands = commands
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Load:
        try:
            for cmd in self.commands:
                self.procs.append(subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL))
        except BaseException:  # the ones already started are not left spinning
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for proc in self.procs:
            kill_group(proc)
        self.procs.clear()

    def died(self) -> list[int]:
        """The exit codes of load processes that ended by themselves (a load that is not there)."""
        return [rc for proc in self.procs if (rc := proc.poll()) is not None]


def kill_group(proc: subprocess.Popen[Any]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


# --- classification ---------------------------------------------------------------------------


def normalize(text: str) -> str:
    """One cause's key, whatever run it came from: its first line, with instance labels, endpoint
    ids, paths and numbers replaced (stage names kept)."""
    line = (text.strip().splitlines() or [""])[0]
    line = re.sub(r"ppsmoke-\d{8}T\d{6}-[0-9a-f]+-stage\d+", "<label>", line)
    line = re.sub(r"\b[0-9a-f]{10,}\b", "<id>", line)
    line = re.sub(r"(?<![\w.])/[\w./+-]+", "<path>", line)
    parts = re.split(r"(\bpp-stage-\d+)", line)  # the stage names, at the odd places, kept
    return "".join(x if i % 2 else re.sub(r"\d+(?:\.\d+)?", "N", x) for i, x in enumerate(parts))[:240]


def cli_cause(report: dict[str, Any] | None, rc: int, tail: str) -> str | None:
    """Why a ``pp-smoke-run`` failed (None: it did not): the report's error (it starts with the
    failed phase), or without a report the exit code and the output's last line."""
    if report is not None:
        if report.get("ok") and rc == 0:
            return None
        error = report.get("error") or f"exit {rc} with no error in the report"
        phase = report.get("failed_phase")
        return normalize(error if not phase or error.startswith(f"{phase}:") else f"{phase}: {error}")
    return normalize(f"exit {rc}, no report: {last_line(tail)}") if rc else None


def junit_causes(xml: str) -> list[str]:
    """Each failing or erroring test of a JUnit XML, as ``test: message``."""
    causes = []
    for case in ET.fromstring(xml).iter("testcase"):
        for bad in (*case.findall("failure"), *case.findall("error")):
            message = bad.get("message") or (bad.text or "").strip() or bad.tag
            causes.append(normalize(f"{case.get('name', '?')}: {message}"))
    return causes


def spec_cause(xml: str | None, rc: int, tail: str) -> tuple[str | None, list[str]]:
    """Why the spec suite failed (None: it passed): its first failing test, and all of them."""
    causes = junit_causes(xml) if xml else []
    if rc == 0 and not causes:
        return None, []
    if causes:
        return causes[0], causes
    return normalize(f"exit {rc}, no failing test in the JUnit XML: {last_line(tail)}"), []


def last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1] if lines else "no output"


# --- detection against SWIM's bound -----------------------------------------------------------


def swim_bound(swim: dict[str, Any], members: int) -> dict[str, float]:
    """SWIM's detection bounds for the timing a run used (the report's ``swim``): a suspicion
    confirmed by another member, and a lone accuser's (the longest), for a healthy prober."""
    sys.path.insert(0, str(ROOT))
    from pytest_ppsmoke.runtime.swimconfig import SwimConfig

    cfg = SwimConfig(
        protocol_period=swim["protocol_period"],
        ping_timeout=swim["ping_timeout"],
        suspicion_timeout=swim["suspicion_timeout"],
        suspicion_max_mult=swim["suspicion_max_mult"],
    )
    return {
        "confirmed_s": round(cfg.detection_bound(members, confirmed=True), 3),
        "lone_s": round(cfg.detection_bound(members, confirmed=False), 3),
    }


def own_words(report: dict[str, Any]) -> str:
    """The failure's error less what the nodes' accounts added to it (each instance's
    ``node_words``, and the pointer to the tails): whether the failure itself names a stage, not
    the accounts gathered after it (which name a stage vast.ai still shows running, killed or not)."""
    error = report.get("error") or ""
    for inst in report.get("instances") or []:
        if inst.get("node_words"):
            error = error.replace("; " + inst["node_words"], "")
    return re.sub(r" \(each node's log tail: [^)]*\)", "", error)


def detection(report: dict[str, Any] | None, rc: int, tail: str) -> dict[str, Any]:
    """A ``detect`` run judged: it must fail in decode naming the killed stage, and the
    orchestrator's SWIM must declare that stage dead within the lone accuser's bound from the
    kill. Returns the figures and ``cause`` (None: as it should)."""
    lost = f"pp-stage-{KILLED_STAGE}"
    if report is None:
        return {"cause": normalize(f"exit {rc}, no report: {last_line(tail)}")}
    out: dict[str, Any] = {"error": normalize(report.get("error") or "")}
    if report.get("ok"):
        return {**out, "cause": "the run passed: the killed stage was never noticed"}
    if report.get("failed_phase") != "decode" or lost not in own_words(report):
        return {**out, "cause": cli_cause(report, rc, tail)}
    kills = [x for x in (report.get("emulator") or {}).get("host_losses", []) if x.get("stage") == KILLED_STAGE]
    swim = report.get("swim") or {}
    deaths = [x for x in swim.get("deaths", []) if x.get("member") == lost]
    if not kills:
        return {**out, "cause": "no kill recorded (emulator.host_losses)"}
    if deaths:
        declared, by = deaths[0]["at"], "the orchestrator's SWIM"
    elif "'s SWIM declared it dead" in (report.get("error") or "") and report.get("failed_at"):
        declared, by = report["failed_at"], "pp-stage-0's SWIM, as the run learnt it"  # an upper bound
    else:
        return {**out, "cause": f"no SWIM declared {lost} dead (swim.deaths, the error)"}
    seconds = round(declared - kills[0]["at"], 3)
    bound = swim_bound(swim, 1 + int(report.get("num_stages") or 2))
    within = seconds <= bound["lone_s"]
    awareness = (swim.get("stats") or {}).get("awareness")
    out.update(detection_s=seconds, declared_by=by, bound=bound, within=within, awareness=awareness)
    out["cause"] = None if within else f"SWIM declared {lost} dead after the bound"
    return out


# --- one run ----------------------------------------------------------------------------------


def command(kind: str, out: Path) -> tuple[list[str], dict[str, str]]:
    """The command line of one run of ``kind`` writing its report or JUnit XML to ``out``, and
    the environment it adds."""
    if kind == "spec":
        cmd = ["-m", "pytest", "--pyargs", "pytest_ppsmoke.spec", "-m", "local", "-p", "no:cacheprovider", "-q"]
        return [sys.executable, *cmd, f"--junitxml={out}"], {}
    cli = [sys.executable, "-m", "pytest_ppsmoke.harness.cli", "--local", "--report", str(out)]
    if kind == "cli":
        return cli, {}
    if kind == "detect":
        return [*cli, "--max-tokens", str(DETECT_TOKENS)], {"PP_FAILPOINTS": DETECT_FAULTS}
    raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")


def run_one(kind: str, workdir: Path, deadline: float) -> dict[str, Any]:
    """One run, in a process group of its own killed at ``deadline`` seconds; its record."""
    out = workdir / ("junit.xml" if kind == "spec" else "report.json")
    out.unlink(missing_ok=True)
    cmd, extra = command(kind, out)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # this checkout's package
    env = {**os.environ, **extra, "PYTHONPATH": path}
    log = workdir / "output.txt"
    started = time.monotonic()
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            cmd, cwd=workdir, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=deadline)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_group(proc)  # what the run left behind, too
    wall = round(time.monotonic() - started, 2)
    tail = log.read_text(errors="replace")[-4000:]
    record: dict[str, Any] = {"kind": kind, "wall_s": wall}
    if timed_out:
        record.update(exit_code=None, cause=f"timeout: no end within {deadline:g} s", false=True)
        return record
    record["exit_code"] = rc
    text = out.read_text() if out.exists() else None
    if kind == "spec":
        cause, failing = spec_cause(text, rc, tail)
        record.update(cause=cause, failing=failing)
    else:
        report = json.loads(text) if text else None
        if kind == "cli":
            record["cause"] = cli_cause(report, rc, tail)
        else:
            record.update(detection(report, rc, tail))
    record["false"] = record["cause"] is not None
    if record["false"]:
        record["output_tail"] = tail[-1500:]
    return record


# --- summaries and parts ----------------------------------------------------------------------


def cells(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per ``load/kind``: runs, false failures, each cause's count, wall times and detections."""
    out: dict[str, dict[str, Any]] = {}
    for r in runs:
        c = out.setdefault(
            f"{r['load']}/{r['kind']}",
            {"load": r["load"], "kind": r["kind"], "runs": 0, "false_failures": 0, "causes": {}, "wall_s": []},
        )
        c["runs"] += 1
        c["wall_s"].append(r["wall_s"])
        if r["false"]:
            c["false_failures"] += 1
            c["causes"][r["cause"]] = c["causes"].get(r["cause"], 0) + 1
        if "detection_s" in r:
            c.setdefault("detection_s", []).append(r["detection_s"])
            c.setdefault("bound_lone_s", []).append(r["bound"]["lone_s"])
    return out


def machine() -> dict[str, Any]:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((x.split(":", 1)[1].strip() for x in info.splitlines() if x.startswith("model name")), "?")
    mem = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    kb = next((int(x.split()[1]) for x in mem.splitlines() if x.startswith("MemTotal:")), 0)
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "memory_gib": round(kb / 2**20, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    return done.stdout.strip()


def part_meta(args: argparse.Namespace, loads: dict[str, Any]) -> dict[str, Any]:
    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "argv": sys.argv[1:],
        "loads": loads,
        "deadlines_s": {k: DEADLINES[k] if args.deadline is None else args.deadline for k in args.kinds},
        "detect_faults": DETECT_FAULTS if "detect" in args.kinds else None,
    }


def result(parts: list[dict[str, Any]], runs: list[dict[str, Any]], allowed: bool = False) -> dict[str, Any]:
    commits = sorted({p["commit"] for p in parts})
    return {
        "benchmark": "false_failures",
        "parts": parts,
        "commits": commits,
        "commits_allowed_to_differ": allowed,
        "cells": cells(runs),
        "runs": runs,
    }


def merge(docs: list[dict[str, Any]], allow_commits: bool = False) -> dict[str, Any]:
    """Parts into one: the runs pooled (every failure's cause kept), the cells summed again, each
    part's metadata kept. Parts from different commits are refused unless ``allow_commits``."""
    parts = [p for d in docs for p in d["parts"]]
    commits = sorted({p["commit"] for p in parts})
    if len(commits) > 1 and not allow_commits:
        raise ValueError(f"the parts come from {len(commits)} commits ({', '.join(commits)}); pass --allow-commits")
    return result(parts, [r for d in docs for r in d["runs"]], allowed=len(commits) > 1)


def table(doc: dict[str, Any]) -> str:
    """The Markdown table: load x kind, runs, false failures, causes, wall time, detection."""
    rows = [
        "| load | kind | runs | false failures | causes | median wall s | SWIM detection s (median / max) | bound s |",
        "|---|---|---:|---:|---|---:|---|---:|",
    ]
    order = {name: i for i, name in enumerate((*LOADS, *KINDS))}
    for c in sorted(doc["cells"].values(), key=lambda c: (order.get(c["load"], 99), order.get(c["kind"], 99))):
        causes = "; ".join(f"{n} x {k}" for k, n in Counter(c["causes"]).most_common()) or "-"
        det = c.get("detection_s") or []
        shown = f"{statistics.median(det):.2f} / {max(det):.2f}" if det else "-"
        bound = f"{max(c['bound_lone_s']):.2f}" if c.get("bound_lone_s") else "-"
        wall = statistics.median(c["wall_s"]) if c["wall_s"] else 0.0
        rows.append(
            f"| {c['load']} | {c['kind']} | {c['runs']} | {c['false_failures']} | {causes.replace('|', '/')} "
            f"| {wall:.1f} | {shown} | {bound} |"
        )
    return "\n".join(rows)


# --- the commands -----------------------------------------------------------------------------


def names(text: str, known: tuple[str, ...], what: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in known]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"{what} {text!r}: expected a comma-separated list of {', '.join(known)}")
    return out


def measure(args: argparse.Namespace) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="ppsmoke-false-failures-", dir=args.workdir))
    runs: list[dict[str, Any]] = []
    described: dict[str, Any] = {}
    meta = part_meta(args, described)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    try:
        for load in args.loads:
            commands, described[load] = load_commands(load, workdir, args.disk_gb, args.memory_gb)
            with Load(commands) as running:
                time.sleep(args.settle if commands else 0)
                for i in range(args.runs):
                    for kind in args.kinds:
                        deadline = DEADLINES[kind] if args.deadline is None else args.deadline
                        record = {"load": load, "round": i + 1, **run_one(kind, workdir, deadline)}
                        if died := running.died():
                            record["load_died"] = died  # the run was not under the whole load
                        runs.append(record)
                        print(json.dumps({k: v for k, v in record.items() if k != "output_tail"}), file=sys.stderr)
                        if args.out:
                            args.out.write_text(json.dumps(result([meta], runs), indent=2) + "\n")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    benchio.emit(result([meta], runs), args.out)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("merge", "show"):
        sub = argparse.ArgumentParser(prog=f"false_failures.py {sys.argv[1]}")
        sub.add_argument("files", type=Path, nargs="+")
        if sys.argv[1] == "merge":
            sub.add_argument("--out", type=Path)
            sub.add_argument("--allow-commits", action="store_true", help="merge parts from different commits")
        a = sub.parse_args(sys.argv[2:])
        docs = [json.loads(f.read_text()) for f in a.files]
        if sys.argv[1] == "show":
            print(table(merge(docs, allow_commits=True)))
            return
        try:
            benchio.emit(merge(docs, a.allow_commits), a.out)
        except ValueError as e:
            raise SystemExit(f"merge: {e}") from None
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=1, help="runs of each kind under each load (default 1)")
    p.add_argument("--loads", type=lambda t: names(t, LOADS, "loads"), default=list(LOADS))
    p.add_argument("--kinds", type=lambda t: names(t, KINDS, "kinds"), default=list(KINDS))
    p.add_argument("--disk-gb", type=float, default=1.5, help="the disk load's file (default 1.5 GB)")
    p.add_argument("--memory-gb", type=float, default=6.0, help="the memory load's size (default 6 GiB)")
    p.add_argument("--settle", type=float, default=5.0, help="seconds a load runs before its first run")
    p.add_argument("--deadline", type=float, help=f"seconds a run may take (default by kind: {DEADLINES})")
    p.add_argument("--workdir", type=Path, help="where the runs and the disk load write (default: the temp dir)")
    p.add_argument("--out", type=Path)
    measure(p.parse_args())


if __name__ == "__main__":
    main()

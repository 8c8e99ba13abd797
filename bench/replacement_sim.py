"""Replacing a host that never boots: the simulation that chooses the policy. The rental itself
(``pytest_ppsmoke/cloud/rental.py``: ``Rental.check``, ``rent``, ``see_through``, ``replace``,
``close``, and the host watch the harness runs beside them), unchanged, on a virtual clock against
the in-memory provider (``tests/memprovider.py``), thousands of runs per cell; the verdicts, their
times and their dollars compared between policies on the same draws.

    python bench/replacement_sim.py --out bench/results/replacement_sim.json --markdown   # 500 runs per cell
    python bench/replacement_sim.py --runs 2000 --no-watch   # more runs; the host watch's list calls left out

A run, as the harness makes one (``harness/deployment.py``): the pre-flight's offers; each
stage rented in turn, its own steps started once its create is in (``see_through``: running
within the per-host deadline or the boot window, then the node's join within the join
deadline, replaced when the policy allows); with a spare, one more instance of the last stage
rented beside it; once every stage is through, the rest of the run (load, resolve, inference);
then the teardown. The budget ends the steps at ``rental.deadline`` (the budget less the
teardown's share, as the driver sets it). The simulated deployment is always healthy: every
failure here is the cloud's (a host that never boots, a boot too slow for the budget, offers
taken), which a smoke test should not report as the deployment's.

Each cell (a boot assumption, a share of hosts that never boot, a rate of offers taken between
search and create, vast.ai's documented rate limits on or off) draws, per run, every create's
boot and the offers taken, from a seed of its own; every policy runs on the same draws (common
random numbers), so a difference between policies in a cell is the policy's, and a run that one
policy passes and another fails is counted (``rescued`` and ``harmed``, against ``none``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import itertools
import logging
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_ppsmoke.cloud import vastdoc
from pytest_ppsmoke.cloud.provider import Offer
from pytest_ppsmoke.cloud.rental import Rental, RentalConfig, RentedInstance
from pytest_ppsmoke.cloud.replace import DOCUMENTED, FAST_HOSTS, SPEC, BootAssumption, ReplacePolicy
from pytest_ppsmoke.cloud.teardown import within
from pytest_ppsmoke.harness.settings import Settings
from pytest_ppsmoke.protocol import BOOT_POLL_INTERVAL, BUDGET, Phase, PhaseError

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the repository: tests.memprovider
import benchio

from tests.memprovider import MemProvider, VirtualClock

ROOT = Path(__file__).resolve().parent.parent
# the harness's own defaults: the budget, and the teardown's share kept back from it
TEARDOWN_S: float = next(f.default for f in dataclasses.fields(Settings) if f.name == "teardown_timeout")  # type: ignore[assignment]
STAGES = 2
# from running to the node joined: the container's start and the cluster's join, assumed
JOIN_S = 15.0
# load, resolve and inference once every stage has joined: the harness's own estimate
REST_S = ReplacePolicy().rest_estimate
OFFERS = 16
PRICES = (0.30, 1.50)  # $/h, the cheapest and the dearest of the catalogue, evenly between
DEADLINES = (30.0, 45.0, 60.0, 90.0)  # race@D: the slow host keeps booting beside its replacement
AT_ONCE = (45.0, 90.0, 120.0)  # replace@D: the slow host destroyed at once
NEVER = (0.0, 0.05, 0.10, 0.20)
TAKES = (0.0, 0.10)
BOOTS = {"fast": FAST_HOSTS, "documented": DOCUMENTED}
SEED = 4801  # issue 48's


@dataclass(frozen=True)
class Cell:
    """One set of assumptions about the cloud."""

    boot: str  # a key of BOOTS
    never: float  # the share of hosts that never boot
    take: float  # each offer's chance of being taken by someone else between search and create
    limits: bool = True  # vast.ai's documented rate limits on the provider's calls

    @property
    def assumption(self) -> BootAssumption:
        return dataclasses.replace(BOOTS[self.boot], never=self.never)

    @property
    def name(self) -> str:
        return f"{self.boot} never={self.never:g} take={self.take:g} limits={'on' if self.limits else 'off'}"

    def summary(self) -> dict[str, Any]:
        a = self.assumption
        return {
            "boot": self.boot,
            "p5_s": a.p5,
            "p95_s": a.p95,
            "median_s": round(a.median, 1),
            "never": self.never,
            "take": self.take,
            "rate_limits": self.limits,
        }


@dataclass(frozen=True)
class Policy:
    """A replacement policy (the rental's own), and whether the last stage gets a spare."""

    name: str
    replace: ReplacePolicy
    spare: bool = False


def policies(both_deadline: float) -> list[Policy]:
    """``none`` (the spec's error table: a host gets its whole boot window), ``replace@D`` for each
    per-host deadline D (the slow host destroyed at once: ``keep_slow`` off), ``race@D`` (its
    replacement races it, the first to run kept: ``keep_slow``, the rental's default), ``spare``
    (no replacement; the last stage rented twice, the first to run kept) and ``both`` (a spare,
    and a race at ``both_deadline``)."""
    return [
        Policy("none", SPEC),
        *(Policy(f"replace@{d:g}", ReplacePolicy(host_deadline=d, keep_slow=False)) for d in AT_ONCE),
        *(Policy(f"race@{d:g}", ReplacePolicy(host_deadline=d)) for d in DEADLINES),
        Policy("spare", SPEC, spare=True),
        Policy(f"both@{both_deadline:g}", ReplacePolicy(host_deadline=both_deadline), spare=True),
    ]


def cells() -> list[Cell]:
    """The sweep: every boot assumption, never-boot share and take rate with the documented rate
    limits; then one cell without them, for contrast."""
    out = [Cell(b, n, t) for b in BOOTS for n in NEVER for t in TAKES]
    out.append(Cell("documented", 0.10, 0.0, limits=False))
    return out


def catalogue() -> list[Offer]:
    """``OFFERS`` offers on distinct machines, cheapest first, evenly priced over ``PRICES``."""
    lo, hi = PRICES
    step = (hi - lo) / (OFFERS - 1)
    return [
        Offer(100 + i, f"GPU-{i}", 1, 24_000.0, round(lo + step * i, 4), 0.99, "here", {}, 500 + i)
        for i in range(OFFERS)
    ]


@dataclass(frozen=True)
class Draw:
    """One run's luck: each create's boot in order (None: never), and the offers someone else
    takes first. Drawn from the cell and the run's number alone, so every policy gets the same."""

    boots: tuple[float | None, ...]
    taken: frozenset[int]

    @classmethod
    def of(cls, cell: Cell, index: int, creates: int) -> Draw:
        rng = random.Random(f"{SEED}/{cell.boot}/{cell.never}/{cell.take}/{cell.limits}/{index}")
        a = cell.assumption
        boots = tuple(a.sample(rng) for _ in range(creates))
        taken = frozenset(o.id for o in catalogue() if rng.random() < cell.take)
        return cls(boots, taken)


def most_creates() -> int:
    """Every create a run can make: each stage, a spare, and the policy's replacements."""
    most = ReplacePolicy().most
    return STAGES + 1 + (STAGES if most is None else most) + 1


@dataclass
class Outcome:
    ok: bool
    cause: str | None  # None for a pass; else the failed phase, or "budget"
    error: str
    seconds: float  # virtual, from the run's start to the teardown's end
    usd: float
    replacements: int
    replaced_bootable: int  # replaced hosts that would have run within their boot window
    creates: int


async def _within(clock: VirtualClock, seconds: float, work: Any) -> bool:
    """``work`` until done (True) or ``seconds`` of the virtual clock (False: cancelled): the
    rental's own deadline (``teardown.within``), as the driver's budget cuts the steps."""
    try:
        await within(max(seconds, 0.0), work, clock.sleep)
    except TimeoutError:
        return False
    return True


async def _steps(
    rental: Rental, policy: Policy, clock: VirtualClock, join_s: float, rest_s: float, watch_hosts: bool
) -> None:
    """The run's steps, as the harness takes them: the offers, each stage's create and its own
    steps (with a spare of the last), the host watch; then the rest of the run."""
    ids = itertools.count(STAGES)
    began = clock()

    def stamp(inst: RentedInstance, step: str) -> None:
        inst.reached(step, began, clock())

    async def renew(old: RentedInstance) -> tuple[dict[str, str], str]:
        return {}, f"id-{next(ids)}"

    async def after_running(inst: RentedInstance) -> None:
        await clock.sleep(join_s)

    offers = await rental.check()
    tasks: list[asyncio.Future[Any]] = []  # each stage's steps, then the host watch
    try:
        for stage in range(STAGES):
            inst = await rental.rent(stage, {}, offers, f"id-{stage}")
            stamp(inst, "rented")
            spare = None
            if policy.spare and stage == STAGES - 1:
                n = rental.next_replacement(stage)
                spare = await rental.rent(stage, {}, offers, f"id-{next(ids)}", replacement=n)
                stamp(spare, "rented")
            tasks.append(asyncio.ensure_future(rental.see_through(inst, renew, after_running, stamp, spare=spare)))
        lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        pending: set[asyncio.Future[Any]] = {*tasks, lost}
        if watch_hosts:
            tasks.append(asyncio.ensure_future(rental.watch(lost)))
        while pending - {lost}:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if lost in done:
                raise PhaseError(Phase.BOOT, lost.result())
            for t in done:
                t.result()  # a stage's failure ends the run
        await clock.sleep(rest_s)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def simulate(
    cell: Cell,
    policy: Policy,
    draw: Draw,
    *,
    join_s: float = JOIN_S,
    rest_s: float = REST_S,
    budget: float = BUDGET,
    teardown: float = TEARDOWN_S,
    watch_hosts: bool = True,
) -> tuple[Outcome, Rental, MemProvider]:
    """One run on a fresh virtual clock; its outcome, and the rental and provider it ran on."""
    clock = VirtualClock(start=0.0)
    provider = MemProvider(
        clock,
        catalogue=catalogue(),
        boot_s=list(draw.boots),
        taken=set(draw.taken),
        pace=vastdoc.pace(scale=1.0) if cell.limits else {},  # vast.ai's own seconds, whatever the suite scales
    )
    config = RentalConfig(
        num_stages=STAGES, check_image="not asked", replacement=policy.replace, poll_interval=BOOT_POLL_INTERVAL
    )
    rental = Rental(provider, config, "sim", clock=clock, sleep=clock.sleep)
    rental.teardown_timeout = teardown
    start = clock()
    rental.deadline = start + budget - teardown
    cause: str | None = None
    error = ""
    try:
        if not await _within(
            clock, rental.deadline - clock(), _steps(rental, policy, clock, join_s, rest_s, watch_hosts)
        ):
            cause, error = "budget", f"the budget's {budget - teardown:g} s for the steps ran out"
    except PhaseError as e:
        cause, error = str(e.phase), e.reason
    except Exception as e:  # a defect of the rental: the harness fails the run naming it (Deployment._steps)
        cause, error = f"defect ({type(e).__name__})", f"{type(e).__name__}: {e}"
    finally:
        await rental.close()
    end = clock()
    usd = sum(
        i.offer.dph_total * ((end if i.destroyed is None else i.destroyed) - i.created) / 3600
        for i in provider.instances.values()
    )
    replaced = {i.replaces for i in rental.instances if i.replaces is not None}
    window = rental.config.boot_window
    bootable = sum(
        1 for i in provider.instances.values() if i.id in replaced and i.boot_s is not None and i.boot_s <= window
    )
    outcome = Outcome(
        cause is None, cause, error, end - start, usd, rental.replacements, bootable, len(provider.instances)
    )
    return outcome, rental, provider


def run_one(cell: Cell, policy: Policy, draw: Draw) -> Outcome:
    return asyncio.run(simulate(cell, policy, draw))[0]


BATCH = 25  # runs (each under every policy) in one event loop at once: each has its own clock


def _chunk(args: tuple[Cell, list[Policy], int, int, bool]) -> dict[str, list[Outcome]]:
    """Runs ``start`` to ``stop`` of ``cell``, every policy on each run's draw. Runs share an
    event loop, each on its own virtual clock (a clock moves when its own callers are parked,
    whatever else the loop runs), so a loop's turns are paid once for many runs."""
    cell, pols, start, stop, watch_hosts = args
    logging.disable(logging.WARNING)  # each replacement and taken offer is logged: thousands of lines
    out: dict[str, list[Outcome]] = {p.name: [] for p in pols}

    async def many() -> None:
        for a in range(start, stop, BATCH):
            draws = [Draw.of(cell, i, most_creates()) for i in range(a, min(stop, a + BATCH))]
            done = await asyncio.gather(*(simulate(cell, p, d, watch_hosts=watch_hosts) for d in draws for p in pols))
            for k, (outcome, _, _) in enumerate(done):
                out[pols[k % len(pols)].name].append(outcome)

    asyncio.run(many())
    return out


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1), by linear interpolation between the sorted values."""
    s = sorted(values)
    if not s:
        return math.nan
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def figures(runs: list[Outcome], base: list[Outcome]) -> dict[str, Any]:
    """A policy's figures in a cell; ``base``: the ``none`` policy's runs on the same draws."""
    n = len(runs)
    fails = [r for r in runs if not r.ok]
    usd = statistics.fmean(r.usd for r in runs)
    return {
        "runs": n,
        "fail_rate": len(fails) / n,
        "causes": dict(Counter(str(r.cause) for r in fails).most_common()),
        "verdict_p50_s": round(pct([r.seconds for r in runs], 0.5), 1),
        "verdict_p95_s": round(pct([r.seconds for r in runs], 0.95), 1),
        "usd_mean": round(usd, 5),
        "usd_extra_vs_none": round(usd - statistics.fmean(r.usd for r in base), 5),
        "replacements_mean": round(statistics.fmean(r.replacements for r in runs), 4),
        "replaced_bootable": sum(r.replaced_bootable for r in runs),
        "rescued_vs_none": sum(1 for r, b in zip(runs, base, strict=True) if r.ok and not b.ok),
        "harmed_vs_none": sum(1 for r, b in zip(runs, base, strict=True) if b.ok and not r.ok),
    }


def sweep(
    cs: Iterable[Cell], pols: list[Policy], runs: int, jobs: int, watch_hosts: bool = True
) -> dict[tuple[Cell, str], list[Outcome]]:
    """Every cell's runs under every policy, split in chunks over ``jobs`` processes; each
    policy's runs of a cell in the order of their draws."""
    per = max(1, math.ceil(runs / max(1, jobs) / 4))
    work = [(c, pols, a, min(runs, a + per), watch_hosts) for c in cs for a in range(0, runs, per)]
    out: dict[tuple[Cell, str], list[Outcome]] = {}
    pool = ProcessPoolExecutor(max_workers=jobs) if jobs > 1 else None
    with pool if pool is not None else contextlib.nullcontext():
        results = pool.map(_chunk, work) if pool is not None else map(_chunk, work)
        for (c, *_), part in zip(work, results, strict=True):
            for name, outs in part.items():
                out.setdefault((c, name), []).extend(outs)
    return out


def fail_rate(runs: list[Outcome]) -> float:
    return sum(1 for r in runs if not r.ok) / len(runs)


def best_deadline(table: dict[tuple[Cell, str], list[Outcome]], cs: list[Cell]) -> float:
    """The per-host deadline for ``both``: of the races' deadlines at which anything was replaced (one at which
    nothing ever is would make ``both`` the spare alone), the one whose runs fail least over
    every cell, then the one with the earlier verdicts."""

    def runs(d: float) -> list[list[Outcome]]:
        return [table[(c, f"race@{d:g}")] for c in cs]

    replacing = [d for d in DEADLINES if any(r.replacements for rs in runs(d) for r in rs)] or list(DEADLINES)
    return min(
        replacing,
        key=lambda d: (
            statistics.fmean(fail_rate(rs) for rs in runs(d)),
            statistics.fmean(pct([r.seconds for r in rs], 0.95) for rs in runs(d)),
        ),
    )


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown(report: dict[str, Any]) -> str:
    """The tables for docs/benchmarks.md: the share of runs that fail, a row per cell and a
    column per policy; then every figure, a row per cell and policy."""
    names = list(report["cells"][0]["policies"])

    def where(c: dict[str, Any]) -> str:
        limits = "on" if c["rate_limits"] else "off"
        return f"| {c['boot']} | {c['never'] * 100:g} % | {c['take'] * 100:g} % | {limits} "

    head = "| boot | never boots | offers taken | rate limits | " + " | ".join(names) + " |"
    lines = ["Runs that fail, %:", "", head, "|" + "---|" * (head.count("|") - 1)]
    for cell in report["cells"]:
        fails = " | ".join(f"{cell['policies'][n]['fail_rate'] * 100:.1f}" for n in names)
        lines.append(where(cell["cell"]) + f"| {fails} |")
    head = (
        "| boot | never boots | offers taken | rate limits | policy | fail % | causes | verdict p50 s | "
        "verdict p95 s | $ mean | $ extra vs none | replacements | replaced hosts that would have run "
        "| rescued / harmed vs none |"
    )
    lines += ["", "Every figure:", "", head, "|" + "---|" * (head.count("|") - 1)]
    for cell in report["cells"]:
        for name, f in cell["policies"].items():
            causes = ", ".join(f"{k} {v}" for k, v in f["causes"].items()) or "-"
            lines.append(
                where(cell["cell"]) + f"| {name} | {f['fail_rate'] * 100:.1f} | {causes} | {f['verdict_p50_s']:.0f} "
                f"| {f['verdict_p95_s']:.0f} | {f['usd_mean']:.4f} | {f['usd_extra_vs_none']:+.4f} "
                f"| {f['replacements_mean']:.2f} | {f['replaced_bootable']} "
                f"| {f['rescued_vs_none']} / {f['harmed_vs_none']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=500, help="runs per cell, every policy on the same draws (500)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes (default: every core)")
    ap.add_argument("--both-deadline", type=float, default=None, help="both's per-host deadline (default: the best)")
    ap.add_argument(
        "--watch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the host watch beside the steps, as the harness runs it (--no-watch: faster, its list calls left out)",
    )
    ap.add_argument("--out", type=Path, default=None, help="the JSON, also printed")
    ap.add_argument("--markdown", action="store_true", help="print the tables for docs/benchmarks.md after the JSON")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs must be at least 1, got {args.runs}")
    cs = cells()
    began = time.monotonic()
    first = policies(DEADLINES[0])[:-1]
    table = sweep(cs, first, args.runs, args.jobs, args.watch)
    both_at = args.both_deadline if args.both_deadline is not None else best_deadline(table, cs)
    both = policies(both_at)[-1]
    table.update(sweep(cs, [both], args.runs, args.jobs, args.watch))
    names = [p.name for p in [*first, both]]
    report: dict[str, Any] = {
        "bench": "replacement_sim",
        "date": datetime.date.today().isoformat(),
        "commit": commit(),
        "machine": {"python": platform.python_version(), "cores": os.cpu_count()},
        "command": " ".join(["python", "bench/replacement_sim.py", *(argv if argv is not None else sys.argv[1:])]),
        "assumptions": {
            "stages": STAGES,
            "budget_s": BUDGET,
            "teardown_s": TEARDOWN_S,
            "steps_deadline_s": BUDGET - TEARDOWN_S,
            "boot_window_s": RentalConfig(check_image="not asked").boot_window,
            "poll_interval_s": BOOT_POLL_INTERVAL,
            "join_s": JOIN_S,
            "rest_s": REST_S,
            "offers": OFFERS,
            "prices_dph": [o.dph_total for o in catalogue()],
            "boots": {k: dataclasses.asdict(v) for k, v in BOOTS.items()},
            "rate_limits": vastdoc.pace(scale=1.0),
            "host_watch": args.watch,
            "replace_policy_defaults": dataclasses.asdict(ReplacePolicy()),
            "runs_per_cell": args.runs,
            "seed": SEED,
            "both_deadline_s": both_at,
        },
        "cells": [
            {"cell": c.summary(), "policies": {n: figures(table[(c, n)], table[(c, "none")]) for n in names}}
            for c in cs
        ],
        "wall_s": round(time.monotonic() - began, 1),
    }
    benchio.emit(report, args.out)
    if args.markdown:
        print()
        print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

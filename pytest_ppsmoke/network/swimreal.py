"""SWIM with real members, measured as :mod:`.swimsim` measures its simulated ones, so that the
simulation can be checked against the real thing at the same N, profile and join schedule.

    async with EmulatedNetwork(parse_network("wan"), seed=1) as net:
        real = await run_members(net, RealSpec(members=16, config=SwimConfig.wan(), hold_s=60))
    sims = [simulate(SimSpec(16, "wan", cfg, join_at=real.join_at, watch_s=60, seed=s)) for s in range(20)]
    agreement(real, sims)   # per figure: the real value, the simulated range, agreed or not

Member 0 (the seed a run's orchestrator would be) is a ``Node`` in this process at the network's
host address; members 1 .. N - 1 are ``python -m pytest_ppsmoke.runtime.member`` processes (a node,
iroh and all), each in a namespace of its own behind the network's switch. They join through the
seed as their processes come up; every membership event is stamped with ``time.monotonic()``
where it happens (one clock for every process of this machine). Measured, as the simulation
measures them:

- ``join_at``: when each member began its join, after the first (the simulation replays it);
- ``converge_after_joins_s``: the last join's end to the moment every member sees every other
  alive;
- ``detect_first_s`` / ``detect_all_s``: a member SIGKILLed (a crashed host) to the first live
  member that declares it dead, and to the last;
- ``false_deaths``: then, for ``hold_s``, deaths declared of live members (each member and
  incarnation once), and ``suspicions`` of them;
- what it costs this machine over the hold: each member process's CPU seconds per second and
  memory, and the share of all cores busy, which says how many members this machine holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..runtime.codec import MemberStatus
from ..runtime.localproc import ChildProcess, ClusterKeys, EventKind, member_env
from ..runtime.node import Node, NodeConfig
from ..runtime.swim import MemberEvent
from ..runtime.swimconfig import SwimConfig
from .emulated import EmulatedNetwork
from .swimsim import SimResult, until

_PAGE = os.sysconf("SC_PAGE_SIZE")
_TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class RealSpec:
    members: int
    config: SwimConfig = field(default_factory=SwimConfig.wan)
    hold_s: float = 30.0  # after the detection: watched for false deaths
    seed: int = 1  # which member is killed
    start_wave: int = (
        0  # start the member processes this many at a time, each wave once the last has joined; 0: all at once
    )
    limit_s: float = 120.0  # a phase's deadline (the start: this plus 3 s a member)


@dataclass
class RealResult:
    members: int
    profile: str
    join_at: tuple[float, ...] = ()
    start_s: float = 0.0  # the first member process started to the last one joined
    converge_after_joins_s: float | None = None
    detect_first_s: float | None = None
    detect_all_s: float | None = None
    detect_spread_s: float | None = None
    false_deaths: int = 0
    suspicions: int = 0
    hold_s: float = 0.0
    member_cpu_per_s: float = 0.0  # a member process's CPU seconds per second over the hold, mean
    member_rss_mb: float = 0.0  # a member process's resident memory, mean
    machine_busy: float = 0.0  # the share of this machine's cores busy over the hold (everything on it)
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)


@dataclass
class _Views:
    """Every observer's view, replayed from its events: the members it holds alive."""

    n: int
    # observer -> (at, kind, id, incarnation, alive: the member's status in the event)
    events: dict[str, list[tuple[float, str, str, int, bool]]] = field(default_factory=dict)

    def add(self, observer: str, at: float, kind: str, member: str, incarnation: int, alive: bool) -> None:
        self.events.setdefault(observer, []).append((at, kind, member, incarnation, alive))

    def complete_since(self, observer: str) -> float | None:
        """When ``observer``'s view last became every other member alive (None: it is not now)."""
        alive: set[str] = set()
        since: float | None = None
        for at, _, member, _, is_alive in sorted(self.events.get(observer, [])):
            if is_alive:
                alive.add(member)
            else:
                alive.discard(member)
            complete = len(alive) == self.n - 1
            since = (since if since is not None else at) if complete else None
        return since

    def dead_at(self, member: str) -> dict[str, float]:
        """Observer -> when it first declared ``member`` dead."""
        out: dict[str, float] = {}
        for observer, evs in self.events.items():
            ats = [at for at, kind, m, _, _ in evs if kind == "dead" and m == member]
            if ats:
                out[observer] = min(ats)
        return out

    def about_live(self, kinds: set[str], dead: str, since: float) -> list[tuple[str, int]]:
        return [
            (m, inc)
            for evs in self.events.values()
            for at, kind, m, inc, _ in evs
            if kind in kinds and m != dead and at >= since
        ]


def _proc_cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / _TICK  # utime, stime
    except (OSError, IndexError, ValueError):
        return 0.0


def _proc_rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE / 2**20
    except (OSError, IndexError, ValueError):
        return 0.0


def _machine_busy_total() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]  # idle, iowait
    return sum(v) - idle, sum(v)


async def run_members(net: EmulatedNetwork, spec: RealSpec) -> RealResult:
    """Form a cluster of ``spec.members`` on ``net``, kill one, watch; always tears it down."""
    n, cfg = spec.members, spec.config
    if n < 3:
        raise ValueError(f"members must be at least 3 (a seed, a victim and a witness), got {n}")
    keys = ClusterKeys(n)
    ids = keys.ids
    views = _Views(n)
    seed = Node(NodeConfig(secret_key=keys.keys[0], allowed=frozenset(ids), bind_addr=f"{net.host_addr}:0", swim=cfg))
    procs: list[ChildProcess] = []
    result = RealResult(members=n, profile=net.spec.name)

    def on_seed(ev: MemberEvent) -> None:
        alive = ev.member.status == MemberStatus.alive
        views.add(ids[0], ev.at, ev.kind, ev.member.id, ev.member.incarnation, alive)

    seen = [0] * n

    def collect() -> None:
        for i, p in enumerate(procs, 1):
            new = p.events[seen[i] :]
            seen[i] = len(p.events)
            for e in new:
                if "member" in e and "at" in e:
                    alive = e.get("status") == "alive"
                    views.add(ids[i], float(e["at"]), str(e.name), str(e["member"]), int(e["incarnation"]), alive)

    try:
        await seed.start()
        seed.membership.add_listener(on_seed)
        for i in range(1, n):
            m = await net.add_member(str(i))
            env = member_env(keys.keys[i], ids, seed.ticket(), [], cfg.to_env(), {"PP_BIND": f"{m.addr}:0"})
            procs.append(
                ChildProcess(f"member {i}", m.wrap([sys.executable, "-m", "pytest_ppsmoke.runtime.member"]), env)
            )
        started = time.monotonic()
        wave = spec.start_wave or len(procs)
        readies = []
        for k in range(0, len(procs), wave):
            for p in procs[k : k + wave]:
                await p.start()
            for p in procs[k : k + wave]:
                readies.append(
                    await p.wait_event(lambda e: e.kind is EventKind.READY, spec.limit_s + 3 * wave, "ready")
                )
        starts = [float(r["at"]) - float(r["joined_in_s"]) for r in readies]
        ends = [float(r["at"]) for r in readies]
        result.join_at = tuple(round(s - min(starts), 3) for s in starts)
        result.start_s = round(max(ends) - started, 3)

        def converged() -> bool:
            collect()
            return all(views.complete_since(i) is not None for i in ids)

        await until(converged, 0.05, spec.limit_s, f"every one of {n} members seeing every other alive")
        done = max(v for i in ids if (v := views.complete_since(i)) is not None)
        result.converge_after_joins_s = round(max(0.0, done - max(ends)), 3)

        victim_index = random.Random(spec.seed).randrange(1, n)
        victim = ids[victim_index]
        killed = time.monotonic()
        procs[victim_index - 1].signal(signal.SIGKILL)
        live = [i for i in ids if i != victim]

        def all_know() -> bool:
            collect()
            return set(views.dead_at(victim)) >= set(live)

        await until(all_know, 0.05, spec.limit_s, f"every live member declaring the killed one dead (of {n})")
        seen_at = views.dead_at(victim)
        result.detect_first_s = round(min(seen_at[i] for i in live) - killed, 3)
        result.detect_all_s = round(max(seen_at[i] for i in live) - killed, 3)
        result.detect_spread_s = round(result.detect_all_s - result.detect_first_s, 3)

        others = [p for k, p in enumerate(procs, 1) if k != victim_index]
        hold_from = time.monotonic()
        cpu0 = {p.pid: _proc_cpu_s(p.pid) for p in others}
        busy0, total0 = _machine_busy_total()
        await asyncio.sleep(spec.hold_s)
        busy1, total1 = _machine_busy_total()
        held = time.monotonic() - hold_from
        result.hold_s = round(held, 3)
        result.member_cpu_per_s = round(sum(_proc_cpu_s(p.pid) - cpu0[p.pid] for p in others) / len(others) / held, 4)
        result.member_rss_mb = round(sum(_proc_rss_mb(p.pid) for p in others) / len(others), 1)
        result.machine_busy = round((busy1 - busy0) / max(1, total1 - total0), 3)
        collect()
        result.false_deaths = len(set(views.about_live({"dead"}, victim, hold_from)))
        result.suspicions = len(views.about_live({"suspect"}, victim, hold_from))
    finally:
        await asyncio.gather(*(_stop(p) for p in procs))
        await seed.close()
    return result


async def _stop(p: ChildProcess) -> None:
    with contextlib.suppress(Exception):
        await p.stop(grace=2.0)


FIGURES = ("converge_after_joins_s", "detect_first_s", "detect_all_s")


def agreement(real: RealResult, sims: Sequence[SimResult], slack_s: float = 0.5, rel: float = 0.15) -> dict[str, Any]:
    """Whether the real run lies where the simulation's seeds put it, figure by figure: each
    timing within the simulated range (min to max over the seeds) widened by ``max(slack_s, rel x
    the simulated median)`` (what a real clock adds: scheduling on a shared CPU, QUIC handshakes
    to members first met, the switch's own delay); the false deaths within the 95 % Poisson
    interval of the simulated rate over the real hold's member-hours."""
    if not sims:
        raise ValueError("agreement needs at least one simulated run")
    out: dict[str, Any] = {}
    for name in FIGURES:
        values = sorted(v for s in sims if (v := getattr(s, name)) is not None)
        got = getattr(real, name)
        if not values or got is None:
            out[name] = {"real": got, "simulated": values, "agrees": False}
            continue
        median = values[len(values) // 2]
        tol = max(slack_s, rel * median)
        out[name] = {
            "real": got,
            "simulated_min": values[0],
            "simulated_median": median,
            "simulated_max": values[-1],
            "tolerance_s": round(tol, 3),
            "agrees": values[0] - tol <= got <= values[-1] + tol,
        }
    rates = [s.false_deaths_per_member_hour for s in sims if s.false_deaths_per_member_hour is not None]
    if rates:
        member_hours = (real.members - 1) * real.hold_s / 3600
        expected = sum(rates) / len(rates) * member_hours
        lo, hi = poisson_interval(expected)
        out["false_deaths"] = {
            "real": real.false_deaths,
            "simulated_rate_per_member_hour": round(sum(rates) / len(rates), 3),
            "expected": round(expected, 3),
            "interval": [lo, hi],
            "agrees": lo <= real.false_deaths <= hi,
        }
    out["agrees"] = all(v["agrees"] for v in out.values() if isinstance(v, dict))
    return out


def poisson_interval(mean: float, p: float = 0.95) -> tuple[int, int]:
    """The smallest and largest counts outside the ``(1 - p) / 2`` tails of Poisson(``mean``)."""
    if mean <= 0:
        return 0, 0
    tail = (1 - p) / 2
    k, cdf, term = 0, 0.0, math.exp(-mean)
    lo: int | None = None
    while True:
        cdf += term
        if lo is None and cdf > tail:
            lo = k
        if cdf >= 1 - tail:
            return lo or 0, k
        k += 1
        term *= mean / k

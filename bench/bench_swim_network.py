"""SWIM over an emulated network: join, convergence and dead-member detection per profile; and
false deaths under CPU starvation or a lossy network.

    python bench/bench_swim_network.py detect [--profiles loopback,lan,wan,far,slow,flaky] [--rounds 1]
    python bench/bench_swim_network.py false-deaths [--load busy|flaky] [--runs 5] [--hold 8] [--busy 4]
    python bench/bench_swim_network.py busy-smoke [--runs 2] [--busy 4] [--max-tokens 16]

A cluster as a run forms it: the seed (the orchestrator's node) in this process on the network's
host address, and two member processes (``python -m pytest_ppsmoke.runtime.member``), each in a
member namespace of the network (``Member.wrap``) binding its member address (``PP_BIND``). SWIM's
configuration is the one a run chooses for the profile (``RunConfig(rtt=...).swim``, the worst
round trip of the profile's links: loopback's shared-CPU preset below 10 ms, the WAN preset with a
probe timeout of at least three round trips above), given to the members through ``PP_SWIM``.

``detect``: per profile and round, the members' join (their Join until the seed's Sync is
merged), convergence (both joined until all three views hold three members alive), then
SIGKILL of member 2 until the seed, and member 1, declare it dead; against
``SwimConfig.detection_bound(3)`` (confirmed and lone-accuser forms). Suspicions or deaths of live
members on the way are counted too.

``false-deaths``: ``--runs`` clusters, each formed, held for ``--hold`` seconds with nobody
killed, and torn down; ``busy``: on loopback with ``--busy`` processes spinning ``while True:
pass`` on this machine's cores for the whole run (the shared-CPU case: two runs at once on 2
cores); ``flaky``: on the ``flaky`` profile (20 % loss, bursty). Counted: every "dead" event
about a member (any of the three observers: they are all alive, so each is false), "suspect"
events (suspicions, which refutation must clear), and the seed's ``SwimStats``.

``busy-smoke``: whole ``pp-smoke-run --local`` runs (SmolLM2, reference off) under the busy
loops, the tinygrad workers competing too; a false death there fails the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from pytest_ppsmoke.harness.runconfig import RunConfig  # noqa: E402
from pytest_ppsmoke.harness.setup import rtt_of  # noqa: E402
from pytest_ppsmoke.network import EmulatedNetwork, parse_network  # noqa: E402
from pytest_ppsmoke.runtime.localproc import ChildProcess, ClusterKeys, EventKind, member_env  # noqa: E402
from pytest_ppsmoke.runtime.node import Node, NodeConfig  # noqa: E402
from pytest_ppsmoke.runtime.swim import MemberEvent  # noqa: E402
from pytest_ppsmoke.runtime.swimconfig import SwimConfig  # noqa: E402


async def spin() -> asyncio.subprocess.Process:
    """A busy loop in a session of its own: with the kernel's autogroup scheduling (on here) CFS
    shares the CPU between sessions first, and the nodes and members are each a session of their
    own (``ChildProcess``); four loops in one session would weigh as one."""
    return await asyncio.create_subprocess_exec(sys.executable, "-c", "while True: pass", start_new_session=True)


def swim_for(profile: str) -> SwimConfig:
    """The SWIM configuration a run chooses for the profile (from its worst round trip)."""
    return RunConfig(transport="local", rtt=rtt_of(parse_network(profile))).swim


def alive_seen(p: ChildProcess) -> set[str]:
    alive: set[str] = set()
    for e in p.events:
        if e.kind in (EventKind.JOINED, EventKind.ALIVE):
            alive.add(e["member"])
        elif e.kind is EventKind.DEAD:
            alive.discard(e["member"])
    return alive


class Cluster:
    """The seed here and two members in the network's namespaces; every event recorded."""

    def __init__(self, net: EmulatedNetwork, cfg: SwimConfig) -> None:
        self.net, self.cfg = net, cfg
        self.keys = ClusterKeys(3)
        self.seed_events: list[tuple[float, MemberEvent]] = []
        self.seed: Node | None = None
        self.members: list[ChildProcess] = []

    async def start(self) -> dict[str, Any]:
        k = self.keys
        self.seed = Node(
            NodeConfig(
                secret_key=k.keys[0], allowed=frozenset(k.ids), bind_addr=f"{self.net.host_addr}:0", swim=self.cfg
            )
        )
        await self.seed.start()
        self.seed.membership.add_listener(lambda e: self.seed_events.append((time.monotonic(), e)))
        for i in (1, 2):
            m = await self.net.add_member(str(i))
            env = member_env(k.keys[i], k.ids, self.seed.ticket(), [], self.cfg.to_env(), {"PP_BIND": f"{m.addr}:0"})
            self.members.append(
                ChildProcess(f"m{i}", m.wrap([sys.executable, "-m", "pytest_ppsmoke.runtime.member"]), env)
            )
        started = time.monotonic()
        for p in self.members:
            await p.start()
        readies = [await p.wait_event(lambda e: e.kind is EventKind.READY, 60, "ready") for p in self.members]
        joined = time.monotonic()
        seed = self.seed
        await seed.membership.wait_until(lambda: len(seed.membership.alive()) == 3, 60, "3 alive at the seed")
        deadline = time.monotonic() + 60
        while not all(len(alive_seen(p)) >= 2 for p in self.members):
            if time.monotonic() > deadline:
                raise TimeoutError("the members' views did not reach 3 alive in 60 s")
            await asyncio.sleep(0.005)
        return {
            "join_s": [round(r["joined_in_s"], 4) for r in readies],
            "start_to_joined_s": round(joined - started, 3),
            "converge_after_join_s": round(time.monotonic() - joined, 4),
        }

    def false_events(self, exclude: str | None = None) -> dict[str, int]:
        """Suspicions and deaths, at any observer, about members that were alive (``exclude``: the
        killed one)."""
        kinds = [e.kind for _, e in self.seed_events if e.member.id != exclude]
        for p in self.members:
            kinds += [e.name for e in p.events if e.get("member") not in (None, exclude)]
        return {"dead": kinds.count("dead"), "suspect": kinds.count("suspect")}

    async def close(self) -> None:
        for p in self.members:
            with contextlib.suppress(Exception):
                await p.stop(grace=2.0)
        if self.seed is not None:
            await self.seed.close()


async def detect_one(profile: str, seed: int) -> dict[str, Any]:
    cfg = swim_for(profile)
    async with EmulatedNetwork(parse_network(profile), seed=seed) as net:
        c = Cluster(net, cfg)
        try:
            out = await c.start()
            victim = c.keys.ids[2]
            killed = time.monotonic()
            c.members[1].signal(signal.SIGKILL)
            seed_node = c.seed
            assert seed_node is not None

            def seed_dead() -> bool:
                return any(e.kind == "dead" and e.member.id == victim for _, e in c.seed_events)

            await seed_node.membership.wait_until(seed_dead, 120, "the killed member dead at the seed")
            at_seed = next(t for t, e in c.seed_events if e.kind == "dead" and e.member.id == victim)
            out["detect_seed_s"] = round(at_seed - killed, 3)
            ev = await c.members[0].wait_event(
                lambda e: e.kind is EventKind.DEAD and e.get("member") == victim, 120, "the killed member dead at m1"
            )
            out["detect_member_s"] = round(time.monotonic() - killed, 3) if ev else None  # an upper bound: seen now
            out["false_total"] = c.false_events(exclude=victim)
            out["seed_stats"] = asdict(seed_node.membership.stats())
            return out
        finally:
            await c.close()


async def detect(profiles: list[str], rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for prof in profiles:
        cfg = swim_for(prof)
        runs = []
        for r in range(rounds):
            res = await detect_one(prof, r + 1)
            print(f"{prof} round {r}: {json.dumps(res)}", flush=True)
            runs.append(res)
        out[prof] = {
            "profile": (parse_network(prof).default.describe() if parse_network(prof).default else "127.0.0.1"),
            "swim": asdict(cfg),
            "bound_confirmed_s": round(cfg.detection_bound(3, True), 2),
            "bound_lone_s": round(cfg.detection_bound(3, False), 2),
            "join_s_median": round(statistics.median(j for r in runs for j in r["join_s"]), 4),
            "converge_s_median": round(statistics.median(r["converge_after_join_s"] for r in runs), 4),
            "detect_seed_s": [r["detect_seed_s"] for r in runs],
            "detect_member_s": [r["detect_member_s"] for r in runs],
            "false_dead": sum(r["false_total"]["dead"] for r in runs),
            "false_suspect": sum(r["false_total"]["suspect"] for r in runs),
            "runs": runs,
        }
    return out


async def false_deaths(load: str, runs: int, hold: float, busy: int) -> dict[str, Any]:
    profile = "flaky" if load == "flaky" else "loopback"
    cfg = swim_for(profile)
    spinners: list[asyncio.subprocess.Process] = []
    if load == "busy":
        for _ in range(busy):
            spinners.append(await spin())
    results = []
    try:
        for r in range(runs):
            async with EmulatedNetwork(parse_network(profile), seed=100 + r) as net:
                c = Cluster(net, cfg)
                try:
                    formed = await c.start()
                    await asyncio.sleep(hold)
                    seed_node = c.seed
                    assert seed_node is not None
                    res = {
                        **formed,
                        **c.false_events(),
                        "seed_stats": asdict(seed_node.membership.stats()),
                        "alive_at_end": len(seed_node.membership.alive()),
                    }
                finally:
                    await c.close()
            print(f"{load} run {r}: {json.dumps(res)}", flush=True)
            results.append(res)
    finally:
        for s in spinners:
            s.kill()
            await s.wait()
    return {
        "load": load,
        "profile": profile,
        "busy_loops": busy if load == "busy" else 0,
        "hold_s": hold,
        "swim": asdict(cfg),
        "runs": len(results),
        "false_dead": sum(r["dead"] for r in results),
        "runs_with_false_dead": sum(1 for r in results if r["dead"]),
        "suspect": sum(r["suspect"] for r in results),
        "seed_max_awareness": max(r["seed_stats"]["awareness"] for r in results),
        "seed_refuted_about_me": sum(r["seed_stats"]["refuted_about_me"] for r in results),
        "seed_suspicions_refuted": sum(r["seed_stats"]["suspicions_refuted"] for r in results),
        "converge_s_median": round(statistics.median(r["converge_after_join_s"] for r in results), 4),
        "per_run": results,
    }


async def busy_smoke(runs: int, busy: int, max_tokens: int) -> dict[str, Any]:
    """``pp-smoke-run --local`` (SmolLM2, reference off) ``runs`` times under ``busy`` spinning
    processes: the whole stack, tinygrad workers included, on starved cores. A false death fails
    the run (a stage declared dead at load or decode)."""
    spinners = [await spin() for _ in range(busy)]
    results: list[dict[str, Any]] = []
    try:
        for r in range(runs):
            report = Path(f"/tmp/pps-busy-smoke-{os.getpid()}.json")
            cmd = ["pp-smoke-run", "--local", "--reference", "off", "--max-tokens", str(max_tokens)]
            started = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                *cmd, "--report", str(report), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
            )
            rc = await asyncio.wait_for(proc.wait(), 600)
            rep = json.loads(await asyncio.to_thread(report.read_text))
            await asyncio.to_thread(report.unlink)
            res = {
                "rc": rc,
                "ok": rep["ok"],
                "error": rep["error"],
                "wall_s": round(time.monotonic() - started, 2),
                "timings": rep["timings"],
            }
            print(f"busy smoke run {r}: {json.dumps(res)}", flush=True)
            results.append(res)
    finally:
        for sp in spinners:
            sp.kill()
            await sp.wait()
    return {
        "busy_loops": busy,
        "max_tokens": max_tokens,
        "runs": len(results),
        "failed": sum(1 for r in results if not r["ok"]),
        "errors": [r["error"] for r in results if r["error"]],
        "per_run": results,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("detect")
    d.add_argument("--profiles", default="loopback,lan,wan,far,slow,flaky")
    d.add_argument("--rounds", type=int, default=1)
    d.add_argument("--out", type=Path, default=HERE / "results" / "swim_network.json")
    f = sub.add_parser("false-deaths")
    f.add_argument("--load", choices=("busy", "flaky"), default="busy")
    f.add_argument("--runs", type=int, default=5)
    f.add_argument("--hold", type=float, default=8.0, help="seconds each formed cluster is watched")
    f.add_argument("--busy", type=int, default=4, help="spinning processes (busy load)")
    f.add_argument("--out", type=Path)
    b = sub.add_parser("busy-smoke")
    b.add_argument("--runs", type=int, default=2)
    b.add_argument("--busy", type=int, default=4)
    b.add_argument("--max-tokens", type=int, default=16)
    b.add_argument("--out", type=Path, default=HERE / "results" / "busy_smoke.json")
    args = ap.parse_args()
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()}
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if args.cmd == "detect":
        res: dict[str, Any] = {"machine": machine, "measured_at": started, "rounds": args.rounds}
        res["profiles"] = asyncio.run(detect([p.strip() for p in args.profiles.split(",")], args.rounds))
        summary = {p: {k: v for k, v in r.items() if k not in ("runs", "swim")} for p, r in res["profiles"].items()}
    elif args.cmd == "busy-smoke":
        res = {
            "machine": machine,
            "measured_at": started,
            **asyncio.run(busy_smoke(args.runs, args.busy, args.max_tokens)),
        }
        summary = {k: v for k, v in res.items() if k != "per_run"}
    else:
        res = {
            "machine": machine,
            "measured_at": started,
            **asyncio.run(false_deaths(args.load, args.runs, args.hold, args.busy)),
        }
        summary = {k: v for k, v in res.items() if k != "per_run"}
        args.out = args.out or HERE / "results" / f"false_deaths_{args.load}.json"
    print(json.dumps(summary, indent=2))
    args.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Transport benchmark: our iroh transport against raw asyncio TCP on loopback, in one run.

    python bench/bench_transport.py [--out bench/results/transport.json] [--quick]

Every carrier runs as two processes (an echo server and a client), one carrier at a time:
- ``tcp``: raw asyncio TCP, length-prefixed frames: the baseline;
- ``iroh-stock``: the iroh binding as shipped, one bi stream, the same framing;
- ``iroh-patched``: the same with our memmove fix (pytest_ppsmoke/runtime/_irohpatch.py);
- ``ppsmoke``: our full stack: Node.request / Node.send with codec frames, envelopes and dispatch.

It also measures SWIM: how long a seed and two member processes take to converge, and how long a
SIGKILLed member takes to be declared dead. Results go to stdout and ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchio import emit  # bench/ is this script's directory: first on sys.path

HERE = Path(__file__).resolve().parent
SMALL, BIG = 4096, 4 << 20


def summarise(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "median_us": round(statistics.median(s) * 1e6, 1),
        "p10_us": round(s[len(s) // 10] * 1e6, 1),
        "p99_us": round(s[int(len(s) * 0.99)] * 1e6, 1),
        "n": len(s),
    }


# --- clients (each runs in its own process) ------------------------------------------------------


async def client_tcp(port: str, n_small: int, n_big: int) -> dict[str, Any]:
    r, w = await asyncio.open_connection("127.0.0.1", int(port))

    async def rt(frame: bytes, reply: int) -> None:
        w.write(frame)
        await w.drain()
        await r.readexactly(reply)

    return await _measure(rt, n_small, n_big)


async def client_iroh(ticket: str, n_small: int, n_big: int, stock: bool) -> dict[str, Any]:
    import iroh
    from echo_peers import ALPN, loopback_endpoint_options

    ep = await iroh.Endpoint.bind(loopback_endpoint_options(stock))
    conn = await ep.connect(iroh.EndpointTicket.from_string(ticket).endpoint_addr(), ALPN)
    bi = await conn.open_bi()
    send, recv = bi.send(), bi.recv()

    async def rt(frame: bytes, reply: int) -> None:
        await send.write_all(frame)
        got = 0
        while got < reply:
            got += len(await recv.read(reply - got))

    res = await _measure(rt, n_small, n_big)
    # Where a round trip's time goes: size-independent latency, the cost of one async call into
    # the binding, and of one write_all.
    tiny = struct.pack(">I", 60) + os.urandom(60)
    samples, writes = [], []
    for _ in range(n_small):
        t = time.perf_counter()
        await rt(tiny, len(tiny))
        samples.append(time.perf_counter() - t)
    small = struct.pack(">I", SMALL) + os.urandom(SMALL)
    for _ in range(n_small // 3):
        t = time.perf_counter()
        await send.write_all(small)
        writes.append(time.perf_counter() - t)
        got = 0
        while got < len(small):
            got += len(await recv.read(len(small) - got))
    t = time.perf_counter()
    for _ in range(n_small):
        await recv.bytes_read()  # resolves at once on the Rust side: pure call overhead
    res["profile"] = {
        "rt_64b": summarise(samples),
        "write_all_4k": summarise(writes),
        "bare_async_call_us": round((time.perf_counter() - t) / n_small * 1e6, 1),
    }
    conn.close(0, b"done")
    await ep.close()
    return res


async def _measure(rt: Any, n_small: int, n_big: int) -> dict[str, Any]:
    small = struct.pack(">I", SMALL) + os.urandom(SMALL)
    big = struct.pack(">I", BIG) + os.urandom(BIG)
    for _ in range(50):
        await rt(small, len(small))
    samples = []
    for _ in range(n_small):
        t = time.perf_counter()
        await rt(small, len(small))
        samples.append(time.perf_counter() - t)
    await rt(big, 4)
    t = time.perf_counter()
    for _ in range(n_big):
        await rt(big, 4)  # 4 MiB out, a 4-byte ack back
    dt = time.perf_counter() - t
    return {"rt_4k": summarise(samples), "oneway_4m_MBps": round(n_big * BIG / dt / 1e6, 1)}


async def client_ppsmoke(env_json: str, n_small: int, n_big: int) -> dict[str, Any]:
    from pytest_ppsmoke.runtime.codec import Echo
    from pytest_ppsmoke.runtime.node import NODE_ACTOR, Node, NodeConfig

    spec = json.loads(env_json)
    node = Node(NodeConfig(secret_key=bytes.fromhex(spec["key"]), allowed=frozenset(spec["allowed"])))
    await node.start()
    node.transport.learn(
        __import__("pytest_ppsmoke.runtime.transport").runtime.transport.PeerAddr.parse(spec["ticket"])
    )
    to = node.address(NODE_ACTOR, spec["id"])
    small, big = Echo(os.urandom(SMALL)), Echo(os.urandom(BIG))
    for _ in range(50):
        await node.request(to, small, 5)
    samples = []
    for _ in range(n_small):
        t = time.perf_counter()
        await node.request(to, small, 5)
        samples.append(time.perf_counter() - t)
    await node.send(to, big, timeout=30)
    await node.request(to, Echo(b""), 30)
    t = time.perf_counter()
    for _ in range(n_big):
        await node.send(to, big, timeout=30)  # one-way: the echo actor's answer is dropped
    await node.request(to, Echo(b""), 30)  # in order on the stream: all big frames were handled
    dt = time.perf_counter() - t
    await node.close()
    return {"rt_4k": summarise(samples), "oneway_4m_MBps": round(n_big * BIG / dt / 1e6, 1)}


# --- driver ------------------------------------------------------------------------------------


def spawn(argv: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def run_client(args: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--client", *args], capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"client {args[0]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def stop(proc: subprocess.Popen[str]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def carriers(n_small: int, n_big: int, rounds: int) -> dict[str, Any]:
    """Every carrier's client runs once per round, the carriers interleaved, against servers that
    stay up: drift on a shared machine then hits all carriers alike, and ratios are paired per round."""
    from pytest_ppsmoke.runtime.localproc import ClusterKeys, member_env

    counts = [str(n_small), str(n_big)]
    servers: list[subprocess.Popen[str]] = []
    targets: dict[str, str] = {}
    try:
        proc, targets["tcp"] = spawn([sys.executable, str(HERE / "echo_peers.py"), "tcp"])
        servers.append(proc)
        for name, extra in (("iroh-stock", ["--stock"]), ("iroh-patched", [])):
            proc, targets[name] = spawn([sys.executable, str(HERE / "echo_peers.py"), "iroh", *extra])
            servers.append(proc)
        keys = ClusterKeys(2)
        proc, line = spawn(
            [sys.executable, "-m", "pytest_ppsmoke.runtime.member"], member_env(keys.keys[0], keys.ids, None, [], "")
        )
        servers.append(proc)
        ready = json.loads(line)
        spec = {"key": keys.keys[1].hex(), "allowed": keys.ids, "ticket": ready["ticket"], "id": ready["id"]}
        targets["ppsmoke"] = json.dumps(spec)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
        for _ in range(rounds):
            for name, target in targets.items():
                runs[name].append(run_client([name, target, *counts]))
    finally:
        for proc in servers:
            stop(proc)
    return runs


def aggregate(runs: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, Any]]:
    med = statistics.median
    carriers_out: dict[str, Any] = {}
    for name, rs in runs.items():
        carriers_out[name] = {
            "rt_4k_median_us": round(med(r["rt_4k"]["median_us"] for r in rs), 1),
            "rt_4k_p99_us": round(med(r["rt_4k"]["p99_us"] for r in rs), 1),
            "oneway_4m_MBps": round(med(r["oneway_4m_MBps"] for r in rs), 1),
            "rounds": rs,
        }
        if "profile" in rs[0]:
            carriers_out[name]["profile"] = {
                "rt_64b_median_us": round(med(r["profile"]["rt_64b"]["median_us"] for r in rs), 1),
                "write_all_4k_median_us": round(med(r["profile"]["write_all_4k"]["median_us"] for r in rs), 1),
                "bare_async_call_us": round(med(r["profile"]["bare_async_call_us"] for r in rs), 1),
            }
    tcp = runs["tcp"]

    def paired(rs: list[dict[str, Any]], get: Any) -> float:  # per round, then the median over rounds
        return float(med(get(r) / get(t) for r, t in zip(rs, tcp, strict=True)))

    ratios = {
        name: {
            "rt_4k_vs_tcp": round(paired(rs, lambda x: x["rt_4k"]["median_us"]), 2),
            "oneway_4m_vs_tcp": round(paired(rs, lambda x: x["oneway_4m_MBps"]), 3),
        }
        for name, rs in runs.items()
        if name != "tcp"
    }
    return carriers_out, ratios


async def swim_timings(rounds: int) -> dict[str, Any]:
    from pytest_ppsmoke.runtime.localproc import ClusterKeys, EventKind, member_env, member_process
    from pytest_ppsmoke.runtime.node import Node, NodeConfig

    converge, detect, join = [], [], []
    for _ in range(rounds):
        keys = ClusterKeys(3)
        seed = Node(NodeConfig(secret_key=keys.keys[0], allowed=frozenset(keys.ids)))
        await seed.start()
        dead_at: dict[str, float] = {}
        seed.membership.add_listener(
            lambda e, d=dead_at: e.kind == "dead" and d.setdefault(e.member.id, time.monotonic())
        )
        members = [member_process(f"m{i}", member_env(keys.keys[i], keys.ids, seed.ticket(), [], "")) for i in (1, 2)]
        try:
            for m in members:
                await m.start()
            readies = [await m.wait_event(lambda e: e.kind is EventKind.READY, 30, "ready") for m in members]
            join += [r["joined_in_s"] for r in readies]
            t = time.monotonic()  # both members are up and joined the seed: now until all agree
            await seed.membership.wait_until(lambda s=seed: len(s.membership.alive()) == 3, 10, "3 alive")
            for m in members:
                await m.wait_event(lambda e, m=m: _alive_count(m) >= 2, 10, "views")
            converge.append(time.monotonic() - t)
            killed = time.monotonic()
            members[1].signal(signal.SIGKILL)
            await seed.membership.wait_until(lambda k=keys, d=dead_at: k.ids[2] in d, 30, "dead")
            detect.append(dead_at[keys.ids[2]] - killed)
        finally:
            for m in members:
                await m.stop()
            await seed.close()
    cfg = NodeConfig.generate().swim
    return {
        "join_s": {"median": round(statistics.median(join), 4), "max": round(max(join), 4)},
        "converge_after_join_s": {"median": round(statistics.median(converge), 4), "max": round(max(converge), 4)},
        "detect_killed_s": {"median": round(statistics.median(detect), 3), "max": round(max(detect), 3)},
        "config": {"protocol_period": cfg.protocol_period, "suspicion_timeout": cfg.suspicion_timeout},
        "rounds": rounds,
    }


def _alive_count(m: Any) -> int:
    from pytest_ppsmoke.runtime.localproc import EventKind

    alive: set[str] = set()
    for e in m.events:
        if e.kind in (EventKind.JOINED, EventKind.ALIVE):
            alive.add(e["member"])
        elif e.kind is EventKind.DEAD:
            alive.discard(e["member"])
    return len(alive)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path)
    p.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    p.add_argument("--client", nargs="+", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.client:
        kind, target, n_small, n_big = a.client[0], a.client[1], int(a.client[2]), int(a.client[3])
        if kind == "tcp":
            res = asyncio.run(client_tcp(target, n_small, n_big))
        elif kind == "ppsmoke":
            res = asyncio.run(client_ppsmoke(target, n_small, n_big))
        else:
            res = asyncio.run(client_iroh(target, n_small, n_big, stock=kind == "iroh-stock"))
        print(json.dumps(res))
        return
    n_small, n_big, rounds = (300, 5, 2) if a.quick else (2000, 20, 3)
    res, ratios = aggregate(carriers(n_small, n_big, rounds))
    report = {
        "bench": "transport",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "carriers": res,
        "ratios": ratios,
        "goal": {"rt_4k_vs_tcp_at_most": 4.0, "oneway_4m_vs_tcp_at_least": 0.5},
        "swim": asyncio.run(swim_timings(2 if a.quick else 5)),
    }
    emit(report, a.out)


if __name__ == "__main__":
    main()

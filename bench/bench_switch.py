"""The delay switch's cost: its CPU time per packet and the delay it adds on top of a profile's.

    python bench/bench_switch.py [--out bench/results/switch.json] [--quick]

Round trips between the root namespace (the host) and a UDP / iroh echo peer, in three settings:
- ``loopback``: the peer on 127.0.0.1 in the root namespace, no switch: the baseline;
- ``switch-0``: the peer in a member namespace, links with no delay: the switch's own floor;
- ``lan``: the same with the ``lan`` profile (0.2 ms one way).
For each: RTT percentiles for a 64-byte datagram (a QUIC ack's size) and a 1400-byte one (an
activation's packets), the one-way time the switch adds over loopback ((RTT - loopback RTT) / 2),
iroh frame round trips (2 KB, decode's activation), and the switch's CPU seconds per packet
(/proc utime+stime over a flood of datagrams). Needs root; results go to stdout and ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

SELF = Path(__file__).resolve()
HERE = SELF.parent
sys.path.insert(0, str(HERE.parent))

from pytest_ppsmoke.network import EmulatedNetwork, LinkProfile, NetworkSpec, parse_network  # noqa: E402
from pytest_ppsmoke.runtime import codec  # noqa: E402
from pytest_ppsmoke.runtime.codec import Echo, Envelope, Message  # noqa: E402
from pytest_ppsmoke.runtime.localproc import ChildProcess, emit, stop_on_stdin_eof  # noqa: E402
from pytest_ppsmoke.runtime.transport import PeerAddr, Transport, new_secret_key  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")


def summarise(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "median_ms": round(statistics.median(s) * 1e3, 4),
        "p10_ms": round(s[len(s) // 10] * 1e3, 4),
        "p99_ms": round(s[int(len(s) * 0.99)] * 1e3, 4),
        "n": len(s),
    }


# --- the peer (runs in the member's namespace, or on loopback) ------------------------------------


async def peer(addr: str, host_ticket: str) -> None:
    loop = asyncio.get_running_loop()

    class Echoer(asyncio.DatagramProtocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.t = transport

        def datagram_received(self, data: bytes, src: tuple[str, int]) -> None:
            self.t.sendto(data, src)  # type: ignore[attr-defined]

    udp, _ = await loop.create_datagram_endpoint(Echoer, local_addr=(addr, 0))
    host = PeerAddr.parse(host_ticket)
    tasks: set[asyncio.Task[None]] = set()

    def on_message(src: str, env: Envelope, msg: Message) -> None:
        if isinstance(msg, Echo):
            reply = codec.encode_frame(Envelope(env.from_actor, env.to_actor, env.corr, True), msg)
            task = asyncio.ensure_future(t.send_frame(src, reply, 5.0))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    t = Transport(new_secret_key(), on_message=on_message, allowed=[host.id], local=True, bind_addr=f"{addr}:0")
    await t.start()
    t.learn(host)
    emit({"port": udp.get_extra_info("sockname")[1], "id": t.id, "addrs": list(t.addr().addrs)})
    await stop_on_stdin_eof(asyncio.Event())
    await t.close()
    udp.close()


# --- the host side ---------------------------------------------------------------------------------


def udp_rtts(host: str, dst: tuple[str, int], size: int, n: int) -> list[float]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((host, 0))
        s.settimeout(2.0)
        payload = b"x" * size
        out = []
        for _ in range(n + 20):
            t0 = time.perf_counter()
            s.sendto(payload, dst)
            try:
                s.recv(size + 64)
            except TimeoutError:  # lost (a lossy profile): no sample
                continue
            out.append(time.perf_counter() - t0)
        return out[20:]  # the first ones warm caches and ARP-free paths alike


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def flood(host: str, dst: tuple[str, int], size: int, n: int) -> int:
    """Send ``n`` datagrams in windows of 32 (the echo comes back: 2n packets through the switch)."""
    got = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((host, 0))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        s.settimeout(0.5)
        payload = b"y" * size
        for i in range(0, n, 32):
            for _ in range(min(32, n - i)):
                s.sendto(payload, dst)
            try:
                for _ in range(min(32, n - i)):
                    s.recv(size + 64)
                    got += 1
            except TimeoutError:
                pass
    return got


async def measure(setting: str, n: int) -> dict[str, Any]:
    got: asyncio.Queue[bytes] = asyncio.Queue()

    def on_message(src: str, env: Envelope, msg: Message) -> None:
        if isinstance(msg, Echo):
            got.put_nowait(msg.payload)

    spec = NetworkSpec("switch-0", LinkProfile()) if setting == "switch-0" else parse_network(setting)
    async with EmulatedNetwork(spec, seed=1) as net:
        m = await net.add_member("0")
        host = Transport(new_secret_key(), on_message=on_message, local=True, bind_addr=f"{net.host_addr}:0")
        await host.start()
        argv = m.wrap([sys.executable, str(SELF), "peer", m.addr, host.ticket()])
        p = ChildProcess("peer", argv, os.environ)
        await p.start()
        try:
            ev = await p.wait_event(lambda e: "port" in e, 20, "the peer")
            dst = (m.addr, int(ev["port"]))
            out: dict[str, Any] = {"setting": setting, "profile": spec.default.describe() if spec.default else None}
            for size in (64, 1400):
                out[f"udp_{size}B"] = summarise(await asyncio.to_thread(udp_rtts, net.host_addr, dst, size, n))
            host.learn(PeerAddr(ev["id"], tuple(ev["addrs"])))
            rtts = []
            for i in range(n // 2 + 10):
                frame = codec.encode_frame(Envelope("a", "b", i + 1, False), Echo(os.urandom(2048)))
                t0 = time.perf_counter()
                await host.send_frame(ev["id"], frame, 10)
                await asyncio.wait_for(got.get(), 10)
                rtts.append(time.perf_counter() - t0)
            out["iroh_echo_2KB"] = summarise(rtts[10:])
            if net._switch is not None:
                pid = net._switch.pid
                before, t0 = cpu_seconds(pid), time.perf_counter()
                flood_n = n * 10
                echoed = await asyncio.to_thread(flood, net.host_addr, dst, 1400, flood_n)
                wall = time.perf_counter() - t0
                packets = flood_n + echoed
                used = cpu_seconds(pid) - before
                out["flood_1400B"] = {
                    "packets": packets,
                    "switch_cpu_s": round(used, 3),
                    "switch_us_per_packet": round(used / packets * 1e6, 2),
                    "packets_per_s": round(packets / wall),
                }
                out["switch_stats"] = await net.stats()
            return out
        finally:
            await p.stop(grace=1.0)
            await host.close()


async def run(quick: bool) -> dict[str, Any]:
    n = 200 if quick else 1000
    results = [await measure(s, n) for s in ("loopback", "switch-0", "lan")]
    base = {k: results[0][k]["median_ms"] for k in ("udp_64B", "udp_1400B", "iroh_echo_2KB")}
    for r in results[1:]:
        r["added_one_way_ms"] = {k: round((r[k]["median_ms"] - v) / 2, 4) for k, v in base.items()}
    return {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()},
        "n": n,
        "results": results,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "peer":
        asyncio.run(peer(sys.argv[2], sys.argv[3]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "results" / "switch.json"))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    res = asyncio.run(run(args.quick))
    text = json.dumps(res, indent=2)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

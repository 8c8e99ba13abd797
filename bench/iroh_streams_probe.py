"""Probe: does spreading a 4 MiB transfer over several QUIC streams or connections help?

    python bench/iroh_streams_probe.py [--out FILE]

Runs an iroh receiver and sender as two processes (patched binding) for (streams, connections)
in (1, 1), (4, 1), (4, 4) and prints the throughput and the sender's CPU use as JSON. It answers
whether one-way throughput is bound by a single stream's flow control or by CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import iroh

from pytest_ppsmoke.runtime import _irohpatch
from pytest_ppsmoke.runtime.transport import endpoint_options

ALPN = b"ppsmoke-probe/1"
TOTAL = 4 << 20
ROUNDS = 20


def opts() -> iroh.EndpointOptions:
    return endpoint_options(os.urandom(32), local=True, bind_addr="127.0.0.1:0", alpn=ALPN)


async def receiver(k: int, conns: int) -> None:
    ep = await iroh.Endpoint.bind(opts())
    print(str(iroh.EndpointTicket.from_addr(ep.addr())), flush=True)
    accepted = [await (await (await ep.accept_next()).accept()).connect() for _ in range(conns)]
    bi = await accepted[0].accept_bi()
    ack, ctl = bi.send(), bi.recv()
    await ctl.read(1)
    streams = [await accepted[j % conns].accept_uni() for j in range(k)]

    async def drain(st: iroh.RecvStream, n: int) -> None:
        got = 0
        while got < n:
            got += len(await st.read(n - got))

    while True:
        await asyncio.gather(*(drain(st, TOTAL // k) for st in streams))
        await ack.write_all(b"k")


async def sender(ticket: str, k: int, conns: int) -> dict[str, float]:
    addr = iroh.EndpointTicket.from_string(ticket).endpoint_addr()
    eps = [await iroh.Endpoint.bind(opts()) for _ in range(conns)]
    cs = [await e.connect(addr, ALPN) for e in eps]
    bi = await cs[0].open_bi()
    ctl, ack = bi.send(), bi.recv()
    await ctl.write_all(b"x")
    streams = []
    for j in range(k):
        st = await cs[j % conns].open_uni()
        streams.append(st)
    part = os.urandom(TOTAL // k)

    async def one() -> None:
        await asyncio.gather(*(s.write_all(part) for s in streams))
        await ack.read(1)

    await one()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(ROUNDS):
        await one()
    dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return {
        "streams": k,
        "connections": conns,
        "MBps": round(ROUNDS * TOTAL / dt / 1e6, 1),
        "sender_cpu": round(cpu / dt, 2),
    }


def main() -> None:
    _irohpatch.apply()
    if len(sys.argv) > 1 and sys.argv[1] in ("--receiver", "--sender"):
        k, conns = int(sys.argv[-2]), int(sys.argv[-1])
        if sys.argv[1] == "--receiver":
            asyncio.run(receiver(k, conns))
        else:
            print(json.dumps(asyncio.run(sender(sys.argv[2], k, conns))))
        return
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    results = []
    for k, conns in ((1, 1), (4, 1), (4, 4)):
        rx = subprocess.Popen(
            [sys.executable, __file__, "--receiver", str(k), str(conns)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert rx.stdout is not None
            ticket = rx.stdout.readline().strip()
            out = subprocess.run(
                [sys.executable, __file__, "--sender", ticket, str(k), str(conns)],
                capture_output=True,
                text=True,
                timeout=120,
                check=True,
            )
            results.append(json.loads(out.stdout))
        finally:
            rx.kill()
            rx.wait()
    text = json.dumps({"bench": "iroh_streams_probe", "results": results}, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

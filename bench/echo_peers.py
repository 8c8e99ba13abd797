"""Echo servers for the transport benchmark, each run as its own process.

    python bench/echo_peers.py tcp            -> prints the port
    python bench/echo_peers.py iroh [--stock] -> prints the endpoint ticket

Both echo length-prefixed frames (4-byte big-endian length + payload) on one long-lived stream,
the same framing our transport uses, so the comparison is of the carriers, not of the framing.
"""

from __future__ import annotations

import asyncio
import os
import struct
import sys
from typing import Any

ALPN = b"ppsmoke-bench/1"


async def tcp() -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                header = await r.readexactly(4)
                (n,) = struct.unpack(">I", header)
                payload = await r.readexactly(n)
                w.write(header + payload if n <= 65536 else struct.pack(">I", 0))
                await w.drain()
        except asyncio.IncompleteReadError:
            w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


def loopback_endpoint_options(stock: bool) -> Any:
    """Options for a loopback endpoint with no relays; applies our binding fix unless ``stock``.

    The stock carrier must not import pytest_ppsmoke.runtime.transport, which patches at import."""
    import iroh

    if not stock:
        from pytest_ppsmoke.runtime import _irohpatch

        _irohpatch.apply()
    return iroh.EndpointOptions(
        preset=iroh.preset_minimal(),
        relay_mode=iroh.RelayMode.disabled(),
        bind_addr="127.0.0.1:0",
        secret_key=os.urandom(32),
        alpns=[ALPN],
    )


async def iroh_echo(stock: bool) -> None:
    import iroh

    ep = await iroh.Endpoint.bind(loopback_endpoint_options(stock))
    print(str(iroh.EndpointTicket.from_addr(ep.addr())), flush=True)

    async def serve(incoming: iroh.Incoming) -> None:
        conn = await (await incoming.accept()).connect()
        bi = await conn.accept_bi()
        recv, send = bi.recv(), bi.send()
        buf = bytearray()
        while True:
            want = max(65536, struct.unpack(">I", buf[:4])[0] + 4 - len(buf)) if len(buf) >= 4 else 65536
            try:
                chunk = await recv.read(want)
            except iroh.IrohError:
                return
            if not chunk:
                return
            buf += chunk
            while len(buf) >= 4 and len(buf) >= 4 + (n := struct.unpack(">I", buf[:4])[0]):
                frame = bytes(buf[: 4 + n])
                del buf[: 4 + n]
                await send.write_all(frame if n <= 65536 else struct.pack(">I", 0))

    tasks = set()
    while True:  # one task per client: an old client's connection may linger until its idle timeout
        incoming = await ep.accept_next()
        if incoming is None:
            return
        task = asyncio.ensure_future(serve(incoming))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


if __name__ == "__main__":
    kind = sys.argv[1]
    asyncio.run(tcp() if kind == "tcp" else iroh_echo("--stock" in sys.argv))

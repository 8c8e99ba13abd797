"""Peers for tests/test_network.py, each run inside a member's namespace (``member.wrap``).

    python -m tests.netpeer udp-echo ADDR                     -> {"port": P}; echoes datagrams
    python -m tests.netpeer udp-ping ADDR PORT N              -> {"rtts": [...]}: N sequential pings, 2 s each
    python -m tests.netpeer iroh-echo ADDR PEER_TICKET        -> {"id", "addrs"}; echoes Echo frames to PEER

Each serves until its stdin closes (its parent is gone) and prints JSON lines on stdout.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time

from pytest_ppsmoke.runtime import codec
from pytest_ppsmoke.runtime.codec import Echo, Envelope, Message
from pytest_ppsmoke.runtime.localproc import emit, stop_on_stdin_eof
from pytest_ppsmoke.runtime.transport import PeerAddr, Transport, new_secret_key


async def udp_echo(addr: str) -> None:
    loop = asyncio.get_running_loop()

    class Echoer(asyncio.DatagramProtocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.t = transport

        def datagram_received(self, data: bytes, src: tuple[str, int]) -> None:
            self.t.sendto(data, src)  # type: ignore[attr-defined]

    t, _ = await loop.create_datagram_endpoint(Echoer, local_addr=(addr, 0))
    emit({"port": t.get_extra_info("sockname")[1]})
    await stop_on_stdin_eof(asyncio.Event())
    t.close()


def pings(sock: socket.socket, dst: tuple[str, int], n: int) -> list[float | None]:
    """``n`` sequential datagrams to an echo, each waited for: its round trip, or None when lost."""
    rtts: list[float | None] = []
    for i in range(n):
        t0 = time.monotonic()
        sock.sendto(str(i).encode(), dst)
        try:
            while sock.recv(64) != str(i).encode():
                pass
            rtts.append(time.monotonic() - t0)
        except TimeoutError:
            rtts.append(None)
    return rtts


def udp_ping(addr: str, port: int, n: int) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2.0)
    emit({"rtts": pings(s, (addr, port), n)})


async def iroh_echo(addr: str, peer_ticket: str) -> None:
    peer = PeerAddr.parse(peer_ticket)
    tasks: set[asyncio.Task[None]] = set()

    def on_message(src: str, env: Envelope, msg: Message) -> None:
        if isinstance(msg, Echo):
            reply = codec.encode_frame(Envelope(env.from_actor, env.to_actor, env.corr, True), msg)
            task = asyncio.ensure_future(t.send_frame(src, reply, 5.0))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    t = Transport(new_secret_key(), on_message=on_message, allowed=[peer.id], local=True, bind_addr=f"{addr}:0")
    await t.start()
    t.learn(peer)
    emit({"id": t.id, "addrs": list(t.addr().addrs)})
    await stop_on_stdin_eof(asyncio.Event())
    await t.close()


def main() -> None:
    mode, *args = sys.argv[1:]
    if mode == "udp-echo":
        asyncio.run(udp_echo(args[0]))
    elif mode == "udp-ping":
        udp_ping(args[0], int(args[1]), int(args[2]))
    elif mode == "iroh-echo":
        asyncio.run(iroh_echo(args[0], args[1]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()

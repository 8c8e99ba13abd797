"""Framed messaging over iroh (QUIC).

A node sends to a peer on one unidirectional stream (frames back to back), opened on a live
connection with that peer: the one the peer dialled to it, if there is one, else one it dials
itself. So a peer behind a NAT, which can dial out but never be dialled, is answered on the
connection it made (the orchestrator behind a home router is never dialled). A node receives on
every connection, dialled or accepted. One stream per peer keeps the order of its frames; two
peers that dial each other at once each send on the connection they chose, which needs no
tie-breaking; a broken connection is replaced by dialling again.

Security: a node knows the endpoint ids it will talk to (the orchestrator derives them from the
secret keys it generates). A connection from any other id is closed right after the TLS handshake
authenticates it, before a single frame is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import iroh

from . import _irohpatch, codec
from .codec import Envelope, FrameError, FrameReader, Message, UnknownMessageType
from .peeraddr import PeerAddr as PeerAddr  # re-exported: the transport's callers name addresses through it
from .peeraddr import endpoint_id as endpoint_id
from .peeraddr import new_secret_key as new_secret_key

_irohpatch.apply()

log = logging.getLogger(__name__)

ALPN = b"ppsmoke/1"
CLOSE_REFUSED = 1  # application close codes, seen by the peer in its close reason
CLOSE_BAD_FRAME = 2
CLOSE_SHUTDOWN = 0
_READ_SIZE = 64 << 10
# how long a closing endpoint waits for its peers to acknowledge the close of their connections: a
# round trip over the internet; a peer that has not by then is gone (a destroyed instance, whose
# node closed first or was killed), and iroh would wait out the connection's timeouts for it
CLOSE_WAIT = 0.5


class TransportError(ConnectionError):
    """Sending to a peer failed; the message names the peer and the step."""


RELAY_OFF = "off"


def relay_mode(relay: str | None) -> iroh.RelayMode:
    """The relays of an endpoint in internet mode: n0's (None or ""), none (``off``), or a
    dedicated relay's URL (``https://relay.example.com``)."""
    if not relay:
        return iroh.RelayMode.default_mode()
    if relay == RELAY_OFF:
        return iroh.RelayMode.disabled()
    if not relay.startswith(("http://", "https://")):
        raise ValueError(f"relay {relay!r}: expected 'off' or a relay's URL (https://...)")
    return iroh.RelayMode.custom_from_urls([relay])


def endpoint_options(
    secret_key: bytes, local: bool, bind_addr: str, alpn: bytes = ALPN, relay: str | None = None
) -> iroh.EndpointOptions:
    """Local: no relays, no discovery, nothing leaves loopback. Internet: the n0 preset (its
    discovery) with its relays, or ``relay`` (:func:`relay_mode`).

    Never log or format the result: the binding's ``str()`` of it prints the secret key."""
    if local:
        preset, mode = iroh.preset_minimal(), iroh.RelayMode.disabled()
    else:
        preset, mode = iroh.preset_n0(), relay_mode(relay)
    return iroh.EndpointOptions(
        preset=preset, relay_mode=mode, bind_addr=bind_addr, secret_key=secret_key, alpns=[alpn]
    )


@dataclass
class TransportStats:
    frames_in: int = 0
    frames_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    connections_refused: int = 0
    frames_rejected: int = 0
    connects: int = 0  # connections this node dialled
    accepted: int = 0  # connections dialled to this node (and admitted)
    reconnects: int = 0
    last_rejection: str | None = None
    # frames by message type code, as written whole to a peer and as decoded from one (a frame of
    # an unknown type counts too): a dict update per frame, cheap enough for every token
    sent_by_type: Counter[int] = field(default_factory=Counter)
    received_by_type: Counter[int] = field(default_factory=Counter)


@dataclass
class _Outbound:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    conn: iroh.Connection | None = None
    stream: iroh.SendStream | None = None
    dialled: bool = True  # False: the stream is on a connection the peer dialled


MessageHandler = Callable[[str, Envelope, Message], None]
UnknownHandler = Callable[[str, UnknownMessageType], None]


class Transport:
    """An iroh endpoint that sends and receives :mod:`codec` frames.

    ``on_message(peer_id, envelope, message)`` is called for every decoded frame, in order per
    connection; ``on_unknown`` for a well-formed frame of a type this node does not know.
    """

    def __init__(
        self,
        secret_key: bytes,
        *,
        on_message: MessageHandler,
        on_unknown: UnknownHandler | None = None,
        allowed: Iterable[str] | None = None,
        local: bool = True,
        bind_addr: str | None = None,
        max_frame: int = codec.DEFAULT_MAX_FRAME,
        connect_timeout: float = 5.0,
        relay: str | None = None,
        advertise: Iterable[str] = (),
    ) -> None:
        if len(secret_key) != 32:
            raise ValueError(f"secret key must be 32 bytes, got {len(secret_key)}")
        self._secret_key = secret_key
        self.on_message = on_message
        self.on_unknown = on_unknown
        self.allowed: set[str] | None = None if allowed is None else set(allowed)
        self.local = local
        self.bind_addr = bind_addr or ("127.0.0.1:0" if local else "0.0.0.0:0")
        self.max_frame = max_frame
        self.connect_timeout = connect_timeout
        self.relay = relay
        relay_mode(relay)  # a bad value fails here, before anything binds
        self.advertise = tuple(advertise)  # addresses the endpoint is reachable at that it cannot see (a NAT's)
        self.id = endpoint_id(secret_key)
        self.stats = TransportStats()
        self._endpoint: iroh.Endpoint | None = None
        self._book: dict[str, PeerAddr] = {}
        self._out: dict[str, _Outbound] = {}
        self._inbound: set[iroh.Connection] = set()
        self._accepted: dict[str, iroh.Connection] = {}  # by peer: the latest live connection it dialled to us
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def __repr__(self) -> str:
        return f"Transport(id={self.id[:10]}, local={self.local})"

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._endpoint = await iroh.Endpoint.bind(
            endpoint_options(self._secret_key, self.local, self.bind_addr, relay=self.relay)
        )
        for addr in self.advertise:
            await self._endpoint.add_external_addr(addr)
        self._spawn(self._accept_loop())
        log.debug("transport %s bound on %s", self.id[:10], self.addr().addrs)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._endpoint is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._endpoint.close(), CLOSE_WAIT)

    def addr(self) -> PeerAddr:
        """Where this endpoint can be reached: the advertised addresses first, then what it sees."""
        assert self._endpoint is not None, "transport not started"
        found = PeerAddr.from_iroh(self._endpoint.addr())
        return PeerAddr(found.id, tuple(dict.fromkeys([*self.advertise, *found.addrs])), found.relay)

    async def online(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for a home relay (internet mode); False if none came."""
        assert self._endpoint is not None, "transport not started"
        if self.local or self.relay == RELAY_OFF:
            return False
        try:
            await asyncio.wait_for(self._endpoint.online(), timeout)
        except (TimeoutError, iroh.IrohError):
            return False
        return True

    def watch_addr(self, on_change: Callable[[PeerAddr], None], every: float = 2.0) -> None:
        """Call ``on_change(self.addr())`` whenever the endpoint's addresses change (a relay came,
        an interface went), looked at every ``every`` seconds until the transport closes. (The
        binding's own watcher calls back on a thread of its runtime, where no event loop runs.)"""

        async def watch() -> None:
            last = self.addr()
            while not self._closed:
                await asyncio.sleep(every)
                now = self.addr()
                if (now.addrs, now.relay) != (last.addrs, last.relay):
                    log.info("transport %s: addresses now %s, relay %s", self.id[:10], now.addrs, now.relay)
                    last = now
                    on_change(now)

        self._spawn(watch())

    def reached_by(self, peer_id: str) -> bool:
        """Whether ``peer_id`` has a live connection it dialled to this node."""
        return peer_id in self._accepted

    def peers(self) -> list[str]:
        """The peers this node has a connection with (it dialled, or they did)."""
        return sorted({p for p, out in self._out.items() if out.conn is not None} | set(self._accepted))

    def path(self, peer_id: str) -> dict[str, Any] | None:
        """How this node reaches ``peer_id`` now: the selected path of the connection it sends on
        (``direct`` with the peer's address, or ``relay``), its round trip, and who dialled it.
        A connection can list its paths with none selected for a moment (as its path selection
        moves, or a closed path is dropped); then the one that carried the most bytes out is
        given, with ``selected`` False, rather than no path at all."""
        out = self._out.get(peer_id)
        conn, dialled = (out.conn, out.dialled) if out is not None and out.conn is not None else (None, True)
        if conn is None:
            conn, dialled = self._accepted.get(peer_id), False
        if conn is None:
            return None
        try:
            paths = conn.paths()
        except iroh.IrohError:
            return None
        chosen = next((p for p in paths if p.is_selected), None)
        if chosen is None and paths:
            chosen = max(paths, key=lambda p: p.stats.udp_tx_bytes)
        return {
            "path": None if chosen is None else ("relay" if chosen.is_relay else "direct"),
            "remote_addr": None if chosen is None else chosen.remote_addr,
            "rtt_ms": None if chosen is None else chosen.rtt_ms,
            "dialled_by": "us" if dialled else "peer",
            "selected": chosen is not None and chosen.is_selected,
            "paths": len(paths),
        }

    def ticket(self) -> str:
        return self.addr().ticket()

    # --- address book and allowlist ----------------------------------------------------------

    def learn(self, peer: PeerAddr) -> None:
        if peer.id != self.id and (peer.addrs or peer.relay or peer.id not in self._book):
            self._book[peer.id] = peer

    def is_allowed(self, peer_id: str) -> bool:
        return self.allowed is None or peer_id in self.allowed or peer_id == self.id

    def allow(self, peer_ids: Iterable[str]) -> None:
        """Admit more endpoint ids (a node with no allowlist admits everyone already)."""
        if self.allowed is not None:
            self.allowed.update(peer_ids)

    def revoke(self, peer_id: str) -> None:
        """Take ``peer_id`` off the allowlist and close our connections with it: what it sends
        from now on is dropped unread, and it can connect no more. A node with no allowlist
        has nothing to take it off, so this does nothing there."""
        if self.allowed is None or peer_id == self.id:
            return
        self.allowed.discard(peer_id)
        self.forget(peer_id)
        conn = self._accepted.pop(peer_id, None)
        if conn is not None:
            _close(conn, CLOSE_REFUSED, b"endpoint id revoked")

    def forget(self, peer_id: str) -> None:
        """Drop the outbound connection to a peer (for example one declared dead)."""
        out = self._out.pop(peer_id, None)
        if out is not None:
            self._drop(out)

    # --- sending -----------------------------------------------------------------------------

    async def send_frame(self, peer_id: str, frame: bytes | bytearray, timeout: float) -> None:
        """Send one whole frame to ``peer_id`` within ``timeout`` seconds.

        A stale connection (peer restarted or closed it) is replaced once; a timeout abandons the
        stream, since a frame may have been half written (:meth:`_abandon`).
        """
        if not self.is_allowed(peer_id):
            raise TransportError(f"peer {peer_id[:10]} is not on this node's allowlist")
        if self._closed:
            raise TransportError("transport is closed")
        out = self._out.setdefault(peer_id, _Outbound())
        step = "waiting for the send lock"
        try:
            async with asyncio.timeout(timeout):
                async with out.lock:
                    for attempt in (1, 2):
                        fresh = out.stream is None
                        try:
                            if out.stream is None:
                                step = "connecting"
                                await self._open(peer_id, out)
                                fresh = fresh and out.dialled  # a peer's connection may be stale: dial next
                            step = "writing"
                            assert out.stream is not None
                            await out.stream.write_all(cast(bytes, frame))  # any buffer works (see _irohpatch)
                            self.stats.frames_out += 1
                            self.stats.bytes_out += len(frame)
                            self.stats.sent_by_type[frame[3]] += 1  # the header's type code
                            return
                        except iroh.IrohError as e:
                            self._drop(out)
                            if fresh or attempt == 2:
                                raise TransportError(f"{step} to peer {peer_id[:10]} failed: {e}") from None
                            self.stats.reconnects += 1
        except TimeoutError:
            if step != "waiting for the send lock":  # else another sender owns the connection
                self._abandon(out)
            raise TransportError(f"{step} to peer {peer_id[:10]} timed out after {timeout:.3g} s") from None
        except asyncio.CancelledError:
            if step == "writing":  # part of the frame may be on the stream: the next frame would be garbage
                self._abandon(out)
            raise

    async def _open(self, peer_id: str, out: _Outbound) -> None:
        """A stream to ``peer_id``: on the connection it dialled to us if it has one, else dialled."""
        conn = self._accepted.get(peer_id)
        if conn is not None:
            try:
                out.conn, out.stream, out.dialled = conn, await conn.open_uni(), False
                return
            except iroh.IrohError:
                self._accepted.pop(peer_id, None)
        await self._connect(peer_id, out)

    async def _connect(self, peer_id: str, out: _Outbound) -> None:
        assert self._endpoint is not None
        peer = self._book.get(peer_id, PeerAddr(peer_id))
        if not peer.addrs and not peer.relay and self.local:
            raise TransportError(f"no address known for peer {peer_id[:10]} (local mode has no discovery)")
        conn = await asyncio.wait_for(self._endpoint.connect(peer.to_iroh(), ALPN), self.connect_timeout)
        try:
            stream = await conn.open_uni()
        except BaseException:
            _close(conn, CLOSE_SHUTDOWN, b"open failed")
            raise
        out.conn, out.stream, out.dialled = conn, stream, True
        self.stats.connects += 1
        self._spawn(self._receive(peer_id, conn))  # the peer may answer on it

    def _abandon(self, out: _Outbound) -> None:
        """After a send that timed out or was cancelled, perhaps half way through its frame: its
        stream cannot carry another. A connection we dialled is dropped and dialled again; one the
        peer dialled is kept, for it may be our only way to the peer (an orchestrator behind a
        NAT), and the next frame opens a new stream on it (the half frame waits, unread, on the
        old stream until the connection ends)."""
        if out.dialled or out.conn is None:
            self._drop(out)
        else:
            out.stream = None

    def _drop(self, out: _Outbound) -> None:
        conn, out.conn, out.stream = out.conn, None, None
        if conn is not None:
            for peer, live in list(self._accepted.items()):
                if live is conn:
                    del self._accepted[peer]
            _close(conn, CLOSE_SHUTDOWN, b"dropped")

    # --- receiving ---------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_loop(self) -> None:
        assert self._endpoint is not None
        while not self._closed:
            incoming = await self._endpoint.accept_next()
            if incoming is None:
                return
            self._spawn(self._serve(incoming))

    async def _serve(self, incoming: iroh.Incoming) -> None:
        assert self._endpoint is not None
        try:
            accepting = await asyncio.wait_for(incoming.accept(), self.connect_timeout)
            conn = await asyncio.wait_for(accepting.connect(), self.connect_timeout)
        except (iroh.IrohError, TimeoutError) as e:
            log.info("incoming connection failed during the handshake: %s", e)
            return
        peer_id = str(conn.remote_id())
        if not self.is_allowed(peer_id):
            self.stats.connections_refused += 1
            log.warning("refused a connection from %s: not on the allowlist", peer_id[:10])
            _close(conn, CLOSE_REFUSED, b"endpoint id not on the allowlist")
            return
        # Replies go back over our own outbound connection: learn where this peer is now (it may
        # be new to us, or restarted on another port).
        with contextlib.suppress(Exception):
            seen = await asyncio.wait_for(self._endpoint.remote_addr(conn.remote_id()), self.connect_timeout)
            if seen is not None and (seen.direct_addresses() or seen.relay_url()):
                self._book[peer_id] = PeerAddr.from_iroh(seen)
        self.stats.accepted += 1
        self._accepted[peer_id] = conn
        await self._receive(peer_id, conn)

    async def _receive(self, peer_id: str, conn: iroh.Connection) -> None:
        """Read every stream the peer opens on ``conn`` (dialled or accepted) until it ends."""
        self._inbound.add(conn)
        try:
            while not self._closed:
                try:
                    stream = await conn.accept_uni()
                except iroh.IrohError:
                    return  # the peer closed or lost the connection
                self._spawn(self._read(peer_id, conn, stream))
        finally:
            self._inbound.discard(conn)
            if self._accepted.get(peer_id) is conn:
                del self._accepted[peer_id]
            out = self._out.get(peer_id)
            if out is not None and out.conn is conn and not out.lock.locked():
                out.conn = out.stream = None  # gone: the next frame opens another

    async def _read(self, peer_id: str, conn: iroh.Connection, stream: iroh.RecvStream) -> None:
        reader = FrameReader(self.max_frame)
        try:
            while True:
                try:
                    if reader.pending >= codec.HEADER_SIZE:
                        # the header is checked and the rest of the frame is due: one call that
                        # waits for all of it beats a wake-up per QUIC packet
                        chunk = await stream.read_exact(reader.missing)
                    else:
                        chunk = await stream.read(_READ_SIZE)
                except iroh.IrohError as e:
                    if reader.pending:
                        raise codec.TruncatedFrame(f"stream ended inside a frame: {e}") from None
                    return
                if not chunk:
                    if reader.pending:
                        raise codec.TruncatedFrame(f"stream ended inside a frame ({reader.pending} bytes pending)")
                    return
                self.stats.bytes_in += len(chunk)
                if not self.is_allowed(peer_id):  # revoked while its connection was open
                    log.warning("dropping the connection from %s: its id was revoked", peer_id[:10])
                    _close(conn, CLOSE_REFUSED, b"endpoint id revoked")
                    return
                for code, body in reader.feed(chunk):
                    self.stats.frames_in += 1
                    self.stats.received_by_type[code] += 1
                    try:
                        env, msg = codec.decode_body(code, body)
                    except UnknownMessageType as e:
                        log.warning("frame from %s: %s", peer_id[:10], e)
                        if self.on_unknown is not None:
                            self.on_unknown(peer_id, e)
                        continue
                    self.on_message(peer_id, env, msg)
                # Let what these frames started (a reply's write, a request waiting for this
                # reply) run before this task's next read call into the binding: a shorter
                # round trip (docs/benchmarks.md, bench/trace_roundtrip.py).
                await asyncio.sleep(0)
        except FrameError as e:
            self.stats.frames_rejected += 1
            self.stats.last_rejection = f"{type(e).__name__}: {e}"
            log.warning("dropping the connection from %s: %s: %s", peer_id[:10], type(e).__name__, e)
            _close(conn, CLOSE_BAD_FRAME, f"{type(e).__name__}: {e}"[:200].encode())


def _close(conn: iroh.Connection, code: int, reason: bytes) -> None:
    """Close a connection now (the binding's close is synchronous); the peer sees ``reason``."""
    with contextlib.suppress(iroh.IrohError):
        conn.close(code, reason)

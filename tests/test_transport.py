"""The iroh transport and actor messaging, in one process over real loopback QUIC."""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import types

import iroh
import pytest

from pytest_ppsmoke.messages import NextToken
from pytest_ppsmoke.runtime import _irohpatch, codec
from pytest_ppsmoke.runtime.codec import Echo, Envelope, ErrorReply
from pytest_ppsmoke.runtime.node import Node, NodeConfig, RemoteError
from pytest_ppsmoke.runtime.swimconfig import SwimConfig
from pytest_ppsmoke.runtime.transport import ALPN, PeerAddr, Transport, TransportError, endpoint_id, endpoint_options

from .helpers import cluster_configs

pytestmark = pytest.mark.local


async def test_echo_round_trip_carries_the_payload_exactly(nodes) -> None:
    seed_cfg, member_cfg = cluster_configs(2)
    seed = await nodes(seed_cfg)
    member_cfg.seed = seed.ticket()
    member = await nodes(member_cfg)
    payload = os.urandom(4096)
    reply = await member.request(member.address("node", seed.id), Echo(payload), timeout=5)
    assert reply == Echo(payload)
    big = os.urandom(4 << 20)
    reply = await member.request(member.address("node", seed.id), Echo(big), timeout=20)
    assert isinstance(reply, Echo) and reply.payload == big
    assert seed.transport.stats.frames_in >= 2
    assert seed.transport.stats.bytes_in >= len(big)
    # frames by type and direction, each side counting its own (SWIM's beside them)
    echo = codec.Echo.type_code
    assert seed.frame_counts()[echo] == (2, 2) and member.frame_counts()[echo] == (2, 2)
    await member.send(member.address("node", seed.id), NextToken(1, 2, 3, False), timeout=5)
    for _ in range(100):
        if NextToken.type_code in seed.frame_counts():
            break
        await asyncio.sleep(0.02)
    assert seed.frame_counts()[NextToken.type_code] == (0, 1)
    assert member.frame_counts()[NextToken.type_code] == (1, 0)


async def test_unknown_actor_and_unhandled_message_are_errors_not_crashes(nodes) -> None:
    a_cfg, b_cfg = cluster_configs(2)
    a = await nodes(a_cfg)
    b_cfg.seed = a.ticket()
    b = await nodes(b_cfg)
    with pytest.raises(RemoteError, match="no actor 'nobody'") as info:
        await b.request(b.address("nobody", a.id), Echo(b""), timeout=5)
    assert info.value.kind == "unknown_actor"
    with pytest.raises(RemoteError, match="actor 'node' does not handle NextToken") as info:
        await b.request(b.address("node", a.id), NextToken(1, 2, 3, False), timeout=5)
    assert info.value.kind == "unhandled_message"

    class Failing:
        def on_echo(self, msg: Echo, ctx: object) -> Echo:
            raise ValueError(f"payload of {len(msg.payload)} bytes is not allowed")

    a.add_actor("failing", Failing())
    with pytest.raises(RemoteError, match="ValueError: payload of 3 bytes is not allowed"):
        await b.request(b.address("failing", a.id), Echo(b"abc"), timeout=5)
    # and the node still serves
    assert await b.request(b.address("node", a.id), Echo(b"ok"), timeout=5) == Echo(b"ok")


async def test_unknown_message_type_gets_an_error_reply_and_the_connection_survives(nodes) -> None:
    a_cfg, b_cfg = cluster_configs(2)
    a = await nodes(a_cfg)
    b_cfg.seed = a.ticket()
    b = await nodes(b_cfg)
    corr = 424242
    fut = asyncio.get_running_loop().create_future()
    b._pending[corr] = (a.id, fut)
    frame = bytearray(codec.encode_frame(Envelope("node", "", corr, False), Echo(b"x")))
    frame[3] = 200  # a type from some future version
    await b.transport.send_frame(a.id, bytes(frame), timeout=5)
    with pytest.raises(RemoteError, match="unknown message type 200"):
        await asyncio.wait_for(fut, 5)
    assert await b.request(b.address("node", a.id), Echo(b"still"), timeout=5) == Echo(b"still")
    assert a.transport.stats.frames_rejected == 0


async def test_a_stranger_cannot_send_join_or_register(nodes, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    seed_cfg, member_cfg = cluster_configs(2)
    seed = await nodes(seed_cfg)
    member_cfg.seed = seed.ticket()
    await nodes(member_cfg)
    stranger_cfg = NodeConfig.generate(seed=seed.ticket(), join_timeout=1.5, allowed=seed_cfg.allowed)
    stranger = Node(stranger_cfg)
    try:
        await stranger.start(join=False)
        with pytest.raises(TimeoutError, match="could not join through seed"):
            await stranger.join()
        with pytest.raises((TimeoutError, TransportError)):
            await stranger.request(stranger.address("node", seed.id), codec.Register("pp-entry", "node"), timeout=1)
    finally:
        await stranger.close()
    assert seed.transport.stats.connections_refused >= 1
    assert stranger.id not in seed.membership.members
    assert "pp-entry" not in seed.registry.names()
    assert f"refused a connection from {stranger.id[:10]}: not on the allowlist" in caplog.text


class RawClient:
    """A bare iroh endpoint that writes whatever bytes we like to a node."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    async def __aenter__(self) -> RawClient:
        self.ep = await iroh.Endpoint.bind(endpoint_options(self.key, local=True, bind_addr="127.0.0.1:0"))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.ep.close()

    async def send_raw(self, to: PeerAddr, data: bytes) -> iroh.Connection:
        conn = await asyncio.wait_for(self.ep.connect(to.to_iroh(), ALPN), 5)
        stream = await conn.open_uni()
        await stream.write_all(data)
        await stream.finish()
        return conn


BAD_FRAMES = {
    "truncated": (codec.encode_frame(Envelope("node", "", 0, False), Echo(b"x" * 100))[:-10], "TruncatedFrame"),
    "wrong version": (b"PP\x07\x21" + struct.pack(">I", 4) + b"abcd", "UnsupportedVersion"),
    "huge length": (b"PP" + bytes([codec.VERSION, 0x21]) + struct.pack(">I", 0xFFFFFFF0), "FrameTooLarge"),
    "random bytes": (bytes.fromhex("9c1e6a0be4d15f32aa07c8b1e9") * 5, "BadMagic"),
    "bad body": (b"PP" + bytes([codec.VERSION, 0x21]) + struct.pack(">I", 6) + b"\xff" * 6, "TruncatedFrame"),
}


@pytest.mark.parametrize("case", list(BAD_FRAMES))
async def test_malformed_frames_are_refused_and_logged_and_the_node_keeps_serving(
    nodes, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    caplog.set_level(logging.WARNING)
    data, error = BAD_FRAMES[case]
    seed_cfg, member_cfg = cluster_configs(2)
    raw_key = os.urandom(32)
    allowed = frozenset({*seed_cfg.allowed, endpoint_id(raw_key)})  # an insider sending garbage
    seed_cfg.allowed = member_cfg.allowed = allowed
    seed = await nodes(seed_cfg)
    member_cfg.seed = seed.ticket()
    member = await nodes(member_cfg)
    async with RawClient(raw_key) as raw:
        conn = await raw.send_raw(seed.transport.addr(), data)
        reason = await asyncio.wait_for(conn.closed(), 5)
    assert error in reason, reason
    assert seed.transport.stats.frames_rejected == 1
    assert error in (seed.transport.stats.last_rejection or "")
    assert f"dropping the connection from {endpoint_id(raw_key)[:10]}: {error}" in caplog.text
    assert await member.request(member.address("node", seed.id), Echo(b"alive"), timeout=5) == Echo(b"alive")


async def test_sender_reconnects_after_the_peer_restarts(nodes) -> None:
    a_cfg, b_cfg = cluster_configs(2)
    a = await nodes(a_cfg)
    b_cfg.seed = a.ticket()
    b = await nodes(b_cfg)
    assert await b.request(b.address("node", a.id), Echo(b"1"), timeout=5) == Echo(b"1")
    assert b.transport.stats.connects == 1
    await a.close()
    before = b.transport.stats.connects
    a2 = await nodes(a_cfg)  # same key, new port: the old connection is gone
    b.transport.learn(a2.transport.addr())
    assert await b.request(b.address("node", a2.id), Echo(b"2"), timeout=5) == Echo(b"2")
    assert b.transport.stats.connects > before  # the dead connection was replaced, not reused


async def test_every_connect_and_request_has_a_deadline() -> None:
    key = os.urandom(32)
    t = Transport(key, on_message=lambda *a: None, connect_timeout=0.5)
    await t.start()
    try:
        ghost = PeerAddr(endpoint_id(os.urandom(32)), ("127.0.0.1:9",))  # nothing listens there
        t.learn(ghost)
        with pytest.raises(TransportError, match=r"connecting to peer .* (timed out|failed)"):
            await t.send_frame(ghost.id, b"PP", timeout=1.0)
        with pytest.raises(TransportError, match="no address known"):
            await t.send_frame(endpoint_id(os.urandom(32)), b"PP", timeout=1.0)
    finally:
        await t.close()
    node = Node(NodeConfig.generate())
    await node.start()
    try:

        class Silent:
            async def on_echo(self, msg: Echo, ctx: object) -> None:
                await asyncio.sleep(30)

        node.add_actor("silent", Silent())
        with pytest.raises(TimeoutError, match=r"no reply from silent@.* to Echo within 0.2 s"):
            await node.request(node.address("silent"), Echo(b""), timeout=0.2)
    finally:
        await node.close()


def test_the_iroh_patch_is_applied_and_guards_against_a_changed_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _irohpatch.is_applied()
    builder = iroh.iroh_ffi._UniffiRustBufferBuilder

    def write(self: object, value: bytes) -> None:  # what a future release might ship
        raise NotImplementedError

    monkeypatch.setattr(builder, "write", write)
    with pytest.raises(_irohpatch.IrohPatchError, match=r"changed _UniffiRustBufferBuilder\.write"):
        _irohpatch.apply()


def test_error_reply_and_secret_key_stay_out_of_reprs() -> None:
    cfg = NodeConfig.generate()
    assert cfg.secret_key.hex() not in repr(cfg)
    assert "secret_key" not in repr(cfg)
    assert ErrorReply("k", "m") == ErrorReply("k", "m")


async def test_a_sender_that_gives_up_waiting_does_not_break_the_frame_in_flight(nodes) -> None:
    # the 24 MiB frame holds b's one stream to a, its SWIM acks behind it: on 2 loaded cores that
    # can outlast the loopback preset's lone suspicion (6 s), and a would forget b as dead
    a_cfg, b_cfg = cluster_configs(2, SwimConfig.shared_cpu())
    a = await nodes(a_cfg)
    b_cfg.seed = a.ticket()
    b = await nodes(b_cfg)
    to = b.address("node", a.id)
    big = asyncio.ensure_future(b.send(to, Echo(os.urandom(24 << 20)), timeout=60))
    async with asyncio.timeout(30):  # until the big frame holds the stream (encoding it comes first)
        while (out := b.transport._out.get(a.id)) is None or not out.lock.locked():
            await asyncio.sleep(0.001)
    with pytest.raises(TransportError, match=r"waiting for the send lock to peer .* timed out"):
        await b.send(to, Echo(b"small"), timeout=0.01)
    await big
    assert await b.request(to, Echo(b"after"), timeout=30) == Echo(b"after")
    assert a.transport.stats.frames_rejected == 0 and b.transport.stats.reconnects == 0


async def test_a_reply_that_cannot_be_encoded_comes_back_as_an_error(nodes) -> None:
    a_cfg, b_cfg = cluster_configs(2)
    a = await nodes(a_cfg)
    b_cfg.seed = a.ticket()
    b = await nodes(b_cfg)

    class Sloppy:
        def on_echo(self, msg: Echo, ctx: object) -> str:
            return "not a message"

    a.add_actor("sloppy", Sloppy())
    with pytest.raises(RemoteError, match=r"str is not a registered message type") as info:
        await b.request(b.address("sloppy", a.id), Echo(b""), timeout=5)
    assert info.value.kind == "bad_reply"


def test_a_connection_with_no_path_selected_for_a_moment_still_says_the_path_it_carried_most_on() -> None:
    """A connection lists its paths, and for a moment none of them selected (its selection
    moving): the path told is the one that carried the most bytes out, marked not selected,
    never no path at all (a stage's account of its peers would then leave that peer out)."""

    def snap(relay: bool, addr: str, tx: int, selected: bool = False) -> types.SimpleNamespace:
        stats = types.SimpleNamespace(udp_tx_bytes=tx)
        return types.SimpleNamespace(is_selected=selected, is_relay=relay, remote_addr=addr, rtt_ms=7, stats=stats)

    class Conn:
        def __init__(self, *paths: types.SimpleNamespace) -> None:
            self.listed = list(paths)

        def paths(self) -> list[types.SimpleNamespace]:
            return self.listed

    t = Transport(os.urandom(32), on_message=lambda p, e, m: None)
    conn = Conn(snap(True, "relay", 900), snap(False, "10.0.0.2:7000", 90_000))
    t._accepted["peer"] = conn  # type: ignore[assignment]
    told = t.path("peer")
    assert told is not None
    assert (told["path"], told["remote_addr"], told["selected"], told["dialled_by"]) == (
        "direct",
        "10.0.0.2:7000",
        False,
        "peer",
    )
    conn.listed[0] = snap(True, "relay", 900, selected=True)  # once one is selected, it is the one told
    assert (t.path("peer") or {}).get("path") == "relay" and (t.path("peer") or {}).get("selected") is True
    conn.listed = []
    assert (t.path("peer") or {}).get("path") is None and t.path("nobody") is None


async def test_a_peer_that_cannot_dial_back_is_answered_on_the_connection_it_made() -> None:
    """B knows no address of A (local mode has no discovery): it can answer A only on the
    connection A dialled, as a node answers an orchestrator behind a NAT. Neither side dials twice."""
    got: dict[str, list[bytes]] = {"a": [], "b": []}
    key_a, key_b = os.urandom(32), os.urandom(32)
    a = Transport(key_a, on_message=lambda p, e, m: got["a"].append(m.payload))
    b = Transport(key_b, on_message=lambda p, e, m: got["b"].append(m.payload))
    await a.start()
    await b.start()
    try:
        a.learn(b.addr())
        env = Envelope("node", "", 0, False)
        await a.send_frame(b.id, codec.encode_frame(env, Echo(b"ping")), timeout=5)
        for _ in range(250):
            if got["b"]:
                break
            await asyncio.sleep(0.02)
        await b.send_frame(a.id, codec.encode_frame(env, Echo(b"pong")), timeout=5)
        for _ in range(250):
            if got["a"]:
                break
            await asyncio.sleep(0.02)
        assert got == {"a": [b"pong"], "b": [b"ping"]}
        assert (a.stats.connects, a.stats.accepted, b.stats.connects, b.stats.accepted) == (1, 0, 0, 1)
        assert a.path(b.id)["dialled_by"] == "us" and b.path(a.id)["dialled_by"] == "peer"
        assert a.path(b.id)["path"] == "direct" and a.path(b.id)["remote_addr"] == b.addr().addrs[0]
    finally:
        await a.close()
        await b.close()

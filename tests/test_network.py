"""The emulated network: profiles, the delay switch's link model, and members in namespaces.

Timing claims are lower bounds only (a packet is never early); nothing here asserts speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest

from pytest_ppsmoke.network import (
    EmulatedNetwork,
    LinkProfile,
    NetworkError,
    NetworkSpec,
    parse_network,
    sweep,
    unavailable,
)
from pytest_ppsmoke.network import netns as nsmod
from pytest_ppsmoke.network.switch import Switch
from pytest_ppsmoke.runtime import codec
from pytest_ppsmoke.runtime.codec import Echo, Envelope, Message
from pytest_ppsmoke.runtime.localproc import ChildProcess
from pytest_ppsmoke.runtime.transport import PeerAddr, Transport, new_secret_key

from .helpers import alive
from .netpeer import pings

pytestmark = pytest.mark.local

_WHY = unavailable()
needs_netns = pytest.mark.skipif(_WHY is not None, reason=f"no emulated network here: {_WHY}")


def _peer(member_argv: list[str], name: str) -> ChildProcess:
    return ChildProcess(name, member_argv, os.environ)


def _leftovers(prefix: str) -> list[str]:
    """This network's namespaces and root devices (pyroute2's sync calls must not run in an event loop)."""
    names = [n for n in nsmod.netns_names() if n.startswith(prefix)]
    return names + [n for n in nsmod.root_links() if n.startswith(prefix)]


@pytest.fixture
async def stopper() -> AsyncIterator[list[ChildProcess]]:
    procs: list[ChildProcess] = []
    yield procs
    for p in procs:
        await p.stop(grace=1.0)


async def _echo(m_argv: list[str], stopper: list[ChildProcess]) -> int:
    p = _peer([*m_argv], "udp-echo")
    stopper.append(p)
    await p.start()
    return int((await p.wait_event(lambda e: "port" in e, 15, "its port"))["port"])


async def _pings(sock: socket.socket, dst: tuple[str, int], n: int, timeout: float) -> list[float | None]:
    """``n`` sequential pings from the root namespace (a blocking socket in a thread)."""

    sock.settimeout(timeout)
    return await asyncio.to_thread(pings, sock, dst, n)


# --- profiles and the link model (no namespaces) ---------------------------------------------


def test_profiles_parse_with_overrides_and_name_what_is_wrong() -> None:
    spec = parse_network("wan;host->1=far;1->0=lan")
    assert spec.emulated and spec.default is not None
    assert spec.link("host", "1").delay_ms == 60 and spec.link("1", "host").delay_ms == 20
    assert spec.link("1", "0").delay_ms == 0.2 and spec.link("0", "1").delay_ms == 20
    assert not parse_network("loopback").emulated
    assert parse_network("flaky").link("0", "1").loss_corr == 0.75
    with pytest.raises(ValueError, match=r"unknown profile 'wam'; known profiles: loopback, lan, wan"):
        parse_network("wam")
    with pytest.raises(ValueError, match=r"'host=1' is not SRC->DST=PROFILE"):
        parse_network("wan;host=1")
    with pytest.raises(ValueError, match="loopback has no links"):
        parse_network("loopback;0->1=wan")
    with pytest.raises(ValueError, match=r"loss_corr=0\.1"):
        LinkProfile(loss=0.2, loss_corr=0.1)


@pytest.mark.parametrize(("loss", "corr"), [(0.2, 0.0), (0.2, 0.75)])
def test_loss_model_has_the_mean_and_the_burstiness_asked_for(loss: float, corr: float) -> None:
    sw = Switch("pps1-t", {"default": LinkProfile(loss=loss, loss_corr=corr).to_json()}, seed=7)
    link = sw._link("0", "1")
    drops = [sw._lose(link) for _ in range(40000)]
    assert abs(sum(drops) / len(drops) - loss) < 0.02
    after_drop = [b for a, b in itertools.pairwise(drops) if a]
    want = corr or loss  # independent drops: P(drop | drop) is the mean itself
    assert abs(sum(after_drop) / len(after_drop) - want) < 0.03


# --- members in namespaces ----------------------------------------------------------------------


@pytest.mark.netns
@needs_netns
async def test_one_way_delay_is_a_lower_bound_and_links_are_directed(stopper: list[ChildProcess]) -> None:
    spec = NetworkSpec("t", LinkProfile(delay_ms=10), {("host", "0"): LinkProfile(delay_ms=30)})
    async with EmulatedNetwork(spec, seed=1) as net:
        m0, m1 = await net.add_member("0"), await net.add_member("1")
        assert net.host_addr.endswith(".1") and m0.addr != m1.addr
        port = await _echo(m0.wrap([sys.executable, "-m", "tests.netpeer", "udp-echo", m0.addr]), stopper)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((net.host_addr, 0))
            rtts = await _pings(s, (m0.addr, port), 5, 2.0)
        assert all(r is not None and r >= 0.040 for r in rtts), rtts  # host->0 30 ms + 0->host 10 ms
        ping = _peer(m1.wrap([sys.executable, "-m", "tests.netpeer", "udp-ping", m0.addr, str(port), "5"]), "ping")
        stopper.append(ping)
        await ping.start()
        member_rtts = (await ping.wait_event(lambda e: "rtts" in e, 20, "the pings"))["rtts"]
        assert all(r is not None and r >= 0.020 for r in member_rtts), member_rtts  # 1->0 and 0->1: 10 ms each
        stats = await net.stats()
        assert stats["host->0"]["delivered"] == 5 and stats["host->0"]["mean_delay_ms"] >= 30
        assert stats["1->0"]["delivered"] == 5 and stats["0->1"]["delivered"] == 5


@pytest.mark.netns
@needs_netns
async def test_loss_over_many_packets_and_rate_as_serialisation(stopper: list[ChildProcess]) -> None:
    spec = NetworkSpec(
        "t", LinkProfile(), {("host", "0"): LinkProfile(loss=0.3), ("host", "1"): LinkProfile(rate_mbit=1)}
    )
    async with EmulatedNetwork(spec, seed=3) as net:
        m0, m1 = await net.add_member("0"), await net.add_member("1")
        p0 = await _echo(m0.wrap([sys.executable, "-m", "tests.netpeer", "udp-echo", m0.addr]), stopper)
        p1 = await _echo(m1.wrap([sys.executable, "-m", "tests.netpeer", "udp-echo", m1.addr]), stopper)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((net.host_addr, 0))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            for burst in range(20):  # in bursts of 25: a deeper burst would overflow the TUN's own queue
                for i in range(25):
                    s.sendto(b"x%d" % (burst * 25 + i), (m0.addr, p0))
                await asyncio.sleep(0.005)
            s.settimeout(0.3)
            got = 0
            with contextlib.suppress(TimeoutError):
                while True:
                    s.recv(64)
                    got += 1
            assert 0.62 < got / 500 < 0.78, got  # 30% lost on the way there, nothing on the way back
            # 20 datagrams of 1250 bytes (+28 of headers) at 1 Mbit/s take >= 0.2 s to serialise
            s.settimeout(5.0)
            t0 = time.monotonic()
            for _ in range(20):
                s.sendto(b"y" * 1250, (m1.addr, p1))
            for _ in range(20):
                await asyncio.to_thread(s.recv, 2048)
            assert time.monotonic() - t0 >= 20 * 1278 * 8 / 1e6
        stats = await net.stats()
        assert stats["host->0"]["lost"] == 500 - got and stats["0->host"]["dropped"] == 0
        assert stats["host->1"]["max_delay_ms"] >= 190


@pytest.mark.netns
@needs_netns
async def test_partition_in_each_direction_and_heal(stopper: list[ChildProcess]) -> None:
    async with EmulatedNetwork(NetworkSpec("t", LinkProfile()), seed=1) as net:
        m0 = await net.add_member("0")
        port = await _echo(m0.wrap([sys.executable, "-m", "tests.netpeer", "udp-echo", m0.addr]), stopper)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((net.host_addr, 0))
            dst = (m0.addr, port)
            assert None not in await _pings(s, dst, 2, 2.0)
            for direction, cut in (("in", "host->0"), ("out", "0->host"), ("both", "host->0")):
                before = (await net.stats())[cut]["partitioned"]
                await net.partition("0", direction)
                assert await _pings(s, dst, 1, 0.25) == [None], direction
                assert (await net.stats())[cut]["partitioned"] == before + 1, direction
                await net.heal("0")
                assert None not in await _pings(s, dst, 1, 2.0), direction
            await net.partition("0", "both", seconds=3)  # heals by itself
            assert await _pings(s, dst, 1, 0.2) == [None]
            async with asyncio.timeout(30):  # healed: answered again, however late the switch's timer ran
                while None in await _pings(s, dst, 1, 1.0):
                    pass
            assert None not in await _pings(s, dst, 2, 2.0)


@pytest.mark.netns
@needs_netns
async def test_iroh_between_members_binds_and_advertises_the_member_address(stopper: list[ChildProcess]) -> None:
    got: asyncio.Queue[bytes] = asyncio.Queue()

    def on_message(src: str, env: Envelope, msg: Message) -> None:
        if isinstance(msg, Echo):
            got.put_nowait(msg.payload)

    async with EmulatedNetwork(parse_network("lan"), seed=1) as net:
        m1 = await net.add_member("1")
        host = Transport(new_secret_key(), on_message=on_message, local=True, bind_addr=f"{net.host_addr}:0")
        await host.start()
        try:
            assert [a.split(":")[0] for a in host.addr().addrs] == [net.host_addr]
            peer = _peer(m1.wrap([sys.executable, "-m", "tests.netpeer", "iroh-echo", m1.addr, host.ticket()]), "iroh")
            stopper.append(peer)
            await peer.start()
            ev = await peer.wait_event(lambda e: "id" in e, 20, "its endpoint")
            assert [a.split(":")[0] for a in ev["addrs"]] == [m1.addr]
            host.learn(PeerAddr(ev["id"], tuple(ev["addrs"])))
            for i in range(3):
                payload = os.urandom(1500 + i)
                await host.send_frame(ev["id"], codec.encode_frame(Envelope("a", "b", i + 1, False), Echo(payload)), 10)
                assert await asyncio.wait_for(got.get(), 10) == payload
        finally:
            await host.close()
        stats = await net.stats()
        assert stats["host->1"]["delivered"] > 0 and stats["1->host"]["delivered"] > 0


@pytest.mark.netns
@needs_netns
async def test_nothing_outlives_a_close_or_an_exception() -> None:
    net = EmulatedNetwork(parse_network("wan"))
    with pytest.raises(RuntimeError, match="boom"):
        async with net:
            m = await net.add_member("0")
            sleeper = subprocess.Popen(m.wrap(["sleep", "60"]), start_new_session=True)  # noqa: ASYNC220
            for _ in range(200):  # until it has entered the namespace
                if sleeper.pid in nsmod.pids_in_netns(m.netns or ""):
                    break
                await asyncio.sleep(0.02)
            assert net._switch is not None
            switch_pid = net._switch.pid
            assert len(await asyncio.to_thread(_leftovers, net.prefix)) == 2  # the member's namespace, the host's TUN
            raise RuntimeError("boom")
    assert await asyncio.to_thread(_leftovers, net.prefix) == []
    assert sleeper.wait(5) == -signal.SIGKILL  # what still ran in a member's namespace is killed
    assert not alive(switch_pid)
    async with EmulatedNetwork(parse_network("wan")) as net2:
        await net2.add_member("0")
        await net2.remove_member("0")
        assert await asyncio.to_thread(_leftovers, net2.prefix) == [f"{net2.prefix}h"]
    assert await asyncio.to_thread(_leftovers, net2.prefix) == []


_OWNER = """
import asyncio, json, sys
from pytest_ppsmoke.network import EmulatedNetwork, parse_network
async def main():
    net = EmulatedNetwork(parse_network("lan"))
    await net.start()
    await net.add_member("0")
    print(json.dumps({"prefix": net.prefix, "switch": net._switch.pid}), flush=True)
    await asyncio.sleep(60)
asyncio.run(main())
"""


@pytest.mark.netns
@needs_netns
@pytest.mark.parametrize("kill_switch", [False, True], ids=["owner-killed", "owner-and-switch-killed"])
def test_a_sigkilled_owner_leaves_nothing_after_the_switch_or_the_sweep(kill_switch: bool) -> None:
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        info = json.loads(owner.stdout.readline())
        prefix, switch = info["prefix"], info["switch"]
        assert len(_leftovers(prefix)) == 2
        if kill_switch:
            os.kill(switch, signal.SIGKILL)
        owner.kill()
        owner.wait(5)
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 10
    while alive(switch) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(switch), "the switch outlived its owner"
    removed = sweep()
    assert _leftovers(prefix) == []
    if kill_switch:  # the switch could not clean up: the namespace is the sweep's
        assert f"{prefix}0" in removed
    else:  # the switch saw its stdin close and removed everything itself
        assert not [n for n in removed if n.startswith(prefix)]


async def test_loopback_makes_nothing_and_needs_no_second_path() -> None:
    async with EmulatedNetwork(parse_network("loopback")) as net:
        m = await net.add_member("0")
        assert (net.host_addr, m.addr, m.netns) == ("127.0.0.1", "127.0.0.1", None)
        assert m.wrap(["true"]) == ["true"] and await net.stats() == {}
        with pytest.raises(NetworkError, match="'loopback' is loopback: there is no link to partition"):
            await net.partition("0")


@pytest.mark.netns
@needs_netns
async def test_requests_that_make_no_sense_are_refused_by_name() -> None:
    async with EmulatedNetwork(parse_network("lan")) as net:
        await net.add_member("0")
        with pytest.raises(NetworkError, match="member '0' is already on network 'lan'"):
            await net.add_member("0")
        with pytest.raises(NetworkError, match=r"no member '7' on this network; members: \['0', 'host'\]"):
            await net.partition("7", "in")
        with pytest.raises(ValueError, match="partition direction 'up': expected in, out or both"):
            await net.partition("0", "up")
        with pytest.raises(NetworkError, match="no member '7' on network 'lan'"):
            await net.remove_member("7")
        await net.heal()


@pytest.mark.netns
@needs_netns
async def test_a_switch_that_cannot_start_fails_the_start_with_its_reason_and_leaves_nothing() -> None:
    net = EmulatedNetwork(parse_network("lan"))
    net.prefix = "pps-not-a-pid"
    with pytest.raises(NetworkError, match=r"(?s)switch ready.*--prefix 'pps-not-a-pid': expected pps<pid>-<letters>"):
        async with net:
            pytest.fail("started")  # pragma: no cover
    assert net._switch is None and net.members == {}
    assert await asyncio.to_thread(_leftovers, "pps-not-a-pid") == []

"""The delay switch: an L3 switch in user space between one TUN device per member.

    python -m pytest_ppsmoke.network.switch --prefix pps1234-a --spec JSON [--seed N]

This kernel has no netem, so delay, jitter, loss and rate are made here. The switch owns the TUN
devices (their fds): the host's in the root namespace (10.77.k.1/24) and one per member, moved into
the member's namespace (10.77.k.<2+i>/24). Each device is the only route of its namespace, and it
routes only the /24: packets reach nothing but the members. Per packet: read it, look up the IPv4
destination, apply the directed link's profile (partition, loss, serialisation at the rate, delay
with jitter) and write it to the destination's TUN at its due time. A link never reorders.

The loop is a plain ``select.select`` loop rather than asyncio: epoll (asyncio's selector) sleeps in
whole milliseconds, which would turn the ``lan`` profile's 0.2 ms into 1 ms; select sleeps in
microseconds, and the loop does nothing per packet but the work above.

Control: JSON lines on stdin, one reply line per request on stdout (``{"id": ..., "ok": true, ...}``
or ``{"id": ..., "ok": false, "error": ...}``); the first line out is ``{"event": "ready", ...}``.
Requests (``op``): ``add`` (member), ``remove`` (member), ``partition`` (member, direction
in|out|both, seconds or null), ``heal`` (member or null), ``stats``. When stdin closes (the owner
is gone, however it went) or on SIGTERM the switch closes its devices, removes the namespaces it
made and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import heapq
import json
import os
import random
import select
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from . import netns
from .profiles import LinkProfile

HOST = "host"
# the internet profiles' private sides (docs/network.md): a home LAN before the orchestrator, a
# Docker bridge network behind each instance's host; each in namespaces of its own, so every host
# can use the same addresses, as real ones do
HOME_ROUTER, HOME_ORCHESTRATOR, HOME_NET = "192.168.1.1", "192.168.1.2", "192.168.1.0/24"
BRIDGE_HOST, BRIDGE_CONTAINER, BRIDGE_NET = "172.17.0.1", "172.17.0.2", "172.17.0.0/16"
_PR_SET_TIMERSLACK = 29
_BATCH = 64  # packets read from one device per wake-up, so that one busy link cannot starve the rest


@dataclass
class Port:
    member: str
    ifname: str
    fd: int
    addr: str
    netns: str | None  # None: the root namespace (the host)
    inner: str | None = None  # behind NAT: the namespace of what runs there (the home LAN, a container)
    cut_in: bool = False
    cut_out: bool = False
    heal_at: float | None = None


@dataclass
class Link:
    profile: LinkProfile
    busy_until: float = 0.0  # the transmitter is serialising until then (rate)
    last_due: float = 0.0  # no packet of this link is due before the previous one: no reordering
    queued: int = 0
    bad: bool = False  # the Gilbert model's state: the previous packet was lost
    packets: int = 0
    bytes: int = 0
    delivered: int = 0
    lost: int = 0
    cut: int = 0
    overflow: int = 0
    delay_sum: float = 0.0
    delay_max: float = 0.0

    def stats(self) -> dict[str, Any]:
        return {
            "profile": self.profile.describe(),
            "packets": self.packets,
            "bytes": self.bytes,
            "delivered": self.delivered,
            "dropped": self.lost + self.cut + self.overflow,
            "lost": self.lost,
            "partitioned": self.cut,
            "overflow": self.overflow,
            "mean_delay_ms": round(self.delay_sum / self.delivered * 1e3, 4) if self.delivered else None,
            "max_delay_ms": round(self.delay_max * 1e3, 4) if self.delivered else None,
        }


@dataclass(order=True)
class _Due:
    due: float
    seq: int
    t_in: float = field(compare=False)
    link: Link = field(compare=False)
    dst: Port = field(compare=False)
    packet: bytes = field(compare=False)


class _Stop(BaseException):  # not an Exception: a request's error handling must not swallow it
    pass


class Switch:
    def __init__(self, prefix: str, spec: dict[str, Any], seed: int | None) -> None:
        self.prefix = prefix
        self.default = LinkProfile(**spec["default"])
        self.overrides = {tuple(k.split("->", 1)): LinkProfile(**v) for k, v in spec.get("overrides", {}).items()}
        self.nat = bool(spec.get("nat", False))
        self.rng = random.Random(seed)
        self.subnet = -1
        self.ports: dict[str, Port] = {}  # by member
        self.by_fd: dict[int, Port] = {}
        self.by_addr: dict[bytes, Port] = {}
        self.links: dict[tuple[str, str], Link] = {}
        self.heap: list[_Due] = []
        self.seq = 0
        self.next_index = 0
        self.unroutable = 0  # not IPv4, or to an address that is no member's
        self._buf = b""

    # --- setup and teardown --------------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        why = netns.unavailable()
        if why is not None:
            raise OSError(f"cannot emulate a network here: {why}")
        ifname = f"{self.prefix}h"
        fd = netns.open_tun(ifname)
        try:
            with netns.subnet_lock():
                self.subnet = netns.pick_subnet(os.getpid() % 256)
                addr = f"{netns.SUBNET_PREFIX}.{self.subnet}.1"
                if self.nat:  # nothing of it in this namespace: every address is in one of the network's
                    port = self._home_router(ifname, fd, addr)
                else:
                    netns.configure_root_tun(ifname, addr)
                    port = Port(HOST, ifname, fd, addr, None)
        except BaseException:
            os.close(fd)
            for name in (f"{self.prefix}r", f"{self.prefix}o"):
                with contextlib.suppress(Exception):
                    netns.remove_netns(name)
            raise
        self._attach(port)
        ready = {"event": "ready", "host_addr": addr, "subnet": f"{netns.SUBNET_PREFIX}.{self.subnet}.0/24"}
        if port.inner is not None:
            ready |= {"home_netns": port.inner, "home_addr": HOME_ORCHESTRATOR}
        return ready

    def _home_router(self, ifname: str, fd: int, addr: str) -> Port:
        """The orchestrator's home: its router (namespace ``<prefix>r``) holds the public address
        on the switch and masquerades the LAN behind it; the orchestrator's namespace
        (``<prefix>o``) has the LAN's second address and a default route to the router. The router
        has no route beyond the switch's /24: what the orchestrator sends elsewhere (n0's relays
        and discovery) is answered "unreachable" and never leaves this machine."""
        router, home = f"{self.prefix}r", f"{self.prefix}o"
        netns.create_netns(router)
        netns.create_netns(home)
        netns.move_and_configure_tun(ifname, router, addr)
        lan_r, lan_o = f"{self.prefix}ra", f"{self.prefix}oa"
        netns.veth_between(lan_r, router, lan_o, home)
        netns.address_in(router, lan_r, HOME_ROUTER, 24)
        netns.address_in(home, lan_o, HOME_ORCHESTRATOR, 24, gateway=HOME_ROUTER)
        netns.firewall(router, _nat_rules(ifname, lan_r, HOME_ORCHESTRATOR, HOME_NET, {}))
        return Port(HOST, ifname, fd, addr, router, inner=home)

    def _attach(self, port: Port) -> None:
        self.ports[port.member] = port
        self.by_fd[port.fd] = port
        self.by_addr[bytes(int(x) for x in port.addr.split("."))] = port

    def add(self, member: str, ports: list[int] | None = None, server: bool = False) -> dict[str, Any]:
        """A member on its own address. On a NAT network a member that is not a ``server`` is an
        instance: its host's namespace holds the public address and forwards each of ``ports``
        (UDP) from a random public port to the container behind it, where its node runs."""
        if member in self.ports:
            raise ValueError(f"member {member!r} is already on the network")
        if self.next_index > 253:
            raise ValueError(f"a network holds at most 254 members; {member!r} would be one more")
        i = self.next_index
        self.next_index += 1
        ifname = name = f"{self.prefix}{i}"
        addr = f"{netns.SUBNET_PREFIX}.{self.subnet}.{i + 2}"
        fd = netns.open_tun(ifname)
        inner = f"{name}c" if self.nat and not server else None
        mapped: dict[int, int] = {}
        try:
            netns.create_netns(name)
            netns.move_and_configure_tun(ifname, name, addr)
            if inner is not None:
                netns.create_netns(inner)
                bridge, eth = f"{name}a", f"{name}b"
                netns.veth_between(bridge, name, eth, inner)
                netns.address_in(name, bridge, BRIDGE_HOST, 16)
                netns.address_in(inner, eth, BRIDGE_CONTAINER, 16, gateway=BRIDGE_HOST)
                for p in ports or []:
                    if not 1 <= int(p) <= 65535:
                        raise ValueError(f"port {p!r}: expected 1..65535")
                    while (public := self.rng.randint(20000, 59999)) in mapped.values() or public == p:
                        pass
                    mapped[int(p)] = public
                netns.firewall(name, _nat_rules(ifname, bridge, BRIDGE_CONTAINER, BRIDGE_NET, mapped))
        except BaseException:
            os.close(fd)
            for ns in (inner, name):
                if ns is not None:
                    with contextlib.suppress(Exception):
                        netns.remove_netns(ns)
            raise
        self._attach(Port(member, ifname, fd, addr, name, inner=inner))
        if inner is None:
            return {"member": member, "netns": name, "ifname": ifname, "addr": addr}
        return {
            "member": member,
            "netns": inner,
            "host_netns": name,
            "ifname": ifname,
            "addr": BRIDGE_CONTAINER,
            "public_addr": addr,
            "ports": {str(p): q for p, q in mapped.items()},
        }

    def remove(self, member: str) -> dict[str, Any]:
        port = self._port(member)
        if port.member == HOST:
            raise ValueError("the host cannot be removed (close the network instead)")
        self._detach(port)
        killed = netns.remove_netns(port.inner) if port.inner is not None else []
        killed += netns.remove_netns(port.netns) if port.netns is not None else []
        return {"member": member, "killed": killed}

    def _detach(self, port: Port) -> None:
        self.ports.pop(port.member, None)
        self.by_fd.pop(port.fd, None)
        self.by_addr.pop(bytes(int(x) for x in port.addr.split(".")), None)
        with contextlib.suppress(OSError):
            os.close(port.fd)

    def close(self) -> None:
        for port in list(self.ports.values()):
            self._detach(port)
            for ns in (port.inner, port.netns):
                if ns is not None:
                    with contextlib.suppress(Exception):
                        netns.remove_netns(ns)

    def _port(self, member: str) -> Port:
        port = self.ports.get(member)
        if port is None:
            raise ValueError(f"no member {member!r} on this network; members: {sorted(self.ports)}")
        return port

    # --- faults ----------------------------------------------------------------------------------

    def partition(self, member: str, direction: str, seconds: float | None) -> dict[str, Any]:
        port = self._port(member)
        if direction not in ("in", "out", "both"):
            raise ValueError(f"partition direction {direction!r}: expected in, out or both")
        port.cut_in = port.cut_in or direction in ("in", "both")
        port.cut_out = port.cut_out or direction in ("out", "both")
        port.heal_at = time.monotonic() + seconds if seconds else None
        return {"member": member, "cut_in": port.cut_in, "cut_out": port.cut_out}

    def heal(self, member: str | None) -> dict[str, Any]:
        ports = list(self.ports.values()) if member is None else [self._port(member)]
        for port in ports:
            port.cut_in = port.cut_out = False
            port.heal_at = None
        return {"healed": [p.member for p in ports]}

    def stats(self) -> dict[str, Any]:
        return {
            "links": {f"{s}->{d}": link.stats() for (s, d), link in sorted(self.links.items())},
            "unroutable": self.unroutable,
            "members": {p.member: {"addr": p.addr, "netns": p.netns} for p in self.ports.values()},
        }

    # --- the data path ---------------------------------------------------------------------------

    def _link(self, src: str, dst: str) -> Link:
        link = self.links.get((src, dst))
        if link is None:
            link = self.links[(src, dst)] = Link(self.overrides.get((src, dst), self.default))
        return link

    def _lose(self, link: Link) -> bool:
        p = link.profile
        if p.loss == 0.0:
            return False
        if p.loss_corr == 0.0:
            return self.rng.random() < p.loss
        q = p.loss_corr if link.bad else p.loss * (1.0 - p.loss_corr) / (1.0 - p.loss)
        link.bad = self.rng.random() < q
        return link.bad

    def ingress(self, src: Port, packet: bytes, now: float) -> None:
        if len(packet) < 20 or packet[0] >> 4 != 4:
            self.unroutable += 1
            return
        dst = self.by_addr.get(packet[16:20])
        if dst is None or dst is src:
            self.unroutable += 1
            return
        link = self._link(src.member, dst.member)
        link.packets += 1
        link.bytes += len(packet)
        if src.cut_out or dst.cut_in:
            link.cut += 1
            return
        if self._lose(link):
            link.lost += 1
            return
        p = link.profile
        if link.queued >= p.queue:
            link.overflow += 1
            return
        delay = p.delay_ms * 1e-3
        if p.jitter_ms:
            delay = max(0.0, delay + self.rng.uniform(-p.jitter_ms, p.jitter_ms) * 1e-3)
        sent = now
        if p.rate_mbit:
            sent = link.busy_until = max(now, link.busy_until) + len(packet) * 8 / (p.rate_mbit * 1e6)
        due = max(sent + delay, link.last_due)
        link.last_due = due
        if due <= now and not link.queued:  # nothing to wait for: straight through
            self._deliver(link, dst, packet, now)
            return
        link.queued += 1
        self.seq += 1
        heapq.heappush(self.heap, _Due(due, self.seq, now, link, dst, packet))

    def _deliver(self, link: Link, dst: Port, packet: bytes, t_in: float) -> None:
        if self.by_fd.get(dst.fd) is not dst:  # removed while the packet was in flight
            link.cut += 1
            return
        try:
            os.write(dst.fd, packet)
        except OSError:
            link.overflow += 1
            return
        added = time.monotonic() - t_in
        link.delivered += 1
        link.delay_sum += added
        link.delay_max = max(link.delay_max, added)

    def deliver_due(self) -> None:
        now = time.monotonic()
        while self.heap and self.heap[0].due <= now:
            d = heapq.heappop(self.heap)
            d.link.queued -= 1
            self._deliver(d.link, d.dst, d.packet, d.t_in)

    def _heal_due(self, now: float) -> None:
        for port in self.ports.values():
            if port.heal_at is not None and port.heal_at <= now:
                port.cut_in = port.cut_out = False
                port.heal_at = None

    def _timeout(self, now: float) -> float:
        wake = [self.heap[0].due] if self.heap else []
        wake += [p.heal_at for p in self.ports.values() if p.heal_at is not None]
        return max(0.0, min(wake) - now) if wake else 1.0

    # --- control -------------------------------------------------------------------------------

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        try:
            if op == "add":
                out = self.add(str(req["member"]), [int(p) for p in req.get("ports") or []], bool(req.get("server")))
            elif op == "remove":
                out = self.remove(str(req["member"]))
            elif op == "partition":
                out = self.partition(str(req["member"]), str(req["direction"]), req.get("seconds"))
            elif op == "heal":
                m = req.get("member")
                out = self.heal(None if m is None else str(m))
            elif op == "stats":
                out = self.stats()
            else:
                raise ValueError(f"unknown op {op!r}: expected add, remove, partition, heal or stats")
        except Exception as e:
            return {"id": req.get("id"), "ok": False, "error": f"{type(e).__name__}: {e}"}
        return {"id": req.get("id"), "ok": True, **out}

    def _control(self) -> bool:
        """Serve the control lines waiting on stdin; False at EOF."""
        data = os.read(0, 65536)
        if not data:
            return False
        self._buf += data
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            if line.strip():
                try:
                    req = json.loads(line)
                except ValueError as e:
                    reply: dict[str, Any] = {"id": None, "ok": False, "error": f"not a JSON line: {e}"}
                else:
                    reply = self.handle(req)
                _emit(reply)
        return True

    def run(self) -> None:
        while True:
            r, _, _ = select.select([0, *self.by_fd], [], [], self._timeout(time.monotonic()))
            for fd in r:
                if fd == 0:
                    if not self._control():
                        return
                    continue
                port = self.by_fd.get(fd)
                if port is None:
                    continue
                now = time.monotonic()
                for _ in range(_BATCH):
                    try:
                        packet = os.read(fd, 65536)
                    except (BlockingIOError, OSError):
                        break
                    self.ingress(port, packet, now)
            self.deliver_due()
            if any(p.heal_at is not None for p in self.ports.values()):
                self._heal_due(time.monotonic())


def _nat_rules(wan: str, lan: str, inside: str, lan_net: str, forwards: dict[int, int]) -> str:
    """A NAT router's tables (iptables-restore): what leaves ``lan_net`` through ``wan`` is
    masqueraded behind the router's address; each public UDP port of ``forwards`` (container port
    -> public port) is sent on to ``inside``; every other packet from the outside is dropped."""
    dnat = [
        f"-A PREROUTING -i {wan} -p udp --dport {public} -j DNAT --to-destination {inside}:{port}"
        for port, public in forwards.items()
    ]
    return "\n".join(
        [
            "*nat",
            ":PREROUTING ACCEPT [0:0]",
            ":INPUT ACCEPT [0:0]",
            ":OUTPUT ACCEPT [0:0]",
            ":POSTROUTING ACCEPT [0:0]",
            *dnat,
            f"-A POSTROUTING -s {lan_net} -o {wan} -j MASQUERADE",
            "COMMIT",
            "*filter",
            ":INPUT DROP [0:0]",
            ":FORWARD DROP [0:0]",
            ":OUTPUT ACCEPT [0:0]",
            "-A INPUT -i lo -j ACCEPT",
            f"-A INPUT -i {lan} -j ACCEPT",
            "-A INPUT -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
            "-A FORWARD -m conntrack --ctstate ESTABLISHED,RELATED,DNAT -j ACCEPT",
            f"-A FORWARD -i {lan} -o {wan} -j ACCEPT",
            "COMMIT",
            "",
        ]
    )


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


_MAIN_PID = os.getpid()


def _raise_stop(signum: int, frame: object) -> None:
    if os.getpid() != _MAIN_PID:  # a helper pyroute2 forked (netns.create): die as the signal says
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise _Stop(signal.Signals(signum).name)


def _precise_timers() -> None:
    """Ask the kernel for 1 ns timer slack (default 50 us): a 0.2 ms delay should not grow by a quarter."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pytest_ppsmoke.network.switch", description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", required=True, help="device and namespace names: pps<owner pid>-<letter>")
    ap.add_argument("--spec", required=True, help="the network as JSON: {default: profile, overrides: {a->b: profile}}")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    if netns.owner_of(args.prefix + "h") is None or len(args.prefix) + 4 > 15:
        ap.error(f"--prefix {args.prefix!r}: expected pps<pid>-<letters>, short enough for 15-character names")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _raise_stop)
    _precise_timers()
    switch = Switch(args.prefix, json.loads(args.spec), args.seed)
    try:
        _emit(switch.start())
        switch.run()
    except _Stop:
        pass
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut the cleanup short
        switch.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

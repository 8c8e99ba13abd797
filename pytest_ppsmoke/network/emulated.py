"""The emulated network as a :class:`Resource`: the switch process, the members' namespaces.

The orchestrator is the ``host`` member, in the root namespace at ``host_addr`` (10.77.k.1); each
other member gets a namespace with one address (10.77.k.<2+i>) and no route but the network's /24.
A command runs inside a member's namespace through ``member.wrap(argv)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import string
import sys
from dataclasses import dataclass, field
from typing import Any

from ..runtime.localproc import ChildError, ChildProcess, EventKind
from ..runtime.resource import Resource
from . import netns
from .profiles import NetworkSpec

log = logging.getLogger(__name__)

LOOPBACK_ADDR = "127.0.0.1"
_letters = itertools.cycle(string.ascii_lowercase)  # one letter per network of this process


class NetworkError(RuntimeError):
    """The switch refused a request or could not set something up; the message says which and why."""


@dataclass(frozen=True)
class Member:
    """A member of the network: ``name`` (host, 0, 1, ...), its namespace (None: the root
    namespace, or loopback) and the address its endpoint binds and advertises."""

    name: str
    netns: str | None
    addr: str
    public_addr: str | None = None  # behind NAT (the internet profiles): its host's address
    ports: dict[int, int] = field(default_factory=dict)  # behind NAT: UDP port -> the public port forwarded to it

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this member's namespace (unchanged where there is none). The wrapper
        execs the command in place, so its pid, stdin, process group and exit status are the command's."""
        if self.netns is None:
            return list(argv)
        return [sys.executable, "-m", "pytest_ppsmoke.network.nsexec", self.netns, "--", *argv]


class EmulatedNetwork(Resource):
    """Members behind the delay switch, links shaped by ``spec``.

    A loopback spec makes nothing: every member is 127.0.0.1 in the root namespace and ``wrap``
    changes nothing, so callers need no second path. Otherwise ``start`` launches the switch
    (``python -m pytest_ppsmoke.network.switch``), which creates the host's TUN device; ``close``
    ends it (it removes its devices and namespaces) and then removes whatever of this network's
    names is still there, so nothing outlives a close, an exception or a cancelled start. The
    switch also exits, cleaning up, when this process dies however it dies (its stdin closes);
    :func:`sweep` is the last resort for a switch killed as well.
    """

    def __init__(self, spec: NetworkSpec, *, seed: int | None = None, timeout: float = 15.0) -> None:
        self.spec = spec
        self.seed = seed
        self.timeout = timeout
        self.prefix = f"pps{os.getpid()}-{next(_letters)}"
        self.host_addr = LOOPBACK_ADDR
        self.subnet: str | None = None
        self.members: dict[str, Member] = {}
        self.home_netns: str | None = None  # NAT: the orchestrator's namespace, behind the home router
        self.home_addr: str | None = None
        self._left: int | None = None  # while this process is at home: its own namespace to go back to
        self._switch: ChildProcess | None = None
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"EmulatedNetwork({self.spec.name!r}, host={self.host_addr}, members={sorted(self.members)})"

    @property
    def host(self) -> Member:
        return Member("host", None, self.host_addr)

    async def start(self) -> EmulatedNetwork:
        if not self.spec.emulated:
            return self
        why = netns.unavailable(create=False)  # the switch tries a namespace itself: no fork here
        if why is not None:
            raise NetworkError(f"network {self.spec.name!r} cannot be emulated here: {why}")
        argv = [sys.executable, "-m", "pytest_ppsmoke.network.switch", "--prefix", self.prefix]
        argv += ["--spec", json.dumps(self.spec.to_json())]
        if self.seed is not None:
            argv += ["--seed", str(self.seed)]
        self._switch = ChildProcess(f"switch {self.prefix}", argv, os.environ)
        await self._switch.start()
        try:
            ready = await self._switch.wait_event(lambda e: e.kind is EventKind.READY, self.timeout, "switch ready")
        except ChildError as e:
            raise NetworkError(str(e)) from None
        self.host_addr = str(ready["host_addr"])
        self.subnet = str(ready["subnet"])
        self.home_netns, self.home_addr = ready.get("home_netns"), ready.get("home_addr")
        log.info(
            "network %s: %s, host %s (switch pid %d)", self.spec.name, self.subnet, self.host_addr, self._switch.pid
        )
        return self

    async def _request(self, op: str, **args: Any) -> dict[str, Any]:
        sw = self._switch
        if sw is None or sw.proc is None or sw.proc.stdin is None:
            raise NetworkError(f"network {self.spec.name!r} is not started (or is closed): cannot {op}")
        async with self._lock:
            rid = next(self._ids)
            sw.proc.stdin.write((json.dumps({"id": rid, "op": op, **args}) + "\n").encode())
            try:
                await sw.proc.stdin.drain()
                reply = await sw.wait_event(lambda e: e.get("id") == rid, self.timeout, f"its reply to {op}")
            except (ChildError, ConnectionError) as e:
                raise NetworkError(f"the switch of network {self.spec.name!r} failed during {op}: {e}") from None
        if not reply.get("ok"):
            raise NetworkError(f"network {self.spec.name!r}: {op} {args}: {reply.get('error')}")
        return dict(reply.fields)

    async def add_member(self, name: str, ports: list[int] | None = None, server: bool = False) -> Member:
        """A new member ``name`` (``0``, ``1``, ...; ``host`` is the root namespace's, always there).
        On a NAT network a member that is not a ``server`` runs behind its host's address, which
        forwards a public port to each of ``ports`` (UDP)."""
        if name == "host":
            return self.host
        if name in self.members:
            raise NetworkError(f"member {name!r} is already on network {self.spec.name!r}")
        if not self.spec.emulated:
            m = Member(name, None, LOOPBACK_ADDR)
        else:
            reply = await self._request("add", member=name, ports=list(ports or []), server=server)
            mapped = {int(p): int(q) for p, q in reply.get("ports", {}).items()}
            m = Member(name, str(reply["netns"]), str(reply["addr"]), reply.get("public_addr"), mapped)
        self.members[name] = m
        return m

    async def remove_member(self, name: str) -> None:
        """Remove ``name``'s namespace and device; whatever still ran inside it is SIGKILLed."""
        m = self.members.pop(name, None)
        if m is None:
            raise NetworkError(f"no member {name!r} on network {self.spec.name!r}; members: {sorted(self.members)}")
        if m.netns is not None:
            await self._request("remove", member=name)

    async def partition(self, name: str, direction: str = "both", seconds: float | None = None) -> None:
        """Cut ``name`` off: ``in`` (it receives nothing), ``out`` (it sends nothing) or ``both``,
        for ``seconds`` (None or 0: until :meth:`heal`). Packets already on the wire still arrive."""
        if direction not in ("in", "out", "both"):
            raise ValueError(f"partition direction {direction!r}: expected in, out or both")
        self._need_emulated("partition")
        await self._request("partition", member=name, direction=direction, seconds=seconds or None)

    async def heal(self, name: str | None = None) -> None:
        """End ``name``'s partition (None: every member's)."""
        self._need_emulated("heal")
        await self._request("heal", member=name)

    async def stats(self) -> dict[str, dict[str, Any]]:
        """Per directed link (``"host->1"``): packets, bytes, delivered, dropped (lost, partitioned,
        overflow) and the added delay actually measured, mean and max, in ms."""
        if not self.spec.emulated:
            return {}
        reply = await self._request("stats")
        return dict(reply["links"])

    def _need_emulated(self, what: str) -> None:
        if not self.spec.emulated:
            raise NetworkError(f"network {self.spec.name!r} is loopback: there is no link to {what}")

    def enter_home(self) -> None:
        """Put this process behind the home NAT: its main thread moves into the orchestrator's
        namespace, and every thread it starts from now on, with every socket, is made there.
        Must come before the process starts iroh (whose runtime threads would stay where they
        were made: NetworkError says so); :meth:`close` brings the thread back."""
        if self.home_netns is None:
            raise NetworkError(f"network {self.spec.name!r} has no home NAT to enter")
        if self._left is not None:
            return
        started = netns.iroh_threads()
        if started:
            raise NetworkError(
                f"network {self.spec.name!r} puts the orchestrator behind a NAT, but this process already runs "
                f"iroh ({started} runtime threads, which stay in the namespace they were made in): run it in a "
                "process of its own (pp-smoke-run, or a pytest session of its own)"
            )
        self._left = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            netns.setns(self.home_netns)
        except BaseException:
            os.close(self._left)
            self._left = None
            raise
        log.info("this process is now behind the home NAT of network %s (%s)", self.spec.name, self.home_addr)

    def leave_home(self) -> None:
        """Back to the namespace :meth:`enter_home` left (a no-op if it did not)."""
        fd, self._left = self._left, None
        if fd is not None:
            try:
                netns.setns_fd(fd)
            finally:
                os.close(fd)

    async def close(self) -> None:
        self.leave_home()  # first: the switch SIGKILLs what is still inside its namespaces
        sw, self._switch = self._switch, None
        try:
            if sw is not None and sw.proc is not None:
                if sw.proc.stdin is not None:
                    with contextlib.suppress(Exception):
                        sw.proc.stdin.close()  # the switch's cue to clean up and exit
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(sw.proc.wait()), self.timeout)
                await sw.stop(grace=2.0)
        finally:
            self.members.clear()
            await asyncio.to_thread(self._remove_leftovers)

    def _remove_leftovers(self) -> None:
        if not self.spec.emulated:
            return
        for name in netns.netns_names():
            if name.startswith(self.prefix):
                with contextlib.suppress(Exception):
                    netns.remove_netns(name)
        with contextlib.suppress(Exception):
            for ifname in netns.root_links():
                if ifname.startswith(self.prefix):
                    netns.delete_root_link(ifname)

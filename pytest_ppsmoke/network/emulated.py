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
from dataclasses import dataclass
from typing import Any

from ..runtime.localproc import ChildError, ChildProcess
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
            ready = await self._switch.wait_event(lambda e: e.get("event") == "ready", self.timeout, "switch ready")
        except ChildError as e:
            raise NetworkError(str(e)) from None
        self.host_addr = str(ready["host_addr"])
        self.subnet = str(ready["subnet"])
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
        return reply

    async def add_member(self, name: str) -> Member:
        """A new member ``name`` (``0``, ``1``, ...; ``host`` is the root namespace's, always there)."""
        if name == "host":
            return self.host
        if name in self.members:
            raise NetworkError(f"member {name!r} is already on network {self.spec.name!r}")
        if not self.spec.emulated:
            m = Member(name, None, LOOPBACK_ADDR)
        else:
            reply = await self._request("add", member=name)
            m = Member(name, str(reply["netns"]), str(reply["addr"]))
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

    async def close(self) -> None:
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

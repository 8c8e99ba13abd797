"""``pp-fake-vast``: an emulator of vast.ai's REST API whose instances are local node processes.

:class:`FakeVast` holds the emulator's state (the catalogue, the instances, the faults, the
calls it answered) and starts and closes it: the API (:mod:`.api`) on loopback, an emulated
network if asked for, the instances' runtime (:mod:`.runtimes`) and the host-loss scheduler
(:mod:`.faults`). The package's docstring describes the whole.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import inspect
import json
import logging
import os
import secrets
import shlex
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from ... import failpoints
from ...nodeenv import NodeEnv
from ...runtime.resource import Resource
from . import api, apidoc, catalogue, instances, registry
from .catalogue import default_catalogue
from .faults import HostLoss, RateLimiter, loses_hosts
from .instances import Instance
from .runtimes import Runtime

log = logging.getLogger(__name__)

RUNTIMES = registry.NAMES


class FakeVast(Resource):
    """The emulator: ``async with FakeVast(...) as vast`` serves vast.ai's API at ``vast.url`` for
    ``vast.api_key``. ``runtime``: a name in :data:`RUNTIMES`, or a :class:`Runtime` class."""

    def __init__(
        self,
        *,
        api_key: str | None = None,
        catalogue: Iterable[Mapping[str, Any]] | None = None,
        faults: str | Mapping[str, Any] | failpoints.Scenario | None = None,
        node_argv: list[str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        gpus: list[str] | None = None,
        runtime: str | type[Runtime] = "processes",
        network: str = "loopback",
        credit: float = 100.0,
        pull_mbps: float | None = None,
    ) -> None:
        kind: type[Runtime] = registry.load(runtime) if isinstance(runtime, str) else runtime
        self.runtime = kind.name
        self.runs = kind.for_network(network)(self)  # ValueError: this runtime has no place on an emulated network
        self.api_key = api_key or "fake-" + secrets.token_hex(16)
        self.gpus = gpus  # this host's GPUs: each instance gets one (CUDA_VISIBLE_DEVICES), in turn
        self.credit = credit  # the account's credit in $, as users/current shows it
        if pull_mbps is not None and pull_mbps <= 0:
            raise ValueError(f"pull_mbps must be positive (Mbit/s), got {pull_mbps}")
        self.pull_mbps = pull_mbps  # the hosts' download speed: an image pull takes its size over it
        self.catalogue = [dict(o) for o in (catalogue if catalogue is not None else default_catalogue())]
        # faults: failpoints.parse validates them; none given: this process's (PP_FAILPOINTS)
        self.faults = failpoints.active() if faults is None else failpoints.parse(faults)
        self.node_argv = node_argv or [sys.executable, "-m", "pytest_ppsmoke.stage.gpu_node"]
        self.host, self.port = host, port
        self.instances: dict[int, Instance] = {}  # live: rented and not destroyed
        self.lingering: dict[int, Instance] = {}  # destroyed, still listed (vast.destroy_linger)
        self.destroyed: list[Instance] = []
        self.requests: list[tuple[str, str, int]] = []  # method, path, status
        self.violations: list[apidoc.Violation] = []  # calls that broke vast.ai's description (apidoc)
        self.limiter = RateLimiter(self.faults.value("vast.rate_limit"))
        self.creates = 0  # create calls answered or held, counted from 1
        self._next_id = 12_400_000
        self._runner: web.AppRunner | None = None
        self.container_prefix = f"pp-fake-vast-{os.getpid()}-{secrets.token_hex(3)}-"  # + the instance's id
        self._watch: asyncio.Task[None] | None = None
        self._stopping: set[asyncio.Future[None]] = set()
        self._released = asyncio.Event()
        self.url = ""
        # an emulated network (pytest_ppsmoke.network): each instance's node in a namespace of its own,
        # the orchestrator on the root namespace's "host" address, this API on an "api" member of its own
        # (so that cutting the orchestrator off leaves the nodes their way to destroy themselves)
        self.network_spec = network
        self.isolated_until = 0.0  # vast.isolate_orchestrator: the account's calls get no answer until then
        self.host_losses: list[dict[str, Any]] = []  # what HostLoss did to which instance, and when (epoch s)
        self.network: Any = None  # an EmulatedNetwork once started
        self.node_url = ""  # the URL nodes reach this API at (the network's api member; else self.url)

    def __repr__(self) -> str:
        return f"FakeVast({self.url or 'not started'}, {len(self.instances)} live)"

    def app(self) -> web.Application:
        return api.app(self)

    async def start(self) -> str:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        port = self._runner.addresses[0][1]  # the real port when asked for 0
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = self.node_url = f"http://{host}:{port}"
        if self.network_spec != "loopback":
            await self._start_network()
        if loses_hosts(self.faults):
            self._watch = asyncio.ensure_future(HostLoss(self, self.runs).run())
        return self.url

    async def _start_network(self) -> None:
        """The emulated network, and this API on its "api" member: a listening socket made inside
        that member's namespace (by a thread that enters it), served by the same application."""
        from ...network import EmulatedNetwork, parse_network, sweep

        assert self._runner is not None
        swept = await asyncio.to_thread(sweep)  # what killed runs left: never a live run's
        if swept:
            log.warning("removed what killed runs left of their networks: %s", ", ".join(swept))
        self.network = EmulatedNetwork(parse_network(self.network_spec))
        await self.network.start()
        member = await self.network.add_member("api", server=True)
        sock = await _in_new_thread(_listen_in, member.netns, member.addr)
        site = web.SockSite(self._runner, sock)
        await site.start()
        self.node_url = f"http://{member.addr}:{sock.getsockname()[1]}"

    def release(self) -> None:
        """Answer the create calls held by the failpoint ``vast.hold_create``."""
        self._released.set()

    async def held(self) -> None:
        """Until :meth:`release`: where a held create call waits."""
        await self._released.wait()

    async def close(self) -> None:
        """Stop the server and every instance still running; nothing outlives the emulator."""
        self.release()
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await asyncio.gather(
            *(instances.stop(i, self.runs) for i in list(self.instances.values())),
            *self._stopping,
            return_exceptions=True,
        )
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.network is not None:
            await self.network.close()
            self.network = None

    async def torn_down(self, timeout: float = 60.0) -> None:
        """Wait until every destroy so far has finished behind its answer: its process reaped, its
        working container removed (a destroy's answer comes first, as vast.ai's does)."""
        if self._stopping:
            await asyncio.wait_for(asyncio.gather(*list(self._stopping), return_exceptions=True), timeout)

    # --- the instances ---------------------------------------------------------------------------

    def live(self) -> list[Instance]:
        """The instances rented and not destroyed (lingering ones are destroyed: not here)."""
        return list(self.instances.values())

    def listed(self) -> list[Instance]:
        """What vast.ai lists, by id: the live instances and the destroyed ones still lingering."""
        self.purge()
        return sorted([*self.instances.values(), *self.lingering.values()], key=lambda i: i.id)

    def purge(self) -> None:
        """Forget the lingering instances whose time is up, and free their offers."""
        now = time.monotonic()
        for inst in [i for i in self.lingering.values() if i.linger_until <= now]:
            del self.lingering[inst.id]
            catalogue.free(inst.offer)

    def find(self, iid: int, lingering: bool = True) -> Instance | None:
        """Instance ``iid``: a live one, or (``lingering``) a destroyed one still listed."""
        self.purge()
        return self.instances.get(iid) or (self.lingering.get(iid) if lingering else None)

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def rent(self, inst: Instance) -> Instance:
        """``inst`` rents its offer and boots."""
        catalogue.rent(inst.offer)
        # each port asked for, forwarded from a random public one (on an emulated internet, the
        # network's NAT assigns them when the node starts; elsewhere nothing forwards them: the
        # nodes run the transport's local mode and never use them)
        inst.public_ports = {f"{p}/{proto}": secrets.SystemRandom().randint(20000, 59999) for p, proto in inst.ports}
        self.instances[inst.id] = inst
        inst.heartbeat_gap = self.faults.value("vast.heartbeat_gap").get(inst.stage, 0.0)
        inst.late_ports = self.faults.value("vast.late_ports")
        inst.boot = asyncio.ensure_future(instances.boot(inst, self.runs, self.faults))
        log.info("created instance %d from offer %d (%s)", inst.id, inst.offer["id"], inst.label)
        return inst

    def destroy(self, inst: Instance) -> None:
        """``inst`` is destroyed: vast.ai answers at once and tears the container down behind the
        answer (:meth:`torn_down` waits for that); with vast.destroy_linger it stays listed."""
        del self.instances[inst.id]
        linger = self.faults.value("vast.destroy_linger")
        inst.destroyed(linger)
        if linger:  # still listed, going away, until then; its offer stays taken as long
            self.lingering[inst.id] = inst
        else:
            catalogue.free(inst.offer)
        self.destroyed.append(inst)
        stopping = asyncio.ensure_future(instances.stop(inst, self.runs))
        self._stopping.add(stopping)
        stopping.add_done_callback(self._stopping.discard)


async def _in_new_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a thread of its own that then ends: for a call that changes its thread's
    namespace, which must never happen to a pooled thread that later runs other work."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not done.done():
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # handed to the waiting coroutine
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name="pp-netns", daemon=True).start()
    return await asyncio.wait_for(done, 30)


def _listen_in(netns: str, addr: str) -> socket.socket:
    """A listening TCP socket on ``addr`` (any port) inside the named network namespace: made by
    the calling thread after it entered the namespace (``setns`` moves only that thread), so run
    it in a thread of its own. The socket stays in the namespace; the thread's namespace does not
    matter afterwards, since the thread ends."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{netns}") as ns:
        if libc.setns(ns.fileno(), CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot enter network namespace {netns}: {os.strerror(err)}")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, 0))
    sock.listen(128)
    sock.setblocking(False)
    return sock


CLONE_NEWNET = 0x40000000


def main(argv: list[str] | None = None) -> None:
    # The flags are the emulator's own, not the settings table's: cloud/ sits below the harness, and
    # pp-fake-vast is a server for any vast.ai client. Where a flag takes a setting's value (--runtime,
    # --gpus, --network) it takes the same names (registry.NAMES, the network profiles); every default
    # is FakeVast's own, read from its signature.
    defaults = {k: v.default for k, v in inspect.signature(FakeVast).parameters.items()}
    p = argparse.ArgumentParser(prog="pp-fake-vast", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--host", default=defaults["host"], help="an IP literal on loopback (default %(default)s)")
    p.add_argument("--port", type=int, default=defaults["port"], help="0 picks a free port (default %(default)s)")
    p.add_argument(
        "--faults",
        default=None,
        help="failpoints, as in PP_FAILPOINTS (its default), e.g. 'vast.reject_create=2;vast.no_join=1'",
    )
    p.add_argument("--catalogue", type=Path, help="a JSON file with a list of offers (default: a built-in set)")
    p.add_argument("--node-command", default="", help="what an instance runs (default: pp-gpu-node in this Python)")
    p.add_argument(
        "--runtime",
        choices=RUNTIMES,
        default=defaults["runtime"],
        help="an instance is a node process (processes) or the image it names, run by buildah (image) "
        "(default %(default)s)",
    )
    p.add_argument("--gpus", default="", help="this host's GPUs, e.g. 0,1: each instance gets one in turn")
    p.add_argument(
        "--credit", type=float, default=defaults["credit"], help="the account's credit in $ (default %(default)s)"
    )
    p.add_argument(
        "--pull-mbps", type=float, default=defaults["pull_mbps"],
        help="the hosts' download speed in Mbit/s: an image's pull lasts its compressed size over it (--runtime image)",
    )  # fmt: skip
    p.add_argument(
        "--network",
        default=defaults["network"],
        help="the network between the nodes: loopback or an emulated profile (lan, wan, far, slow, "
        "flaky; per-link overrides as in docs/network.md); needs root (default %(default)s)",
    )
    args = p.parse_args(argv)
    if args.host not in ("127.0.0.1", "::1", "localhost"):
        p.error(f"--host must be loopback (127.0.0.1 or ::1), got {args.host!r}: the emulator runs local processes")
    try:
        faults = failpoints.parse(args.faults) if args.faults is not None else failpoints.active()
        level = NodeEnv.from_env(only=("log_level",)).log_level
        catalogue = json.loads(args.catalogue.read_text()) if args.catalogue else None
    except (ValueError, OSError) as e:
        p.error(str(e))
    logging.basicConfig(level=level, stream=sys.stderr)
    # the key: from VAST_API_KEY if set (so clients can be pointed at us), else a fresh one
    api_key = os.environ.get("VAST_API_KEY") or None

    async def serve() -> None:
        vast = FakeVast(
            api_key=api_key,
            catalogue=catalogue,
            faults=faults,
            node_argv=shlex.split(args.node_command) or None,
            host=args.host,
            port=args.port,
            gpus=[g for g in args.gpus.split(",") if g] or None,
            runtime=args.runtime,
            network=args.network,
            credit=args.credit,
            pull_mbps=args.pull_mbps,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with vast:
            print(vast.url, flush=True)
            if api_key is None:
                print(f"api key: {vast.api_key}", flush=True)
            await stop.wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()

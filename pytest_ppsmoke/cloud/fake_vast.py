"""``pp-fake-vast``: an emulator of vast.ai's REST API whose instances are local node processes.

    async with FakeVast(faults="vast.reject_create=2") as vast:   # vast.url, vast.api_key
        ...  # a VastClient, pp-smoke-run --vast-url, or the official vastai CLI

It serves the paths, methods, JSON fields, status values and error codes that vast.ai serves
(as its official client, ``vastai`` 1.9, calls them): ``POST /api/v0/bundles/`` (offers from a
catalogue, filtered by the query's ``{field: {op: value}}`` and ordered), ``PUT
/api/v0/asks/{id}/`` (create), ``GET``/``PUT``/``DELETE /api/v0/instances/{id}/`` (show, label,
destroy), ``GET /api/v0/instances/`` and the
paginated ``GET /api/v1/instances/``. Every call needs ``Authorization: Bearer <key>``.

An instance is a ``pp-gpu-node`` process started with the create call's ``env`` plus what
vast.ai's host agent gives a container (``NodeEnv.container_id`` and ``container_api_key``, a key
that may act on that instance only) and ``vast_url``. Its ``actual_status`` goes null -> ``loading`` ->
``running`` (process started) -> ``exited`` (process gone). A record also carries vast.ai's
``intended_status`` (what the owner wants: running, stopped once destroyed), ``cur_state`` (the
contract: running while its container lives) and ``next_state`` (where it is headed); an instance
whose process crashed is ``exited`` but still intended running. Destroy kills its process group and
frees the offer; destroying an unknown instance is HTTP 404 ``not_found`` ("Instance not found"),
vast.ai's way of saying it is gone. Closing the emulator kills whatever is left, and the nodes
also exit when the emulator's process dies (stdin EOF), so nothing outlives it.

``runtime="image"`` (``--runtime image``) runs each instance as vast.ai does: a working container
of the image the create call names (built here by ``python -m pytest_ppsmoke.cloud.image``; never
pulled), its entrypoint under ``buildah run`` as the image's user, with only the instance's
environment (the create call's and the host agent's, no variable of this process), on the host's
network, so the emulator's loopback URL and the cluster's ports are the same as for a process. A
model given as a file on this machine (``MODEL``) is copied into the container at the same path,
owned by the image's user, as a fetched model would lie on the instance's disk. Destroy kills
the container's process group and removes the working container.

Faults are failpoints (``pytest_ppsmoke/failpoints.py``, the ``vast.*`` points), one or more for
each row of the spec's error table: ``FakeVast(faults=...)`` takes them in PP_FAILPOINTS's form or
as a mapping; without it, the emulator takes this process's (PP_FAILPOINTS, ``failpoints.scoped``).
Instances are picked by their stage (``NodeEnv.stage`` in the create call's env), create calls by
their number (1-based). Symptoms only a node can show are switched on in that node's environment
(``NodeEnv.failpoints``). vast.ai's own misbehaviour, each off by default:

- ``vast.rate_limit``: per endpoint and per identity (the key and the client's address: the
  account key and a container's key count apart), a call within the endpoint's threshold of the
  last one let through gets HTTP 429, and so does every call for the penalty that follows; the
  body is plain text (``API requests too frequent endpoint threshold=4.5``), with no Retry-After.
- ``vast.race_offers``: that create call finds its offer rented by someone else between search and
  create: HTTP 404 ``no_such_ask`` ("Offer N is not available") or 410 ("... is no longer
  available"); the offer stays rented, so later searches no longer return it.
- ``vast.destroy_linger``: a destroyed instance stays listed (show and both lists) that long, going
  away (``intended_status`` and ``next_state`` "stopped"; ``cur_state`` "running" until its process
  has ended, then "stopped"; ``actual_status`` as the process is: running, then exited); destroying
  it again answers success. :meth:`FakeVast.live` leaves it out: it is destroyed.
- ``vast.destroy_ignored``: a destroy answered success that does nothing (still running, intended
  running).
- ``vast.lose_host``: mid-run (after ``vast.kill_after_tokens`` sampled tokens) a stage's host dies:
  ``offline`` freezes its node's process group (SIGSTOP; "host N stopped answering"), ``exited``
  kills it ("host N failed"); intended still running. A destroy then kills the node at once (no
  stop grace). In the image runtime the same signals go to ``buildah run``'s process group, which
  holds the container's processes (chroot isolation).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import logging
import os
import secrets
import shlex
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from .. import failpoints
from ..nodeenv import NodeEnv, process_env
from ..protocol import VAST_ENDPOINTS
from ..runtime.localproc import ChildProcess
from ..runtime.resource import Resource
from ..runtime.transport import PeerAddr
from . import image as images

log = logging.getLogger(__name__)

RUNTIMES = ("processes", "image")  # what an instance is: a node process, or the image in a container
TEST_TAG = "PPSMOKE_TEST_TAG"  # tests/helpers.py's: a container's processes carry it too
UNREACHABLE = "127.0.0.1:9"  # discard port: nothing answers QUIC there
NETWORK_PATH = "/ppsmoke/network"  # the emulator's own path: the emulated network's host address


def default_catalogue() -> list[dict[str, Any]]:
    """Offers shaped like vast.ai's: single-GPU machines of a few kinds, and some that a careful
    query must skip (unverified, unreliable, two GPUs, an old CUDA)."""
    kinds = [
        # gpu_name, gpu_ram MB, dph_total, reliability, cuda, verified, num_gpus, geolocation
        ("RTX 3090", 24576, 0.21, 0.995, 12.4, True, 1, "Poland, PL"),
        ("RTX 4090", 24564, 0.34, 0.998, 12.6, True, 1, "Sweden, SE"),
        ("RTX 4090", 24564, 0.36, 0.991, 12.6, True, 1, "Texas, US"),
        ("A100 SXM4", 81920, 1.05, 0.997, 12.4, True, 1, "Oregon, US"),
        ("H100 SXM", 81559, 2.19, 0.999, 12.8, True, 1, "Quebec, CA"),
        ("RTX 3090", 24576, 0.12, 0.97, 12.2, False, 1, "Vietnam, VN"),
        ("RTX 3080", 10240, 0.09, 0.81, 12.0, True, 1, "Ohio, US"),
        ("RTX 4090", 24564, 0.68, 0.996, 12.6, True, 2, "Norway, NO"),
        ("GTX 1080 Ti", 11264, 0.07, 0.99, 11.4, True, 1, "Brazil, BR"),
    ]
    offers = []
    for i, (gpu, ram, dph, rel, cuda, verified, n, geo) in enumerate(kinds):
        oid = 4_100_000 + 17 * i
        offers.append(
            {
                "id": oid,
                "ask_contract_id": oid,
                "bundle_id": 900_000 + i,
                "machine_id": 31_000 + i,
                "host_id": 7_000 + i,
                "gpu_name": gpu,
                "num_gpus": n,
                "gpu_ram": ram,
                "gpu_total_ram": ram * n,
                "gpu_frac": 1.0,
                "gpu_arch": "nvidia",
                "compute_cap": 860,
                "cpu_name": "AMD EPYC 7543 32-Core Processor",
                "cpu_cores": 32,
                "cpu_cores_effective": 8.0 * n,
                "cpu_ram": 64_000 * n,
                "disk_space": 200.0,
                "disk_bw": 2000.0,
                "disk_name": "nvme",
                "dph_base": round(dph * 0.9, 4),
                "dph_total": dph,
                "storage_cost": 0.1,
                "inet_up": 800.0,
                "inet_down": 900.0,
                "inet_up_cost": 0.0,
                "inet_down_cost": 0.0,
                "reliability": rel,
                "reliability2": rel,
                "cuda_max_good": cuda,
                "driver_version": "550.54.14",
                "verification": "verified" if verified else "unverified",
                "verified": verified,
                "rentable": True,
                "rented": False,
                "external": False,
                "geolocation": geo,
                "dlperf": 40.0 * n,
                "dlperf_per_dphtotal": round(40.0 * n / dph, 2),
                "total_flops": 80.0 * n,
                "pcie_bw": 24.0,
                "direct_port_count": 50,
                "duration": 2_592_000.0,
                "min_bid": round(dph * 0.5, 4),
                "is_bid": False,
                "start_date": 1.7e9,
                "end_date": 1.8e9,
                "static_ip": True,
                "hosting_type": 0,
                "public_ipaddr": "127.0.0.1",
                "score": 100.0 - i,
            }
        )
    return offers


OPS: dict[str, Callable[[Any, Any], bool]] = {
    "eq": lambda a, b: a == b,
    "neq": lambda a, b: a != b,
    "gt": lambda a, b: a > b,
    "gte": lambda a, b: a >= b,
    "lt": lambda a, b: a < b,
    "lte": lambda a, b: a <= b,
    "in": lambda a, b: a in b,
    "notin": lambda a, b: a not in b,
    "nin": lambda a, b: a not in b,
}
QUERY_META = {"order", "type", "limit", "allocated_storage", "disable_bundling", "extra_ids"}


def _coerce(have: Any, want: Any) -> Any:
    """The CLI sends some numbers and booleans as strings ("1", "0.99", "true")."""
    if isinstance(want, list):
        return [_coerce(have, w) for w in want]
    if isinstance(have, bool) and isinstance(want, str):
        return want.lower() == "true"
    if isinstance(have, (int, float)) and not isinstance(have, bool) and isinstance(want, str):
        try:
            return float(want)
        except ValueError:
            return want
    return want


def match_offer(offer: Mapping[str, Any], query: Mapping[str, Any]) -> bool:
    for fld, cond in query.items():
        if fld in QUERY_META or not isinstance(cond, dict):
            continue
        if fld not in offer:
            continue  # vast.ai ignores fields it does not know as filters
        for op, want in cond.items():
            if op not in OPS:
                raise ValueError(f"unknown operator {op!r} for {fld}; expected one of {', '.join(OPS)}")
            have = offer[fld]
            try:
                if not OPS[op](have, _coerce(have, want)):
                    return False
            except TypeError:
                return False
    return True


@dataclass
class Instance:
    id: int
    number: int  # create order, 1-based
    offer: dict[str, Any]
    image: str
    env: dict[str, str] = field(repr=False)
    label: str | None
    disk: float
    onstart: str | None
    args: list[str]
    container_key: str = field(repr=False)
    created_at: float = field(default_factory=time.time)
    actual_status: str | None = None
    status_msg: str = ""
    destroyed_at: float | None = None
    proc: ChildProcess | None = None
    container: images.Container | None = None  # runtime "image": its working container
    boot: asyncio.Task[None] | None = None
    destroy_attempts: int = 0
    lost: str | None = None  # its host died (vast.lose_host): "offline" or "exited"
    member: str | None = None  # its node's member of the emulated network, if there is one
    linger_until: float = 0.0  # destroyed: listed until then (time.monotonic())

    @property
    def stage(self) -> int | None:
        """The stage its node will be (unset: 0, as the node reads it); None if it cannot be one."""
        try:
            return NodeEnv.from_env(self.env, only=("stage", "num_stages")).stage
        except ValueError:
            return None

    @property
    def ended(self) -> bool:
        """Whether its process (or container) has ended, or never started and never will."""
        return self.actual_status == "exited" or (
            self.proc is not None and self.proc.proc is not None and self.proc.proc.returncode is not None
        )

    def states(self) -> tuple[str, str, str]:
        """``intended_status``, ``cur_state`` and ``next_state`` as vast.ai shows them: what the
        owner wants (running until destroyed, then stopped), the contract's state (running while
        its container lives) and where it is headed. A crashed instance is still intended running."""
        if self.destroyed_at is not None:  # on its way out
            return "stopped", "stopped" if self.ended else "running", "stopped"
        return "running", "stopped" if self.ended else "running", "running"

    def record(self) -> dict[str, Any]:
        """The instance as vast.ai shows it."""
        o = self.offer
        running = self.actual_status == "running"
        intended, cur, nxt = self.states()
        return {
            "id": self.id,
            "machine_id": o["machine_id"],
            "host_id": o["host_id"],
            "bundle_id": o["bundle_id"],
            "actual_status": self.actual_status,
            "intended_status": intended,
            "cur_state": cur,
            "next_state": nxt,
            "status_msg": self.status_msg,
            "label": self.label,
            "image_uuid": self.image,
            "image_runtype": "args",
            "image_args": self.args,
            "onstart": self.onstart,
            "extra_env": [[k, v] for k, v in self.env.items()],
            "template_id": None,
            "template_name": None,
            "volume_info": [],
            "gpu_name": o["gpu_name"],
            "num_gpus": o["num_gpus"],
            "gpu_ram": o["gpu_ram"],
            "gpu_totalram": o["gpu_total_ram"],
            "gpu_util": 0.0 if running else None,
            "gpu_temp": 40.0 if running else None,
            "gpu_arch": o["gpu_arch"],
            "cpu_name": o["cpu_name"],
            "cpu_cores": o["cpu_cores"],
            "cpu_cores_effective": o["cpu_cores_effective"],
            "cpu_ram": o["cpu_ram"],
            "cpu_util": 0.0,
            "mem_usage": 0.0,
            "mem_limit": o["cpu_ram"],
            "disk_space": self.disk,
            "disk_usage": 0.0,
            "disk_util": 0.0,
            "dph_base": o["dph_base"],
            "dph_total": o["dph_total"],
            "storage_cost": o["storage_cost"],
            "inet_up": o["inet_up"],
            "inet_down": o["inet_down"],
            "inet_up_cost": o["inet_up_cost"],
            "inet_down_cost": o["inet_down_cost"],
            "reliability2": o["reliability2"],
            "cuda_max_good": o["cuda_max_good"],
            "driver_version": o["driver_version"],
            "compute_cap": o["compute_cap"],
            "geolocation": o["geolocation"],
            "verification": o["verification"],
            "public_ipaddr": "127.0.0.1",
            "local_ipaddrs": "127.0.0.1",
            "ports": {},
            "ssh_host": "127.0.0.1",
            "ssh_port": None,
            "ssh_idx": None,
            "direct_port_start": -1,
            "direct_port_end": -1,
            "direct_port_count": o["direct_port_count"],
            "machine_dir_ssh_port": None,
            "start_date": self.created_at,
            "end_date": o["end_date"],
            "duration": o["duration"],
            "is_bid": False,
            "min_bid": o["min_bid"],
            "time_remaining": "",
            "time_remaining_isbid": "",
            "client_run_time": 0.0,
            "host_run_time": 0.0,
            "dlperf": o["dlperf"],
            "dlperf_per_dphtotal": o["dlperf_per_dphtotal"],
            "total_flops": o["total_flops"],
            "pcie_bw": o["pcie_bw"],
            "disk_bw": o["disk_bw"],
            "logo": "/static/logos/nvidia.png",
            "webpage": None,
            "jupyter_token": None,
        }


class RateLimiter:
    """vast.ai's rate limits: a minimum interval between calls, per endpoint and per identity
    (the key and the client's address). A call sooner than ``threshold`` after the last call let
    through is refused, and so is every call until ``penalty`` seconds after that refusal
    (refusals do not move it); ``limits``: endpoint name -> (threshold, penalty)."""

    def __init__(self, limits: Mapping[str, tuple[float, float]], clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.clock = dict(limits), clock
        self._last: dict[tuple[str, str], float] = {}  # the last call let through
        self._penalty: dict[tuple[str, str], float] = {}  # refused until then
        self.refused: dict[str, int] = {}  # by endpoint

    def refuse(self, endpoint: str, identity: str) -> str | None:
        """None to let the call through, else the 429's text."""
        if endpoint not in self.limits:
            return None
        threshold, penalty = self.limits[endpoint]
        now, key = self.clock(), (endpoint, identity)
        last = self._last.get(key)
        if now < self._penalty.get(key, 0.0) or (last is not None and now - last < threshold):
            if now >= self._penalty.get(key, 0.0):
                self._penalty[key] = now + penalty
            self.refused[endpoint] = self.refused.get(endpoint, 0) + 1
            return f"API requests too frequent endpoint threshold={threshold:g}"
        self._last[key] = now
        return None


def endpoint_of(request: web.Request) -> str | None:
    """The request's endpoint name in :data:`VAST_ENDPOINTS` (None: a path it does not name)."""
    info = request.match_info.route.resource
    return VAST_ENDPOINTS.get((request.method, info.canonical)) if info is not None else None


def _json(data: Any, status: int = 200) -> web.Response:
    # exactly "application/json": the official CLI rejects the offers answer otherwise, and
    # aiohttp's json_response would add "; charset=utf-8"
    return web.Response(body=json.dumps(data).encode(), status=status, headers={"Content-Type": "application/json"})


def _error(status: int, error: str, msg: str) -> web.Response:
    return _json({"success": False, "error": error, "msg": msg}, status)


class FakeVast(Resource):
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
        runtime: str = "processes",
        network: str = "loopback",
    ) -> None:
        if runtime not in RUNTIMES:
            raise ValueError(f"unknown runtime {runtime!r}; expected one of {', '.join(RUNTIMES)}")
        self.runtime = runtime
        self.api_key = api_key or "fake-" + secrets.token_hex(16)
        self.gpus = gpus  # this host's GPUs: each instance gets one (CUDA_VISIBLE_DEVICES), in turn
        self.catalogue = [dict(o) for o in (catalogue if catalogue is not None else default_catalogue())]
        # faults: failpoints.parse validates them; none given: this process's (PP_FAILPOINTS)
        self.faults = failpoints.active() if faults is None else failpoints.parse(faults)
        self.node_argv = node_argv or [sys.executable, "-m", "pytest_ppsmoke.stage.gpu_node"]
        self.host, self.port = host, port
        self.instances: dict[int, Instance] = {}  # live: rented and not destroyed
        self.lingering: dict[int, Instance] = {}  # destroyed, still listed (vast.destroy_linger)
        self.destroyed: list[Instance] = []
        self.requests: list[tuple[str, str, int]] = []  # method, path, status
        self.limiter = RateLimiter(self.faults.value("vast.rate_limit"))
        self._creates = 0
        self._next_id = 12_400_000
        self._runner: web.AppRunner | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="pp-fake-vast-")
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
        self.network: Any = None  # an EmulatedNetwork once started
        self.node_url = ""  # the URL nodes reach this API at (the network's api member; else self.url)
        if network != "loopback" and runtime != "processes":
            raise ValueError(f"an emulated network ({network!r}) runs node processes; the runtime {runtime!r} is not")

    def __repr__(self) -> str:
        return f"FakeVast({self.url or 'not started'}, {len(self.instances)} live)"

    # --- server ------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._gate])
        r = app.router
        r.add_get("/api/v0/gpu_names/unique/", self.gpu_names)  # the CLI asks at start, with no key
        r.add_get("/api/v0/users/current", self.current_user)
        r.add_get("/api/v0/instances/filters/", self.instance_filters)
        r.add_post("/api/v0/bundles/", self.search_offers)
        r.add_delete("/api/v0/instances/", self.destroy_instances)
        r.add_put("/api/v0/asks/{id}/", self.create_instance)
        r.add_get("/api/v0/instances/", self.list_v0)
        r.add_get("/api/v1/instances/", self.list_v1)
        r.add_get("/api/v0/instances/{id}/", self.show_instance)
        r.add_put("/api/v0/instances/{id}/", self.update_instance)
        r.add_delete("/api/v0/instances/{id}/", self.destroy_instance)
        r.add_get(NETWORK_PATH, self.network_info)  # the emulator's own, not vast.ai's
        return app

    async def network_info(self, request: web.Request) -> web.Response:
        """The emulated network an orchestrator of these instances must join (``pp-smoke-run
        --local --vast-url URL --network ...``): its description and the host address to bind."""
        net = self.network
        if net is None:
            return _error(404, "no_network", "this emulator runs its nodes on loopback (start it with --network)")
        return _json({"spec": net.spec.name, "host_addr": net.host_addr, "subnet": net.subnet})

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
        f = self.faults
        if (
            f.on("vast.kill_stage")
            or f.value("vast.lose_host")
            or f.value("vast.partition")
            or f.on("vast.isolate_orchestrator")
        ):
            self._watch = asyncio.ensure_future(self._lose_hosts())
        return self.url

    async def _start_network(self) -> None:
        """The emulated network, and this API on its "api" member: a listening socket made inside
        that member's namespace (by a thread that enters it), served by the same application."""
        from ..network import EmulatedNetwork, parse_network, sweep

        assert self._runner is not None
        swept = await asyncio.to_thread(sweep)  # what killed runs left: never a live run's
        if swept:
            log.warning("removed what killed runs left of their networks: %s", ", ".join(swept))
        self.network = EmulatedNetwork(parse_network(self.network_spec))
        await self.network.start()
        api = await self.network.add_member("api")
        sock = await _in_new_thread(_listen_in, api.netns, api.addr)
        site = web.SockSite(self._runner, sock)
        await site.start()
        self.node_url = f"http://{api.addr}:{sock.getsockname()[1]}"

    def release(self) -> None:
        """Answer the create calls held by the failpoint ``vast.hold_create``."""
        self._released.set()

    async def close(self) -> None:
        """Stop the server and every instance still running; nothing outlives the emulator."""
        self.release()
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await asyncio.gather(
            *(self._stop(i) for i in list(self.instances.values())), *self._stopping, return_exceptions=True
        )
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.network is not None:
            await self.network.close()
            self.network = None
        self._tmp.cleanup()

    async def torn_down(self, timeout: float = 60.0) -> None:
        """Wait until every destroy so far has finished behind its answer: its process reaped, its
        working container removed (a destroy's answer comes first, as vast.ai's does)."""
        if self._stopping:
            await asyncio.wait_for(asyncio.gather(*list(self._stopping), return_exceptions=True), timeout)

    def live(self) -> list[Instance]:
        """The instances rented and not destroyed (lingering ones are destroyed: not here)."""
        return list(self.instances.values())

    def listed(self) -> list[Instance]:
        """What vast.ai lists, by id: the live instances and the destroyed ones still lingering."""
        self._purge()
        return sorted([*self.instances.values(), *self.lingering.values()], key=lambda i: i.id)

    def _purge(self) -> None:
        """Forget the lingering instances whose time is up, and free their offers."""
        now = time.monotonic()
        for inst in [i for i in self.lingering.values() if i.linger_until <= now]:
            del self.lingering[inst.id]
            inst.offer["rentable"], inst.offer["rented"] = True, False

    @web.middleware
    async def _gate(self, request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        n = len(self.requests)
        burst, every = self.faults.value("vast.burst_429"), self.faults.value("vast.throttle_every")
        if burst and n % max(every, burst + 1) < burst:
            self.requests.append((request.method, request.path, 429))
            return web.Response(status=429, text="Too Many Requests")  # plain text, no Retry-After
        if time.monotonic() < self.isolated_until and _identity(request).startswith(self.api_key + "@"):
            # the orchestrator's network is down: its calls get no answer (the nodes' still do)
            self.requests.append((request.method, request.path, 0))
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=503)  # never sent: the connection is gone
        limits = self.faults.value("vast.rate_limit")
        if limits != self.limiter.limits:  # faults changed since (a test may set them on a running emulator)
            self.limiter = RateLimiter(limits)
        endpoint = endpoint_of(request)
        refused = self.limiter.refuse(endpoint, _identity(request)) if endpoint else None
        if refused is not None:
            self.requests.append((request.method, request.path, 429))
            return web.Response(status=429, text=refused)  # plain text, no Retry-After, as vast.ai's
        resp = await self._authorized(request, handler)
        self.requests.append((request.method, request.path, resp.status))
        if self.faults.value("vast.api_latency"):
            await asyncio.sleep(self.faults.value("vast.api_latency"))
        return resp

    async def _authorized(self, request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        if request.path == "/api/v0/gpu_names/unique/":
            public: web.StreamResponse = await handler(request)  # public on vast.ai too
            return public
        key = _key_of(request)
        if not key:
            return _error(401, "auth_error", "authentication required: send Authorization: Bearer <api key>")
        if not secrets.compare_digest(key, self.api_key):
            own = next((i for i in self.listed() if secrets.compare_digest(key, i.container_key)), None)
            if own is None or request.path != f"/api/v0/instances/{own.id}/":
                return _error(401, "auth_error", "invalid api key")
        try:
            resp: web.StreamResponse = await handler(request)
        except json.JSONDecodeError as e:
            return _error(400, "invalid_args", f"the body is not JSON: {e}")
        return resp

    # --- account and catalogue ---------------------------------------------------------------

    async def gpu_names(self, request: web.Request) -> web.Response:
        return _json({"gpu_names": sorted({o["gpu_name"] for o in self.catalogue})})

    async def current_user(self, request: web.Request) -> web.Response:
        return _json({"id": 1, "username": "ppsmoke", "email": "ppsmoke@localhost", "host_agreement_accepted": False})

    async def instance_filters(self, request: web.Request) -> web.Response:
        records = [i.record() for i in self.listed()]
        keys = ("actual_status", "verification", "gpu_name")
        return _json({"filters": [{k: r[k] for k in keys} for r in records]})

    # --- offers ------------------------------------------------------------------------------

    async def search_offers(self, request: web.Request) -> web.Response:
        query = await request.json() if request.can_read_body else {}
        if not isinstance(query, dict):
            return _error(400, "invalid_args", f"the query must be an object, got {type(query).__name__}")
        if isinstance(query.get("q"), dict):  # some clients wrap the query
            query = query["q"]
        self._purge()
        try:
            found = [o for o in self.catalogue if match_offer(o, query)]
        except ValueError as e:
            return _error(400, "invalid_args", str(e))
        for key, direction in _order(query.get("order")):
            found.sort(key=_sort_key(key), reverse=direction == "desc")
        try:
            limit = int(query.get("limit") or 64)
        except (TypeError, ValueError):
            return _error(400, "invalid_args", f"limit must be a number, got {query.get('limit')!r}")
        if self.faults.on("vast.offers"):
            limit = min(limit, self.faults.value("vast.offers"))
        return _json({"offers": found[:limit]})

    # --- instances ---------------------------------------------------------------------------

    async def create_instance(self, request: web.Request) -> web.Response:
        self._creates += 1
        n = self._creates
        body = await request.json()
        if not isinstance(body, dict):
            return _error(400, "invalid_args", "the body must be a JSON object")
        if n in self.faults.value("vast.reject_create"):
            return _error(400, "invalid_args", f"create call {n} rejected (failpoint vast.reject_create)")
        self._purge()
        offer = next((o for o in self.catalogue if str(o["id"]) == request.match_info["id"]), None)
        raced = self.faults.value("vast.race_offers").get(n)
        if offer is not None and offer["rentable"] and raced is not None:
            # someone else rented it between the search and this call, and keeps it
            offer["rentable"], offer["rented"] = False, True
            log.info("create call %d: offer %d taken by someone else (failpoint vast.race_offers)", n, offer["id"])
            gone = "is not available" if raced == 404 else "is no longer available"
            return _error(raced, "no_such_ask", f"Offer {offer['id']} {gone}")
        if offer is None or not offer["rentable"]:
            return _error(404, "no_such_ask", f"Offer {request.match_info['id']} is not available")
        image = body.get("image")
        if not isinstance(image, str) or not image:
            return _error(400, "invalid_args", "image is required")
        try:
            env = _parse_env(body.get("env"))
            disk = float(body.get("disk") or 10)
        except (TypeError, ValueError) as e:
            return _error(400, "invalid_args", str(e))
        self._next_id += 1
        inst = Instance(
            self._next_id,
            n,
            offer,
            image,
            env,
            body.get("label") or None,
            disk,
            body.get("onstart") or None,
            [str(a) for a in body.get("args") or []],
            container_key=secrets.token_hex(32),
        )
        offer["rentable"], offer["rented"] = False, True
        self.instances[inst.id] = inst
        inst.boot = asyncio.ensure_future(self._boot(inst))
        log.info("created instance %d from offer %d (%s)", inst.id, offer["id"], inst.label)
        if n in self.faults.value("vast.hold_create"):  # rented, but the answer is held (a lost answer)
            await self._released.wait()
        return _json({"success": True, "new_contract": inst.id, "instance_api_key": inst.container_key})

    def _find(self, request: web.Request, lingering: bool = True) -> Instance | None:
        """The instance the path names: a live one, or (``lingering``) a destroyed one still listed."""
        try:
            iid = int(request.match_info["id"])
        except ValueError:
            return None
        self._purge()
        return self.instances.get(iid) or (self.lingering.get(iid) if lingering else None)

    async def show_instance(self, request: web.Request) -> web.Response:
        inst = self._find(request)
        return _json({"instances": inst.record() if inst else None})

    async def update_instance(self, request: web.Request) -> web.Response:
        inst = self._find(request, lingering=False)
        if inst is None:
            return _error(404, "not_found", "Instance not found")
        body = await request.json()
        if not isinstance(body, dict) or not ({"label", "state"} & set(body)):
            return _error(400, "invalid_args", "expected a body with 'label' or 'state'")
        if "label" in body:
            inst.label = str(body["label"])
        if "state" in body:
            return _error(400, "invalid_args", f"state changes ({body['state']!r}) are not emulated")
        return _json({"success": True})

    async def destroy_instance(self, request: web.Request) -> web.Response:
        inst = self._find(request)
        if inst is None:
            return _error(404, "not_found", "Instance not found")  # vast.ai's answer: already gone
        if inst.destroyed_at is not None:
            return _json({"success": True})  # lingering: already on its way out
        outcome = self._destroy_outcome(inst)  # counted now (destroy_attempts), answered after any wait
        if self.faults.value("vast.slow_destroy"):
            await asyncio.sleep(self.faults.value("vast.slow_destroy"))
        if outcome == "failed":
            return _error(500, "server_error", f"destroy of {inst.id} failed (failpoint vast.destroy_fails)")
        if outcome == "done":
            self._destroy(inst)  # vast.ai answers at once and tears the container down behind the answer
        return _json({"success": True})  # "ignored" too: accepted, and nothing happens

    def _destroy_outcome(self, inst: Instance) -> str:
        """What this destroy of ``inst`` does: the first vast.destroy_fails of its stage fail,
        the next vast.destroy_ignored are accepted and ignored, the rest are done."""
        inst.destroy_attempts += 1
        stage = inst.stage
        failing = self.faults.value("vast.destroy_fails").get(stage, 0) if stage is not None else 0
        ignored = self.faults.value("vast.destroy_ignored").get(stage, 0) if stage is not None else 0
        if inst.destroy_attempts <= failing:
            return "failed"
        if inst.destroy_attempts <= failing + ignored:
            log.info("destroy of instance %d accepted and ignored (failpoint vast.destroy_ignored)", inst.id)
            return "ignored"
        return "done"

    async def destroy_instances(self, request: web.Request) -> web.Response:
        body = await request.json()
        ids = body.get("instance_ids") if isinstance(body, dict) else None
        if not isinstance(ids, list):
            return _error(400, "invalid_args", "expected {'instance_ids': [...]}")
        failed = []
        for i in ids:
            inst = self.instances.get(int(i)) if str(i).isdigit() else None
            outcome = self._destroy_outcome(inst) if inst is not None else "gone"
            if inst is not None and outcome == "done":
                self._destroy(inst)
            elif outcome == "failed":
                failed.append(str(i))
        if failed:
            return _error(500, "server_error", f"destroy of {', '.join(failed)} failed (failpoint vast.destroy_fails)")
        return _json({"success": True})

    def _destroy(self, inst: Instance) -> None:
        # vast.ai answers at once and tears the container down behind the answer
        del self.instances[inst.id]
        inst.destroyed_at = time.time()
        linger = self.faults.value("vast.destroy_linger")
        if linger:  # still listed, going away, until then; its offer stays taken as long
            inst.linger_until = time.monotonic() + linger
            self.lingering[inst.id] = inst
        else:
            inst.offer["rentable"], inst.offer["rented"] = True, False
        self.destroyed.append(inst)
        stopping = asyncio.ensure_future(self._stop(inst))
        self._stopping.add(stopping)
        stopping.add_done_callback(self._stopping.discard)

    async def list_v0(self, request: web.Request) -> web.Response:
        return _json({"instances": [i.record() for i in self.listed()]})

    async def list_v1(self, request: web.Request) -> web.Response:
        try:
            limit = min(int(request.query.get("limit", "25")), 25)
            after = int(request.query.get("after_token") or 0)
            filters = json.loads(request.query.get("select_filters") or "{}")
        except ValueError as e:
            return _error(400, "invalid_args", f"bad list parameters: {e}")
        listed = self.listed()
        records = [i.record() for i in listed if i.id > after]
        try:
            records = [r for r in records if match_offer(r, filters)]
        except ValueError as e:
            return _error(400, "invalid_args", str(e))
        page = records[:limit]
        token = str(page[-1]["id"]) if len(records) > limit else None
        labels: dict[str, int] = {}
        for i in listed:
            labels[i.label or ""] = labels.get(i.label or "", 0) + 1
        return _json({"instances": page, "next_token": token, "total_instances": len(listed), "label_counts": labels})

    # --- the instance's life -----------------------------------------------------------------

    async def _boot(self, inst: Instance) -> None:
        await asyncio.sleep(0.05)
        inst.actual_status, inst.status_msg = "loading", f"Pulling image {inst.image}"
        if inst.stage in self.faults.value("vast.never_running"):
            return  # stuck pulling, as a host with a broken registry mirror would be
        await asyncio.sleep(self.faults.value("vast.boot_delay"))
        try:
            inst.proc = await self._process(inst)
            await inst.proc.start()
        except (OSError, RuntimeError) as e:  # a broken or missing image: the container never starts
            inst.proc = None
            inst.actual_status, inst.status_msg = "exited", f"container failed to start: {e}"
            return
        inst.actual_status, inst.status_msg = "running", f"success, running {inst.image}"
        assert inst.proc.proc is not None
        rc = await inst.proc.proc.wait()
        how = f"killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
        if inst.lost is not None:  # its host died: what vast.ai said then stands
            log.info("instance %d's node %s (host lost: %s)", inst.id, how, inst.lost)
            return
        inst.actual_status, inst.status_msg = "exited", f"container {how}"
        if rc:
            log.info("instance %d %s; stderr:\n%s", inst.id, how, inst.proc.stderr_tail())

    async def _process(self, inst: Instance) -> ChildProcess:
        """The instance's node: a process of this machine's Python, or the image's entrypoint in
        a working container (made here; :meth:`_stop` removes it)."""
        name = f"instance-{inst.id}"
        if self.runtime == "processes" and self.network is not None:
            name = self._member_name(inst)
            # a destroyed instance of this stage gives its member back as its node stops (a new
            # deployment of the same emulator may rent while that is under way): wait, bounded
            for _ in range(300):  # 15 s
                if name not in self.network.members:
                    break
                await asyncio.sleep(0.05)
            else:
                name = f"{inst.stage}.{inst.number}"
            member = await self.network.add_member(name)
            inst.member = member.name
            env = self._node_env(inst) | NodeEnv(bind=f"{member.addr}:0").to_env()
            return ChildProcess(name, member.wrap(self.node_argv), env)
        if self.runtime == "processes":
            return ChildProcess(name, self.node_argv, self._node_env(inst))
        inst.container = images.Container(f"{self.container_prefix}{inst.id}", inst.image)
        command, user = await inst.container.create()
        env = self._node_env(inst, inherit=False)
        if TEST_TAG in os.environ:  # the test suite finds what a test left running by this variable
            env[TEST_TAG] = os.environ[TEST_TAG]
        if not self.gpus:  # no GPU here: tinygrad's CPU device (docker/debian-base.sh gives it clang)
            env |= {"CUDA": "0", "CPU": "1"}
        model = Path(NodeEnv.read(env, "model").get("model", ""))
        if model.is_absolute() and await asyncio.to_thread(model.is_file):
            await inst.container.copy_in(model, user)  # tinygrad opens it read-write: its user's own copy
        # buildah itself gets this process's environment (its storage settings, PATH)
        return ChildProcess(name, inst.container.argv(command, env), os.environ)

    def _member_name(self, inst: Instance) -> str:
        """Its network member's name: its stage (as per-link overrides name it), unless another
        instance of that stage holds it."""
        taken = {i.member for i in [*self.instances.values(), *self.lingering.values()] if i is not inst}
        name = str(inst.stage)
        return name if name not in taken else f"{inst.stage}.{inst.number}"

    def _node_env(self, inst: Instance, inherit: bool = True) -> dict[str, str]:
        """The create call's env over this process's (less any node variable), plus what vast.ai's
        host agent adds and the node-side failpoints of the instance's stage."""
        stage = inst.stage
        node = NodeEnv(
            container_id=inst.id,
            container_api_key=inst.container_key,
            vast_url=self.node_url,
            exit_on_stdin_eof=True,  # a node never outlives the emulator that started it
            failpoints=str(self.faults.for_stage(stage)),
        )
        if stage in self.faults.value("vast.no_join"):
            try:
                seed = PeerAddr.parse(NodeEnv.read(inst.env, "seed").get("seed", ""))
                node = node.replace(seed=PeerAddr(seed.id, (UNREACHABLE,)).ticket())
            except ValueError:
                node = node.replace(seed="0" * 63)  # not even an address
        if stage in self.faults.value("vast.stall_worker"):
            node = node.replace(worker_ready_timeout=3.0)  # the node gives up on its stalled worker after 3 s
        env = {**(process_env(NodeEnv()) if inherit else {"PYTHONUNBUFFERED": "1"}), **inst.env, **node.to_env()}
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[(inst.number - 1) % len(self.gpus)]
        return env

    async def _stop(self, inst: Instance) -> None:
        if inst.boot is not None and not inst.boot.done():
            inst.boot.cancel()
            # a boot making a container finishes that (and removes it) before it ends
            await asyncio.wait([inst.boot], timeout=images.CREATE_TIMEOUT + 30)
        try:
            if inst.proc is not None:
                # a lost host's node (frozen, or gone) gets no grace: stop() wakes and kills it at once
                await inst.proc.stop(grace=0.0 if inst.lost else 5.0)
        finally:
            if inst.container is not None:
                await inst.container.remove()
            if inst.member is not None and self.network is not None:
                with contextlib.suppress(Exception):  # the network's close removes it anyway
                    await self.network.remove_member(inst.member)
                inst.member = None
            # what a lingering record shows (a lost host's instance stays as it was last seen)
            if inst.destroyed_at is not None and inst.lost is None and inst.actual_status != "exited":
                inst.actual_status, inst.status_msg = "exited", "container stopped: instance destroyed"

    async def _lose_hosts(self) -> None:
        """Once vast.kill_after_tokens tokens were sampled (by any node): SIGKILL vast.kill_stage's
        instance (its node crashes; vast.ai shows it ``exited``), and let vast.lose_host's hosts die."""
        after = self.faults.value("vast.kill_after_tokens")
        targets: dict[int, str] = dict(self.faults.value("vast.lose_host"))
        if self.faults.on("vast.kill_stage"):
            targets.setdefault(self.faults.value("vast.kill_stage"), "killed")
        cuts: dict[int, tuple[str, float]] = dict(self.faults.value("vast.partition"))
        isolate = self.faults.value("vast.isolate_orchestrator")
        hit: set[int] = set()
        while True:
            await asyncio.sleep(0.02)
            events = [e for i in self.instances.values() if i.proc for e in i.proc.events]
            sampled = max((e.get("n", 0) for e in events if e.get("event") == "token"), default=0)
            if sampled < after:
                continue
            if cuts or isolate:
                await self._cut(cuts, isolate, sampled)
                cuts, isolate = {}, 0.0
            if len(hit) >= len(targets):
                return
            for inst in list(self.instances.values()):
                stage = inst.stage
                if stage in targets and stage not in hit and inst.proc is not None and inst.proc.proc is not None:
                    hit.add(stage)
                    self._lose(inst, targets[stage], sampled)

    async def _cut(self, cuts: Mapping[int, tuple[str, float]], isolate: float, sampled: int) -> None:
        """vast.partition's stages cut off from the network, vast.isolate_orchestrator's host cut off
        from every node; each healed by the network after its seconds (0: never)."""
        if self.network is None:
            log.warning("vast.partition and vast.isolate_orchestrator need an emulated network; none here")
            return
        for inst in list(self.instances.values()):
            stage = inst.stage
            if stage is not None and stage in cuts and inst.member is not None:
                direction, seconds = cuts[stage]
                log.warning("instance %d (stage %d) after %d tokens: cut off (%s)", inst.id, stage, sampled, direction)
                await self.network.partition(inst.member, direction, seconds or None)
        if isolate:
            log.warning("after %d tokens: the orchestrator cut off for %g s", sampled, isolate)
            await self.network.partition("host", "both", isolate)
            self.isolated_until = time.monotonic() + isolate  # from vast.ai's API too

    def _lose(self, inst: Instance, how: str, sampled: int) -> None:
        """``inst``'s node is killed ("killed": a crash), or its host dies: "offline" (unreachable:
        the node's process group is frozen) or "exited" (the container is gone: killed). The status
        set here stands (the boot task leaves it); a destroy kills a frozen node at once."""
        assert inst.proc is not None
        host = inst.offer["machine_id"]
        log.warning("instance %d (stage %s) after %d tokens: %s", inst.id, inst.stage, sampled, how)
        if how == "killed":
            inst.proc.signal(signal.SIGKILL)
            return
        inst.lost = how
        if how == "offline":
            inst.proc.signal(signal.SIGSTOP)
            inst.actual_status, inst.status_msg = "offline", f"host {host} stopped answering (no heartbeat)"
        else:
            inst.actual_status, inst.status_msg = "exited", f"host {host} failed: its container was lost"
            inst.proc.signal(signal.SIGKILL)


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


def _key_of(request: web.Request) -> str:
    """The key a call carries: ``Authorization: Bearer <key>``, or the ``api_key`` parameter."""
    auth = request.headers.get("Authorization", "")
    return auth[7:].strip() if auth.startswith("Bearer ") else request.query.get("api_key", "")


def _identity(request: web.Request) -> str:
    """Who a rate limit counts a call against: the key it carries and the address it came from."""
    return f"{_key_of(request)}@{request.remote}"


def _sort_key(key: str) -> Callable[[Mapping[str, Any]], tuple[bool, Any]]:
    return lambda o: (o.get(key) is None, o.get(key) or 0)


def _order(order: Any) -> list[tuple[str, str]]:
    if not isinstance(order, list):
        return []
    out = []
    for item in order:
        if isinstance(item, (list, tuple)) and item:
            out.append((str(item[0]), str(item[1]) if len(item) > 1 else "asc"))
    return list(reversed(out))  # stable sorts, the most significant key last


def _parse_env(env: Any) -> dict[str, str]:
    """vast.ai takes ``env`` as an object, or as docker flags (``-e K=V -p 8080:8080``)."""
    if env is None:
        return {}
    if isinstance(env, dict):  # the CLI turns "-p 8080:8080" into {"-p 8080:8080": "1"}: not variables
        return {str(k): str(v) for k, v in env.items() if not str(k).startswith("-")}
    if isinstance(env, str):
        out: dict[str, str] = {}
        words = shlex.split(env)
        for i, w in enumerate(words):
            if w == "-e" and i + 1 < len(words) and "=" in words[i + 1]:
                k, v = words[i + 1].split("=", 1)
                out[k] = v
        return out
    raise TypeError(f"env must be an object or a string of docker flags, got {type(env).__name__}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="pp-fake-vast", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="an IP literal on loopback (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (default)")
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
        default="processes",
        help="an instance is a node process (default) or the image it names, run by buildah",
    )
    p.add_argument("--gpus", default="", help="this host's GPUs, e.g. 0,1: each instance gets one in turn")
    p.add_argument(
        "--network",
        default="loopback",
        help="the network between the nodes: loopback (default) or an emulated profile (lan, wan, far, slow, "
        "flaky; per-link overrides as in docs/network.md); needs root",
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

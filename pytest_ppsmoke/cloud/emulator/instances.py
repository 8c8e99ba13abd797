"""An emulated instance: its record as vast.ai shows it, and its life.

Its ``actual_status`` goes null -> ``loading`` -> ``running`` (its node started) -> ``exited``
(its node gone), or ``offline`` when its host stops answering (``vast.lose_host``); its record
shows ``unknown`` for a while where its host's heartbeat lapses (``vast.heartbeat_gap``), and its
``ports`` only some time after it runs (``vast.late_ports``). The record also carries vast.ai's
``intended_status``, ``cur_state`` and ``next_state`` (:meth:`Instance.states`), and its
``dph_total`` priced for the disk its create rented.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shlex
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...failpoints import Scenario
from ...nodeenv import NodeEnv
from ...runtime.localproc import ChildProcess
from .. import image as images
from . import catalogue

log = logging.getLogger(__name__)

PULL_RETRY = 10.0  # seconds between a host's pulls of an image it could not pull


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
    cancel_unavail: bool = False  # the create asked for an error, not a stopped instance, if it cannot be scheduled
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
    ports: list[tuple[int, str]] = field(default_factory=list)  # what the create asked to expose: (port, proto)
    public_ip: str = "127.0.0.1"  # its host's public address
    public_ports: dict[str, int] = field(default_factory=dict)  # "7000/udp" -> the public port forwarded to it
    linger_until: float = 0.0  # destroyed: listed until then (time.monotonic())
    running_at: float | None = None  # when it first showed running (time.monotonic())
    heartbeat_gap: float = 0.0  # seconds its record shows unknown from running_at (vast.heartbeat_gap)
    late_ports: float = 0.0  # seconds its record shows no ports from running_at (vast.late_ports)

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
        owner wants (running: the emulator has no stop, and a destroy is not a stop, so it stays
        running when destroyed), the contract's state (running while its container lives, stopped
        once it ended; ``unloaded`` once destroyed, released) and where it is headed (``unloaded``
        once destroyed). A crashed instance is still intended running; one whose destroy was
        ignored shows everything as before it."""
        if self.destroyed_at is not None:  # released, on its way out of the listing
            return "running", "unloaded", "unloaded"
        return "running", "stopped" if self.ended else "running", "running"

    def shown_status(self, now: float) -> tuple[str | None, str]:
        """``actual_status`` and ``status_msg`` as its record shows them at ``now``
        (``time.monotonic()``): ``unknown`` in a heartbeat gap (its node runs underneath)."""
        gap = self.running_at is not None and now < self.running_at + self.heartbeat_gap
        if gap and self.actual_status == "running":
            return "unknown", "no recent heartbeat from the host"
        return self.actual_status, self.status_msg

    def shown_ports(self, now: float) -> dict[str, int]:
        """The forwarded ports its record shows at ``now``: none until ``late_ports`` seconds
        after it first ran (vast.ai fills them in a poll or more after running)."""
        if self.late_ports and (self.running_at is None or now < self.running_at + self.late_ports):
            return {}
        return self.public_ports

    def record(self) -> dict[str, Any]:
        """The instance as vast.ai shows it."""
        return vast_record(self)

    # --- its life: each step's actual_status and status_msg ---------------------------------

    def loading(self) -> None:
        self.actual_status, self.status_msg = "loading", f"Pulling image {self.image}"

    def pull_failed(self, error: Exception) -> None:
        """Its image cannot be pulled: it stays ``loading`` while the host tries again, the
        engine's error in ``status_msg``, as vast.ai shows it (it never runs)."""
        self.actual_status, self.status_msg = "loading", str(error)

    def failed_to_start(self, error: Exception) -> None:
        """A broken or missing image: the container never starts."""
        self.actual_status, self.status_msg = "exited", f"container failed to start: {error}"

    def running(self) -> None:
        self.actual_status, self.status_msg = "running", f"success, running {self.image}"
        if self.running_at is None:
            self.running_at = time.monotonic()

    def exited(self, how: str) -> None:
        self.actual_status, self.status_msg = "exited", f"container {how}"

    def host_lost(self, how: str) -> None:
        """Its host died: "offline" (stopped answering) or "exited" (its container lost). What
        vast.ai shows then stands (its node's end does not change it)."""
        host = self.offer["machine_id"]
        self.lost = how
        if how == "offline":
            self.actual_status, self.status_msg = "offline", f"host {host} stopped answering (no heartbeat)"
        else:
            self.actual_status, self.status_msg = "exited", f"host {host} failed: its container was lost"

    def destroyed(self, linger: float) -> None:
        """Destroyed, and still listed for ``linger`` seconds (0: not at all)."""
        self.destroyed_at = time.time()
        if linger:
            self.linger_until = time.monotonic() + linger

    def stopped(self) -> None:
        """Its node is stopped: what a lingering record shows (a lost host's stays as last seen)."""
        if self.destroyed_at is not None and self.lost is None and self.actual_status != "exited":
            self.actual_status, self.status_msg = "exited", "container stopped: instance destroyed"


class Runs(Protocol):
    """What an instance's life needs of what runs it (``runtimes.Runtime`` is one)."""

    async def pull(self, inst: Instance) -> None: ...
    async def start(self, inst: Instance) -> None: ...
    async def wait(self, inst: Instance) -> int: ...
    async def stop(self, inst: Instance, grace: float) -> None: ...


async def boot(inst: Instance, runtime: Runs, faults: Scenario) -> None:
    """The instance's life from its create call: loading, then its node started by ``runtime``
    (running) until it ends (exited)."""
    await asyncio.sleep(0.05)
    inst.loading()
    if inst.stage in faults.value("vast.never_running") or inst.offer["machine_id"] in faults.value(
        "vast.stuck_machines"
    ):
        return  # stuck pulling, as a host with a broken registry mirror would be
    delays = faults.value("vast.boot_delay")  # one per instance in create order, the last for the rest
    await asyncio.sleep(delays[min(inst.number, len(delays)) - 1])
    while True:
        try:
            await runtime.pull(inst)
            break
        except images.PullError as e:  # a missing or private image: loading for good, the error shown
            inst.pull_failed(e)
            await asyncio.sleep(PULL_RETRY)
    try:
        await runtime.start(inst)
    except (OSError, RuntimeError) as e:  # a broken or missing image: the container never starts
        inst.proc = None
        inst.failed_to_start(e)
        return
    inst.running()
    rc = await runtime.wait(inst)
    how = f"killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
    if inst.lost is not None:  # its host died: what vast.ai said then stands
        log.info("instance %d's node %s (host lost: %s)", inst.id, how, inst.lost)
        return
    await asyncio.sleep(faults.value("vast.status_lag"))  # its host reports the end late (default: at once)
    inst.exited(how)
    if rc and inst.proc is not None:
        log.info("instance %d %s; stderr:\n%s", inst.id, how, inst.proc.stderr_tail())


async def stop(inst: Instance, runtime: Runs) -> None:
    """End the instance's life: its boot, then its node (a lost host's without grace) and what
    ``runtime`` made for it."""
    if inst.boot is not None and not inst.boot.done():
        inst.boot.cancel()
        # a boot making a container finishes that (and removes it) before it ends
        await asyncio.wait([inst.boot], timeout=images.CREATE_TIMEOUT + 30)
    try:
        # a lost host's node (frozen, or gone) gets no grace: stop() wakes and kills it at once
        await runtime.stop(inst, grace=0.0 if inst.lost else 5.0)
    finally:
        inst.stopped()


def vast_record(inst: Instance) -> dict[str, Any]:
    """The instance as vast.ai shows it."""
    o = inst.offer
    now = time.monotonic()
    status, msg = inst.shown_status(now)
    running = status == "running"
    intended, cur, nxt = inst.states()
    return {
        "id": inst.id,
        "machine_id": o["machine_id"],
        "host_id": o["host_id"],
        "bundle_id": o["bundle_id"],
        "actual_status": status,
        "intended_status": intended,
        "cur_state": cur,
        "next_state": nxt,
        "status_msg": msg,
        "label": inst.label,
        "image_uuid": inst.image,
        "image_runtype": "args",
        "image_args": inst.args,
        "onstart": inst.onstart or "",  # a string in both of vast.ai's descriptions (the list's not nullable)
        "extra_env": [[k, v] for k, v in inst.env.items()],
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
        "disk_space": inst.disk,
        "disk_usage": 0.0,
        "disk_util": 0.0,
        "dph_base": o["dph_base"],
        "dph_total": catalogue.price(o, inst.disk),
        "storage_cost": o["storage_cost"],
        "storage_total_cost": catalogue.storage_price(o, inst.disk),
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
        "public_ipaddr": inst.public_ip,
        "local_ipaddrs": inst.public_ip,
        "ports": {k: [{"HostIp": "0.0.0.0", "HostPort": str(v)}] for k, v in inst.shown_ports(now).items()},
        "ssh_host": "127.0.0.1",
        "ssh_port": 20_000 + inst.id % 10_000,  # an integer in vast.ai's description (no ssh is served here)
        "ssh_idx": "",
        "direct_port_start": -1,
        "direct_port_end": -1,
        "direct_port_count": o["direct_port_count"],
        "machine_dir_ssh_port": 30_000 + inst.id % 10_000,
        "start_date": inst.created_at,
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
        "jupyter_token": "",
    }


MAX_PORTS = 64  # vast.ai exposes at most this many ports per instance
_PORT = re.compile(r"^(?:(\d{1,5}):)?(\d{1,5})(?:/(tcp|udp))?$")


def parse_ports(env: Any) -> list[tuple[int, str]]:
    """The ports a create asks vast.ai to expose: docker's ``-p [HOST:]PORT[/tcp|udp]`` among its
    ``env`` flags (vast-cli writes each as the key ``"-p 7000:7000/udp"``, value ``"1"``), as
    (container port, protocol). ValueError names an entry that is not of that form."""
    words: list[str] = []
    if isinstance(env, dict):
        for k in env:
            key = str(k).strip()
            if key.startswith("-p"):
                words += ["-p", key[2:].strip()]
    elif isinstance(env, str):
        words = shlex.split(env)
    out: list[tuple[int, str]] = []
    for i, w in enumerate(words):
        if w != "-p":
            continue
        spec = words[i + 1] if i + 1 < len(words) else ""
        m = _PORT.match(spec)
        if m is None or not all(0 < int(x) <= 65535 for x in m.groups()[:2] if x is not None):
            raise ValueError(f"port {spec!r}: expected -p PORT:PORT[/tcp|udp], PORT in 1..65535")
        entry = (int(m.group(2)), m.group(3) or "tcp")
        if entry not in out:
            out.append(entry)
    if len(out) > MAX_PORTS:
        raise ValueError(f"{len(out)} ports asked for; an instance exposes at most {MAX_PORTS}")
    return out


def parse_env(env: Any) -> dict[str, str]:
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

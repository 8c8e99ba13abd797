"""What an emulated instance is on its host: one :class:`Runtime` class each, chosen by name
(:mod:`.registry`).

- ``processes`` (:class:`Processes`): a ``pp-gpu-node`` process of this machine's Python, with
  this process's environment under the instance's.
- on an emulated network, ``processes`` becomes :class:`NetworkMembers`: each node a process in
  a network namespace of its own (a member of the network, named by its stage).
- ``image`` (:class:`Image`): a working container of the image the create call names, pulled by
  name from the registry the name points to (:meth:`Image.pull`, ``buildah pull``, anonymously, as
  vast.ai's hosts pull), its entrypoint under ``buildah run``
  as the image's user, with only the instance's environment (the create call's and the host
  agent's, no variable of this process), on the host's network, so the emulator's loopback URL and
  the cluster's ports are the same as for a process. A model given as a file on this machine
  (``MODEL``) is copied into the container at the same path, owned by the image's user, as a
  fetched model would lie on the instance's disk. Destroy kills the container's process group
  (``buildah run``'s, which holds the container's processes: chroot isolation) and removes the
  working container.

Every runtime gives each instance the environment vast.ai's host agent gives a container
(:meth:`Runtime.node_env`): ``NodeEnv.container_id`` and ``container_api_key`` (a key that may act
on that instance only), ``vast_url``, and the node-side failpoints of the instance's stage.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar, Protocol

from ... import failpoints
from ...nodeenv import NodeEnv, process_env
from ...runtime.localproc import ChildProcess
from .. import image as images
from .. import oci
from . import faults
from .instances import Instance


class Host(Protocol):
    """What a runtime needs of the emulator it runs instances for."""

    node_argv: list[str]  # what a node process runs
    gpus: list[str] | None  # this host's GPUs: each instance gets one (CUDA_VISIBLE_DEVICES), in turn
    faults: failpoints.Scenario
    node_url: str  # where a node reaches the emulator's API
    network: Any  # the EmulatedNetwork, or None on loopback
    container_prefix: str  # a working container's name: this and the instance's id
    instances: dict[int, Instance]  # live
    lingering: dict[int, Instance]  # destroyed, still listed
    pull_mbps: float | None  # the hosts' download speed a pull is modelled at (None: as fast as it runs)


class Runtime(ABC):
    """What an instance is: :meth:`start` its node, :meth:`poll`, :meth:`wait` for and
    :meth:`signal` it, :meth:`stop` it and remove what starting it made. The instance's node is
    a :class:`ChildProcess` (``inst.proc``) whatever it runs in."""

    name: ClassVar[str]
    # the runtime that stands in for this one on an emulated network (None: it cannot run on one)
    on_network: ClassVar[type[Runtime] | None] = None

    def __init__(self, host: Host) -> None:
        self.host = host

    @classmethod
    def for_network(cls, network: str) -> type[Runtime]:
        """The runtime that runs this one's instances on ``network``; ValueError if none can."""
        if network == "loopback":
            return cls
        if cls.on_network is None:
            raise ValueError(f"an emulated network ({network!r}) runs node processes; the runtime {cls.name!r} is not")
        return cls.on_network

    @abstractmethod
    async def launch(self, inst: Instance) -> ChildProcess:
        """The instance's node, not started yet (and whatever it runs in, made: :meth:`remove`
        removes it). OSError or RuntimeError: it cannot be made (a broken image)."""

    async def pull(self, inst: Instance) -> None:
        """Fetch what the instance runs, before :meth:`start` (vast.ai's ``loading``).
        ``images.PullError``: the registry refused; the host tries again later."""
        return None  # a process needs nothing fetched

    async def remove(self, inst: Instance) -> None:
        """Remove what :meth:`launch` made besides the process, once that has ended."""
        return None  # nothing but the process

    async def start(self, inst: Instance) -> None:
        """Start the instance's node: ``inst.proc``, running. OSError or RuntimeError: it cannot
        start (what was made is removed by :meth:`stop`)."""
        inst.proc = await self.launch(inst)
        await inst.proc.start()

    def poll(self, inst: Instance) -> int | None:
        """The node's exit status; None while it runs, or before it started."""
        p = inst.proc.proc if inst.proc is not None else None
        return p.returncode if p is not None else None

    async def wait(self, inst: Instance) -> int:
        """Until the started node ends: its exit status (negative: the signal)."""
        assert inst.proc is not None and inst.proc.proc is not None
        return await inst.proc.proc.wait()

    def signal(self, inst: Instance, sig: int) -> None:
        """Signal the node's process group (SIGSTOP: its host froze; SIGKILL: it died)."""
        assert inst.proc is not None
        inst.proc.signal(sig)

    async def stop(self, inst: Instance, grace: float) -> None:
        """Stop the node (SIGTERM, then SIGKILL after ``grace`` seconds) and remove what starting
        it made."""
        try:
            if inst.proc is not None:
                await inst.proc.stop(grace=grace)
        finally:
            await self.remove(inst)

    def node_env(self, inst: Instance, inherit: bool = True) -> dict[str, str]:
        """The create call's env over this process's (``inherit``; less any node variable), plus
        what vast.ai's host agent adds and the node-side failpoints of the instance's stage."""
        host = self.host
        node = NodeEnv(
            container_id=inst.id,
            container_api_key=inst.container_key,
            vast_url=host.node_url,
            exit_on_stdin_eof=True,  # a node never outlives the emulator that started it
            public_ipaddr=inst.public_ip,
        )
        node = faults.node_faults(host.faults, inst, node)
        env = {**(process_env(NodeEnv()) if inherit else {"PYTHONUNBUFFERED": "1"}), **inst.env, **node.to_env()}
        env["PUBLIC_IPADDR"] = f"{inst.public_ip}\n"  # padded, as vast.ai serves its strings
        for key, public in inst.public_ports.items():  # vast.ai's host agent: VAST_UDP_PORT_7000=41234
            port, proto = key.split("/")
            env[f"VAST_{proto.upper()}_PORT_{port}"] = str(public)
        if host.gpus:
            env["CUDA_VISIBLE_DEVICES"] = host.gpus[(inst.number - 1) % len(host.gpus)]
        return env


class Processes(Runtime):
    """Each instance a node process of this machine's Python (or ``node_argv``)."""

    name = "processes"

    async def launch(self, inst: Instance) -> ChildProcess:
        return ChildProcess(f"instance-{inst.id}", self.host.node_argv, self.node_env(inst))


class NetworkMembers(Processes):
    """``processes`` on an emulated network: each node in a namespace of its own, a member of the
    network named by its stage (as per-link overrides name it), unless another instance of that
    stage holds the name; :meth:`remove` gives the member back."""

    async def launch(self, inst: Instance) -> ChildProcess:
        network = self.host.network
        assert network is not None
        name = self._member_name(inst)
        # a destroyed instance of this stage gives its member back as its node stops (a new
        # deployment of the same emulator may rent while that is under way): wait, bounded
        for _ in range(300):  # 15 s
            if name not in network.members:
                break
            await asyncio.sleep(0.05)
        else:
            name = f"{inst.stage}.{inst.number}"
        udp = [port for port, proto in inst.ports if proto == "udp"]
        member = await network.add_member(name, ports=udp)
        inst.member = member.name
        if member.public_addr is None:  # on the member's address, its only one
            env = self.node_env(inst) | NodeEnv(bind=f"{member.addr}:0").to_env()
        else:  # behind its host's NAT, which forwards the public ports it chose
            inst.public_ip = member.public_addr
            inst.public_ports = {f"{p}/udp": q for p, q in member.ports.items()}
            env = self.node_env(inst)
        return ChildProcess(name, member.wrap(self.host.node_argv), env)

    def _member_name(self, inst: Instance) -> str:
        host = self.host
        taken = {i.member for i in [*host.instances.values(), *host.lingering.values()] if i is not inst}
        name = str(inst.stage)
        return name if name not in taken else f"{inst.stage}.{inst.number}"

    async def remove(self, inst: Instance) -> None:
        if inst.member is not None and self.host.network is not None:
            with contextlib.suppress(Exception):  # the network's close removes it anyway
                await self.host.network.remove_member(inst.member)
            inst.member = None


Processes.on_network = NetworkMembers
NetworkMembers.on_network = NetworkMembers


class Image(Runtime):
    """Each instance the image its create call names, in a working container of its own
    (``inst.container``), run by buildah."""

    name = "image"

    async def pull(self, inst: Instance) -> None:
        """``buildah pull`` of the instance's image by its name, then, with ``pull_mbps``, the
        rest of the time a download of its compressed layers takes at that speed."""
        started = time.monotonic()
        await images.pull(inst.image)
        mbps = self.host.pull_mbps
        if mbps:
            size = (await oci.inspect_image(inst.image)).compressed_bytes
            wait = size * 8 / (mbps * 1e6) - (time.monotonic() - started)
            if wait > 0:
                inst.status_msg = f"Pulling image {inst.image}: {size / 1e6:.0f} MB at {mbps:g} Mbit/s"
                await asyncio.sleep(wait)

    async def launch(self, inst: Instance) -> ChildProcess:
        inst.container = images.Container(f"{self.host.container_prefix}{inst.id}", inst.image)
        command, user = await inst.container.create()
        env = self.container_env(inst)
        model = Path(NodeEnv.read(env, "model").get("model", ""))
        if model.is_absolute() and await asyncio.to_thread(model.is_file):
            await inst.container.copy_in(model, user)  # tinygrad opens it read-write: its user's own copy
        # buildah itself gets this process's environment (its storage settings, PATH)
        return ChildProcess(f"instance-{inst.id}", inst.container.argv(command, env, self.volumes(inst)), os.environ)

    def volumes(self, inst: Instance) -> list[str]:
        """Host folders bound into the instance's container (``host:container[:options]``): none,
        as on vast.ai, where an instance starts with nothing but its image."""
        return []

    def container_env(self, inst: Instance) -> dict[str, str]:
        """The container's environment: the instance's only, none of this process's."""
        env = self.node_env(inst, inherit=False)
        if not self.host.gpus:  # no GPU here: tinygrad's CPU device (docker/debian-base.sh gives it clang)
            env |= {"CUDA": "0", "CPU": "1"}
        return env

    async def remove(self, inst: Instance) -> None:
        if inst.container is not None:
            await inst.container.remove()

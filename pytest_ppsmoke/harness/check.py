"""What this machine can run, and what to install for the rest.

    pp-smoke-run --check      # a line per mode: ok, or missing: what to install

:func:`report` is that table; :func:`refusal` is a run's own line, before anything starts, when
this machine lacks a tool its settings need, or cannot hold the run's nodes (:func:`capacity`:
their memory and cores against this machine's, :class:`Machine`); the driver fails the run's first
phase with it, the command line refuses with it. Only what a run here needs is refused: on
vast.ai, or on an emulator started apart (``--vast-url``), the tools and the nodes are the other
machine's.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..network.netns import unavailable
from ..network.profiles import NAT_PROFILES, PROFILES
from ..protocol import Names
from .settings import Settings


@dataclass(frozen=True)
class Tool:
    """A command on PATH and the Debian package that installs it."""

    command: str
    package: str

    def found(self) -> bool:
        return shutil.which(self.command) is not None


CLANG = Tool("clang", "clang")  # tinygrad's CPU device compiles every kernel with it
IPTABLES = Tool("iptables-restore", "iptables")  # the NATs of the internet profiles
BUILDAH = Tool("buildah", "buildah")  # runs the node image (--runtime image) and builds it
MMDEBSTRAP = Tool("mmdebstrap", "mmdebstrap")  # the image's Debian base (docker/debian-base.sh)
REGISTRY = Tool("docker-registry", "docker-registry")  # the tests' image registry (tests/registry.py)
HTPASSWD = Tool("htpasswd", "apache2-utils")  # ... behind a login
NVIDIA_SMI = Tool("nvidia-smi", "nvidia-driver")  # NVIDIA's driver (Debian's non-free)


@dataclass(frozen=True)
class Need:
    """What one mode needs of this machine: tools, and for an emulated network root and its
    namespaces."""

    what: str
    tools: tuple[Tool, ...] = ()
    namespaces: bool = False
    cuda: bool = False

    def missing(self) -> str | None:
        """What to do here for this mode (one line), None if nothing."""
        fixes = []
        packages = [t.package for t in self.tools if not t.found()]
        if packages:
            fixes.append(f"apt-get install -y {' '.join(dict.fromkeys(packages))}")
        if self.namespaces and (why := unavailable(create=False)) is not None:
            fixes.append(why)
        if self.cuda and ctypes.util.find_library("cuda") is None:
            fixes.append("no libcuda (NVIDIA's driver)")
        return "; ".join(fixes) or None

    def needs(self) -> str:
        """The tools it needs that are not found here, by name."""
        return ", ".join(t.command for t in self.tools if not t.found())


EMULATED = ", ".join(p for p in PROFILES if p != "loopback")
NEEDS = (
    Need("the main job (--local: tinygrad's CPU device)", (CLANG,)),
    Need(f"--network {EMULATED} (root, network namespaces)", namespaces=True),
    Need(f"--network {', '.join(NAT_PROFILES)} (NATs)", (IPTABLES,), namespaces=True),
    Need("--runtime image (run and build the node image)", (BUILDAH, MMDEBSTRAP)),
    Need("the tests' registry (python -m pytest -m local)", (REGISTRY, HTPASSWD)),
    Need("--gpus (NVIDIA GPUs, CUDA)", (NVIDIA_SMI,), cuda=True),
)


def report() -> list[str]:
    """A line per mode: what it is, then ``ok`` or ``missing:`` and what to install."""
    return [f"{need.what}: {'ok' if (fix := need.missing()) is None else f'missing: {fix}'}" for need in NEEDS]


# What a local node costs this machine, measured with SmolLM2 and the synthetic model (peak RSS
# read from /proc through a run; bench/node_memory.py, docs/benchmarks.md "What a local node costs")
NODE_MIB = 60  # a stage's node process (pp-gpu-node)
WORKER_MIB = 160  # its tinygrad worker with next to no weights (the synthetic model)
MODEL_PER_GGUF = 35  # the workers' memory above that, all stages and the reference together, per GGUF byte
ORCHESTRATOR_MIB = 80  # pp-smoke-run with the emulator in it
CORES_PER_NODE = 0.25  # the share of a core a node and its worker need to load and stay alive


@dataclass(frozen=True)
class Machine:
    """What this machine has for local nodes: cores, and memory available (bytes)."""

    cores: int
    memory: int

    @classmethod
    def here(cls) -> Machine:
        """The cores this process may run on and /proc/meminfo's MemAvailable."""
        memory = 0
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                memory = int(line.split()[1]) * 1024
        return cls(len(os.sched_getaffinity(0)), memory)


def capacity(s: Settings, names: Names, machine: Machine | None = None) -> str | None:
    """Why this machine cannot hold ``s``'s local nodes, in one line that says what they need
    (memory from the figures above and the model's GGUF; cores on CPU only) and what it has; None
    when they fit."""
    from ..stage.catalog import ModelError, resolve_model

    machine = machine or Machine.here()
    try:
        model = resolve_model(s.model)
        gguf = model.stat().st_size if isinstance(model, Path) else 0  # a URL: the nodes fetch it
    except (ModelError, OSError):
        gguf = 0  # the pre-flight names a model it cannot read

    def need(stages: int) -> tuple[float, float]:
        """Memory (bytes) and cores that ``stages`` local nodes need."""
        mib = ORCHESTRATOR_MIB + stages * (NODE_MIB + WORKER_MIB) + MODEL_PER_GGUF * gguf / 2**20
        return mib * 2**20, 0.0 if s.gpus else stages * CORES_PER_NODE

    def fits(stages: int) -> bool:
        memory, cores = need(stages)
        return memory <= machine.memory and cores <= machine.cores

    if fits(s.num_stages):
        return None
    memory, cores = need(s.num_stages)
    most = max((k for k in range(2, s.num_stages) if fits(k)), default=0)
    needs = f"{memory / 2**30:.1f} GiB of memory" + (f" and {cores:g} cores" if cores else "")
    fix = f"lower {names.setting('num_stages')} to at most {most}" if most else "free memory"
    return (
        f"{s.num_stages} local nodes need {needs}; this machine has {machine.memory / 2**30:.1f} GiB available "
        f"and {machine.cores} core(s): {fix}, or rent the stages on vast.ai"
    )


def refusal(s: Settings, names: Names, machine: Machine | None = None) -> str | None:
    """Why this machine cannot run ``s``, in one line that says what to install or to change; None
    if it can. Each setting named as ``names`` (the face's) writes it; ``machine``: this one's
    cores and memory (:meth:`Machine.here`) unless given."""
    if not s.local or s.vast_url:
        return None
    needs = []
    if s.network != "loopback":
        nat = s.network.split(";", 1)[0].strip() in NAT_PROFILES
        needs.append(Need(f"{names.setting('network')} {s.network}", (IPTABLES,) if nat else (), namespaces=True))
    if s.runtime == "image":
        needs.append(Need(f"{names.setting('runtime')} image", (BUILDAH,)))
    for need in needs:
        if (fix := need.missing()) is not None:
            tools = need.needs()
            return f"{need.what} needs {tools}, which this machine lacks: {fix}" if tools else f"{need.what}: {fix}"
    return capacity(s, names, machine)

"""What this machine can run, and what to install for the rest.

    pp-smoke-run --check      # a line per mode: ok, or missing: what to install

:func:`report` is that table; :func:`refusal` is a run's own line, before anything starts, when
this machine lacks a tool its settings need (the driver fails the run's first phase with it, the
command line refuses with it). Only what a run here needs is refused: on vast.ai, or on an
emulator started apart (``--vast-url``), the tools are the other machine's.
"""

from __future__ import annotations

import ctypes.util
import shutil
from dataclasses import dataclass

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


def refusal(s: Settings, names: Names) -> str | None:
    """Why this machine cannot run ``s``, in one line that says what to install; None if it can.
    Each setting named as ``names`` (the face's) writes it."""
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
    return None

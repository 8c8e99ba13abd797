"""The node image on this machine, with buildah (no Docker engine, no image registry needed).

    python -m pytest_ppsmoke.cloud.image [--base local|registry] [--tag TAG]

builds ``docker/Dockerfile`` into buildah's storage (overlay, or vfs where the kernel has no
overlay: :func:`storage_driver`; ``--isolation chroot``: no daemon, no user namespaces) as ``TAG``
(default :data:`~pytest_ppsmoke.DEFAULT_IMAGE`, the name the run asks vast.ai for).
``--base local`` (default) builds on a root filesystem of the image's Debian release that
``docker/debian-base.sh`` makes from this machine's apt sources, once; ``--base registry`` on the
Dockerfile's own default, ``debian:<release>-slim`` from Docker Hub, as the publishing workflow
does. pip inside the build reaches packages as this machine's pip does: its configuration
(``pip config list``: index, extra indexes, find-links, certificate bundle, constraints) is
written to a ``pip.conf`` bind-mounted into the ``RUN`` steps with every local file or directory
it names (read-only, under :data:`HOST`); nothing of it lands in the image.

:class:`Container` is one working container of an image, run the way vast.ai runs an instance:
the image's entrypoint as its user, the instance's environment, the host's network.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import urlparse

from .. import DEFAULT_IMAGE
from .oci import ImageProblem, ImageRef, on_loopback

ROOT = Path(__file__).resolve().parent.parent.parent  # the source tree (the build context)
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DEBIAN_BASE_SCRIPT = ROOT / "docker" / "debian-base.sh"


def storage_driver() -> str:
    """buildah's storage driver: ``STORAGE_DRIVER`` (buildah's own variable) if set, else overlay
    where the kernel has it (a container is then a mount, made in a second), else vfs (each
    container a full copy of the image's files, slow and large)."""
    if chosen := os.environ.get("STORAGE_DRIVER"):
        return chosen
    try:
        kernel = Path("/proc/filesystems").read_text()
    except OSError:
        kernel = ""
    return "overlay" if any(line.split()[-1:] == ["overlay"] for line in kernel.splitlines()) else "vfs"


BUILDAH = ("buildah", "--storage-driver", storage_driver())
HOST = "/run/pp-host"  # where the build's RUN steps see this machine's pip files
CONTEXT = ("pyproject.toml", "README.md", "constraints.txt", "pytest_ppsmoke", "worker")  # what the Dockerfile copies
LABEL = "io.github.pytest-ppsmoke.context"  # the image's context digest: an unchanged one is not rebuilt
CREATE_TIMEOUT = 600.0  # seconds for buildah from (vfs copies the image's files)
PIP_PATH_KEYS = ("cert", "client-cert", "constraint", "requirement", "find-links", "index-url", "extra-index-url")


def release() -> str:
    """The Debian release the image is built on: the one docker/Dockerfile's ``ARG BASE``
    (``debian:<release>-slim``) names, which docker/debian-base.sh builds too."""
    for line in DOCKERFILE.read_text().splitlines():
        m = re.fullmatch(r"ARG BASE=debian:([a-z]+)-slim", line.strip())
        if m:
            return m.group(1)
    raise RuntimeError(f"{DOCKERFILE}: ARG BASE is not debian:<release>-slim")


def debian_base() -> str:
    """The local base's name, as docker/debian-base.sh names it: the image's Debian release."""
    return f"localhost/pp-debian-base:{release()}"


def buildah_missing() -> str | None:
    """Why this machine cannot build or run images with buildah, or None if it can."""
    if shutil.which("buildah") is None:
        return "buildah is not installed (apt-get install buildah)"
    try:
        r = subprocess.run([*BUILDAH, "info"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"buildah info failed: {e}"
    if r.returncode:
        return f"buildah info failed (status {r.returncode}): {r.stderr.strip()[-500:]}"
    return None


def image_exists(name: str) -> bool:
    r = subprocess.run([*BUILDAH, "inspect", "--type", "image", name], capture_output=True, timeout=60)
    return r.returncode == 0


def pip_settings(python: str = sys.executable) -> dict[str, str]:
    """This machine's pip configuration as ``pip config list`` shows it, one value a key: the
    variables (``PIP_*``) over the files, as pip reads them."""
    r = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60)
    if r.returncode:
        raise RuntimeError(f"pip config list failed (status {r.returncode}): {r.stderr.strip()[-500:]}")
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    for line in r.stdout.splitlines():
        scoped, _, value = line.partition("=")
        scope, _, key = scoped.rpartition(".")
        if not key or not value:
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        (env if scope == ":env:" else files)[key] = value
    return files | env


def pip_conf(settings: Mapping[str, str]) -> tuple[str, list[Path]]:
    """``settings`` as a ``pip.conf`` for the build, and the local paths it names: each is seen
    inside the build under :data:`HOST` (for a ``file://`` index, the folder that holds it)."""
    paths: list[Path] = []

    def inside(word: str) -> str:
        url = urlparse(word)
        if url.scheme == "file":  # an index's pages link to its files, often beside it (../../files)
            paths.append(Path(url.path).parent)
            return f"file://{HOST}{url.path}"
        if not url.scheme and word.startswith("/"):
            paths.append(Path(word))
            return HOST + word
        return word  # a remote index: reached over the host's network

    lines = ["[global]"]
    for key, value in sorted(settings.items()):
        if key in PIP_PATH_KEYS:
            value = " ".join(inside(w) for w in value.split())
        lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n", [p for p in dict.fromkeys(paths) if p.exists()]


def image_id(name: str) -> str:
    r = subprocess.run([*BUILDAH, "inspect", "--type", "image", name], capture_output=True, text=True, timeout=60)
    return str(json.loads(r.stdout).get("FromImageID", "")) if r.returncode == 0 else ""


def context_digest(base: str | None, args: Mapping[str, str]) -> str:
    """What an image built from docker/Dockerfile depends on: the Dockerfile, the files it copies
    (the build context less .dockerignore's exclusions), the base image's id and the build
    arguments."""
    h = hashlib.sha256(DOCKERFILE.read_bytes())
    h.update(json.dumps([base, image_id(base) if base else "", sorted(args.items())]).encode())
    for top in CONTEXT:
        path = ROOT / top
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        for f in files:
            if f.is_file() and "__pycache__" not in f.parts:
                h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def built(tag: str) -> str:
    """The context digest ``tag`` was built from (its :data:`LABEL`), "" if none."""
    r = subprocess.run([*BUILDAH, "inspect", "--type", "image", tag], capture_output=True, text=True, timeout=60)
    if r.returncode:
        return ""
    labels = json.loads(r.stdout).get("OCIv1", {}).get("config", {}).get("Labels") or {}
    return str(labels.get(LABEL, ""))


def build(tag: str = DEFAULT_IMAGE, base: str | None = None, build_args: Mapping[str, str] | None = None) -> bool:
    """``buildah bud`` of docker/Dockerfile as ``tag`` on ``base`` (None: the Dockerfile's
    default, the CUDA runtime base). Returns False, building nothing, when ``tag`` was built
    from the same context (:func:`context_digest`): vfs storage copies every layer's files even
    when it is cached, so there a cached rebuild takes minutes on a busy machine; otherwise the
    unchanged layers are reused. The image the tag named before is removed once the new one is
    built (left untagged, each would keep its copy of every layer on disk)."""
    args = {**({"BASE": base} if base else {}), **(build_args or {})}
    digest = context_digest(base, args)
    if built(tag) == digest:
        return False
    with tempfile.TemporaryDirectory(prefix="pp-image-") as tmp:
        conf, paths = pip_conf(pip_settings())
        (Path(tmp) / "pip.conf").write_text(conf)
        volumes = [f"{tmp}/pip.conf:/etc/pip.conf:ro"] + [f"{p}:{HOST}{p}:ro" for p in paths]
        cmd = [
            *BUILDAH, "bud", "--isolation", "chroot", "--layers", "--network", "host", "-f", str(DOCKERFILE),
            "-t", tag, f"--label={LABEL}={digest}", *(f"--volume={v}" for v in volumes),
            *(f"--build-arg={k}={v}" for k, v in args.items()), str(ROOT),
        ]  # fmt: skip
        replaced = image_id(tag)
        subprocess.run(cmd, check=True, timeout=1800)
    if replaced and replaced != image_id(tag):  # the old image, untagged now: it would keep its layers on disk
        subprocess.run([*BUILDAH, "rmi", replaced], capture_output=True, timeout=300)
    return True


def entrypoint(image: str) -> tuple[list[str], str]:
    """The image's ENTRYPOINT and CMD, as a container engine runs them, and its USER."""
    r = subprocess.run(
        [*BUILDAH, "inspect", "--type", "image", image],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if r.returncode:
        raise RuntimeError(f"no image {image!r} in buildah's storage: {r.stderr.strip()[-300:]}")
    config = json.loads(r.stdout).get("OCIv1", {}).get("config", {})
    argv = [*(config.get("Entrypoint") or []), *(config.get("Cmd") or [])]
    if not argv:
        raise RuntimeError(f"image {image!r} has neither an ENTRYPOINT nor a CMD")
    return argv, str(config.get("User") or "root")


def containers(prefix: str) -> list[str]:
    """buildah's working containers whose names start with ``prefix``."""
    r = subprocess.run(
        [*BUILDAH, "containers", "--format", "{{.ContainerName}}"], capture_output=True, text=True, timeout=60
    )
    return [n for n in r.stdout.split() if n.startswith(prefix)] if r.returncode == 0 else []


class PullError(RuntimeError):
    """A pull that failed: the message is the container engine's own, as a host shows it."""


async def pull(name: str, timeout: float = CREATE_TIMEOUT) -> None:
    """Pull ``name`` from the registry it names, as a host of vast.ai's does before it starts an
    instance: anonymously (no login of this machine's is used), over plain HTTP for a registry on
    loopback. A cancelled or late pull is stopped. PullError: the registry's refusal, as the
    engine words it (``manifest unknown``, ``unauthorized: authentication required``)."""
    try:
        ref = ImageRef.parse(name)
    except ImageProblem as e:
        raise PullError(f"Error response from daemon: invalid reference format: {e}") from None
    with tempfile.TemporaryDirectory(prefix="pp-pull-") as tmp:
        auth = Path(tmp) / "auth.json"
        auth.write_text("{}")  # anonymous, whatever logins this machine holds
        cmd = [
            *BUILDAH, "pull", "--quiet", "--policy", "always", "--authfile", str(auth),
            f"--tls-verify={'false' if on_loopback(ref.registry) else 'true'}", name,
        ]  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
        try:
            _, err = await asyncio.wait_for(proc.communicate(), timeout)
        except (asyncio.CancelledError, TimeoutError):
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
    if proc.returncode:
        lines = [ln.strip() for ln in err.decode(errors="replace").splitlines() if ln.strip()]
        why = lines[-1].removeprefix("Error: ") if lines else f"buildah pull exited with status {proc.returncode}"
        raise PullError(f"Error response from daemon: {why}")


class Container:
    """A working container ``name`` of ``image``: :meth:`create` it, run :meth:`argv` (the
    image's entrypoint under ``buildah run``, host network) as a process, :meth:`remove` it.
    Creating is not cancelled half way (a container made behind our back would leak): a cancelled
    :meth:`create` waits for ``buildah from`` and removes what it made."""

    def __init__(self, name: str, image: str) -> None:
        self.name, self.image = name, image
        self.created = False

    def __repr__(self) -> str:
        return f"Container({self.name!r}, {self.image!r})"

    async def create(self) -> tuple[list[str], str]:
        """Make the working container (never pulls: the image is built here); return the
        image's entrypoint and user. Cancelled, or past :data:`CREATE_TIMEOUT`, it stops
        ``buildah from`` and removes whatever that made before it ends."""
        argv = await asyncio.to_thread(entrypoint, self.image)
        cmd = [*BUILDAH, "from", "--pull=never", "--quiet", "--name", self.name, self.image]
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
        done = asyncio.ensure_future(proc.communicate())
        try:
            _, err = await asyncio.wait_for(asyncio.shield(done), CREATE_TIMEOUT)
        except (asyncio.CancelledError, TimeoutError):
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(done, 20)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            await self.remove(force=True)
            raise
        if proc.returncode:
            raise OSError(f"buildah from {self.image} failed (status {proc.returncode}): {err.decode()[-500:]}")
        self.created = True
        return argv

    async def copy_in(self, path: Path, owner: str) -> None:
        """Copy the host's file ``path`` into the container at the same path, owned by ``owner``."""
        proc = await asyncio.create_subprocess_exec(
            *BUILDAH, "copy", "--quiet", "--chown", owner, self.name, str(path), str(path),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 600)
        if proc.returncode:
            raise OSError(
                f"buildah copy {path} into {self.name} failed (status {proc.returncode}): {err.decode()[-300:]}"
            )

    def argv(self, command: list[str], env: Mapping[str, str], volumes: Iterable[str] = ()) -> list[str]:
        """``buildah run`` of ``command`` in the container with ``env`` over the image's and
        ``volumes`` (host:container[:options]) bound, on the host's network."""
        return [
            *BUILDAH, "run", "--isolation", "chroot", "--network", "host",
            *(f"--env={k}={v}" for k, v in env.items()), *(f"--volume={v}" for v in volumes),
            self.name, "--", *command,
        ]  # fmt: skip

    async def remove(self, force: bool = False) -> None:
        """``buildah rm``; a container that was never made is no error."""
        if not (self.created or force):
            return
        proc = await asyncio.create_subprocess_exec(
            *BUILDAH, "rm", self.name, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
        _, err = await asyncio.wait_for(proc.communicate(), 120)
        if proc.returncode and self.created:
            raise OSError(f"buildah rm {self.name} failed (status {proc.returncode}): {err.decode()[-300:]}")
        self.created = False


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pytest_ppsmoke.cloud.image", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--base", choices=("local", "registry"), default="local",
        help="local: docker/debian-base.sh's root filesystem (default); registry: debian:<release>-slim",
    )  # fmt: skip
    p.add_argument("--tag", default=DEFAULT_IMAGE, help=f"the image's name (default {DEFAULT_IMAGE})")
    p.add_argument("--build-arg", action="append", default=[], help="KEY=VALUE, e.g. BAKE_MODEL=llama3.2:1b")
    args = p.parse_args(argv)
    why = buildah_missing()
    if why:
        p.error(why)
    base = None
    if args.base == "local":
        base = debian_base()
        t = time.monotonic()
        subprocess.run(
            [str(DEBIAN_BASE_SCRIPT), base], check=True, timeout=1800, env={**os.environ, "STORAGE_DRIVER": BUILDAH[2]}
        )
        print(f"image: the local base in {time.monotonic() - t:.1f} s", file=sys.stderr)
    t = time.monotonic()
    done = build(args.tag, base, dict(a.partition("=")[::2] for a in args.build_arg))
    print(f"image: {args.tag} {'built' if done else 'up to date'} in {time.monotonic() - t:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    os.umask(0o022)  # files copied into the image stay readable by its user
    main()

"""A real image registry on loopback for the tests: Debian's ``docker-registry`` (the distribution
registry, the software Docker Hub and GHCR speak the API of), started on a free port of 127.0.0.1
with its storage in a folder, optionally behind htpasswd (a private registry: a pull needs a
login). Images get into it with ``buildah push``. Nothing here reaches beyond this machine."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from pytest_ppsmoke import DEFAULT_IMAGE
from pytest_ppsmoke.cloud import image

START_TIMEOUT = 20.0  # seconds for the registry to answer /v2/
# the node image's registry for tests/test_image.py: kept between runs, so that its push (about
# 30 s of compression) is paid once per machine; .ci/run's setup fills it (python -m tests.registry)
NODE_REGISTRY = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ppsmoke" / "test-registry"
NODE_REPOSITORY = "pytest-ppsmoke/gpu-node:" + DEFAULT_IMAGE.rsplit(":", 1)[1]


def missing() -> str | None:
    """Why this machine cannot run the test registry, or None."""
    for tool, package in (("docker-registry", "docker-registry"), ("htpasswd", "apache2-utils")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install {package})"
    return image.buildah_missing()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRegistry:
    """``with LocalRegistry(root) as reg: reg.host`` (``127.0.0.1:PORT``); ``login=(user,
    password)`` puts it behind htpasswd."""

    def __init__(self, root: Path, login: tuple[str, str] | None = None) -> None:
        self.root, self.login = root, login
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.pushed = ""  # what a test pushed into it, by the name a pull asks for

    def __enter__(self) -> LocalRegistry:
        self.root.mkdir(parents=True, exist_ok=True)
        auth = ""
        if self.login is not None:
            user, password = self.login
            hashed = subprocess.run(
                ["htpasswd", "-Bbn", user, password], check=True, capture_output=True, text=True, timeout=30
            ).stdout
            (self.root / "htpasswd").write_text(hashed)
            auth = f"auth:\n  htpasswd:\n    realm: ppsmoke-private\n    path: {self.root / 'htpasswd'}\n"
        config = self.root / "config.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: error\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.root / 'data'}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: {self.host}\n{auth}"
        )
        self.proc = subprocess.Popen(
            ["docker-registry", "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                urllib.request.urlopen(f"http://{self.host}/v2/", timeout=2)
                break
            except urllib.error.HTTPError:  # 401 behind htpasswd: it answers
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    err = self.proc.stderr.read().decode()[-500:] if self.proc.stderr else ""
                    self.__exit__(None, None, None)
                    raise RuntimeError(f"docker-registry did not answer on {self.host}: {err}") from None
                time.sleep(0.1)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            if self.proc.stderr:
                self.proc.stderr.close()
            self.proc = None

    def push(self, local: str, name: str) -> str:
        """``buildah push`` of the local image ``local`` as ``HOST/name``; returns that name."""
        dest = f"{self.host}/{name}"
        creds = ["--creds", ":".join(self.login)] if self.login else []
        subprocess.run(
            [*image.BUILDAH, "push", "--quiet", "--tls-verify=false", *creds, local, f"docker://{dest}"],
            check=True, capture_output=True, timeout=900,
        )  # fmt: skip
        return dest


def tiny_image(tag: str, arch: str = "amd64") -> str:
    """A small image of one file (made once per tag): for what the pre-flight checks, any image
    does, and it pushes in a moment."""
    if image.image_exists(tag):
        return tag
    ctr = subprocess.run(
        [*image.BUILDAH, "from", "--quiet", "scratch"], check=True, capture_output=True, text=True, timeout=60
    ).stdout.strip()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "hello"
            src.write_text("pytest-ppsmoke\n")
            subprocess.run([*image.BUILDAH, "copy", ctr, str(src), "/hello"], check=True, capture_output=True)
        subprocess.run(
            [*image.BUILDAH, "config", "--arch", arch, "--os", "linux", ctr], check=True, capture_output=True
        )
        subprocess.run([*image.BUILDAH, "commit", "--quiet", ctr, tag], check=True, capture_output=True)
    finally:
        subprocess.run([*image.BUILDAH, "rm", ctr], capture_output=True, timeout=60)
    return tag


def main() -> None:
    """Setup: the node image (built) pushed into :data:`NODE_REGISTRY`."""
    why = missing() or (None if image.image_exists(DEFAULT_IMAGE) else f"no image {DEFAULT_IMAGE} is built")
    if why:
        print(f"test registry: not filled: {why}", file=sys.stderr)
        return
    t = time.monotonic()
    with LocalRegistry(NODE_REGISTRY) as reg:
        name = reg.push(DEFAULT_IMAGE, NODE_REPOSITORY)
    print(f"test registry: {name} pushed in {time.monotonic() - t:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()

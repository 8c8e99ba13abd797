"""A real image registry on loopback for the tests: Debian's ``docker-registry`` (the distribution
registry, the software Docker Hub and GHCR speak the API of), started on a free port of 127.0.0.1
with its storage in a folder, optionally behind htpasswd (a private registry: a pull needs a
login). Images get into it with ``buildah push``. Nothing here reaches beyond this machine."""

from __future__ import annotations

import base64
import datetime
import json
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
from typing import Any

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


class TokenService:
    """The token service a registry's Bearer challenge points to, as Docker Hub's and GHCR's do:
    ``GET /token?service=...&scope=repository:NAME:pull`` answers a JWT (RS256, the signing
    certificate in its ``x5c`` header) that the registry verifies against the certificate it is
    configured with. Anonymous callers get ``pull`` on the repositories in ``public`` and a token
    with no access for any other (GHCR's answer for a private package: the registry then refuses
    the manifest)."""

    def __init__(self, root: Path, public: set[str]) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID

        self.public = public
        self.port = free_port()
        self.realm = f"http://127.0.0.1:{self.port}/token"
        self.service, self.issuer = "ppsmoke-registry", "ppsmoke-token-service"
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.issuer)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(self.key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)).sign(self.key, hashes.SHA256())
        )  # fmt: skip
        self.cert_der = cert.public_bytes(serialization.Encoding.DER)
        self.bundle = root / "token-cert.pem"
        root.mkdir(parents=True, exist_ok=True)
        self.bundle.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self.asked: list[tuple[str, str]] = []  # (scope, Authorization) of each token request
        self._server: Any = None

    def token(self, scope: str, login: bool) -> str:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        def b64(data: bytes) -> str:
            return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

        access = []
        kind, _, rest = scope.partition(":")
        repo, _, actions = rest.rpartition(":")
        if kind == "repository" and login:  # the owner (buildah push with --creds): what it asks
            access = [{"type": "repository", "name": repo, "actions": actions.split(",")}]
        elif kind == "repository" and repo in self.public and "pull" in actions.split(","):
            access = [{"type": "repository", "name": repo, "actions": ["pull"]}]
        now = int(time.time())
        header = {"alg": "RS256", "typ": "JWT", "x5c": [base64.b64encode(self.cert_der).decode()]}
        claims = {"iss": self.issuer, "sub": "", "aud": self.service, "exp": now + 300, "nbf": now - 10,
                  "iat": now, "jti": os.urandom(8).hex(), "access": access}  # fmt: skip
        signed = b64(json.dumps(header).encode()) + "." + b64(json.dumps(claims).encode())
        signature = self.key.sign(signed.encode(), padding.PKCS1v15(), hashes.SHA256())
        return signed + "." + b64(signature)

    def __enter__(self) -> TokenService:
        import http.server
        import threading
        import urllib.parse

        service = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
                scope = (query.get("scope") or [""])[0]
                login = self.headers.get("Authorization", "")
                service.asked.append((scope, login))
                body = json.dumps({"token": service.token(scope, bool(login))}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def config(self) -> str:
        return (
            f"auth:\n  token:\n    realm: {self.realm}\n    service: {self.service}\n"
            f"    issuer: {self.issuer}\n    rootcertbundle: {self.bundle}\n"
        )


class LocalRegistry:
    """``with LocalRegistry(root) as reg: reg.host`` (``127.0.0.1:PORT``); ``login=(user,
    password)`` puts it behind htpasswd, ``tokens`` behind a token service (Bearer)."""

    def __init__(self, root: Path, login: tuple[str, str] | None = None, tokens: TokenService | None = None) -> None:
        self.root, self.login, self.tokens = root, login, tokens
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
        elif self.tokens is not None:
            auth = self.tokens.config()
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

    def config_digest(self, name: str) -> str | None:
        """The digest of the config that ``name`` (``repository:tag``) has here, or None: the
        registry does not hold it, or asks for a login."""
        repo, tag = name.rsplit(":", 1)
        accept = "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json"
        ask = urllib.request.Request(f"http://{self.host}/v2/{repo}/manifests/{tag}", headers={"Accept": accept})
        try:
            with urllib.request.urlopen(ask, timeout=10) as answer:
                digest = json.load(answer).get("config", {}).get("digest")
        except (OSError, ValueError, AttributeError):
            return None
        return digest if isinstance(digest, str) else None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        forget(self.host)
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
        """``buildah push`` of the local image ``local`` as ``HOST/name``; returns that name. An
        open registry that holds ``name`` as this very image (its config's digest is the local
        image's id; a registry takes a manifest only once it holds every layer) is not pushed to
        again: buildah would compress every layer anew to find that out (16 s of CPU for the node
        image)."""
        dest = f"{self.host}/{name}"
        if not self.login and not self.tokens and self.config_digest(name) == image_id(local):
            return dest
        creds = ["--creds", ":".join(self.login)] if self.login else ["--creds", "owner:x"] if self.tokens else []
        subprocess.run(
            [*image.BUILDAH, "push", "--quiet", "--tls-verify=false", *creds, local, f"docker://{dest}"],
            check=True, capture_output=True, timeout=900,
        )  # fmt: skip
        return dest


def image_id(local: str) -> str | None:
    """The local image's id (the digest of its config), or None when there is no such image."""
    done = subprocess.run(
        [*image.BUILDAH, "inspect", "--type", "image", "--format", "{{.FromImageID}}", local],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return f"sha256:{done.stdout.strip()}" if done.returncode == 0 and done.stdout.strip() else None


def forget(host: str) -> None:
    """Untag every image name of this machine's storage that a pull from ``host`` left (an
    emulated host pulls by the registry's name, and each test registry has a port of its own):
    the images stay under their other names, and nothing piles up run after run."""
    listed = subprocess.run(
        [*image.BUILDAH, "images", "--format", "{{.Name}}:{{.Tag}}"], capture_output=True, text=True, timeout=60
    )
    names = [n for n in listed.stdout.split() if n.startswith(host + "/")]
    if names:
        subprocess.run([*image.BUILDAH, "rmi", *names], capture_output=True, timeout=300)


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

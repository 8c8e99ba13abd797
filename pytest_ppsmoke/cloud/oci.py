"""An image registry, asked what ``docker pull`` would find, before anything is rented.

    info = await inspect_image("ghcr.io/pytest-ppsmoke/gpu-node:0.1.0")
    info.digest, info.compressed_bytes, info.platforms

The registry's distribution API (v2), as a container engine speaks it: the manifest by tag, with
the media types of an OCI index, a Docker manifest list and their single-image manifests. A 401
with a Bearer challenge is answered with an anonymous token (the challenge's realm, service and a
``pull`` scope), then the manifest is asked again, as vast.ai's hosts pull: anonymously, since the
create call carries no login. A registry on loopback is spoken to over plain HTTP, as docker does
for localhost; any other over HTTPS. ``docker.io`` is Docker Hub's ``registry-1.docker.io``.

Every problem is an :class:`ImageProblem` whose message is one line naming the image, what was
found and what to do: not found, private (a Basic challenge, a refused token, or a 401/403 with a
token), no ``linux/amd64`` manifest, an answer that is not a registry's, or no answer at all.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from dataclasses import dataclass
from typing import Any

import aiohttp
from multidict import CIMultiDict

from ..protocol import Names

PLATFORM = "linux/amd64"  # what vast.ai's hosts run
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json", "application/vnd.docker.distribution.manifest.v2+json")
ACCEPT = ", ".join((*INDEX_TYPES, *MANIFEST_TYPES))
TIMEOUT = 15.0  # seconds for the whole inspection
HUB, HUB_API = "docker.io", "registry-1.docker.io"
_REPO = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


class ImageProblem(Exception):
    """Why the image cannot be pulled: ``kind`` (``bad name``, ``not found``, ``private``,
    ``platform``, ``unreachable``, ``bad answer``) and a one-line message."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class ImageRef:
    """``registry/repository:tag``, each part as a registry names it."""

    registry: str
    repository: str
    tag: str

    @classmethod
    def parse(cls, name: str) -> ImageRef:
        """The image name a create call carries; ImageProblem (``bad name``) unless it names a
        registry (a first part with a dot, a port or ``localhost``) and a tag."""
        expected = "expected REGISTRY/REPOSITORY:TAG, e.g. ghcr.io/pytest-ppsmoke/gpu-node:0.1.0"
        first, slash, rest = name.strip().partition("/")
        if not slash or not ("." in first or ":" in first or first == "localhost"):
            raise ImageProblem("bad name", f"image {name!r} names no registry; {expected}")
        repository, colon, tag = rest.rpartition(":")
        if not colon or "/" in tag:
            raise ImageProblem("bad name", f"image {name!r} names no tag; {expected}")
        if not _REPO.fullmatch(repository) or not _TAG.fullmatch(tag):
            raise ImageProblem("bad name", f"image {name!r} is not a valid name; {expected}")
        return cls(first.lower() if first != HUB else HUB, repository, tag)

    def __str__(self) -> str:
        return f"{self.registry}/{self.repository}:{self.tag}"

    @property
    def api(self) -> str:
        """The registry's base URL: plain HTTP on loopback, else HTTPS."""
        host = HUB_API if self.registry == HUB else self.registry
        return f"{'http' if on_loopback(host) else 'https'}://{host}"


def on_loopback(host_port: str) -> bool:
    """Whether ``host[:port]`` (an IPv6 address in brackets) is this machine."""
    host = host_port.rsplit(":", 1)[0] if not host_port.endswith("]") else host_port
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ImageInfo:
    """What the registry holds for an image: its manifest's digest, the platforms it offers and,
    for ``linux/amd64``, the layers a pull downloads and their compressed size."""

    ref: ImageRef
    digest: str
    platforms: tuple[str, ...]
    layers: int
    compressed_bytes: int  # the layers and the config, as the registry stores them

    def summary(self) -> dict[str, Any]:
        return {
            "image": str(self.ref),
            "digest": self.digest,
            "platforms": list(self.platforms),
            "layers": self.layers,
            "compressed_bytes": self.compressed_bytes,
        }


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    """``WWW-Authenticate``'s scheme and parameters."""
    scheme, _, rest = header.strip().partition(" ")
    return scheme.lower(), dict(re.findall(r'(\w+)="([^"]*)"', rest))


def _codes(text: str) -> str:
    """A registry error body's codes and messages (``MANIFEST_UNKNOWN: manifest unknown``)."""
    try:
        errors = json.loads(text).get("errors") or []
        return "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors if isinstance(e, dict))
    except (ValueError, AttributeError):
        return ""


class _Registry:
    """One inspection's requests: the token once it is granted."""

    def __init__(self, http: aiohttp.ClientSession, ref: ImageRef, names: Names) -> None:
        self.http, self.ref, self.names = http, ref, names
        self.token: str | None = None

    async def get(self, path: str, accept: str) -> tuple[int, CIMultiDict[str], bytes]:
        """GET ``/v2/<repository>/<path>``, answering a Bearer challenge once with an anonymous
        token; ImageProblem (``private``) where the registry asks for a login."""
        for _ in range(2):
            headers = {"Accept": accept} | ({"Authorization": f"Bearer {self.token}"} if self.token else {})
            url = f"{self.ref.api}/v2/{self.ref.repository}/{path}"
            async with self.http.get(url, headers=headers) as resp:
                status, got, body = resp.status, resp.headers.copy(), await resp.read()
            if status != 401:
                return status, got, body
            scheme, params = _challenge(got.get("WWW-Authenticate", ""))
            if scheme != "bearer" or self.token is not None or "realm" not in params:
                break
            self.token = await self._anonymous_token(params)
        raise ImageProblem(
            "private",
            f"image {self.ref} is private: {self.ref.registry} asks for a login to pull it, and vast.ai's hosts "
            "pull anonymously; make the package public (docs/image.md) or pass "
            f"{self.names.setting('image')} of a public one",
        )

    async def _anonymous_token(self, params: dict[str, str]) -> str:
        query = {"scope": params.get("scope") or f"repository:{self.ref.repository}:pull"}
        if params.get("service"):
            query["service"] = params["service"]
        async with self.http.get(params["realm"], params=query) as resp:
            status, text = resp.status, await resp.text()
        if status != 200:
            raise ImageProblem(
                "private",
                f"image {self.ref} is private: {self.ref.registry}'s token service refused an anonymous pull "
                f"(HTTP {status}); make the package public (docs/image.md) or pass "
                f"{self.names.setting('image')} of a public one",
            )
        try:
            data = json.loads(text)
            return str(data.get("token") or data["access_token"])
        except (ValueError, KeyError, AttributeError):
            raise ImageProblem("bad answer", f"{self.ref.registry}'s token service answered no token") from None


async def inspect_image(
    name: str, platform: str = PLATFORM, timeout: float = TIMEOUT, names: Names | None = None
) -> ImageInfo:
    """What a pull of ``name`` would find (module docstring); ImageProblem on any problem, each
    setting its advice names as ``names`` writes it."""
    names = names or Names()
    ref = ImageRef.parse(name)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
            return await _inspect(_Registry(http, ref, names), platform)
    except (aiohttp.ClientError, TimeoutError) as e:
        why = f"{type(e).__name__}: {e}" if str(e) else f"no answer within {timeout:g} s"
        raise ImageProblem(
            "unreachable",
            f"cannot ask {ref.registry} for image {ref} ({why}); check the name and the network, "
            f"or skip this check with {names.setting('preflight')} off",
        ) from None


async def _inspect(reg: _Registry, platform: str) -> ImageInfo:
    ref = reg.ref
    status, headers, body = await reg.get(f"manifests/{ref.tag}", ACCEPT)
    if status == 404:
        codes = _codes(body.decode(errors="replace")) or "HTTP 404"
        raise ImageProblem(
            "not found",
            f"image {ref} does not exist ({codes}); publish it (a version tag runs the image workflow) "
            f"or pass {reg.names.setting('image')}",
        )
    if status == 403:
        raise ImageProblem(
            "private", f"image {ref}: {ref.registry} denies an anonymous pull (HTTP 403); make the package public"
        )
    if status != 200:
        raise ImageProblem("bad answer", f"{ref.registry} answered HTTP {status} for image {ref}'s manifest")
    digest = headers.get("Docker-Content-Digest") or "sha256:" + hashlib.sha256(body).hexdigest()
    manifest = _json(body, ref, "manifest")
    kind = str(manifest.get("mediaType") or headers.get("Content-Type", "")).split(";")[0]
    if kind in INDEX_TYPES or "manifests" in manifest:
        entries = [m for m in manifest.get("manifests") or [] if isinstance(m, dict)]
        platforms = tuple(
            f"{p.get('os')}/{p.get('architecture')}" for m in entries if isinstance(p := m.get("platform"), dict)
        )
        chosen = next((m for m, p in zip(entries, platforms, strict=False) if p == platform), None)
        if chosen is None:
            raise _no_platform(ref, platform, platforms)
        status, _, body = await reg.get(f"manifests/{chosen['digest']}", ", ".join(MANIFEST_TYPES))
        if status != 200:
            raise ImageProblem("bad answer", f"{ref.registry} answered HTTP {status} for {ref}'s {platform} manifest")
        manifest = _json(body, ref, f"{platform} manifest")
    else:
        config = manifest.get("config") or {}
        status, _, blob = await reg.get(f"blobs/{config.get('digest')}", "*/*")
        if status != 200:
            raise ImageProblem("bad answer", f"{ref.registry} answered HTTP {status} for {ref}'s config")
        cfg = _json(blob, ref, "config")
        platforms = (f"{cfg.get('os')}/{cfg.get('architecture')}",)
        if platforms[0] != platform:
            raise _no_platform(ref, platform, platforms)
    layers = [la for la in manifest.get("layers") or [] if isinstance(la, dict)]
    size = sum(int(la.get("size") or 0) for la in layers) + int((manifest.get("config") or {}).get("size") or 0)
    return ImageInfo(ref, digest, platforms, len(layers), size)


def _json(body: bytes, ref: ImageRef, what: str) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise ImageProblem("bad answer", f"{ref.registry} answered no JSON object for {ref}'s {what}")
    return data


def _no_platform(ref: ImageRef, platform: str, found: tuple[str, ...]) -> ImageProblem:
    return ImageProblem(
        "platform",
        f"image {ref} has no {platform} manifest (it has {', '.join(found) or 'none'}); vast.ai's hosts run "
        f"{platform}: build it for that platform",
    )

"""vast.ai's limits, read from its own OpenAPI files: the one table of them.

Each vendored file (``emulator/openapi/*.yaml``, checked against its upstream by
``emulator/apidoc.py``) describes one endpoint and carries, beside the operation, its rate limit
(``x-rate-limit``: a ``threshold`` in seconds between two calls and the ``penalty`` once it is
broken, or so many ``requests`` per ``minute``, per client address) and its input limits
(``x-input-validation``: a field's ``max_length``, ``min``, ...). :func:`endpoints` reads them by
the endpoint names of :data:`~pytest_ppsmoke.protocol.VAST_ENDPOINTS` (``create``, ``show``,
``list``, ...); the emulator's limiter and the client's pace both come from here, for ``--vastai``
and ``--local`` alike, so neither copies a number.

``PP_VASTDOC`` points the table at another folder of such files (a test changes a threshold in a
copy and sees both sides follow). ``PP_VAST_TIME_SCALE`` (default 1) multiplies every second of
the rate limits where both sides are the project's own (the emulator and the client that talks to
it): the test suite runs the documented limits at a fraction of their seconds (docs/lifecycle.md,
"Rate limits"); the client of vast.ai itself always paces at scale 1.

Loaded only by the cloud layer (it needs PyYAML): never on the pytest plugin's import path.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from .. import checks
from ..protocol import VAST_ENDPOINTS

DOCS = Path(__file__).parent / "emulator" / "openapi"  # the vendored files (apidoc.DOCS)
ENV_DIR = "PP_VASTDOC"  # another folder of vast.ai's OpenAPI files (a test's changed copy)
ENV_SCALE = "PP_VAST_TIME_SCALE"  # the seconds of every rate limit, scaled (the emulator and its client)
METHODS = ("get", "put", "post", "delete", "patch")
# libyaml's parser where PyYAML was built with it (the same documents, a tenth of the CPU: the
# pure-Python one took 0.16 s for these files, in every process that starts an emulator or a client)
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(frozen=True)
class RateLimit:
    """One endpoint's limit per client: a call sooner than ``threshold`` seconds after the last
    one let through is refused, and so is every call for ``penalty`` seconds after that; or, for
    a limit by count (``requests`` per ``window`` seconds), a call past that count in any window."""

    threshold: float = 0.0
    penalty: float = 0.0
    requests: int = 0  # 0: a limit by threshold
    window: float = 0.0

    def scaled(self, scale: float) -> RateLimit:
        return RateLimit(self.threshold * scale, self.penalty * scale, self.requests, self.window * scale)

    @property
    def text(self) -> str:
        """The threshold a 429 names (a limit by count: its window over its count)."""
        spacing = self.threshold if not self.requests else self.window / self.requests
        return f"{spacing:g}"


@dataclass(frozen=True)
class Endpoint:
    """An endpoint as its file describes it: its name, method, route (``{id}`` for any path
    parameter), file, rate limit (None: none documented) and input limits by field."""

    name: str
    method: str
    route: str
    file: str
    rate_limit: RateLimit | None
    inputs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


def directory() -> Path:
    """The folder the table is read from: ``PP_VASTDOC``, else the vendored files."""
    return Path(os.environ.get(ENV_DIR) or DOCS)


def time_scale() -> float:
    """``PP_VAST_TIME_SCALE`` (a number > 0; default 1)."""
    raw = os.environ.get(ENV_SCALE, "").strip()
    if not raw:
        return 1.0
    try:
        return checks.number(float(raw), above=0)
    except (TypeError, ValueError):
        raise ValueError(f"{ENV_SCALE} must be a number above 0, got {raw!r}") from None


def _route(template: str) -> str:
    return re.sub(r"\{[^}]+\}", "{id}", template)


def _name(method: str, template: str) -> str | None:
    route = _route(template)
    for form in (route, route.rstrip("/") + "/", route.rstrip("/")):
        if (method.upper(), form) in VAST_ENDPOINTS:
            return VAST_ENDPOINTS[(method.upper(), form)]
    return None


def _rate_limit(raw: Any, file: str) -> RateLimit | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ValueError(f"{file}: x-rate-limit is not a mapping")
    try:
        if "requests" in raw:
            per = {"second": 1.0, "minute": 60.0, "hour": 3600.0}[str(raw.get("per"))]
            return RateLimit(requests=int(raw["requests"]), window=per)
        return RateLimit(float(raw["threshold"]), float(raw.get("penalty") or 0.0))
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"{file}: x-rate-limit {dict(raw)!r} names neither a threshold nor requests per a unit"
        ) from None


@functools.cache
def _read(folder: str) -> MappingProxyType[str, Endpoint]:
    out: dict[str, Endpoint] = {}
    for path in sorted(Path(folder).glob("*.yaml")):
        doc = yaml.load(path.read_text(), Loader=YAML_LOADER) or {}
        limit = _rate_limit(doc.get("x-rate-limit"), path.name)
        inputs = MappingProxyType(
            {k: MappingProxyType(dict(v)) for k, v in (doc.get("x-input-validation") or {}).items()}
        )
        for template, item in (doc.get("paths") or {}).items():
            for method in METHODS:
                if method in item and (name := _name(method, template)) is not None:
                    out[name] = Endpoint(name, method.upper(), _route(template), path.name, limit, inputs)
    if not out:
        raise ValueError(f"{folder}: no OpenAPI file of a vast.ai endpoint this project calls")
    return MappingProxyType(out)


def endpoints(folder: Path | None = None) -> Mapping[str, Endpoint]:
    """The endpoints the files describe, by name."""
    return _read(str(folder or directory()))


def rate_limits(scale: float | None = None, folder: Path | None = None) -> dict[str, RateLimit]:
    """Endpoint name -> its documented rate limit, its seconds times ``scale`` (default
    :func:`time_scale`)."""
    s = time_scale() if scale is None else scale
    out = {n: e.rate_limit.scaled(s) for n, e in endpoints(folder).items() if e.rate_limit is not None}
    if "destroy_many" not in out and "destroy" in out:  # undocumented: held to one destroy's limit (a guess)
        out["destroy_many"] = out["destroy"]
    return out


def input_limits(folder: Path | None = None) -> dict[str, Mapping[str, Mapping[str, Any]]]:
    """Endpoint name -> its documented input limits by field (``{"label": {"max_length": 256}}``)."""
    return {n: e.inputs for n, e in endpoints(folder).items() if e.inputs}


def env_flags(env: Mapping[str, Any]) -> str:
    """A create's ``env`` object (what vast-cli's ``parse_env`` makes of the described docker-flag
    string) as that string again: ``-e K=V`` for a variable, a port's or volume's key (``-p
    7000:7000/udp``) as it stands; what ``max_total_length`` measures, for the client and the
    emulator alike."""
    return " ".join(str(k) if str(k).startswith("-") else f"-e {k}={v}" for k, v in env.items())


def pace(scale: float | None = None, folder: Path | None = None) -> dict[str, tuple[int, float]]:
    """Endpoint name -> (calls, seconds): at most so many calls in any such span, as a client
    that keeps within the documented limits spaces them (a threshold: 1 call per threshold)."""
    return {
        n: (r.requests, r.window) if r.requests else (1, r.threshold) for n, r in rate_limits(scale, folder).items()
    }

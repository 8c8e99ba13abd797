"""Every option of a smoke run, declared once: its default, type, help, validation and where it
may come from. ``pp-smoke-run``'s flags and the pytest plugin's options and ini keys are both
generated from :data:`OPTIONS`, so the two faces cannot drift.

Precedence: command line > environment variable (where one is named) > ini key (pytest only) >
default. Defaults that depend on the mode (the model, the poll interval) are resolved once the
mode is known.

This module imports only the standard library: the pytest plugin reads it at start-up, in
every pytest run of every project that has the package installed.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import DEFAULT_IMAGE, checks
from ..cloud.emulator.registry import NAMES as RUNTIMES  # the emulator's runtimes (stdlib only)
from ..nodeenv import DEFAULTS as NODE
from ..nodeenv import REFERENCES
from ..protocol import BOOT_POLL_INTERVAL, BOOT_POLLS, CONVERGE_TIMEOUT, RESOLVE_TIMEOUT, WIRE_DTYPES
from .gridspec import grid_spec

# the run's steps, in order: the driver runs them, the plugin maps its fixtures to them
STEPS = ("rent", "boot", "converge", "load", "resolve", "infer", "reference")
MODES = ("local", "vastai")
VAST_URL = "https://console.vast.ai"
LOCAL_MODEL, VASTAI_MODEL = "smollm2:135m", "llama3.2:1b"


class SettingError(ValueError):
    """A value that does not parse; the message says what was expected."""


def _checked(kind: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise SettingError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise SettingError(f"expected {expected}, got {text!r}")
        return value

    return parse


def _int_at_least(low: int) -> Callable[[str], int]:
    return _checked(lambda t: checks.integer(t, low), lambda v: True, f"an integer of at least {low}")


_positive = _checked(lambda t: checks.number(t, above=0), lambda v: True, "a positive number")
_fraction = _checked(lambda t: checks.number(t, least=0, most=1), lambda v: True, "a number between 0 and 1")
_number = _checked(float, lambda v: True, "a number")


def _one_of(choices: tuple[str, ...], what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        try:
            return checks.one_of(text.strip().lower(), choices)
        except ValueError:
            raise SettingError(f"unknown {what} {text!r}; expected one of {', '.join(choices)}") from None

    return parse


def _on_off(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("on", "off"):
        raise SettingError(f"expected on or off, got {text!r}")
    return value == "on"


def _text(text: str) -> str:
    if not text.strip():
        raise SettingError("expected a non-empty text")
    return text


@dataclass(frozen=True)
class Option:
    """One option. ``name`` is the :class:`Settings` field; ``cli`` the ``pp-smoke-run`` flag
    (None: not there); ``pytest`` the plugin's flag (None: not there), whose ini key is the flag
    with ``--`` dropped and ``-`` as ``_`` unless ``ini`` is False (a secret would get committed)."""

    name: str
    help: str
    parse: Callable[[str], Any]
    default: Any = None
    cli: str | None = None
    pytest: str | None = None
    env: str | None = None
    ini: bool = True
    group: str = "run"
    secret: bool = False
    choices: tuple[str, ...] | None = None

    @property
    def ini_name(self) -> str | None:
        if not self.pytest or not self.ini:
            return None
        name = self.pytest.lstrip("-").replace("-", "_")
        return name if name.startswith("ppsmoke_") else "ppsmoke_" + name

    def shown(self, raw: object) -> str:
        """How a raw value may appear in an error: a secret never does."""
        return "<hidden>" if self.secret else repr(str(raw))


def _network(text: str) -> str:
    """A network description, checked (its parser is loaded only when one is given)."""
    if text.strip() == "loopback":
        return "loopback"
    from ..network import parse_network

    parse_network(text)
    return text.strip()


def _port(text: str) -> int:
    try:
        port = checks.integer(text, 0)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise SettingError(f"expected a UDP port (1..65535), or 0 for none, got {text!r}")
    return port


def _relay(text: str) -> str:
    from ..runtime.transport import relay_mode

    text = text.strip()
    if text in ("", "default"):
        return ""
    try:
        relay_mode(text)
    except ValueError as e:
        raise SettingError(str(e)) from None
    return text


def _grid(text: str) -> str:
    try:
        grid_spec(text, "")
    except ValueError as e:
        raise SettingError(str(e)) from None
    return text.strip()


def _opt(name: str, help: str, parse: Callable[[str], Any], default: Any = None, **kw: Any) -> Option:
    flag = "--" + name.replace("_", "-")
    kw.setdefault("cli", flag)
    kw.setdefault("pytest", "--ppsmoke-" + name.replace("_", "-"))
    return Option(name, help, parse, default, **kw)


OPTIONS: tuple[Option, ...] = (
    Option(
        "mode",
        "local: the vast.ai emulator and nodes on this machine; vastai: real GPUs on vast.ai "
        "(default: vastai when a key is given, else local)",
        _one_of(MODES, "mode"),
        None,
        cli=None,  # pp-smoke-run says --local or --vastai
        pytest="--ppsmoke-mode",
        env="PPSMOKE_MODE",
        choices=MODES,
    ),
    Option(
        "api_key",
        "vast.ai API key (prefer the variable: arguments show in ps; never an ini key: it would get committed)",
        str,
        "",
        cli="--api-key",
        pytest="--vastai-key",
        env="VAST_API_KEY",
        ini=False,
        secret=True,
    ),
    Option(
        "vast_url",
        f"the vast.ai REST base URL (default {VAST_URL}; local: an embedded emulator)",
        str,
        None,
        cli="--vast-url",
        pytest="--vast-url",
        env="VAST_URL",
    ),
    _opt(
        "model",
        f"a model name or a GGUF path (default {LOCAL_MODEL} local, {VASTAI_MODEL} on vast.ai)",
        _text,
    ),
    _opt("prompt", "the prompt (default 'Say hello')", _text, "Say hello"),
    _opt("max_tokens", "tokens to generate (default 64)", _int_at_least(1), 64),
    _opt(
        "num_stages",
        f"pipeline stages, at least 2 (default {NODE.num_stages})",
        _int_at_least(2),
        NODE.num_stages,
        pytest="--ppsmoke-stages",
    ),
    _opt(
        "wire_dtype",
        "hidden states on the wire: bf16 (default), f16, f32",
        _one_of(WIRE_DTYPES, "wire dtype"),
        NODE.wire_dtype,
        choices=WIRE_DTYPES,
    ),
    _opt(
        "preflight",
        "the checks before the first create: the key, the credit, the image in its registry, the offers, the "
        "stages (on, default; off skips them, for a registry this machine cannot reach)",
        _on_off,
        True,
        choices=("on", "off"),
    ),
    _opt(
        "budget",
        "seconds for the whole run, start to exit, teardown included; rent to decode get it less "
        "--teardown-timeout (default 300)",
        _positive,
        300.0,
    ),
    _opt(
        "reference",
        "after the request, run the model in one piece on stage 0's node and compare tokens: on (default) or off",
        _on_off,
        True,
        choices=("on", "off"),
    ),
    _opt(
        "reference_load",
        "where stage 0's node loads the reference's model: beside (a worker of its own, while the stages load, so "
        "the reference step only generates), after (the stage's worker, after the request: one model in memory at "
        "a time until then), or auto (default: beside on GPUs, after on this machine's CPU, where a third process "
        "takes the cores the stages load on)",
        _one_of(("auto", *REFERENCES), "reference load"),
        "auto",
        choices=("auto", *REFERENCES),
    ),
    _opt("report", "write the run's JSON report here", Path),
    _opt(
        "grid",
        "measure a layout grid, fit its cost model and write the report (pp-smoke-run: instead of the smoke "
        "run; pytest: as a test of the session): off (default), small, or items such as "
        "prompts=32,128;stages=1,2;networks=loopback,wan;weights=native",
        _grid,
        "off",
    ),
    _opt(
        "grid_out",
        "the layout report's directory (default ppsmoke-layout)",
        Path,
        Path("ppsmoke-layout"),
    ),
    _opt(
        "weight_cache",
        "each node's cache of realized stage weights: a directory on the node, off, or auto (default: "
        "~/.cache/ppsmoke/weights on this machine, where a warm load is a read; off on vast.ai, where every "
        "instance is new, so the cache would be written and never read)",
        _text,
        "auto",
    ),
    _opt(
        "program_cache",
        "each node keeps tinygrad's generated programs and schedules in tinygrad's disk cache: on (default) or off",
        _on_off,
        NODE.program_cache,
        choices=("on", "off"),
    ),
    _opt(
        "network",
        "local: the network between the orchestrator and the nodes: loopback (default), or an emulated one, "
        "each node in a network namespace behind a delay switch: lan, wan, far, slow, flaky, with per-link "
        "overrides (e.g. 'wan;host->1=far'); internet, internet-far: wan and far with the orchestrator and "
        "each node behind NAT, on the transport's internet mode (docs/network.md)",
        _network,
        "loopback",
    ),
    _opt(
        "port",
        "the UDP port each create asks vast.ai to forward, for a direct path to its node (default 7000; "
        "0: none, relays only); offers must have a direct port",
        _port,
        7000,
        group="instances",
    ),
    _opt(
        "relay",
        "the relays of the orchestrator and the nodes when a path is not direct: default (n0's), off, or a "
        "dedicated relay's URL",
        _relay,
        "",
        group="instances",
    ),
    _opt("gpus", "local: this machine's GPUs (e.g. 0,1), one per instance in turn", str, ""),
    _opt(
        "runtime",
        "local: an instance is a node process (default) or the image, run by buildah "
        "(build it first: python -m pytest_ppsmoke.cloud.image)",
        _one_of(RUNTIMES, "runtime"),
        "processes",
        choices=RUNTIMES,
    ),
    _opt("image", f"the node image (default {DEFAULT_IMAGE})", _text, DEFAULT_IMAGE, group="instances"),
    _opt("disk", "disk per instance, GB (default 20)", _positive, 20.0, group="instances"),
    _opt("gpu_ram", "least GPU RAM per instance, GB (default 8)", _positive, 8.0, group="instances"),
    _opt(
        "max_price",
        "most $/hour per instance, its disk (--disk) included (default 2.0)",
        _positive,
        2.0,
        group="instances",
    ),
    _opt("min_reliability", "least host reliability, 0..1 (default 0.95)", _fraction, 0.95, group="instances"),
    _opt(
        "min_cuda",
        "least CUDA version the host supports (default 12.4: the image's NVRTC makes PTX for it)",
        _number,
        12.4,
        group="instances",
    ),
    _opt(
        "polls",
        f"the boot window, in polls at vast.ai's {BOOT_POLL_INTERVAL:g} s (default {BOOT_POLLS}: "
        f"{BOOT_POLLS * BOOT_POLL_INTERVAL:g} s, however often the run looks)",
        _int_at_least(1),
        BOOT_POLLS,
        group="deadlines",
    ),
    _opt(
        "poll_interval",
        f"seconds between polls (default {BOOT_POLL_INTERVAL:g}; local 0.25, 1 with --runtime image)",
        _positive,
        group="deadlines",
    ),
    _opt(
        "converge_timeout",
        f"SWIM convergence, seconds (default {CONVERGE_TIMEOUT:g})",
        _positive,
        CONVERGE_TIMEOUT,
        group="deadlines",
    ),
    _opt(
        "load_timeout",
        f"workers ready, seconds (default {NODE.worker_ready_timeout:.0f})",
        _positive,
        NODE.worker_ready_timeout,
        group="deadlines",
    ),
    _opt(
        "resolve_timeout",
        f"stage names, seconds (default {RESOLVE_TIMEOUT:g})",
        _positive,
        RESOLVE_TIMEOUT,
        group="deadlines",
    ),
    _opt(
        "teardown_timeout",
        "destroying everything, seconds; kept back from the budget for the teardown (default 60)",
        _positive,
        60.0,
        group="deadlines",
    ),
    _opt(
        "node_ttl",
        f"a node's own time-to-live, seconds (default {NODE.ttl:.0f})",
        _positive,
        NODE.ttl,
        group="deadlines",
    ),
    _opt(
        "orphan_grace",
        f"how long a node outlives a lost orchestrator, seconds (default {NODE.orphan_grace:.0f})",
        _positive,
        NODE.orphan_grace,
        group="deadlines",
    ),
)


_DEFAULT: dict[str, Any] = {o.name: o.default for o in OPTIONS}


@dataclass(frozen=True)
class Settings:
    """One run's settings, resolved: every field has its final value."""

    mode: str = "local"
    api_key: str = field(default="", repr=False)
    vast_url: str | None = _DEFAULT["vast_url"]  # None: vast.ai's in vastai mode, an embedded emulator in local mode
    model: str = LOCAL_MODEL
    prompt: str = _DEFAULT["prompt"]
    max_tokens: int = _DEFAULT["max_tokens"]
    num_stages: int = _DEFAULT["num_stages"]
    wire_dtype: str = _DEFAULT["wire_dtype"]
    budget: float = _DEFAULT["budget"]
    preflight: bool = _DEFAULT["preflight"]
    reference: bool = _DEFAULT["reference"]
    reference_load: str = _DEFAULT["reference_load"]
    report: Path | None = _DEFAULT["report"]
    grid: str = _DEFAULT["grid"]  # a layout grid to measure in the pytest session (harness/gridspec.py's grid_spec)
    grid_out: Path = _DEFAULT["grid_out"]
    weight_cache: str = _DEFAULT["weight_cache"]  # auto; "": the node's default directory; "off"; or a directory
    program_cache: bool = _DEFAULT["program_cache"]
    network: str = _DEFAULT["network"]
    port: int = _DEFAULT["port"]
    relay: str = _DEFAULT["relay"]
    gpus: str = _DEFAULT["gpus"]
    runtime: str = _DEFAULT["runtime"]
    image: str = _DEFAULT["image"]
    disk: float = _DEFAULT["disk"]
    gpu_ram: float = _DEFAULT["gpu_ram"]
    max_price: float = _DEFAULT["max_price"]
    min_reliability: float = _DEFAULT["min_reliability"]
    min_cuda: float = _DEFAULT["min_cuda"]
    polls: int = _DEFAULT["polls"]
    poll_interval: float = 0.25
    converge_timeout: float = _DEFAULT["converge_timeout"]
    load_timeout: float = _DEFAULT["load_timeout"]
    resolve_timeout: float = _DEFAULT["resolve_timeout"]
    teardown_timeout: float = _DEFAULT["teardown_timeout"]
    node_ttl: float = _DEFAULT["node_ttl"]
    orphan_grace: float = _DEFAULT["orphan_grace"]

    @property
    def local(self) -> bool:
        return self.mode == "local"

    @property
    def phases_budget(self) -> float:
        """Seconds for rent to decode (and, under pytest, every test that uses the deployment):
        the budget less the teardown's deadline, which the budget keeps back so that the whole
        run, teardown included, ends within it."""
        return self.budget - self.teardown_timeout

    @property
    def embedded_emulator(self) -> bool:
        """Local mode with no URL given: the run starts its own vast.ai emulator."""
        return self.local and not self.vast_url

    @classmethod
    def resolve(cls, values: Mapping[str, Any]) -> Settings:
        """Settings from parsed values (missing ones take their defaults), with the mode and
        the defaults that follow from it decided."""
        v = {o.name: o.default for o in OPTIONS} | {k: x for k, x in values.items() if x is not None}
        if v["mode"] is None:
            v["mode"] = "vastai" if v["api_key"] else "local"
        local = v["mode"] == "local"
        if v["model"] is None:
            v["model"] = LOCAL_MODEL if local else VASTAI_MODEL
        if v["poll_interval"] is None:
            # a working container of the image takes seconds to make (its files are copied)
            v["poll_interval"] = (1.0 if v.get("runtime") == "image" else 0.25) if local else BOOT_POLL_INTERVAL
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: x for k, x in v.items() if k in names})

    def public(self) -> dict[str, Any]:
        """Every setting as the report gives it; the key never."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "api_key"}
        out["report"] = str(self.report) if self.report else None
        return out


def read(
    flags: Mapping[str, Any],
    ini: Callable[[str], Any] | None = None,
    env: Mapping[str, str] | None = None,
    face: str = "pytest",
) -> Settings:
    """:func:`from_sources`, resolved, and checked across options. Raises :class:`SettingError`
    naming each option involved and where its value came from."""
    values, sources = from_sources(flags, ini, env, face)
    s = Settings.resolve(values)
    if s.network != "loopback" and not s.local:
        net = _named("network", sources, face)
        raise SettingError(f"{net} = {s.network!r} is for local runs: vast.ai's network is the real one")
    if s.budget <= s.teardown_timeout:
        budget, teardown = _named("budget", sources, face), _named("teardown_timeout", sources, face)
        raise SettingError(
            f"{budget} = {s.budget:g} s must be more than {teardown} = {s.teardown_timeout:g} s: the budget "
            "is the whole run's, and keeps the teardown's deadline back from rent to decode; "
            "raise the budget or lower the teardown's deadline"
        )
    return s


def flag(name: str, face: str) -> str:
    """The flag of option ``name`` on ``face`` (pytest or cli), or its name where it has none there."""
    opt = next((o for o in OPTIONS if o.name == name), None)
    if opt is None:
        return name
    return (opt.pytest if face == "pytest" else opt.cli) or opt.name


def in_face(text: str, face: str) -> str:
    """A lower layer's message as ``face`` shows it: each setting it names (``protocol.setting``) as
    this face's flag, the reap advice (``protocol.reap_advice``) as the command."""
    text = re.sub(r"<setting:(\w+)>", lambda m: flag(m[1], face), text)
    return re.sub(r"<reap:([^>]*)>", lambda m: f"pp-smoke-run --reap --run-id {m[1]}", text)


def _named(name: str, sources: Mapping[str, str], face: str) -> str:
    """An option as an error names it: its flag on this face, and where its value came from."""
    opt = next(o for o in OPTIONS if o.name == name)
    flag = (opt.pytest if face == "pytest" else opt.cli) or opt.name
    source = sources.get(name)
    if source is None:
        return f"{flag} (the default)"
    return flag if source == flag else f"{flag} (from {source})"


def from_sources(
    flags: Mapping[str, Any],
    ini: Callable[[str], Any] | None = None,
    env: Mapping[str, str] | None = None,
    face: str = "pytest",
) -> tuple[dict[str, Any], dict[str, str]]:
    """Each option's parsed value (absent when nowhere given) and where it came from, by
    precedence: ``flags`` (already parsed or raw text, keyed by option name) > ``env`` > ``ini``.
    ``face`` (pytest or cli) picks the flag names that errors use. Raises
    :class:`SettingError` naming the option, its source and what was expected."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for opt in OPTIONS:
        raw: Any = None
        source = ""
        flag = (opt.pytest if face == "pytest" else opt.cli) or opt.name
        if flags.get(opt.name) is not None:
            raw, source = flags[opt.name], flag
        elif opt.env and env.get(opt.env):
            raw, source = env[opt.env], f"environment variable {opt.env}"
        elif ini is not None and opt.ini_name:
            found = ini(opt.ini_name)
            if found not in (None, "", []):
                raw, source = found, f"ini {opt.ini_name}"
        if raw is None:
            continue
        if isinstance(raw, str):
            try:
                raw = opt.parse(raw)
            except (SettingError, ValueError) as e:
                detail = "not a valid value" if opt.secret else str(e)
                where = flag if source == flag else f"{flag} (from {source})"
                raise SettingError(f"{where} = {opt.shown(raw)}: {detail}") from None
        values[opt.name], sources[opt.name] = raw, source
    return values, sources

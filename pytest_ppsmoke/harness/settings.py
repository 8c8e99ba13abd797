"""The table of a smoke run's settings: every option declared once, as a field of
:class:`Settings` (``options.option``: its default, type, help, check and where it may come from),
so ``settings.max_tokens`` is typed as it is declared; :data:`OPTIONS` lists them, derived from
the fields (:data:`TABLE`, ``options.Table``). ``pp-smoke-run``'s flags and the pytest plugin's
options and ini keys are both generated from :data:`OPTIONS`, so the two faces cannot drift;
another command's flag that is a setting comes from it too (:func:`add_option`). A default is
written once, as the value: the help adds it (``Option.help``). Values are read and checked by
``checks.py``'s checks, as ``NodeEnv``'s are; the machinery (sources, precedence, flags, the
parser) is ``harness/options.py``'s. Defaults that depend on the mode (the model, the poll
interval) are resolved once the mode is known; :func:`read` checks the options across each other.

This module imports only the standard library and the package's shared tables: the pytest plugin
reads it at start-up, in every pytest run of every project that has the package installed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any

from .. import DEFAULT_IMAGE, checks
from ..cloud.provider import OfferQuery  # the offer search's defaults (stdlib only)
from ..cloud.replace import ReplacePolicy  # the replacement's defaults (stdlib only)
from ..cloud.runtimenames import NAMES as RUNTIMES  # the runtimes an emulated instance can be (stdlib only)
from ..nodeenv import DEFAULTS as NODE
from ..nodeenv import REFERENCES
from ..protocol import (
    BOOT_POLL_INTERVAL,
    BOOT_POLLS,
    BUDGET,
    CONVERGE_TIMEOUT,
    DIRECT_PORT,
    LEAST_DISK_GB,
    RESOLVE_TIMEOUT,
    WIRE_DTYPES,
)
from .gridspec import grid_spec
from .options import SettingError, Table, option

# the run's steps, in order: the driver runs them, the plugin maps its fixtures to them
STEPS = ("rent", "boot", "converge", "load", "resolve", "infer", "reference")
MODES = ("local", "vastai")
VAST_URL = "https://console.vast.ai"


# --- the options' own forms: a check of checks.py each, with its error in its own words ---------


def _network(text: str) -> str:
    """A network description, checked (its parser is loaded only when one is given)."""
    if text.strip() == "loopback":
        return "loopback"
    from ..network import parse_network

    try:
        parse_network(text)
    except ValueError as e:
        raise checks.Invalid(f"is not a network description: {e}") from None
    return text.strip()


def _relay(text: str) -> str:
    from ..runtime.transport import relay_mode

    text = text.strip()
    if text in ("", "default"):
        return ""
    try:
        relay_mode(text)
    except ValueError as e:
        raise checks.Invalid(f"is not a relay setting: {e}") from None
    return text


def _grid(text: str) -> str:
    try:
        grid_spec(text, "")
    except ValueError as e:
        raise checks.Invalid(f"is not a grid: {e}") from None
    return text.strip()


_TEXT = checks.text(nonempty=True)
_POSITIVE = checks.numbers(above=0)


def _least_disk(gb: float) -> bool:
    """At least the disk vast.ai documents as a create's least (``protocol.LEAST_DISK_GB``)."""
    least = LEAST_DISK_GB
    if not gb >= least:
        raise checks.Invalid(f"must be at least {least:g} GB (the least disk vast.ai takes for a create), got {gb:g}")
    return True


_DISK = checks.Check("a number of GB", float, _least_disk, types=(int, float), show=lambda x: f"{x:g}")
_ON_OFF = checks.switch("on", "off")
_PATH: checks.Check[Path] = checks.Check("a path", Path, types=(Path,))
_PORT = checks.Check("a UDP port (1..65535), or 0 for none", checks.integer, lambda n: 0 <= n <= 65535, types=(int,))


# the tasks the help groups the options by, in the order it shows them: an option's ``group`` is a key
GROUPS = {
    "run": "the run",
    "model": "the model, its stages and the request",
    "network": "the network between the orchestrator and the nodes",
    "instances": "instances (vast.ai)",
    "local": "local emulator",
    "deadlines": "deadlines (the spec's by default)",
    "reports": "reports and the layout grid",
}


# the defaults that the mode decides, written once here and given in words by the help
LOCAL_MODEL, VASTAI_MODEL = NODE.model, "llama3.2:1b"
LOCAL_POLL_INTERVAL, IMAGE_POLL_INTERVAL = 0.25, 1.0  # a working container of the image takes seconds to make
REPLACE = ReplacePolicy()  # vast.ai's per-host deadline, chosen by the simulation (docs/benchmarks.md)
# an emulated host runs as soon as its node's process starts, or its container is made (seconds
# more): one not running by then is stuck, and its replacement fits the budget many times over
LOCAL_HOST_DEADLINE, IMAGE_HOST_DEADLINE = 10.0, 60.0


@dataclass(frozen=True, kw_only=True)
class Settings:
    """One run's settings, resolved: every field has its final value. Each field is an option,
    declared once here (:func:`option`): its default, check, help and sources; :data:`OPTIONS`
    lists them, in this order, for the faces' flags. Build one with :meth:`resolve`."""

    mode: str = option(
        MISSING,
        "local: the vast.ai emulator and nodes on this machine; vastai: real GPUs on vast.ai",
        checks.choice(MODES, "mode"),
        cli=None,  # pp-smoke-run says --local or --vastai
        env="PPSMOKE_MODE",
        group="run",
        default_text="vastai when a key is given, else local",
    )
    api_key: str = option(
        "",
        "vast.ai API key (prefer the variable: arguments show in ps; never an ini key: it would get committed)",
        checks.text(secret=True),
        cli="--api-key",
        pytest="--vastai-key",
        env="VAST_API_KEY",
        ini=False,
        group="run",
        repr=False,
    )
    vast_url: str | None = option(
        None,
        "the vast.ai REST base URL",
        checks.text(),
        pytest="--vast-url",
        env="VAST_URL",
        group="run",
        default_text=f"{VAST_URL}; local: an embedded emulator",
        metavar="URL",
    )
    model: str = option(
        MISSING,
        "a model name or a GGUF path",
        _TEXT,
        group="model",
        default_text=f"{LOCAL_MODEL} local, {VASTAI_MODEL} on vast.ai",
        metavar="NAME|PATH",
    )
    prompt: str = option("Say hello", "the prompt", _TEXT, group="model")
    max_tokens: int = option(64, "tokens to generate", checks.integers(1), group="model")
    num_stages: int = option(
        NODE.num_stages, "pipeline stages", checks.integers(2), pytest="--ppsmoke-stages", group="model"
    )
    wire_dtype: str = option(
        NODE.wire_dtype,
        "hidden states on the wire: " + ", ".join(WIRE_DTYPES),
        checks.choice(WIRE_DTYPES, "wire dtype"),
        group="model",
    )
    preflight: bool = option(
        True,
        "the checks before the first create: the key, the credit, the image in its registry, the offers, the "
        "stages (off skips them, for a registry this machine cannot reach)",
        _ON_OFF,
        group="run",
    )
    budget: float = option(
        BUDGET,
        "seconds for the whole run, start to exit, teardown included; rent to decode get it less --teardown-timeout",
        _POSITIVE,
        group="deadlines",
        metavar="SECONDS",
    )
    reference: bool = option(
        True,
        "run the model in one piece on stage 0's node and compare its tokens with the request's: on or off",
        _ON_OFF,
        group="model",
    )
    reference_load: str = option(
        "auto",
        "where stage 0's node loads the reference's model: beside (a worker of its own, while the stages load; it is "
        "asked as soon as stage 0's node joins and runs while the stages load, so the reference step only waits for "
        "its answer), after (the stage's worker, after the request: one model in memory at a time until then), or "
        "auto (beside on GPUs, after on this machine's CPU, where a third process takes the cores the stages load on)",
        checks.choice(("auto", *REFERENCES), "reference load"),
        group="model",
    )
    # option() makes a dataclasses.field, which ruff knows for str, int, float and bool fields only
    report: Path | None = option(None, "write the run's JSON report here", _PATH, group="reports")  # noqa: RUF009
    timeline: Path | None = option(  # noqa: RUF009
        None,
        "draw the run's timeline (each instance's steps, each phase, the budget) as an image here, "
        "with matplotlib (pip install 'pytest-ppsmoke[layout]')",
        _PATH,
        group="reports",
        metavar="FILE.png",
    )
    grid: str = option(
        "off",
        "measure a layout grid, fit its cost model and write the report (pp-smoke-run: instead of the smoke "
        "run; pytest: as a test of the session): off, small, or items such as "
        "prompts=32,128;stages=1,2;networks=loopback,wan;weights=native",
        checks.Check("a grid", _grid),
        group="reports",
        metavar="{off,small,ITEMS}",
    )
    grid_out: Path = option(  # noqa: RUF009
        Path("ppsmoke-layout"), "the layout report's directory", _PATH, group="reports", metavar="DIR"
    )
    # auto; "": the node's default directory; "off"; or a directory
    weight_cache: str = option(
        "auto",
        "each node's cache of realized stage weights: a directory on the node, off, or auto "
        "(~/.cache/ppsmoke/weights on this machine, where a warm load is a read; off on vast.ai, where every "
        "instance is new, so the cache would be written and never read)",
        _TEXT,
        group="model",
        metavar="{auto,off,DIR}",
    )
    program_cache: bool = option(
        NODE.program_cache,
        "each node keeps tinygrad's generated programs and schedules in tinygrad's disk cache: on or off",
        _ON_OFF,
        group="model",
    )
    network: str = option(
        "loopback",
        "local: the network between the orchestrator and the nodes: loopback, or an emulated one, "
        "each node in a network namespace behind a delay switch: lan, wan, far, slow, flaky, with per-link "
        "overrides (e.g. 'wan;host->1=far'); internet, internet-far: wan and far with the orchestrator and "
        "each node behind NAT, on the transport's internet mode (docs/network.md)",
        checks.Check("a network description", _network),
        group="network",
        metavar="PROFILE",
    )
    port: int = option(
        DIRECT_PORT,
        "the UDP port each create asks vast.ai to forward, for a direct path to its node (0: none, relays "
        "only); offers must have a direct port",
        _PORT,
        group="network",
    )
    relay: str = option(
        "",
        "the relays of the orchestrator and the nodes when a path is not direct: default (n0's), off, or a "
        "dedicated relay's URL",
        checks.Check("a relay setting", _relay),
        group="network",
        metavar="{default,off,URL}",
    )
    gpus: str = option(
        "",
        "local: this machine's GPUs (e.g. 0,1), one per instance in turn",
        checks.text(),
        group="local",
        metavar="I,J,...",
    )
    runtime: str = option(
        "processes",
        "local: an instance is a node process (processes) or the image, run by buildah "
        "(image; build it first: python -m pytest_ppsmoke.cloud.image)",
        checks.choice(RUNTIMES, "runtime"),
        group="local",
    )
    image: str = option(DEFAULT_IMAGE, "the node image", _TEXT, group="instances", metavar="IMAGE:TAG")
    disk: float = option(OfferQuery.disk_gb, "disk per instance, GB", _DISK, group="instances", metavar="GB")
    gpu_ram: float = option(
        OfferQuery.gpu_ram_gb, "least GPU RAM per instance, GB", _POSITIVE, group="instances", metavar="GB"
    )
    max_price: float = option(
        OfferQuery.max_dph,
        "most $/hour per instance, its disk (--disk) included",
        _POSITIVE,
        group="instances",
        metavar="USD",
    )
    min_reliability: float = option(
        OfferQuery.min_reliability,
        "least host reliability, 0..1",
        checks.numbers(least=0, most=1),
        group="instances",
        metavar="0..1",
    )
    min_cuda: float = option(
        OfferQuery.min_cuda,
        "least CUDA version the host supports (the default is the one the image's NVRTC makes PTX for)",
        checks.numbers(),
        group="instances",
        metavar="VERSION",
    )
    polls: int = option(
        BOOT_POLLS,
        f"the boot window, in polls at vast.ai's {BOOT_POLL_INTERVAL:g} s, however often the run looks",
        checks.integers(1),
        group="deadlines",
        default_text=f"{BOOT_POLLS}: {BOOT_POLLS * BOOT_POLL_INTERVAL:g} s",
    )
    poll_interval: float = option(
        MISSING,
        "seconds between polls",
        _POSITIVE,
        group="deadlines",
        default_text=f"{BOOT_POLL_INTERVAL:g}; local {LOCAL_POLL_INTERVAL:g}, {IMAGE_POLL_INTERVAL:g} with "
        "--runtime image",
        metavar="SECONDS",
    )
    replace_hosts: bool = option(
        True,
        "replace a host that is not running by the host deadline, or whose node has not joined within "
        f"{REPLACE.join_deadline:g} s of running, with an instance on another machine, when the rest of the budget "
        "fits one: on or off (off: the spec's error table, where such a host fails the run)",
        _ON_OFF,
        group="deadlines",
    )
    host_deadline: float = option(
        MISSING,
        "seconds from an instance's create to running before it is replaced (docs/benchmarks.md, the simulation)",
        _POSITIVE,
        group="deadlines",
        default_text=f"{REPLACE.host_deadline:g}; local {LOCAL_HOST_DEADLINE:g}, {IMAGE_HOST_DEADLINE:g} with "
        "--runtime image",
        metavar="SECONDS",
    )
    converge_timeout: float = option(
        CONVERGE_TIMEOUT, "SWIM convergence, seconds", _POSITIVE, group="deadlines", metavar="SECONDS"
    )
    load_timeout: float = option(
        NODE.worker_ready_timeout, "workers ready, seconds", _POSITIVE, group="deadlines", metavar="SECONDS"
    )
    resolve_timeout: float = option(
        RESOLVE_TIMEOUT, "stage names, seconds", _POSITIVE, group="deadlines", metavar="SECONDS"
    )
    teardown_timeout: float = option(
        60.0,
        "destroying everything, seconds; kept back from the budget for the teardown",
        _POSITIVE,
        group="deadlines",
        metavar="SECONDS",
    )
    node_ttl: float = option(
        NODE.ttl, "a node's own time-to-live, seconds", _POSITIVE, group="deadlines", metavar="SECONDS"
    )
    orphan_grace: float = option(
        NODE.orphan_grace,
        "how long a node outlives a lost orchestrator, seconds",
        _POSITIVE,
        group="deadlines",
        metavar="SECONDS",
    )

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
            image = v.get("runtime") == "image"
            v["poll_interval"] = (
                (IMAGE_POLL_INTERVAL if image else LOCAL_POLL_INTERVAL) if local else BOOT_POLL_INTERVAL
            )
        if v["host_deadline"] is None:
            image = v.get("runtime") == "image"
            v["host_deadline"] = (
                (IMAGE_HOST_DEADLINE if image else LOCAL_HOST_DEADLINE) if local else REPLACE.host_deadline
            )
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: x for k, x in v.items() if k in names})

    def public(self) -> dict[str, Any]:
        """Every setting as the report gives it; the key never."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "api_key"}
        out["report"] = str(self.report) if self.report else None
        out["timeline"] = str(self.timeline) if self.timeline else None
        return out


TABLE = Table(Settings, GROUPS)
OPTIONS = TABLE.options
add_option = TABLE.add_option  # a setting as another command's flag (pp-layout's)
face_names = TABLE.names  # how a face (pytest or cli) names each setting: its flags


def read(
    flags: Mapping[str, Any],
    ini: Callable[[str], Any] | None = None,
    env: Mapping[str, str] | None = None,
    face: str = "pytest",
) -> Settings:
    """The values of ``TABLE.from_sources``, resolved, and checked across options. Raises
    :class:`SettingError` naming each option involved and where its value came from."""
    values, sources = TABLE.from_sources(flags, ini, env, face)
    s = Settings.resolve(values)
    if s.network != "loopback" and not s.local:
        net = TABLE.named("network", sources, face)
        raise SettingError(f"{net} = {s.network!r} is for local runs: vast.ai's network is the real one")
    if s.budget <= s.teardown_timeout:
        budget, teardown = TABLE.named("budget", sources, face), TABLE.named("teardown_timeout", sources, face)
        raise SettingError(
            f"{budget} = {s.budget:g} s must be more than {teardown} = {s.teardown_timeout:g} s: the budget "
            "is the whole run's, and keeps the teardown's deadline back from rent to decode; "
            "raise the budget or lower the teardown's deadline"
        )
    return s

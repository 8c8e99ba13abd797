"""pytest-ppsmoke's pytest plugin (``pytest11`` entry point ``ppsmoke``): options, markers,
session fixtures, the budget, and reporting. The work is done by the library
(:class:`~pytest_ppsmoke.harness.session.SmokeSession`); this module is hooks and thin fixtures.

Options, each mirrored by an ini key (the key excepted: a key in an ini file gets committed).
Precedence: command line > environment variable (where one is named) > ini > default.

Fixtures, session-scoped, each building on the one before:
``ppsmoke_session`` (its finalizer destroys everything rented, on every path) ->
``ppsmoke_instances`` (rented and running) -> ``ppsmoke_cluster`` (1 + N members converged,
workers ready) -> ``ppsmoke_names`` (the stage names resolved) -> ``ppsmoke_inference`` (the
prompt answered, with its figures).

The spec's claims are tests shipped in ``pytest_ppsmoke.spec``:
``pytest --pyargs pytest_ppsmoke.spec -m local`` (or ``-m vastai --vastai-key ...``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .cloud.lifecycle import DEFAULT_IMAGE, Deployment
from .cloud.vast import DEFAULT_URL
from .harness.pipeline import InferenceResult
from .harness.session import Settings, SmokeSession
from .runtime.codec import ActorAddress, WireDtype

MARKERS = {
    "local": (
        "runs on this machine with no key, no GPU and no network: loopback iroh, CPU tinygrad, the vast.ai emulator"
    ),
    "vastai": "rents real GPUs on vast.ai; needs --vastai-key or VAST_API_KEY",
    "gpu": "needs a CUDA GPU on this machine",
}

SETTINGS = pytest.StashKey[Settings]()
SESSION = pytest.StashKey[SmokeSession]()
FIXTURES = (
    "ppsmoke_session",
    "ppsmoke_instances",
    "ppsmoke_cluster",
    "ppsmoke_names",
    "ppsmoke_inference",
    "ppsmoke_teardown",
)


@dataclass(frozen=True)
class Option:
    flag: str
    dest: str
    help: str
    parse: Callable[[str], Any]
    default: Any
    ini: str | None = None
    env: str | None = None

    @property
    def ini_name(self) -> str:
        return self.ini or self.flag.lstrip("-").replace("-", "_")


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise ValueError(f"expected an integer of at least {low}, got {text!r}")
        return value

    return parse


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"expected a positive number, got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise ValueError(f"expected a number between 0 and 1, got {text!r}")
    return value


def _wire(text: str) -> str:
    return WireDtype.parse(text).name


OPTIONS = [
    Option("--vastai-key", "key", "vast.ai API key (no ini key: it would get committed)", str, "", env="VAST_API_KEY"),
    Option("--vast-url", "vast_url", "vast.ai REST base URL", str, DEFAULT_URL, "ppsmoke_vast_url", "VAST_URL"),
    Option("--ppsmoke-model", "model", "model name or GGUF path (default smollm2:135m local, llama3.2:1b)", str, None),
    Option("--ppsmoke-stages", "num_stages", "pipeline stages, at least 2 (default 2)", _int_at_least(2), 2),
    Option("--ppsmoke-wire-dtype", "wire_dtype", "hidden states on the wire: bf16 (default), f16, f32", _wire, "bf16"),
    Option("--ppsmoke-image", "image", f"node image on vast.ai (default {DEFAULT_IMAGE})", str, DEFAULT_IMAGE),
    Option("--ppsmoke-budget", "budget", "seconds for the whole session (default 300)", _positive, 300.0),
    Option("--ppsmoke-max-tokens", "max_tokens", "tokens to generate (default 64)", _int_at_least(1), 64),
    Option("--ppsmoke-prompt", "prompt", "the prompt (default 'Say hello')", str, "Say hello"),
    Option("--ppsmoke-gpu-ram", "gpu_ram", "least GPU RAM per instance, GB (default 8)", _positive, 8.0),
    Option("--ppsmoke-max-price", "max_price", "most $/hour per instance (default 2.0)", _positive, 2.0),
    Option("--ppsmoke-min-reliability", "min_reliability", "least host reliability, 0..1 (0.95)", _fraction, 0.95),
    Option("--ppsmoke-report", "report", "write the session's JSON report here", Path, None),
]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ppsmoke", "pipeline-parallel smoke test (pytest-ppsmoke)")
    for opt in OPTIONS:
        env = f"; env {opt.env}" if opt.env else ""
        ini = f"; ini {opt.ini_name}" if opt.dest != "key" else ""
        group.addoption(opt.flag, dest="ppsmoke_" + opt.dest, default=None, help=f"{opt.help}{env}{ini}")
        if opt.dest != "key":
            parser.addini(opt.ini_name, help=opt.help + (f" (env {opt.env} overrides)" if opt.env else ""))


def _value(config: pytest.Config, opt: Option) -> tuple[Any, str]:
    """The option's raw value and where it came from (for an error message)."""
    raw = config.getoption("ppsmoke_" + opt.dest)
    if raw is not None:
        return raw, opt.flag
    if opt.env and os.environ.get(opt.env):
        return os.environ[opt.env], f"environment variable {opt.env}"
    if opt.dest != "key":
        ini = config.getini(opt.ini_name)
        if ini not in (None, "", []):
            return ini, f"ini {opt.ini_name}"
    return None, "default"


def read_settings(config: pytest.Config) -> Settings:
    values: dict[str, Any] = {}
    for opt in OPTIONS:
        raw, source = _value(config, opt)
        if raw is None:
            values[opt.dest] = opt.default
            continue
        try:
            values[opt.dest] = opt.parse(str(raw))
        except ValueError as e:
            shown = "<hidden>" if opt.dest == "key" else repr(str(raw))
            detail = str(e) if opt.dest != "key" else "bad value"
            raise pytest.UsageError(f"{opt.flag} (from {source}) = {shown}: {detail}") from None
    markexpr = config.getoption("markexpr", "") or ""
    wants_vastai = "vastai" in markexpr and "not vastai" not in markexpr
    mode = "vastai" if wants_vastai or (values["key"] and "local" not in markexpr) else "local"
    if values["model"] is None:
        values["model"] = "smollm2:135m" if mode == "local" else "llama3.2:1b"
    return Settings(mode=mode, **values)


def pytest_configure(config: pytest.Config) -> None:
    for name, help_text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {help_text}")
    config.stash[SETTINGS] = read_settings(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A timeout on every test that uses the session: ``--timeout`` (or the ini ``timeout``) if
    set, else the budget; always by pytest-timeout's signal method, which raises in the test so
    that the session's finalizers still run (the thread method ends the process). A test's own
    timeout marker wins."""
    user = config.getoption("timeout", None) or config.getini("timeout") if _has_timeout(config) else None
    seconds = float(user) if user else config.stash[SETTINGS].budget
    for item in items:
        if _uses_session(item) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(seconds, method="signal"))
    # a test that tears the session down runs after every other test of the session
    items.sort(key=lambda item: "ppsmoke_teardown" in getattr(item, "fixturenames", ()))


def _has_timeout(config: pytest.Config) -> bool:
    return config.pluginmanager.has_plugin("timeout")


def _uses_session(item: pytest.Item) -> bool:
    return any(f in getattr(item, "fixturenames", ()) for f in FIXTURES)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The session's deadline, counted from its first step (renting): once it has passed, the
    remaining tests fail at once."""
    session = item.config.stash.get(SESSION, None)
    if session is None or not _uses_session(item):
        return
    if session.remaining() <= 0:
        budget = session.settings.budget
        pytest.fail(f"the session's budget of {budget:.0f} s is spent", pytrace=False)


def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Every test that used the session carries its figures as JUnit properties."""
    session = item.config.stash.get(SESSION, None)
    if session is None or not _uses_session(item):
        return
    for name, value in properties(session.figures()):
        item.user_properties.append((name, value))


def properties(fig: dict[str, Any]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [("ppsmoke_mode", fig["mode"]), ("ppsmoke_run_id", fig["run_id"])]
    out += [(f"ppsmoke_time_{k}", v) for k, v in sorted(fig["timings"].items())]
    for hop, phases in sorted(fig.get("hops", {}).items()):
        for phase, h in phases.items():
            out.append((f"ppsmoke_hop_{hop}_{phase}_bytes", h["bytes_each"]))
            out.append((f"ppsmoke_hop_{hop}_{phase}_median_s", h["median_s"]))
    out.append(("ppsmoke_instances", ",".join(str(i["id"]) for i in fig["instances"])))
    out.append(("ppsmoke_cost_usd", fig["cost_usd"]))
    return out


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def ppsmoke_settings(pytestconfig: pytest.Config) -> Settings:
    return pytestconfig.stash[SETTINGS]


@pytest.fixture(scope="session")
def ppsmoke_session(pytestconfig: pytest.Config, ppsmoke_settings: Settings) -> Iterator[SmokeSession]:
    """The session's deployment. Its finalizer destroys everything rented, however the session
    ends: passed, failed, timed out (pytest-timeout's signal), or interrupted (Ctrl-C)."""
    if ppsmoke_settings.mode == "vastai" and not ppsmoke_settings.key:
        pytest.skip("-m vastai needs a vast.ai API key: pass --vastai-key or set VAST_API_KEY")
    session = SmokeSession(ppsmoke_settings)
    pytestconfig.stash[SESSION] = session
    try:
        yield session
    finally:
        try:
            session.teardown()
        finally:
            if ppsmoke_settings.report is not None:
                ppsmoke_settings.report.write_text(json.dumps(session.figures(), indent=2) + "\n")


@pytest.fixture(scope="session")
def ppsmoke_instances(ppsmoke_session: SmokeSession) -> Deployment:
    """One instance per stage, rented on the cheapest matching offers and running."""
    return ppsmoke_session.rent()


@pytest.fixture(scope="session")
def ppsmoke_cluster(ppsmoke_session: SmokeSession, ppsmoke_instances: Deployment) -> Deployment:
    """1 + N members alive in every member's view, every worker ready."""
    return ppsmoke_session.form_cluster()


@pytest.fixture(scope="session")
def ppsmoke_names(ppsmoke_session: SmokeSession, ppsmoke_cluster: Deployment) -> dict[str, ActorAddress]:
    """``pp-entry``, ``pp-exit`` and every ``pp-stage-i``, resolved on the orchestrator."""
    return ppsmoke_session.resolve().names


@pytest.fixture(scope="session")
def ppsmoke_inference(ppsmoke_session: SmokeSession, ppsmoke_names: dict[str, ActorAddress]) -> InferenceResult:
    """The prompt sent through the chain and answered, with its figures."""
    return ppsmoke_session.infer()


@pytest.fixture(scope="session")
def ppsmoke_teardown(ppsmoke_session: SmokeSession) -> SmokeSession:
    """Tears the session down now (the tests that use it run last) and returns it, so that a
    test can check what is left: ``left_after_teardown`` is vast.ai's list of the run's label."""
    ppsmoke_session.teardown()
    return ppsmoke_session


# --- the terminal summary ----------------------------------------------------------------------


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    session = config.stash.get(SESSION, None)
    if session is None:
        return
    fig = session.figures()
    tr = terminalreporter
    tr.write_sep("=", f"pytest-ppsmoke: {fig['mode']}, {fig['model']}, {fig['num_stages']} stages, {fig['wire_dtype']}")
    timings = fig["timings"]
    phases = ["rent", "boot", "converge", "load", "resolve", "prefill", "decode", "teardown"]
    tr.write_line("  ".join(f"{p} {timings[p]:.2f}s" for p in phases if p in timings))
    if "decode_tokens_per_s" in timings:
        tr.write_line(f"decode {timings['decode_tokens_per_s']} tokens/s, {len(fig.get('token_ids', []))} tokens")
    for hop, phases_ in sorted(fig.get("hops", {}).items()):
        for phase, h in phases_.items():
            tr.write_line(f"{hop} {phase}: {h['count']} x {h['bytes_each']} B, median {h['median_s']} s")
    for i in fig["instances"]:
        tr.write_line(
            f"instance {i['id']} stage {i['stage']}: {i['offer']['gpu_name']} ${i['dph_total']}/h, {i['final_state']}"
        )
    tr.write_line(f"cost ${fig['cost_usd']:.4f}" + (f"; error: {fig['error']}" if fig["error"] else ""))

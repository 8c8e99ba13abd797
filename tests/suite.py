"""The suite's session: the two models, tinygrad's device, and a check after every test module
that none of the processes it started (nodes, workers, emulators) is left running.

Every process a test module starts inherits ``PPSMOKE_TEST_TAG=<session>-<module>`` (the
emulator's node processes inherit it, tests/test_image.py's runtime passes it into its containers,
and the nodes pass it to their workers), so a leak is found by its
tag, never confused with another run on the same machine, and killed so that it cannot slow or
disturb the tests after it.

A plugin of the project's own suite: the top-level ``conftest.py`` registers it for the suite only
(never for a user's ``pytest --pyargs pytest_ppsmoke.spec``), and it needs the dev install.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.helpers import SMOLLM2, SYNTH, SYNTH_SEED, TEST_TAG, tagged_processes

SESSION_TAG = f"pytest-{os.getpid()}"

# The property tests check values, never time: hypothesis's per-example deadline (200 ms) is a
# wall-clock assertion, and on 2 cores shared with the suite's clusters one example of a message
# round trip took 298 ms (a flaky failure). Its too_slow health check is another (the time spent
# generating examples), so it is off too. Each test keeps its own number of examples. A
# ``@settings`` takes the profile loaded when its module is imported: this one, loaded before
# collection (tests/test_codec.py checks that its property tests run under it).
settings.register_profile("suite", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("suite")

# The suite starts some 400 interpreters (nodes, workers, pp-smoke-run, the emulator, inner pytest
# sessions, xdist's workers). Where the environment says PYTHONDONTWRITEBYTECODE (as container
# images often do), each of them compiles the package anew, and pytest rewrites the asserts of
# every test module it imports again: a collection of the suite took 8 s instead of 4. The suite
# writes its bytecode (__pycache__, which git ignores), for this process and all it starts.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False

# Every call the emulator answers, in this process and in every pp-smoke-run, pytest and emulator
# the suite starts, is held against vast.ai's own description of its API (cloud/emulator/apidoc.py):
# one that breaks it (and that the allow-list beside the description does not explain) fails.
os.environ["PP_EMULATOR_OPENAPI"] = "strict"

# vast.ai's documented rate limits are on in every emulator the suite starts, and every client of
# one paces by the same table, both at a hundredth of the documented seconds (create 45 ms apart,
# its penalty 120 ms; docs/lifecycle.md, "Rate limits": the suite's time scale). A test that needs
# vast.ai's own seconds runs them on a virtual clock (vastdoc.rate_limits(scale=1)).
os.environ.setdefault("PP_VAST_TIME_SCALE", "0.01")

# pytester points HOME at each test's own directory, so that an inner session reads no user
# configuration. The caches under HOME went with it: every inner session that ran the spec, and
# every pp-smoke-run, node and worker it started, found tinygrad's database (programs, schedules)
# and the weight cache empty and made them anew (a cold suite generated 753 programs, most of
# them the synthetic model's, again in each such session). The caches are the machine's, as they
# are for a user's runs: XDG_CACHE_HOME, which tinygrad and the weight cache both follow, names
# this session's own. A test that wants a cold cache names one of its own (CACHEDB,
# PP_WEIGHT_CACHE), as tests/test_cache.py does.
os.environ.setdefault("XDG_CACHE_HOME", str(Path.home() / ".cache"))

# The files whose tests take longest, first: under xdist a file goes to one worker whole, so a long
# file that starts last is the suite's tail. xdist hands files out in this order only with
# --no-loadscope-reorder (conftest.py): its default reorders them by their number of tests,
# which sent test_codec's 79 quick ones first and test_layout_grid's 3 long ones near the end.
# Ordered by their times, cold (a fresh machine, JUnit, 2026-12-02: test_worker 182 s,
# test_lifecycle 123 s, test_layout_grid 102 s: they make the most tinygrad programs) and warm
# (2026-12-06: test_lifecycle 185 s, a sixth of the suite's test time; test_signals 76 s,
# test_plugin and test_stages 71 s, ... test_budget 20 s); a file missing here starts after them all.
LONGEST_FIRST = (
    "tests/test_lifecycle.py",
    "tests/test_worker.py",
    "tests/test_layout_grid.py",
    "tests/test_cache.py",
    "tests/test_stages.py",
    "tests/test_replace_run.py",
    "tests/test_signals.py",
    "tests/test_plugin.py",
    "tests/test_pipeline.py",
    "tests/test_internet.py",
    "tests/test_network_run.py",
    "tests/test_tails.py",
    "tests/test_preflight.py",
    "tests/test_cli.py",
    "tests/test_layers.py",
    "pytest_ppsmoke/spec/test_spec.py",
    "tests/test_vast.py",
    "tests/test_image.py",
    "tests/test_install.py",
    "tests/test_driver.py",
    "tests/test_bridge.py",
    "tests/test_budget.py",
    "tests/test_codec.py",
    "tests/test_membership.py",
    "tests/test_fake_vast.py",
    "tests/test_xdist.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONGEST_FIRST)))  # stable: files stay whole


LEAK_GRACE = 20.0  # seconds a module's processes get to exit after its last fixture is torn down


@pytest.fixture(scope="session")
def synth_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The path of the session's synthetic GGUF (``tests.helpers.SYNTH``), written once: the
    model of every test that checks orchestration rather than tokens or text."""
    from pytest_ppsmoke.stage.synth import write

    path = tmp_path_factory.mktemp("models") / f"synth-{SYNTH.blocks}x{SYNTH.dim}-seed{SYNTH_SEED}.gguf"
    write(path, SYNTH, SYNTH_SEED)
    return str(path)


@pytest.fixture(scope="session")
def smollm2() -> str:
    """SmolLM2's model name, once it is known to be installed: the model of the tests of tokens
    and text. Without it they fail with the command that installs it."""
    from pytest_ppsmoke.stage.catalog import ModelError, resolve_model

    try:
        resolve_model(SMOLLM2.name)
    except ModelError as e:
        pytest.fail(f"{e} (the tests of tokens and text run on SmolLM2)", pytrace=False)
    return SMOLLM2.name


def _tinygrad_devices() -> list[str]:
    """The device names tinygrad reads from the environment (its ``runtime/ops_*.py``), found
    without importing tinygrad."""
    spec = importlib.util.find_spec("tinygrad")
    if spec is None or not spec.submodule_search_locations:
        return []
    runtime = Path(next(iter(spec.submodule_search_locations))) / "runtime"
    return [p.stem.removeprefix("ops_").upper() for p in runtime.glob("ops_*.py")]


def _llvm_library() -> str:
    """The file of the libLLVM tinygrad's CPU device loads ("" if it found none)."""
    try:
        from tinygrad.runtime.autogen import llvm
    except Exception:  # a tinygrad without it, or none: its processes look for themselves
        return ""
    return str(llvm.dll._name) if getattr(llvm.dll, "loaded", False) else ""


@pytest.fixture(scope="session", autouse=True)
def _tinygrad_on_the_cpu(request: pytest.FixtureRequest) -> Iterator[None]:
    """Without a device in the environment, every process that starts tinygrad probes all its
    backends first (about 1.5 s here, in each worker of each cluster). A session with no ``gpu``
    test and no device chosen names the CPU, which is what that probe finds on such a machine.
    ``HALF=0`` (unless the environment says otherwise) keeps each GGUF's own dtype: SmolLM2's
    quantized weights dequantize to float32, on this CPU 2.6-4x faster than float16, and the claims
    hold in either. The synthetic model is float16 in its file, so the orchestration tests still
    run float16, as do the node image's containers (tests/test_image.py).

    ``UPAT_COMPILE=0`` (unless the environment says otherwise): tinygrad compiles each of its
    rewrite rules into a Python function as it is imported, some 0.3 s of CPU in every process
    that imports it (a worker's start, warm: 0.78 CPU-seconds against 1.14), and the suite starts
    a hundred workers and more, most of which make no program at all. The same rules, matched by
    tinygrad's interpreter instead: the same programs, kernels and values (a warm SmolLM2
    reference generates in the same CPU time). tinygrad's ``getenv`` reads it, so the program
    cache keys it apart: the suite's programs are its own, made once per machine.

    ``LLVM_PATH`` (unless set): the libLLVM that tinygrad's CPU device loads, found once here.
    Without it every process that opens the device looks for the library file by file through
    /lib and /usr/lib (some 0.1 CPU-seconds of a worker's 0.9); with it tinygrad loads that
    file at once. The same library either way, and no program's key reads it.

    The program cache (``stage/cache.py``'s ``install_program_cache``, as every worker installs
    it) in this process too: the tests that run tinygrad here (the references, the loads, the
    tokenizer's model, the synthetic files) generated every program and schedule afresh in each
    session, and the same shapes again in each test (two references of the synthetic model, 6.8
    CPU-seconds cold in-process, 1.1 warm). The same programs: the cache is keyed by each
    kernel's AST, the renderer and every tinygrad setting, and tests/test_cache.py checks it."""
    chosen = os.environ.get("DEV") or any(os.environ.get(d) == "1" for d in _tinygrad_devices())
    if chosen or any(item.get_closest_marker("gpu") for item in request.session.items):
        yield
        return
    os.environ["CPU"] = "1"
    settings = {"HALF": "0", "UPAT_COMPILE": "0", "LLVM_PATH": _llvm_library()}
    ours = [name for name, value in settings.items() if name not in os.environ and value]
    for name in ours:
        os.environ[name] = settings[name]
    if importlib.util.find_spec("tinygrad") is not None:
        from pytest_ppsmoke.stage.cache import install_program_cache

        install_program_cache()
    try:
        yield
    finally:
        os.environ.pop("CPU", None)
        for name in ours:
            os.environ.pop(name, None)


def _reap(prefix: str, grace: float) -> str:
    """Waits up to ``grace`` for the processes tagged ``prefix...`` to exit; kills those that did
    not and says which they were ("" if none)."""
    deadline = time.monotonic() + grace
    while (left := tagged_processes(prefix)) and time.monotonic() < deadline:
        time.sleep(0.2)
    lines = []
    for pid, tag in sorted(left.items()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmd = "?"
        lines.append(f"  pid {pid} ({tag}): {cmd.strip()[:200]}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return "\n".join(lines)


def _holds_the_plugins_session(module: pytest.Module) -> bool:
    """The plugin's session fixtures outlive the module that starts them (the test that tears
    them down runs last in the session): its processes are checked at the session's end."""
    return any(
        name.startswith("ppsmoke_")
        for item in module.session.items
        if item.nodeid.startswith(module.nodeid + "::")
        for name in getattr(item, "fixturenames", ())
    )


@pytest.fixture(scope="module", autouse=True)
def _no_process_left_by_the_module(request: pytest.FixtureRequest) -> Iterator[str]:
    """Tags what the module starts; after its last fixture, nothing with the tag may be running."""
    tag = f"{SESSION_TAG}-{request.module.__name__}"
    before = os.environ.get(TEST_TAG)
    os.environ[TEST_TAG] = tag
    try:
        yield tag
    finally:
        if before is None:
            os.environ.pop(TEST_TAG, None)
        else:
            os.environ[TEST_TAG] = before
    if _holds_the_plugins_session(request.node):
        return
    left = _reap(tag, LEAK_GRACE)
    if left:
        pytest.fail(f"{request.module.__name__} left processes running (now killed):\n{left}", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def _no_process_left_by_the_session() -> Iterator[None]:
    yield
    left = _reap(SESSION_TAG + "-", LEAK_GRACE)
    if left:
        pytest.fail(f"the session left processes running (now killed):\n{left}", pytrace=False)

"""pytest-ppsmoke's pytest plugin (``pytest11`` entry point ``ppsmoke``): options, markers,
session fixtures, the budget, and reporting. The work is done by the run driver
(:mod:`pytest_ppsmoke.harness.driver`), stepped by :class:`~pytest_ppsmoke.harness.session.SmokeSession`;
this module is hooks and thin fixtures.

Loading the plugin imports the standard library, pytest and the settings table only: every
pytest run of a project that merely has the package installed pays nothing more. The runtime
(iroh, aiohttp, tinygrad) loads when a ppsmoke fixture is first requested. No asyncio plugin is
needed: the session runs its own event loop in a thread.

Options come from the settings table (:mod:`pytest_ppsmoke.harness.settings`), each mirrored by
an ini key (the key excepted: a key in an ini file gets committed). Precedence: command line >
environment variable (where one is named) > ini > default. The mode is explicit:
``--ppsmoke-mode local|vastai``; without it, a key means vastai. ``-m`` only selects tests.

Fixtures, session-scoped, each building on the one before:
``ppsmoke_session`` (its finalizer destroys everything rented, on every path) ->
``ppsmoke_instances`` (rented and running) -> ``ppsmoke_cluster`` (1 + N members converged,
workers ready) -> ``ppsmoke_names`` (the stage names resolved) -> ``ppsmoke_inference`` (the
prompt answered, with its figures) -> ``ppsmoke_reference`` (the model in one piece on stage 0's
node, after the request). ``ppsmoke_teardown`` tears the session down (its tests run last).

A failed phase shows once, as one line naming the phase, the cause and what to do, on the first
test that needed it; every later test that needs that phase fails at once, pointing there.

The budget (``--ppsmoke-budget``) is the deployment's wall clock, from its first use to the end of
its teardown: the steps, and every test that uses the deployment, must start within the budget
less the teardown's deadline (``--ppsmoke-teardown-timeout``), which is kept for the teardown.

One deployment per session, whatever the runner: under pytest-xdist, every test that uses the
deployment runs in one worker (:mod:`pytest_ppsmoke.distributed`), and the teardown's tests run
after every other test of the session, also when the order is shuffled (``-p randomly``),
failed-first (``--ff``) or stepped (``--sw``).

The spec's claims are tests shipped in ``pytest_ppsmoke.spec``:
``pytest --pyargs pytest_ppsmoke.spec -m local`` (or ``-m vastai --vastai-key ...``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from .harness.options import SettingError, plain
from .harness.settings import GROUPS, OPTIONS, STEPS, Settings, read
from .nodeids import XDIST_SUFFIX, plain_nodeid

if TYPE_CHECKING:
    from .harness.deployment import Deployment
    from .harness.figures import ReferenceFigures
    from .harness.pipeline import InferenceResult
    from .harness.progress import Relay
    from .harness.session import SmokeSession
    from .runtime.codec import ActorAddress

MARKERS = {
    "local": (
        "runs on this machine with no key, no GPU and no network: loopback iroh, CPU tinygrad, the vast.ai emulator"
    ),
    "vastai": "rents real GPUs on vast.ai; needs --vastai-key or VAST_API_KEY",
    "gpu": "needs a CUDA GPU on this machine",
}

SETTINGS = pytest.StashKey[Settings]()
STATE = pytest.StashKey["_State"]()

# each fixture and the driver step it needs
STEP_OF = {
    "ppsmoke_instances": "boot",
    "ppsmoke_cluster": "load",
    "ppsmoke_names": "resolve",
    "ppsmoke_inference": "infer",
    "ppsmoke_reference": "reference",
}
FIXTURES = ("ppsmoke_session", *STEP_OF, "ppsmoke_teardown")
BACKSTOP = 30.0  # seconds past the budget before pytest-timeout stops a test that uses the session


class _State:
    """The plugin's own record of the session: its deployment and where it first failed."""

    def __init__(self) -> None:
        self.session: SmokeSession | None = None
        self.current: str = ""  # the test being set up
        self.failed_in: str | None = None  # the test whose setup showed the failure
        self.teardown_reported = False
        self.recorded: set[str] = set()  # the JUnit properties already on a test: each goes on one


def _group(parser: pytest.Parser, name: str) -> pytest.OptionGroup:
    """The help's group of the options of one task (:data:`GROUPS`)."""
    return parser.getgroup(f"ppsmoke-{name}", f"pytest-ppsmoke: {GROUPS[name]}")


def pytest_addoption(parser: pytest.Parser) -> None:
    """The settings table's options, grouped by task as ``pp-smoke-run --help`` groups them, each
    with its values as the metavar (its choices, N, SECONDS, URL...), the real variable it reads
    and its ini key."""
    for name in GROUPS:  # the groups in the table's order of tasks, whichever option comes first
        _group(parser, name)
    for opt in OPTIONS:
        if opt.pytest is None:
            continue
        env = f"; env {opt.env}" if opt.env else ""
        ini = f"; ini {opt.ini_name}" if opt.ini_name else ""
        _group(parser, opt.group).addoption(
            opt.pytest,
            dest="ppsmoke_" + opt.name,
            default=None,
            choices=opt.choices,
            metavar=opt.metavar,
            help=plain(f"{opt.help}{env}{ini}"),
        )
        if opt.ini_name:
            parser.addini(opt.ini_name, help=plain(opt.help + (f" (env {opt.env} overrides)" if opt.env else "")))


def read_settings(config: pytest.Config) -> Settings:
    flags = {o.name: config.getoption("ppsmoke_" + o.name) for o in OPTIONS if o.pytest}
    try:
        return read(flags, ini=config.getini)
    except SettingError as e:
        raise pytest.UsageError(str(e)) from None


def pytest_configure(config: pytest.Config) -> None:
    for name, help_text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {help_text}")
    config.stash[SETTINGS] = read_settings(config)
    config.stash[STATE] = _State()
    # registered now, after the plugins that reorder tests in their own wrappers (--lf/--ff/--nf
    # register theirs in a tryfirst pytest_configure): the last registered is the outermost
    config.pluginmanager.register(_LastWord(), "ppsmoke-last-word")
    if not hasattr(config, "workerinput"):  # not an xdist worker, whose reports must keep their node ids
        config.pluginmanager.register(_PlainIds(), "ppsmoke-plain-ids")


class _LastWord:
    """The collection's final order and node ids, after every other plugin's reordering."""

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> Iterator[None]:
        yield  # pytest-randomly shuffles before this yield; --lf/--ff/--nf reorder after theirs, inside
        # a test that tears the session down runs after every other test of the session
        items.sort(key=lambda item: "ppsmoke_teardown" in getattr(item, "fixturenames", ()))
        if hasattr(config, "workerinput"):  # an xdist worker: mark the deployment's tests for the scheduler
            for item in items:
                if _uses_session(item) and not item.nodeid.endswith(XDIST_SUFFIX):
                    _mark_for_scheduler(item)


def _mark_for_scheduler(item: pytest.Item) -> None:
    """Append :data:`XDIST_SUFFIX` to the node id the worker sends the controller, as xdist itself
    appends ``@group`` under ``--dist loadgroup``. pytest keeps the id as a string (``_nodeid``) up
    to 9.1 and as a structured ``NodeId`` (``_id``) from 9.2, where setting ``_nodeid`` silently
    does nothing (pytest-dev/pytest-xdist#1386: loadgroup lost its groups the same way, and this
    plugin rented once per worker). Should a later pytest ignore both, the session stops before
    any test instead of renting twice."""
    marked = item.nodeid + XDIST_SUFFIX
    node: Any = item  # private attributes, each present in only some pytest versions
    structured = getattr(node, "_id", None)
    if structured is not None and hasattr(type(structured), "parse"):  # pytest >= 9.2
        node._id = type(structured).parse(marked)
    else:
        node._nodeid = marked
    if item.nodeid != marked:
        raise pytest.UsageError(
            f"pytest-ppsmoke: cannot mark {item.nodeid} for pytest-xdist's scheduler under pytest "
            f"{pytest.__version__}, so every worker would rent its own deployment; run with -n 0"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A timeout on every test that uses the session: ``--timeout`` (or the ini ``timeout``) if
    set, else the budget and ``BACKSTOP`` seconds more; always by pytest-timeout's signal method,
    which raises in the test so that the session's finalizers still run (the thread method ends
    the process). A test's own timeout marker wins. The run's own deadlines end every step and the
    teardown within the budget, each with its one line: the backstop fires only where they did
    not, and never races them (at the budget itself, a loaded machine's lag put it inside the
    teardown or pytest's own reporting)."""
    user = config.getoption("timeout", None) or config.getini("timeout") if _has_timeout(config) else None
    seconds = float(user) if user else config.stash[SETTINGS].budget + BACKSTOP
    for item in items:
        if _uses_session(item) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(seconds, method="signal"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's controller: the scheduler that runs every test that uses the deployment in
    one worker (or refuses ``--dist each``)."""
    from .distributed import OneDeployment  # xdist: only on its controller

    return OneDeployment(config, log)


class _PlainIds:
    """pytest-xdist's controller (or a session without xdist, where it finds nothing to change)."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """A worker's report, with the node id the user knows (for the terminal, JUnit XML,
        --lf and --sw), before any other plugin sees it."""
        report.nodeid = plain_nodeid(report.nodeid)


def _has_timeout(config: pytest.Config) -> bool:
    return config.pluginmanager.has_plugin("timeout")


def _uses_session(item: pytest.Item) -> bool:
    return any(f in getattr(item, "fixturenames", ()) for f in FIXTURES)


def _needed_step(item: pytest.Item) -> str | None:
    steps = [STEP_OF[f] for f in getattr(item, "fixturenames", ()) if f in STEP_OF]
    return max(steps, key=STEPS.index) if steps else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the fixtures: a test that needs a phase the deployment already failed at fails at
    once, pointing at the first error (not repeating it); once the session's budget is spent,
    the remaining tests fail at once."""
    state = item.config.stash[STATE]
    state.current = plain_nodeid(item.nodeid)
    session = state.session
    if session is None or not _uses_session(item):
        return
    failure, needed, failed = session.run.failure, _needed_step(item), session.run.failed_step
    if failure is not None and needed and failed and STEPS.index(needed) >= STEPS.index(failed):
        why = f": {_spent(session)}" if session.run.out_of_budget else ""
        where = f"; the error is shown at {state.failed_in}" if state.failed_in else ""
        pytest.fail(f"the deployment failed at {failure.phase}{why}{where}", pytrace=False)
    if session.remaining() <= 0 and "ppsmoke_teardown" not in getattr(item, "fixturenames", ()):
        pytest.fail(_spent(session), pytrace=False)


def _spent(session: SmokeSession) -> str:
    s = session.settings
    return f"the session's budget of {s.budget:g} s is spent ({s.teardown_timeout:g} s of it kept for the teardown)"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """The run's figures as JUnit properties, each once: a step's on the first test that saw the
    step done, the run's end's (its cost, the API's counts, the teardown) on the test during whose
    teardown the run ended. After the session's finalizers, which the last test's teardown runs."""
    try:
        yield
    finally:
        state = item.config.stash[STATE]
        session = state.session
        if session is not None and (session.closed or _uses_session(item)):
            for step, name, value in session.report.figures():
                if name not in state.recorded and (session.closed or step in session.run.done):
                    state.recorded.add(name)
                    item.user_properties.append((name, value))
            if state.failed_in == plain_nodeid(item.nodeid):  # each node's account, on the failing test
                for name, value in session.report.tails():
                    if name not in state.recorded:
                        state.recorded.add(name)
                        item.user_properties.append((name, value))


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def ppsmoke_settings(pytestconfig: pytest.Config) -> Settings:
    return pytestconfig.stash[SETTINGS]


@pytest.fixture(scope="session")
def ppsmoke_session(pytestconfig: pytest.Config, ppsmoke_settings: Settings) -> Iterator[SmokeSession]:
    """The session's run. Its finalizer destroys everything rented, however the session ends:
    passed, failed, timed out (pytest-timeout's signal), or interrupted (Ctrl-C)."""
    if ppsmoke_settings.mode == "vastai" and not ppsmoke_settings.api_key:
        pytest.skip("vastai mode needs a vast.ai API key: pass --vastai-key or set VAST_API_KEY")
    from .harness.session import SmokeSession  # the runtime: only now

    state = pytestconfig.stash[STATE]
    session = state.session = SmokeSession(ppsmoke_settings, _relay(pytestconfig))
    try:
        yield session
    finally:
        try:
            session.teardown()
        finally:
            report = session.report
            if ppsmoke_settings.report is not None:
                report.write(ppsmoke_settings.report)
            if ppsmoke_settings.timeline is not None:
                from .harness.cli import draw_timeline  # matplotlib, if at all: only now

                draw_timeline(report, ppsmoke_settings.timeline, "pytest-ppsmoke")
        if report.failed_phase == "teardown" and not state.teardown_reported:
            state.teardown_reported = True
            pytest.fail(report.headline(), pytrace=False)


def _relay(config: pytest.Config) -> Relay | None:
    """What the session shows while it waits, through pytest's terminal reporter: on a terminal
    a live line, redrawn in place over pytest's own line and given back after each step; in a
    pipe or CI a line as each phase starts and as it ends. Nothing in an xdist worker, whose
    output is no terminal: the controller prints its tests' outcomes."""
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None or hasattr(config, "workerinput"):
        return None
    import contextlib
    import io

    from .harness.progress import Around, Lines, Progress, Relay

    tw = tr._tw  # pytest's terminal writer: its file, and the line it has written so far
    capman = config.pluginmanager.get_plugin("capturemanager")
    uncaptured = capman.global_and_fixture_disabled if capman is not None else contextlib.nullcontext
    if tr.isatty():
        terminal = Around(tw._file, uncaptured)
        progress = Progress(io.StringIO(), terminal, live=True)  # the phase lines: in the terminal summary
        progress.cache_said = True  # no line of its own between pytest's
        return Relay(progress, lambda: getattr(tw, "_current_line", ""))

    def write_line(line: str) -> None:
        with uncaptured():
            tr.write_line(line)

    lines = Lines(write_line)
    return Relay(Progress(lines, lines, live=False))


def _step(pytestconfig: pytest.Config, session: SmokeSession, step: str) -> None:
    """Run the driver up to ``step``; a failure shows here once, as one line, with no traceback."""
    from .protocol import PhaseError

    try:
        session.step(step)
        return
    except PhaseError:
        pass  # shown below, outside the handler: no chained traceback through the driver
    state = pytestconfig.stash[STATE]
    state.failed_in = state.failed_in or state.current
    pytest.fail(f"the {session.settings.mode} deployment failed at {session.report.headline()}", pytrace=False)


@pytest.fixture(scope="session")
def ppsmoke_instances(pytestconfig: pytest.Config, ppsmoke_session: SmokeSession) -> Deployment:
    """One instance per stage, rented on the cheapest matching offers and running."""
    _step(pytestconfig, ppsmoke_session, "boot")
    assert ppsmoke_session.run.deployment is not None
    return ppsmoke_session.run.deployment


@pytest.fixture(scope="session")
def ppsmoke_cluster(
    pytestconfig: pytest.Config, ppsmoke_session: SmokeSession, ppsmoke_instances: Deployment
) -> Deployment:
    """1 + N members alive in every member's view, every worker ready."""
    _step(pytestconfig, ppsmoke_session, "load")
    return ppsmoke_instances


@pytest.fixture(scope="session")
def ppsmoke_names(
    pytestconfig: pytest.Config, ppsmoke_session: SmokeSession, ppsmoke_cluster: Deployment
) -> dict[str, ActorAddress]:
    """``pp-entry``, ``pp-exit`` and every ``pp-stage-i``, resolved on the orchestrator."""
    _step(pytestconfig, ppsmoke_session, "resolve")
    return ppsmoke_cluster.names


@pytest.fixture(scope="session")
def ppsmoke_inference(
    pytestconfig: pytest.Config, ppsmoke_session: SmokeSession, ppsmoke_names: dict[str, ActorAddress]
) -> InferenceResult:
    """The prompt sent through the chain and answered, with its figures."""
    _step(pytestconfig, ppsmoke_session, "infer")
    assert ppsmoke_session.run.result is not None
    return ppsmoke_session.run.result


@pytest.fixture(scope="session")
def ppsmoke_reference(
    pytestconfig: pytest.Config, ppsmoke_session: SmokeSession, ppsmoke_inference: InferenceResult
) -> ReferenceFigures:
    """The token-exact reference: after the request, stage 0's worker loads the model afresh and
    runs it in one piece on that node's device (a rented GPU with vastai, this machine's CPU with
    local). Skips when ``--ppsmoke-reference off``; fails, once per test, when it could not run."""
    _step(pytestconfig, ppsmoke_session, "reference")
    ref = ppsmoke_session.report.reference
    if ref.state == "off":
        pytest.skip("the reference is off (--ppsmoke-reference off)")
    if ref.state != "done":
        pytest.fail(f"the reference did not run ({ref.state}): {ref.detail}", pytrace=False)
    return ref


@pytest.fixture(scope="session")
def ppsmoke_teardown(pytestconfig: pytest.Config, ppsmoke_session: SmokeSession) -> SmokeSession:
    """Tears the session down now (the tests that use it run last) and returns it, so that a
    test can check what is left: ``report.left_after_teardown`` is vast.ai's list of the run's
    label. A failed teardown shows here, once."""
    ppsmoke_session.teardown()
    report = ppsmoke_session.report
    state = pytestconfig.stash[STATE]
    if report.failed_phase == "teardown" and not state.teardown_reported:
        state.teardown_reported = True
        pytest.fail(report.headline(), pytrace=False)
    return ppsmoke_session


# --- the terminal summary ----------------------------------------------------------------------


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    _layout_summary(terminalreporter)
    session = config.stash[STATE].session
    if session is None:
        return
    r = session.report
    tr = terminalreporter
    tr.write_sep("=", f"pytest-ppsmoke: {r.mode}, {r.model}, {r.num_stages} stages, {r.wire_dtype}")
    for line in r.summary():
        tr.write_line(line)
    from .harness import claims  # loaded once a session ran (the plugin's import stays light)

    for line in claims.block(r):  # the same verdict block as pp-smoke-run's
        tr.write_line(line)


def _layout_summary(tr: Any) -> None:
    """The layout grid's figures (spec/test_layout.py's properties), from the test reports: they
    reach this process under xdist too."""
    props = [
        (k, v)
        for reports in tr.stats.values()
        for rep in reports
        if getattr(rep, "when", None) == "call"
        for k, v in getattr(rep, "user_properties", ())
        if str(k).startswith("ppsmoke_layout_")
    ]
    if not props:
        return
    tr.write_sep("=", "pytest-ppsmoke: layout grid")
    for k, v in props:
        tr.write_line(f"{k[len('ppsmoke_layout_') :]}: {v}")

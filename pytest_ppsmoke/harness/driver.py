"""The one run driver: a smoke run from settings to report.

    async with SmokeRun(settings, on_phase=print_line) as run:   # the emulator and the client
        await run.step("infer")                                   # rent ... resolve, then infer
        await run.step("reference")                               # the model in one piece, on stage 0's node
    run.report                                                    # filled, teardown included

``pp-smoke-run`` runs every step at once; the pytest session steps it phase by phase from its
fixtures. Each step runs the steps before it that have not run, at most once; a failed step
fails every later one with the same :class:`PhaseError`.

The budget is wall clock, counted from :meth:`start` to the end of :meth:`close`, teardown
included. The teardown's deadline (``teardown_timeout``) is kept back from it: the steps must end
by ``budget - teardown_timeout`` (:meth:`remaining`; a step still running then fails, naming the
phase and the budget), and the teardown then gets what is left of the budget, at most
``teardown_timeout`` (:meth:`teardown_seconds`). Only a teardown that starts late, because
something outside the driver held the run past the steps' deadline (a test of the plugin's
session), gets more than what is left: at least :data:`LATE_TEARDOWN` of its deadline, since
destroying what was rented comes before the budget.

:meth:`close` destroys everything that was rented, on every path, then closes the client and
the embedded emulator, and completes the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..cloud.provider import Provider, going_away
from ..cloud.rental import RentedInstance
from ..protocol import Phase, PhaseError, stage_name
from ..runtime.resource import Resource
from . import accounts, claims
from .check import refusal
from .deployment import Deployment
from .figures import (
    ApiFigures,
    EmulatorFigures,
    InstanceFigures,
    LinkStats,
    ListedInstance,
    Mode,
    NetworkFigures,
    PathFigures,
    Paths,
    PhaseSpan,
    PreflightFigures,
    RunTimeline,
    SkippedOffer,
    StageSplit,
    SwimFigures,
    WireDtype,
)
from .pipeline import InferenceResult, run_inference
from .reference import Asker
from .report import Report, parse
from .settings import STEPS, Settings, face_names
from .setup import Place, open_place

log = logging.getLogger(__name__)


OnPhase = Callable[[str, float, str], None]

ACCOUNTS_TIMEOUT = 12.0  # seconds the nodes' accounts of a failure may take, at most
ACCOUNTS_SHARE = 0.25  # and, the steps' deadline passed, this share of the teardown's (the budget holds)
LATE_TEARDOWN = 0.5  # the share of teardown_timeout a teardown gets even when the budget is spent


def random_weights(model: str) -> bool:
    """Whether ``model`` is a GGUF on this machine whose weights are random (``pp-synth-gguf``'s)."""
    from ..ggufinfo import RANDOM_WEIGHTS, GGUFError, metadata

    try:
        return RANDOM_WEIGHTS in str(metadata(model, ("general.name",)).get("general.name", ""))
    except (OSError, GGUFError, ValueError):
        return False  # a catalogue name, or a file that is not a GGUF: a real model


def stage_paths(result: InferenceResult, dep: Deployment) -> dict[str, PathFigures]:
    """How each stage reached its peers during the request, as it said (``StageStats.paths``),
    by ``pp-stage-0->pp-stage-1``."""
    names = {i.endpoint_id: stage_name(i.stage) for i in dep.instances if i.endpoint_id}
    if dep.seed is not None:
        names[dep.seed.id] = "orchestrator"
    out: dict[str, PathFigures] = {}
    for st in result.stages:
        for p in st.paths:
            if p.peer in names:
                out[f"{stage_name(st.stage)}->{names[p.peer]}"] = PathFigures(
                    p.path, p.remote_addr, p.rtt_ms, p.dialled_by, p.selected
                )
    return dict(sorted(out.items()))


def paths_figures(dep: Deployment, before: Paths | None, stages: dict[str, PathFigures]) -> Paths:
    """How the orchestrator reaches each stage now, and how each stage reached its peers during
    the request; a released stage's link as last seen (its connection ended with it)."""
    seen = before.links if before is not None else {}
    paths = parse(Paths, dep.paths())
    for i in dep.current:
        name = stage_name(i.stage)
        if i.id in dep.rental.released and paths.links.get(name) is None and seen.get(name) is not None:
            paths.links[name] = seen[name]
    paths.stages = dict(stages)
    return paths


def run_timeline(
    dep: Deployment, spans: dict[str, tuple[float, float]], started: float | None, s: Settings
) -> RunTimeline:
    """The phases so far, in seconds since the rent began (the instances' timelines' origin),
    and the budget on the same clock."""
    began = dep.began
    phases = [
        PhaseSpan(str(phase), round(a - began, 4), round(b - began, 4))
        for phase, (a, b) in sorted({**dep.spans, **spans}.items(), key=lambda kv: kv[1])
    ]
    at = round((started if started is not None else began) - began, 4)
    return RunTimeline(phases, at, s.budget, round(at + s.phases_budget, 4), round(at + s.budget, 4))


async def _settled(task: asyncio.Future[None] | None, deadline: float) -> None:
    """``task`` finished, or cancelled at ``deadline`` (monotonic); what it raised is its own."""
    if task is None:
        return
    await asyncio.wait([task], timeout=max(0.0, deadline - time.monotonic()))
    task.cancel()
    with contextlib.suppress(BaseException):
        await task


async def _unless_lost(step: Awaitable[None], dep: Deployment) -> None:
    """Run the step, unless a stage's host is lost first (``Deployment.lost``, from boot on):
    then the step is cancelled and the loss is its failure."""
    if dep.lost is None:
        await step
        return
    task: asyncio.Future[None] = asyncio.ensure_future(step)
    lost: asyncio.Future[Any] = dep.lost
    try:
        await asyncio.wait([task, lost], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if dep.lost.done() and not (task.done() and not task.cancelled() and task.exception() is None):
        raise dep.lost.result()
    await task  # its result, or its own failure


class SmokeRun(Resource):
    def __init__(
        self,
        settings: Settings,
        on_phase: OnPhase | None = None,
        face: str = "cli",
        *,
        on_start: Callable[[str], None] | None = None,
        on_answer: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.face = face  # whose flags the report's messages name: pp-smoke-run's (cli) or the plugin's (pytest)
        self.names = face_names(face)  # how the lower layers' messages name a setting: this face's flags
        self.on_phase = on_phase  # each phase as it ends: its name, seconds and line
        self.on_start = on_start  # each phase as it begins
        self.on_answer = on_answer  # the text, as soon as it has come back (before the reference and teardown)
        s = settings
        self.report = Report(Mode(s.mode), s.model, s.prompt, s.max_tokens, s.num_stages, WireDtype(s.wire_dtype))
        self.started: float | None = None
        self.place: Place | None = None  # where it rents: the provider, the embedded emulator if any
        self.vast: Provider | None = None
        self.deployment: Deployment | None = None
        self.result: InferenceResult | None = None
        self.releasing: asyncio.Future[None] | None = None  # the stages the reference does not need, going
        self.asker = Asker()  # the reference: asked as stage 0's node joins (loaded beside), or at its step
        # whether the reference step lets the other stages go (run(): nothing after it asks them; the
        # plugin's tests ask any node in any order, until the session's teardown)
        self.release_early = False
        self.stage_paths: dict[str, PathFigures] = {}  # how each stage reached its peers (the request's StageStats)
        self.spans: dict[str, tuple[float, float]] = {}  # prefill, decode, reference: start, end
        # the work the nodes noted (``Progress``), the furthest of each kind: "blocks" (or "stages")
        # of the prefill, decode's "tokens", "reference loading" and "reference tokens": done, total
        self.noted: dict[str, tuple[int, int]] = {}
        self.failure: PhaseError | None = None
        self.accounts: dict[int, accounts.Account] = {}  # each node's own account of a failure, by stage
        self.failed_step: str | None = None  # the step that failed: every later one fails with it
        self.out_of_budget = False  # the failure is the budget's: the steps' deadline passed
        self.done: set[str] = set()
        self.tearing_down = False
        self.closed = False

    def __repr__(self) -> str:
        return f"SmokeRun({self.settings.mode}, {self.deployment!r})"

    @property
    def phase(self) -> Phase:
        """The phase under way (or the next one): what an interruption is reported against."""
        if self.tearing_down:
            return Phase.TEARDOWN
        return self.deployment.phase if self.deployment is not None else Phase.RENT

    def elapsed(self) -> float:
        return 0.0 if self.started is None else time.monotonic() - self.started

    def remaining(self) -> float:
        """Seconds left to the steps: the budget less the teardown's deadline, less the time spent."""
        return self.settings.phases_budget - self.elapsed()

    def teardown_seconds(self) -> float:
        """The teardown's deadline, were it to start now: what is left of the budget, at most
        ``teardown_timeout``, at least its :data:`LATE_TEARDOWN` share."""
        s = self.settings
        return max(min(s.teardown_timeout, s.budget - self.elapsed()), LATE_TEARDOWN * s.teardown_timeout)

    def fail(self, phase: Phase | None, message: str) -> None:
        """Record a failure from outside (a signal, a test's timeout): the first one is the cause."""
        self.report.fail(phase, message)

    # --- start -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the clock and the place the run rents out (``setup.open_place``: the embedded
        emulator, or a vast.ai API), and make the deployment on it."""
        s = self.settings
        self.started = time.monotonic()
        if (why := refusal(s, self.names)) is not None:  # a tool this machine lacks: refused before anything starts
            self._failed(STEPS[0], PhaseError(Phase.PREFLIGHT, why))
        try:  # no retry of the client's waits past the steps' deadline
            place = await open_place(s, deadline=self.started + s.phases_budget, names=self.names)
        except Exception as e:  # the run's first cause: in the report before anything closes
            failure = e if isinstance(e, PhaseError) else PhaseError(self.phase, f"{type(e).__name__}: {e}")
            self.failure, self.failed_step = failure, "rent"
            self.report.fail(failure.phase, str(failure))
            raise failure from None if failure is e else e
        self.place, self.vast = place, place.provider
        self.report.vast_url = place.url
        self.report.network = parse(NetworkFigures, place.network) if place.network is not None else None
        self.deployment = place.deployment(on_phase=self.on_phase)
        self.deployment.rental.deadline = self.started + s.phases_budget  # a replacement must fit before it
        self.deployment.on_start = self.on_start
        self.deployment.on_step = self._stage_step
        self.report.run_id = self.deployment.run_id

    # --- the steps -------------------------------------------------------------------------

    async def step(self, name: str) -> None:
        """Run the steps up to ``name`` that have not run. Raises the run's PhaseError."""
        if name not in STEPS:
            raise ValueError(f"unknown step {name!r}; expected one of {', '.join(STEPS)}")
        for step in STEPS[: STEPS.index(name) + 1]:
            if step not in self.done:
                await self._guarded(step)
                self.done.add(step)

    async def run(self) -> Report:
        """Every step, then teardown: what ``pp-smoke-run`` does."""
        self.release_early = True
        try:
            await self.step(STEPS[-1])
        except PhaseError:
            pass  # in the report
        finally:
            await self.close()
        return self.report

    async def _guarded(self, step: str) -> None:
        if self.failure is not None:
            raise self.failure
        if self.deployment is None:
            raise RuntimeError("SmokeRun.start() has not run")
        dep = self.deployment
        try:
            if self.remaining() <= 0:
                raise TimeoutError
            async with asyncio.timeout(self.remaining()):
                await self._do(step, dep)
        except PhaseError as e:
            self._failed(step, await self._accounted(step, e))
        except TimeoutError:
            if self.remaining() > 0:  # a deadline of the step's own, not the budget
                raise
            s = self.settings
            self.out_of_budget = True
            spent = f"the run did not finish within its budget of {s.budget:g} s"
            kept = f"{s.teardown_timeout:g} s of it kept for the teardown"
            self._failed(step, await self._accounted(step, PhaseError(dep.phase, f"{spent} ({kept})")))

    async def _accounted(self, step: str, e: PhaseError) -> PhaseError:
        """Each node's own account of the failure (``accounts.gather``), before anything is torn
        down, kept for the report; ``e`` with the words of every node not simply answering. An
        account that cannot be had never hides ``e``: ``e`` is recorded as the cause first (a
        Ctrl-C or a timeout while the accounts are asked for finds it there), and amended with
        their words after. The vast.ai client gets the accounts' own deadline: the steps' may
        have passed (a budget failure), and a log's upload is polled."""
        dep = self.deployment
        if dep is None or self.accounts or not any(i.id is not None for i in dep.instances):
            return e
        self._record(step, e)
        timeout = min(ACCOUNTS_TIMEOUT, max(self.remaining(), ACCOUNTS_SHARE * self.settings.teardown_timeout))
        secrets = [*(self.vast.secrets() if self.vast is not None else ()), *dep.keys.keys]
        kept = self.vast.deadline if self.vast is not None else None
        if self.vast is not None:
            self.vast.deadline = time.monotonic() + timeout
        try:
            self.accounts = await accounts.gather(dep.seed, dep.rental, secrets, timeout)
        except Exception:
            log.exception("the nodes' accounts of the failure could not be gathered")
            return e
        finally:
            if self.vast is not None:
                self.vast.deadline = kept
            try:
                self._take_figures()
            except Exception:  # the figures are the report's; the failure is the cause
                log.exception("the run's figures could not be taken after its failure")
        words = accounts.failure_words(self.accounts, e.reason)
        if not words:
            return e
        amended = PhaseError(e.phase, e.reason + words)
        self.report.amend(str(e), str(amended))
        self.failure = amended
        return amended

    def _record(self, step: str, e: PhaseError) -> None:
        """``e`` is the run's failure, and the report's first cause."""
        self.failure, self.failed_step = e, step
        self.report.fail(e.phase, str(e))

    def _failed(self, step: str, e: PhaseError) -> None:
        self._record(step, e)
        raise e

    async def _do(self, step: str, dep: Deployment) -> None:
        calls: dict[str, Callable[[], Awaitable[None]]] = {
            "rent": dep.rent,
            "boot": dep.boot,
            "converge": dep.converge,
            "load": dep.load,
            "resolve": dep.resolve,
            "infer": self._infer,
            "reference": self._reference,
        }
        try:
            await _unless_lost(calls[step](), dep)
        finally:
            self._take_figures()

    async def _infer(self) -> None:
        dep, s = self.deployment, self.settings
        assert dep is not None and dep.seed is not None

        def prefilled(seconds: float) -> None:
            self.note("tokens", 1, s.max_tokens)  # the first token, sampled at the prefill's end
            if self.on_phase is not None:
                self.on_phase(Phase.PREFILL, seconds, "first token sampled")
            dep.phase = Phase.DECODE

        # a failure names each stage it involves with its instance: the nodes know stages only by name
        result = await run_inference(
            dep.seed, s.num_stages, s.prompt, s.max_tokens, max(1.0, self.remaining()), prefilled, dep.places(),
            # each stage's programs apart: a stage counts its own from 1 while another's are made
            lambda note: self.note(
                f"programs {note.stage}" if note.what == "programs" else note.what, note.done, note.total
            ),
        )  # fmt: skip
        self.result = result
        self.spans.update(result.spans)
        if self.on_phase is not None:
            t = result.timings
            self.on_phase(Phase.DECODE, t["decode"], f"{t['decode_tokens_per_s']} tokens/s")
        if self.on_answer is not None:
            self.on_answer(result.text)
        if s.reference:
            dep.phase = Phase.REFERENCE  # from the decode line on, an interruption is the reference's
        r = self.report
        kv = {k.stage: k for k in result.kv}
        r.split = [
            StageSplit(
                stage=i,
                blocks=(kv[i].first_block, kv[i].end_block) if i in kv else None,
                instance=inst.id,
                # weights cached or not, programs: the line derived from the node's load figures
                load=((st.load.describe() if st.load else "") if (st := dep.ready.get(i)) else None),
            )
            for i, inst in enumerate(sorted(dep.current, key=lambda x: x.stage))
        ]
        r.text, r.prompt_token_ids, r.token_ids = result.text, result.prompt_token_ids, result.token_ids
        r.hops, r.kv, r.frames = result.hops, result.kv_summary(), result.frames
        r.timings.update(result.timings)
        self.stage_paths = stage_paths(result, dep)

    def _stage_step(self, inst: RentedInstance, step: str) -> None:
        self.asker.reached(self, inst, step)

    async def _reference(self) -> None:
        await self.asker.step(self)

    def note(self, what: str, done: int, total: int) -> None:
        """A count of work done in the nodes (a stage's ``Progress``): the furthest of its kind."""
        if done >= self.noted.get(what, (0, 0))[0]:
            self.noted[what] = (done, total)

    def _account(self, inst: RentedInstance) -> accounts.Account | None:
        """The node's own account of a failure, for the instance its stage stands on (a replaced
        one's node never joined: it has none)."""
        return None if inst.replaced else self.accounts.get(inst.stage)

    def _take_figures(self) -> None:
        dep, r = self.deployment, self.report
        if dep is None:
            return
        r.timings.update(dep.timings)
        r.timeline = run_timeline(dep, self.spans, self.started, self.settings)
        # the lower layers' records (their summaries) as the report's parts, every key and type checked
        r.preflight = parse(PreflightFigures, dep.preflight.summary()) if dep.preflight is not None else None
        r.instances = [
            parse(
                InstanceFigures,
                {
                    **i.summary(),
                    "released": i.id in dep.rental.released,
                    **(a.summary() if (a := self._account(i)) else accounts.NO_ACCOUNT),
                },
            )
            for i in dep.instances
        ]
        r.replacements = sum(1 for i in dep.instances if i.replaced)
        r.cost_usd = round(dep.cost_usd(), 6)
        r.creates_sent = dep.creates_sent
        r.offers_skipped = parse(list[SkippedOffer], dep.offers_skipped)
        if self.vast is not None:
            r.vast_api = parse(ApiFigures, self.vast.calls_summary())
        if not r.split and dep.current:
            r.split = [StageSplit(stage=i.stage, instance=i.id) for i in sorted(dep.current, key=lambda x: x.stage)]
        if dep.seed is not None and "converge" in dep.timings:
            r.paths = paths_figures(dep, r.paths, self.stage_paths)
        if dep.swim_timing and dep.seed is not None:  # the orchestrator's failure detector's counts so far
            stats = dataclasses.asdict(dep.seed.membership.stats())
            stalls = dep.watch.summary() if dep.watch is not None else None
            swim = {**dep.swim_timing, "stats": stats, "deaths": dep.swim_deaths, "orchestrator_stalls": stalls}
            r.swim = parse(SwimFigures, swim)

    # --- teardown --------------------------------------------------------------------------

    async def close(self) -> None:
        """Destroy everything rented, then close the client and the emulator; idempotent.
        A destroy that fails is in the report (``error``, ``instances[].destroy_error``)."""
        if self.closed:
            return
        self.closed = True
        self.tearing_down = True
        r = self.report
        seconds = self.teardown_seconds()
        deadline = time.monotonic() + seconds
        if self.vast is not None:
            self.vast.deadline = deadline  # the teardown's own retries may wait until its deadline
        await self.asker.close()  # a reference asked early and never waited for: cancelled
        try:
            await _settled(self.releasing, deadline)  # destroys already under way: finished (or given up) first
            if self.deployment is not None:
                self.deployment.teardown_timeout = max(0.0, deadline - time.monotonic())  # the destroys and the sweep
                try:
                    await self.deployment.close()
                except PhaseError as e:
                    r.teardown_error = str(e)
                    r.fail(e.phase, r.teardown_error)
                    if self.failure is None:
                        self.failure = e
                finally:
                    self._take_figures()
                if self.vast is not None and self.deployment.creates_sent:  # vast.ai's own word on what is left
                    try:
                        # the teardown's own last list, read after every destroy, or a list now
                        left = self.deployment.rental.listed_after
                        if left is None:
                            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                                left = await self.vast.list_instances(self.deployment.label_prefix)
                        # only what names them: a record also holds the instance's own key; one still
                        # listed but on its way out (its state fields say so) is gone, and shown apart
                        r.left_after_teardown = [parse(ListedInstance, i.names()) for i in left if not going_away(i)]
                        r.going_after_teardown = [parse(ListedInstance, i.names()) for i in left if going_away(i)]
                    except Exception as e:  # TimeoutError included: the teardown's deadline has passed
                        log.warning("could not list the run's instances after teardown: %r", e)
        finally:
            if self.vast is not None:
                with contextlib.suppress(Exception):
                    await self.vast.close()
            emulated = None
            if self.place is not None:  # the embedded emulator's own record, before it closes
                with contextlib.suppress(Exception):
                    emulated = await self.place.emulated_record()
            if self.place is not None:
                with contextlib.suppress(Exception):
                    await self.place.close()
            if emulated is not None:  # read after everything closed: a record that does not parse is a bug
                r.emulator = parse(EmulatorFigures, emulated.emulator)
                stats = emulated.network_stats
                r.network_stats = parse(dict[str, LinkStats], stats) if stats is not None else None
            if self.started is not None:
                r.timings["total"] = round(time.monotonic() - self.started, 4)
            r.claims = claims.verdict(r, evidence(self))
            r.finish()


def evidence(run: SmokeRun) -> claims.Evidence:
    """What the run recorded for its claims (``claims.verdict`` judges them)."""
    dep = run.deployment
    if dep is None:
        return claims.Evidence()
    ready = dep.ready.get(0)
    dim = ready.dim if ready is not None else None
    return claims.Evidence(dep.members, dep.views, dict(dep.names), run.result, dim, random_weights(run.settings.model))

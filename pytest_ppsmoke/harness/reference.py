"""The run's token-exact reference (:class:`Asker`): the model in one piece on stage 0's node,
its tokens against the pipeline's. Where stage 0 loads it beside the stages (a reference worker
of its own: on GPUs), it is asked as soon as stage 0's node has joined the cluster (its reference
actor answers once that worker has loaded, while the stage's own worker still loads), while the
other stages are still created and load (each create is 4.5 s after the last on vast.ai, and a
boot takes minutes), and runs beside the request if it outlasts them; the reference step then
waits for an answer most often already in, and the teardown destroys every instance at once.
Where it is loaded after the request (the stage's own worker), it is asked at its step, and the
other stages' instances are destroyed while it runs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from ..cloud.rented import RentedInstance
from ..messages import ReferenceResult
from ..protocol import Phase
from ..runtime.errors import RemoteError
from .deployment import Deployment
from .figures import ReferenceFigures, ReferenceLoad, ReferenceState
from .pipeline import InferenceResult, program_figures, request_reference
from .report import Report
from .settings import Settings

REFERENCE_LEAST = 10.0  # seconds of budget the reference step needs left to start at all
REFERENCE_MARGIN = 2.0  # seconds of budget the reference step leaves for itself to record its outcome


class Run(Protocol):
    """What the reference needs of its run (``driver.SmokeRun`` is one)."""

    settings: Settings
    report: Report
    deployment: Deployment | None
    result: InferenceResult | None
    release_early: bool
    releasing: asyncio.Future[None] | None
    spans: dict[str, tuple[float, float]]
    on_phase: Callable[[str, float, str], None] | None

    def remaining(self) -> float: ...
    def note(self, what: str, done: int, total: int) -> None: ...


class Asker:
    """The reference of one run: asked early (:meth:`ready`) or at its step (:meth:`step`)."""

    def __init__(self) -> None:
        # asked as stage 0's node was ready: its answer, and the seconds from query to answer
        self.early: asyncio.Task[tuple[ReferenceResult, float]] | None = None

    def reached(self, run: Run, inst: RentedInstance, step: str) -> None:
        """An instance reached a step: stage 0's node, with its reference loaded beside, is asked
        as it joins the cluster (its reference actor, by its id)."""
        dep, s = run.deployment, run.settings
        if inst.stage != 0 or step != "joined" or self.early is not None or dep is None or dep.seed is None:
            return
        if not s.reference or dep.config.reference_load != "beside" or not inst.endpoint_id:
            return
        left = run.remaining() - REFERENCE_MARGIN
        if left >= REFERENCE_LEAST:
            self.early = asyncio.ensure_future(self._ask(run, left, inst.endpoint_id))

    async def _ask(self, run: Run, left: float, beside: str | None = None) -> tuple[ReferenceResult, float]:
        """The reference query, within ``left`` seconds (``beside``: stage 0's node id, whose
        reference actor answers): its answer, and the seconds it took."""
        dep, s = run.deployment, run.settings
        assert dep is not None and dep.seed is not None
        started = time.monotonic()
        ref = await request_reference(
            dep.seed,
            s.prompt,
            s.max_tokens,
            left,
            lambda note: run.note(f"reference {note.what}", note.done, note.total),
            beside,
        )
        return ref, round(time.monotonic() - started, 4)

    async def step(self, run: Run) -> None:
        """The reference step, within what is left of the budget (asked already: its answer). Its
        outcome goes into the report; a mismatch, a failure or a lack of time is not the run's
        failure (the spec's token-exact test fails on it), so this step never raises."""
        dep, s, r = run.deployment, run.settings, run.report
        assert dep is not None and dep.seed is not None and run.result is not None
        if not s.reference:
            r.reference = ReferenceFigures(ReferenceState.OFF, "the reference setting is off")
            return
        left = run.remaining() - REFERENCE_MARGIN
        early = self.early
        if left < REFERENCE_LEAST and early is None:
            budget = f"{max(0.0, left):.0f} s of the budget of {s.budget:.0f} s"
            r.reference = ReferenceFigures(ReferenceState.SKIPPED, f"only {budget} were left; raise the budget")
            return
        dep.phase = Phase.REFERENCE
        started = time.monotonic()
        # asked now, the reference runs on stage 0's node alone: the other stages' instances are
        # destroyed while it runs (their destroys spaced as vast.ai's limit asks), not after it.
        # Asked early, it is most often in, or nearly: they are left to the teardown, which
        # destroys them all in one call (released now, stage 0's destroy would wait out the
        # destroy limit after theirs)
        if run.release_early and early is None:
            run.releasing = asyncio.ensure_future(dep.release(keep=0))
        early_s = None
        try:
            if early is not None:
                ref, early_s = await early
            else:
                ref, _ = await self._ask(run, left)
        except (RemoteError, TimeoutError, ConnectionError, LookupError) as e:
            r.reference = ReferenceFigures(ReferenceState.FAILED, str(e))
        else:
            got, want = run.result.token_ids, list(ref.token_ids)
            differ = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
            if differ is None and len(got) != len(want):
                differ = min(len(got), len(want))
            r.reference = ReferenceFigures(
                ReferenceState.DONE,
                stage=ref.stage,
                device=ref.device,
                method=ref.method,
                prompt_token_ids=list(ref.prompt_token_ids),
                token_ids=want,
                match=differ is None,
                first_difference=differ,
                load_s=ref.load_s,
                generate_s=ref.generate_s,
                mem_before=ref.mem_before,
                mem_after=ref.mem_after,
                loaded=ReferenceLoad(ref.loaded) if ref.loaded else None,
                programs=program_figures(ref.programs),
                early_s=early_s,
            )
        ended = time.monotonic()
        seconds = round(ended - started, 4)
        run.spans["reference"] = (started, ended)
        r.reference.seconds = r.timings["reference"] = seconds
        if run.on_phase is not None:
            run.on_phase("reference", seconds, r.reference.line())

    async def close(self) -> None:
        """A reference asked early and never waited for (the run failed first): cancelled."""
        if self.early is not None:
            self.early.cancel()
            await asyncio.gather(self.early, return_exceptions=True)

"""Renting, apart from the cluster: the provider's few steps for one run, on any provider
(``provider.py``'s seam: vast.ai's REST client, real or emulated, or a test's in-memory one).

    rental = Rental(provider, config, run_id)          # clock=, sleep=: a test's virtual clock
    offers = await rental.check()                       # the pre-flight: the matching offers
    inst = await rental.rent(stage, env, offers)        # a create, moving past offers raced away
    inst = await rental.see_through(inst, renew, join)  # running and joined, or replaced (.replace)
    lost = rental.watch()                               # a host lost mid-run, from vast.ai's list
    await rental.close()                                # destroy all, sweep, on every path

A host that does not run by its per-host deadline, or whose node does not join by its join
deadline, is replaced by an instance on another machine when the rest of the budget fits one
(:class:`.replace.ReplacePolicy`); off, it fails the run as the spec's error table says.

Each instance is labelled ``ppsmoke-<run id>-stage<i>`` (a replacement ``...-stage<i>r<k>``), so
that one whose create answer was lost is found again and destroyed (:meth:`Rental.close`'s
sweep); the reap (:func:`reap`) destroys every labelled instance, of one run or all. What runs
on the instances (the cluster, the model) is the harness's: this module knows the environment
each create carries only as strings.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import DEFAULT_IMAGE
from ..nodeenv import DEFAULTS
from ..protocol import BOOT_POLL_INTERVAL, BOOT_POLLS, BUDGET, DIRECT_PORT, Names, Phase, PhaseError, stage_name
from .preflight import Preflight, find_offers, image_check, preflight
from .provider import Instance, Label, NeverRuns, Offer, OfferGone, OfferQuery, Provider, ProviderError, going_away
from .replace import Replaceable, ReplacePolicy
from .waits import Board, wait_running

log = logging.getLogger(__name__)

# vast.ai's states a running instance never comes back from. ``unknown`` ("no recent heartbeat
# from the host") is a gap in the host's reports, not in its node: the cluster's own failure
# detection judges the node, and a watched instance that shows it is only logged
LOST_STATES = ("offline", "exited")
PORTS_WAIT = 10.0  # seconds a running instance's record may take to show its forwarded port
# an instance's own steps, in order: each is stamped in its timeline as it is reached
STEPS = ("rented", "running", "reached", "joined", "loaded")


@dataclass
class RentalConfig:
    """What renting needs. ``RunConfig`` (the harness's) extends it with the cluster's settings."""

    num_stages: int = DEFAULTS.num_stages
    model: str = DEFAULTS.model  # the pre-flight checks a GGUF's blocks against the stage count
    image: str = DEFAULT_IMAGE
    disk_gb: float = OfferQuery.disk_gb
    query: OfferQuery = field(default_factory=OfferQuery)
    transport: str = DEFAULTS.transport  # local: loopback; wan: the internet (a forwarded UDP port per create)
    polls: int = BOOT_POLLS  # the spec's boot polls, at vast.ai's pace: the boot window (boot_window)
    poll_interval: float = BOOT_POLL_INTERVAL  # how often the boot looks (a local run: faster)
    port: int = DIRECT_PORT  # wan: the UDP port each create asks vast.ai to forward (0: none, relays only)
    offer_races: int = 4  # offers raced away between search and create that the run moves past
    redestroys: int = 2  # destroys sent again when vast.ai accepted one but still shows the instance running
    preflight: bool = True  # the checks before the first create (.preflight)
    check_image: bool | str | None = None  # ask the image's registry; a str: why not; None: image_check decides
    budget: float = BUDGET  # the run's seconds: the credit must cover the offers' $/h for this long
    names: Names = field(default_factory=Names)  # how the face names a setting in a failure's advice
    replacement: ReplacePolicy = field(default_factory=ReplacePolicy)  # a host that never boots (.replace)

    def __post_init__(self) -> None:
        if self.num_stages < 2:
            raise ValueError(f"num_stages must be at least 2, got {self.num_stages}")
        if self.transport not in ("local", "wan"):
            raise ValueError(f"transport must be 'local' or 'wan', got {self.transport!r}")
        if self.polls < 1:
            raise ValueError(f"polls must be at least 1, got {self.polls}")
        if self.offer_races < 0:
            raise ValueError(f"offer_races must be at least 0, got {self.offer_races}")
        if self.check_image is None:
            self.check_image = image_check(self.image, vastai=self.transport != "local")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be a UDP port (1..65535), or 0 for none, got {self.port}")
        if self.direct and not self.query.direct_ports:
            self.query = dataclasses.replace(self.query, direct_ports=1)

    @property
    def boot_window(self) -> float:
        """Seconds an instance has to run: the spec's polls at vast.ai's pace (60 x 3 s = 180 s),
        however often the run looks (``poll_interval``). vast.ai's docs put a boot at 1-5 minutes
        (the image's size decides); the search skips hosts whose download would eat the window
        (``OfferQuery.min_inet_down``). Each node knows it: until the orchestrator first reaches
        it, a node waits this long plus its grace before it removes itself."""
        return self.polls * BOOT_POLL_INTERVAL

    @property
    def direct(self) -> bool:
        """Whether each create asks vast.ai to forward a UDP port, for a direct path to its node."""
        return self.transport == "wan" and self.port > 0


@dataclass
class RentedInstance:
    stage: int
    offer: Offer
    label: str
    id: int | None = None
    created_at: float | None = None  # wall clock, for the cost
    ended_at: float | None = None
    state: str | None = None  # last actual_status seen; then "destroyed" (gone) or "destroying" (still listed)
    status_msg: str = ""
    endpoint_id: str = ""
    destroy_error: str | None = None
    public_udp: str | None = None  # where vast.ai forwards its node's UDP port from (its record's ports)
    timeline: dict[str, float] = field(default_factory=dict)  # STEPS reached: seconds since the run began
    replacement: int = 0  # 0: its stage's first instance; k: the k-th to replace it
    replaces: int | None = None  # the id of the instance it replaced
    replaced: str | None = None  # why it was replaced (then destroyed): it never ran, or never joined
    replaced_at: float | None = None  # when: seconds since the run began
    started: float | None = None  # the rental's clock at its create: its per-host deadline counts from it

    @property
    def name(self) -> str:
        return f"instance {self.id} (stage {self.stage})"

    @property
    def where(self) -> str:
        """How a failure names it: ``pp-stage-1 on instance N (label)``."""
        return f"{stage_name(self.stage)} on instance {self.id} ({self.label})"

    def reached(self, step: str, since: float, now: float | None = None) -> None:
        """Stamp ``step`` (one of :data:`STEPS`) at the seconds from ``since`` to ``now`` (times of
        one clock; ``now`` by default: ``time.monotonic()``)."""
        if step not in STEPS:
            raise ValueError(f"unknown instance step {step!r}; expected one of {', '.join(STEPS)}")
        self.timeline.setdefault(step, round((time.monotonic() if now is None else now) - since, 3))

    def seconds(self) -> float:
        if self.created_at is None:
            return 0.0
        return (self.ended_at or time.time()) - self.created_at

    def cost_usd(self) -> float:
        return self.offer.dph_total * self.seconds() / 3600

    def seen(self, record: Instance) -> None:
        """What vast.ai last showed of it."""
        self.state, self.status_msg = record.actual_status, record.status_msg

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "stage": self.stage,
            "label": self.label,
            "endpoint_id": self.endpoint_id,
            "offer": self.offer.summary(),
            "dph_total": self.offer.dph_total,
            "seconds": round(self.seconds(), 3),
            "cost_usd": round(self.cost_usd(), 6),
            "final_state": self.state,
            "status_msg": self.status_msg,
            "destroy_error": self.destroy_error,
            "public_udp": self.public_udp,
            "timeline": {step: self.timeline[step] for step in STEPS if step in self.timeline},
            "replacement": self.replacement,
            "replaces": self.replaces,
            "replaced": self.replaced,
            "replaced_at": self.replaced_at,
        }


class Rental:
    """One run's instances on a provider: rent, wait for running, watch, destroy, list. Every wait
    reads and spends ``clock`` and ``sleep`` (the real ones unless a test runs it on a virtual
    clock), the teardown's deadline included."""

    def __init__(
        self,
        provider: Provider,
        config: RentalConfig,
        run_id: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.provider, self.config, self.run_id = provider, config, run_id
        self.clock, self.sleep = clock, sleep
        self.instances: list[RentedInstance] = []
        self.creates_sent = 0  # create calls sent: with none, nothing of this run can be billing
        self._uncertain_creates = False
        self.offers_skipped: list[dict[str, Any]] = []  # offers raced away between search and create
        self.preflight: Preflight | None = None  # what the pre-flight found, once it ran
        self.teardown_timeout = 120.0
        self.teardown_errors: list[str] = []
        self._tried: set[int] = set()
        self.offers: list[Offer] = []  # the matching offers, cheapest first: a replacement takes the next
        self.began = clock()  # when the run began (the deployment sets it at the rent)
        self.deadline: float | None = None  # the rental's clock when the run's phases must end (the budget)
        self.replacements = 0
        self._machines: set[int] = set()  # machines rented: a replacement goes to none of them
        # the boot waits' records: one list of the run's instances a round, shared by every wait
        self.board = Board(provider, self.label_prefix, config.poll_interval / 2, clock=clock)

    @property
    def label_prefix(self) -> str:
        return Label.prefix(self.run_id)

    @property
    def current(self) -> list[RentedInstance]:
        """Each stage's latest instance (the replaced ones left out), and any adopted by the sweep."""
        return [i for i in self.instances if i.replaced is None]

    async def check(self) -> list[Offer]:
        """The pre-flight (:mod:`.preflight`): the matching offers, or PhaseError with nothing
        rented. Off (``config.preflight``): the offer search alone, in the rent."""
        c = self.config
        if not c.preflight:
            self.offers = await find_offers(self.provider, c.query, c.num_stages, c.names, phase=Phase.RENT)
            return self.offers
        self.preflight = await preflight(
            self.provider, query=c.query, num_stages=c.num_stages, image=c.image, check_image=c.check_image or "",
            model=c.model, budget_s=c.budget, names=c.names,
        )  # fmt: skip
        self.offers = self.preflight.offers
        return self.offers

    def preflight_line(self) -> str:
        found = self.preflight
        if found is None:
            return ""
        credit = "no credit shown" if found.credit is None else f"credit ${found.credit:.2f}"
        image = (
            f"image {found.image.ref} ({found.image.compressed_bytes / 1e6:.0f} MB compressed)"
            if found.image else f"image not checked: {found.image_checked}"
        )  # fmt: skip
        return f"key ok, {credit} for a worst case of ${found.worst_case_usd:.2f}; {image}; {len(found.offers)} offers"

    async def rent(
        self, stage: int, env: Mapping[str, str], offers: list[Offer], endpoint_id: str, replacement: int = 0
    ) -> RentedInstance:
        """Create stage ``stage``'s instance on the cheapest matching offer not tried yet (a
        replacement: on a machine this run has not rented). An offer taken by someone else
        between search and create (404/410 ``no_such_ask``) is reported and the next one is
        tried, up to ``offer_races`` in the run; any other refusal ends the run."""
        c = self.config
        ports = {f"-p {c.port}:{c.port}/udp": "1"} if c.direct else {}  # vast-cli's form of docker's -p
        while True:
            offer = next(
                (o for o in offers if o.id not in self._tried and not (replacement and o.machine_id in self._machines)),
                None,
            )
            if offer is None:
                taken = ", ".join(str(o["offer"]) for o in self.offers_skipped)
                raise PhaseError(
                    Phase.RENT,
                    f"no matching offer left for stage {stage}: {len(offers)} matched, and {taken} were taken "
                    f"between search and create. Relax {c.names.setting('gpu_ram')}, {c.names.setting('max_price')} or "
                    f"{c.names.setting('min_reliability')}, or try again",
                )
            self._tried.add(offer.id)
            label = Label(self.run_id, stage, replacement).format()
            inst = RentedInstance(stage, offer, label, endpoint_id=endpoint_id, replacement=replacement)
            self.creates_sent += 1
            self._uncertain_creates = True  # until its answer is in: cancelled now, it may still rent
            try:
                inst.id = await self.provider.create_instance(
                    offer.id, image=c.image, env={**env, **ports}, label=inst.label, disk_gb=c.disk_gb
                )
            except OfferGone as e:
                self._uncertain_creates = False  # refused: nothing was rented
                self._skipped(stage, offer, e)
                continue
            except ProviderError as e:
                self._uncertain_creates = e.status == 0  # a definite refusal rented nothing
                raise PhaseError(Phase.RENT, f"creating stage {stage} on offer {offer.id} was rejected: {e}") from None
            self._uncertain_creates = False
            inst.created_at, inst.started = time.time(), self.clock()
            if offer.machine_id:
                self._machines.add(offer.machine_id)
            self.instances.append(inst)  # one cancelled while its create was in flight is found by the sweep
            return inst

    def _skipped(self, stage: int, offer: Offer, e: OfferGone) -> None:
        self.offers_skipped.append(
            {"stage": stage, "offer": offer.id, "dph_total": offer.dph_total, "status": e.status, "error": str(e)}
        )
        log.warning("stage %d: offer %d was taken first (%s); trying the next", stage, offer.id, e)
        if len(self.offers_skipped) > self.config.offer_races:
            taken = ", ".join(str(o["offer"]) for o in self.offers_skipped)
            raise PhaseError(
                Phase.RENT,
                f"{len(self.offers_skipped)} offers were taken by someone else between search and create "
                f"({taken}); the market is moving too fast: try again",
            ) from None

    def rent_line(self) -> str:
        detail = ", ".join(f"{i.id} ({i.offer.gpu_name}, ${i.offer.dph_total:.4f}/h)" for i in self.instances)
        if self.offers_skipped:
            gone = ", ".join(f"{o['offer']} (HTTP {o['status']})" for o in self.offers_skipped)
            detail += f"; {len(self.offers_skipped)} offer(s) taken by someone else first: {gone}"
        return detail

    async def wait_running(self, inst: RentedInstance) -> None:
        """``inst`` running within its boot window (PhaseError(Phase.BOOT) naming its stage and why
        not), and, where its create asked for one, the port vast.ai forwards to it. With
        replacement on, a host not running by its per-host deadline, or one vast.ai shows dead,
        raises :class:`Replaceable` when a replacement could be rented (:meth:`cannot_replace`);
        when none could, it keeps the rest of its window."""
        c, policy = self.config, self.config.replacement
        assert inst.id is not None

        def seen(poll: int, record: Instance | None) -> None:
            if record is not None:
                inst.seen(record)

        looks = max(1, math.ceil(c.boot_window / c.poll_interval))
        first = looks
        if policy.on:
            waited = self.clock() - (inst.started if inst.started is not None else self.clock())
            first = min(looks, 1 + max(0, math.ceil((policy.host_deadline - waited) / c.poll_interval)))
        record: Instance | None = None
        kept = ""  # why a host past its deadline was kept, not replaced
        for polls in (first, looks - first):
            if polls <= 0:
                continue
            try:
                record = await wait_running(
                    self.provider, inst.id, polls, c.poll_interval, seen,
                    clock=self.clock, sleep=self.sleep, look=self.board.look,
                )  # fmt: skip
                break
            except NeverRuns as e:
                fix = ""
                if e.failure == "image pull":
                    fix = f"; check that image {c.image} exists and is public, or pass {c.names.setting('image')}"
                error = PhaseError(Phase.BOOT, f"stage {inst.stage}: {e}{fix}")
                if policy.on and e.failure is None:  # its host is dead (an image's failure is everyone's)
                    raise Replaceable(error) from None
                raise error from None
            except TimeoutError as e:
                if polls == first and first < looks and self.cannot_replace() is None:
                    deadline = f"its {policy.host_deadline:g} s per-host deadline"
                    late = PhaseError(Phase.BOOT, f"stage {inst.stage}: not running within {deadline}: {e}")
                    raise Replaceable(late) from None
                if polls == first and first < looks:
                    kept = f"not replaced: {self.cannot_replace()}"
                    log.info("%s: not running by its per-host deadline, and %s", inst.where, kept)
                    continue
                window = f"its {c.boot_window:g} s boot window ({c.polls} polls at vast.ai's {BOOT_POLL_INTERVAL:g} s)"
                why = f"stage {inst.stage}: not running within {window}: {e}" + (f"; {kept}" if kept else "")
                raise PhaseError(Phase.BOOT, why) from None
            except ProviderError as e:
                raise PhaseError(Phase.BOOT, f"stage {inst.stage}: {e}") from None
        assert record is not None
        if c.direct:
            inst.public_udp = await self._forwarded(inst, record)

    # --- replacing a host that never boots (replace.py) -----------------------------------------

    def cannot_replace(self) -> str | None:
        """Why no replacement can be rented now (None: one can): replacement off, the run's
        replacements spent, or too little of the budget left for the policy's estimate of a
        replacement's boot and the rest of the run."""
        p = self.config.replacement
        if not p.on:
            return "replacement is off"
        if self.replacements >= p.most:
            return f"the run's {p.most} replacement(s) are spent"
        if self.deadline is not None:
            left, need = self.deadline - self.clock(), p.boot_estimate + p.rest_estimate
            if left < need:
                return (
                    f"the budget has {max(left, 0):.0f} s left, and a replacement needs about {need:.0f} s "
                    f"(a boot of {p.boot_estimate:g} s assumed, then {p.rest_estimate:g} s for the rest of the run)"
                )
        return None

    async def see_through(
        self,
        inst: RentedInstance,
        renew: Callable[[RentedInstance], Awaitable[tuple[Mapping[str, str], str]]],
        after_running: Callable[[RentedInstance], Awaitable[None]],
        stamp: Callable[[RentedInstance, str], None] = lambda i, step: None,
        spare: RentedInstance | None = None,
    ) -> RentedInstance:
        """``inst`` running (:meth:`wait_running`), then ``after_running`` (the cluster's join),
        replaced by another instance of its stage each time it does not get there in time
        (``after_running`` raises :class:`Replaceable`, or does not end within the policy's join
        deadline): ``renew`` gives the replacement's environment and endpoint id. ``spare``:
        another instance of the stage, rented beside it; the first of the two to run goes on,
        the other is destroyed. Returns the instance that got there; raises the failure of the
        last one that did not."""
        p = self.config.replacement
        while True:
            try:
                inst = await self._first_running(inst, spare)
                spare = None
                stamp(inst, "running")
                if not p.on:
                    await after_running(inst)
                    return inst
                try:
                    await self._within(p.join_deadline, after_running(inst))
                except TimeoutError:
                    late = f"{inst.where}: its node did not join within {p.join_deadline:g} s of running"
                    raise Replaceable(PhaseError(Phase.CONVERGE, late)) from None
                return inst
            except Replaceable as e:
                why = self.cannot_replace()
                if why is not None:
                    raise PhaseError(e.error.phase, f"{e.error.reason}; not replaced: {why}") from None
                inst = await self.replace(inst, e.error.reason, renew)
                stamp(inst, "rented")

    def next_replacement(self, stage: int) -> int:
        """The next replacement number of ``stage`` (its label's ``r<k>``): one past any it has had."""
        return 1 + max((i.replacement for i in self.instances if i.stage == stage), default=0)

    async def _first_running(self, inst: RentedInstance, spare: RentedInstance | None) -> RentedInstance:
        """``inst`` running; with a ``spare``, whichever of the two runs first, the other one
        destroyed (marked replaced). When neither runs, the spare is destroyed and ``inst``'s
        failure raised."""
        if spare is None:
            await self.wait_running(inst)
            return inst
        waits = {asyncio.ensure_future(self.wait_running(i)): i for i in (inst, spare)}
        first: BaseException | None = None
        try:
            for done in asyncio.as_completed(list(waits)):
                try:
                    await done
                except (PhaseError, Replaceable) as e:
                    first = first or e
                    continue
                winner = next(i for t, i in waits.items() if t.done() and not t.cancelled() and not t.exception())
                loser = spare if winner is inst else inst
                await self._retire(loser, f"the other instance of stage {inst.stage} ran first")
                return winner
        finally:
            for t in waits:
                t.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        await self._retire(spare, "neither it nor the other instance of its stage ran in time")
        assert first is not None
        raise first

    async def _retire(self, inst: RentedInstance, why: str) -> None:
        """Mark ``inst`` replaced (``why``) and destroy it."""
        inst.replaced, inst.replaced_at = why, round(self.clock() - self.began, 3)
        await self._destroy(inst)

    async def replace(
        self,
        inst: RentedInstance,
        why: str,
        renew: Callable[[RentedInstance], Awaitable[tuple[Mapping[str, str], str]]],
    ) -> RentedInstance:
        """Destroy ``inst`` (``why``: what it did not do in time) and rent its stage again on the
        next offer, on a machine this run has not rented; ``renew`` gives the new instance's
        environment and endpoint id (a new key, admitted by the cluster)."""
        self.replacements += 1
        log.warning("replacing %s: %s", inst.where, why)
        await self._retire(inst, why)  # a failed destroy is reported against it, and tried again at the close
        env, endpoint_id = await renew(inst)
        new = await self.rent(inst.stage, env, self.offers, endpoint_id, replacement=self.next_replacement(inst.stage))
        new.replaces = inst.id
        return new

    async def _forwarded(self, inst: RentedInstance, record: Instance) -> str | None:
        """Where vast.ai forwards the node's UDP port from: the running record's ``ports``, or a
        later record's (a host may show them a poll after ``running``), for up to
        :data:`PORTS_WAIT` seconds; then None, and the orchestrator reaches the node by its id
        alone (discovery and relays)."""
        c = self.config
        assert inst.id is not None
        deadline = self.clock() + PORTS_WAIT
        while (public := record.public_udp(c.port)) is None and self.clock() < deadline:
            await self.sleep(c.poll_interval)
            try:
                later = await self.board.look(inst.id)
            except ProviderError as e:
                log.info("%s: looking for its forwarded port: %s", inst.name, e)
                continue
            if later is not None:
                record = later
        if public is None:
            log.warning(
                "%s runs, but its record shows no forwarded UDP port %d after %g s: reaching it by its id",
                inst.name, c.port, PORTS_WAIT,
            )  # fmt: skip
        return public

    async def watch(self, lost: asyncio.Future[str]) -> None:
        """Until cancelled: vast.ai's list of the run's instances, every poll interval. An instance
        seen running that vast.ai then shows ``offline`` or ``exited`` (its host died; ``unknown``,
        a gap in its host's heartbeats, is logged and left to the cluster's failure detection), or
        no longer lists twice running, ends the run at once: ``lost`` gets what happened, naming
        the stage and the instance. A list that fails is retried next time."""
        missing: dict[int, int] = {}
        while not lost.done():
            await self.sleep(self.config.poll_interval)
            try:
                listed = {r.id: r for r in await self.provider.list_instances(self.label_prefix)}
            except ProviderError as e:
                log.info("watching the run's instances: %s", e)
                continue
            for inst in self.instances:
                if inst.id is None or "running" not in inst.timeline or inst.state in ("destroyed", "destroying"):
                    continue
                record = listed.get(inst.id)
                if record is None:
                    missing[inst.id] = missing.get(inst.id, 0) + 1
                    if missing[inst.id] < 2:
                        continue
                    what = "vast.ai no longer lists the instance (destroyed from elsewhere, or its node's time-to-live)"
                else:
                    missing.pop(inst.id, None)
                    if record.actual_status == "unknown" and inst.state != "unknown":
                        log.warning("%s: vast.ai has no recent heartbeat from its host (unknown)", inst.where)
                    if record.actual_status not in LOST_STATES:
                        if record.actual_status is not None:
                            inst.seen(record)
                        continue
                    inst.seen(record)
                    what = f"vast.ai reports the instance {inst.state} ({inst.status_msg or 'no status message'})"
                lost.set_result(f"{inst.where}: {what}; its host was lost mid-run")
                return

    # --- an instance's own account, when a run fails -------------------------------------------

    async def log_tail(self, inst: RentedInstance, lines: int) -> str:
        """The last ``lines`` of the instance's log, as vast.ai serves it (``request_logs``, then
        its result URL); ProviderError when the provider cannot."""
        assert inst.id is not None
        return await self.provider.request_logs(inst.id, lines)

    async def state_now(self, inst: RentedInstance) -> tuple[str, str]:
        """What vast.ai shows of the instance now: its ``actual_status`` (``missing`` once it is
        no longer shown, ``null`` before it has one) and its status message."""
        assert inst.id is not None
        record = await self.provider.show_instance(inst.id)
        if record is None:
            return "missing", "vast.ai no longer shows the instance"
        return record.actual_status or "null", record.status_msg

    # --- teardown ----------------------------------------------------------------------------

    async def close(self) -> None:
        """Destroy every instance of this run. Raises PhaseError(Phase.TEARDOWN) naming every instance
        that could not be destroyed; never stops at the first failure, and ends within
        ``teardown_timeout`` even when vast.ai does not answer."""
        try:
            await self._within(self.teardown_timeout, self._destroy_all())
        except TimeoutError:
            for i in self.instances:
                if i.state not in ("destroyed", "destroying") and not i.destroy_error:
                    i.destroy_error = f"no answer within the teardown's {self.teardown_timeout:.0f} s"
            self.teardown_errors.append(f"the teardown did not finish within {self.teardown_timeout:.0f} s")
        failed = [i for i in self.instances if i.destroy_error]
        problems = [f"{i.name} was NOT destroyed: {i.destroy_error}" for i in failed] + self.teardown_errors
        if problems:
            advice = (
                f". Something may still be billing: run {self.config.names.reap(self.run_id)}, "
                "or check the vast.ai console"
                if self.creates_sent
                else " (no instance was ever created)"
            )
            raise PhaseError(Phase.TEARDOWN, "; ".join(problems) + advice)

    async def _destroy_all(self) -> None:
        await asyncio.gather(*(self._destroy(i) for i in self.instances if i.id is not None))
        await self._sweep()

    async def _within(self, seconds: float, work: Awaitable[None]) -> None:
        """``work``, cancelled with TimeoutError once ``seconds`` of the rental's clock have passed."""
        task = asyncio.ensure_future(work)
        timer = asyncio.ensure_future(self.sleep(seconds))
        try:
            await asyncio.wait([task, timer], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, timer):
                t.cancel()
            await asyncio.gather(task, timer, return_exceptions=True)
        if task.cancelled():
            raise TimeoutError
        task.result()

    def close_line(self) -> str:
        failed = sum(1 for i in self.instances if i.destroy_error)
        return f"{len(self.instances) - failed} of {len(self.instances)} destroyed"

    async def _destroy(self, inst: RentedInstance) -> None:
        """Destroy it, then ask vast.ai: gone (``destroyed``), still listed on its way out
        (``destroying``: its state fields no longer intend it to run), or still intended running
        although the destroy was accepted: then the destroy is sent again, ``redestroys`` times,
        before it is reported as not destroyed."""
        assert inst.id is not None
        if inst.state in ("destroyed", "destroying"):
            return
        for attempt in range(1 + self.config.redestroys):
            try:
                await self.provider.destroy_instance(inst.id)
            except Exception as e:  # any failure is reported against this instance; the others go on
                inst.destroy_error = str(e) or type(e).__name__
                log.warning("could not destroy %s: %s", inst.name, inst.destroy_error)
                return
            inst.ended_at = inst.ended_at or time.time()  # billing stops with the accepted destroy
            inst.destroy_error = None
            try:
                record = await self.provider.show_instance(inst.id)
            except Exception as e:
                log.info("destroy of %s accepted; the check afterwards failed: %s", inst.name, e)
                inst.state = "destroying"
                return
            if record is None or going_away(record):
                inst.state = "destroyed" if record is None else "destroying"
                return
            inst.seen(record)
            log.warning("%s: destroy accepted, but vast.ai still shows it intended running", inst.name)
            if attempt < self.config.redestroys:
                await self.sleep(min(2.0, self.config.poll_interval))
        inst.ended_at = None  # still billing
        inst.destroy_error = (
            f"vast.ai accepted {1 + self.config.redestroys} destroys but still shows it intended running "
            f"(actual_status {inst.state!r})"
        )

    async def _sweep(self) -> None:
        """Destroy instances with this run's label that the run holds no id for: a create that
        was cancelled in flight, or whose answer was lost. Such an instance may be listed only a
        moment later, so after an uncertain create the list is read a few times."""
        if not self.creates_sent:
            return  # nothing was ever asked of vast.ai: nothing can carry this run's label
        looks = 4 if self._uncertain_creates else 1
        for look in range(looks):
            try:
                listed = await self.provider.list_instances(self.label_prefix)
            except Exception as e:
                self.teardown_errors.append(f"could not list this run's instances to sweep them: {e}")
                return
            known = {i.id for i in self.instances}
            for record in listed:
                if record.id not in known:
                    await self._destroy(self._adopt(record))
            if look < looks - 1:
                await self.sleep(min(2.0, self.config.poll_interval))

    def _adopt(self, record: Instance) -> RentedInstance:
        label = str(record.label)
        log.warning("destroying instance %s (%s): created by this run, its answer lost", record.id, label)
        stage = record.run_label.stage if record.run_label is not None else -1
        if record.id is None:
            raise ProviderError(f"a record labelled {label} without an id", 200)
        orphan = RentedInstance(stage, record.machine, label, record.id, record.start_date)
        orphan.state = record.actual_status
        self.instances.append(orphan)
        return orphan

    def cost_usd(self) -> float:
        return sum(i.cost_usd() for i in self.instances)


async def reap(provider: Provider, run_id: str | None = None) -> list[dict[str, Any]]:
    """Destroy every instance labelled by this tool (of one run, if ``run_id`` is given)."""
    out = []
    for record in await provider.list_instances(Label.prefix(run_id)):
        entry: dict[str, Any] = {
            "id": record.id,
            "label": record.label,
            "status": record.actual_status,
            "destroyed": False,
        }
        try:
            if record.id is None:
                raise ProviderError(f"a record labelled {record.label} without an id", 200)
            await provider.destroy_instance(record.id)
            entry["destroyed"] = True
        except ProviderError as e:
            entry["error"] = str(e)
        out.append(entry)
    return out

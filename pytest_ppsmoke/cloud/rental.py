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
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ..protocol import BOOT_POLL_INTERVAL, Phase, PhaseError
from .preflight import Preflight, find_offers, preflight
from .provider import Instance, Label, NeverRuns, Offer, OfferGone, Provider, ProviderError
from .renewal import Renewing
from .rented import STEPS as STEPS
from .rented import RentalConfig as RentalConfig
from .rented import RentedInstance as RentedInstance
from .replace import Replaceable
from .teardown import Teardown, within
from .waits import Board, wait_running

log = logging.getLogger(__name__)

# vast.ai's states a running instance never comes back from. ``unknown`` ("no recent heartbeat
# from the host") is a gap in the host's reports, not in its node: the cluster's own failure
# detection judges the node, and a watched instance that shows it is only logged
LOST_STATES = ("offline", "exited")
# the host watch lists at most once in this many of the list's spacings: the boot's polls and the
# teardown's check after its destroys share the call, and a watch at the list's limit would make
# each of them wait out that limit after its last list
WATCH_SHARE = 3
PORTS_WAIT = 10.0  # seconds a running instance's record may take to show its forwarded port


class _WindowSpent(Exception):
    """The boot window's polls were spent (a wait's own TimeoutError, told apart from a deadline's)."""


class Rental(Renewing):
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
        self.uncertain_creates = False
        self.offers_skipped: list[dict[str, Any]] = []  # offers raced away between search and create
        self.preflight: Preflight | None = None  # what the pre-flight found, once it ran
        self.teardown_timeout = 120.0
        self.teardown_errors: list[str] = []
        self.listed_after: list[Instance] | None = None  # the teardown's last list, read after every destroy
        self.released: set[int] = set()  # instances destroyed before the teardown, once no step needs them
        self._tried: set[int] = set()
        self.offers: list[Offer] = []  # the matching offers, cheapest first: a replacement takes the next
        self.began = clock()  # when the run began (the deployment sets it at the rent)
        self.deadline: float | None = None  # the rental's clock when the run's phases must end (the budget)
        self.replacements = 0
        self._machines: set[int] = set()  # machines rented: a replacement goes to none of them
        self.on_retire: Callable[[RentedInstance], None] | None = None  # told of each one replaced
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
        self.preflight = Preflight()  # filled as its checks pass: the live line counts them
        await preflight(
            self.provider, query=c.query, num_stages=c.num_stages, image=c.image, check_image=c.check_image or "",
            model=c.model, budget_s=c.budget, names=c.names, found=self.preflight,
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
            self.uncertain_creates = True  # until its answer is in: cancelled now, it may still rent
            try:
                inst.id = await self.provider.create_instance(
                    offer.id, image=c.image, env={**env, **ports}, label=inst.label, disk_gb=c.disk_gb
                )
            except OfferGone as e:
                self.uncertain_creates = False  # refused: nothing was rented
                self._skipped(stage, offer, e)
                continue
            except ProviderError as e:
                self.uncertain_creates = e.status == 0  # a definite refusal rented nothing
                raise PhaseError(Phase.RENT, f"creating stage {stage} on offer {offer.id} was rejected: {e}") from None
            self.uncertain_creates = False
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

    async def wait_running(self, inst: RentedInstance, deadline: bool = True) -> None:
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
        polled: list[Instance] = []  # what the polls found: the running record, once there is one

        async def poll(n: int) -> None:
            assert inst.id is not None
            try:
                found = await wait_running(
                    self.provider, inst.id, n, c.poll_interval, seen,
                    clock=self.clock, sleep=self.sleep, look=self.board.look,
                )  # fmt: skip
                polled.append(found)
            except TimeoutError as e:  # the window's polls spent, told apart from the per-host deadline
                raise _WindowSpent(str(e)) from None

        kept = ""  # why a host past its per-host deadline was kept, not replaced
        try:
            waited = self.clock() - (inst.started if inst.started is not None else self.clock())
            if deadline and policy.on and policy.host_deadline < c.boot_window:
                try:  # the per-host deadline is time on the rental's clock, however long each poll takes
                    await within(max(0.0, policy.host_deadline - waited), poll(looks), self.sleep)
                except TimeoutError:
                    took = self.clock() - (inst.started if inst.started is not None else self.clock())
                    last = f"last status {inst.state!r}: {inst.status_msg or 'no status message'}"
                    late = f"instance {inst.id} not running after {took:.1f} s ({last})"
                    if (why := self.cannot_replace()) is None:
                        within_deadline = f"within its {policy.host_deadline:g} s per-host deadline"
                        error = PhaseError(Phase.BOOT, f"stage {inst.stage}: not running {within_deadline}: {late}")
                        raise Replaceable(error, slow=True) from None
                    kept = f"not replaced: {why}"
                    log.info("%s: not running by its per-host deadline, and %s", inst.where, kept)
                    left = max(1, math.ceil((c.boot_window - took) / c.poll_interval))
                    await poll(left)
            elif deadline:  # the spec's polls
                await poll(looks)
            else:  # a host racing its replacement: the rest of its window, from its create
                await poll(max(1, looks - int(waited // c.poll_interval)))
        except NeverRuns as e:
            fix = ""
            if e.failure == "image pull":
                fix = f"; check that image {c.image} exists and is public, or pass {c.names.setting('image')}"
            error = PhaseError(Phase.BOOT, f"stage {inst.stage}: {e}{fix}")
            if policy.on and e.failure is None:  # its host is dead (an image's failure is everyone's)
                raise Replaceable(error) from None
            raise error from None
        except _WindowSpent as e:
            window = f"its {c.boot_window:g} s boot window ({c.polls} polls at vast.ai's {BOOT_POLL_INTERVAL:g} s)"
            why = f"stage {inst.stage}: not running within {window}: {e}" + (f"; {kept}" if kept else "")
            raise PhaseError(Phase.BOOT, why) from None
        except ProviderError as e:
            raise PhaseError(Phase.BOOT, f"stage {inst.stage}: {e}") from None
        record = polled[0]
        if c.direct:
            inst.public_udp = await self._forwarded(inst, record)

    # --- replacing a host that never boots (replace.py) -----------------------------------------

    def cannot_replace(self) -> str | None:
        """Why no replacement can be rented now (None: one can): replacement off, the run's
        replacements spent, or too little of the budget left for the policy's estimate of a
        replacement's boot and the rest of the run."""
        left = None if self.deadline is None else self.deadline - self.clock()
        return self.config.replacement.refusal(self.replacements, left, self.config.num_stages)

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
        the stage and the instance. A list that fails is retried next time. It keeps to a share of
        the provider's limit on the list (:data:`WATCH_SHARE`): vast.ai allows one a second, and
        its own pace, 3 s, is the boot's polls'."""
        missing: dict[int, int] = {}
        interval = max(self.config.poll_interval, WATCH_SHARE * self.provider.spacing("list"))
        while not lost.done():
            await self.sleep(interval)
            try:
                listed = {r.id: r for r in await self.provider.list_instances(self.label_prefix)}
            except ProviderError as e:
                log.info("watching the run's instances: %s", e)
                continue
            for inst in self.instances:
                if inst.id is None or "running" not in inst.timeline or inst.state in ("destroyed", "destroying"):
                    continue
                if inst.id in self.released:  # destroyed on purpose: gone is what it should be
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

    # --- teardown (teardown.py) ----------------------------------------------------------------

    async def close(self) -> None:
        """Destroy every instance of this run (:meth:`.teardown.Teardown.close`): raises
        PhaseError(Phase.TEARDOWN) naming every one that could not be, within ``teardown_timeout``."""
        await Teardown(self).close()

    async def _destroy(self, inst: RentedInstance) -> None:
        await Teardown(self).destroy(inst)

    async def release(self, instances: list[RentedInstance]) -> None:
        """Destroy ``instances`` before the teardown, as the teardown would (two or more in one
        call, then each checked, sent again alone while still shown running): no step of the run
        needs them any more, and every second they stay rented bills. The watch no longer counts
        them lost. A destroy that fails is left in ``destroy_error`` for the teardown, which
        sends it again."""
        todo = [i for i in instances if i.id is not None]
        self.released.update(i.id for i in todo if i.id is not None)
        teardown = Teardown(self)
        if len(todo) > 1:  # one by one, vast.ai spaces them 3 s apart
            await teardown.destroy_together(todo)
        for inst in todo:  # those not yet gone (all, where the one call failed)
            await teardown.destroy(inst)

    async def _within(self, seconds: float, work: Awaitable[None]) -> None:
        await within(seconds, work, self.sleep)

    def close_line(self) -> str:
        failed = sum(1 for i in self.instances if i.destroy_error)
        return f"{len(self.instances) - failed} of {len(self.instances)} destroyed"

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

"""The spec's lifecycle on rented instances: the cluster phase over the rental.

    async with VastClient(key, url) as vast:                # any cloud.provider.Provider
        async with Deployment(vast, RunConfig(num_stages=2)) as dep:
            result = await run_inference(dep.seed, 2, "Say hello", 64, timeout=...)

Renting is :mod:`..cloud.rental`'s (create, running, watch, destroy); this module is what runs on
the instances: the orchestrator (this process) is the seed member. It generates every member's
secret key, so it knows each endpoint id before an instance boots and the allowlist admits nobody
else. Each instance gets its ``NodeEnv`` (stage, stage count, seed, model, key, the cluster
settings) in its create call's ``env``.

Each instance moves through its own steps as soon as it can, one task each (:data:`STEPS`):
*rented* (its create answered), *running* (within its boot window: 60 polls at vast.ai's 3 s),
*reached* (the orchestrator has heard from its node), *joined* (alive in the orchestrator's
view, within the spec's 2 minutes of running), *loaded* (its worker ready). A node that boots
first is reached, joined and loaded while a slower host still boots. The phases are where the
run waits for every instance: *rent*, *boot*, *converge* (also every member's own view holding
all 1 + N alive), *load*, *resolve* (every stage name within 1 minute). The first failure of any
instance, or a host lost mid-run (vast.ai's list), ends the phase under way at once.

Teardown destroys every instance this run created on every path (the rental's close): success, a
failed phase, a cancellation (Ctrl-C, a budget) and a create whose answer was lost (found by its
label). A destroy that fails is reported, not hidden; the nodes' own time-to-live and the reap
are the next lines of defence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..cloud.provider import Offer, Provider
from ..cloud.rental import STEPS, Rental, RentedInstance
from ..cloud.replace import Replaceable
from ..messages import NodeStatus
from ..protocol import Phase, PhaseError, stage_name
from ..runtime.cluster import converge, resolve_names
from ..runtime.localproc import ClusterKeys
from ..runtime.node import Node, NodeConfig
from ..runtime.resource import Resource
from ..runtime.stalls import LoopStall, LoopWatch
from ..runtime.swimstate import MemberEvent
from ..runtime.transport import endpoint_id, new_secret_key
from . import reach
from .runconfig import NODE_FIELDS, RunConfig

log = logging.getLogger(__name__)


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


class Deployment(Resource):
    def __init__(
        self,
        provider: Provider,
        config: RunConfig,
        *,
        run_id: str | None = None,
        on_phase: Callable[[Phase, float, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.provider, self.config = provider, config
        self.clock, self.sleep = clock, sleep  # the phases' times and the rental's waits (a test's: virtual)
        self.run_id = run_id or new_run_id()
        self.rental = Rental(provider, config, self.run_id, clock=clock, sleep=sleep)
        self.on_phase = on_phase
        self.seed: Node | None = None
        self.watch: LoopWatch | None = None  # the orchestrator's own event loop, from the rent on
        self.keys = ClusterKeys(1 + config.num_stages)  # the seed's, each stage's; then each replacement's
        self.admitted = list(
            self.keys.ids
        )  # the ids the cluster admits now: a replacement's added, a retired one's gone
        self.names: dict[str, Any] = {}
        self.views: dict[str, list[tuple[str, str]]] = {}  # each node's own view of the members, after converge
        self.ready: dict[int, NodeStatus] = {}  # each stage's ready status: dim, blocks, context
        # each stage's last status during the load, and when it came (monotonic): the progress line's
        self.statuses: dict[int, tuple[NodeStatus, float]] = {}
        self.timings: dict[str, float] = {}
        self.spans: dict[str, tuple[float, float]] = {}  # each phase's start and end, on ``clock``
        self.on_start: Callable[[Phase], None] | None = None  # told each phase as it begins
        self.on_step: Callable[[RentedInstance, str], None] | None = None  # told each instance's step as reached
        self._phase = Phase.RENT
        self.lost: asyncio.Future[PhaseError] | None = None  # the first failure: an instance's, or a host lost
        self.swim_timing: dict[str, Any] = {}  # the round trips measured after converge, and SWIM's timing
        self.swim_deaths: list[dict[str, Any]] = []  # stages the orchestrator's SWIM saw die, and when
        self._began = clock()  # the instances' timelines count from here
        self._tasks: list[asyncio.Task[None]] = []
        self._seed_up: asyncio.Future[None] | None = None  # the seed's start, from the rent on
        self._changed = asyncio.Event()  # an instance reached a step, or failed

    def __repr__(self) -> str:
        return f"Deployment({self.run_id}, {len(self.instances)} instances)"

    @property
    def phase(self) -> Phase:
        """The phase under way: named when something interrupts it; ``on_start`` hears each one set."""
        return self._phase

    @phase.setter
    def phase(self, phase: Phase) -> None:
        self._phase = phase
        if self.on_start is not None:
            self.on_start(phase)

    @property
    def began(self) -> float:
        """When the rent began (monotonic): the instances' timelines count from it."""
        return self._began

    # the rental's, as the driver and the tests read them
    @property
    def instances(self) -> list[RentedInstance]:
        """Every instance the run rented, the replaced ones (destroyed) included."""
        return self.rental.instances

    @property
    def current(self) -> list[RentedInstance]:
        """The instances the run stands on: each stage's latest, the replaced ones left out."""
        return self.rental.current

    @property
    def members(self) -> list[str]:
        """The cluster's members' ids: the orchestrator's, then each current instance's node's."""
        seed = [self.seed.id] if self.seed is not None else [self.keys.ids[0]]
        return seed + [i.endpoint_id for i in sorted(self.current, key=lambda x: x.stage) if i.endpoint_id]

    @property
    def label_prefix(self) -> str:
        return self.rental.label_prefix

    @property
    def creates_sent(self) -> int:
        return self.rental.creates_sent

    @property
    def offers_skipped(self) -> list[dict[str, Any]]:
        return self.rental.offers_skipped

    @property
    def preflight(self) -> Any:
        return self.rental.preflight

    @property
    def teardown_timeout(self) -> float:
        return self.rental.teardown_timeout

    @teardown_timeout.setter
    def teardown_timeout(self, seconds: float) -> None:
        self.rental.teardown_timeout = seconds

    def cost_usd(self) -> float:
        return self.rental.cost_usd()

    def _begin(self, phase: Phase) -> float:
        self.phase = phase
        return self.clock()

    def _done(self, phase: Phase, started: float, detail: str = "") -> None:
        """The phase's time, and its line; from the line on, an interruption is the next phase's
        (the user has seen this one end)."""
        now = self.clock()
        self.timings[phase] = round(now - started, 4)
        self.spans[phase] = (started, now)
        if self.on_phase is not None:
            self.on_phase(phase, self.timings[phase], detail)
        self.phase = phase.next

    async def start(self) -> None:
        await self.rent()
        await self.boot()
        await self.converge()
        await self.load()
        await self.resolve()

    # --- the instances' own steps --------------------------------------------------------------

    def _failed(self, e: PhaseError) -> None:
        """The first failure ends the run: every phase waiting sees it."""
        assert self.lost is not None
        if not self.lost.done():
            self.lost.set_result(e)
        self._changed.set()

    async def _steps(self, inst: RentedInstance) -> None:
        """One instance from created to loaded, as soon as it can, apart from the others."""
        try:
            inst = await self.rental.see_through(inst, self._renew, self._join, self._stamp)
            await self._loaded(inst)
        except PhaseError as e:
            self._failed(e)
        except Exception as e:  # a defect: it still ends the run, naming the instance
            log.exception("%s: its steps failed", inst.where)
            self._failed(PhaseError(self.phase, f"{inst.where}: {type(e).__name__}: {e}"))

    async def _join(self, inst: RentedInstance) -> None:
        """``inst``'s node reached and alive in the orchestrator's view; one that is not, by the
        spec's deadline, may be replaced (:meth:`Rental.see_through`)."""
        assert self.seed is not None and self._seed_up is not None
        await asyncio.shield(self._seed_up)  # the orchestrator's own endpoint, bound
        try:
            await reach.join(self.seed, inst, self.config, self._stamp, self.current)
        except PhaseError as e:
            if e.phase is Phase.CONVERGE:
                raise Replaceable(e) from None
            raise

    async def _renew(self, old: RentedInstance) -> tuple[dict[str, str], str]:
        """A replacement of ``old``'s stage: a new key, its id admitted by the cluster (signed by
        the orchestrator, checked by every node: ``Node.admit``), and the create's environment,
        which carries the cluster's ids as they are now. ``old``'s id is revoked once it is
        retired (:meth:`_retired`): a slow host may yet win the race."""
        assert self.seed is not None
        key = new_secret_key()
        new_id = endpoint_id(key)
        self.keys.keys.append(key)
        self.keys.ids.append(new_id)
        self.admitted.append(new_id)
        self.seed.admit([new_id], [])
        return self._env(old.stage, key), new_id

    def _retired(self, inst: RentedInstance) -> None:
        """A replaced instance's node id revoked over the cluster: it may never join."""
        if self.seed is not None and inst.endpoint_id in self.admitted:
            self.admitted.remove(inst.endpoint_id)
            self.seed.admit([], [inst.endpoint_id])

    def _stamp(self, inst: RentedInstance, step: str) -> None:
        inst.reached(step, self._began, self.clock())
        self._changed.set()
        if self.on_step is not None:
            self.on_step(inst, step)

    async def _loaded(self, inst: RentedInstance) -> None:
        assert self.seed is not None

        def seen(st: NodeStatus) -> None:
            self.statuses[inst.stage] = (st, time.monotonic())

        self.ready[inst.stage] = await reach.loaded(self.seed, inst, self.config, seen)
        self._stamp(inst, "loaded")

    async def _every(self, phase: Phase) -> None:
        """Until every instance has reached the step ``phase`` waits for; the run's first failure
        is raised at once."""
        step = phase.waits_for
        if step is None:
            raise ValueError(f"phase {phase} waits for no instance step")
        while True:
            if self.lost is not None and self.lost.done():
                raise self.lost.result()
            current = self.current  # a stage being replaced has none for a while: it is not there yet
            if {i.stage for i in current} >= set(range(self.config.num_stages)) and all(
                step in i.timeline for i in current
            ):
                return
            self._changed.clear()
            await self._changed.wait()

    async def _watch_hosts(self) -> None:
        lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        with contextlib.suppress(asyncio.CancelledError):
            await self.rental.watch(lost)
        if lost.done():
            self._failed(PhaseError(self.phase, lost.result()))

    # --- phases: where the run waits for every instance ----------------------------------------

    async def check(self) -> list[Offer]:
        """The pre-flight, its own phase: the matching offers, or PhaseError with nothing rented.
        Off (``config.preflight``): the offer search alone, in the rent."""
        if not self.config.preflight:
            return await self.rental.check()
        t = self._begin(Phase.PREFLIGHT)
        offers = await self.rental.check()
        self._done(Phase.PREFLIGHT, t, self.rental.preflight_line())
        return offers

    async def rent(self) -> None:
        c = self.config
        offers = await self.check()
        t = self._begin(Phase.RENT)
        self._began = t
        self.lost = asyncio.get_running_loop().create_future()
        self.seed = Node(
            NodeConfig(
                secret_key=self.keys.keys[0],
                allowed=frozenset(self.keys.ids),
                local=c.transport == "local",
                bind_addr=c.bind,
                relay=c.relay or None,
                swim=c.swim,
            )
        )
        # the creates carry the seed's ticket (local: its address, once bound), or its id alone
        # (wan: it binds, and waits for a relay, while they go out; each instance's steps wait
        # for it before they reach the node)
        self._seed_up = asyncio.ensure_future(self.seed.start())
        # the orchestrator's own loop, watched as a node's is: a stall stretches its own probes
        # (local health) rather than costing a stage its life, and the report says it happened
        self.watch = LoopWatch(threshold=c.swim.ping_timeout, level=logging.INFO)
        self.watch.on_stall.append(self._stalled)
        self.watch.start()
        try:
            if c.transport == "local":
                await asyncio.shield(self._seed_up)
            await self._rent_all(offers)
        finally:
            if not self._seed_up.done():
                await asyncio.wait([self._seed_up])
        self._seed_up.result()
        self._tasks.append(asyncio.ensure_future(self._watch_hosts()))
        self._done(Phase.RENT, t, self.rental.rent_line())

    async def _rent_all(self, offers: list[Offer]) -> None:
        """Each stage's create in turn; each instance starts its own steps once its create is in."""
        self.rental.on_retire = self._retired
        for stage in range(self.config.num_stages):
            env = self._env(stage, self.keys.keys[1 + stage])
            inst = await self.rental.rent(stage, env, offers, self.keys.ids[1 + stage])
            self._stamp(inst, "rented")
            self._tasks.append(asyncio.ensure_future(self._steps(inst)))

    def _env(self, stage: int, key: bytes) -> dict[str, str]:
        c = self.config
        assert self.seed is not None
        node = c.node_env().replace(
            stage=stage,
            seed=self.seed.ticket() if c.transport == "local" else self.seed.id,
            node_key=key,
            allowed_ids=tuple(self.admitted),
            swim=c.swim.to_env(),
        )
        return {**node.to_env(), **c.extra_env}

    async def boot(self) -> None:
        t = self._begin(Phase.BOOT)
        await self._every(Phase.BOOT)
        replaced = [i for i in self.instances if i.replaced]
        more = f"; {len(replaced)} replaced: " + ", ".join(f"{i.name}" for i in replaced) if replaced else ""
        self._done(Phase.BOOT, t, f"{len(self.current)} running{more}")

    async def converge(self) -> None:
        """Every node joined (each within its deadline, from its running), then every member's own
        view holding all 1 + N alive, and SWIM timed to the round trips measured, the orchestrator's
        and every node's (:func:`reach.time_swim`)."""
        t = self._begin(Phase.CONVERGE)
        assert self.seed is not None
        c = self.config
        await self._every(Phase.CONVERGE)
        members = self.members
        self.views = await converge(
            self.seed, members, c.converge_timeout, lambda missing: reach.explain(self.current, c, missing)
        )
        self.swim_timing = await reach.time_swim(self.seed, self.current, c)
        self.seed.membership.add_listener(self._on_member)  # until the seed closes, teardown included
        self._done(Phase.CONVERGE, t, f"{len(members)} members" + self._paths_line() + self._swim_line())

    def _stalled(self, stall: LoopStall) -> None:
        """The orchestrator's own loop stalled: Lifeguard's local health takes it (once SWIM runs)."""
        membership = getattr(self.seed, "membership", None)
        if membership is not None:
            membership.loop_stalled(stall.seconds)

    def _on_member(self, ev: MemberEvent) -> None:
        """A stage that the orchestrator's SWIM declares dead (by its own probes or another
        member's word), and when (epoch seconds): kept for the report whichever detector ended the
        run, so that the failure detector's delay can be measured against a known death."""
        if ev.kind != "dead":
            return
        for inst in self.instances:
            if inst.endpoint_id == ev.member.id:
                self.swim_deaths.append({"member": stage_name(inst.stage), "at": round(time.time(), 3)})

    def _swim_line(self) -> str:
        t = self.swim_timing
        if not t or t["worst_rtt_ms"] < 10:
            return ""
        nodes = t.get("nodes", {})
        took = sum(1 for n in nodes.values() if n.get("ping_timeout", 0) >= t["ping_timeout"])
        return (
            f"; SWIM probe timeout {t['ping_timeout']:.3g} s, period {t['protocol_period']:.3g} s "
            f"(worst round trip {t['worst_rtt_ms']:.0f} ms; set by {t['set_by']}; on {took} of {len(nodes)} nodes)"
        )

    def places(self) -> dict[int, str]:
        """Where each stage runs, as a failure names it: ``{stage: "instance N (label)"}``."""
        return {i.stage: f"instance {i.id} ({i.label})" for i in self.current}

    def paths(self) -> dict[str, Any]:
        """How the orchestrator reaches each stage now (:meth:`Transport.path`), and how many
        connections it accepted (behind a NAT: none can come in)."""
        if self.seed is None:
            return {}
        out: dict[str, Any] = {
            stage_name(i.stage): self.seed.transport.path(i.endpoint_id) for i in self.current if i.endpoint_id
        }
        stats = self.seed.transport.stats
        return {"links": out, "dialled": stats.connects, "accepted": stats.accepted}

    def _paths_line(self) -> str:
        if self.config.transport != "wan":
            return ""
        seen = []
        for name, p in self.paths().get("links", {}).items():
            if p is not None and p["path"] is not None:
                rtt = f", {p['rtt_ms']} ms" if p["rtt_ms"] is not None else ""
                seen.append(f"{name} {p['path']} {p['remote_addr']}{rtt}")
        return "; " + ", ".join(seen) if seen else ""

    async def load(self) -> None:
        """Every node's worker has loaded its layers (``NodeStatus`` ready), each within its deadline."""
        t = self._begin(Phase.LOAD)
        await self._every(Phase.LOAD)
        self._done(Phase.LOAD, t, "workers ready" + reach.load_totals(list(self.ready.values())))

    async def release(self, keep: int) -> None:
        """Destroy every current instance but stage ``keep``'s (:meth:`Rental.release`: two or more
        in one call): after the request, the reference runs on stage ``keep``'s node alone, and the
        teardown then has that one left to destroy."""
        await self.rental.release(sorted((i for i in self.current if i.stage != keep), key=lambda i: i.stage))

    async def resolve(self) -> None:
        t = self._begin(Phase.RESOLVE)
        assert self.seed is not None
        self.names = await resolve_names(self.seed, self.config.num_stages, self.config.resolve_timeout)
        self._done(Phase.RESOLVE, t, ", ".join(self.names))  # next: prefill, which the pipeline splits from decode

    # --- teardown ----------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop the instances' steps, destroy every instance of this run (the rental's close), then
        leave the cluster. Raises the rental's PhaseError(Phase.TEARDOWN) naming every instance that
        could not be destroyed."""
        t = self._begin(Phase.TEARDOWN)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await _leave(self.seed)
        try:
            await self.rental.close()
        finally:
            if self.watch is not None:
                await self.watch.close()
            if self.seed is not None:
                with contextlib.suppress(Exception):
                    await self.seed.close(leave=False)  # it left before the destroys
                self.seed = None
            self._done(Phase.TEARDOWN, t, self.rental.close_line())


async def _leave(seed: Node | None) -> None:
    """The orchestrator leaves the cluster before the teardown's destroys, while every node still
    hears it: a node destroyed next says its own goodbye to the members left, and waits on no
    orchestrator already gone (its close then sends none)."""
    if seed is not None:
        with contextlib.suppress(Exception):
            await seed.membership.leave()


__all__ = ["NODE_FIELDS", "STEPS", "Deployment", "RunConfig", "new_run_id"]

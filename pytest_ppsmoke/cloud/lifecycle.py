"""The spec's lifecycle on rented instances: rent, boot, converge, load, resolve, then teardown.

    async with VastClient(key, url) as vast:
        async with Deployment(vast, RunConfig(num_stages=2)) as dep:
            result = await run_inference(dep.seed, 2, "Say hello", 64, timeout=...)

The orchestrator (this process) is the seed member. It generates every member's secret key, so
it knows each endpoint id before an instance boots and the allowlist admits nobody else. Each
instance gets its ``NodeEnv`` (stage, stage count, seed, model, key, the cluster settings) in its
create call's ``env``, and a label ``ppsmoke-<run id>-stage<i>`` by which it can be found again.

Phases and their deadlines (the spec's): *rent* (fewer offers than stages, or a rejected create,
fails at once), *boot* (each instance ``running`` within its boot window: 60 polls at vast.ai's
3 s), *converge* (1 + N members
alive in every member's view within 2 minutes), *load* (every node's worker ready), *resolve*
(every stage name within 1 minute).

Teardown destroys every instance this run created on every path: success, a failed phase, a
cancellation (Ctrl-C, a budget) and a create whose answer was lost (found by its label). A
destroy that fails is reported, not hidden; the nodes' own time-to-live and the reap (``reap``)
are the next lines of defence.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import DEFAULT_IMAGE
from ..messages import NodeStatus, NodeStatusQuery
from ..nodeenv import DEFAULTS, NodeEnv
from ..protocol import (
    BOOT_POLL_INTERVAL,
    BOOT_POLLS,
    CONVERGE_TIMEOUT,
    RESOLVE_TIMEOUT,
    STATUS_ACTOR,
    PhaseError,
    reap_advice,
    setting,
    stage_name,
)
from ..runtime.cluster import converge, resolve_names
from ..runtime.codec import ActorAddress, Echo, Join, MemberStatus, Sync
from ..runtime.errors import RemoteError
from ..runtime.localproc import ClusterKeys
from ..runtime.node import Node, NodeConfig
from ..runtime.resource import Resource
from ..runtime.swim import SWIM_ACTOR
from ..runtime.swimconfig import SwimConfig
from ..runtime.transport import PeerAddr
from .preflight import Preflight, find_offers, image_check, preflight
from .vast import Instance, Label, NeverRuns, Offer, OfferGone, OfferQuery, VastClient, VastError, going_away

log = logging.getLogger(__name__)

# vast.ai's states a running instance never comes back from. ``unknown`` ("no recent heartbeat
# from the host") is a gap in the host's reports, not in its node: the cluster's own failure
# detection judges the node, and a watched instance that shows it is only logged
LOST_STATES = ("offline", "exited")
PORTS_WAIT = 10.0  # seconds a running instance's record may take to show its forwarded port
NEXT_PHASE = {
    "preflight": "rent",
    "rent": "boot",
    "boot": "converge",
    "converge": "load",
    "load": "resolve",
    "resolve": "prefill",
}


# RunConfig's fields that every node's NodeEnv carries, by the NodeEnv field each becomes
NODE_FIELDS = {
    "num_stages": "num_stages",
    "model": "model",
    "wire_dtype": "wire_dtype",
    "weight_cache": "weight_cache",
    "program_cache": "program_cache",
    "network": "network",
    "converge_timeout": "join_timeout",  # a node joins within the run's convergence deadline
    "load_timeout": "worker_ready_timeout",
    "node_ttl": "ttl",
    "orphan_grace": "orphan_grace",
    "relay": "relay",
    "reference_load": "reference",
    "boot_window": "boot_window",
}
DEFAULT_PORT = 7000  # the UDP port each create asks vast.ai to forward (wan), and its node binds


@dataclass
class RunConfig:
    """What a deployment needs: the harness builds it from its settings (``driver.run_config``); a
    value that a node also reads takes ``NodeEnv``'s default, a deadline of the spec's ``protocol``'s."""

    num_stages: int = DEFAULTS.num_stages
    model: str = DEFAULTS.model
    wire_dtype: str = DEFAULTS.wire_dtype
    weight_cache: str = DEFAULTS.weight_cache  # the nodes' PP_WEIGHT_CACHE ("": their default directory)
    program_cache: bool = DEFAULTS.program_cache  # the nodes' PP_PROGRAM_CACHE
    reference_load: str = DEFAULTS.reference  # stage 0's PP_REFERENCE: its reference worker beside, or after
    image: str = DEFAULT_IMAGE
    disk_gb: float = OfferQuery.disk_gb
    query: OfferQuery = field(default_factory=OfferQuery)
    network: str = DEFAULTS.network  # local: loopback, relays off, the seed a ticket; wan: ids, discovery, relays
    polls: int = BOOT_POLLS  # the spec's boot polls, at vast.ai's pace: the boot window (boot_window)
    poll_interval: float = BOOT_POLL_INTERVAL  # how often the boot looks (a local run: faster)
    converge_timeout: float = CONVERGE_TIMEOUT  # the spec's SWIM deadline
    load_timeout: float = DEFAULTS.worker_ready_timeout  # the workers' ready deadline
    resolve_timeout: float = RESOLVE_TIMEOUT  # the spec's name deadline
    node_ttl: float = DEFAULTS.ttl  # a node removes itself after this long, whatever happens
    orphan_grace: float = DEFAULTS.orphan_grace  # ... or once it has lost the orchestrator for this long
    extra_env: Mapping[str, str] = field(default_factory=dict)  # raw variables over each node's NodeEnv
    port: int = DEFAULT_PORT  # wan: the UDP port each create asks vast.ai to forward (0: none, relays only)
    relay: str = ""  # wan: the relays (empty: n0's; "off"; a dedicated relay's URL), the seed's and the nodes'
    bind: str | None = None  # the seed's ip:port (None: loopback when local); an emulated network's host address
    rtt: float = 0.0  # the network's worst round trip, seconds (an emulated network's profile): SWIM's timeouts
    offer_races: int = 4  # offers raced away between search and create that the run moves past
    redestroys: int = 2  # destroys sent again when vast.ai accepted one but still shows the instance running
    preflight: bool = True  # the checks before the first create (.preflight)
    check_image: bool | str | None = None  # ask the image's registry; a str: why not; None: image_check decides
    budget: float = 300.0  # the run's seconds: the credit must cover the offers' $/h for this long

    def __post_init__(self) -> None:
        if self.num_stages < 2:
            raise ValueError(f"num_stages must be at least 2, got {self.num_stages}")
        if self.network not in ("local", "wan"):
            raise ValueError(f"network must be 'local' or 'wan', got {self.network!r}")
        if self.polls < 1:
            raise ValueError(f"polls must be at least 1, got {self.polls}")
        if self.offer_races < 0:
            raise ValueError(f"offer_races must be at least 0, got {self.offer_races}")
        if self.check_image is None:
            self.check_image = image_check(self.image, vastai=self.network != "local")
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
        return self.network == "wan" and self.port > 0

    def node_env(self) -> NodeEnv:
        """The part of every node's ``NodeEnv`` that this config gives (:data:`NODE_FIELDS`), and
        the port it binds where its create asks vast.ai to forward one (none elsewhere: nodes that
        share a host's network, as the image's do here, must not all bind it)."""
        fields = {var: getattr(self, name) for name, var in NODE_FIELDS.items()}
        return NodeEnv(**fields, port=self.port if self.direct else 0)

    @property
    def swim(self) -> SwimConfig:
        """Loopback on shared cores; the WAN's; or, where the round trip is known to be more than
        a few milliseconds (an emulated network's profile), :func:`swim_for_rtt`."""
        if self.rtt >= 0.01:
            return swim_for_rtt(self.rtt)
        return SwimConfig.wan() if self.network != "local" else SwimConfig.shared_cpu()


def swim_for_rtt(rtt: float) -> SwimConfig:
    """The WAN's timing with a probe timeout of at least three round trips of ``rtt`` seconds,
    and a probe period of at least two timeouts."""
    wan = SwimConfig.wan()
    timeout = max(wan.ping_timeout, 3 * rtt)
    return dataclasses.replace(wan, ping_timeout=timeout, protocol_period=max(wan.protocol_period, 2 * timeout))


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

    @property
    def name(self) -> str:
        return f"instance {self.id} (stage {self.stage})"

    @property
    def where(self) -> str:
        """How a failure names it: ``pp-stage-1 on instance N (label)``."""
        return f"{stage_name(self.stage)} on instance {self.id} ({self.label})"

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
        }


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


class Deployment(Resource):
    def __init__(
        self,
        vast: VastClient,
        config: RunConfig,
        *,
        run_id: str | None = None,
        on_phase: Callable[[str, float, str], None] | None = None,
    ) -> None:
        self.vast, self.config = vast, config
        self.run_id = run_id or new_run_id()
        self.on_phase = on_phase
        self.instances: list[RentedInstance] = []
        self.seed: Node | None = None
        self.keys = ClusterKeys(1 + config.num_stages)
        self.names: dict[str, ActorAddress] = {}
        self.ready: dict[int, NodeStatus] = {}  # each stage's ready status: dim, blocks, context
        self.timings: dict[str, float] = {}
        self.phase = "rent"  # the phase under way: named when something interrupts it
        self.teardown_timeout = 120.0
        self.teardown_errors: list[str] = []
        self.creates_sent = 0  # create calls sent: with none, nothing of this run can be billing
        self._uncertain_creates = False
        self.offers_skipped: list[dict[str, Any]] = []  # offers raced away between search and create
        self.preflight: Preflight | None = None  # what the pre-flight found, once it ran
        self.lost: asyncio.Future[PhaseError] | None = None  # set when a stage's host is lost mid-run
        self.swim_timing: dict[str, Any] = {}  # the round trips measured after converge, and SWIM's timing
        self._watch: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"Deployment({self.run_id}, {len(self.instances)} instances)"

    def _begin(self, phase: str) -> float:
        self.phase = phase
        return time.monotonic()

    def _done(self, phase: str, started: float, detail: str = "") -> None:
        """The phase's time, and its line; from the line on, an interruption is the next phase's
        (the user has seen this one end)."""
        self.timings[phase] = round(time.monotonic() - started, 4)
        self.phase = NEXT_PHASE.get(phase, self.phase)
        if self.on_phase is not None:
            self.on_phase(phase, self.timings[phase], detail)

    @property
    def label_prefix(self) -> str:
        return Label.prefix(self.run_id)

    async def start(self) -> None:
        await self.rent()
        await self.boot()
        await self.converge()
        await self.load()
        await self.resolve()

    # --- phases ------------------------------------------------------------------------------

    async def check(self) -> list[Offer]:
        """The pre-flight (:mod:`.preflight`), its own phase: the matching offers, or PhaseError
        with nothing rented. Off (``config.preflight``): the offer search alone, in the rent."""
        c = self.config
        if not c.preflight:
            return await find_offers(self.vast, c.query, c.num_stages, phase="rent")
        t = self._begin("preflight")
        self.preflight = await preflight(
            self.vast, query=c.query, num_stages=c.num_stages, image=c.image, check_image=c.check_image or "",
            model=c.model, budget_s=c.budget,
        )  # fmt: skip
        found = self.preflight
        credit = "no credit shown" if found.credit is None else f"credit ${found.credit:.2f}"
        image = (
            f"image {found.image.ref} ({found.image.compressed_bytes / 1e6:.0f} MB compressed)"
            if found.image else f"image not checked: {found.image_checked}"
        )  # fmt: skip
        detail = (
            f"key ok, {credit} for a worst case of ${found.worst_case_usd:.2f}; {image}; {len(found.offers)} offers"
        )
        self._done("preflight", t, detail)
        return found.offers

    async def rent(self) -> None:
        offers = await self.check()
        t = self._begin("rent")
        c = self.config
        self.seed = Node(
            NodeConfig(
                secret_key=self.keys.keys[0],
                allowed=frozenset(self.keys.ids),
                local=c.network == "local",
                bind_addr=c.bind,
                relay=c.relay or None,
                swim=c.swim,
            )
        )
        tried: set[int] = set()
        if c.network == "local":  # the creates carry the seed's ticket: its address, once bound
            await self.seed.start()
            for stage in range(c.num_stages):
                await self._rent_stage(stage, offers, tried)
        else:  # the creates carry its id alone: it binds, and waits for a relay, while they go out
            starting = asyncio.ensure_future(self.seed.start())
            try:
                for stage in range(c.num_stages):
                    await self._rent_stage(stage, offers, tried)
            finally:
                if not starting.done():
                    await asyncio.wait([starting])
            starting.result()
        detail = ", ".join(f"{i.id} ({i.offer.gpu_name}, ${i.offer.dph_total:.4f}/h)" for i in self.instances)
        if self.offers_skipped:
            gone = ", ".join(f"{o['offer']} (HTTP {o['status']})" for o in self.offers_skipped)
            detail += f"; {len(self.offers_skipped)} offer(s) taken by someone else first: {gone}"
        self._done("rent", t, detail)

    async def _rent_stage(self, stage: int, offers: list[Offer], tried: set[int]) -> None:
        """Create stage ``stage``'s instance on the cheapest matching offer not tried yet. An offer
        taken by someone else between search and create (404/410 ``no_such_ask``) is reported and
        the next one is tried, up to ``offer_races`` in the run; any other refusal ends the run."""
        c = self.config
        while True:
            offer = next((o for o in offers if o.id not in tried), None)
            if offer is None:
                taken = ", ".join(str(o["offer"]) for o in self.offers_skipped)
                raise PhaseError(
                    "rent",
                    f"no matching offer left for stage {stage}: {len(offers)} matched, and {taken} were taken "
                    f"between search and create. Relax {setting('gpu_ram')}, {setting('max_price')} or "
                    f"{setting('min_reliability')}, or try again",
                )
            tried.add(offer.id)
            inst = RentedInstance(stage, offer, Label(self.run_id, stage).format())
            inst.endpoint_id = self.keys.ids[1 + stage]
            self.creates_sent += 1
            self._uncertain_creates = True  # until its answer is in: cancelled now, it may still rent
            try:
                inst.id = await self.vast.create_instance(
                    offer.id, image=c.image, env=self._env(stage), label=inst.label, disk_gb=c.disk_gb
                )
            except OfferGone as e:
                self._uncertain_creates = False  # refused: nothing was rented
                self.offers_skipped.append(
                    {
                        "stage": stage,
                        "offer": offer.id,
                        "dph_total": offer.dph_total,
                        "status": e.status,
                        "error": str(e),
                    }
                )
                log.warning("stage %d: offer %d was taken first (%s); trying the next", stage, offer.id, e)
                if len(self.offers_skipped) > c.offer_races:
                    taken = ", ".join(str(o["offer"]) for o in self.offers_skipped)
                    raise PhaseError(
                        "rent",
                        f"{len(self.offers_skipped)} offers were taken by someone else between search and create "
                        f"({taken}); the market is moving too fast: try again",
                    ) from None
                continue
            except VastError as e:
                self._uncertain_creates = e.status == 0  # a definite refusal rented nothing
                raise PhaseError("rent", f"creating stage {stage} on offer {offer.id} was rejected: {e}") from None
            self._uncertain_creates = False
            inst.created_at = time.time()
            self.instances.append(inst)  # one cancelled while its create was in flight is found by the sweep
            return

    def _env(self, stage: int) -> dict[str, str]:
        c = self.config
        assert self.seed is not None
        node = c.node_env().replace(
            stage=stage,
            seed=self.seed.ticket() if c.network == "local" else self.seed.id,
            node_key=self.keys.keys[1 + stage],
            allowed_ids=tuple(self.keys.ids),
            swim=c.swim.to_env(),
        )
        ports = {f"-p {c.port}:{c.port}/udp": "1"} if c.direct else {}  # vast-cli's form of docker's -p
        return {**node.to_env(), **ports, **c.extra_env}

    async def boot(self) -> None:
        t = self._begin("boot")
        c = self.config

        async def one(inst: RentedInstance) -> None:
            assert inst.id is not None

            def seen(poll: int, record: Instance | None) -> None:
                if record is not None:
                    inst.seen(record)

            looks = max(1, math.ceil(c.boot_window / c.poll_interval))
            try:
                record = await self.vast.wait_running(inst.id, looks, c.poll_interval, seen)
            except NeverRuns as e:
                fix = ""
                if e.failure == "image pull":
                    fix = f"; check that image {c.image} exists and is public, or pass {setting('image')}"
                raise PhaseError("boot", f"stage {inst.stage}: {e}{fix}") from None
            except TimeoutError as e:
                window = f"its {c.boot_window:g} s boot window ({c.polls} polls at vast.ai's {BOOT_POLL_INTERVAL:g} s)"
                raise PhaseError("boot", f"stage {inst.stage}: not running within {window}: {e}") from None
            except VastError as e:
                raise PhaseError("boot", f"stage {inst.stage}: {e}") from None
            if c.direct:
                inst.public_udp = await self._forwarded(inst, record)

        await _all(one(i) for i in self.instances)
        self._done("boot", t, f"{len(self.instances)} running")
        self.lost = asyncio.get_running_loop().create_future()
        self._watch = asyncio.ensure_future(self._watch_hosts(self.lost))

    async def _forwarded(self, inst: RentedInstance, record: Instance) -> str | None:
        """Where vast.ai forwards the node's UDP port from: the running record's ``ports``, or a
        later record's (a host may show them a poll after ``running``), for up to
        :data:`PORTS_WAIT` seconds; then None, and the orchestrator reaches the node by its id
        alone (discovery and relays)."""
        c = self.config
        assert inst.id is not None
        deadline = time.monotonic() + PORTS_WAIT
        while (public := record.public_udp(c.port)) is None and time.monotonic() < deadline:
            await asyncio.sleep(c.poll_interval)
            try:
                later = await self.vast.show_instance(inst.id)
            except VastError as e:
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

    async def _watch_hosts(self, lost: asyncio.Future[PhaseError]) -> None:
        """From boot to teardown: vast.ai's list of the run's instances, every poll interval. A stage
        instance that vast.ai shows ``offline`` or ``exited`` (its host died; ``unknown``, a gap in
        its host's heartbeats, is logged and left to the cluster's failure detection), or no
        longer lists twice running, ends the run at once: ``lost`` gets the PhaseError, naming the
        stage, the instance and what vast.ai reported. A list that fails is retried next time."""
        missing: dict[int, int] = {}
        while not lost.done():
            await asyncio.sleep(self.config.poll_interval)
            try:
                listed = {r.id: r for r in await self.vast.list_instances(self.label_prefix)}
            except VastError as e:
                log.info("watching the run's instances: %s", e)
                continue
            for inst in self.instances:
                if inst.id is None or inst.state in ("destroyed", "destroying"):
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
                lost.set_result(PhaseError(self.phase, f"{inst.where}: {what}; its host was lost mid-run"))
                return

    async def converge(self) -> None:
        t = self._begin("converge")
        assert self.seed is not None

        c = self.config

        def explain(missing: set[str]) -> str:
            lines = [f"{i.name}, last seen {i.state or 'null'}" for i in self.instances if i.endpoint_id in missing]
            unmapped = [i for i in self.instances if i.endpoint_id in missing and not i.public_udp]
            if c.network == "wan" and unmapped:
                names = ", ".join(i.name for i in unmapped)
                why = (
                    f"no port was asked of vast.ai ({setting('port')} 0)"
                    if not c.direct
                    else f"vast.ai's record shows no ports['{c.port}/udp'] mapping"
                )
                lines.append(
                    f"{names} cannot be dialled: {why}, so a node behind its host's NAT is reachable through a "
                    f"relay only; ask for a forwarded UDP port ({setting('port')} {c.port or DEFAULT_PORT}: "
                    f"'-p {c.port or DEFAULT_PORT}:{c.port or DEFAULT_PORT}/udp' in each create's env) on offers "
                    "with direct_port_count >= 1"
                )
            return "; ".join(lines)

        reach = asyncio.ensure_future(self._reach_nodes()) if c.network == "wan" else None
        try:
            await converge(self.seed, self.keys.ids, c.converge_timeout, explain)
        finally:
            if reach is not None:
                reach.cancel()
                await asyncio.gather(reach, return_exceptions=True)
        await self.time_swim()
        self._done("converge", t, f"{len(self.keys.ids)} members" + self._paths_line() + self._swim_line())

    async def time_swim(self, rounds: int = 3) -> None:
        """SWIM timed to the paths: each member's round trip measured (``rounds`` echoes, the
        median), and, over a network (vast.ai, an emulated one), the orchestrator's probe timeout
        and period set from the worst one when that asks for more than it has
        (:func:`swim_for_rtt`): a relayed path across an ocean must not read as a dead member.
        ``self.swim_timing`` records what was measured and chosen."""
        seed = self.seed
        assert seed is not None
        measured: dict[str, float | None] = {}

        async def one(inst: RentedInstance) -> None:
            times = []
            for _ in range(rounds):
                t = time.monotonic()
                try:
                    await seed.request(ActorAddress(inst.endpoint_id, "node"), Echo(b""), timeout=5.0)
                except (TimeoutError, ConnectionError, RemoteError):
                    continue
                times.append(time.monotonic() - t)
            measured[stage_name(inst.stage)] = sorted(times)[len(times) // 2] if times else None

        await asyncio.gather(*(one(i) for i in self.instances if i.endpoint_id))
        worst = max((v for v in measured.values() if v is not None), default=0.0)
        before = seed.membership.config
        wanted = swim_for_rtt(worst)
        source = "the run's settings"
        # on loopback a slow echo is a busy core, not a path: the shared-CPU timing stays
        over_a_network = self.config.network == "wan" or self.config.rtt >= 0.01
        if over_a_network and worst >= 0.01 and wanted.ping_timeout > before.ping_timeout:
            seed.membership.config = dataclasses.replace(
                before, ping_timeout=wanted.ping_timeout, protocol_period=wanted.protocol_period
            )
            source = "the measured round trips"
        cfg = seed.membership.config
        self.swim_timing = {
            "rtt_ms": {k: None if v is None else round(v * 1e3, 2) for k, v in sorted(measured.items())},
            "worst_rtt_ms": round(worst * 1e3, 2),
            "ping_timeout": cfg.ping_timeout,
            "protocol_period": cfg.protocol_period,
            "suspicion_timeout": cfg.suspicion_timeout,
            "set_by": source,
        }

    def _swim_line(self) -> str:
        t = self.swim_timing
        if not t or t["worst_rtt_ms"] < 10:
            return ""
        return (
            f"; SWIM probe timeout {t['ping_timeout']:.3g} s, period {t['protocol_period']:.3g} s "
            f"(worst round trip {t['worst_rtt_ms']:.0f} ms; set by {t['set_by']})"
        )

    async def _reach_nodes(self) -> None:
        """The orchestrator dials every node (the internet: a node cannot dial an orchestrator
        behind NAT): at the public address and port vast.ai forwards to it, where the record
        shows one, else by its id alone (discovery and relays). It offers each node its own state
        (a SWIM join the other way round) until the node answers; the node answers, and later
        sends everything, on the connection the orchestrator made."""
        seed = self.seed
        assert seed is not None

        async def one(inst: RentedInstance) -> None:
            seed.transport.learn(PeerAddr(inst.endpoint_id, (inst.public_udp,) if inst.public_udp else ()))
            delay = 0.2
            while True:
                try:
                    reply = await seed.request(
                        ActorAddress(inst.endpoint_id, SWIM_ACTOR), Join(seed.membership.me), 5.0, sender=SWIM_ACTOR
                    )
                except (TimeoutError, ConnectionError, RemoteError) as e:
                    log.info("reaching %s: %s", inst.where, e)
                else:
                    if isinstance(reply, Sync):
                        seed.membership.merge(reply.members)
                        return
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)

        await asyncio.gather(*(one(i) for i in self.instances if i.endpoint_id))

    def places(self) -> dict[int, str]:
        """Where each stage runs, as a failure names it: ``{stage: "instance N (label)"}``."""
        return {i.stage: f"instance {i.id} ({i.label})" for i in self.instances}

    def paths(self) -> dict[str, Any]:
        """How the orchestrator reaches each stage now (:meth:`Transport.path`), and how many
        connections it accepted (behind a NAT: none can come in)."""
        if self.seed is None:
            return {}
        out: dict[str, Any] = {
            stage_name(i.stage): self.seed.transport.path(i.endpoint_id) for i in self.instances if i.endpoint_id
        }
        stats = self.seed.transport.stats
        return {"links": out, "dialled": stats.connects, "accepted": stats.accepted}

    def _paths_line(self) -> str:
        if self.config.network != "wan":
            return ""
        seen = []
        for name, p in self.paths().get("links", {}).items():
            if p is not None and p["path"] is not None:
                rtt = f", {p['rtt_ms']} ms" if p["rtt_ms"] is not None else ""
                seen.append(f"{name} {p['path']} {p['remote_addr']}{rtt}")
        return "; " + ", ".join(seen) if seen else ""

    async def load(self) -> None:
        """Every node's worker has loaded its layers (``NodeStatus`` ready), within the deadline."""
        t = self._begin("load")
        assert self.seed is not None
        seed, timeout = self.seed, self.config.load_timeout
        # the node has the same deadline for its worker and says why it failed (the worker's stderr);
        # a few seconds more here let that answer arrive
        deadline = t + timeout + 5
        statuses: dict[int, NodeStatus | str] = {}

        async def one(inst: RentedInstance) -> NodeStatus:
            while True:
                member = seed.membership.get(inst.endpoint_id)
                if member is not None and member.status == MemberStatus.dead:
                    lost = "dropped out of the cluster: the orchestrator's SWIM declared it dead"
                    raise PhaseError("load", f"{stage_name(inst.stage)} on {inst.name} {lost}")
                try:
                    st = await seed.request(ActorAddress(inst.endpoint_id, STATUS_ACTOR), NodeStatusQuery(), timeout=10)
                except (TimeoutError, ConnectionError, RemoteError) as e:
                    statuses[inst.stage] = f"no answer: {e}"
                else:
                    assert isinstance(st, NodeStatus)
                    statuses[inst.stage] = st
                    if st.state == "ready":
                        self.ready[inst.stage] = st
                        return st
                    if st.state == "failed":
                        raise PhaseError("load", f"{stage_name(inst.stage)} on {inst.name}: {st.detail}")
                if time.monotonic() > deadline:
                    last = statuses.get(inst.stage)
                    seen = f"{last.state} for {last.seconds} s" if isinstance(last, NodeStatus) else last
                    what = f"{stage_name(inst.stage)} on {inst.name}"
                    raise PhaseError("load", f"{what}: worker not ready within {timeout:.0f} s ({seen})")
                await asyncio.sleep(min(1.0, self.config.poll_interval))

        await _all(one(i) for i in self.instances)
        self._done("load", t, "workers ready" + load_totals(list(self.ready.values())))

    async def resolve(self) -> None:
        t = self._begin("resolve")
        assert self.seed is not None
        self.names = await resolve_names(self.seed, self.config.num_stages, self.config.resolve_timeout)
        self._done("resolve", t, ", ".join(self.names))  # next: prefill, which the pipeline splits from decode

    # --- teardown ----------------------------------------------------------------------------

    async def close(self) -> None:
        """Destroy every instance of this run, then leave the cluster. Raises PhaseError("teardown")
        naming every instance that could not be destroyed; never stops at the first failure, and
        ends within ``teardown_timeout`` even when vast.ai does not answer."""
        t = self._begin("teardown")
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        try:
            async with asyncio.timeout(self.teardown_timeout):
                await asyncio.gather(*(self._destroy(i) for i in self.instances if i.id is not None))
                await self._sweep()
        except TimeoutError:
            for i in self.instances:
                if i.state not in ("destroyed", "destroying") and not i.destroy_error:
                    i.destroy_error = f"no answer within the teardown's {self.teardown_timeout:.0f} s"
            self.teardown_errors.append(f"the teardown did not finish within {self.teardown_timeout:.0f} s")
        finally:
            if self.seed is not None:
                with contextlib.suppress(Exception):
                    await self.seed.close()
                self.seed = None
        failed = [i for i in self.instances if i.destroy_error]
        self._done("teardown", t, f"{len(self.instances) - len(failed)} of {len(self.instances)} destroyed")
        problems = [f"{i.name} was NOT destroyed: {i.destroy_error}" for i in failed] + self.teardown_errors
        if problems:
            advice = (
                f". Something may still be billing: run {reap_advice(self.run_id)}, or check the vast.ai console"
                if self.creates_sent
                else " (no instance was ever created)"
            )
            raise PhaseError("teardown", "; ".join(problems) + advice)

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
                await self.vast.destroy_instance(inst.id)
            except Exception as e:  # any failure is reported against this instance; the others go on
                inst.destroy_error = str(e) or type(e).__name__
                log.warning("could not destroy %s: %s", inst.name, inst.destroy_error)
                return
            inst.ended_at = inst.ended_at or time.time()  # billing stops with the accepted destroy
            inst.destroy_error = None
            try:
                record = await self.vast.show_instance(inst.id)
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
                await asyncio.sleep(min(2.0, self.config.poll_interval))
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
                listed = await self.vast.list_instances(self.label_prefix)
            except Exception as e:
                self.teardown_errors.append(f"could not list this run's instances to sweep them: {e}")
                return
            known = {i.id for i in self.instances}
            for record in listed:
                if record.id not in known:
                    await self._destroy(self._adopt(record))
            if look < looks - 1:
                await asyncio.sleep(min(2.0, self.config.poll_interval))

    def _adopt(self, record: Instance) -> RentedInstance:
        label = str(record.label)
        log.warning("destroying instance %s (%s): created by this run, its answer lost", record.id, label)
        stage = record.run_label.stage if record.run_label is not None else -1
        if record.id is None:
            raise VastError("GET", "/api/v1/instances/", 200, f"a record labelled {label} without an id")
        orphan = RentedInstance(stage, record.machine(), label, record.id, record.start_date)
        orphan.state = record.actual_status
        if 0 <= stage < self.config.num_stages:
            orphan.endpoint_id = self.keys.ids[1 + stage]
        self.instances.append(orphan)
        return orphan

    def cost_usd(self) -> float:
        return sum(i.cost_usd() for i in self.instances)


def load_totals(ready: list[NodeStatus]) -> str:
    """The load line's tail: how many stages read their weights from the cache, and the
    programs cached and generated, summed from each node's load figures (``NodeStatus.load``)."""
    loads = [st.load for st in ready if st.load is not None]
    if not any(load.weights or load.programs for load in loads):
        return ""
    cached = sum(load.weights is not None and load.weights.source == "cache" for load in loads)
    programs = [load.programs for load in loads if load.programs is not None]
    hits, misses = sum(p.hits for p in programs), sum(p.misses for p in programs)
    line = f"; weights from the cache on {cached} of {len(ready)}; programs {hits} cached, {misses} generated"
    slowest = max(ready, key=lambda st: st.load.wall_s if st.load is not None else 0.0)
    if slowest.load is not None and slowest.load.wall_s:
        line += f"; the slowest, {stage_name(slowest.stage)}, {slowest.load.parts()}"
    return line


async def _all(coros: Any) -> list[Any]:
    """Run concurrently; the first failure cancels the rest and is raised (as in a TaskGroup,
    but raising the PhaseError itself rather than an ExceptionGroup)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def reap(vast: VastClient, run_id: str | None = None) -> list[dict[str, Any]]:
    """Destroy every instance labelled by this tool (of one run, if ``run_id`` is given)."""
    out = []
    for record in await vast.list_instances(Label.prefix(run_id)):
        entry: dict[str, Any] = {
            "id": record.id,
            "label": record.label,
            "status": record.actual_status,
            "destroyed": False,
        }
        try:
            if record.id is None:
                raise VastError("GET", "/api/v1/instances/", 200, f"a record labelled {record.label} without an id")
            await vast.destroy_instance(record.id)
            entry["destroyed"] = True
        except VastError as e:
            entry["error"] = str(e)
        out.append(entry)
    return out

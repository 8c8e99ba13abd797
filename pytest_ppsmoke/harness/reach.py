"""The cluster's side of one rented instance, for the deployment's own steps: reached, joined,
loaded; and what the orchestrator measures and says of them all (SWIM timed to the round trips,
the convergence failure's detail, the load line's figures)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..messages import NodeStatus, NodeStatusQuery
from ..protocol import STATUS_ACTOR, Phase, PhaseError, stage_name
from ..runtime.codec import ActorAddress, Echo, Join, MemberStatus, SwimTiming, Sync
from ..runtime.errors import RemoteError
from ..runtime.node import Node
from ..runtime.swim import SWIM_ACTOR
from ..runtime.transport import PeerAddr
from .runconfig import RunConfig, port_advice, swim_for_rtt

if TYPE_CHECKING:
    from ..cloud.rental import RentedInstance

log = logging.getLogger(__name__)
LOAD_WAIT = 1.0  # seconds a loading node holds a status query for its next change (a block, ready, failed)

Stamp = Callable[["RentedInstance", str], None]


def _alive(seed: Node, endpoint_id: str) -> bool:
    member = seed.membership.get(endpoint_id)
    return member is not None and member.status == MemberStatus.alive


async def join(
    seed: Node, inst: RentedInstance, config: RunConfig, stamp: Stamp, instances: list[RentedInstance]
) -> None:
    """``inst``'s node reached, then alive in the orchestrator's view, within the spec's convergence
    deadline from its running (PhaseError(Phase.CONVERGE) naming it and what was last seen). Over the
    internet the orchestrator dials it (:func:`dial`); on loopback the node dials the seed's
    ticket, and is reached when the orchestrator first hears of it."""
    timeout = config.converge_timeout
    try:
        async with asyncio.timeout(timeout):
            if config.transport == "wan":
                await dial(seed, inst)
            else:
                await seed.membership.wait_until(
                    lambda: seed.membership.get(inst.endpoint_id) is not None, timeout, f"{inst.where} heard of"
                )
            stamp(inst, "reached")
            await seed.membership.wait_until(lambda: _alive(seed, inst.endpoint_id), timeout, f"{inst.where} alive")
            stamp(inst, "joined")
    except TimeoutError:
        ids = [seed.id, *(i.endpoint_id for i in instances if i.endpoint_id)]
        alive = sum(1 for i in ids if i == seed.id or _alive(seed, i))
        detail = explain(instances, config, {inst.endpoint_id})
        raise PhaseError(
            Phase.CONVERGE, f"{alive} of {len(ids)} members alive after {timeout:.0f} s; missing: {detail}"
        ) from None


async def dial(seed: Node, inst: RentedInstance) -> None:
    """The orchestrator dials a node (the internet: a node cannot dial an orchestrator behind NAT):
    at the public address and port vast.ai forwards to it, where the record shows one, else by its
    id alone (discovery and relays). It offers the node its own state (a SWIM join the other way
    round) until the node answers; the node answers, and later sends everything, on the
    connection the orchestrator made."""
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


def explain(instances: Iterable[RentedInstance], config: RunConfig, missing: set[str]) -> str:
    """What the orchestrator last saw of the members missing from a convergence, and, over the
    internet, why one may not be dialled."""
    gone = [i for i in instances if i.endpoint_id in missing]
    lines = [f"{i.name}, last seen {i.state or 'null'}" for i in gone]
    unmapped = [i for i in gone if not i.public_udp]
    if config.transport == "wan" and unmapped:
        names = ", ".join(i.name for i in unmapped)
        why = (
            f"no port was asked of vast.ai ({config.names.setting('port')} 0)"
            if not config.direct
            else f"vast.ai's record shows no ports['{config.port}/udp'] mapping"
        )
        lines.append(
            f"{names} cannot be dialled: {why}, so a node behind its host's NAT is reachable through a "
            f"relay only; {port_advice(config)}"
        )
    return "; ".join(lines)


async def time_swim(seed: Node, instances: list[RentedInstance], config: RunConfig, rounds: int = 3) -> dict[str, Any]:
    """SWIM timed to the paths: each member's round trip measured (``rounds`` echoes, the
    median), and, over a network (vast.ai, an emulated one), the orchestrator's probe timeout
    and period set from the worst one when that asks for more than it has
    (:func:`swim_for_rtt`): a relayed path across an ocean must not read as a dead member.
    Then every node is told the orchestrator's timing (:func:`tell_swim`), so that the members
    probe one another as patiently as the orchestrator probes them. Returns what was measured,
    chosen, and taken by each node."""
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

    await asyncio.gather(*(one(i) for i in instances if i.endpoint_id))
    worst = max((v for v in measured.values() if v is not None), default=0.0)
    wanted = swim_for_rtt(worst)
    source = "the run's settings"
    # on loopback a slow echo is a busy core, not a path: the shared-CPU timing stays
    over_a_network = config.transport == "wan" or config.rtt >= 0.01
    if over_a_network and worst >= 0.01 and seed.membership.retime(wanted.ping_timeout, wanted.protocol_period):
        source = "the measured round trips"
    cfg = seed.membership.config
    return {
        "rtt_ms": {k: None if v is None else round(v * 1e3, 2) for k, v in sorted(measured.items())},
        "worst_rtt_ms": round(worst * 1e3, 2),
        "ping_timeout": cfg.ping_timeout,
        "protocol_period": cfg.protocol_period,
        "suspicion_timeout": cfg.suspicion_timeout,
        "suspicion_max_mult": cfg.suspicion_max_mult,
        "set_by": source,
        "nodes": await tell_swim(seed, instances),
    }


async def tell_swim(seed: Node, instances: list[RentedInstance], attempts: int = 3) -> dict[str, dict[str, Any]]:
    """Every node told the orchestrator's probe timeout and period (``SwimTiming`` to its SWIM
    actor); each takes what asks for more than it has and answers with the timing it runs with.
    Returns, by stage name, that timing, or the ``error`` of a node that did not answer in
    ``attempts`` requests (logged; the node keeps its start-up timing, and the run goes on: a
    node that cannot answer is the load phase's to report)."""
    cfg = seed.membership.config
    ask = SwimTiming(cfg.ping_timeout, cfg.protocol_period)
    taken: dict[str, dict[str, Any]] = {}

    async def one(inst: RentedInstance) -> None:
        name = stage_name(inst.stage)
        last = ""
        for _ in range(attempts):
            try:
                reply = await seed.request(ActorAddress(inst.endpoint_id, SWIM_ACTOR), ask, timeout=5.0)
            except (TimeoutError, ConnectionError, RemoteError) as e:
                last = str(e)
                continue
            if isinstance(reply, SwimTiming):
                taken[name] = {"ping_timeout": reply.ping_timeout, "protocol_period": reply.protocol_period}
                return
            last = f"answered {type(reply).__name__}, expected SwimTiming"
        log.warning("%s on %s did not take SWIM's timing: %s", name, inst.where, last)
        taken[name] = {"error": last}

    await asyncio.gather(*(one(i) for i in instances if i.endpoint_id))
    return dict(sorted(taken.items()))


async def loaded(
    seed: Node, inst: RentedInstance, config: RunConfig, on_status: Callable[[NodeStatus], None] | None = None
) -> NodeStatus:
    """``inst``'s node says its worker is ready (``NodeStatus``), within the load deadline from its
    joining; PhaseError(Phase.LOAD) naming the stage and the instance when it failed, dropped out of
    the cluster, or was not ready in time (with what it last said). ``on_status``: told each status
    as it arrives (what the progress line shows of the load)."""
    timeout = config.load_timeout
    # the node has the same deadline for its worker, from its own start, and says why it failed
    # (the worker's stderr); a few seconds more here let that answer arrive
    deadline = time.monotonic() + timeout + 5
    last: NodeStatus | str | None = None
    what = f"{stage_name(inst.stage)} on {inst.name}"
    while True:
        member = seed.membership.get(inst.endpoint_id)
        if member is not None and member.status == MemberStatus.dead:
            raise PhaseError(Phase.LOAD, f"{what} dropped out of the cluster: the orchestrator's SWIM declared it dead")
        try:
            query = NodeStatusQuery(int(LOAD_WAIT * 1000))  # answered at the node's next change
            st = await seed.request(ActorAddress(inst.endpoint_id, STATUS_ACTOR), query, timeout=10 + LOAD_WAIT)
        except (TimeoutError, ConnectionError, RemoteError) as e:
            last = f"no answer: {e}"
            await asyncio.sleep(min(1.0, config.poll_interval))
        else:
            assert isinstance(st, NodeStatus)
            last = st
            if on_status is not None:
                on_status(st)
            if st.state == "ready":
                return st
            if st.state == "failed":
                raise PhaseError(Phase.LOAD, f"{what}: {st.detail}")
        if time.monotonic() > deadline:
            seen = f"{last.state} for {last.seconds} s" if isinstance(last, NodeStatus) else last
            raise PhaseError(Phase.LOAD, f"{what}: worker not ready within {timeout:.0f} s ({seen})")


def load_totals(ready: list[NodeStatus]) -> str:
    """The load line's tail: how many stages read their weights from the cache, and the
    programs cached and generated, summed from each node's load figures (``NodeStatus.load``)."""
    loads = [st.load for st in ready if st.load is not None]
    if not any(load.weights or load.programs for load in loads):
        return ""
    cached = sum(load.weights is not None and load.weights.source == "cache" for load in loads)
    programs = [load.programs for load in loads if load.programs is not None]
    hits, misses = sum(p.hits for p in programs), sum(p.misses for p in programs)
    compiled = sum(p.compiled for p in programs)
    line = f"; weights from the cache on {cached} of {len(ready)}; programs {hits} cached, {misses} generated"
    line += f", {compiled} compiled"
    slowest = max(ready, key=lambda st: st.load.wall_s if st.load is not None else 0.0)
    if slowest.load is not None and slowest.load.wall_s:
        line += f"; the slowest, {stage_name(slowest.stage)}, {slowest.load.parts()}"
    return line

"""vast.ai's misbehaviour, each behind its failpoint (``pytest_ppsmoke/failpoints.py``'s ``vast.*``
points): at the API's door (bursts of 429, rate limits, an orchestrator cut off), in a destroy's
outcome, in a node's environment, and the host-loss scheduler that kills, freezes or cuts off
stages' hosts mid-run."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ... import failpoints
from ...nodeenv import NodeEnv
from ...runtime.localproc import EventKind
from ...runtime.peeraddr import PeerAddr
from .. import vastdoc
from ..vastdoc import RateLimit
from .instances import Instance

log = logging.getLogger(__name__)

UNREACHABLE = "127.0.0.1:9"  # discard port: nothing answers QUIC there


class RateLimiter:
    """vast.ai's rate limits (:class:`~..vastdoc.RateLimit`), per endpoint and per identity (the key
    and the client's address). A call sooner than ``threshold`` after the last call let through
    is refused, and so is every call until ``penalty`` seconds after that refusal (refusals do not
    move it); a limit by count refuses a call past its count in any window. ``limits``: the
    ``vast.rate_limit`` failpoint's value (``documented``: :func:`~..vastdoc.rate_limits`, the
    table read from vast.ai's files at ``PP_VAST_TIME_SCALE``; ``{}``: none) or endpoint name ->
    a :class:`RateLimit` or (threshold, penalty); ``source`` keeps it as given. ``scale``: the
    documented table's time scale (default ``PP_VAST_TIME_SCALE``)."""

    def __init__(
        self,
        limits: str | Mapping[str, RateLimit | tuple[float, float]],
        clock: Callable[[], float] = time.monotonic,
        scale: float | None = None,
    ) -> None:
        self.source, self.clock = limits, clock
        table = vastdoc.rate_limits(scale) if limits == "documented" else limits
        assert not isinstance(table, str), f"unknown rate limits {limits!r}"
        self.limits = {k: v if isinstance(v, RateLimit) else RateLimit(*v) for k, v in table.items()}
        self._last: dict[tuple[str, str], float] = {}  # the last call let through
        self._through: dict[tuple[str, str], deque[float]] = {}  # a limit by count: its calls let through
        self._penalty: dict[tuple[str, str], float] = {}  # refused until then
        self.refused: dict[str, int] = {}  # by endpoint

    def refuse(self, endpoint: str, identity: str) -> str | None:
        """None to let the call through, else the 429's detail (``API requests too frequent
        endpoint threshold=4.5``)."""
        if endpoint not in self.limits:
            return None
        limit = self.limits[endpoint]
        now, key = self.clock(), (endpoint, identity)
        last = self._last.get(key)
        through = self._through.setdefault(key, deque(maxlen=max(1, limit.requests)))
        if limit.requests:
            early = len(through) >= limit.requests and now - through[0] < limit.window
        else:
            early = last is not None and now - last < limit.threshold
        if now < self._penalty.get(key, 0.0) or early:
            if now >= self._penalty.get(key, 0.0) and limit.penalty:
                self._penalty[key] = now + limit.penalty
            self.refused[endpoint] = self.refused.get(endpoint, 0) + 1
            return f"API requests too frequent endpoint threshold={limit.text}"
        self._last[key] = now
        through.append(now)
        return None


def burst(faults: failpoints.Scenario, n: int) -> bool:
    """Whether the ``n``-th call (0-based) falls in a ``vast.burst_429`` burst."""
    size, every = faults.value("vast.burst_429"), faults.value("vast.throttle_every")
    return bool(size) and n % max(every, size + 1) < size


def destroy_outcome(faults: failpoints.Scenario, inst: Instance) -> str:
    """What this destroy of ``inst`` does (counted in ``destroy_attempts``): the first
    vast.destroy_fails of its stage fail, the next vast.destroy_ignored are accepted and
    ignored, the rest are done."""
    inst.destroy_attempts += 1
    stage = inst.stage
    failing = faults.value("vast.destroy_fails").get(stage, 0) if stage is not None else 0
    ignored = faults.value("vast.destroy_ignored").get(stage, 0) if stage is not None else 0
    if inst.destroy_attempts <= failing:
        return "failed"
    if inst.destroy_attempts <= failing + ignored:
        log.info("destroy of instance %d accepted and ignored (failpoint vast.destroy_ignored)", inst.id)
        return "ignored"
    return "done"


def node_faults(faults: failpoints.Scenario, inst: Instance, node: NodeEnv) -> NodeEnv:
    """``node`` with the instance's stage's node-side failpoints, and what vast.no_join (an
    unreachable seed) and vast.stall_worker (a short worker deadline) change."""
    stage = inst.stage
    node = node.replace(failpoints=str(faults.for_stage(stage)))
    if stage in faults.value("vast.no_join"):
        try:
            seed = PeerAddr.parse(NodeEnv.read(inst.env, "seed").get("seed", ""))
            node = node.replace(seed=PeerAddr(seed.id, (UNREACHABLE,)).ticket())
        except ValueError:
            node = node.replace(seed="0" * 63)  # not even an address
    if stage in faults.value("vast.stall_worker"):
        node = node.replace(worker_ready_timeout=3.0)  # the node gives up on its stalled worker after 3 s
    return node


def loses_hosts(faults: failpoints.Scenario) -> bool:
    """Whether a run needs the :class:`HostLoss` scheduler."""
    return bool(
        faults.on("vast.kill_stage")
        or faults.value("vast.lose_host")
        or faults.value("vast.freeze_stage")
        or faults.value("vast.partition")
        or faults.on("vast.isolate_orchestrator")
        or faults.on("vast.starve_orchestrator")
    )


class Hosts(Protocol):
    """What :class:`HostLoss` needs of the emulator (``server.FakeVast`` is it)."""

    faults: failpoints.Scenario
    instances: dict[int, Instance]  # live
    network: Any  # the EmulatedNetwork, or None on loopback
    isolated_until: float  # the orchestrator's calls get no answer until then
    host_losses: list[dict[str, Any]]  # each loss as HostLoss carried it out


class Signals(Protocol):
    """What :class:`HostLoss` needs of the runtime (``runtimes.Runtime`` is one)."""

    def signal(self, inst: Instance, sig: int) -> None: ...


class HostLoss:
    """Once vast.kill_after_tokens tokens were sampled (by any node): kill vast.kill_stage's
    instance (its node crashes; vast.ai shows it ``exited``), let vast.lose_host's hosts die,
    freeze vast.freeze_stage's nodes (vast.ai still shows them ``running``), cut vast.partition's
    stages off the network and vast.isolate_orchestrator's host off every node, and block this
    process for vast.starve_orchestrator's seconds (embedded in the orchestrator: its loop too)."""

    def __init__(self, emulator: Hosts, runtime: Signals) -> None:
        self.emulator, self.runtime = emulator, runtime

    async def run(self) -> None:
        vast = self.emulator
        f = vast.faults
        after = f.value("vast.kill_after_tokens")
        targets: dict[int, str] = dict(f.value("vast.lose_host"))
        if f.on("vast.kill_stage"):
            targets.setdefault(f.value("vast.kill_stage"), "killed")
        for stage in f.value("vast.freeze_stage"):
            targets.setdefault(stage, "frozen")
        cuts: dict[int, tuple[str, float]] = dict(f.value("vast.partition"))
        isolate = f.value("vast.isolate_orchestrator")
        starve = f.value("vast.starve_orchestrator")
        hit: set[int] = set()
        while True:
            await asyncio.sleep(0.02)
            events = [e for i in vast.instances.values() if i.proc for e in i.proc.events]
            sampled = max((e.get("n", 0) for e in events if e.kind is EventKind.TOKEN), default=0)
            # after 0 tokens: once a target's own prefill has begun (in prefill, not before it)
            began = {e.get("stage") for e in events if e.kind is EventKind.PREFILL}
            if sampled < after or (after == 0 and targets and not began & set(targets)):
                continue
            if cuts or isolate:
                await self._cut(cuts, isolate, sampled)
                cuts, isolate = {}, 0.0
            if starve:  # the whole process, the orchestrator's loop with it: nothing runs meanwhile
                log.warning("after %d tokens: the orchestrator's process blocked for %g s", sampled, starve)
                time.sleep(starve)  # noqa: ASYNC251 (the point: a blocked loop)
                starve = 0.0
            if len(hit) >= len(targets):
                return
            for inst in list(vast.instances.values()):
                stage = inst.stage
                if after == 0 and stage not in began:
                    continue
                if stage in targets and stage not in hit and inst.proc is not None and inst.proc.proc is not None:
                    hit.add(stage)
                    self._lose(inst, targets[stage], sampled)

    async def _cut(self, cuts: Mapping[int, tuple[str, float]], isolate: float, sampled: int) -> None:
        """vast.partition's stages cut off from the network, vast.isolate_orchestrator's host cut off
        from every node; each healed by the network after its seconds (0: never)."""
        vast = self.emulator
        if vast.network is None:
            log.warning("vast.partition and vast.isolate_orchestrator need an emulated network; none here")
            return
        for inst in list(vast.instances.values()):
            stage = inst.stage
            if stage is not None and stage in cuts and inst.member is not None:
                direction, seconds = cuts[stage]
                log.warning("instance %d (stage %d) after %d tokens: cut off (%s)", inst.id, stage, sampled, direction)
                await vast.network.partition(inst.member, direction, seconds or None)
        if isolate:
            log.warning("after %d tokens: the orchestrator cut off for %g s", sampled, isolate)
            await vast.network.partition("host", "both", isolate)
            vast.isolated_until = time.monotonic() + isolate  # from vast.ai's API too

    def _freeze(self, inst: Instance) -> None:
        """vast.freeze_stage: the node's process group stopped while its instance runs on (a node
        starved of CPU, or hung), continued after its seconds (0: never). A destroy continues and
        ends it (``ChildProcess.stop``); a continue after that signals nothing."""
        assert inst.stage is not None
        self.runtime.signal(inst, signal.SIGSTOP)
        seconds = self.emulator.faults.value("vast.freeze_stage")[inst.stage]
        if seconds:
            proc = inst.proc

            def resume() -> None:
                if inst.proc is proc and proc is not None and proc.proc is not None and proc.proc.returncode is None:
                    log.warning("instance %d (stage %d): continued after %g s", inst.id, inst.stage, seconds)
                    self.runtime.signal(inst, signal.SIGCONT)

            asyncio.get_running_loop().call_later(seconds, resume)

    def _lose(self, inst: Instance, how: str, sampled: int) -> None:
        """``inst``'s node is killed ("killed": a crash), or its host dies: "offline" (unreachable:
        the node's process group is frozen) or "exited" (the container is gone: killed). The status
        set here stands (the boot task leaves it); a destroy kills a frozen node at once. The loss
        is recorded with its time (epoch seconds): what a failure detector's delay counts from."""
        log.warning("instance %d (stage %s) after %d tokens: %s", inst.id, inst.stage, sampled, how)
        self.emulator.host_losses.append(
            {"instance": inst.id, "stage": inst.stage, "how": how, "after_tokens": sampled, "at": round(time.time(), 3)}
        )
        if how == "killed":
            self.runtime.signal(inst, signal.SIGKILL)
            return
        if how == "frozen":
            self._freeze(inst)
            return
        inst.host_lost(how)
        self.runtime.signal(inst, signal.SIGSTOP if how == "offline" else signal.SIGKILL)

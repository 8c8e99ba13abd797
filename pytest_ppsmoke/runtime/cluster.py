"""A cluster on this machine: the seed (this process) plus one member process per stage.

    async with LocalCluster(num_stages=2) as cluster:
        entry = cluster.names["pp-entry"]

The orchestrator generates every member's secret key, so it knows every endpoint id before a
member starts and the allowlist keeps anybody else out. Members are started with the environment
a rented instance gets (a ``NodeEnv``: stage, stage count, seed, key, allowed ids), plus
``extra_env``, raw variables over it (such as the model's). ``node_module`` picks what runs:
``pytest_ppsmoke.stage.gpu_node`` (a stage with its tinygrad worker) or ``pytest_ppsmoke.runtime.member``
(a bare member that only registers the stage names).

Phases: *boot* until every node has joined, *load* until every node reports ready (its worker
loaded and its names registered), *converge* until every node's own view, and the seed's, hold
all 1 + N members alive, *resolve*
until every stage name resolves.

Teardown runs on every path (``finally``), stops members in reverse order and reports every
error, not just the first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..nodeenv import DEFAULTS, NodeEnv, process_env
from ..protocol import CONVERGE_TIMEOUT, RESOLVE_TIMEOUT, Phase, PhaseError, cluster_names, stage_name, stage_names
from .codec import ActorAddress, MembersQuery, MemberStatus, MembersView
from .localproc import ChildProcess, ClusterKeys, Event, EventKind
from .node import NODE_ACTOR, Node, NodeConfig
from .resource import Resource
from .swimconfig import SwimConfig

log = logging.getLogger(__name__)


async def converge(
    seed: Node, ids: list[str], timeout: float, explain: Callable[[set[str]], str] | None = None
) -> dict[str, list[tuple[str, str]]]:
    """Wait until the seed sees every id in ``ids`` alive, and every member's own view
    (``MembersQuery``) agrees: the spec's SWIM deadline. ``explain`` adds detail on missing ids.
    Returns each node's view as it agreed (by id: sorted (member, state) pairs)."""
    deadline = time.monotonic() + timeout
    want = set(ids)

    def alive() -> set[str]:
        return {m.id for m in seed.membership.alive() if m.status == MemberStatus.alive}

    try:
        await seed.membership.wait_until(lambda: alive() >= want, timeout, f"{len(want)} alive members")
    except TimeoutError:
        missing = want - alive()
        detail = explain(missing) if explain else ", ".join(sorted(i[:10] for i in missing))
        alive_n = len(want) - len(missing)
        raise PhaseError(
            Phase.CONVERGE, f"{alive_n} of {len(want)} members alive after {timeout:.0f} s; missing: {detail}"
        ) from None
    try:
        return await _views_agree(seed, ids, deadline)
    except TimeoutError as e:
        raise PhaseError(Phase.CONVERGE, str(e)) from None


async def _views_agree(seed: Node, ids: list[str], deadline: float) -> dict[str, list[tuple[str, str]]]:
    """Every node's own view (MembersQuery) equals the seed's: all members, all alive."""
    want = tuple(sorted((i, "alive") for i in ids))
    while True:
        views: dict[str, object] = {}
        for node_id in ids:
            if node_id == seed.id:
                continue
            try:
                reply = await seed.request(seed.address(NODE_ACTOR, node_id), MembersQuery(), timeout=5)
            except (TimeoutError, ConnectionError, RuntimeError) as e:
                views[node_id] = f"no answer: {e}"
                continue
            assert isinstance(reply, MembersView)
            views[node_id] = tuple(
                sorted((m.id, MemberStatus(m.status).name) for m in reply.members if m.status != MemberStatus.dead)
            )
        if seed.membership.view() == want and all(v == want for v in views.values()):
            return {i: list(v) for i, v in views.items() if isinstance(v, tuple)}
        if time.monotonic() > deadline:
            differing = [f"{i[:10]} sees {v}" for i, v in views.items() if v != want]
            raise TimeoutError(f"views did not agree on {len(want)} alive members: {'; '.join(differing)}")
        await asyncio.sleep(0.05)


async def resolve_names(seed: Node, num_stages: int, timeout: float) -> dict[str, ActorAddress]:
    """Resolve ``pp-entry``, ``pp-exit`` and every ``pp-stage-i``: one deadline for all (the spec's minute)."""
    deadline = time.monotonic() + timeout
    names = {}
    for name in cluster_names(num_stages):
        try:
            names[name] = await seed.resolve(name, max(0.0, deadline - time.monotonic()))
        except LookupError as e:
            raise PhaseError(Phase.RESOLVE, str(e)) from None
    return names


@dataclass
class LocalCluster(Resource):
    num_stages: int = 2
    swim: SwimConfig = field(default_factory=SwimConfig.loopback)
    node_module: str = "pytest_ppsmoke.runtime.member"
    boot_timeout: float = 60.0
    load_timeout: float = DEFAULTS.worker_ready_timeout
    converge_timeout: float = CONVERGE_TIMEOUT  # the spec's SWIM deadline
    resolve_timeout: float = RESOLVE_TIMEOUT  # the spec's name deadline
    on_phase: Callable[[str, float], None] | None = None
    extra_env: Mapping[str, str] | None = None
    # stage 0's PP_REFERENCE: its callers compute the reference in their own process, so no
    # reference worker loads beside the stages unless asked ("beside")
    reference: str = DEFAULTS.reference
    seed: Node | None = None
    members: list[ChildProcess] = field(default_factory=list)
    names: dict[str, ActorAddress] = field(default_factory=dict)
    ready: list[Event] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    keys: ClusterKeys | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.num_stages < 2:
            raise ValueError(f"num_stages must be at least 2, got {self.num_stages}")

    def _phase_done(self, phase: str, started: float) -> None:
        self.timings[phase] = round(time.monotonic() - started, 4)
        if self.on_phase is not None:
            self.on_phase(phase, self.timings[phase])

    async def start(self) -> None:
        self.keys = ClusterKeys(1 + self.num_stages)
        t = time.monotonic()
        self.seed = Node(NodeConfig(secret_key=self.keys.keys[0], allowed=frozenset(self.keys.ids), swim=self.swim))
        await self.seed.start()
        for stage in range(self.num_stages):
            node = NodeEnv(
                stage=stage,
                num_stages=self.num_stages,
                seed=self.seed.ticket(),
                node_key=self.keys.keys[1 + stage],
                allowed_ids=tuple(self.keys.ids),
                names=tuple(stage_names(stage, self.num_stages)),
                swim=self.swim.to_env(),
                worker_ready_timeout=self.load_timeout,
                reference=self.reference,
                exit_on_stdin_eof=True,  # the node goes when this process does, however it dies
            )
            env = {**process_env(node), **(self.extra_env or {})}
            proc = ChildProcess(stage_name(stage), [sys.executable, "-m", self.node_module], env)
            self.members.append(proc)
            await proc.start()
        deadline = t + self.boot_timeout  # one deadline for the phase, not one per node
        for proc in self.members:
            try:
                await proc.wait_event(
                    lambda e: e.kind in (EventKind.JOINED, EventKind.READY),
                    max(0.0, deadline - time.monotonic()),
                    "join",
                )
            except RuntimeError as e:
                raise PhaseError(Phase.BOOT, str(e)) from None
        self._phase_done("boot", t)

        t = time.monotonic()
        deadline = t + self.load_timeout
        for proc in self.members:
            try:
                ev = await proc.wait_event(
                    lambda e: e.kind in (EventKind.READY, EventKind.FAILED),
                    max(0.0, deadline - time.monotonic()),
                    "ready line",
                )
            except RuntimeError as e:
                raise PhaseError(Phase.LOAD, str(e)) from None
            if ev.kind is EventKind.FAILED:
                raise PhaseError(Phase.LOAD, f"{proc.name}: {ev.get('error')}")
            self.ready.append(ev)
        self._phase_done("load", t)

        t = time.monotonic()
        await converge(self.seed, self.keys.ids, self.converge_timeout)
        self._phase_done("converge", t)

        t = time.monotonic()
        self.names = await resolve_names(self.seed, self.num_stages, self.resolve_timeout)
        self._phase_done("resolve", t)

    async def close(self) -> None:
        """Stop every node (gracefully, in parallel), then the seed. Even if this is cancelled
        half way (a second Ctrl-C, a budget), no node process group is left running."""
        t = time.monotonic()
        errors: list[str] = []
        try:
            results = await asyncio.gather(*(proc.stop() for proc in reversed(self.members)), return_exceptions=True)
            for proc, result in zip(reversed(self.members), results, strict=True):
                if isinstance(result, BaseException):
                    errors.append(f"{proc.name}: {result}")
                elif result not in (0, None):
                    log.info("%s exited with status %s", proc.name, result)
        finally:
            for proc in self.members:
                if proc.proc is not None:
                    proc.signal(signal.SIGKILL)  # synchronous: runs even when the gather was cancelled
            if self.seed is not None:
                with contextlib.suppress(Exception):
                    await self.seed.close()
        self._phase_done("teardown", t)
        if errors:
            raise PhaseError(Phase.TEARDOWN, "; ".join(errors))

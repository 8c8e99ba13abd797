"""What a stage node runs with (``Settings``, from its environment) and its own lifetime: the
time-to-live and the orphan guard that remove a node whose run is over, destroying its own
instance on its provider (``cloud/own.py``), and the exit of a node that cannot serve."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from ..messages import WireDtype
from ..nodeenv import NodeEnv
from ..runtime.codec import MemberState, MemberStatus
from ..runtime.localproc import emit
from ..runtime.node import Node, NodeConfig
from ..runtime.transport import PeerAddr
from .pipe import worker_script

log = logging.getLogger(__name__)


def default_worker_path() -> Path:
    return worker_script()


@dataclass(frozen=True)
class Settings:
    """What the node runs with: its environment (every value and its default: ``NodeEnv``), the
    node's config made from it, and the worker script found."""

    env: NodeEnv
    config: NodeConfig = field(repr=False)
    worker: Path

    @property
    def stage(self) -> int:
        return self.env.stage

    @property
    def num_stages(self) -> int:
        return self.env.num_stages

    @property
    def wire(self) -> WireDtype:
        return WireDtype.parse(self.env.wire_dtype)

    @property
    def ready_timeout(self) -> float:
        return self.env.worker_ready_timeout

    @property
    def ttl(self) -> float:  # a hard limit on the node's life
        return self.env.ttl

    @property
    def orphan_grace(self) -> float:  # how long the node lives on once it has lost the orchestrator (the seed)
        return self.env.orphan_grace

    @classmethod
    def from_env(cls) -> Settings:
        """Everything the node reads from its environment, checked before anything starts."""
        env = NodeEnv.from_env()
        WireDtype.parse(env.wire_dtype)
        worker = Path(env.worker) if env.worker else default_worker_path()
        if not worker.is_file():
            raise ValueError(f"worker script {worker} not found; set {NodeEnv.var('worker')} to pp_tinygrad_worker.py")
        return cls(env, NodeConfig.from_nodeenv(env), worker)


def _seed(settings: Settings) -> PeerAddr | None:
    """The orchestrator (the seed) as the node was given it: an id, or a ticket with its address."""
    return PeerAddr.parse(settings.config.seed) if settings.config.seed else None


def _seen(node: Node, seed_id: str | None) -> MemberState | None:
    """The orchestrator's member in the node's view (None: not seen, or no membership before the
    node has bound its endpoint)."""
    membership = getattr(node, "membership", None)
    return membership.members.get(seed_id) if membership is not None and seed_id else None


def orchestrator_gone(node: Node, settings: Settings) -> bool:
    """Whether the orchestrator (the seed) is dead in this node's view: it left (a teardown begins
    so, before its destroys) or it died."""
    peer = _seed(settings)
    member = _seen(node, peer.id if peer is not None else None)
    return member is not None and member.status == MemberStatus.dead


async def guard_lifetime(
    node: Node, settings: Settings, stop: asyncio.Event, clock: Callable[[], float] = time.monotonic
) -> None:
    """The node's own time-to-live: it removes itself when it has lost the orchestrator for
    ``orphan_grace`` seconds, or when ``ttl`` has passed, so that no rented GPU outlives a run
    whose orchestrator died. On a provider it destroys its own instance (``cloud/own.py``: on
    vast.ai, ``NodeEnv.container_id`` and ``container_api_key``, set by vast.ai's host agent);
    anywhere it then exits.

    Where the orchestrator reaches the node (a seed given by its id alone: vast.ai, where the
    orchestrator may sit behind a NAT), the orphan clock starts at that first contact (the seed
    alive in the node's view): the orchestrator reaches the nodes only once every instance runs,
    so a node on a fast host may wait for a slower one. Until then the node waits the run's
    ``boot_window`` plus its grace, then removes itself: the orchestrator may have died during the
    boot. Where the node dials the seed itself (a ticket, with its address), nothing keeps the
    contact waiting, and the clock starts with the node."""
    peer = _seed(settings)
    seed_id = peer.id if peer is not None else None
    reached = peer is not None and not (peer.addrs or peer.relay)  # the orchestrator dials this node
    started = clock()
    # the last time the orchestrator was alive in this node's view (None: it has not reached it yet)
    seen: float | None = None if reached else started
    contact = False
    while True:
        await asyncio.sleep(min(1.0, settings.orphan_grace / 4))
        now = clock()
        member = _seen(node, seed_id)
        if member is not None and member.status in (MemberStatus.alive, MemberStatus.suspect):
            if not contact:
                emit({"event": "orchestrator", "after_s": round(now - started, 3)})
            seen, contact = now, True
        never = settings.env.boot_window + settings.orphan_grace
        if now - started > settings.ttl:
            reason = f"its time-to-live of {settings.ttl:g} s has passed"
        elif seed_id and seen is None and now - started > never:
            reason = (
                f"the orchestrator ({seed_id[:10]}) never reached it within the boot window "
                f"({settings.env.boot_window:g} s) plus its grace ({settings.orphan_grace:g} s)"
            )
        elif seed_id and seen is not None and now - seen > settings.orphan_grace:
            reason = f"it lost the orchestrator ({seed_id[:10]}) {settings.orphan_grace:g} s ago"
        else:
            continue
        log.warning("removing itself: %s", reason)
        emit({"event": "expired", "reason": reason})
        await destroy_own_instance(settings.env)
        stop.set()
        return


async def destroy_own_instance(env: NodeEnv) -> None:
    from ..cloud.own import own_instance  # the provider the node runs on, from its environment
    from ..cloud.provider import ProviderError

    own = own_instance(env)
    if own is None:
        return  # on no provider (this machine): exiting is all there is to do
    try:
        gone = await own.destroy()
        log.warning("destroyed own instance %s%s", own.id, "" if gone else " (it was already gone)")
    except (ProviderError, ValueError) as e:
        log.error("could not destroy own instance %s: %s; exiting anyway", own.id, e)


def give_up(error: BaseException, env: NodeEnv, kind: str = "") -> NoReturn:
    # a node that cannot serve does not keep a rented GPU: it destroys its own instance, whatever
    # ended it (the traceback, if any, is logged first; the exit line names the error)
    asyncio.run(destroy_own_instance(env))
    sys.exit(f"pp-gpu-node: {kind}{error}")


def container_env() -> NodeEnv:
    """Just what the node needs to destroy its own instance, when the rest of its environment is bad."""
    try:
        return NodeEnv.from_env(only=("container_id", "container_api_key", "vast_url"))
    except ValueError:
        return NodeEnv()

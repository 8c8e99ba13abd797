"""A bare cluster member: joins, registers names, reports membership events.

    env = member_env(key, allowed_ids, seed_ticket, ["pp-entry", "pp-stage-0"])   # through NodeEnv
    member_process("m1", env)       # python -m pytest_ppsmoke.runtime.member

It is what the membership tests and benchmarks run as a separate process, and a handy probe when
a cluster misbehaves. Each name in ``NodeEnv.names`` is registered for this node's ``node`` actor
(which answers Echo, MembersQuery, ResolveQuery and Register). stdout carries one JSON object per
line: ``{"event": "ready", "id": ..., "ticket": ...}`` once joined, then every membership event.
SIGTERM or SIGINT leaves the cluster cleanly.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from ..nodeenv import NodeEnv
from . import scrub
from .codec import MemberStatus
from .localproc import configure_child_logging, emit, stop_event
from .node import NODE_ACTOR, Node, NodeConfig
from .swim import MemberEvent


async def run(config: NodeConfig, names: tuple[str, ...], watch_parent: bool = False) -> None:
    stop, parent = stop_event(watch_parent)
    node = Node(config)
    await node.start(join=False)
    try:

        def report(ev: MemberEvent) -> None:
            emit(
                {
                    "event": ev.kind,
                    "member": ev.member.id,
                    "status": MemberStatus(ev.member.status).name,
                    "incarnation": ev.member.incarnation,
                    "names": ev.member.names,
                    "at": ev.at,  # time.monotonic(): one clock for every process of this machine
                }
            )

        node.membership.add_listener(report)
        started = time.monotonic()
        await node.join()
        joined_in = time.monotonic() - started
        for name in names:
            node.register(name, NODE_ACTOR)
        emit(
            {
                "event": "ready",
                "id": node.id,
                "ticket": node.ticket(),
                "pid": os.getpid(),
                "joined_in_s": joined_in,
                "at": time.monotonic(),
            }
        )
        await stop.wait()
    finally:
        if parent is not None:
            parent.cancel()
        await node.close()


def main() -> None:
    scrub.install(scrub.secrets_in_env())  # its key out of everything it writes
    try:
        env = NodeEnv.from_env()
        config = NodeConfig.from_nodeenv(env)
    except ValueError as e:
        sys.exit(f"pytest_ppsmoke.runtime.member: {e}")
    configure_child_logging("member", env.log_level)
    try:
        asyncio.run(run(config, env.names, env.exit_on_stdin_eof))
    except TimeoutError as e:
        sys.exit(f"pytest_ppsmoke.runtime.member: {e}")


if __name__ == "__main__":
    main()

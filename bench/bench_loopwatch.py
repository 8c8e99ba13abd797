"""The loop watch (``runtime/stalls.py``): what it costs, and how closely it measures a pause.

    python bench/bench_loopwatch.py [--seconds 5] [--pauses 0.25,0.5,1,2] [--out FILE]

``cost``: the CPU time of an idle event loop over ``seconds``, with and without the watch (its
20 wake-ups a second), in ms of CPU per second. ``pauses``: a real ``pp-gpu-node`` (its worker
held by the ``node.stall_worker`` failpoint, so nothing loads), joined to a seed in this process,
stopped with SIGSTOP for each pause and continued; the node's ``LogTail`` then gives the stall its
watch measured: ``measured_s`` and its excess over the pause (``over_s``; at least minus one tick,
more on a loaded machine).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path
from typing import Any

from benchio import emit  # bench/ is this script's directory: first on sys.path

from pytest_ppsmoke.messages import LogTail, LogTailQuery
from pytest_ppsmoke.nodeenv import NodeEnv, process_env
from pytest_ppsmoke.protocol import STATUS_ACTOR, stage_name
from pytest_ppsmoke.runtime.codec import ActorAddress
from pytest_ppsmoke.runtime.localproc import ChildProcess, ClusterKeys, EventKind
from pytest_ppsmoke.runtime.node import Node, NodeConfig
from pytest_ppsmoke.runtime.stalls import TICK, LoopWatch
from pytest_ppsmoke.runtime.swimconfig import SwimConfig


async def idle_cpu(seconds: float, watched: bool) -> float:
    """ms of CPU per second of an idle loop, with or without the watch."""
    watch = LoopWatch()
    if watched:
        watch.start()
    cpu = time.process_time()
    await asyncio.sleep(seconds)
    used = time.process_time() - cpu
    await watch.close()
    return round(1000 * used / seconds, 3)


async def pauses(values: list[float]) -> list[dict[str, Any]]:
    swim = SwimConfig.shared_cpu()
    keys = ClusterKeys(2)
    seed = Node(NodeConfig(secret_key=keys.keys[0], allowed=frozenset(keys.ids), swim=swim))
    proc: ChildProcess | None = None
    rows = []
    try:
        await seed.start()
        env = NodeEnv(
            num_stages=2,
            seed=seed.ticket(),
            node_key=keys.keys[1],
            allowed_ids=tuple(keys.ids),
            swim=swim.to_env(),
            exit_on_stdin_eof=True,
            failpoints="node.stall_worker",
        )
        proc = ChildProcess(stage_name(0), [sys.executable, "-m", "pytest_ppsmoke.stage.gpu_node"], process_env(env))
        await proc.start()
        await proc.wait_event(lambda e: e.kind is EventKind.JOINED, 60, "join")
        status = ActorAddress(keys.ids[1], STATUS_ACTOR)
        for pause in values:
            await asyncio.sleep(1.0)  # the node's loop settles between pauses
            proc.signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(pause)
            finally:
                proc.signal(signal.SIGCONT)
            tail = await seed.request(status, LogTailQuery(10, 4096), timeout=30)
            assert isinstance(tail, LogTail), tail
            newest = max(tail.stalls, key=lambda s: s.at)
            rows.append({"pause_s": pause, "measured_s": newest.seconds, "over_s": round(newest.seconds - pause, 3)})
    finally:
        if proc is not None:
            await proc.stop()
        await seed.close()
    return rows


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--pauses", default="0.25,0.5,1,2")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cost = {
        "idle_ms_per_s": await idle_cpu(args.seconds, False),
        "watched_ms_per_s": await idle_cpu(args.seconds, True),
    }
    rows = await pauses([float(p) for p in args.pauses.split(",")])
    emit({"tick_s": TICK, "cost": cost, "pauses": rows}, args.out)


if __name__ == "__main__":
    asyncio.run(main())

"""Child processes: long output lines, deadlines that carry stderr, teardown that leaves nothing."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from pytest_ppsmoke.runtime.localproc import ChildError, ChildProcess, EventKind

from .helpers import alive

pytestmark = pytest.mark.local


async def test_a_long_output_line_neither_kills_the_reader_nor_blocks_the_child() -> None:
    script = "import sys, time; print('x' * 20_000_000); print('{\"event\": \"ready\"}', flush=True); time.sleep(60)"
    child = ChildProcess("chatty", [sys.executable, "-c", script], os.environ)
    await child.start()
    try:
        assert (await child.wait_event(lambda e: e.kind is EventKind.READY, 30, "ready")).kind is EventKind.READY
    finally:
        assert await child.stop() == -15


async def test_a_missed_deadline_says_what_the_child_printed_last() -> None:
    child = ChildProcess(
        "mute",
        [
            sys.executable,
            "-c",
            "import sys, time; sys.stderr.write('loading weights\\n'); sys.stderr.flush(); time.sleep(60)",
        ],
        os.environ,
    )
    await child.start()
    try:
        with pytest.raises(ChildError, match=r"mute: no ready line within 0.5 s; stderr:\nloading weights"):
            await child.wait_event(lambda e: e.kind is EventKind.READY, 0.5, "ready line")
    finally:
        await child.stop()


async def test_a_cancelled_stop_still_kills_the_whole_group() -> None:
    # the child ignores SIGTERM and starts a grandchild in its group
    script = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        'print(\'{"event": "ready", "grandchild": %d}\' % p.pid, flush=True); time.sleep(60)'
    )
    child = ChildProcess("stubborn", [sys.executable, "-c", script], os.environ)
    await child.start()
    ready = await child.wait_event(lambda e: e.kind is EventKind.READY, 30, "ready")
    stopping = asyncio.ensure_future(child.stop(grace=30))
    await asyncio.sleep(0.3)
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    pids = (child.pid, ready["grandchild"])
    async with asyncio.timeout(10):  # the group's kill, seen by polling (a loaded machine reaps late)
        while any(alive(pid) for pid in pids):
            await asyncio.sleep(0.05)


async def test_a_stopped_child_is_gone_with_its_whole_group_when_stop_returns() -> None:
    """A node whose worker outlives it for a moment (it exits on SIGTERM and leaves its own
    child): when stop returns, no process of the group is left, not even one on its way out."""
    script = (
        "import subprocess, sys, time; d = subprocess.DEVNULL;"  # the worker: pipes of its own
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], stdout=d, stderr=d);"
        'print(\'{"event": "ready", "grandchild": %d}\' % p.pid, flush=True); time.sleep(60)'
    )
    child = ChildProcess("leaver", [sys.executable, "-c", script], os.environ)
    await child.start()
    ready = await child.wait_event(lambda e: e.kind is EventKind.READY, 30, "ready")
    await child.stop(grace=10)
    with pytest.raises(ProcessLookupError):
        os.killpg(child.pid, 0)  # the group: no member left, zombies included
    assert not alive(ready["grandchild"])

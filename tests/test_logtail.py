"""A node's own account (``LogTail``): the ring of its log lines (``runtime/logring.py``), bounded
by lines and bytes, the newest kept, every secret redacted before a line is stored; the status
actor's answer (``stage/account.py``); and a real ``pp-gpu-node`` paused by SIGSTOP, whose answer
then carries the stall it measured."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from pytest_ppsmoke import failpoints, redact
from pytest_ppsmoke.messages import LogTail, LogTailQuery, NodeStatusQuery, Stall
from pytest_ppsmoke.nodeenv import NodeEnv, process_env
from pytest_ppsmoke.protocol import STATUS_ACTOR, stage_name
from pytest_ppsmoke.runtime import codec
from pytest_ppsmoke.runtime.codec import ActorAddress, Envelope
from pytest_ppsmoke.runtime.localproc import ChildProcess, ClusterKeys, EventKind
from pytest_ppsmoke.runtime.logring import LogRing
from pytest_ppsmoke.runtime.node import Node, NodeConfig
from pytest_ppsmoke.runtime.stalls import TICK, LoopStall, LoopWatch
from pytest_ppsmoke.runtime.swimconfig import SwimConfig
from pytest_ppsmoke.stage.account import StatusActor

pytestmark = pytest.mark.local

NODE_KEY = bytes(range(7, 39))
API_KEY = "ck_live_" + "Q7" * 12


@pytest.fixture
def ring() -> Iterator[LogRing]:
    """A ring on a logger of its own, with the node's secrets and format."""
    ring = LogRing(NodeEnv(node_key=NODE_KEY, container_api_key=API_KEY).secrets(), keep=10, line_chars=300)
    ring.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("tests.logtail")
    logger.addHandler(ring)
    logger.propagate, logger.level = False, logging.INFO
    yield ring
    logger.removeHandler(ring)


def test_the_ring_keeps_the_newest_lines_and_counts_the_rest(ring: LogRing) -> None:
    logger = logging.getLogger("tests.logtail")
    for i in range(25):
        logger.info("line %d", i)
    lines, dropped = ring.tail(100, 1 << 20)
    assert lines == [f"INFO line {i}" for i in range(15, 25)] and dropped == 15  # kept 10 of 25
    lines, dropped = ring.tail(3, 1 << 20)
    assert lines == ["INFO line 22", "INFO line 23", "INFO line 24"] and dropped == 22
    assert ring.tail(0, 1 << 20) == ([], 25)


def test_the_tail_fits_its_bytes_newest_first_and_cuts_only_a_newest_line_too_long(ring: LogRing) -> None:
    for text in ("a" * 10, "b" * 10, "c" * 10, "dé" * 5):  # é: two bytes in UTF-8
        ring.add(text)
    # each line's UTF-8 bytes and its newline: 11, 11, 11, 16
    assert ring.tail(10, 16 + 11 + 11) == (["b" * 10, "c" * 10, "dé" * 5], 1)
    assert ring.tail(10, 16 + 11 + 10) == (["c" * 10, "dé" * 5], 2)
    assert ring.tail(10, 16) == (["dé" * 5], 3)
    assert ring.tail(10, 6) == (["déd"], 3)  # 5 bytes and the newline: whole characters only


def test_a_record_of_several_lines_is_kept_as_its_lines_and_a_long_line_is_cut(ring: LogRing) -> None:
    logger = logging.getLogger("tests.logtail")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("it failed")
    lines, _ = ring.tail(100, 1 << 20)
    assert lines[0] == "ERROR it failed" and lines[1] == "Traceback (most recent call last):"
    assert lines[-1] == "RuntimeError: boom"
    ring.add("x" * 1000)
    assert ring.tail(1, 1 << 20)[0] == ["x" * 300 + "... (700 more characters)"]


def test_no_form_of_a_secret_reaches_the_ring(ring: LogRing) -> None:
    """The node key (bytes) and the API key (text), written as they are, in hex of both cases, in
    base64 of both alphabets at every offset, inside JSON, and across the point where a long line
    is cut: none of their forms is stored, every one is marked."""
    logger = logging.getLogger("tests.logtail")
    blob = json.dumps({"key": NODE_KEY.hex(), "api": API_KEY})
    written = [
        f"key {NODE_KEY.hex()} and {NODE_KEY.hex().upper()}",
        f"api key {API_KEY}",
        *(f"b64 {base64.b64encode(b'x' * k + NODE_KEY).decode()}" for k in range(3)),
        *(f"url {base64.urlsafe_b64encode(b'yz'[:k] + API_KEY.encode()).decode()}" for k in range(3)),
        f"config {base64.b64encode(blob.encode()).decode()}",
        "." * 290 + NODE_KEY.hex(),  # the cut at 300 falls inside the key
    ]
    for text in written:
        logger.warning("%s", text)
    lines, _ = ring.tail(100, 1 << 20)
    assert len(lines) == len(written)
    forms = redact.forms(NODE_KEY) | redact.forms(API_KEY) | {NODE_KEY.hex()[:10], NODE_KEY.hex()[:10].upper()}
    leaks = [(f, line) for line in lines for f in forms if f in line]
    assert not leaks, leaks
    assert all(redact.REDACTED in line for line in lines[:-2]), lines
    assert lines[-1].startswith("WARNING " + "." * 290) and redact.REDACTED[:2] in lines[-1]


def test_the_ring_has_the_format_of_the_childs_stderr() -> None:
    """``configure_child_logging``'s extra handlers get the records in stderr's format: the same
    line in both (in a child of its own: logging's configuration is the process's)."""
    code = (
        "import logging, sys\n"
        "from pytest_ppsmoke.runtime.localproc import configure_child_logging\n"
        "from pytest_ppsmoke.runtime.logring import LogRing\n"
        "ring = LogRing()\n"
        "configure_child_logging('pp-gpu-node', 'INFO', ring)\n"
        "logging.getLogger('pytest_ppsmoke.x').info('hello %d', 7)\n"
        "logging.getLogger('pytest_ppsmoke.x').debug('not at INFO')\n"
        "print(ring.tail(10, 10000)[0])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    stderr = done.stderr.splitlines()
    assert len(stderr) == 1 and stderr[0].endswith(" pp-gpu-node pytest_ppsmoke.x INFO hello 7"), stderr
    assert done.stdout.strip() == repr([stderr[0]])


def test_the_status_actor_answers_with_the_tail_the_uptime_and_the_stalls(ring: LogRing) -> None:
    for i in range(12):
        ring.add(f"line {i}")
    now = [50.0]
    watch = LoopWatch(clock=lambda: now[0])
    watch.found(LoopStall(1.5, 4.2))
    watch.found(LoopStall(0.25, 0.3))
    now[0] = 57.25
    answer = StatusActor(1, ring, watch).on_log_tail_query(LogTailQuery(4, 1000), None)  # type: ignore[arg-type]
    assert answer == LogTail(
        1, ("line 8", "line 9", "line 10", "line 11"), 8, 7.25, (Stall(0.25, 0.3), Stall(1.5, 4.2))
    )
    frame = codec.encode_frame(Envelope("status", "x", 1, True), answer)  # it travels as it is
    assert codec.decode_frame(frame)[1] == answer


async def test_a_status_query_that_waits_is_answered_at_the_loads_next_change(ring: LogRing) -> None:
    """``NodeStatusQuery(wait_ms)`` while the worker loads: held until the next change (a block
    said, the worker ready), not to its end: the orchestrator hears a stage ready as it is, not
    at its next poll. A node no longer loading, or a query that does not wait, answers at once."""
    status = StatusActor(1, ring, LoopWatch())
    ask = asyncio.ensure_future(status.on_node_status_query(NodeStatusQuery(60_000), None))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    assert not ask.done()  # nothing changed: it waits
    status.load_said("blocks", 3, 8)
    said = await asyncio.wait_for(ask, 30)
    assert (said.state, said.blocks_loaded, said.blocks) == ("loading", 3, 8)
    now = await asyncio.wait_for(status.on_node_status_query(NodeStatusQuery(), None), 30)  # type: ignore[arg-type]
    assert now.state == "loading"
    ask = asyncio.ensure_future(status.on_node_status_query(NodeStatusQuery(60_000), None))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    status.set("ready")
    assert (await asyncio.wait_for(ask, 30)).state == "ready"
    ready = await asyncio.wait_for(status.on_node_status_query(NodeStatusQuery(60_000), None), 30)  # type: ignore[arg-type]
    assert ready.state == "ready"  # not loading: at once
    frame = codec.encode_frame(Envelope("status", "x", 1, False), NodeStatusQuery(1000))  # it travels as it is
    assert codec.decode_frame(frame)[1] == NodeStatusQuery(1000)


# --- a real node, paused ---------------------------------------------------------------------------

PAUSE = 1.0  # seconds the node is stopped; the stall it measures is at least this less one tick


async def logged(seed: Node, status: ActorAddress, words: str, within: float = 30.0) -> list[str]:
    """The node's lines that hold ``words``, asked until there is one: the query may be answered
    after a stall before the watch wakes up to log it."""
    deadline = time.monotonic() + within
    while True:
        tail = await seed.request(status, LogTailQuery(200, 1 << 16), timeout=within)
        assert isinstance(tail, LogTail), tail
        found = [line for line in tail.lines if words in line]
        if found:
            return found
        assert time.monotonic() < deadline, f"no line with {words!r} in the node's tail within {within} s: {tail.lines}"
        await asyncio.sleep(0.1)


async def test_a_paused_node_tells_the_stall_it_measured() -> None:
    """A ``pp-gpu-node`` (its worker stalled by its failpoint: the status actor answers from the
    join, and nothing loads) is stopped with SIGSTOP and continued: its own account then holds a
    stall at least as long as the pause, less one tick of its watch (load only lengthens it), the
    line that logged it, exactly as its stderr has it, and no form of its key. Only lower bounds:
    a loaded machine makes the stall longer, never shorter."""
    swim = SwimConfig.shared_cpu()
    keys = ClusterKeys(2)
    seed = Node(NodeConfig(secret_key=keys.keys[0], allowed=frozenset(keys.ids), swim=swim))
    node_env = NodeEnv(
        stage=0,
        num_stages=2,
        seed="",
        node_key=keys.keys[1],
        allowed_ids=tuple(keys.ids),
        swim=swim.to_env(),
        exit_on_stdin_eof=True,
        log_level="INFO",
        failpoints="node.stall_worker",
    )
    proc: ChildProcess | None = None
    try:
        await seed.start()
        env = process_env(node_env.replace(seed=seed.ticket()))
        assert env[failpoints.ENV] == "node.stall_worker"
        proc = ChildProcess(stage_name(0), [sys.executable, "-m", "pytest_ppsmoke.stage.gpu_node"], env)
        await proc.start()
        await proc.wait_event(lambda e: e.kind is EventKind.JOINED, 60, "join")
        status = ActorAddress(keys.ids[1], STATUS_ACTOR)
        before = await seed.request(status, LogTailQuery(200, 1 << 16), timeout=30)
        assert isinstance(before, LogTail) and before.stage == 0
        # its worker's stderr is in its own account, logged by the node (the stand-in's one line)
        await logged(seed, status, "pp-stage-0 worker: node.stall_worker: this worker never reports ready")
        proc.signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(PAUSE)
        finally:
            proc.signal(signal.SIGCONT)
        after = await seed.request(status, LogTailQuery(200, 1 << 16), timeout=30)
        assert isinstance(after, LogTail), after
        assert after.stalls, f"no stall in the node's account: {after}"
        longest = max(s.seconds for s in after.stalls)
        assert longest >= PAUSE - TICK - 0.01, after.stalls
        assert after.uptime >= PAUSE
        said = await logged(seed, status, "the event loop stalled for")
        deadline = time.monotonic() + 30  # the line is on stderr as it is in the ring, once read here
        while not set(said) <= set(proc.stderr_tail().splitlines()):
            assert time.monotonic() < deadline, (said, proc.stderr_tail())
            await asyncio.sleep(0.05)
        text = "\n".join(after.lines)
        assert not [f for f in redact.forms(keys.keys[1]) if f.lower() in text.lower()]
    finally:
        if proc is not None:
            await proc.stop()
        await seed.close()

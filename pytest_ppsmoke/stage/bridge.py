"""The process bridge: a node talks to its tinygrad worker over stdin/stdout JSON lines.

    bridge = WorkerBridge([sys.executable, worker_path], env, name=stage_name(1))
    ready = await bridge.start(ready_timeout=300)        # pipe.Ready
    sampled = await bridge.call(ForwardAndSample(raw, position=0, seq_len=11), timeout=60)

Requests and replies are the records of ``pipe.py`` (each request names its reply's record), matched
by ``request_id``; every wait has a deadline. A progress line (``pipe.encode_progress``: the
reference's tokens as they come) answers no call: it goes to ``on_progress``. If the worker dies,
every pending call fails at once with :class:`WorkerDied`, which carries the exit status and the
tail of the worker's stderr. Each line of the worker's stderr is also logged by the node at WARNING
(``<name> worker: <line>``, within a budget of lines, ``runtime.logbudget``; the worker writes there
only what went wrong: its errors, a traceback, tinygrad's warnings), so that it is in the node's own
log at its default level: its stderr, which is what vast.ai's logs endpoint serves, and the tail a
node tells when asked.

Hidden states pass as raw bytes in the wire dtype (a record's ``hidden``). On the pipe they travel
in the worker's payload framing (a JSON line with ``"payload": N``, then N raw bytes) when its ready
line offers it, else as ``hidden_b64`` (``framing=Framing.json`` asks for that too); either way the
worker's digests are of the same raw bytes. The worker's stdout is parsed where it arrives (the
pipe protocol's callback resolves the call's future: no reader task in between), and one request
is one write: calls need no lock, and a drain only when the pipe is full.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import signal
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ..runtime.logbudget import LogBudget
from .pipe import (
    MAX_PAYLOAD,
    ErrorReply,
    Framing,
    PipeError,
    Ready,
    Request,
    Shutdown,
    Unframeable,
    decode_ready,
    decode_reply,
    encode_request,
    is_ready,
    payload_size,
    progress_of,
    reply_id,
    worker_seconds,
)

log = logging.getLogger(__name__)
# worker stderr lines the node logs: a traceback's worth at once, then two a second
STDERR_BURST, STDERR_EVERY = 100, 0.5

R = TypeVar("R")
_LINE_LIMIT = MAX_PAYLOAD  # a prefill's hidden state in base64 is one line


def stderr_text(tail: str) -> str:
    """The worker's stderr tail for a message, in one line (a failure is one line): its last line
    (a traceback's exception, the worker's own error) and how many there were; the node logged
    each of them, so its log tail has the rest."""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    if not lines:
        return "its stderr is empty"
    more = f" (the last of {len(lines)} lines; the node's log has them)" if len(lines) > 1 else ""
    return f"its stderr ends: {lines[-1][:500]}{more}"


class WorkerDied(RuntimeError):
    def __init__(self, name: str, status: int | None, stderr_tail: str) -> None:
        killed = status is not None and status < 0
        how = f"was killed by signal {-(status or 0)}" if killed else f"exited with status {status}"
        super().__init__(f"{name} worker {how}; {stderr_text(stderr_tail)}")
        self.status = status
        self.stderr_tail = stderr_tail


class WorkerError(RuntimeError):
    """The worker answered a request with an error."""


class _Protocol(asyncio.subprocess.SubprocessStreamProtocol):
    """asyncio's subprocess protocol (stdin a StreamWriter, stderr a StreamReader), with the
    worker's stdout handed to the bridge as it arrives."""

    def __init__(self, bridge: WorkerBridge, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=_LINE_LIMIT, loop=loop)
        self.bridge = bridge
        self.stdout_closed = loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        if fd == 1:
            self.bridge._received(data if isinstance(data, bytes) else data.encode())
        else:
            super().pipe_data_received(fd, data)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        super().pipe_connection_lost(fd, exc)
        if fd == 1 and not self.stdout_closed.done():
            self.stdout_closed.set_result(None)


class WorkerBridge:
    def __init__(self, argv: list[str], env: Mapping[str, str], name: str, framing: Framing | None = None) -> None:
        """``framing``: of the hidden states; None: the best the worker offers."""
        if framing is not None and not isinstance(framing, Framing):
            raise ValueError(f"framing must be a Framing (json, payload) or None (the best offered), got {framing!r}")
        self.argv, self.env, self.name, self.asked = argv, dict(env), name, framing
        self.framing = Framing.json  # until the worker's ready line says what it offers
        self.proc: asyncio.subprocess.Process | None = None
        self.ready: Ready | None = None
        self.on_death: Callable[[WorkerDied], None] | None = None
        # the worker's progress lines while a call runs: what it counts, done, of total
        self.on_progress: Callable[[str, int, int], None] | None = None
        # each line of the worker's stderr, redacted before it is kept or logged (the node's keys)
        self.redact: Callable[[str], str] = str
        self._ids = itertools.count(1)
        # each call's future (its reply and the worker's seconds) and the request it answers
        self._pending: dict[int, tuple[asyncio.Future[tuple[Any, float | None]], Request[Any]]] = {}
        self._ready_fut: asyncio.Future[Ready] | None = None
        self._stderr: deque[str] = deque(maxlen=30)
        self._tasks: list[asyncio.Task[None]] = []
        self._buf = bytearray()  # stdout not yet parsed
        self._scanned = 0  # how much of _buf holds no newline
        self._header: tuple[dict[str, Any], int] | None = None  # a reply line whose payload is due
        self._broken = False
        self.died: WorkerDied | None = None
        self._closing = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def start(self, ready_timeout: float) -> Ready:
        loop = asyncio.get_running_loop()
        self._ready_fut = loop.create_future()
        transport, protocol = await loop.subprocess_exec(
            lambda: _Protocol(self, loop),
            *self.argv,
            env=self.env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            # the worker stays in the node's process group, so whoever kills the node's group
            # kills it too; and it reads EOF on stdin (and exits) if the node dies some other way
        )
        self.proc = asyncio.subprocess.Process(transport, protocol, loop)
        self._tasks = [asyncio.ensure_future(self._watch(protocol)), asyncio.ensure_future(self._read_stderr())]
        try:
            self.ready = await asyncio.wait_for(asyncio.shield(self._ready_fut), ready_timeout)
        except TimeoutError:
            raise TimeoutError(
                f"{self.name} worker did not report ready within {ready_timeout:.0f} s; "
                f"{stderr_text(self.stderr_tail())}"
            ) from None
        offered = self.ready.framing
        if self.asked is None:
            self.framing = Framing.payload if Framing.payload in offered else Framing.json
        elif self.asked in offered or self.asked is Framing.json:
            self.framing = self.asked
        else:
            await self.close()
            names = [f.value for f in offered]
            raise ValueError(f"{self.name} worker offers framing {names}, not {self.asked.value!r}")
        return self.ready

    def stderr_tail(self) -> str:
        return "\n".join(self._stderr)

    async def call(self, request: Request[R], timeout: float) -> R:
        """One request, answered with its reply's record. Raises WorkerError (an error reply, or
        one that is not the record), WorkerDied, or TimeoutError."""
        reply, _ = await self.timed_call(request, timeout)
        return reply

    async def timed_call(self, request: Request[R], timeout: float) -> tuple[R, float | None]:
        """``call``, with the seconds the worker says it spent on the request."""
        if self.died is not None:
            raise self.died
        assert self.proc is not None and self.proc.stdin is not None
        rid = next(self._ids)
        data = encode_request(rid, request, self.framing)
        fut: asyncio.Future[tuple[Any, float | None]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = (fut, request)
        stdin = self.proc.stdin
        try:
            async with asyncio.timeout(timeout):  # the write and the answer: one deadline
                stdin.write(data)  # whole: no other call's bytes can come between
                if stdin.transport.get_write_buffer_size() or stdin.transport.is_closing():
                    await stdin.drain()  # the pipe is full (a large prefill), or the worker is gone
                reply, worker_s = await fut
        except TimeoutError:
            raise TimeoutError(f"{self.name} worker did not answer {request.op} within {timeout:.3g} s") from None
        except (BrokenPipeError, ConnectionResetError):
            await asyncio.sleep(0.1)  # let the watcher see the exit status
            raise self.died or WorkerDied(self.name, self.proc.returncode, self.stderr_tail()) from None
        finally:
            self._pending.pop(rid, None)
        if isinstance(reply, ErrorReply):
            raise WorkerError(f"{self.name} worker: {reply.error}")
        return reply, worker_s

    # --- the worker's stdout, parsed as it arrives --------------------------------------------

    def _received(self, data: bytes) -> None:
        """Bytes from the worker's stdout: complete replies (a line, and the payload it
        announces) resolve their calls here and now."""
        if self._broken:
            return
        buf = self._buf
        buf += data
        while True:
            if self._header is not None:
                head, n = self._header
                if len(buf) < n:
                    return
                payload = bytes(buf[:n])
                del buf[:n]
                self._header = None
                self._deliver(head, payload)
                continue
            end = buf.find(b"\n", self._scanned)
            if end < 0:
                self._scanned = len(buf)
                if len(buf) > _LINE_LIMIT:
                    self._break(f"a reply line exceeded {_LINE_LIMIT} bytes")
                return
            line = bytes(buf[: end + 1])
            del buf[: end + 1]
            self._scanned = 0
            try:
                msg: Any = json.loads(line)
            except (ValueError, RecursionError):
                msg = None
            if not isinstance(msg, dict):
                if line.strip():
                    self._stderr.append("stdout: " + line.decode(errors="replace")[:200].rstrip())
                continue
            try:
                size = payload_size(msg)
            except Unframeable as e:
                self._break(f"a reply that cannot be framed: {e}")
                return
            if size is not None:
                self._header = (msg, size)
                continue
            self._deliver(msg, None)

    def _deliver(self, msg: dict[str, Any], payload: bytes | None) -> None:
        """A reply line (and its payload) to the call that waits for it, as its record; a
        progress line to ``on_progress``."""
        if (counted := progress_of(msg)) is not None:
            if self.on_progress is not None:
                self.on_progress(*counted)
            return
        if self._ready_fut is not None and not self._ready_fut.done():
            if is_ready(msg):
                try:
                    self._ready_fut.set_result(decode_ready(msg))
                except PipeError as e:
                    self._ready_fut.set_exception(WorkerError(f"{self.name} worker's ready line: {e}"))
            return
        rid = reply_id(msg)
        call = self._pending.get(rid) if rid is not None else None
        if call is None or call[0].done():
            if "error" in msg:
                log.warning("%s worker: %s", self.name, str(msg["error"])[:400])
            return
        fut, request = call
        try:
            fut.set_result((decode_reply(request.reply, msg, payload), worker_seconds(msg)))
        except PipeError as e:
            fut.set_exception(WorkerError(f"{self.name} worker answered {request.op} with a malformed reply: {e}"))

    def _break(self, why: str) -> None:
        """The worker's stdout cannot be framed any more: stop the worker (its calls then fail
        with WorkerDied, whose stderr tail says why)."""
        self._broken = True
        self._buf.clear()
        self._stderr.append(f"bridge: {why}; killing the worker")
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    async def _watch(self, protocol: _Protocol) -> None:
        """Once stdout has closed and the worker has exited: fail every call still waiting."""
        assert self.proc is not None
        await protocol.stdout_closed
        status = await self.proc.wait()
        await asyncio.sleep(0.05)  # the last stderr lines
        self.died = WorkerDied(self.name, status, self.stderr_tail())
        for fut in [*(f for f, _ in self._pending.values()), self._ready_fut]:
            if fut is not None and not fut.done():
                fut.set_exception(self.died)
                fut.exception()
        if not self._closing:
            log.error("%s", self.died)
            if self.on_death is not None:
                self.on_death(self.died)

    async def _read_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        budget = LogBudget(STDERR_BURST, STDERR_EVERY)
        async for line in self.proc.stderr:
            text = self.redact(line.decode(errors="replace").rstrip())
            self._stderr.append(text)
            if (held := budget.take()) is not None:
                more = f" ({held} lines of its stderr not logged before this one)" if held else ""
                log.warning("%s worker: %s%s", self.name, text[:2000], more)
        if budget.held:
            log.warning("%s worker: its stderr ended; its last %d lines were not logged", self.name, budget.held)

    async def close(self, timeout: float = 5.0) -> int | None:
        """Ask the worker to shut down; kill it if it does not within ``timeout``. One that has
        not reported ready yet is killed at once: it reads no request until it has loaded."""
        if self.proc is None:
            return None
        self._closing = True
        if self.proc.returncode is None and self.ready is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)
            await self.proc.wait()
        if self.proc.returncode is None:
            with contextlib.suppress(Exception):
                await self.call(Shutdown(), timeout=timeout)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGKILL)
                await self.proc.wait()
        if len(self._tasks) > 1:  # the worker's last stderr lines, logged, up to the pipe's end
            with contextlib.suppress(TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(self._tasks[1]), timeout)
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        return self.proc.returncode

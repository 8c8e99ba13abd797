"""The process bridge: a node talks to its tinygrad worker over stdin/stdout JSON lines.

    bridge = WorkerBridge([sys.executable, worker_path], env, name="pp-stage-1")
    ready = await bridge.start(ready_timeout=300)
    reply = await bridge.call("forward_and_sample", timeout=60, hidden=raw, position=0, seq_len=11)

Requests and replies are matched by ``request_id``; every wait has a deadline. If the worker
dies, every pending call fails at once with :class:`WorkerDied`, which carries the exit status and
the tail of the worker's stderr.

Hidden states pass as raw bytes in the wire dtype: ``call(..., hidden=raw)`` sends them, and a
reply that has one carries them as ``reply["hidden"]``. On the pipe they travel in the worker's
payload framing (a JSON line with ``"payload": N``, then N raw bytes) when its ready line offers
it (``"framing": [..., "payload"]``), else as ``hidden_b64`` (``framing="json"`` asks for that
too); either way the worker's digests are of the same raw bytes. The worker's stdout is parsed
where it arrives (the pipe protocol's callback resolves the call's future: no reader task in
between), and one request is one write: calls need no lock, and a drain only when the pipe is
full.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import itertools
import json
import logging
import signal
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)

_LINE_LIMIT = 256 << 20  # a prefill's hidden state in base64 is one line; also the largest payload
FRAMINGS = ("json", "payload")  # of the hidden states on the pipe: the worker offers these, the bridge takes one


def stderr_text(tail: str) -> str:
    """The worker's stderr tail for a message: on lines of its own, or one line saying it is empty
    (so that the failure stays one line)."""
    return f"stderr tail:\n{tail}" if tail.strip() else "its stderr is empty"


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
    def __init__(self, argv: list[str], env: Mapping[str, str], name: str, framing: str | None = None) -> None:
        """``framing``: "json" or "payload" for the hidden states; None: the best the worker offers."""
        if framing not in (None, *FRAMINGS):
            raise ValueError(f"framing must be json, payload or None (the best offered), got {framing!r}")
        self.argv, self.env, self.name, self.asked = argv, dict(env), name, framing
        self.framing = "json"  # until the worker's ready line says what it offers
        self.proc: asyncio.subprocess.Process | None = None
        self.ready: dict[str, Any] | None = None
        self.on_death: Callable[[WorkerDied], None] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ready_fut: asyncio.Future[dict[str, Any]] | None = None
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

    async def start(self, ready_timeout: float) -> dict[str, Any]:
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
        offered = self.ready.get("framing")
        offered = offered if isinstance(offered, list) else ["json"]
        if self.asked is None:
            self.framing = "payload" if "payload" in offered else "json"
        elif self.asked in offered or self.asked == "json":
            self.framing = self.asked
        else:
            await self.close()
            raise ValueError(f"{self.name} worker offers framing {offered}, not {self.asked!r}")
        return self.ready

    def stderr_tail(self) -> str:
        return "\n".join(self._stderr)

    async def call(self, op: str, timeout: float, hidden: bytes | None = None, **fields: Any) -> dict[str, Any]:
        """One request (``hidden``: the raw bytes of its hidden state, if it sends one); a reply
        that has a hidden state has its raw bytes as ``"hidden"`` (and ``"hidden_b64"`` only if
        it came in JSON). Raises WorkerError (an error reply), WorkerDied, or TimeoutError."""
        if hidden is not None and "hidden_b64" in fields:
            raise ValueError(f"{op}: pass the hidden state once, as hidden or as hidden_b64")
        if self.died is not None:
            raise self.died
        assert self.proc is not None and self.proc.stdin is not None
        rid = next(self._ids)
        if self.framing == "payload" and "hidden_b64" not in fields:  # a caller's own base64 goes as JSON
            request = {"op": op, "request_id": rid, **fields, "payload": len(hidden) if hidden else 0}
            line = json.dumps(request).encode() + b"\n"
            data = line + hidden if hidden else line
        else:
            if hidden is not None:
                fields["hidden_b64"] = base64.b64encode(hidden).decode()
            data = (json.dumps({"op": op, "request_id": rid, **fields}) + "\n").encode()
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        stdin = self.proc.stdin
        try:
            async with asyncio.timeout(timeout):  # the write and the answer: one deadline
                stdin.write(data)  # whole: no other call's bytes can come between
                if stdin.transport.get_write_buffer_size() or stdin.transport.is_closing():
                    await stdin.drain()  # the pipe is full (a large prefill), or the worker is gone
                reply = await fut
        except TimeoutError:
            raise TimeoutError(f"{self.name} worker did not answer {op} within {timeout:.3g} s") from None
        except (BrokenPipeError, ConnectionResetError):
            await asyncio.sleep(0.1)  # let the watcher see the exit status
            raise self.died or WorkerDied(self.name, self.proc.returncode, self.stderr_tail()) from None
        finally:
            self._pending.pop(rid, None)
        if "error" in reply:
            raise WorkerError(f"{self.name} worker: {reply['error']}")
        if "hidden_b64" in reply and "hidden" not in reply:
            try:
                reply["hidden"] = base64.b64decode(reply["hidden_b64"], validate=True)
            except (binascii.Error, ValueError, TypeError):
                raise WorkerError(f"{self.name} worker answered {op} with hidden_b64 that is not base64") from None
        return reply

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
                head["hidden"] = bytes(buf[:n])
                del buf[:n]
                self._header = None
                self._deliver(head)
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
            if "payload" in msg:
                n = msg.pop("payload")
                if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= _LINE_LIMIT:
                    self._break(f"a reply announced a payload of {str(n)[:40]!r} bytes; expected 0..{_LINE_LIMIT}")
                    return
                self._header = (msg, n)
                continue
            self._deliver(msg)

    def _deliver(self, msg: dict[str, Any]) -> None:
        if self._ready_fut is not None and not self._ready_fut.done():
            if msg.get("status") == "ready":
                self._ready_fut.set_result(msg)
            return
        rid = msg.get("request_id")
        fut = self._pending.get(rid) if isinstance(rid, int) else None
        if fut is not None and not fut.done():
            fut.set_result(msg)
        elif msg.get("error"):
            log.warning("%s worker: %s", self.name, msg["error"])

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
        for fut in [*self._pending.values(), self._ready_fut]:
            if fut is not None and not fut.done():
                fut.set_exception(self.died)
                fut.exception()
        if not self._closing:
            log.error("%s", self.died)
            if self.on_death is not None:
                self.on_death(self.died)

    async def _read_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        async for line in self.proc.stderr:
            self._stderr.append(line.decode(errors="replace").rstrip())

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
                await self.call("shutdown", timeout=timeout)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGKILL)
                await self.proc.wait()
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        return self.proc.returncode

"""The process bridge: a node talks to its tinygrad worker over stdin/stdout JSON lines.

    bridge = WorkerBridge([sys.executable, worker_path], env, name="pp-stage-1")
    ready = await bridge.start(ready_timeout=300)
    reply = await bridge.call("forward_and_sample", timeout=60, hidden_b64=..., position=0, seq_len=11)

Requests and replies are matched by ``request_id``; every wait has a deadline. If the worker
dies, every pending call fails at once with :class:`WorkerDied`, which carries the exit status and
the tail of the worker's stderr.
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
from typing import Any

log = logging.getLogger(__name__)

_LINE_LIMIT = 256 << 20  # a prefill's hidden state in base64 is one line


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


class WorkerBridge:
    def __init__(self, argv: list[str], env: Mapping[str, str], name: str) -> None:
        self.argv, self.env, self.name = argv, dict(env), name
        self.proc: asyncio.subprocess.Process | None = None
        self.ready: dict[str, Any] | None = None
        self.on_death: Callable[[WorkerDied], None] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ready_fut: asyncio.Future[dict[str, Any]] | None = None
        self._stderr: deque[str] = deque(maxlen=30)
        self._tasks: list[asyncio.Task[None]] = []
        self._lock = asyncio.Lock()
        self.died: WorkerDied | None = None
        self._closing = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def start(self, ready_timeout: float) -> dict[str, Any]:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            env=self.env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            limit=_LINE_LIMIT,
            # the worker stays in the node's process group, so whoever kills the node's group
            # kills it too; and it reads EOF on stdin (and exits) if the node dies some other way
        )
        self._ready_fut = asyncio.get_running_loop().create_future()
        self._tasks = [asyncio.ensure_future(self._read_stdout()), asyncio.ensure_future(self._read_stderr())]
        try:
            self.ready = await asyncio.wait_for(asyncio.shield(self._ready_fut), ready_timeout)
        except TimeoutError:
            raise TimeoutError(
                f"{self.name} worker did not report ready within {ready_timeout:.0f} s; "
                f"{stderr_text(self.stderr_tail())}"
            ) from None
        return self.ready

    def stderr_tail(self) -> str:
        return "\n".join(self._stderr)

    async def call(self, op: str, timeout: float, **fields: Any) -> dict[str, Any]:
        """One request; raises WorkerError (an error reply), WorkerDied, or TimeoutError."""
        if self.died is not None:
            raise self.died
        assert self.proc is not None and self.proc.stdin is not None
        rid = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            async with asyncio.timeout(timeout):  # the lock, the write and the answer: one deadline
                async with self._lock:
                    self.proc.stdin.write((json.dumps({"op": op, "request_id": rid, **fields}) + "\n").encode())
                    await self.proc.stdin.drain()
                reply = await fut
        except TimeoutError:
            raise TimeoutError(f"{self.name} worker did not answer {op} within {timeout:.3g} s") from None
        except (BrokenPipeError, ConnectionResetError):
            await asyncio.sleep(0.1)  # let the reader see the exit status
            raise self.died or WorkerDied(self.name, self.proc.returncode, self.stderr_tail()) from None
        finally:
            self._pending.pop(rid, None)
        if "error" in reply:
            raise WorkerError(f"{self.name} worker: {reply['error']}")
        return reply

    async def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            async for line in self.proc.stdout:
                try:
                    msg = json.loads(line)
                except (ValueError, RecursionError):
                    msg = None
                if not isinstance(msg, dict):
                    self._stderr.append("stdout: " + line.decode(errors="replace")[:200].rstrip())
                    continue
                if self._ready_fut is not None and not self._ready_fut.done():
                    if msg.get("status") == "ready":
                        self._ready_fut.set_result(msg)
                    continue
                rid = msg.get("request_id")
                fut = self._pending.get(rid) if isinstance(rid, int) else None
                if fut is not None and not fut.done():
                    fut.set_result(msg)
                elif msg.get("error"):
                    log.warning("%s worker: %s", self.name, msg["error"])
        except ValueError as e:  # a line over the limit: the protocol is broken, stop the worker
            self._stderr.append(f"bridge: a reply line exceeded {_LINE_LIMIT} bytes ({e}); killing the worker")
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
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
        """Ask the worker to shut down; kill its process group if it does not within ``timeout``."""
        if self.proc is None:
            return None
        self._closing = True
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

"""Child processes on this machine that speak JSON lines on stdout (members, later nodes).

Each JSON object line is an :class:`Event`: its kind (``"event"``, one of :class:`EventKind`;
None for a line without one, such as the delay switch's replies) and every field it carried.
Callers test ``e.kind is EventKind.READY``, and read a field as ``e["reason"]`` or ``e.get("n")``.

Every wait has a deadline and its error carries the tail of the child's stderr, so a failure says
what the child was doing. ``stop`` escalates SIGTERM -> SIGKILL and always reaps.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..nodeenv import DEFAULTS, NodeEnv, process_env
from .peeraddr import endpoint_id, new_secret_key

log = logging.getLogger(__name__)
GROUP_GONE = 5.0  # seconds a stopped child's process group gets to be gone after its SIGKILL
LINES_KEPT = 5000  # a child's last lines of output kept (vast.ai's logs serve a tail of 1,000 by default)


class ChildError(RuntimeError):
    pass


class EventKind(enum.StrEnum):
    """What a child's line says happened (its ``"event"``): a node's or a member's start
    (``joined``, ``ready``, ``failed``), a node's progress and lifetime (``prefill``, ``token``,
    ``reference_ready``, ``reference``, ``orchestrator``, ``expired``), and a bare member's
    membership events (``runtime/member.py``: ``joined``, ``alive``, ``suspect``, ``dead``,
    ``updated``)."""

    JOINED = "joined"
    READY = "ready"
    FAILED = "failed"
    TOKEN = "token"
    REFERENCE_READY = "reference_ready"
    REFERENCE = "reference"
    PREFILL = "prefill"
    ORCHESTRATOR = "orchestrator"
    EXPIRED = "expired"
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    UPDATED = "updated"


@dataclass(frozen=True)
class Event:
    """One JSON object line of a child: its :class:`EventKind` (None for a line with no
    ``"event"``, or one this version does not know: ``name`` keeps what it said) and its fields,
    ``"event"`` among them, as the line had them."""

    kind: EventKind | None
    name: str | None
    fields: Mapping[str, Any]

    @classmethod
    def of(cls, line: Mapping[str, Any]) -> Event:
        name = line.get("event")
        known = name if isinstance(name, str) and name in EventKind._value2member_map_ else None
        return cls(None if known is None else EventKind(known), name if isinstance(name, str) else None, line)

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


class ChildProcess:
    def __init__(self, name: str, argv: list[str], env: Mapping[str, str]) -> None:
        self.name = name
        self.argv = argv
        self.env = dict(env)
        self.proc: asyncio.subprocess.Process | None = None
        self.events: list[Event] = []
        self._stderr: deque[str] = deque(maxlen=LINES_KEPT)
        self._new = asyncio.Event()
        self._readers: list[asyncio.Task[None]] = []

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            env=self.env,
            stdin=asyncio.subprocess.PIPE,  # never written: its EOF tells the child we are gone
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group: stop() takes everything it started
            limit=16 << 20,  # a long log line must not kill the reader (and then block the child)
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._readers = [
            asyncio.ensure_future(self._read_stdout(self.proc.stdout)),
            asyncio.ensure_future(self._read_stderr(self.proc.stderr)),
        ]

    async def _read_stdout(self, stream: asyncio.StreamReader) -> None:
        try:
            await self._read_lines(stream)
        finally:
            self._new.set()

    async def _read_lines(self, stream: asyncio.StreamReader) -> None:
        async for line in _lines(stream):
            try:
                obj = json.loads(line)
            except ValueError:
                self._stderr.append("stdout: " + line.decode(errors="replace").rstrip())
                continue
            if isinstance(obj, dict):
                self.events.append(Event.of(obj))
                self._new.set()

    async def _read_stderr(self, stream: asyncio.StreamReader) -> None:
        async for line in _lines(stream):
            self._stderr.append(line.decode(errors="replace").rstrip())

    def stderr_tail(self, lines: int = 40) -> str:
        """Its last ``lines`` lines of output (stderr, and stdout's lines that are no event)."""
        return "\n".join(list(self._stderr)[-lines:]) if lines > 0 else ""

    def find(self, pred: Callable[[Event], bool]) -> Event | None:
        return next((e for e in self.events if pred(e)), None)

    async def wait_event(self, pred: Callable[[Event], bool], timeout: float, what: str) -> Event:
        """The first event (past or future) that satisfies ``pred``."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.find(pred)
            if found is not None:
                return found
            if self.proc is not None and self.proc.returncode is not None:
                raise ChildError(
                    f"{self.name} exited with status {self.proc.returncode} while waiting for {what}; "
                    f"stderr:\n{self.stderr_tail()}"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChildError(f"{self.name}: no {what} within {timeout:.3g} s; stderr:\n{self.stderr_tail()}")
            self._new.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._new.wait(), min(left, 0.5))

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    async def _group_gone(self, within: float = GROUP_GONE) -> None:
        """Until no process of the child's group is left, at most ``within`` seconds: a SIGKILL
        takes effect when the process next runs, and a worker with its model mapped takes a moment
        to go on a loaded machine, so that a stopped node is gone, workers and all, when
        :meth:`stop` returns."""
        assert self.proc is not None
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            await asyncio.sleep(0.02)
        log.warning("%s: processes of its group still there %.0f s after SIGKILL", self.name, within)

    async def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM the child, SIGKILL its process group after ``grace`` seconds; reap; return its status.

        Cancelling this (a timeout, Ctrl-C) still kills the group: nothing is left running."""
        if self.proc is None:
            return None
        try:
            if self.proc.returncode is None:
                self.signal(signal.SIGCONT)  # a stopped child cannot handle SIGTERM
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGTERM)  # the leader only: it stops its own children
                try:
                    await asyncio.wait_for(self.proc.wait(), grace)
                except TimeoutError:
                    self.signal(signal.SIGKILL)
                    await self.proc.wait()
        finally:
            self.signal(signal.SIGKILL)  # anything left in its group (a worker of a killed node)
        await self._group_gone()
        for t in self._readers:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        return self.proc.returncode


async def _lines(stream: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """Lines of a child's output; one over the reader's limit is cut, not fatal."""
    while True:
        try:
            line = await stream.readline()
        except ValueError:  # longer than the limit: asyncio drops it (or its first part)
            yield b"(a line over the reader's limit was dropped)"
            continue
        if not line:
            return
        yield line


async def stop_on_stdin_eof(stop: asyncio.Event) -> None:
    """In a child started by :class:`ChildProcess`: set ``stop`` when stdin reaches EOF, which
    happens when the parent dies, however it dies (``NodeEnv.exit_on_stdin_eof`` turns this on)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.read(4096):
        pass
    stop.set()


def stop_event(watch_parent: bool) -> tuple[asyncio.Event, asyncio.Task[None] | None]:
    """In a child process: an event set by SIGTERM, SIGINT or (``watch_parent``) the parent's
    death; the task watching the parent is returned so that the child can cancel it on the way out."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop, asyncio.ensure_future(stop_on_stdin_eof(stop)) if watch_parent else None


def emit(obj: dict[str, Any]) -> None:
    """One JSON line on stdout: how a child reports its events to :class:`ChildProcess`."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def configure_child_logging(tag: str, level: str = DEFAULTS.log_level, *also: logging.Handler) -> None:
    """A child's log on stderr at ``level``; ``also``: handlers that get the same records in the
    same format (a node's :class:`~pytest_ppsmoke.runtime.logring.LogRing`)."""
    form = f"%(asctime)s {tag} %(name)s %(levelname)s %(message)s"
    logging.basicConfig(level=level, format=form, stream=sys.stderr)
    for handler in also:
        handler.setFormatter(logging.Formatter(form))  # what basicConfig gives stderr's handler
        logging.getLogger().addHandler(handler)


def member_env(
    key: bytes,
    allowed: list[str],
    seed_ticket: str | None,
    names: Iterable[str] = (),
    swim: str = "",
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of a bare member (or a node) on this machine that exits with its parent."""
    node = NodeEnv(
        node_key=key,
        allowed_ids=tuple(allowed),
        seed=seed_ticket or "",
        names=tuple(names),
        swim=swim,
        transport="local",
        exit_on_stdin_eof=True,
    )
    return {**process_env(node), **(extra or {})}


def member_process(name: str, env: Mapping[str, str]) -> ChildProcess:
    return ChildProcess(name, [sys.executable, "-m", "pytest_ppsmoke.runtime.member"], env)


class ClusterKeys:
    """Secret keys for a cluster, generated by the orchestrator so it knows every id in advance."""

    def __init__(self, n: int) -> None:
        self.keys = [new_secret_key() for _ in range(n)]
        self.ids = [endpoint_id(k) for k in self.keys]

    def __repr__(self) -> str:
        return f"ClusterKeys(ids={[i[:10] for i in self.ids]})"

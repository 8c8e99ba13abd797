"""A process's own output, redacted before a byte of it leaves: what a node (and its worker)
writes to stdout and stderr is what vast.ai's logs endpoint serves to whoever holds a result URL,
so a secret the process holds is taken out where it is written, not later by a reader.

    scrub.install(scrub.secrets_in_env())   # first thing in main(), before logging is configured

:func:`install` puts a :class:`RedactedStream` in place of ``sys.stdout`` and ``sys.stderr`` and
makes uncaught exceptions (the main thread's and any other thread's) print their whole traceback
in one write. A stream holds what it is given until a line ends, then redacts the held text
whole (``redact.Redactor``) and writes it on: a log record of several lines (a traceback, an
encoded blob wrapped over lines) is redacted as one text, before anything splits it, and so are
the pieces ``print`` writes one by one. ``warnings`` writes each warning in one write too.

Out of reach, and said so in docs/threats.md: bytes written to the file descriptors themselves,
past Python's streams (a C library's own prints), and a secret cut across writes that a line end
separates.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import traceback
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import TextIO

from ..nodeenv import variables
from ..redact import Redactor

HOLD = 1 << 16  # characters held without a line end before they are redacted and written anyway


class RedactedStream(io.TextIOBase):
    """A text stream over ``inner`` that redacts with ``redactor`` before it writes (see the
    module's text). ``fileno`` and ``isatty`` are the inner stream's."""

    def __init__(self, inner: TextIO, secrets: Iterable[str | bytes] = ()) -> None:
        super().__init__()
        self.secrets = tuple(secrets)
        self.inner, self.redactor = inner, Redactor(self.secrets)
        self._held: list[str] = []
        self._size = 0
        self._lock = threading.RLock()

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        with self._lock:
            self._held.append(s)
            self._size += len(s)
            if s.endswith("\n") or self._size >= HOLD:
                self._pass_on()
        return len(s)

    def _pass_on(self) -> None:
        text = "".join(self._held)
        self._held.clear()
        self._size = 0
        if text:
            self.inner.write(self.redactor.text(text))
            self.inner.flush()

    def flush(self) -> None:
        with self._lock:
            self._pass_on()
            self.inner.flush()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.inner.fileno()

    def isatty(self) -> bool:
        return self.inner.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.inner.encoding

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return self.inner.errors


def secrets_in_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """The values of the contract's secret variables in the environment, as they are, whether
    or not the rest of it parses: what a node redacts from its first line on."""
    env = os.environ if environ is None else environ
    return [env[v.name] for v in variables() if v.form.secret and env.get(v.name)]


def install(secrets: Iterable[str | bytes | None], stdout: bool = True) -> Redactor:
    """This process's stdout and stderr redacted of ``secrets`` from now on, and its uncaught
    exceptions printed whole; the redactor is returned for what the process redacts itself (a
    worker's stderr it relays). ``stdout``: False leaves stdout as it is (a worker's is its
    binary pipe to the node, never a log). Idempotent: a second call redacts the union of both
    calls'."""
    held = [s for s in secrets if s]
    names = ("stdout", "stderr") if stdout else ("stderr",)
    for name in names:
        stream = getattr(sys, name)
        if isinstance(stream, RedactedStream):
            stream.flush()
            held += [s for s in stream.secrets if s not in held]
    for name in names:
        stream = getattr(sys, name)
        setattr(sys, name, RedactedStream(stream.inner if isinstance(stream, RedactedStream) else stream, held))
    sys.excepthook = _print_whole
    threading.excepthook = _print_thread_whole
    return Redactor(held)


def _print_whole(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    """An uncaught exception's traceback in one write: redacted as one text."""
    sys.stderr.write("".join(traceback.format_exception(kind, exc, tb)))
    sys.stderr.flush()


def _print_thread_whole(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
    sys.stderr.write(f"Exception in thread {name}:\n{text}")
    sys.stderr.flush()

"""The process's own last log lines, kept in memory so that it can tell them when asked (a node's
``LogTail``): a logging handler beside the one that writes stderr, with the same format, that keeps
the last ``keep`` lines.

Every secret the process knows is redacted before a line is stored (``redact.Redactor``: as
written, in hex of either case, in base64 of either alphabet at any alignment), and only then is
a line too long cut: a cut could split a secret into pieces that no longer match. A record of
several lines (a traceback) is stored as its lines, as stderr shows them.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable

from ..redact import Redactor

KEEP = 200  # lines kept: a failure's last minutes at INFO, its whole story at WARNING
LINE_CHARS = 2000  # a stored line is cut to this many characters (a long repr, a huge error)


class LogRing(logging.Handler):
    """The last ``keep`` lines of the log, redacted of ``secrets``. ``written`` counts every
    line ever stored, so that a tail can say how many older lines it leaves out."""

    def __init__(
        self, secrets: Iterable[str | bytes | None] = (), keep: int = KEEP, line_chars: int = LINE_CHARS
    ) -> None:
        super().__init__()
        if keep < 1 or line_chars < 1:
            raise ValueError(
                f"a log ring keeps at least one line of one character; keep={keep!r}, line_chars={line_chars!r}"
            )
        self.redactor = Redactor(secrets)
        self.line_chars = line_chars
        self.written = 0
        self._lines: deque[str] = deque(maxlen=keep)
        self._guard = threading.Lock()  # logging may come from another thread than the one that asks

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:
            self.handleError(record)
            return
        self.add(text)

    def add(self, text: str) -> None:
        """Store ``text`` (one record, formatted) as its lines, each redacted, then cut."""
        lines = [self._cut(line) for line in self.redactor.text(text).splitlines() or [""]]
        with self._guard:
            self._lines.extend(lines)
            self.written += len(lines)

    def _cut(self, line: str) -> str:
        if len(line) <= self.line_chars:
            return line
        return f"{line[: self.line_chars]}... ({len(line) - self.line_chars} more characters)"

    def tail(self, lines: int, max_bytes: int) -> tuple[list[str], int]:
        """The newest lines, oldest first: at most ``lines`` of them and ``max_bytes`` of UTF-8
        text (a newline counted after each), and how many older lines were left out (those no
        longer kept included). A newest line longer than ``max_bytes`` alone is cut to fit."""
        with self._guard:
            kept, written = list(self._lines), self.written
        out: list[str] = []
        size = 0
        for line in reversed(kept):
            if len(out) >= lines:
                break
            n = len(line.encode()) + 1
            if size + n > max_bytes:
                if not out and max_bytes > 1:
                    out.append(line.encode()[: max_bytes - 1].decode(errors="ignore"))
                break
            out.append(line)
            size += n
        out.reverse()
        return out, written - len(out)

"""A command's terminal, read whole: a pty as its stderr (or stdout and stderr), a thread that
reads everything written to it, and the live line's redraws cut out of that (``progress.CLEAR``
begins each), so that a test reads what a person would have seen, drawing by drawing."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import termios
import threading

from pytest_ppsmoke.harness.progress import CLEAR
from pytest_ppsmoke.protocol import Phase

# a drawing of the live line: the phase, its clock, then (after ": ") the count of its work done
DRAWING = re.compile(rf"({'|'.join(p.value for p in Phase)}) \d+\.\d s(?:: (?P<count>[^;]*))?")
# "3 of 30 blocks": work done, of how much; "12 programs": work of no total known ahead
COUNT = re.compile(r"(\d+) (?:of (\d+)|programs)")


class Terminal:
    """A pty of 200 columns; ``slave`` for the command, everything it writes in ``text()``."""

    def __init__(self) -> None:
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # the last writer closed it (EIO)
                return
            if not data:
                return
            self.chunks.append(data)

    def close_slave(self) -> None:
        """The command has it: this side keeps only the master, so that its end reads as EOF."""
        os.close(self.slave)

    def text(self, timeout: float = 30.0) -> str:
        """All it was written, once the command has exited."""
        self.reader.join(timeout)
        os.close(self.master)
        return b"".join(self.chunks).decode(errors="replace")


def drawings(text: str) -> list[tuple[str, str]]:
    """Each drawing of the live line in ``text``: (phase, count). A clear with nothing drawn after
    it, or what the plugin gives back after its line (pytest's own), is no drawing."""
    out = []
    for segment in text.split(CLEAR)[1:]:
        line = re.split(r"[\r\n]", segment, maxsplit=1)[0]
        m = DRAWING.match(line)
        if m:
            out.append((m.group(1), m.group("count") or ""))
    return out


def counted(drawn: list[tuple[str, str]]) -> list[tuple[str, list[int]]]:
    """Each phase, in the order drawn, with the work done each of its drawings counts (the first
    number of each "n of m", and each "n programs": ``1 of 2 workers ready`` is 1). Every drawing
    must carry a count:
    a clock alone fails here, naming the drawing."""
    phases: list[tuple[str, list[int]]] = []
    for phase, count in drawn:
        found = COUNT.findall(count)
        assert found, f"a drawing of {phase} with no count of work, only its clock: {count!r}"
        done = sum(int(n) for n, _ in found)
        if not phases or phases[-1][0] != phase:
            phases.append((phase, []))
        phases[-1][1].append(done)
    return phases


def plain(text: str) -> str:
    """What the terminal holds line by line once the live line has gone: each line's text after
    its last clear (a pty ends lines with ``\\r\\n``)."""
    return "\n".join(line.rsplit(CLEAR, 1)[-1] for line in text.replace("\r\n", "\n").split("\n"))

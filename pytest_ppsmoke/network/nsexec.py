"""Run a command inside a network namespace made by this package:

    python -m pytest_ppsmoke.network.nsexec NETNS -- COMMAND [ARG...]

It enters the namespace and execs the command in place (same pid, stdin, process group, status);
only the network namespace changes, the filesystem and everything else are the caller's.
"""

from __future__ import annotations

import os
import sys

from .netns import setns


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[1] != "--":
        sys.stderr.write("usage: python -m pytest_ppsmoke.network.nsexec NETNS -- COMMAND [ARG...]\n")
        return 2
    setns(args[0])
    os.execvp(args[2], args[2:])
    return 127  # not reached: execvp replaces this process or raises


if __name__ == "__main__":
    sys.exit(main())

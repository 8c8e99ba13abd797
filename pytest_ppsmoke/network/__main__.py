"""``python -m pytest_ppsmoke.network sweep``: remove what killed runs left (namespaces, devices)."""

from __future__ import annotations

import argparse
import logging
import sys

from .netns import sweep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pytest_ppsmoke.network")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("sweep", help="remove the namespaces and devices of runs whose owner process is dead")
    ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    removed = sweep()
    for name in removed:
        print(f"removed {name}")
    print(f"sweep: {len(removed)} left-over name(s) removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What redacting a log line costs (``redact.Redactor.text``), against the redactor as it was
before it read the encodings a log line adds (``OldRedactor`` below, its class as it was).

    python bench/bench_redact.py [--repeat 5] [--out FILE]

Lines of 100, 1,000 and 10,000 characters: ordinary log text without a secret (plain, and with
escapes, hex pairs with separators and line breaks, which take the new redactor's slower paths),
and with one secret written in a few encodings; each with 1 secret known (a node key), 2 (a node
key and an API key) and 6. ``us_per_line`` is the best of ``repeat`` timings of a batch, per line;
``ratio`` is new over old, both measured in this run, interleaved. ``linear``: the cost per
thousand characters of lines from 100 characters to 100,000, with escapes, for each redactor.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import random
import re
import secrets
import time
import urllib.parse
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from benchio import emit  # bench/ is this script's directory: first on sys.path

from pytest_ppsmoke.redact import MIN_LENGTH, REDACTED, Redactor, forms


class OldRedactor:
    """The redactor as it was: one search for the forms as written (hex in either case)."""

    def __init__(self, secrets: Iterable[str | bytes | None]) -> None:
        hexes: set[str] = set()
        exact: set[str] = set()
        for s in secrets:
            if not s or len(s) < MIN_LENGTH:
                continue
            for f in forms(s):
                (hexes if _is_hex(f) else exact).add(f)
        parts = [re.escape(f) for f in sorted(exact, key=len, reverse=True)]
        parts += [f"(?i:{re.escape(f)})" for f in sorted(hexes, key=len, reverse=True)]
        self.count = len(exact) + len(hexes)
        self._pattern = re.compile("|".join(sorted(parts, key=len, reverse=True))) if parts else None

    def text(self, s: str) -> str:
        if self._pattern is None:
            return s
        return self._pattern.sub(REDACTED, s)


def _is_hex(s: str) -> bool:
    try:
        binascii.unhexlify(s)
    except (binascii.Error, ValueError):
        return False
    return True


WORDS = "stage 1 joined peer ping acked in ms members loaded blocks of programs step decode token".split()  # noqa: SIM905
ESCAPED = ['"C:\\\\cache\\/w"', "q=a%20b", "\\u00e9", "b'\\x00\\x01'", "3f:a1:00:9c:de:ad:be:ef", "\n  "]


def filler(rng: random.Random, n: int, escaped: bool) -> str:
    """``n`` characters of log text: words and numbers, and with ``escaped`` also escapes,
    separated hex pairs and line breaks."""
    out: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(ESCAPED) if escaped and rng.random() < 0.2 else rng.choice([*WORDS, str(rng.randrange(10**6))])
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


def key_encodings(key: str) -> dict[str, str]:
    raw = bytes.fromhex(key)
    return {
        "as written": key,
        "hex a:b": binascii.hexlify(raw, ":").decode(),
        "base64 wrapped": base64.encodebytes(b"cfg:" + raw * 2).decode(),
        "bytes repr": repr(raw),
        "URL-quoted base64": urllib.parse.quote(base64.b64encode(b"x" + raw).decode(), safe=""),
    }


def per_line(fn: Callable[[str], str], lines: list[str], repeat: int) -> float:
    """Microseconds per line: the best of ``repeat`` passes over ``lines``."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for line in lines:
            fn(line)
        best = min(best, time.perf_counter() - started)
    return best / len(lines) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rng = random.Random(1)
    key, api = secrets.token_hex(32), "ak_" + secrets.token_urlsafe(24)
    known = {
        1: [key],
        2: [key, api],
        6: [key, api, *(secrets.token_hex(32) for _ in range(2)), secrets.token_bytes(32), secrets.token_urlsafe(32)],
    }
    rows: list[dict[str, Any]] = []
    for length in (100, 1000, 10_000):
        batch = max(5, 20_000 // length)
        cases = {
            "no secret, plain": [filler(rng, length, False) for _ in range(batch)],
            "no secret, escapes": [filler(rng, length, True) for _ in range(batch)],
        }
        for name, text in key_encodings(key).items():
            lines = []
            for _ in range(batch):
                line = filler(rng, length, True)
                at = rng.randrange(len(line))
                lines.append(line[:at] + " " + text + " " + line[at:])
            cases[f"one secret, {name}"] = lines
        for count, secret_list in known.items():
            new, old = Redactor(secret_list), OldRedactor(secret_list)
            for case, lines in cases.items():
                old_us = per_line(old.text, lines, args.repeat)
                new_us = per_line(new.text, lines, args.repeat)
                rows.append(
                    {
                        "chars": length,
                        "secrets": count,
                        "case": case,
                        "old_us_per_line": round(old_us, 2),
                        "new_us_per_line": round(new_us, 2),
                        "ratio": round(new_us / old_us, 2),
                    }
                )
    linear = []
    new, old = Redactor(known[2]), OldRedactor(known[2])
    for length in (100, 1000, 10_000, 100_000):
        lines = [filler(rng, length, True) for _ in range(max(2, 20_000 // length))]
        old_us = per_line(old.text, lines, args.repeat)
        new_us = per_line(new.text, lines, args.repeat)
        linear.append(
            {
                "chars": length,
                "old_us_per_kchar": round(old_us / length * 1000, 2),
                "new_us_per_kchar": round(new_us / length * 1000, 2),
            }
        )
    emit({"repeat": args.repeat, "rows": rows, "linear": linear}, args.out)


if __name__ == "__main__":
    main()

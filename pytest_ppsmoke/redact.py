"""Secrets out of text that leaves a process: a node's log lines, the tails the orchestrator
collects, what vast.ai's logs endpoint serves.

A key can reach a log in more than one form: as written (an API key, a 64-hex node key), as the
bytes it stands for printed in hex (either case), or base64-encoded inside a larger blob (a
header, a JSON value, an encoded config), where the characters that stand for it depend on the
secret's offset in the blob. :class:`Redactor` knows every one of those forms of each secret and
replaces each occurrence by :data:`REDACTED`.

A base64 encoding of bytes that hold the secret at offset ``k`` (mod 3) contains a run of
characters fixed by the secret alone: the ones whose six bits all fall inside it. Those runs, for
``k`` = 0, 1, 2, in the standard and the URL-safe alphabets, are what is looked for; a run is
shorter than the encoding by at most two characters at each end, which stay in the text (a
secret encoded alone is matched whole, with its padding).

Standard library only: every layer, the nodes and the emulator use it.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import re
from collections.abc import Iterable

REDACTED = "[redacted]"
MIN_LENGTH = 8  # a shorter value is not taken for a secret: it would blank common words and numbers


def _forms(secret: bytes) -> set[str]:
    """The texts ``secret`` (its bytes) may appear as: hex, and base64 at each alignment."""
    whole = base64.b64encode(secret).decode()  # the secret encoded alone: every character of it
    found = {secret.hex(), whole, whole.replace("+", "-").replace("/", "_")}
    for k in range(3):
        encoded = base64.b64encode(b"\0" * k + secret + b"\0\0").decode()
        start, end = -(-8 * k // 6), 8 * (k + len(secret)) // 6
        run = encoded[start:end]
        found.add(run)
        found.add(run.replace("+", "-").replace("/", "_"))
    return found


def forms(secret: str | bytes) -> set[str]:
    """Every text form of ``secret`` that :class:`Redactor` replaces: as written (text), the
    bytes of its text, and, for a hex string, the bytes it stands for; bytes also as their hex
    text, with that text's own forms."""
    if isinstance(secret, bytes):
        found = _forms(secret) | forms(secret.hex())  # a key held as bytes is written as its hex
        try:
            text = secret.decode()
        except UnicodeDecodeError:
            text = ""
        if text.isprintable():
            found |= forms(text)
        return {f for f in found if len(f) >= MIN_LENGTH}
    found = {secret} | _forms(secret.encode())
    with contextlib.suppress(ValueError):
        found |= _forms(bytes.fromhex(secret))
    return {f for f in found if len(f) >= MIN_LENGTH}


class Redactor:
    """Replaces every form (:func:`forms`) of each secret by :data:`REDACTED`. Hex is matched in
    either letter case; base64 and text as written. A secret shorter than :data:`MIN_LENGTH` is
    ignored. With no secrets, text is returned as it is."""

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

    def __bool__(self) -> bool:
        return self._pattern is not None

    def text(self, s: str) -> str:
        """``s`` with every form of every secret replaced."""
        if self._pattern is None:
            return s
        return self._pattern.sub(REDACTED, s)

    def lines(self, lines: Iterable[str]) -> list[str]:
        return [self.text(line) for line in lines]


def _is_hex(s: str) -> bool:
    try:
        binascii.unhexlify(s)
    except (binascii.Error, ValueError):
        return False
    return True

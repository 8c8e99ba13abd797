"""An oracle for the redaction tests: what a reader of a text could decode from it, worked out
apart from :mod:`pytest_ppsmoke.redact` (which it never imports), with the standard library only.

:func:`recovered` decodes every candidate run of the text in each way a log may hold a secret and
says where any ``window`` consecutive bytes of a secret come back. The decodings:

- the text as written (its UTF-8 and its Latin-1 bytes);
- hex, with or without a separator (``:``, ``-``, ``.``, a space or a line break) between bytes,
  either case, at both nibble offsets;
- base64, standard and URL-safe, at each of the four character offsets of a run, after the lines
  of a wrapped block are joined, after URL-unquoting and after JSON unescaping (``\\/`` for ``/``);
- Python bytes literals (``b'...'``, ``b"..."``), read back as Python reads them;
- ``\\uXXXX`` and the other JSON escapes, and URL-quoted (``%XX``) text.

A secret's targets are its text's bytes; for a hex string also the bytes it stands for; for
bytes, the bytes and their hex text.

:data:`ENCODINGS` are the ways the tests write a blob that holds a secret, each from the standard
library, so that the tests and the oracle's own tests share them.
"""

from __future__ import annotations

import ast
import base64
import binascii
import bisect
import contextlib
import json
import re
import textwrap
import urllib.parse
import warnings
from collections.abc import Callable, Iterator

_B64_RUN = re.compile(r"[A-Za-z0-9+/=_-]{8,}")
_HEX_RUN = re.compile(r"[0-9A-Fa-f](?:[0-9A-Fa-f]|[:. \t\r\n-])*")
_LINE_BREAK = re.compile(r"(?:\r?\n|\\r\\n|\\n)[ \t]*")
_JSON_ESCAPE = re.compile(r"\\(u[0-9A-Fa-f]{4}|[\"\\/bfnrt])")
_BYTES_LITERAL = re.compile(r"""b'(?:[^'\\\n]|\\.)*'|b"(?:[^"\\\n]|\\.)*\"""")
_JSON_SIMPLE = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def targets(secret: str | bytes) -> list[bytes]:
    """The byte strings a reader must not get back for ``secret``."""
    if isinstance(secret, bytes):
        return [secret, secret.hex().encode()]
    found = [secret.encode()]
    with contextlib.suppress(ValueError):
        found.append(bytes.fromhex(secret))
    return found


def _json_unescaped(text: str) -> str:
    def one(m: re.Match[str]) -> str:
        e = m.group(1)
        return chr(int(e[1:], 16)) if e[0] == "u" else _JSON_SIMPLE[e]

    return _JSON_ESCAPE.sub(one, text)


def _text_variants(text: str) -> dict[str, str]:
    """The text as written, URL-unquoted and JSON-unescaped, each also with its lines joined; a
    variant the same as one before it is left out."""
    found = {"as written": text, "URL-unquoted": urllib.parse.unquote(text, errors="replace")}
    found["JSON-unescaped"] = _json_unescaped(text)
    for name, v in list(found.items()):
        found[f"{name}, lines joined"] = _LINE_BREAK.sub("", v)
    seen: set[str] = set()
    kept = {}
    for name, v in found.items():
        if v not in seen:
            seen.add(v)
            kept[name] = v
    return kept


def _as_bytes(v: str) -> Iterator[tuple[str, bytes]]:
    yield "utf-8", v.encode("utf-8", "replace")
    yield "latin-1", v.encode("latin-1", "replace")


def _hex_decodings(v: str) -> Iterator[tuple[str, bytes]]:
    for m in _HEX_RUN.finditer(v):
        digits = re.sub(r"[^0-9A-Fa-f]", "", m.group())
        for k in (0, 1):
            run = digits[k:]
            run = run[: len(run) - len(run) % 2]
            if len(run) >= 4:
                yield f"hex at {m.start()} (nibble offset {k})", binascii.unhexlify(run)


def _base64_decodings(v: str) -> Iterator[tuple[str, bytes]]:
    for m in _B64_RUN.finditer(v):
        run = m.group().replace("=", "").replace("-", "+").replace("_", "/")
        for k in range(4):
            part = run[k:]
            part = part[: len(part) - len(part) % 4]
            if part:
                yield f"base64 at {m.start()} (offset {k})", base64.b64decode(part)


def _bytes_literals(text: str) -> Iterator[tuple[str, bytes]]:
    for m in _BYTES_LITERAL.finditer(text):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # an escape Python does not know, read as written
                value = ast.literal_eval(m.group())
        except (ValueError, SyntaxError):
            continue
        if isinstance(value, bytes):
            yield f"bytes literal at {m.start()}", value


def decodings(text: str) -> Iterator[tuple[str, bytes]]:
    """Every candidate a reader could decode from ``text``, with how it was decoded."""
    for name, v in _text_variants(text).items():
        for how, b in _as_bytes(v):
            yield f"{name} ({how})", b
        for how, b in _hex_decodings(v):
            yield f"{name}: {how}", b
        for how, b in _base64_decodings(v):
            yield f"{name}: {how}", b
    yield "URL-unquoted to bytes", urllib.parse.unquote_to_bytes(text)
    yield from _bytes_literals(text)


def recovered(text: str, secrets: list[str | bytes], window: int = 8) -> list[str]:
    """Where ``window`` consecutive bytes of any of ``secrets`` can be read back from ``text``:
    one description per decoding that gives some back (empty: nothing recovered)."""
    pieces: dict[bytes, int] = {}
    for i, secret in enumerate(secrets):
        for t in targets(secret):
            for j in range(len(t) - window + 1):
                pieces[t[j : j + window]] = i
    # every decoding in one blob, searched once per piece; a piece across two decodings would
    # have to match the newline between them too, and random bytes do not
    hows, starts, blobs, at = [], [], [], 0
    for how, blob in decodings(text):
        hows.append(how)
        starts.append(at)
        blobs.append(blob)
        at += len(blob) + 1
    whole = b"\n".join(blobs)
    found: dict[str, None] = {}
    for piece, i in pieces.items():
        k = whole.find(piece)
        while k >= 0:
            found[f"secret {i}: {piece!r} in {hows[bisect.bisect_right(starts, k) - 1]}"] = None
            k = whole.find(piece, k + 1)
    return list(found)


def _b64(blob: bytes) -> str:
    return base64.b64encode(blob).decode()


def _pem(blob: bytes) -> str:
    body = textwrap.fill(_b64(blob), 64)
    return f"-----BEGIN PRIVATE KEY-----\n{body}\n-----END PRIVATE KEY-----"


def _every_char_escaped(blob: bytes) -> str:
    return "".join(f"\\u{ord(c):04x}" for c in blob.decode("latin-1"))


def _some_chars_escaped(blob: bytes) -> str:
    text = blob.decode("latin-1")
    return "".join(f"\\u{ord(c):04X}" if i % 3 else json.dumps(c)[1:-1] for i, c in enumerate(text))


#: How a test writes a blob that holds a secret: a name and the text the blob is written as.
ENCODINGS: dict[str, Callable[[bytes], str]] = {
    "as written": lambda b: b.decode("latin-1"),
    "hex": lambda b: b.hex(),
    "HEX": lambda b: b.hex().upper(),
    "base64": _b64,
    "base64 url-safe": lambda b: base64.urlsafe_b64encode(b).decode(),
    "base64 wrapped at 76": lambda b: base64.encodebytes(b).decode(),
    "base64 MIME": lambda b: base64.encodebytes(b).decode().replace("\n", "\r\n"),
    "PEM": _pem,
    "hex a:b": lambda b: binascii.hexlify(b, ":").decode(),
    "HEX A:B": lambda b: binascii.hexlify(b, ":").decode().upper(),
    "hex a b": lambda b: binascii.hexlify(b, " ").decode(),
    "HEX A-B": lambda b: binascii.hexlify(b, "-").decode().upper(),
    "bytes repr": repr,
    "JSON \\u, every char": _every_char_escaped,
    "JSON \\u, some chars": _some_chars_escaped,
    "JSON ensure_ascii": lambda b: json.dumps(b.decode("latin-1"), ensure_ascii=True),
    "URL-quoted": lambda b: urllib.parse.quote(b, safe=""),
    "URL-quoted base64": lambda b: urllib.parse.quote(_b64(b), safe=""),
    "JSON-escaped base64": lambda b: json.dumps(_b64(b)).replace("/", "\\/"),
}

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

A log line may also hold one of those forms encoded once more: base64 wrapped across the lines
of one record (76 columns, MIME's CRLF, PEM's 64), hex with a separator between bytes (``aa:bb``,
``AA BB``, ``aa-bb``), the repr of the raw bytes (``b'\\x8f...'``), JSON's ``\\uXXXX`` escapes
or its ``\\/``, URL quoting (``%2B``, ``%2F``, ``%3D``, ``%8f``). :meth:`Redactor.text` reads
the line once more in two canonical forms, each built in one pass with a map back to the line:
the line with every escape decoded and every line break inside a run dropped (where a wrapped or
escaped base64 run, an escaped text and a hex run wrapped across lines become their plain
forms), and the hex of the bytes that decoded line stands for (where a repr or a URL quoting of
raw bytes becomes the hex of them); a run of hex pairs with separators is read as its hex
without them. A form found in a canonical text is replaced in the line over the span it came
from: the escapes, separators and line breaks inside it go with it, the rest of the line stays.
Each pass is a regular expression with no nested repetition to backtrack over, so a line costs
time linear in its length. The canonical texts are searched as plain strings first; the map
back to the line is built only where a form is found, and a line with no escape, percent sign or
line break costs two searches: as written, and without its separators for a hex form.

Standard library only: every layer, the nodes and the emulator use it.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import contextlib
import functools
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
    """Replaces every form (:func:`forms`) of each secret by :data:`REDACTED`, as written and
    under the encodings a log line adds (the module's account). Hex is matched in either letter
    case; base64 and text as written. A secret shorter than :data:`MIN_LENGTH` is ignored. With
    no secrets, text is returned as it is; text with none of them in it comes back unchanged."""

    def __init__(self, secrets: Iterable[str | bytes | None]) -> None:
        hexes: set[str] = set()
        exact: set[str] = set()
        for s in secrets:
            if not s or len(s) < MIN_LENGTH:
                continue
            for f in forms(s):
                (hexes if _is_hex(f) else exact).add(f)
        parts = [re.escape(f) for f in sorted(exact, key=len, reverse=True)]
        hex_parts = [f"(?i:{re.escape(f)})" for f in sorted(hexes, key=len, reverse=True)]
        self.count = len(exact) + len(hexes)
        everything = sorted(parts + hex_parts, key=len, reverse=True)
        self._pattern = re.compile("|".join(everything)) if everything else None
        self._hex = re.compile("|".join(hex_parts)) if hex_parts else None
        # the hex of bytes is lower case: searched without a case-folding pattern
        self._hex_lower = re.compile("|".join(re.escape(f.lower()) for f in sorted(hexes, key=len, reverse=True)))
        # a run of at least as many hex pairs as the shortest hex form has, with separators
        pairs = max(2, min((len(f) for f in hexes), default=MIN_LENGTH) // 2)
        self._pairs = re.compile(rf"(?<![0-9A-Fa-f])[0-9A-Fa-f]{{2}}(?:{_HEX_SEP}?[0-9A-Fa-f]{{2}}){{{pairs - 1},}}")

    def __bool__(self) -> bool:
        return self._pattern is not None

    def text(self, s: str) -> str:
        """``s`` with every form of every secret replaced, as written or encoded once more."""
        if self._pattern is None:
            return s
        spans = [m.span() for m in self._pattern.finditer(s)]
        if "\\" in s or "%" in s or "\n" in s:
            spans += self._escaped(s, _ESCAPE)
            if "%" in s and ("\\x" in s or "\\u" in s):  # a bytes repr or JSON string may hold a "%" of its own
                spans += self._escaped(s, _BACKSLASH_ESCAPE)
        if self._hex is not None and self._hex_lower.search(s.translate(_SEPARATORS).lower()):
            for m in self._pairs.finditer(s):
                run = m.group()
                if not run.isalnum():  # plain hex was matched as written
                    spans += _Canonical.of_pairs(run, m.start()).spans(self._hex)
        if not spans:
            return s
        out, at = [], 0
        for start, end in _merged(spans):
            out += [s[at:start], REDACTED]
            at = end
        out.append(s[at:])
        return "".join(out)

    def lines(self, lines: Iterable[str]) -> list[str]:
        return [self.text(line) for line in lines]

    def _escaped(self, s: str, escape: re.Pattern[str]) -> list[tuple[int, int]]:
        """The spans of ``s`` whose escapes decode to a form: in the decoded text (line breaks
        dropped), and in the hex of the bytes it stands for. Both are searched first as plain
        strings; the map back to the line is built only where a form is found."""
        assert self._pattern is not None
        held = escape.sub(_bytes_of_match, s)
        found = self._pattern.search(held.replace("\n", "").replace("\r", "")) is not None
        if not found and self._hex is not None and ("\\x" in s or "\\u" in s or "%" in s):
            found = self._hex_lower.search(held.encode("latin-1", "replace").hex()) is not None
        if not found:
            return []
        text_map, hex_map = _Canonical.of_escapes(s, escape)
        spans = text_map.spans(self._pattern)
        if self._hex is not None:
            spans += hex_map.spans(self._hex)
        return spans


#: A byte's escape in a bytes repr (``\\x8f``), a character's in JSON (``\\u00e9``), a URL's
#: quoting (``%2F``), the one-character escapes of both, and a line break with the indentation
#: after it (a wrapped run, or one escaped as ``\\n``).
_ESCAPE = re.compile(r"\\u[0-9A-Fa-f]{4}|\\x[0-9A-Fa-f]{2}|%[0-9A-Fa-f]{2}|\\[\\/\"'bfnrt]|\r?\n[ \t]*")
_BACKSLASH_ESCAPE = re.compile(r"\\u[0-9A-Fa-f]{4}|\\x[0-9A-Fa-f]{2}|\\[\\/\"'bfnrt]|\r?\n[ \t]*")
_HEX_SEP = r"(?:[:. -]|\r?\n[ \t]*)"
_SEPARATORS = str.maketrans("", "", ":. -\r\n\t")
_SIMPLE = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


@functools.lru_cache(maxsize=4096)
def _decoded(escape: str) -> tuple[str, str]:
    """An escape's text (a line break, ``\\n`` and ``\\r`` as nothing) and the characters of the
    bytes it stands for (those two as themselves; a line break as nothing)."""
    if escape[0] in "\r\n":
        return "", ""
    if escape[0] == "%":
        char = chr(int(escape[1:], 16))
        return char, char
    if escape[1] in "ux":
        char = chr(int(escape[2:], 16))
        return char, char
    kept = _SIMPLE.get(escape[1], escape[1])
    return ("" if escape[1] in "nr" else kept), kept


def _bytes_of_match(m: re.Match[str]) -> str:
    return _decoded(m.group())[1]


class _Canonical:
    """A canonical text built from pieces of a line, each with the span of the line it came
    from: a piece copied (``scale`` characters of it per character of the line) maps back
    character by character, a decoded one (``scale`` 0) to its whole span."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.starts: list[int] = []  # where each piece starts in the canonical text
        self.spans_in_line: list[tuple[int, int, int]] = []  # (start, end, scale)
        self.length = 0

    def add(self, part: str, start: int, end: int, scale: int) -> None:
        if part:
            self.parts.append(part)
            self.starts.append(self.length)
            self.spans_in_line.append((start, end, scale))
            self.length += len(part)

    @classmethod
    def of_escapes(cls, s: str, escape: re.Pattern[str]) -> tuple[_Canonical, _Canonical]:
        """``s`` decoded (line breaks, and ``\\n`` and ``\\r``, dropped) and the hex of its
        characters' bytes as decoded (those two escapes kept as bytes; a character past Latin-1
        as ``?``)."""
        text, hexed = cls(), cls()
        at = 0
        for m in escape.finditer(s):
            start, end = m.span()
            if start > at:
                plain = s[at:start]
                text.add(plain, at, start, 1)
                hexed.add(plain.encode("latin-1", "replace").hex(), at, start, 2)
            char, kept = _decoded(m.group())
            text.add(char, start, end, 0)
            hexed.add(kept.encode("latin-1", "replace").hex(), start, end, 0)
            at = end
        if at < len(s):
            plain = s[at:]
            text.add(plain, at, len(s), 1)
            hexed.add(plain.encode("latin-1", "replace").hex(), at, len(s), 2)
        return text, hexed

    @classmethod
    def of_pairs(cls, run: str, offset: int) -> _Canonical:
        """A run of hex pairs with separators (at ``offset`` in the line) as its hex alone."""
        found = cls()
        for m in re.finditer(r"[0-9A-Fa-f]+", run):
            found.add(m.group(), offset + m.start(), offset + m.end(), 1)
        return found

    def spans(self, pattern: re.Pattern[str]) -> list[tuple[int, int]]:
        """The spans of the line that each match of ``pattern`` in this text came from."""
        text = "".join(self.parts)
        return [(self._line_at(m.start(), 0), self._line_at(m.end() - 1, 1)) for m in pattern.finditer(text)]

    def _line_at(self, i: int, after: int) -> int:
        """Where in the line the canonical character ``i`` came from: its start, or with
        ``after`` its end."""
        k = bisect.bisect_right(self.starts, i) - 1
        start, end, scale = self.spans_in_line[k]
        if not scale:
            return end if after else start
        return start + (i - self.starts[k]) // scale + after


def _is_hex(s: str) -> bool:
    try:
        binascii.unhexlify(s)
    except (binascii.Error, ValueError):
        return False
    return True


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` in order, those that overlap or touch made one."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out

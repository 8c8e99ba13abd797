"""Secrets out of text, in every form a log may hold them: as written, hex in either case,
base64 (standard and URL-safe) at any offset inside a larger blob, and each of those encoded once
more as a log line carries it (wrapped, separated, escaped, quoted), checked by an oracle that
decodes apart from redact.py (tests/leakscan.py)."""

from __future__ import annotations

import base64
import binascii
import random
import secrets
import urllib.parse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_ppsmoke.redact import MIN_LENGTH, REDACTED, Redactor, forms

from .leakscan import ENCODINGS, recovered

pytestmark = pytest.mark.local

KEY = secrets.token_hex(32)  # a node key's form: 64 hex
API = "ak_" + secrets.token_urlsafe(24)  # an API key's: text


def encodings(blob: bytes, text: bool) -> list[str]:
    """The ways a log may hold ``blob``: hex in either case, base64 in both alphabets, with or
    without its padding, and as text where it is text."""
    b64 = base64.b64encode(blob).decode()
    found = [blob.hex(), blob.hex().upper(), b64, base64.urlsafe_b64encode(blob).decode(), b64.rstrip("=")]
    return found + ([blob.decode()] if text else [])


@given(st.text(max_size=7), st.text(max_size=7), st.sampled_from([KEY, API]), st.booleans())
def test_a_secret_inside_a_blob_is_gone_in_every_encoding(prefix: str, suffix: str, secret: str, raw: bool) -> None:
    """Whatever its offset and whatever surrounds it, no encoding of a blob that holds the secret
    (its text, or for a hex key the bytes it stands for) keeps a trace of it after redaction: the
    secret's text, its hex in any case and every base64 run fixed by it are gone."""
    raw = raw and secret == KEY
    held = bytes.fromhex(secret) if raw else secret.encode()
    blob = prefix.encode() + held + suffix.encode()
    r = Redactor([KEY, API])
    traces = {f.lower() for f in forms(secret)}
    for text in encodings(blob, text=not raw):
        out = r.text(f"line: {text} end")
        assert REDACTED in out, text
        left = out.lower()
        assert not any(t in left for t in traces), (text, out)


def test_only_the_secrets_are_replaced_and_the_rest_of_the_line_is_kept() -> None:
    r = Redactor([KEY, None, "", "short"])
    line = f"joined as stage 1 with key={KEY.upper()} at 10.0.0.2:4000"
    assert r.text(line) == f"joined as stage 1 with key={REDACTED} at 10.0.0.2:4000"
    assert r.text("short words and 0123456 stay") == "short words and 0123456 stay"  # under MIN_LENGTH
    assert r.lines(["a", KEY]) == ["a", REDACTED]
    assert not Redactor([None, "", "x" * (MIN_LENGTH - 1)]) and Redactor([KEY])


def test_bytes_secrets_are_matched_as_bytes_and_as_their_text() -> None:
    key = secrets.token_bytes(32)
    r = Redactor([key, API.encode()])
    assert r.text(f"k={key.hex()} b={base64.b64encode(b'x' + key).decode()}").count(REDACTED) == 2
    assert r.text(f"api {API}") == f"api {REDACTED}"
    # a key held as bytes and written as its hex text, that text then encoded again
    assert REDACTED in r.text(key.hex().encode().hex()) and REDACTED in r.text(
        base64.b64encode(key.hex().encode()).decode()
    )


def blob_holding(rng: random.Random, secret: str | bytes, raw: bool) -> bytes:
    """A blob that holds ``secret`` at a random offset: its bytes (``raw``: the bytes a hex
    secret stands for) between random bytes, or its text between words."""
    if isinstance(secret, bytes) or raw:
        held = secret if isinstance(secret, bytes) else bytes.fromhex(secret)
        return rng.randbytes(rng.randrange(70)) + held + rng.randbytes(rng.randrange(30))
    words = "user=bob; token: "
    return words[rng.randrange(len(words)) :].encode() + secret.encode() + b"; ok"


#: The encodings of the raw bytes a reader could not take for text (raw bytes written as Latin-1
#: text are not a form a program logs).
TEXT_ONLY = {"as written", "JSON \\u, every char", "JSON \\u, some chars"}


@pytest.mark.parametrize("name", sorted(ENCODINGS))
def test_no_encoding_of_a_secret_inside_a_record_can_be_read_back(name: str) -> None:
    """Random keys (a node key's 64 hex, as text and as the bytes it stands for; 32 raw bytes; an
    API key's text), each inside a blob at a random offset, the blob encoded as a log writes it,
    that text at a random place in a record of several lines: after redaction the oracle
    (tests/leakscan.py, which decodes apart from redact.py) reads none of the key back, and the
    record around it is kept."""
    rng = random.Random(name)
    for _ in range(25):
        for secret, raw in [
            (secrets.token_hex(32), False),
            (secrets.token_hex(32), True),
            (secrets.token_bytes(32), True),
            ("ak_" + secrets.token_urlsafe(24), False),
        ]:
            if raw and name in TEXT_ONLY:
                continue
            head = "2026-12-06 10:04:17 INFO node 3 said"[: rng.randrange(8, 37)]
            record = f"{head}: {ENCODINGS[name](blob_holding(rng, secret, raw))} (end)\n  next: 10.0.0.2:4000"
            assert recovered(record, [secret]), (name, record)  # the oracle sees it before
            out = Redactor([secret, API]).text(record)
            assert recovered(out, [secret]) == [], (name, record, out)
            assert out.startswith(head) and out.endswith("(end)\n  next: 10.0.0.2:4000"), (record, out)


def test_two_secrets_in_one_record_are_both_gone() -> None:
    key, api = secrets.token_hex(32), "ak_" + secrets.token_urlsafe(24)
    record = "\n".join(
        [
            f"key {binascii.hexlify(bytes.fromhex(key), ':').decode()}",
            f"auth {urllib.parse.quote(base64.b64encode(b'Bearer ' + api.encode()).decode(), safe='')}",
            base64.encodebytes(b"cfg" + bytes.fromhex(key) + api.encode()).decode(),
        ]
    )
    out = Redactor([key, api]).text(record)
    assert recovered(out, [key, api]) == [] and out.startswith("key [redacted]\nauth "), out


def test_text_without_a_secret_comes_back_unchanged() -> None:
    """Lines with every kind of escape, separator and line break, but none of the secrets, are
    returned as they are, character for character."""
    rng = random.Random(3)
    others = [secrets.token_bytes(32) for _ in range(3)]
    noise = [ENCODINGS[name](rng.choice(others)) for name in sorted(ENCODINGS)]
    r = Redactor([KEY, API, secrets.token_bytes(32)])
    lines = [
        *noise,
        "\n".join(noise),
        "GET /v1/x?q=a%20b%2F%zz 200 \"C:\\\\path\\/to\" \\u00e9\\x41 \\n b'\\x00\\''",
        "2026-12-06 10:04:17.203 peer 3f:a1:00:9c:de:ad:be:ef aa bb cc dd ee ff 00 11 22 33",
        "naïve ünïcödé \u2603 \r\n\tindent \\ % \\u12 %4",
        "",
    ]
    for line in lines:
        assert r.text(line) == line
        assert r.lines([line, line]) == [line, line]


def test_a_long_line_of_the_slow_paths_redacts_as_its_pieces_do() -> None:
    """A line of the kinds of text that take the slow paths (escapes, hex pairs with separators,
    wrapped lines), a hundred units long with a secret in the middle, comes out as its pieces do,
    secret and all. Its cost per character, from 100 to 100,000 characters, is the benchmark's
    (bench/bench_redact.py, ``linear``): a test asserts no timing."""
    key = secrets.token_bytes(32)
    r = Redactor([KEY, API, key])
    unit = "a%2Fb\\u0041 de:ad:be:ef:00:11:22:33\nQUJD+/== x " * 10
    secret = f" {key.hex()} "
    line = unit * 50 + secret + unit * 50
    assert r.text(line) == r.text(unit) * 50 + r.text(secret) + r.text(unit) * 50
    assert key.hex() not in r.text(line) and REDACTED in r.text(line)

"""Secrets out of text, in every form a log may hold them: as written, hex in either case,
base64 (standard and URL-safe) at any offset inside a larger blob."""

from __future__ import annotations

import base64
import secrets

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pytest_ppsmoke.redact import MIN_LENGTH, REDACTED, Redactor, forms

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

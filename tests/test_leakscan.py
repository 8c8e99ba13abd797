"""The redaction tests' oracle (tests/leakscan.py) has teeth: it reads a secret back from every
encoding the tests write it in, and reads nothing back from ordinary log text."""

from __future__ import annotations

import random
import secrets

import pytest

from .leakscan import ENCODINGS, recovered

pytestmark = pytest.mark.local

LOG = """2026-12-06 10:04:17.203 INFO node stage 1 joined 10.0.0.2:4000 (peer 3f:a1:00:9c)
2026-12-06 10:04:17.311 DEBUG swim: ping 7 acked in 12.5 ms; members [0, 1, 2]
{"level": "info", "msg": "loaded 30 blocks in 4.1 s", "path": "C:\\\\cache\\/weights", "pct": "50%"}
b'\\x00\\x01ready' -- GET /v1/status?q=a%20b&x=%2F 200; sha256 e3b0c44298fc1c149afbf4c8996fb924
-----BEGIN CERTIFICATE-----
TUlJQkl6Q0IwS2dBd0lCQWdJVUVmK2R1VmJ0Y1c1b3VoZGFhTnZ5N1pXWjRjOHd3
-----END CERTIFICATE-----
"""


def written(rng: random.Random, secret: str | bytes, raw: bool) -> bytes:
    """A blob that holds ``secret`` at a random offset: its bytes (``raw``: the bytes a hex
    secret stands for), between random bytes or, for text, random words."""
    held = secret if isinstance(secret, bytes) else bytes.fromhex(secret) if raw else secret.encode()
    if raw or isinstance(secret, bytes):
        return rng.randbytes(rng.randrange(60)) + held + rng.randbytes(rng.randrange(20))
    words = "user=bob; token="
    return words[rng.randrange(len(words)) :].encode() + held + b"; ok"


@pytest.mark.parametrize("name", sorted(ENCODINGS))
def test_the_oracle_reads_the_secret_back_from_every_encoding(name: str) -> None:
    rng = random.Random(name)
    for _ in range(20):
        for secret, raw in [
            (secrets.token_hex(32), False),
            (secrets.token_hex(32), True),
            (secrets.token_bytes(32), True),
            ("ak_" + secrets.token_urlsafe(24), False),
        ]:
            if name in {"as written", "JSON \\u, every char", "JSON \\u, some chars"} and raw:
                continue  # raw bytes as Latin-1 text: read back only through Latin-1, tried below
            text = f"2026-12-06 node said: {ENCODINGS[name](written(rng, secret, raw))} (end)\nnext line"
            assert recovered(text, [secret]), (name, text)


def test_the_oracle_reads_raw_bytes_written_as_latin_1_text() -> None:
    key = secrets.token_bytes(32)
    for name in ("as written", "JSON \\u, every char", "JSON \\u, some chars"):
        assert recovered("x " + ENCODINGS[name](b"ab" + key) + " y", [key]), name


def test_the_oracle_reads_nothing_back_from_ordinary_log_text() -> None:
    rng = random.Random(7)
    others = [secrets.token_bytes(32) for _ in range(3)]
    noise = "\n".join(ENCODINGS[name](rng.choice(others)) for name in sorted(ENCODINGS))
    for _ in range(50):
        mine = [secrets.token_hex(32), secrets.token_bytes(32), "ak_" + secrets.token_urlsafe(24)]
        assert recovered(LOG + noise, mine) == []
    assert recovered(LOG, [LOG.split()[3]]) == []  # shorter than the window: not taken for a secret


def test_a_window_is_enough() -> None:
    key = secrets.token_bytes(32)
    assert recovered("x" + key[10:18].hex() + "y", [key])
    assert recovered("x" + key.hex()[10:18] + "y", [key])  # a bytes key's hex text is a target too
    assert not recovered("x" + key[10:17].decode("latin-1") + key.hex()[10:17] + "y", [key])

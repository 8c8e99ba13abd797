"""The node's failpoints that write into its own log: ``node.say`` (a marker line, so that a
test can find this node's words in the tail the orchestrator collects) and ``node.log_secrets``
(the process's own keys in every encoding a log line carries, written every way a process writes,
so that a test can check that nothing the node writes, nor any reader of it, lets one through).

Both log at WARNING: the node's log level (``PP_LOG_LEVEL``) is WARNING unless set otherwise."""

from __future__ import annotations

import base64
import logging
import sys
import textwrap
import traceback
import urllib.parse
import warnings

from .. import failpoints
from ..nodeenv import NodeEnv

log = logging.getLogger(__name__)


def say(when: str) -> None:
    """The failpoint ``node.say``: ``marker: <word> (<when>)``."""
    if failpoints.on("node.say"):
        log.warning("marker: %s (%s)", failpoints.value("node.say"), when)


def log_secrets(env: NodeEnv, stdout: bool = True) -> None:
    """The failpoint ``node.log_secrets``: each key the process holds (the node's key, as its hex
    text and as its bytes; the container key) in every encoding a log line may carry
    (:func:`encodings`), written every way a process writes: one log record of many lines, a
    traceback, a warning, and plain prints to stderr and stdout. Each line begins
    ``node.log_secrets:`` so that a test can find what is left of it. ``stdout``: False in a
    worker, whose stdout is its pipe to the node."""
    if not failpoints.on("node.log_secrets"):
        return
    keys: dict[str, str | bytes] = {"container key": env.container_api_key}
    if env.node_key:
        keys |= {"node key": env.node_key.hex(), "node key's bytes": env.node_key}
    lines = [
        f"node.log_secrets: {name} {how}: {text}" for name, key in keys.items() if key for how, text in encodings(key)
    ]
    if not lines:
        return
    record = "\n".join(lines)
    log.warning("%s", record)  # one record of many lines, wrapped blocks inside it
    try:
        raise ValueError(record)
    except ValueError:
        log.exception("node.log_secrets: a traceback")  # through logging
        traceback.print_exc()  # and straight to stderr
    warnings.warn(f"node.log_secrets: a warning\n{record}", UserWarning, stacklevel=1)
    print(record, file=sys.stderr, flush=True)
    if stdout:
        print(record, flush=True)  # stdout is in vast.ai's logs too


def encodings(key: str | bytes) -> list[tuple[str, str]]:
    """``key`` as a log line may carry it, each with its name: as written and URL-quoted; in
    base64 (standard and URL-safe, alone and inside a blob at each offset, URL-quoted,
    JSON-escaped, wrapped at 64 and 76 columns); in hex (either case, with and without a
    separator between bytes); as Python's repr of its bytes; in JSON ``\\u`` escapes."""
    raw = key if isinstance(key, bytes) else key.encode()
    out: list[tuple[str, str]] = []
    if isinstance(key, str):
        out += [("as written", key), ("URL-quoted", urllib.parse.quote(key, safe=""))]
        out.append(("in JSON \\u escapes", "".join(f"\\u{ord(c):04x}" for c in key)))
    for k in range(3):
        blob = b"x="[:k] + raw + b"}"
        std, url = base64.b64encode(blob).decode(), base64.urlsafe_b64encode(blob).decode()
        out += [(f"in base64 at offset {k}", std), (f"in URL-safe base64 at offset {k}", url)]
        out.append((f"in URL-quoted base64 at offset {k}", urllib.parse.quote(std, safe="")))
        out.append((f"in JSON-escaped base64 at offset {k}", std.replace("/", "\\/")))
    long = base64.b64encode(b"header:" + raw * 3).decode()
    out.append(("in base64 wrapped at 76", "\n" + base64.encodebytes(b"header:" + raw * 3).decode().rstrip()))
    out.append(("in base64 wrapped at 64", "\n" + "\n".join(textwrap.wrap(long, 64))))
    hexed = raw.hex()
    out += [("in hex", hexed), ("in upper hex", hexed.upper())]
    out += [(f"in hex split by {sep!r}", raw.hex(sep)) for sep in (":", " ", "-")]
    out.append(("in upper hex split by ':'", raw.hex(":").upper()))
    out.append(("as bytes' repr", repr(raw)))
    return out

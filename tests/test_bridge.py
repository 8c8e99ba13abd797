"""The worker's payload framing, through ``WorkerBridge`` against the real worker on the session's
synthetic model, and against stand-in workers for what a real one never sends (an old worker
without the framing, a reply cut into pieces, a reply that cannot be framed)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from pytest_ppsmoke.messages import Hidden, digest
from pytest_ppsmoke.stage.bridge import WorkerBridge, WorkerDied, WorkerError

from .helpers import SYNTH

pytestmark = pytest.mark.local

WORKER = Path(__file__).resolve().parent.parent / "worker" / "pp_tinygrad_worker.py"
ROW = SYNTH.dim * 2  # bytes of one position in bf16


def _env(model: str, stage: int) -> dict[str, str]:
    return {**os.environ, "MODEL": model, "STAGE": str(stage), "NUM_STAGES": "2", "PP_WIRE_DTYPE": "bf16"}


@pytest.fixture
async def stages(synth_model: str) -> AsyncIterator[tuple[WorkerBridge, WorkerBridge]]:
    bridges = [WorkerBridge([sys.executable, str(WORKER)], _env(synth_model, i), f"s{i}") for i in (0, 1)]
    try:
        await asyncio.gather(*(b.start(120) for b in bridges))
        yield bridges[0], bridges[1]
    finally:
        for b in bridges:
            await b.close()


async def test_the_framings_carry_the_same_bytes_digests_and_tokens(stages: tuple[WorkerBridge, WorkerBridge]) -> None:
    """The worker offers the payload framing and the bridge takes it; a prefill and decode steps
    sent in one framing and then again in the other (the framing is per request) give the same
    raw bytes, the same digests (of those bytes, as before base64) and the same tokens."""
    s0, s1 = stages
    assert s0.ready is not None and s0.ready["framing"] == ["json", "payload"]
    assert (s0.framing, s1.framing) == ("payload", "payload")
    ids = (await s0.call("tokenize", 30, prompt="Say hello"))["token_ids"]
    seen: dict[str, list[tuple[bytes, str, str, int]]] = {}
    for framing in ("payload", "json", "payload"):
        s0.framing = s1.framing = framing
        h = await s0.call("embed_and_forward", 60, tokens=ids, position=0, prefill=True)
        steps = []
        for i in range(4):
            position = 0 if i == 0 else len(ids) + i - 1
            seq_len = len(ids) if i == 0 else 1
            assert len(h["hidden"]) == seq_len * ROW and h["hidden_digest"] == digest(h["hidden"]).hex()
            assert ("hidden_b64" in h) == (framing == "json")
            r = await s1.call("forward_and_sample", 60, hidden=h["hidden"], seq_len=seq_len, position=position)
            assert r["received_digest"] == h["hidden_digest"], f"step {i} in {framing}"
            steps.append((h["hidden"], h["hidden_digest"], r["received_digest"], r["token_id"]))
            h = await s0.call("decode_step", 60, token_id=r["token_id"], position=len(ids) + i)
        seen.setdefault(framing, steps)
    assert seen["payload"] == seen["json"]


async def test_bad_payloads_are_errors_that_name_the_value_and_the_worker_goes_on(
    stages: tuple[WorkerBridge, WorkerBridge],
) -> None:
    s0, s1 = stages
    good = Hidden.from_array(np.ones((1, SYNTH.dim), np.float32), "bf16").data
    cases = [
        ({"hidden": good[:10]}, f"payload of 10 bytes: hidden state of shape (1, {SYNTH.dim}) in bf16 needs {ROW}"),
        ({"hidden": good + good}, f"payload of {2 * ROW} bytes: hidden state of shape (1, {SYNTH.dim})"),
        ({}, f"payload of 0 bytes: hidden state of shape (1, {SYNTH.dim}) in bf16 needs {ROW} bytes, got 0"),
    ]
    for extra, message in cases:
        with pytest.raises(WorkerError, match="forward_and_sample: ") as err:
            await s1.call("forward_and_sample", 30, seq_len=1, position=0, **extra)  # type: ignore[arg-type]
        assert message in str(err.value)
    with pytest.raises(WorkerError, match="tokenize takes no hidden state, got a payload of 5 bytes"):
        await s0.call("tokenize", 30, hidden=b"12345", prompt="hi")
    with pytest.raises(ValueError, match="forward_and_sample: pass the hidden state once, as hidden or as hidden_b64"):
        await s1.call("forward_and_sample", 30, hidden=good, hidden_b64="AAAA", seq_len=1, position=0)
    # still framed and serving
    r = await s1.call("forward_and_sample", 30, hidden=good, seq_len=1, position=0)
    assert r["received_digest"] == digest(good).hex() and 0 <= r["token_id"] < SYNTH.vocab


@pytest.mark.parametrize(
    ("request_bytes", "message"),
    [
        (b'{"op": "kv_info", "request_id": 1, "payload": "ten"}\n',
         "payload must be a byte count in [0, 268435456], got 'ten'; the bytes after this line cannot be framed"),
        (b'{"op": "kv_info", "request_id": 1, "payload": -1}\n',
         "payload must be a byte count in [0, 268435456], got '-1'"),
        (b'{"op": "forward_and_sample", "request_id": 1, "seq_len": 1, "position": 0, "payload": 64}\n' + b"x" * 10,
         "stdin ended after 10 of the payload's 64 bytes"),
    ],
)  # fmt: skip
def test_a_stream_that_cannot_be_framed_is_answered_and_the_worker_exits(
    request_bytes: bytes, message: str, synth_model: str
) -> None:
    """No hang: the worker answers with the error, names it on stderr and exits with status 3."""
    proc = subprocess.Popen(
        [sys.executable, str(WORKER)], env=_env(synth_model, 1),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = proc.communicate(request_bytes, timeout=120)
    ready, reply = (json.loads(line) for line in out.splitlines())
    assert ready["status"] == "ready" and reply["request_id"] == 1 and message in reply["error"], reply
    assert proc.returncode == 3 and message in err.decode()


def test_a_payload_beside_hidden_b64_is_an_error_and_the_stream_stays_framed(synth_model: str) -> None:
    """The worker reads the payload it was announced before it refuses the request: the next
    request line is read as one."""
    proc = subprocess.Popen(
        [sys.executable, str(WORKER)], env=_env(synth_model, 1),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    both = {"op": "forward_and_sample", "request_id": 1, "seq_len": 1, "position": 0, "hidden_b64": "AAAA"}
    payload = b"\n{}\n" + bytes(ROW - 4)  # bytes that would read as request lines if left unread
    stream = json.dumps({**both, "payload": ROW}).encode() + b"\n" + payload + b'{"op": "kv_info", "request_id": 2}\n'
    out, _ = proc.communicate(stream, timeout=120)
    ready, refused, info = (json.loads(line) for line in out.splitlines())
    assert ready["status"] == "ready" and proc.returncode == 0
    assert refused["request_id"] == 1 and f"a payload of {ROW} bytes and hidden_b64 both" in refused["error"], refused
    assert info["request_id"] == 2 and "error" not in info, info


# --- stand-in workers: the bridge's side of the framing -------------------------------------------

# A worker of a few lines: ready (with or without the payload framing), then for each request an
# echo of its hidden state (payload or hidden_b64) reversed, in the request's framing. A request
# with "split": the reply's bytes go out one at a time; "bad": a reply header that cannot be framed;
# "shutdown": the reply, then exit.
STAND_IN = r"""
import base64, json, sys, time
offer = sys.argv[1] == "payload"
inp, out = sys.stdin.buffer, sys.stdout.buffer
out.write(json.dumps({"status": "ready", **({"framing": ["json", "payload"]} if offer else {})}).encode() + b"\n")
out.flush()
while line := inp.readline():
    req = json.loads(line)
    framed = "payload" in req
    data = inp.read(req["payload"]) if framed else base64.b64decode(req.get("hidden_b64", ""))
    reply = {"request_id": req["request_id"], "fields": sorted(req)}
    if framed:
        reply["payload"] = "bad" if req.get("bad") else len(data)
        blob = json.dumps(reply).encode() + b"\n" + data[::-1]
    else:
        blob = json.dumps({**reply, "hidden_b64": base64.b64encode(data[::-1]).decode()}).encode() + b"\n"
    for i in range(0, len(blob), 1 if req.get("split") else len(blob)):
        out.write(blob[i : i + (1 if req.get("split") else len(blob))])
        out.flush()
        if req.get("split"):
            time.sleep(0.001)
    if req["op"] == "shutdown":
        break
"""


async def _stand_in(offer: str, framing: str | None = None) -> WorkerBridge:
    bridge = WorkerBridge([sys.executable, "-c", STAND_IN, offer], dict(os.environ), "stand-in", framing)
    await bridge.start(30)
    return bridge


async def test_an_old_worker_gets_json_and_the_payload_framing_is_taken_when_offered() -> None:
    old, new, asked = await _stand_in("json"), await _stand_in("payload"), await _stand_in("payload", "json")
    try:
        assert (old.framing, new.framing, asked.framing) == ("json", "payload", "json")
        for bridge, sent in [(old, "hidden_b64"), (new, "payload"), (asked, "hidden_b64")]:
            r = await bridge.call("forward", 10, hidden=b"abc", seq_len=1)
            assert r["hidden"] == b"cba" and sent in r["fields"] and "hidden" not in r["fields"], (bridge.framing, r)
            assert "payload" not in r  # the count is the framing's, not the reply's
        r = await new.call("forward", 10, hidden_b64="YWJj", seq_len=1)  # a caller's own base64: sent as JSON
        assert r["hidden"] == b"cba" and "payload" not in r["fields"] and "hidden_b64" in r["fields"]
    finally:
        for b in (old, new, asked):
            await b.close()
    with pytest.raises(ValueError, match="framing must be json, payload or None"):
        WorkerBridge(["true"], {}, "x", "base64")
    with pytest.raises(ValueError, match=r"stand-in worker offers framing \['json'\], not 'payload'"):
        await _stand_in("json", "payload")


async def test_replies_in_pieces_concurrent_calls_and_a_payload_larger_than_the_pipe() -> None:
    """One write per request and no lock: concurrent calls (one of them 4 MiB, past the pipe's
    buffer, so that it drains) each get their own bytes back; a reply that arrives a byte at a
    time is put together."""
    bridge = await _stand_in("payload")
    try:
        blobs = [os.urandom(n) for n in (0, 1, 1000, 4 << 20, 7, 65536)]
        replies = await asyncio.gather(*(bridge.call("forward", 30, hidden=b) for b in blobs))
        assert [r["hidden"] for r in replies] == [b[::-1] for b in blobs]
        r = await bridge.call("forward", 30, hidden=b"0123456789", split=True)
        assert r["hidden"] == b"9876543210"
    finally:
        await bridge.close()


async def test_a_reply_that_cannot_be_framed_stops_the_worker_and_fails_the_call_with_why() -> None:
    bridge = await _stand_in("payload")
    try:
        with pytest.raises(WorkerDied, match="bridge: a reply announced a payload of 'bad' bytes; expected 0"):
            await bridge.call("forward", 30, hidden=b"abc", bad=True)
        with pytest.raises(WorkerDied):
            await bridge.call("forward", 30, hidden=b"abc")
    finally:
        await bridge.close()

"""The worker's payload framing, through ``WorkerBridge`` against the real worker on the session's
synthetic model, and against stand-in workers for what a real one never sends (an old worker
without the framing, a reply cut into pieces, a reply that cannot be framed)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

from pytest_ppsmoke.messages import Hidden, KvInfo, digest
from pytest_ppsmoke.stage.bridge import STDERR_BURST, WorkerBridge, WorkerDied, WorkerError
from pytest_ppsmoke.stage.pipe import (
    DecodeStep,
    EmbedAndForward,
    ErrorReply,
    Forward,
    ForwardAndSample,
    Framing,
    HiddenOut,
    Tokenize,
    answers,
    decode_ready,
    decode_reply,
)

from .helpers import SYNTH
from .leakscan import recovered

pytestmark = pytest.mark.local

WORKER = Path(__file__).resolve().parent.parent / "worker" / "pp_tinygrad_worker.py"
ROW = SYNTH.dim * 2  # bytes of one position in bf16


def _env(model: str, stage: int) -> dict[str, str]:
    return {**os.environ, "MODEL": model, "STAGE": str(stage), "NUM_STAGES": "2", "PP_WIRE_DTYPE": "bf16"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stages(synth_model: str) -> AsyncIterator[tuple[WorkerBridge, WorkerBridge]]:
    """Both stages' real workers, started once for the module's two tests that call them: each
    writes the KV history it reads from position 0 (a prefill, then each step's own position),
    so neither depends on what the other asked first."""
    bridges = [WorkerBridge([sys.executable, str(WORKER)], _env(synth_model, i), f"s{i}") for i in (0, 1)]
    try:
        await asyncio.gather(*(b.start(120) for b in bridges))
        yield bridges[0], bridges[1]
    finally:
        for b in bridges:
            await b.close()


@pytest.mark.asyncio(loop_scope="module")  # the loop of the module's workers (``stages``)
async def test_the_framings_carry_the_same_bytes_digests_and_tokens(stages: tuple[WorkerBridge, WorkerBridge]) -> None:
    """The worker offers the payload framing and the bridge takes it; a prefill and decode steps
    sent in one framing and then again in the other (the framing is per request) give the same
    raw bytes, the same digests (of those bytes, as before base64) and the same tokens."""
    s0, s1 = stages
    assert s0.ready is not None and s0.ready.framing == (Framing.json, Framing.payload)
    assert (s0.framing, s1.framing) == (Framing.payload, Framing.payload)
    ids = (await s0.call(Tokenize("Say hello"), 30)).token_ids
    seen: dict[Framing, list[tuple[bytes, bytes, bytes, int]]] = {}
    for framing in (Framing.payload, Framing.json, Framing.payload):
        s0.framing = s1.framing = framing
        h = await s0.call(EmbedAndForward(ids, 0, prefill=True), 60)
        steps = []
        for i in range(4):
            position = 0 if i == 0 else len(ids) + i - 1
            seq_len = len(ids) if i == 0 else 1
            assert len(h.hidden) == seq_len * ROW and h.hidden_digest == digest(h.hidden)
            r = await s1.call(ForwardAndSample(h.hidden, position, seq_len), 60)
            assert r.received_digest == h.hidden_digest, f"step {i} in {framing}"
            steps.append((h.hidden, h.hidden_digest, r.received_digest, r.token_id))
            h = await s0.call(DecodeStep(r.token_id, len(ids) + i), 60)
        seen.setdefault(framing, steps)
    assert seen[Framing.payload] == seen[Framing.json]


@pytest.mark.asyncio(loop_scope="module")  # the loop of the module's workers (``stages``)
async def test_bad_payloads_are_errors_that_name_the_value_and_the_worker_goes_on(
    stages: tuple[WorkerBridge, WorkerBridge],
) -> None:
    _, s1 = stages
    good = Hidden.from_array(np.ones((1, SYNTH.dim), np.float32), "bf16").data
    cases = [
        (good[:10], f"payload of 10 bytes: hidden state of shape (1, {SYNTH.dim}) in bf16 needs {ROW}"),
        (good + good, f"payload of {2 * ROW} bytes: hidden state of shape (1, {SYNTH.dim})"),
        (b"", f"payload of 0 bytes: hidden state of shape (1, {SYNTH.dim}) in bf16 needs {ROW} bytes, got 0"),
    ]
    for hidden, message in cases:
        with pytest.raises(WorkerError, match="forward_and_sample: ") as err:
            await s1.call(ForwardAndSample(hidden, 0, 1), 30)
        assert message in str(err.value)
    # still framed and serving
    r = await s1.call(ForwardAndSample(good, 0, 1), 30)
    assert r.received_digest == digest(good) and 0 <= r.token_id < SYNTH.vocab


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
    ready, line = answers(out.splitlines())
    reply = decode_reply(HiddenOut, line)
    assert decode_ready(ready).stage == 1 and reply.request_id == 1 and message in reply.error, reply
    assert proc.returncode == 3 and message in err.decode()


@pytest.mark.parametrize(
    ("fields", "payload", "message"),
    [
        ({"op": "forward_and_sample", "seq_len": 1, "position": 0, "hidden_b64": "AAAA"}, ROW,
         f"a payload of {ROW} bytes and hidden_b64 both"),
        ({"op": "tokenize", "prompt": "hi"}, 5, "tokenize takes no hidden state, got a payload of 5 bytes"),
    ],
)  # fmt: skip
def test_a_payload_the_request_cannot_take_is_an_error_and_the_stream_stays_framed(
    fields: dict[str, object], payload: int, message: str, synth_model: str
) -> None:
    """The worker reads the payload it was announced before it refuses the request: the next
    request line is read as one."""
    proc = subprocess.Popen(
        [sys.executable, str(WORKER)], env=_env(synth_model, 1),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    data = b"\n{}\n" + bytes(payload - 4)  # bytes that would read as request lines if left unread
    line = json.dumps({**fields, "request_id": 1, "payload": payload}).encode() + b"\n"
    stream = line + data + b'{"op": "kv_info", "request_id": 2}\n'
    out, _ = proc.communicate(stream, timeout=120)
    ready, refused, info = answers(out.splitlines())
    assert decode_ready(ready).stage == 1 and proc.returncode == 0
    error = decode_reply(KvInfo, refused)
    assert isinstance(error, ErrorReply) and error.request_id == 1 and message in error.error, error
    kv = decode_reply(KvInfo, info)
    assert isinstance(kv, KvInfo) and kv.stage == 1


# --- stand-in workers: the bridge's side of the framing -------------------------------------------

# A worker of a few lines: ready (with or without the payload framing), then for each request an
# echo of its hidden state (payload or hidden_b64) reversed, in the request's framing, as a
# HiddenOut whose received_digest is the request line's keys (JSON, hex) for the test to read.
# A hidden state that begins b"split": the reply's bytes go out one at a time; b"bad": a reply
# header that cannot be framed; a shutdown: the reply, then exit.
STAND_IN = r"""
import base64, json, os, sys, time
offer = sys.argv[1] == "payload"
inp, out = sys.stdin.buffer, sys.stdout.buffer
ready = {"status": "ready", "pid": os.getpid(), "stage": 0, "model": "stand-in", "wire_dtype": "bf16",
         "max_context": 8, "load_s": 0}
out.write(json.dumps({**ready, **({"framing": ["json", "payload"]} if offer else {})}).encode() + b"\n")
out.flush()
while line := inp.readline():
    req = json.loads(line)
    framed = "payload" in req
    data = inp.read(req["payload"]) if framed else base64.b64decode(req.get("hidden_b64", ""))
    keys = json.dumps(sorted(req)).encode().hex()
    reply = {"request_id": req["request_id"], "hidden_digest": "", "seq_len": 1, "dtype": "bf16"}
    reply["received_digest"] = keys
    split = data.startswith(b"split")
    if framed:
        reply["payload"] = "bad" if data == b"bad" else len(data)
        blob = json.dumps(reply).encode() + b"\n" + data[::-1]
    else:
        blob = json.dumps({**reply, "hidden_b64": base64.b64encode(data[::-1]).decode()}).encode() + b"\n"
    for i in range(0, len(blob), 1 if split else len(blob)):
        out.write(blob[i : i + (1 if split else len(blob))])
        out.flush()
        if split:
            time.sleep(0.001)
    if req["op"] == "shutdown":
        break
"""


async def _stand_in(offer: str, framing: Framing | None = None) -> WorkerBridge:
    bridge = WorkerBridge([sys.executable, "-c", STAND_IN, offer], dict(os.environ), "stand-in", framing)
    await bridge.start(30)
    return bridge


def _sent(r: HiddenOut) -> list[str]:
    """The keys of the request line the stand-in received."""
    assert r.received_digest is not None
    return list(json.loads(r.received_digest))


async def test_an_old_worker_gets_json_and_the_payload_framing_is_taken_when_offered() -> None:
    old, new = await _stand_in("json"), await _stand_in("payload")
    asked = await _stand_in("payload", Framing.json)
    try:
        assert (old.framing, new.framing, asked.framing) == (Framing.json, Framing.payload, Framing.json)
        for bridge, sent in [(old, "hidden_b64"), (new, "payload"), (asked, "hidden_b64")]:
            r = await bridge.call(Forward(b"abc", 0, 1), 10)
            assert r.hidden == b"cba" and sent in _sent(r) and "hidden" not in _sent(r), (bridge.framing, r)
    finally:
        for b in (old, new, asked):
            await b.close()
    with pytest.raises(ValueError, match="framing must be a Framing"):
        WorkerBridge(["true"], {}, "x", "base64")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"stand-in worker offers framing \['json'\], not 'payload'"):
        await _stand_in("json", Framing.payload)


async def test_replies_in_pieces_concurrent_calls_and_a_payload_larger_than_the_pipe() -> None:
    """One write per request and no lock: concurrent calls (one of them 4 MiB, past the pipe's
    buffer, so that it drains) each get their own bytes back; a reply that arrives a byte at a
    time is put together."""
    bridge = await _stand_in("payload")
    try:
        blobs = [os.urandom(n) for n in (0, 1, 1000, 4 << 20, 7, 65536)]
        replies = await asyncio.gather(*(bridge.call(Forward(b, 0, 1), 30) for b in blobs))
        assert [r.hidden for r in replies] == [b[::-1] for b in blobs]
        r = await bridge.call(Forward(b"split56789", 0, 1), 30)
        assert r.hidden == b"98765tilps"
    finally:
        await bridge.close()


SPEWER = r"""
import json, os, sys
print("worker-marker: loading", file=sys.stderr)
for i in range(250):
    print(f"spew {i}", file=sys.stderr)
sys.stderr.flush()
print(json.dumps({"status": "ready", "pid": os.getpid(), "stage": 0, "model": "stand-in", "wire_dtype": "bf16",
                  "max_context": 8, "load_s": 0}), flush=True)
sys.stdin.readline()  # the bridge's shutdown: exit
"""


async def test_the_workers_stderr_is_in_the_nodes_log_within_its_budget(caplog: pytest.LogCaptureFixture) -> None:
    """Each stderr line of the worker is logged by the node, so that it reaches the node's own
    log (its stderr, its log ring); a worker that spews gets a burst of lines logged, and the
    rest are counted, never silently dropped: the logged lines and the counts said add up to
    every line written, whatever the timing."""
    bridge = WorkerBridge([sys.executable, "-c", SPEWER], dict(os.environ), "spewer")
    with caplog.at_level(logging.INFO, "pytest_ppsmoke.stage.bridge"):
        await bridge.start(30)
        await bridge.close()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("spewer worker: ")]
    assert said[0] == "spewer worker: worker-marker: loading", said[:3]
    logged = [m for m in said if "its stderr ended" not in m]
    held = sum(int(n) for m in said for n in re.findall(r"(\d+) lines (?:of its stderr|were) not logged", m))
    assert len(logged) >= STDERR_BURST and len(logged) + held == 251, (len(logged), held, said[-2:])
    assert bridge.stderr_tail().endswith("spew 249")


async def test_a_reply_that_cannot_be_framed_stops_the_worker_and_fails_the_call_with_why() -> None:
    bridge = await _stand_in("payload")
    try:
        with pytest.raises(WorkerDied, match="bridge: a reply that cannot be framed: payload must be a byte count"):
            await bridge.call(Forward(b"bad", 0, 1), 30)
        with pytest.raises(WorkerDied):
            await bridge.call(Forward(b"abc", 0, 1), 30)
    finally:
        await bridge.close()


def test_a_worker_handed_keys_writes_none_of_them_raw(synth_model: str) -> None:
    """A worker holds no key (``NodeEnv.for_worker``), except under the test failpoint
    ``node.log_secrets``, which hands it the node's and makes it write them in every encoding,
    every way it writes: its own stdout and stderr, read raw here, hold none that can be decoded
    (``leakscan``), and it still loads and answers."""
    node_key, api_key = secrets.token_bytes(32), secrets.token_hex(32)
    env = {
        **_env(synth_model, 1),
        "PP_FAILPOINTS": "node.log_secrets",
        "PP_NODE_KEY": node_key.hex(),
        "CONTAINER_API_KEY": api_key,
    }
    proc = subprocess.run(
        [sys.executable, str(WORKER)], env=env, input=b'{"op": "shutdown", "request_id": 1}\n',
        capture_output=True, timeout=120,
    )  # fmt: skip
    out, err = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    assert proc.returncode == 0 and answers(out.splitlines())[-1]["status"] == "bye", err[-2000:]
    assert sum("node.log_secrets:" in ln for ln in err.splitlines()) > 100, err[-2000:]
    assert "Traceback" in err and "UserWarning" in err and "[redacted]" in err, err[-2000:]
    for where, text in (("stdout", out), ("stderr", err)):
        assert not recovered(text, [node_key, api_key]), (where, recovered(text, [node_key, api_key])[:3])

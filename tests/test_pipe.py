"""The node<->worker pipe's records (``stage/pipe.py``): each operation, each reply and the ready
line through its encoder and decoder in both framings; a malformed field named by the decoder;
and the node's bridge exchanging every operation with real workers (three stages of a synthetic
model, so that a middle stage answers ``forward`` too)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pytest_ppsmoke.messages import (
    BlockCache,
    Hidden,
    KvInfo,
    ReferenceResult,
    Span,
    WeightLoad,
    WireDtype,
    digest,
)
from pytest_ppsmoke.stage.bridge import WorkerBridge
from pytest_ppsmoke.stage.pipe import (
    OPS,
    Bye,
    CacheUse,
    DecodeStep,
    Detokenize,
    EmbedAndForward,
    ErrorReply,
    Forward,
    ForwardAndSample,
    Framing,
    HiddenOut,
    PipeError,
    ReadKvInfo,
    Ready,
    Request,
    RunReference,
    Sampled,
    Shutdown,
    Text,
    TokenIds,
    Tokenize,
    Unframeable,
    decode_ready,
    decode_reply,
    decode_request,
    encode_error,
    encode_ready,
    encode_reply,
    encode_request,
    payload_size,
    worker_seconds,
)
from pytest_ppsmoke.stage.synth import Shape, write

pytestmark = pytest.mark.local

WORKER = Path(__file__).resolve().parent.parent / "worker" / "pp_tinygrad_worker.py"
RAW = bytes(range(64))
DIGEST = digest(RAW)

REQUESTS: list[Request[Any]] = [
    EmbedAndForward((1, 2, 3), 0, prefill=True),
    DecodeStep(42, 11),
    Forward(RAW, 3, 1, prefill=False, dtype=WireDtype.bf16),
    ForwardAndSample(RAW, 0, 2, prefill=True),
    Tokenize("Say hello"),
    Detokenize((57, 5248, 2)),
    ReadKvInfo(),
    RunReference("Say hello", 64),
    Shutdown(),
]

WEIGHTS = WeightLoad("cache", 0.98, 1 << 20, "/c/w.bin", "", "f16", 1)
REPLIES: list[Any] = [
    HiddenOut(RAW, DIGEST, 1, WireDtype.bf16),
    HiddenOut(RAW, DIGEST, 2, WireDtype.f32, received_digest=digest(b"in")),
    Sampled(17, DIGEST),
    TokenIds((1, 520, 9531, 198)),
    Text("I'm"),
    KvInfo(1, 1, 2, 4, (Span(0, 5),), (BlockCache(1, True, True, True, (2, 1, 8, 4), (Span(0, 5),), DIGEST, DIGEST),)),
    ReferenceResult(0, "unsplit", "CPU", (1, 2), (3, 4), 0.5, 0.25, 10, 20, WEIGHTS, "beside"),
    Bye(CacheUse(41, 0, 0.5, ("a write failed",)), CacheUse(3, 1)),
    Bye(),
]

READY = Ready(
    1234, 1, "smollm2:135m", WireDtype.bf16, 1024, 3.25, tuple(Framing), weights=WEIGHTS,
    programs=CacheUse(41, 0), schedules=CacheUse(2, 0), num_stages=2, range=Span(15, 30),
    num_blocks=30, dim=576, end_ids=(2,), jit=True, param_bytes=10, warm_up_s=1.5, wall_s=9.0,
    imports_s=1.25, device_s=0.5, build_s=0.125,
)  # fmt: skip


def _split(data: bytes) -> tuple[dict[str, Any], bytes | None]:
    """A line and the payload it announces, as the other side reads them."""
    line, _, rest = data.partition(b"\n")
    obj = json.loads(line)
    n = payload_size(obj)
    assert rest == (b"" if n is None else rest) and (n is None or len(rest) == n), (n, len(rest))
    return obj, (rest if n is not None else None)


def test_every_operation_has_a_record_here() -> None:
    assert sorted(OPS) == sorted(type(r).op for r in REQUESTS)
    spec = "embed_and_forward decode_step forward forward_and_sample tokenize detokenize kv_info reference shutdown"
    assert sorted(OPS) == sorted(spec.split())


@pytest.mark.parametrize("framing", list(Framing))
@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: type(r).op)
def test_each_request_round_trips_in_each_framing(request_: Request[Any], framing: Framing) -> None:
    obj, payload = _split(encode_request(7, request_, framing))
    assert (obj["op"], obj["request_id"]) == (request_.op, 7)
    if hasattr(request_, "hidden"):
        assert ("hidden_b64" in obj) == (framing is Framing.json) and (payload == RAW) == (framing is Framing.payload)
    assert decode_request(obj, payload) == request_


@pytest.mark.parametrize("framing", list(Framing))
@pytest.mark.parametrize("reply", REPLIES, ids=lambda r: type(r).__name__)
def test_each_reply_round_trips_in_each_framing(reply: Any, framing: Framing) -> None:
    obj, payload = _split(encode_reply(7, reply, framing, worker_s=0.125))
    assert obj["request_id"] == 7 and worker_seconds(obj) == 0.125
    assert decode_reply(type(reply), obj, payload) == reply


def test_the_spec_shapes_are_the_json_lines() -> None:
    """The spec's worker section: a request names its op and fields; a reply carries
    ``hidden_b64`` and ``seq_len``, or ``token_id``."""
    obj, _ = _split(encode_request(1, EmbedAndForward((1, 2), 0), Framing.json))
    assert obj == {"op": "embed_and_forward", "request_id": 1, "tokens": [1, 2], "position": 0, "prefill": False}
    obj, _ = _split(encode_reply(1, HiddenOut(RAW, DIGEST, 1, WireDtype.bf16), Framing.json))
    assert {"hidden_b64", "seq_len", "hidden_digest", "dtype"} <= obj.keys() and obj["dtype"] == "bf16"
    obj, _ = _split(encode_reply(1, Sampled(1234, DIGEST), Framing.json))
    assert obj == {"request_id": 1, "token_id": 1234, "received_digest": DIGEST.hex()}


def test_the_ready_line_and_an_error_round_trip() -> None:
    obj = json.loads(encode_ready(READY))
    assert obj["status"] == "ready" and obj["range"] == [15, 30] and obj["framing"] == ["json", "payload"]
    assert decode_ready(obj) == READY
    minimal = {"status": "ready", "pid": 1, "stage": 0, "model": "m", "wire_dtype": "f16", "max_context": 8}
    minimal["load_s"] = 1
    assert decode_ready(minimal).framing == (Framing.json,)  # a worker without the payload framing
    error = json.loads(encode_error(5, "tokenize", "tokenize: prompt must be a string, got int"))
    assert decode_reply(TokenIds, error) == ErrorReply(5, "tokenize", "tokenize: prompt must be a string, got int")


def _bad(value: Any) -> Any:
    """A value no field of any type accepts."""
    return {"not": value}


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: type(r).op)
def test_a_malformed_or_missing_request_field_is_named(request_: Request[Any]) -> None:
    obj, payload = _split(encode_request(7, request_, Framing.payload))
    for f in dataclasses.fields(request_):  # type: ignore[arg-type]
        if f.name == "hidden":
            continue
        with pytest.raises(PipeError, match=rf"^{f.name}\b"):
            decode_request({**obj, f.name: _bad(obj.get(f.name))}, payload)
        if f.default is dataclasses.MISSING:
            with pytest.raises(PipeError, match=f"missing field '{f.name}'"):
                decode_request({k: v for k, v in obj.items() if k != f.name}, payload)


@pytest.mark.parametrize("reply", REPLIES, ids=lambda r: type(r).__name__)
def test_a_malformed_reply_field_is_named(reply: Any) -> None:
    obj, payload = _split(encode_reply(7, reply, Framing.payload))
    for f in dataclasses.fields(reply):
        if f.name in ("hidden", "weights") or f.name not in obj:
            continue
        with pytest.raises(PipeError, match=rf"\b{f.name}\b"):
            decode_reply(type(reply), {**obj, f.name: _bad(obj[f.name])}, payload)


def test_the_requests_own_checks_name_the_value() -> None:
    line = {"op": "forward_and_sample", "request_id": 1, "position": 0, "seq_len": 1}
    cases = [
        ({"op": "fly"}, None, "unknown op 'fly'; expected one of embed_and_forward, decode_step"),
        ({"position": -1, "hidden_b64": ""}, None, "position must be a non-negative integer, got -1"),
        ({"prefill": 1, "hidden_b64": ""}, None, "prefill must be true or false, got 1"),
        ({"dtype": "fp8", "hidden_b64": ""}, None, "dtype: unknown wire dtype 'fp8'"),
        ({"hidden_b64": "!!!"}, None, "hidden_b64 is not valid base64"),
        ({}, None, "missing field 'hidden_b64' (or a payload) in forward_and_sample"),
        ({"hidden_b64": "AAAA"}, b"12", "a payload of 2 bytes and hidden_b64 both"),
        ({"op": "tokenize", "prompt": 5}, None, "prompt must be a string, got int"),
        ({"op": "tokenize", "prompt": "hi"}, b"12345", "tokenize takes no hidden state, got a payload of 5 bytes"),
        ({"op": "detokenize", "token_ids": [1, -2]}, None, "token_ids[1] must be a non-negative integer, got -2"),
    ]
    for extra, payload, message in cases:
        with pytest.raises(PipeError) as err:
            decode_request({**line, **extra}, payload)
        assert message in str(err.value)
    with pytest.raises(PipeError, match="a request must be a JSON object, got list"):
        decode_request([1, 2])
    for n in ("ten", -1, True, (256 << 20) + 1):
        with pytest.raises(Unframeable, match="payload must be a byte count in"):
            payload_size({"payload": n})


# --- a real bridge and real workers: every operation ------------------------------------------------

THREE = Shape(blocks=3, dim=32, heads=2, kv_heads=1, ffn=64, vocab=320, context=1024)


@pytest.fixture(scope="module")
def three_stage_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("models") / "synth-3x32.gguf"
    write(path, THREE, 7)
    return str(path)


@pytest.fixture
async def three(three_stage_model: str) -> AsyncIterator[list[WorkerBridge]]:
    """Stages 0, 1 (a middle one) and 2 of three, uncompiled (``PP_JIT=0``: no warm-up)."""
    env = {**os.environ, "MODEL": three_stage_model, "NUM_STAGES": "3", "PP_WIRE_DTYPE": "bf16", "PP_JIT": "0"}
    bridges = [WorkerBridge([sys.executable, str(WORKER)], {**env, "STAGE": str(i)}, f"s{i}") for i in range(3)]
    try:
        await asyncio.gather(*(b.start(120) for b in bridges))
        yield bridges
    finally:
        for b in bridges:
            await b.close()


async def test_a_bridge_and_real_workers_exchange_every_operation(three: list[WorkerBridge]) -> None:
    s0, s1, s2 = three
    for i, b in enumerate(three):
        assert b.ready is not None and (b.ready.stage, b.ready.num_stages, b.ready.dim) == (i, 3, THREE.dim)
        assert b.ready.wire_dtype is WireDtype.bf16 and b.ready.range == Span(i, i + 1)
        assert b.ready.framing == tuple(Framing) and b.framing is Framing.payload
    ids = (await s0.call(Tokenize("Say hello"), 30)).token_ids
    assert ids and all(0 <= t < THREE.vocab for t in ids)
    for framing in Framing:  # each framing carries the same records
        for b in three:
            b.framing = framing
        h0 = await s0.call(EmbedAndForward(ids, 0, prefill=True), 60)
        assert (h0.seq_len, h0.dtype, h0.hidden_digest) == (len(ids), WireDtype.bf16, digest(h0.hidden))
        h1 = await s1.call(Forward(h0.hidden, 0, len(ids), prefill=True, dtype=WireDtype.bf16), 60)
        assert h1.received_digest == h0.hidden_digest and h1.seq_len == len(ids)
        sampled, worker_s = await s2.timed_call(ForwardAndSample(h1.hidden, 0, len(ids), prefill=True), 60)
        assert sampled.received_digest == h1.hidden_digest and 0 <= sampled.token_id < THREE.vocab
        assert worker_s is not None and worker_s >= 0
        step = await s0.call(DecodeStep(sampled.token_id, len(ids)), 60)
        assert step.seq_len == 1 and len(step.hidden) == THREE.dim * 2
        assert Hidden(int(WireDtype.bf16), (1, THREE.dim), step.hidden).to_array().shape == (1, THREE.dim)
    text = await s2.call(Detokenize((sampled.token_id,)), 30)
    assert isinstance(text.text, str)
    info = await s1.call(ReadKvInfo(), 30)
    assert (info.stage, info.first_block, info.end_block, info.prefill_len) == (1, 1, 2, len(ids))
    ref = await s2.call(RunReference("Say hello", 2), 120)
    assert ref.stage == 2 and ref.prompt_token_ids == ids and len(ref.token_ids) == 2
    bye = await s1.call(Shutdown(), 30)
    assert isinstance(bye, Bye)
    assert s1.proc is not None and await asyncio.wait_for(s1.proc.wait(), 30) == 0
    good = Hidden.from_array(np.zeros((1, THREE.dim), np.float32), "bf16").data
    with pytest.raises(Exception, match="stage 0 of 3 is not a middle stage"):
        await s0.call(Forward(good, 0, 1), 30)

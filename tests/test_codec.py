"""Frames: every message round-trips (the runtime's and the pipeline's, ``pytest_ppsmoke.messages``),
hidden states keep their bytes, bad frames raise typed errors."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_ppsmoke import messages
from pytest_ppsmoke.messages import Hidden, StageActivation, WireDtype
from pytest_ppsmoke.runtime import codec
from pytest_ppsmoke.runtime.codec import MESSAGE_TYPES, ActorAddress, Envelope, FrameReader, MemberState

pytestmark = pytest.mark.local

ids = st.binary(min_size=32, max_size=32).map(bytes.hex)


def hidden_states() -> st.SearchStrategy[Hidden]:
    def build(dtype: WireDtype, shape: tuple[int, ...]) -> st.SearchStrategy[Hidden]:
        n = int(np.prod(shape)) if shape else 1
        return st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize).map(
            lambda data: Hidden(int(dtype), shape, data)
        )

    shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)
    return st.tuples(st.sampled_from(list(WireDtype)), shapes).flatmap(lambda a: build(*a))


def strategy_for(kind: codec._Kind) -> st.SearchStrategy[object]:
    """Values for a wire field kind, derived from the schema so that new messages are covered."""
    if isinstance(kind, codec._Int):
        return st.integers(0, kind.max)
    if isinstance(kind, codec._Bool):
        return st.booleans()
    if isinstance(kind, codec._Float):
        return st.floats(allow_nan=False, allow_infinity=False)
    if isinstance(kind, codec._Str):
        return st.text(max_size=20)
    if isinstance(kind, codec._Bytes):
        return st.binary(max_size=64)
    if isinstance(kind, codec._Id):
        return ids
    if isinstance(kind, codec._Optional):
        return st.none() | strategy_for(kind.inner)
    if isinstance(kind, codec._List):
        return st.lists(strategy_for(kind.inner), max_size=3).map(tuple)
    if isinstance(kind, codec._Map):
        return st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3)
    if isinstance(kind, codec._Struct):
        return struct_strategy(kind.cls)
    raise AssertionError(f"no strategy for {kind!r}")


def struct_strategy(cls: type) -> st.SearchStrategy[object]:
    if cls is Hidden:
        return hidden_states()
    fields = {name: strategy_for(kind) for name, kind in cls._wire_fields}  # type: ignore[attr-defined]
    if cls is MemberState:
        fields["status"] = st.sampled_from([0, 1, 2])
    return st.builds(cls, **fields)


envelopes = st.builds(Envelope, st.text(max_size=10), st.text(max_size=10), st.integers(0, 2**64 - 1), st.booleans())
any_message = st.sampled_from(sorted(MESSAGE_TYPES.values(), key=lambda c: c.type_code)).flatmap(struct_strategy)


@pytest.mark.parametrize("cls", sorted(MESSAGE_TYPES.values(), key=lambda c: c.type_code), ids=lambda c: c.__name__)
@settings(max_examples=60)
@given(data=st.data())
def test_every_message_type_round_trips(cls: type[codec.Message], data: st.DataObject) -> None:
    env, msg = data.draw(envelopes), data.draw(struct_strategy(cls))
    frame = codec.encode_frame(env, msg)
    assert codec.decode_frame(frame) == (env, msg)
    code, length = codec.parse_header(frame[: codec.HEADER_SIZE])
    assert code == cls.type_code
    assert length == len(frame) - codec.HEADER_SIZE


@pytest.mark.parametrize("cls", sorted(MESSAGE_TYPES.values(), key=lambda c: c.type_code), ids=lambda c: c.__name__)
@settings(max_examples=30)
@given(data=st.data())
def test_every_message_type_round_trips_as_json_by_the_same_schema(
    cls: type[codec.Message], data: st.DataObject
) -> None:
    """``messages.to_json`` / ``from_json``: the node <-> worker pipe's form of the same records,
    through a real JSON text, from the same schema as the frames."""
    msg = data.draw(struct_strategy(cls))
    assert messages.from_json(cls, json.loads(json.dumps(messages.to_json(msg)))) == msg


def test_a_json_record_that_is_not_the_record_names_the_field() -> None:
    good = messages.to_json(messages.KvInfo(1, 0, 2, 0, (messages.Span(0, 3),), ()))
    with pytest.raises(messages.RecordError, match=r"KvInfo.writes\[0\] must be a list of 2, got \[0\]"):
        messages.from_json(messages.KvInfo, {**good, "writes": [[0]]})
    with pytest.raises(messages.RecordError, match=r"KvInfo.prefill_len: u32 field needs an int .*, got 'x'"):
        messages.from_json(messages.KvInfo, {**good, "prefill_len": "x"})
    with pytest.raises(messages.RecordError, match="missing 1 required positional argument: 'stage'"):
        messages.from_json(messages.KvInfo, {k: v for k, v in good.items() if k != "stage"})
    with pytest.raises(messages.RecordError, match=r"BlockCache\.digest must be hex, got 'zz'"):
        block = messages.to_json(messages.BlockCache(0, True, True, True))
        messages.from_json(messages.BlockCache, {**block, "digest": "zz"})


@settings(max_examples=200)
@given(st.sampled_from(list(WireDtype)), st.integers(1, 5), st.integers(1, 40), st.data())
def test_hidden_state_round_trips_in_every_dtype(dtype: WireDtype, seq: int, dim: int, data: st.DataObject) -> None:
    floats = st.floats(-1e4, 1e4, width=32, allow_nan=False)
    x = np.array(data.draw(st.lists(floats, min_size=seq * dim, max_size=seq * dim)), dtype=np.float32).reshape(
        seq, dim
    )
    h = Hidden.from_array(x, dtype)
    assert len(h.data) == seq * dim * dtype.itemsize
    act = StageActivation(7, 3, seq, False, h)
    _, got = codec.decode_frame(codec.encode_frame(Envelope("stage", "", 0, False), act))
    assert isinstance(got, StageActivation)
    assert got.hidden.data == h.data
    y = got.hidden.to_array()
    assert y.shape == (seq, dim) and y.dtype == np.float32
    if dtype is WireDtype.f32:
        assert np.array_equal(y, x)
    else:
        ref = ml_dtypes.bfloat16 if dtype is WireDtype.bf16 else np.float16
        assert np.array_equal(y, x.astype(ref).astype(np.float32))


@settings(max_examples=300)
@given(st.integers(0, 2**32 - 1))
def test_bf16_rounds_like_the_reference_for_any_bit_pattern(bits: int) -> None:
    x = np.array([bits], dtype=np.uint32).view(np.float32)
    ours = messages.f32_to_bf16_bits(x)
    ref = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    if np.isnan(x[0]):
        assert np.isnan(messages.bf16_bits_to_f32(ours)[0])
    else:
        assert ours[0] == ref[0], f"bits {bits:#010x}: ours {ours[0]:#06x}, reference {ref[0]:#06x}"


def test_bf16_ties_round_to_even_and_are_little_endian() -> None:
    # 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties go to the even mantissa (1.0)
    x = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.0], dtype=np.float32)
    h = Hidden.from_array(x, "bf16")
    assert h.data == struct.pack("<3H", 0x3F80, 0x3F82, 0xC000)


def test_hidden_state_with_wrong_byte_count_names_the_shape() -> None:
    with pytest.raises(ValueError, match=r"shape \(2, 576\) in bf16 needs 2304 bytes, got 100"):
        Hidden(int(WireDtype.bf16), (2, 576), b"\0" * 100)
    with pytest.raises(ValueError, match="unknown wire dtype 'f8'"):
        WireDtype.parse("f8")


def _frame() -> bytes:
    addr = ActorAddress("ab" * 32, "orchestrator")
    return codec.encode_frame(Envelope("stage", "", 9, False), messages.InferenceRequest(addr, "Say hello", 64))


def test_truncated_frame() -> None:
    frame = _frame()
    with pytest.raises(codec.TruncatedFrame, match="header says"):
        codec.decode_frame(frame[:-3])
    with pytest.raises(codec.TruncatedFrame, match="header needs 8 bytes"):
        codec.decode_frame(frame[:5])


def test_wrong_version_and_magic() -> None:
    frame = bytearray(_frame())
    frame[2] = 9
    with pytest.raises(codec.UnsupportedVersion, match=f"frame version 9, this node speaks version {codec.VERSION}"):
        codec.decode_frame(bytes(frame))
    with pytest.raises(codec.BadMagic, match="b'GE'"):
        codec.decode_frame(b"GET / HTTP/1.1\r\n\r\n")


def test_oversized_frame_is_refused_from_the_header_alone() -> None:
    header = codec.HEADER.pack(codec.MAGIC, codec.VERSION, 2, 1 << 31)
    with pytest.raises(codec.FrameTooLarge, match=f"{1 << 31} bytes exceeds the limit of {1 << 20}"):
        FrameReader(max_frame=1 << 20).feed(header)


def test_unknown_type_keeps_the_envelope_so_the_sender_can_be_told() -> None:
    frame = bytearray(_frame())
    frame[3] = 250
    with pytest.raises(codec.UnknownMessageType, match="unknown message type 250") as info:
        codec.decode_frame(bytes(frame))
    assert info.value.envelope == Envelope("stage", "", 9, False)


def test_malformed_body_names_the_field() -> None:
    env = Envelope("stage", "", 0, False)
    frame = bytearray(codec.encode_frame(env, messages.NextToken(1, 2, 3, True)))
    frame[-1] = 7
    with pytest.raises(codec.MalformedMessage, match=r"NextToken.done: bool byte must be 0 or 1, got 7"):
        codec.decode_frame(bytes(frame))


@settings(max_examples=500)
@given(st.binary(max_size=300))
def test_garbage_raises_only_frame_errors(data: bytes) -> None:
    with contextlib.suppress(codec.FrameError):
        codec.decode_frame(data)
    with contextlib.suppress(codec.FrameError):
        FrameReader(max_frame=1 << 16).feed(data)


@settings(max_examples=100)
@given(st.lists(any_message, min_size=1, max_size=5), st.data())
def test_reader_reassembles_frames_from_any_chunking(msgs: list[codec.Message], data: st.DataObject) -> None:
    env = Envelope("a", "b", 1, False)
    stream = b"".join(codec.encode_frame(env, m) for m in msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    reader = FrameReader()
    got = []
    for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        got += [codec.decode_body(c, body)[1] for c, body in reader.feed(stream[a:b])]
    assert got == msgs
    assert reader.pending == 0


def test_encoding_rejects_values_that_do_not_fit() -> None:
    with pytest.raises(codec.MalformedMessage, match=r"u32 field needs an int in \[0, 4294967295\], got -1"):
        codec.encode_frame(Envelope("a", "", 0, False), messages.NextToken(1, -1, 0, False))
    with pytest.raises(codec.MalformedMessage, match="endpoint id needs 64 hex characters"):
        codec.encode_frame(Envelope("a", "", 0, False), codec.PingReq(1, "nothex"))


def test_message_dataclasses_are_frozen() -> None:
    msg = messages.NextToken(1, 2, 3, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.token_id = 5  # type: ignore[misc]


def test_a_hidden_state_with_too_many_dimensions_is_refused_cheaply() -> None:
    with pytest.raises(ValueError, match="hidden state has 9 dimensions; at most 8 are accepted"):
        Hidden(int(WireDtype.f32), (1,) * 9, b"\0\0\0\0")


def test_a_stage_figure_that_is_not_a_finite_number_is_refused_both_ways() -> None:
    bad = messages.StageStats(1, 7, float("nan"))
    with pytest.raises(codec.MalformedMessage, match="f64 field needs a finite number, got nan"):
        codec.encode_frame(Envelope("stage", "", 0, True), bad)
    good = codec.encode_frame(Envelope("stage", "", 0, True), messages.StageStats(1, 7, 1.5))
    nan = bytes(good).replace(struct.pack(">d", 1.5), struct.pack(">d", float("inf")))
    with pytest.raises(codec.MalformedMessage, match="f64 field must be finite, got inf"):
        codec.decode_frame(nan)


def test_the_digest_is_blake2b_of_16_bytes_and_sees_one_flipped_bit() -> None:
    data = bytearray(np.arange(4096, dtype=np.uint8).tobytes())
    assert messages.digest(data) == hashlib.blake2b(data, digest_size=16).digest() and messages.DIGEST_SIZE == 16
    flipped = bytearray(data)
    flipped[1234] ^= 1
    assert messages.digest(flipped) != messages.digest(data)


def test_the_property_tests_check_values_never_time() -> None:
    """hypothesis's per-example deadline and its too_slow health check time the machine, not the
    codec: on a busy machine they fail a round trip that is right. The suite's profile turns both
    off (tests/suite.py); every property test here runs under it."""
    properties = {name: f for name, f in globals().items() if name.startswith("test_") and hasattr(f, "hypothesis")}
    assert len(properties) == 6, sorted(properties)
    for name, f in properties.items():
        used = f._hypothesis_internal_use_settings  # the settings the test runs with
        assert used.deadline is None, f"{name} runs with a {used.deadline} deadline"
        assert HealthCheck.too_slow in used.suppress_health_check, f"{name} runs hypothesis's too_slow check"


def test_swim_timing_round_trips_its_seconds_in_the_membership_range_and_needs_no_new_version() -> None:
    """The orchestrator's SWIM timing for a node's SWIM actor: a new type code among membership's
    (an older node refuses it as an unknown type, so the version stays), two exact f64 seconds."""
    assert codec.MESSAGE_TYPES[23] is codec.SwimTiming
    env = Envelope("swim", "", 5, False)
    msg = codec.SwimTiming(ping_timeout=0.725, protocol_period=1.45)
    frame = codec.encode_frame(env, msg)
    assert codec.decode_frame(bytes(frame)) == (env, msg)
    assert bytes(frame).endswith(struct.pack(">dd", 0.725, 1.45))
    with pytest.raises(codec.MalformedMessage, match="f64 field needs a finite number, got inf"):
        codec.encode_frame(env, codec.SwimTiming(float("inf"), 1.0))

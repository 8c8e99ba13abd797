"""Binary frames for everything that crosses the iroh wire.

A frame is a fixed header followed by an envelope and a message body::

    magic b"PP" | version u8 | type u8 | body length u32 (big endian) | envelope | body

The envelope says which actor the message is for, which actor sent it, and the correlation id
of a request (0 for a one-way message). Bodies are the fields of a message dataclass in
declaration order: fixed-width big-endian integers, length-prefixed strings and bytes, lists,
optionals and nested structs.

This module knows the runtime's own messages (membership and node services) and the machinery
that lays out any message from its annotations. The pipeline's messages (activations, tokens,
requests, a stage's figures) live above the runtime, in :mod:`pytest_ppsmoke.messages`, and
register their type codes here with the same ``@message(code)`` decorator: a process that has not
imported them refuses their frames as ``UnknownMessageType``.

Every decoding failure raises a subclass of :class:`FrameError` that says what was wrong.

``VERSION`` changes whenever the layout of an existing message changes (fields added, removed,
retyped or reordered), so that a node and an orchestrator of different releases refuse each
other's frames with ``UnsupportedVersion`` instead of misreading them. A new message type does not
change it: an unknown type code is refused on its own (``UnknownMessageType``).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
import types
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Union

MAGIC = b"PP"
VERSION = 5  # 2: NodeStatus and StageStats carry typed fields, not JSON; 3: digests, cache state, frame counts;
# 4: NodeStatus carries the worker's load figures, ReferenceResult its weights' load (fields, not text);
# 5: ReferenceResult says where its model was loaded (beside the stages or after the request), and
# LoadFigures the parts of a worker's start
HEADER = struct.Struct(">2sBBI")
HEADER_SIZE = HEADER.size
DEFAULT_MAX_FRAME = 64 << 20  # room for a long prefill of a 1B model in f32 (prompt_len * 8 KiB)


class FrameError(ValueError):
    """A frame that cannot be accepted. The connection it came on is dropped."""


class BadMagic(FrameError):
    pass


class UnsupportedVersion(FrameError):
    pass


class FrameTooLarge(FrameError):
    pass


class TruncatedFrame(FrameError):
    pass


class UnknownMessageType(FrameError):
    """The header is fine but the type code is not one we know; the frame can be skipped."""

    def __init__(self, code: int, envelope: Envelope | None) -> None:
        super().__init__(f"unknown message type {code}")
        self.code = code
        self.envelope = envelope


class MalformedMessage(FrameError):
    pass


# --- field kinds -------------------------------------------------------------------------------


class _Kind:
    def encode(self, out: bytearray, value: Any) -> None:
        raise NotImplementedError

    def decode(self, buf: memoryview, off: int) -> tuple[Any, int]:
        raise NotImplementedError


def _need(buf: memoryview, off: int, n: int, what: str) -> None:
    if off + n > len(buf):
        raise TruncatedFrame(f"{what} needs {n} bytes at offset {off}, frame body has {len(buf)}")


class _Int(_Kind):
    def __init__(self, fmt: str, name: str) -> None:
        self.s = struct.Struct(">" + fmt)
        self.name = name
        self.max = (1 << (8 * self.s.size)) - 1

    def encode(self, out: bytearray, value: Any) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= self.max:
            raise MalformedMessage(f"{self.name} field needs an int in [0, {self.max}], got {value!r}")
        out += self.s.pack(value)

    def decode(self, buf: memoryview, off: int) -> tuple[Any, int]:
        _need(buf, off, self.s.size, self.name)
        return self.s.unpack_from(buf, off)[0], off + self.s.size


class _Float(_Kind):
    """An IEEE 754 double, big-endian: times and durations in the stages' figures."""

    s = struct.Struct(">d")

    def encode(self, out: bytearray, value: Any) -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise MalformedMessage(f"f64 field needs a finite number, got {value!r}")
        out += self.s.pack(value)

    def decode(self, buf: memoryview, off: int) -> tuple[Any, int]:
        _need(buf, off, 8, "f64")
        (value,) = self.s.unpack_from(buf, off)
        if not math.isfinite(value):
            raise MalformedMessage(f"f64 field must be finite, got {value!r}")
        return value, off + 8


class _Bool(_Kind):
    def encode(self, out: bytearray, value: Any) -> None:
        if not isinstance(value, bool):
            raise MalformedMessage(f"bool field needs True or False, got {value!r}")
        out.append(1 if value else 0)

    def decode(self, buf: memoryview, off: int) -> tuple[Any, int]:
        _need(buf, off, 1, "bool")
        b = buf[off]
        if b > 1:
            raise MalformedMessage(f"bool byte must be 0 or 1, got {b}")
        return b == 1, off + 1


_U32 = struct.Struct(">I")


class _Bytes(_Kind):
    def encode(self, out: bytearray, value: Any) -> None:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise MalformedMessage(f"bytes field needs bytes, got {type(value).__name__}")
        out += _U32.pack(len(value))
        out += value

    def decode(self, buf: memoryview, off: int) -> tuple[Any, int]:
        _need(buf, off, 4, "bytes length")
        (n,) = _U32.unpack_from(buf, off)
        _need(buf, off + 4, n, "bytes")
        return bytes(buf[off + 4 : off + 4 + n]), off + 4 + n


class _Str(_Kind):
    def encode(self, out: bytearray, value: Any) -> None:
        if not isinstance(value, str):
            raise MalformedMessage(f"str field needs str, got {type(value).__name__}")
        data = value.encode("utf-8", "surrogatepass")
        out += _U32.pack(len(data))
        out += data

    def decode(self, buf: memoryview, off: int) -> tuple[Any, int]:
        data, off = _BYTES.decode(buf, off)
        try:
            return data.decode("utf-8", "surrogatepass"), off
        except UnicodeDecodeError as e:
            raise MalformedMessage(f"string field is not valid UTF-8: {e}") from None


class _Id(_Kind):
    """An iroh endpoint id: 64 hex characters in Python, 32 raw bytes on the wire."""

    def encode(self, out: bytearray, value: Any) -> None:
        try:
            raw = bytes.fromhex(value)
        except (TypeError, ValueError):
            raw = b""
        if len(raw) != 32:
            raise MalformedMessage(f"endpoint id needs 64 hex characters, got {value!r}")
        out += raw

    def decode(self, buf: memoryview, off: int) -> tuple[Any, int]:
        _need(buf, off, 32, "endpoint id")
        return bytes(buf[off : off + 32]).hex(), off + 32


class _Optional(_Kind):
    def __init__(self, inner: _Kind) -> None:
        self.inner = inner

    def encode(self, out: bytearray, value: Any) -> None:
        if value is None:
            out.append(0)
        else:
            out.append(1)
            self.inner.encode(out, value)

    def decode(self, buf: memoryview, off: int) -> tuple[Any, int]:
        _need(buf, off, 1, "optional flag")
        flag = buf[off]
        if flag == 0:
            return None, off + 1
        if flag != 1:
            raise MalformedMessage(f"optional flag must be 0 or 1, got {flag}")
        return self.inner.decode(buf, off + 1)


class _List(_Kind):
    def __init__(self, inner: _Kind) -> None:
        self.inner = inner

    def encode(self, out: bytearray, value: Any) -> None:
        if not isinstance(value, (list, tuple)):
            raise MalformedMessage(f"list field needs a list, got {type(value).__name__}")
        out += _U32.pack(len(value))
        for item in value:
            self.inner.encode(out, item)

    def decode(self, buf: memoryview, off: int) -> tuple[Any, int]:
        _need(buf, off, 4, "list length")
        (n,) = _U32.unpack_from(buf, off)
        off += 4
        if n > len(buf) - off:  # every item takes at least one byte: refuse absurd counts early
            raise TruncatedFrame(f"list claims {n} items but only {len(buf) - off} bytes remain")
        items = []
        for _ in range(n):
            item, off = self.inner.decode(buf, off)
            items.append(item)
        return tuple(items), off


class _Map(_Kind):
    def encode(self, out: bytearray, value: Any) -> None:
        if not isinstance(value, dict):
            raise MalformedMessage(f"map field needs a dict, got {type(value).__name__}")
        out += _U32.pack(len(value))
        for k, v in sorted(value.items()):
            _STR.encode(out, k)
            _STR.encode(out, v)

    def decode(self, buf: memoryview, off: int) -> tuple[Any, int]:
        _need(buf, off, 4, "map length")
        (n,) = _U32.unpack_from(buf, off)
        off += 4
        if n > len(buf) - off:
            raise TruncatedFrame(f"map claims {n} entries but only {len(buf) - off} bytes remain")
        out = {}
        for _ in range(n):
            k, off = _STR.decode(buf, off)
            v, off = _STR.decode(buf, off)
            out[k] = v
        return out, off


class _Struct(_Kind):
    def __init__(self, cls: type) -> None:
        self.cls = cls

    def encode(self, out: bytearray, value: Any) -> None:
        if not isinstance(value, self.cls):
            raise MalformedMessage(f"field needs {self.cls.__name__}, got {type(value).__name__}")
        for name, kind in self.cls._wire_fields:  # type: ignore[attr-defined]
            kind.encode(out, getattr(value, name))

    def decode(self, buf: memoryview, off: int) -> tuple[Any, int]:
        values = {}
        for name, kind in self.cls._wire_fields:  # type: ignore[attr-defined]
            try:
                values[name], off = kind.decode(buf, off)
            except FrameError as e:
                raise type(e)(f"{self.cls.__name__}.{name}: {e}") from None
        try:
            return self.cls(**values), off
        except (TypeError, ValueError) as e:
            raise MalformedMessage(f"{self.cls.__name__}: {e}") from None


_BYTES = _Bytes()
_STR = _Str()

U8 = Annotated[int, _Int("B", "u8")]
U32 = Annotated[int, _Int("I", "u32")]
U64 = Annotated[int, _Int("Q", "u64")]
F64 = Annotated[float, _Float()]
NodeId = Annotated[str, _Id()]


def _kind_of(tp: Any) -> _Kind:
    if typing.get_origin(tp) is Annotated:
        return typing.get_args(tp)[1]  # type: ignore[no-any-return]
    if tp is bool:
        return _Bool()
    if tp is str:
        return _STR
    if tp is bytes:
        return _BYTES
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType) and len(args) == 2 and type(None) in args:
        return _Optional(_kind_of(next(a for a in args if a is not type(None))))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _List(_kind_of(args[0]))
    if origin is dict and args == (str, str):
        return _Map()
    if isinstance(tp, type) and hasattr(tp, "_wire_struct"):
        return tp._wire_struct  # type: ignore[no-any-return]
    raise TypeError(f"no wire encoding for field type {tp!r}")


def wire_struct(cls: type) -> type:
    """Give a frozen dataclass a wire layout derived from its annotations, in field order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    cls._wire_fields = tuple((f.name, _kind_of(hints[f.name])) for f in dataclasses.fields(cls))  # type: ignore[attr-defined]
    cls._wire_struct = _Struct(cls)  # type: ignore[attr-defined]
    return cls


MESSAGE_TYPES: dict[int, type[Message]] = {}


class Message:
    """Base of every message body; subclasses register a unique type code."""

    type_code: ClassVar[int]
    _wire_fields: ClassVar[tuple[tuple[str, _Kind], ...]]
    _wire_struct: ClassVar[_Struct]


def message(code: int) -> Any:
    def register(cls: type[Message]) -> type[Message]:
        if code in MESSAGE_TYPES:
            raise TypeError(f"message type code {code} used by {MESSAGE_TYPES[code].__name__} and {cls.__name__}")
        cls.type_code = code
        wire_struct(cls)
        MESSAGE_TYPES[code] = cls
        return cls

    return register


# --- envelope and structs ----------------------------------------------------------------------


@wire_struct
@dataclass(frozen=True)
class ActorAddress:
    """Where an actor lives: an endpoint id plus the actor's name on that node."""

    node: NodeId
    actor: str

    def __str__(self) -> str:
        return f"{self.actor}@{self.node[:10]}"


@wire_struct
@dataclass(frozen=True)
class Envelope:
    to_actor: str
    from_actor: str
    corr: U64  # request correlation id; 0 for a one-way message
    reply: bool  # True when this frame answers request ``corr``


class MemberStatus(enum.IntEnum):
    alive = 0
    suspect = 1
    dead = 2


@wire_struct
@dataclass(frozen=True)
class MemberState:
    """One member as SWIM sees it. ``names`` maps registered names to local actor names."""

    id: NodeId
    status: U8
    incarnation: U32
    addrs: tuple[str, ...] = ()
    relay: str | None = None
    names: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        MemberStatus(self.status)  # ValueError names the bad value

    def __hash__(self) -> int:
        return hash((self.id, self.status, self.incarnation))


# --- membership --------------------------------------------------------------------------------


@message(16)
@dataclass(frozen=True)
class Ping(Message):
    seq: U64
    updates: tuple[MemberState, ...] = ()


@message(17)
@dataclass(frozen=True)
class Ack(Message):
    seq: U64
    updates: tuple[MemberState, ...] = ()


@message(18)
@dataclass(frozen=True)
class PingReq(Message):
    """Ask a member to probe ``target`` for us (SWIM's indirect probe)."""

    seq: U64
    target: NodeId
    updates: tuple[MemberState, ...] = ()


@message(19)
@dataclass(frozen=True)
class Nack(Message):
    """Lifeguard: the intermediary reached no answer from the target, but it is itself alive."""

    seq: U64
    updates: tuple[MemberState, ...] = ()


@message(20)
@dataclass(frozen=True)
class Join(Message):
    member: MemberState


@message(21)
@dataclass(frozen=True)
class Sync(Message):
    """Full state (the answer to Join, and periodic push-pull anti-entropy)."""

    members: tuple[MemberState, ...]


@message(22)
@dataclass(frozen=True)
class Gossip(Message):
    updates: tuple[MemberState, ...]


@message(23)
@dataclass(frozen=True)
class SwimTiming(Message):
    """Probe with at least this timeout and period (seconds): the timing the orchestrator chose for
    the round trips it measured at converge. A member takes each only where it asks for more than
    it has (never shortens), and answers with the timing it then runs with (another ``SwimTiming``)."""

    ping_timeout: F64
    protocol_period: F64


@message(24)
@dataclass(frozen=True)
class Admit(Message):
    """The orchestrator's latest admission (``admission.Admission``), to a node's ``node`` actor:
    every endpoint id it admitted and revoked in this run so far, under a number that only
    grows, signed with the seed's key. Answered with ``Ok`` once applied (or already applied),
    with an ``ErrorReply`` when refused."""

    seq: U64
    admitted: tuple[NodeId, ...]
    revoked: tuple[NodeId, ...]
    signature: bytes


# --- node services -----------------------------------------------------------------------------


@message(32)
@dataclass(frozen=True)
class ErrorReply(Message):
    """A request failed on the receiving side; ``kind`` is a short machine-readable tag."""

    kind: str
    message: str


@message(33)
@dataclass(frozen=True)
class Echo(Message):
    payload: bytes


@message(34)
@dataclass(frozen=True)
class MembersQuery(Message):
    pass


@message(35)
@dataclass(frozen=True)
class MembersView(Message):
    members: tuple[MemberState, ...]


@message(36)
@dataclass(frozen=True)
class ResolveQuery(Message):
    name: str
    timeout_ms: U32


@message(37)
@dataclass(frozen=True)
class Resolved(Message):
    address: ActorAddress


@message(38)
@dataclass(frozen=True)
class Register(Message):
    name: str
    actor: str


@message(39)
@dataclass(frozen=True)
class Ok(Message):
    pass


# --- frames ------------------------------------------------------------------------------------

_ENVELOPE = _Struct(Envelope)


def encode_frame(envelope: Envelope, msg: Message) -> bytearray:
    """One frame in a single buffer (one write call on the stream, no further copy)."""
    code = getattr(type(msg), "type_code", None)
    if code is None or MESSAGE_TYPES.get(code) is not type(msg):
        raise MalformedMessage(f"{type(msg).__name__} is not a registered message type")
    out = bytearray(HEADER_SIZE)
    _ENVELOPE.encode(out, envelope)
    msg._wire_struct.encode(out, msg)
    HEADER.pack_into(out, 0, MAGIC, VERSION, code, len(out) - HEADER_SIZE)
    return out


def parse_header(header: bytes | memoryview, max_frame: int = DEFAULT_MAX_FRAME) -> tuple[int, int]:
    """Check a frame header; return (type code, body length)."""
    if len(header) < HEADER_SIZE:
        raise TruncatedFrame(f"frame header needs {HEADER_SIZE} bytes, got {len(header)}")
    magic, version, code, length = HEADER.unpack_from(header, 0)
    if magic != MAGIC:
        raise BadMagic(f"frame starts with {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise UnsupportedVersion(f"frame version {version}, this node speaks version {VERSION}")
    if length > max_frame:
        raise FrameTooLarge(f"frame body of {length} bytes exceeds the limit of {max_frame}")
    return code, length


def decode_body(code: int, body: bytes | memoryview) -> tuple[Envelope, Message]:
    buf = memoryview(body)
    env, off = _ENVELOPE.decode(buf, 0)
    cls = MESSAGE_TYPES.get(code)
    if cls is None:
        raise UnknownMessageType(code, env)
    msg, off = cls._wire_struct.decode(buf, off)
    if off != len(buf):
        raise MalformedMessage(f"{cls.__name__} frame has {len(buf) - off} trailing bytes")
    return env, msg


def decode_frame(frame: bytes | memoryview, max_frame: int = DEFAULT_MAX_FRAME) -> tuple[Envelope, Message]:
    """Decode exactly one whole frame."""
    code, length = parse_header(frame, max_frame)
    if len(frame) - HEADER_SIZE != length:
        raise TruncatedFrame(f"frame header says {length} body bytes, got {len(frame) - HEADER_SIZE}")
    return decode_body(code, memoryview(frame)[HEADER_SIZE:])


class FrameReader:
    """Incremental frame parser over a byte stream (any chunking)."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> list[tuple[int, memoryview]]:
        """Append ``chunk``; return the complete (type code, body) frames, raise on a bad header."""
        self._buf += chunk
        frames: list[tuple[int, memoryview]] = []
        off = 0
        while len(self._buf) - off >= HEADER_SIZE:
            code, length = parse_header(bytes(self._buf[off : off + HEADER_SIZE]), self.max_frame)
            if len(self._buf) - off - HEADER_SIZE < length:
                break
            with memoryview(self._buf) as view:  # released before the buffer is resized below
                body = bytes(view[off + HEADER_SIZE : off + HEADER_SIZE + length])
            frames.append((code, memoryview(body)))
            off += HEADER_SIZE + length
        if off:
            del self._buf[:off]
        return frames

    @property
    def pending(self) -> int:
        return len(self._buf)

    @property
    def missing(self) -> int:
        """Bytes still needed to complete the frame under way (the header first)."""
        if len(self._buf) < HEADER_SIZE:
            return HEADER_SIZE - len(self._buf)
        length = HEADER.unpack_from(self._buf, 0)[3]
        return int(HEADER_SIZE + length - len(self._buf))

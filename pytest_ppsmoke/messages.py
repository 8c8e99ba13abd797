"""The pipeline's messages: what the orchestrator and the stage nodes say to each other.

The runtime (:mod:`pytest_ppsmoke.runtime`) carries frames and knows only its own messages
(membership and node services); it never imports this module. The messages here are laid out by
the runtime's schema machinery (``@message(code)`` and ``@wire_struct`` in
:mod:`pytest_ppsmoke.runtime.codec`), from their annotations, and register their type codes there
when this module is imported: one schema for encoding, decoding and the property tests. The type
codes are the wire's, unchanged; a process that has not imported this module refuses these frames
as ``UnknownMessageType``, naming the code.

Hidden states travel as raw little-endian bytes of the wire dtype plus their shape (never base64,
never JSON on this wire); the wire dtypes are ``protocol.WIRE_DTYPES``.
"""

from __future__ import annotations

import builtins
import enum
import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from .protocol import WIRE_DTYPES
from .runtime import codec
from .runtime.codec import F64, U8, U32, U64, ActorAddress, Message, message, wire_struct

if TYPE_CHECKING:
    import numpy as np  # imported where an array is made or read: the nodes and pp-smoke-run never do

MAX_DIMS = 8  # of a hidden state; bounds the work a crafted shape can cause


# --- hidden states -----------------------------------------------------------------------------

DIGEST_SIZE = 16


def digest(data: bytes | bytearray | memoryview) -> bytes:
    """blake2b of ``data`` in ``DIGEST_SIZE`` bytes: how the stages show that an activation's
    bytes arrived as they were sent, and that a KV cache's prompt positions were not rewritten."""
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


class WireDtype(enum.IntEnum):
    """The dtype of hidden states on the wire; bf16 is the spec's default. The names are
    ``protocol.WIRE_DTYPES`` (checked below, when this module is imported); the codes are the
    wire's, written out so that they never move."""

    bf16 = 1
    f16 = 2
    f32 = 3

    @property
    def itemsize(self) -> int:
        return 4 if self is WireDtype.f32 else 2

    @classmethod
    def parse(cls, value: str | int | WireDtype) -> WireDtype:
        if isinstance(value, cls):
            return value
        try:
            return cls[value] if isinstance(value, str) else cls(value)
        except (KeyError, ValueError):
            raise ValueError(f"unknown wire dtype {value!r}; expected one of {', '.join(WIRE_DTYPES)}") from None


if tuple(d.name for d in WireDtype) != WIRE_DTYPES:
    raise ImportError(f"WireDtype's names {[d.name for d in WireDtype]} are not protocol.WIRE_DTYPES {WIRE_DTYPES}")


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest, ties to even.

    NaNs stay NaN (quiet bit set); infinities and overflow to infinity behave as IEEE rounding does.
    """
    import numpy as np

    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    import numpy as np

    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_to_wire(x: np.ndarray, dtype: WireDtype) -> np.ndarray:
    """What a float32 array becomes after a trip over the wire in ``dtype`` (as float32)."""
    return Hidden.from_array(x, dtype).to_array()


@wire_struct
@dataclass(frozen=True)
class Hidden:
    """A hidden-state tensor: raw little-endian bytes of ``dtype`` with its shape."""

    dtype: U8
    shape: tuple[U32, ...]
    data: bytes = field(repr=False)

    def __post_init__(self) -> None:
        dt = WireDtype.parse(self.dtype)
        if len(self.shape) > MAX_DIMS:
            raise ValueError(f"hidden state has {len(self.shape)} dimensions; at most {MAX_DIMS} are accepted")
        n = 1
        for d in self.shape:
            n *= d
        if len(self.data) != n * dt.itemsize:
            raise ValueError(
                f"hidden state of shape {tuple(self.shape)} in {dt.name} needs {n * dt.itemsize} bytes, "
                f"got {len(self.data)}"
            )

    @property
    def wire_dtype(self) -> WireDtype:
        return WireDtype(self.dtype)

    @classmethod
    def from_array(cls, x: np.ndarray, dtype: WireDtype | str = WireDtype.bf16) -> Hidden:
        import numpy as np

        dt = WireDtype.parse(dtype)
        if dt is WireDtype.bf16:
            raw = f32_to_bf16_bits(np.asarray(x, dtype=np.float32)).astype("<u2")
        elif dt is WireDtype.f16:
            raw = np.asarray(x).astype("<f2")
        else:
            raw = np.asarray(x).astype("<f4")
        return cls(int(dt), tuple(int(d) for d in np.shape(x)), raw.tobytes())

    def to_array(self) -> np.ndarray:
        """The tensor as float32 (bf16 and f16 widen exactly)."""
        import numpy as np

        dt = self.wire_dtype
        if dt is WireDtype.bf16:
            flat = bf16_bits_to_f32(np.frombuffer(self.data, dtype="<u2"))
        elif dt is WireDtype.f16:
            flat = np.frombuffer(self.data, dtype="<f2").astype(np.float32)
        else:
            flat = np.frombuffer(self.data, dtype="<f4").astype(np.float32)
        return flat.reshape(self.shape)


# --- the spec's messages -----------------------------------------------------------------------


@message(1)
@dataclass(frozen=True)
class InferenceRequest(Message):
    reply_to: ActorAddress
    prompt: str
    max_tokens: U32


@message(2)
@dataclass(frozen=True)
class StageActivation(Message):
    """Hidden state from stage i to stage i+1.

    The spec leaves open how the last stage learns where to reply and when to stop: the prefill
    activation carries ``reply_to`` and ``max_tokens`` (None and 0 on decode steps).
    """

    request_id: U64
    position: U32
    seq_len: U32
    is_prefill: bool
    hidden: Hidden
    reply_to: ActorAddress | None = None
    max_tokens: U32 = 0


@message(3)
@dataclass(frozen=True)
class NextToken(Message):
    request_id: U64
    token_id: U32
    position: U32
    done: bool


@message(4)
@dataclass(frozen=True)
class InferenceResponse(Message):
    """The result for ``reply_to``. ``error`` is set, and ``text`` empty, when the request failed."""

    request_id: U64
    text: str
    token_ids: tuple[U32, ...] = ()
    error: str | None = None


@message(44)
@dataclass(frozen=True)
class Accepted(Message):
    """Stage 0 took an InferenceRequest; its InferenceResponse will carry this ``request_id``."""

    request_id: U64


# --- stage introspection (what the harness checks) ---------------------------------------------


@wire_struct
@dataclass(frozen=True)
class ProgramCounts:
    """tinygrad programs a worker read from the program cache (``hits``) and generated (``misses``),
    and those whose binary it compiled (``compiled``: the cache held none its device loads; a
    prebuilt image's programs carry theirs, so a cold node on it compiles none)."""

    hits: U32
    misses: U32
    compiled: U32 = 0


@message(40)
@dataclass(frozen=True)
class KvInfoQuery(Message):
    pass


@wire_struct
@dataclass(frozen=True)
class Span:
    """Positions ``[start, end)`` of a sequence (in JSON: ``[start, end]``)."""

    start: U32
    end: U32

    _json_list: ClassVar[bool] = True


@wire_struct
@dataclass(frozen=True)
class BlockCache:
    """One block of the model as a stage's worker holds it, read from the block itself, owned or
    not: whether a block object exists there, whether its weights are realized on the device, its
    KV cache's shape (empty: no cache), the positions whose K rows are non-zero, and a digest of
    the cache at positions ``[0, P)`` taken right after prefill and again when asked."""

    block: U32
    owned: bool
    present: bool
    weights_realized: bool
    cache_shape: tuple[U32, ...] = ()
    filled: tuple[Span, ...] = ()
    prefill_digest: bytes = b""
    digest: bytes = b""


@message(41)
@dataclass(frozen=True)
class KvInfo(Message):
    """A stage's KV caches as its worker's tensors hold them: every block of the model, owned or
    not. ``prefill_len``: P of the sequence under way (0: none yet); ``writes``: the positions the
    worker's calls wrote into its caches since that prefill, in call order, consecutive calls
    merged (a clean request of G tokens: the one span ``[0, P + G - 1)``)."""

    stage: U32
    first_block: U32
    end_block: U32  # exclusive
    prefill_len: U32
    writes: tuple[Span, ...]
    blocks: tuple[BlockCache, ...]
    programs: ProgramCounts | None = None  # the worker's, over its life so far (None: the cache off)


@message(42)
@dataclass(frozen=True)
class StageStatsQuery(Message):
    pass


@wire_struct
@dataclass(frozen=True)
class HopRecord:
    """One activation as a stage sent it (``at``: when the send began; ``send_s``: how long the
    write took) or received it (``at``: when it arrived; ``send_s`` 0). Wall-clock times.
    ``digest``: of the hidden state's raw wire bytes, taken by the worker that produced them (a
    hop out) or by the worker that decoded them (an activation in)."""

    position: U32
    seq_len: U32
    bytes: U64
    at: F64
    send_s: F64 = 0.0
    request_id: U64 = 0
    digest: builtins.bytes = b""  # the field ``bytes`` above shadows the type in this class


@wire_struct
@dataclass(frozen=True)
class ComputeRecord:
    """One call into the worker: ``s`` as the node saw it (bridge included), ``worker_s`` inside
    the worker (tinygrad and base64), when the worker says."""

    op: str
    position: U32 | None
    at: F64
    s: F64
    worker_s: F64 | None = None


@wire_struct
@dataclass(frozen=True)
class FrameCount:
    """Frames of one message type (its code) that a node sent and received over the wire."""

    type_code: U8
    sent: U64
    received: U64


@wire_struct
@dataclass(frozen=True)
class PeerPath:
    """How a node reaches a peer (``Transport.path``): the selected path, ``direct`` (with the
    peer's address) or ``relay``, its round trip as QUIC measures it, who dialled the
    connection it sends on (``us`` or ``peer``), and whether the path is the selected one
    (False: none was selected at that moment, and this is the one that carried the most out)."""

    peer: str
    path: str
    remote_addr: str
    rtt_ms: U32 | None
    dialled_by: str
    selected: bool


@message(43)
@dataclass(frozen=True)
class StageStats(Message):
    """A stage's figures for its last request: activations in, hops out, compute times; the
    frames it sent and received from the frame that began the request on (that frame included)
    to this answer; ``finished_at``: when its part of the request ended (stage 0: the done
    NextToken; the last stage: the answer sent; a middle stage cannot tell: None)."""

    stage: U32
    request_id: U64 | None = None
    accepted_at: F64 | None = None  # stage 0: when it accepted the InferenceRequest
    prompt_token_ids: tuple[U32, ...] = ()
    activations_in: tuple[HopRecord, ...] = ()
    hops_out: tuple[HopRecord, ...] = ()
    compute: tuple[ComputeRecord, ...] = ()
    frames: tuple[FrameCount, ...] = ()
    finished_at: F64 | None = None
    paths: tuple[PeerPath, ...] = ()  # how it reaches each peer it has a connection with, now


@message(45)
@dataclass(frozen=True)
class NodeStatusQuery(Message):
    """Ask a node (its status actor) where it is. ``wait_ms`` > 0: while its worker loads and
    nothing changes, the answer waits up to that long, so that the asker hears a change (a block
    loaded, the worker ready or failed) as it comes rather than at its next poll."""

    wait_ms: U32 = 0


@wire_struct
@dataclass(frozen=True)
class WeightLoad:
    """How a worker realized its owned tensors (``stage/model.realized_model``): ``source`` is
    ``cache`` or ``gguf``. The one record from the worker's ready line (``to_json``) through
    ``NodeStatus.load`` to the orchestrator, which reads its fields."""

    source: str
    seconds: F64
    nbytes: U64
    path: str = ""  # the cache file read or written ("" with the cache off)
    note: str = ""  # why a cache file was not used, or could not be written
    dtype: str = ""  # the blocks' weights: f16 (tinygrad's HALF=1, its default), or the GGUF's with HALF=0
    half: U8 = 1  # tinygrad's HALF as the load saw it


PART_FIELDS = ("wall_s", "imports_s", "device_s", "build_s", "warm_up_s")


@wire_struct
@dataclass(frozen=True)
class LoadFigures:
    """A worker's load, from its ready line (``stage.pipe.Ready.load_figures``): its weights and its programs, and
    the parts of its start: ``wall_s`` from the process's start to the ready line, of which
    ``imports_s`` (Python and tinygrad's imports), ``device_s`` (opening the device), the
    weights' seconds, ``build_s`` (the stage's split) and ``warm_up_s`` (capturing the decode
    step); 0 where the worker did not say."""

    weights: WeightLoad | None = None
    programs: ProgramCounts | None = None
    wall_s: F64 = 0.0
    imports_s: F64 = 0.0
    device_s: F64 = 0.0
    build_s: F64 = 0.0
    warm_up_s: F64 = 0.0

    def parts(self) -> str:
        """``12.19 s: imports 1.20, device 0.85, weights 3.29, split 0.10, warm-up 5.01, the rest
        1.74`` ("" where the worker did not say)."""
        if not self.wall_s:
            return ""
        weights = self.weights.seconds if self.weights is not None else 0.0
        named = [
            ("imports", self.imports_s),
            ("device", self.device_s),
            ("weights", weights),
            ("split", self.build_s),
            ("warm-up", self.warm_up_s),
        ]
        rest = self.wall_s - sum(v for _, v in named)
        return f"{self.wall_s:.2f} s: " + ", ".join(f"{n} {v:.2f}" for n, v in [*named, ("the rest", rest)])

    def describe(self) -> str:
        """One line for people, e.g. ``weights from the cache in 0.98 s, f16; programs: 41 cached,
        0 generated`` (derived from the fields; nothing reads it back)."""
        parts = []
        if (w := self.weights) is not None:
            where = "the cache" if w.source == "cache" else "the GGUF"
            parts.append(
                f"weights from {where} in {w.seconds:.2f} s"
                + (f", {w.dtype}" if w.dtype else "")
                + ("" if w.half else " (HALF=0)")
                + (f" ({w.note})" if w.note else "")
            )
        if (p := self.programs) is not None:
            parts.append(f"programs: {p.hits} cached, {p.misses} generated, {p.compiled} compiled")
        return "; ".join(parts)


@message(46)
@dataclass(frozen=True)
class NodeStatus(Message):
    """Where a stage node is: ``loading`` (its worker is starting), ``ready`` (names registered;
    the worker's hidden size, its blocks ``[first_block, end_block)`` and its context are set),
    or ``failed`` (``detail`` says why, e.g. the worker's exit status and stderr). ``load``: the
    worker's load figures, as fields (``LoadFigures.describe`` is their line for people); ``step``
    to ``programs``: how far its load has come."""

    stage: U32
    state: str
    detail: str
    seconds: U32  # in this state so far
    dim: U32 = 0
    first_block: U32 = 0
    end_block: U32 = 0  # exclusive
    max_context: U32 = 0
    load: LoadFigures | None = None  # once ready: how the worker loaded
    # the worker's load as it goes (its progress lines): the step begun (of protocol.LOAD_STEPS;
    # 0: the process is starting), its blocks realized of its part's (0 of 0: not said yet), and
    # the programs it has read or generated so far
    step: U8 = 0
    blocks_loaded: U32 = 0
    blocks: U32 = 0
    programs: U32 = 0


@message(47)
@dataclass(frozen=True)
class FirstToken(Message):
    """The last stage to ``reply_to``: prefill is done, decode begins (once per request)."""

    request_id: U64
    token_id: U32


@message(59)
@dataclass(frozen=True)
class Progress(Message):
    """A one-way note of work done, from a stage's node to the orchestrator, never answered:
    counts only, never a token id. ``what`` says what is counted: ``blocks`` (the prompt's
    activation has passed ``done`` of ``total`` blocks: each stage says so after its part of the
    prefill), ``tokens`` (the last stage in decode, stage 0's node in the reference: ``done``
    sampled of ``max_tokens``), ``loading`` (the reference's model is loading, no token yet).
    The last stage sends it to ``reply_to`` (where the InferenceResponse goes), at most one a
    second in decode; the orchestrator counts these frames apart from the token loop."""

    request_id: U64
    stage: U32
    what: str
    done: U32
    total: U32


@message(48)
@dataclass(frozen=True)
class RelayProbe(Message):
    """The activation round trip, checked from outside: the stage that gets this sends ``hidden``
    on to the stage named ``to`` (over the same wire as activations), which answers with what it
    received. ``to`` empty: answer with what arrived."""

    to: str
    hidden: Hidden


@message(49)
@dataclass(frozen=True)
class ProbeReport(Message):
    received_by: str
    hidden: Hidden


# --- the token-exact reference -----------------------------------------------------------------


@message(55)
@dataclass(frozen=True)
class ReferenceQuery(Message):
    """Ask a stage's node to run the model in one piece, on its own device, with a fresh copy of
    the weights (never the stage's): the tokens the pipeline must produce for ``prompt``. The
    node gives its worker ``timeout_ms``; stage 0 first waits for a request in flight to end."""

    prompt: str
    max_tokens: U32
    timeout_ms: U32


@message(56)
@dataclass(frozen=True)
class ReferenceResult(Message):
    """The reference's tokens and how they were made: ``method`` is ``unsplit`` (an f32 wire:
    tinygrad's own ``Transformer.generate``) or ``unsplit, boundaries rounded to <dtype>``;
    ``device`` is tinygrad's device on that node; ``load_s`` and ``generate_s`` are the worker's
    seconds; ``mem_before`` and ``mem_after`` its device bytes in use before the load and after
    the generate. ``loaded`` says where the model was loaded: ``beside`` (a reference worker of its
    own, loaded while the stages loaded; it keeps the model, so
    ``mem_after`` includes it) or ``after`` (the stage's worker, afresh after the request; the
    model is dropped before ``mem_after`` is read)."""

    stage: U32
    method: str
    device: str
    prompt_token_ids: tuple[U32, ...]
    token_ids: tuple[U32, ...]
    load_s: F64
    generate_s: F64
    mem_before: U64 = 0
    mem_after: U64 = 0
    weights: WeightLoad | None = None  # how the reference's own weights were realized
    loaded: str = "after"
    programs: ProgramCounts | None = None  # its worker's, over its life (None: the cache off)


# --- a node's own account: its last log lines and its loop's stalls ---------------------------------


@wire_struct
@dataclass(frozen=True)
class Stall:
    """One time a node's event loop ran late: it began ``at`` seconds after the node started and
    lasted ``seconds`` (the loop was starved: the host's CPU, a paused process, a blocking call)."""

    at: F64
    seconds: F64


@message(57)
@dataclass(frozen=True)
class LogTailQuery(Message):
    """Ask a node (its status actor) for its own last log lines: at most ``lines`` of them and
    ``max_bytes`` of text, the newest kept; every secret it knows redacted first."""

    lines: U32
    max_bytes: U32


@message(58)
@dataclass(frozen=True)
class LogTail(Message):
    """A node's own account: its last log ``lines`` (oldest first, redacted), how many older lines
    were left out (``dropped``), its ``uptime`` in seconds, and the stalls of its event loop it
    measured (the longest ones, at most a few dozen, oldest first)."""

    stage: U32
    lines: tuple[str, ...]
    dropped: U32
    uptime: F64
    stalls: tuple[Stall, ...] = ()


# --- the same records as JSON (the node <-> worker pipe, a subprocess's last line) ---------------

R = TypeVar("R")


class RecordError(ValueError):
    """A JSON value that is not the record it should be; the message names the field."""


def to_json(record: Any) -> Any:
    """A wire struct as JSON values, by its wire schema: tuples as lists, bytes as hex, a nested
    struct as an object (a ``Span`` as ``[start, end]``). :func:`from_json` reads it back."""
    return _to_json(record._wire_struct, record)


def from_json(cls: type[R], obj: Any, where: str = "") -> R:
    """The record ``cls`` from :func:`to_json`'s form, each value checked as the wire checks it
    (keys the record does not have are ignored; a missing field without a default is an error)."""
    return _from_json(cls._wire_struct, obj, where or cls.__name__)  # type: ignore[attr-defined,no-any-return]


def _to_json(kind: codec._Kind, value: Any) -> Any:
    if value is None:
        return None
    if isinstance(kind, codec._Optional):
        return _to_json(kind.inner, value)
    if isinstance(kind, codec._List):
        return [_to_json(kind.inner, v) for v in value]
    if isinstance(kind, codec._Bytes):
        return bytes(value).hex()
    if isinstance(kind, codec._Struct):
        fields = kind.cls._wire_fields  # type: ignore[attr-defined]
        if getattr(kind.cls, "_json_list", False):
            return [_to_json(k, getattr(value, n)) for n, k in fields]
        return {n: _to_json(k, getattr(value, n)) for n, k in fields}
    return value


def _from_json(kind: codec._Kind, obj: Any, where: str) -> Any:
    if isinstance(kind, codec._Optional):
        return None if obj is None else _from_json(kind.inner, obj, where)
    if isinstance(kind, codec._List):
        if not isinstance(obj, list):
            raise RecordError(f"{where} must be a list, got {obj!r:.80}")
        return tuple(_from_json(kind.inner, v, f"{where}[{i}]") for i, v in enumerate(obj))
    if isinstance(kind, codec._Bytes):
        try:
            return bytes.fromhex(obj)
        except (TypeError, ValueError):
            raise RecordError(f"{where} must be hex, got {obj!r:.80}") from None
    if isinstance(kind, codec._Struct):
        cls, fields = kind.cls, kind.cls._wire_fields  # type: ignore[attr-defined]
        if getattr(cls, "_json_list", False):
            if not isinstance(obj, list) or len(obj) != len(fields):
                raise RecordError(f"{where} must be a list of {len(fields)}, got {obj!r:.80}")
            obj = {n: v for (n, _), v in zip(fields, obj, strict=True)}
        if not isinstance(obj, dict):
            raise RecordError(f"{where} must be an object, got {obj!r:.80}")
        values = {n: _from_json(k, obj[n], f"{where}.{n}") for n, k in fields if n in obj}
        try:
            return cls(**values)
        except (TypeError, ValueError) as e:
            raise RecordError(f"{where}: {e}") from None
    try:
        kind.encode(bytearray(), obj)  # the wire's own check of a scalar
    except codec.MalformedMessage as e:
        raise RecordError(f"{where}: {e}") from None
    return obj

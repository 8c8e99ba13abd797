"""The node <-> worker pipe: every operation, every reply and the worker's ready line as a record,
with one encoder and one decoder that the node (``bridge.py``) and the worker
(``worker/pp_tinygrad_worker.py``) share.

    line = encode_request(7, ForwardAndSample(raw, position=0, seq_len=11), Framing.payload)
    req = decode_request(json.loads(first_line), payload)   # the worker: PipeError names the field
    reply = decode_reply(req.reply, json.loads(reply_line), reply_payload)   # HiddenOut, Sampled, ...

On stdin and stdout a record is one JSON object on one line (the spec's ``{"op": ...,
"request_id": ...}`` with the record's fields by name; a reply has ``request_id`` and the record's
fields; ``None`` fields are left out). A hidden state (a record's ``hidden``: raw little-endian
bytes in the wire dtype) rides in the line as ``hidden_b64`` (``Framing.json``), or, with
``Framing.payload``, the line says ``"payload": N`` and N raw bytes follow its newline (0 for a
request that sends none). Digests are hex in JSON, bytes in the records. A worker's error is
``{"request_id": ..., "op": ..., "error": "..."}`` (``ErrorReply``); its first line is ``Ready``
with ``"status": "ready"``, and the reply to ``Shutdown`` has ``"status": "bye"``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum
import json
import math
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeGuard, TypeVar, Union

from ..messages import (
    KvInfo,
    LoadFigures,
    ProgramCounts,
    RecordError,
    ReferenceResult,
    Span,
    WeightLoad,
    WireDtype,
    from_json,
    to_json,
)

MAX_PAYLOAD = 256 << 20  # bytes after one line: a prefill's hidden state at the largest context is far below


class Framing(enum.Enum):
    """How a hidden state crosses the pipe: base64 in the JSON line, or raw bytes after it."""

    json = "json"
    payload = "payload"


class PipeError(ValueError):
    """A line that is not the record it should be; the message names the field."""


class Unframeable(PipeError):
    """The bytes after this line cannot be told apart from the next line."""


# --- the records ---------------------------------------------------------------------------------

R = TypeVar("R")
OPS: dict[str, type[Request[Any]]] = {}


@dataclass(frozen=True)
class Request(Generic[R]):
    """An operation; ``op`` names it on the pipe, ``reply`` is the record it is answered with."""

    op: ClassVar[str]
    reply: ClassVar[type]

    def __init_subclass__(cls, op: str = "", reply: type | None = None, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if op:
            cls.op, cls.reply = op, reply  # type: ignore[assignment]
            OPS[op] = cls


@dataclass(frozen=True)
class HiddenOut:
    """A hidden state this worker computed, with the digest of its raw bytes
    (``messages.digest``); after ``Forward``, also that of the bytes it received."""

    hidden: bytes = dataclasses.field(repr=False)
    hidden_digest: bytes
    seq_len: int
    dtype: WireDtype
    received_digest: bytes | None = None


@dataclass(frozen=True)
class Sampled:
    token_id: int
    received_digest: bytes  # of the hidden state's raw bytes as this worker decoded them


@dataclass(frozen=True)
class TokenIds:
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CacheUse:
    """What a worker read from a cache of its own (``hits``) and made (``misses``): tinygrad's
    programs (with the seconds spent on them, and the errors of the cache's writes) or its
    schedules (``stage/cache.py``)."""

    hits: int
    misses: int
    seconds: float = 0.0
    errors: tuple[str, ...] = ()
    compiled: int = 0  # programs whose binary it compiled (the program cache held none it could load)

    def counts(self) -> ProgramCounts:
        return ProgramCounts(self.hits, self.misses, self.compiled)


@dataclass(frozen=True)
class Bye:
    """The answer to ``Shutdown``: the programs and schedules the worker read from their caches
    and made, over its life."""

    programs: CacheUse | None = None
    schedules: CacheUse | None = None


@dataclass(frozen=True)
class EmbedAndForward(Request[HiddenOut], op="embed_and_forward", reply=HiddenOut):
    """Stage 0: the tokens' embeddings through its blocks, from ``position`` (``prefill``: a new
    sequence at position 0)."""

    tokens: tuple[int, ...]
    position: int
    prefill: bool = False


@dataclass(frozen=True)
class DecodeStep(Request[HiddenOut], op="decode_step", reply=HiddenOut):
    """Stage 0: one token at ``position``, by the compiled decode step."""

    token_id: int
    position: int


@dataclass(frozen=True)
class HiddenIn:
    """A hidden state of ``seq_len`` positions from the stage before, at ``position``. ``dtype``,
    if given, must be the worker's wire dtype."""

    hidden: bytes = dataclasses.field(repr=False)
    position: int
    seq_len: int
    prefill: bool = False
    dtype: WireDtype | None = None


@dataclass(frozen=True)
class Forward(HiddenIn, Request[HiddenOut], op="forward", reply=HiddenOut):
    """A middle stage: the hidden state through its blocks."""


@dataclass(frozen=True)
class ForwardAndSample(HiddenIn, Request[Sampled], op="forward_and_sample", reply=Sampled):
    """The last stage: the hidden state through its blocks, the head, and argmax."""


@dataclass(frozen=True)
class Tokenize(Request[TokenIds], op="tokenize", reply=TokenIds):
    """The prompt in the model's chat template, as token ids."""

    prompt: str


@dataclass(frozen=True)
class Detokenize(Request[Text], op="detokenize", reply=Text):
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ReadKvInfo(Request[KvInfo], op="kv_info", reply=KvInfo):
    """The worker's KV caches, read from its tensors."""


@dataclass(frozen=True)
class RunReference(Request[ReferenceResult], op="reference", reply=ReferenceResult):
    """The model in one piece on this worker's device: the tokens the pipeline must produce."""

    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class Shutdown(Request[Bye], op="shutdown", reply=Bye):
    pass


Reply = HiddenOut | Sampled | TokenIds | Text | KvInfo | ReferenceResult | Bye


@dataclass(frozen=True)
class ErrorReply:
    """A request the worker refused or failed; ``request_id`` and ``op`` as it read them (None:
    not an int, not a string)."""

    request_id: int | None
    op: str | None
    error: str


@dataclass(frozen=True)
class Ready:
    """The worker's first line: what it serves and how it loaded. A stage worker (``role``
    ``stage``) fills every field; a reference worker (``reference``) those before ``num_stages``.
    The seconds: ``load_s`` from the worker's start of loading to this line; ``wall_s`` from the
    process's start, of which ``imports_s``, ``device_s``, the weights', ``build_s`` (the stage's
    split) and ``warm_up_s`` (capturing the decode step)."""

    pid: int
    stage: int
    model: str
    wire_dtype: WireDtype
    max_context: int
    load_s: float
    framing: tuple[Framing, ...] = (Framing.json,)  # what this worker offers
    role: str = "stage"
    weights: WeightLoad | None = None
    programs: CacheUse | None = None
    schedules: CacheUse | None = None
    num_stages: int = 0
    range: Span | None = None  # its blocks [first, end)
    num_blocks: int = 0
    dim: int = 0
    end_ids: tuple[int, ...] = ()
    jit: bool = False
    param_bytes: int = 0
    warm_up_s: float = 0.0
    wall_s: float = 0.0
    imports_s: float = 0.0
    device_s: float = 0.0
    build_s: float = 0.0

    def load_figures(self) -> LoadFigures:
        """The figures a node reports of this load (``NodeStatus.load``)."""
        programs = self.programs.counts() if self.programs is not None else None
        return LoadFigures(
            self.weights, programs, self.wall_s, self.imports_s, self.device_s, self.build_s, self.warm_up_s
        )


# --- fields as JSON values -----------------------------------------------------------------------

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _value_to_json(tp: Any, value: Any) -> Any:
    if isinstance(value, WireDtype):
        return value.name
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, tuple):
        args = typing.get_args(tp)
        return [_value_to_json(args[0] if args else Any, v) for v in value]
    if hasattr(value, "_wire_struct"):
        return to_json(value)
    if dataclasses.is_dataclass(value):
        return _fields_to_json(value)
    return value


def _value_from_json(tp: Any, value: Any, name: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None:
            return None
        return _value_from_json(next(a for a in args if a is not type(None)), value, name)
    if tp is bool:
        if not isinstance(value, bool):
            raise PipeError(f"{name} must be true or false, got {value!r:.80}")
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise PipeError(f"{name} must be a non-negative integer, got {value!r:.80}")
        return value
    if tp is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise PipeError(f"{name} must be a finite number, got {value!r:.80}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise PipeError(f"{name} must be a string, got {type(value).__name__}")
        return value
    if tp is bytes:
        try:
            return bytes.fromhex(value)
        except (TypeError, ValueError):
            raise PipeError(f"{name} must be hex, got {value!r:.80}") from None
    if tp is WireDtype:
        try:
            return WireDtype.parse(str(value))
        except ValueError as e:
            raise PipeError(f"{name}: {e}") from None
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise PipeError(f"{name} must be one of {', '.join(str(m.value) for m in tp)}, got {value!r:.80}") from None
    if origin is tuple:
        if not isinstance(value, list):
            raise PipeError(f"{name} must be a list, got {value!r:.80}")
        return tuple(_value_from_json(args[0], v, f"{name}[{i}]") for i, v in enumerate(value))
    if hasattr(tp, "_wire_struct"):
        try:
            return from_json(tp, value, name)
        except RecordError as e:
            raise PipeError(str(e)) from None
    if dataclasses.is_dataclass(tp):
        try:
            return _fields_from_json(tp, value)  # type: ignore[arg-type]
        except PipeError as e:
            raise PipeError(f"{name}: {e}") from None
    raise TypeError(f"no JSON form for {name} of type {tp!r}")


def _fields_to_json(record: Any) -> dict[str, Any]:
    """The record's fields as JSON values, ``hidden`` and the ``None`` ones left out."""
    if hasattr(record, "_wire_struct"):
        return dict(to_json(record))
    hints = _hints(type(record))
    out = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if f.name != "hidden" and value is not None:
            out[f.name] = _value_to_json(hints[f.name], value)
    return out


def _fields_from_json(cls: type[R], obj: Any, hidden: bytes | None = None) -> R:
    """The record ``cls`` from a JSON object (keys it does not have are ignored); a missing or
    malformed field is a PipeError naming it."""
    if not isinstance(obj, dict):
        raise PipeError(f"{cls.__name__} must be a JSON object, got {type(obj).__name__}")
    if hasattr(cls, "_wire_struct"):
        try:
            return from_json(cls, obj)
        except RecordError as e:
            raise PipeError(str(e)) from None
    hints, values = _hints(cls), {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name == "hidden":
            values["hidden"] = hidden
        elif f.name in obj:
            values[f.name] = _value_from_json(hints[f.name], obj[f.name], f.name)
        elif f.default is dataclasses.MISSING:
            raise PipeError(f"missing field {f.name!r}")
    return cls(**values)


def _hidden_in_line(obj: dict[str, Any], payload: bytes | None, what: str) -> bytes:
    """The hidden state of a line: the payload after it, or else its ``hidden_b64``."""
    if payload is not None:
        if "hidden_b64" in obj:
            raise PipeError(f"a payload of {len(payload)} bytes and hidden_b64 both; send the hidden state once")
        return payload
    if "hidden_b64" not in obj:
        raise PipeError(f"missing field 'hidden_b64' (or a payload) in {what}")
    raw = obj["hidden_b64"]
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise PipeError(f"hidden_b64 is not valid base64 (starts {str(raw)[:16]!r})") from None


def _line(obj: dict[str, Any], hidden: bytes | None, framing: Framing) -> bytes:
    """One line and, in the payload framing, the bytes that follow it: one write."""
    if framing is Framing.payload:
        obj["payload"] = len(hidden) if hidden else 0
        line = json.dumps(obj).encode() + b"\n"
        return line + hidden if hidden else line
    if hidden is not None:
        obj["hidden_b64"] = base64.b64encode(hidden).decode()
    return json.dumps(obj).encode() + b"\n"


def _has_hidden(cls: type) -> bool:
    return any(f.name == "hidden" for f in dataclasses.fields(cls))


# --- requests ------------------------------------------------------------------------------------


def encode_request(request_id: int, request: Request[Any], framing: Framing) -> bytes:
    """The request's line (and in the payload framing the hidden state's bytes after it)."""
    hidden = getattr(request, "hidden", None)
    return _line({"op": request.op, "request_id": request_id, **_fields_to_json(request)}, hidden, framing)


def payload_size(obj: dict[str, Any]) -> int | None:
    """How many raw bytes follow this line (None: no ``payload``, the JSON framing); a value
    that is not a byte count leaves the stream unframeable."""
    if "payload" not in obj:
        return None
    n = obj["payload"]
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_PAYLOAD:
        raise Unframeable(
            f"payload must be a byte count in [0, {MAX_PAYLOAD}], got {str(n)[:40]!r}; "
            "the bytes after this line cannot be framed"
        )
    return n


def request_head(obj: Any) -> tuple[Any, Any]:
    """The ``request_id`` and ``op`` of a request line, as sent (for an error reply)."""
    return (obj.get("request_id"), obj.get("op")) if isinstance(obj, dict) else (None, None)


def decode_request(obj: Any, payload: bytes | None = None) -> Request[Any]:
    """The request of a line (``payload``: the bytes that followed it in the payload framing)."""
    if not isinstance(obj, dict):
        raise PipeError(f"a request must be a JSON object, got {type(obj).__name__}")
    op = obj.get("op")
    cls = OPS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise PipeError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")
    if not _has_hidden(cls):
        if payload:
            raise PipeError(f"{op} takes no hidden state, got a payload of {len(payload)} bytes")
        return _fields_from_json(cls, obj)
    return _fields_from_json(cls, obj, _hidden_in_line(obj, payload, cls.op))


# --- replies -------------------------------------------------------------------------------------


def encode_reply(request_id: Any, reply: Reply, framing: Framing, worker_s: float | None = None) -> bytes:
    """The reply's line (in the request's framing), with the worker's seconds on it."""
    obj: dict[str, Any] = {"request_id": request_id, **_fields_to_json(reply)}
    if isinstance(reply, Bye):
        obj["status"] = "bye"
    if worker_s is not None:
        obj["worker_s"] = worker_s
    return _line(obj, getattr(reply, "hidden", None), framing)


def encode_error(request_id: Any, op: Any, error: str) -> bytes:
    return (json.dumps({"request_id": request_id, "op": op, "error": error}) + "\n").encode()


def encode_progress(what: str, done: int, total: int) -> bytes:
    """A progress line, written by the worker while a call runs (the reference's tokens as they
    are sampled) or while it loads (``protocol.LOAD_STEPS``): ``{"progress": what, "done": n, "total":
    m}``. It has no ``request_id``, so that a bridge that does not read it passes it over as it
    does any line that answers no call."""
    return (json.dumps({"progress": what, "done": done, "total": total}) + "\n").encode()


def progress_of(obj: dict[str, Any]) -> tuple[str, int, int] | None:
    """What a progress line counts (``what``, ``done``, ``total``); None: not a progress line."""
    what, done, total = obj.get("progress"), obj.get("done"), obj.get("total")
    if "request_id" in obj or not isinstance(what, str):
        return None
    if not (_count(done) and _count(total)):
        return None
    return what, done, total


def answers(lines: Iterable[str | bytes]) -> list[dict[str, Any]]:
    """The JSON lines of a worker's stdout that are not progress lines: its ready line and its
    replies, in order (a test's or a bench's view of a whole run of the worker)."""
    return [obj for obj in (json.loads(line) for line in lines if line.strip()) if progress_of(obj) is None]


def read_ready(readline: Callable[[], str | bytes]) -> Ready:
    """The ready line, read past the load's progress lines before it (``protocol.LOAD_STEPS``)."""
    while True:
        line = readline()
        if not line:
            raise PipeError("the worker closed its stdout before its ready line")
        obj = json.loads(line)
        if progress_of(obj) is None:
            return decode_ready(obj)


def _count(n: Any) -> TypeGuard[int]:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def reply_id(obj: dict[str, Any]) -> int | None:
    """The request a reply line answers (None: not a request's)."""
    rid = obj.get("request_id")
    return rid if isinstance(rid, int) and not isinstance(rid, bool) else None


def worker_seconds(obj: dict[str, Any]) -> float | None:
    """The seconds the worker spent on the request, as its reply line says."""
    s = obj.get("worker_s")
    return float(s) if isinstance(s, (int, float)) and not isinstance(s, bool) else None


def decode_reply(cls: type[R], obj: dict[str, Any], payload: bytes | None = None) -> R | ErrorReply:
    """The reply of a line: ``cls``, or the worker's ``ErrorReply``."""
    if isinstance(obj, dict) and "error" in obj:
        op, error = obj.get("op"), obj["error"]
        return ErrorReply(reply_id(obj), op if isinstance(op, str) else None, str(error))
    if _has_hidden(cls):
        return _fields_from_json(cls, obj, _hidden_in_line(obj, payload, cls.__name__))
    if payload:
        raise PipeError(f"{cls.__name__} takes no hidden state, got a payload of {len(payload)} bytes")
    return _fields_from_json(cls, obj)


# --- the ready line ------------------------------------------------------------------------------


def ready_fields(ready: Ready) -> dict[str, Any]:
    """The ready line's fields as JSON values (without ``status``)."""
    return _fields_to_json(ready)


def encode_ready(ready: Ready) -> bytes:
    return (json.dumps({"status": "ready", **ready_fields(ready)}) + "\n").encode()


def is_ready(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get("status") == "ready"


def decode_ready(obj: Any) -> Ready:
    if not is_ready(obj):
        raise PipeError(f'a ready line has "status": "ready", got {str(obj)[:80]}')
    return _fields_from_json(Ready, obj)


def worker_script() -> Path:
    """The installed ``pp_tinygrad_worker.py``: inside the package in a wheel install, beside it
    in a checkout."""
    here = Path(__file__).resolve().parent.parent  # the package
    installed = here / "worker" / "pp_tinygrad_worker.py"  # a wheel install
    return installed if installed.is_file() else here.parent / "worker" / "pp_tinygrad_worker.py"

"""pp_tinygrad_worker: one pipeline stage in tinygrad, behind the spec's stdin/stdout JSON protocol.

Environment (``pytest_ppsmoke.nodeenv.NodeEnv``): the stage and stage count, the model (a name
or a GGUF path), the wire dtype (bf16, f16, f32: the dtype of the hidden states), the context
(default 1024) and whether decode is compiled (the default; off: the spec's uncompiled path).

The first line on stdout is ``{"status": "ready", "pid": ..., ...}``; then one JSON reply per
request line. Before it, the worker has realized its part (from the weight cache when it holds it:
``weights``), and captured its compiled decode step (``warm_up_s``), so that a request's decode is
compiled from its first token; ``programs`` counts the programs it read from the program cache and
generated (``stage/cache.py``), ``schedules`` the schedules likewise, and so does the ``shutdown``
reply, for the worker's whole life. Hidden states are base64 of raw little-endian bytes in the wire
dtype, shape ``[seq_len, dim]``; a reply that carries one has ``hidden_digest``, and a reply to a
request that carried one has ``received_digest``: the hex blake2b (``messages.digest``) of the raw
bytes this worker produced, before base64, and of those it decoded, so that a stage can show that an
activation arrived as it was sent. ``"prefill": true`` (default false) on a compute call at position
0 begins a sequence (``StageModel``: caches zeroed, writes recorded, the prompt's positions
digested). Operations::

    {"op": "embed_and_forward", "request_id": 1, "tokens": [...], "position": 0, "prefill": true}  stage 0
    {"op": "decode_step", "request_id": 2, "token_id": 42, "position": 11}              stage 0
    {"op": "forward", "request_id": 3, "hidden_b64": "...", "position": 0, "seq_len": 11}  middle
    {"op": "forward_and_sample", "request_id": 4, "hidden_b64": "...", "position": 0, "seq_len": 11}  last
    {"op": "tokenize", "request_id": 5, "prompt": "Say hello"}
    {"op": "detokenize", "request_id": 6, "token_ids": [...]}
    {"op": "kv_info", "request_id": 7}
    {"op": "reference", "request_id": 8, "prompt": "Say hello", "max_tokens": 64}        any stage
    {"op": "shutdown", "request_id": 9}

With ``PP_WORKER_ROLE=reference`` the worker is the reference beside a stage (``ReferenceWorker``):
it loads the whole model before its ready line (``role``: ``reference``), keeps it,
and answers ``reference`` and ``shutdown`` only.

A stage's ``reference`` loads the model afresh (a Transformer of its own, never this stage's) and runs it
in one piece through tinygrad's ``generate`` on this worker's device; with a bf16 or f16 wire its
hidden state is rounded to the wire dtype after each stage's last block, as the pipeline's is.
It answers ``method``, ``device``, ``prompt_token_ids``, ``token_ids``, ``load_s``, ``generate_s``
and the device bytes in use before and after (``mem_before``, ``mem_after``: the reference model
is dropped before the reply). The stage's own model and KV cache are left as they were.

A bad request (unknown op, bad base64, wrong shape or dtype, a position outside the context)
gets ``{"request_id": ..., "op": ..., "error": "..."}`` naming the value, and the worker goes on.

The payload framing (the ready line's ``"framing": ["json", "payload"]``): a request line may
carry ``"payload": N``; then exactly N raw bytes follow its newline: the hidden state in the wire
dtype, in place of ``hidden_b64`` (N is 0 for a request that sends none, such as
``decode_step``). Such a request is answered in the same framing: a reply that has a hidden
state carries ``"payload": M`` in place of ``hidden_b64``, and its M raw bytes follow the reply's
newline; a reply without one (``token_id``, an error) is one line, as in JSON. Digests are of the
same raw bytes either way. A decode step at position 11 (SmolLM2, bf16), stage 0 then stage 1::

    {"op": "decode_step", "request_id": 2, "token_id": 42, "position": 11, "payload": 0}\n
    {"request_id": 2, "payload": 1152, "hidden_digest": "...", "seq_len": 1, "dtype": "bf16", ...}\n<1152 bytes>
    {"op": "forward_and_sample", "request_id": 3, "position": 11, "seq_len": 1, "payload": 1152}\n<1152 bytes>
    {"request_id": 3, "token_id": 17, "received_digest": "...", ...}\n

A payload whose length does not fit the request (``seq_len`` x dim x the dtype's size), one for
an op that takes no hidden state, or one beside ``hidden_b64`` is an error reply naming both, and
the worker goes on (it has read the bytes). A ``payload`` that is not a byte count in
[0, ``MAX_PAYLOAD``], or a payload cut short by the end of stdin, leaves the stream unframeable:
the worker answers with the error, says so on stderr and exits with status 3. (A request line
that is not JSON cannot say whether bytes follow it: what follows is read as request lines.)
"""

from __future__ import annotations

import time

STARTED = time.monotonic()  # the process's start, near enough: before the imports below

import base64
import binascii
import dataclasses
import json
import os
import sys
from typing import Any, BinaryIO

import numpy as np

from pytest_ppsmoke.messages import Hidden, WireDtype, digest, to_json
from pytest_ppsmoke.nodeenv import NodeEnv
from pytest_ppsmoke.stage.bridge import FRAMINGS
from pytest_ppsmoke.stage.cache import SCHEDULES, WeightCache, install_program_cache
from pytest_ppsmoke.stage.model import (
    ReferenceModel,
    StageModel,
    Tokenizer,
    native_weights_on_the_cpu,
    open_device,
    realized_model,
    run_reference,
)

IMPORTED = time.monotonic()

MAX_PAYLOAD = 256 << 20  # bytes: a prefill's hidden state at the largest context is far below


class RequestError(ValueError):
    pass


class Unframeable(RequestError):
    """The bytes after this request line cannot be told apart from the next request."""


def _field(req: dict[str, Any], name: str, kind: type) -> Any:
    if name not in req:
        raise RequestError(f"missing field {name!r}")
    value = req[name]
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise RequestError(f"{name} must be a non-negative integer, got {value!r}")
    if kind is list and (not isinstance(value, list) or not all(isinstance(v, int) and v >= 0 for v in value)):
        raise RequestError(f"{name} must be a list of token ids, got {str(value)[:80]}")
    if kind is str and not isinstance(value, str):
        raise RequestError(f"{name} must be a string, got {type(value).__name__}")
    return value


def _flag(req: dict[str, Any], name: str) -> bool:
    value = req.get(name, False)
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}")
    return value


class Worker:
    def __init__(self, env: NodeEnv) -> None:
        self.stage, self.num_stages, self.model_name = env.stage, env.num_stages, env.model
        self.wire = WireDtype.parse(env.wire_dtype)
        started = time.monotonic()
        self.programs = install_program_cache() if env.program_cache else None
        self.device_s = open_device()
        self.cache = WeightCache.from_setting(env.weight_cache)
        model, kv, self.weights = realized_model(
            self.model_name, env.max_context, self.stage, self.num_stages, self.cache
        )
        self.tokenizer = Tokenizer(kv)
        self.vocab = len(kv["tokenizer.ggml.tokens"])
        built = time.monotonic()
        self.model = StageModel(model, kv, self.stage, self.num_stages, jit=env.jit)
        self.build_s = time.monotonic() - built
        self.warm_up_s = self.model.warm_up()  # decode runs compiled from a request's first token
        self.load_s = time.monotonic() - started

    def ready(self) -> dict[str, Any]:
        m = self.model
        return {
            "status": "ready",
            "pid": os.getpid(),
            "stage": self.stage,
            "num_stages": self.num_stages,
            "model": self.model_name,
            "range": [m.lo, m.hi],
            "num_blocks": m.total_blocks,
            "dim": m.dim,
            "max_context": m.max_context,
            "end_ids": sorted(self.tokenizer.end_ids),
            "wire_dtype": self.wire.name,
            "jit": m.jit,
            "param_bytes": m.param_bytes,
            "load_s": round(self.load_s, 3),
            "warm_up_s": round(self.warm_up_s, 3),
            # the parts of the process's start to this line (with the weights' seconds)
            "wall_s": round(time.monotonic() - STARTED, 3),
            "imports_s": round(IMPORTED - STARTED, 3),
            "device_s": round(self.device_s, 3),
            "build_s": round(self.build_s, 3),
            "weights": to_json(dataclasses.replace(self.weights, seconds=round(self.weights.seconds, 3))),
            "programs": dataclasses.asdict(self.programs) if self.programs else None,
            "schedules": dataclasses.asdict(SCHEDULES) if self.programs else None,
            "framing": list(FRAMINGS),  # what this worker offers: all of them
        }

    def _hidden_in(self, req: dict[str, Any], payload: bytes | None) -> tuple[np.ndarray, str]:
        """The request's hidden state (its payload, or else its ``hidden_b64``) and the digest of
        its raw bytes."""
        seq_len = _field(req, "seq_len", int)
        if req.get("dtype", self.wire.name) != self.wire.name:
            raise RequestError(
                f"hidden dtype {req.get('dtype')!r} differs from this worker's wire dtype {self.wire.name}"
            )
        if payload is not None:
            if "hidden_b64" in req:
                raise RequestError(f"a payload of {len(payload)} bytes and hidden_b64 both; send the hidden state once")
            data = payload
        else:
            raw = _field(req, "hidden_b64", str)
            try:
                data = base64.b64decode(raw, validate=True)
            except (binascii.Error, ValueError):
                raise RequestError(f"hidden_b64 is not valid base64 (starts {raw[:16]!r})") from None
        try:
            return Hidden(int(self.wire), (seq_len, self.model.dim), data).to_array(), digest(data).hex()
        except ValueError as e:
            raise RequestError(f"payload of {len(data)} bytes: {e}" if payload is not None else str(e)) from None

    def _hidden_out(self, request_id: Any, x: np.ndarray, framed: bool) -> tuple[dict[str, Any], bytes | None]:
        """The reply that carries hidden state ``x``, and its payload (``framed``: the request
        came in the payload framing; else None, and the bytes ride in the reply as base64)."""
        h = Hidden.from_array(x, self.wire)
        reply: dict[str, Any] = {"request_id": request_id}
        if framed:
            reply["payload"] = len(h.data)
        else:
            reply["hidden_b64"] = base64.b64encode(h.data).decode()
        reply |= {
            "hidden_digest": digest(h.data).hex(),  # of the raw wire bytes, before base64
            "seq_len": int(x.shape[0]),
            "dtype": self.wire.name,
        }
        return reply, h.data if framed else None

    def _tokens(self, ids: list[int]) -> list[int]:
        bad = [t for t in ids if t >= self.vocab]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary of {self.vocab}")
        return ids

    def handle(self, req: dict[str, Any], payload: bytes | None = None) -> tuple[dict[str, Any], bytes | None]:
        """The reply to ``req`` and the bytes that follow it (``payload``: the bytes that came
        with ``req`` in the payload framing, else None; the reply is in the request's framing)."""
        rid, op, m, framed = req.get("request_id"), req.get("op"), self.model, payload is not None
        if framed and payload and op not in ("forward", "forward_and_sample"):
            raise RequestError(f"{op} takes no hidden state, got a payload of {len(payload)} bytes")
        if op == "embed_and_forward":
            tokens = self._tokens(_field(req, "tokens", list))
            if not tokens:
                raise RequestError("tokens must not be empty")
            out = m.embed_and_forward(tokens, _field(req, "position", int), _flag(req, "prefill"))
            return self._hidden_out(rid, out, framed)
        if op == "decode_step":
            one = self._tokens([_field(req, "token_id", int)])
            return self._hidden_out(rid, m.embed_and_forward(one, _field(req, "position", int)), framed)
        if op == "forward":
            hidden, received = self._hidden_in(req, payload)
            out = m.forward(hidden, _field(req, "position", int), _flag(req, "prefill"))
            reply, data = self._hidden_out(rid, out, framed)
            return {**reply, "received_digest": received}, data
        if op == "forward_and_sample":
            hidden, received = self._hidden_in(req, payload)
            token = m.forward_and_sample(hidden, _field(req, "position", int), _flag(req, "prefill"))
            return {"request_id": rid, "token_id": token, "received_digest": received}, None
        if op == "tokenize":
            return {"request_id": rid, "token_ids": self.tokenizer.chat(_field(req, "prompt", str))}, None
        if op == "detokenize":
            text = self.tokenizer.decode(self._tokens(_field(req, "token_ids", list)))
            return {"request_id": rid, "text": text}, None
        if op == "kv_info":
            return {"request_id": rid, **to_json(m.kv_info())}, None
        if op == "reference":
            prompt, max_tokens = _field(req, "prompt", str), _field(req, "max_tokens", int)
            ref = run_reference(
                self.model_name, prompt, max_tokens, self.wire, self.num_stages, m.max_context, self.cache, self.stage
            )
            return {"request_id": rid, **to_json(ref)}, None
        if op == "shutdown":  # with the programs this process generated and read, over its life
            programs = dataclasses.asdict(self.programs) if self.programs else None
            schedules = dataclasses.asdict(SCHEDULES) if self.programs else None
            return {"request_id": rid, "status": "bye", "programs": programs, "schedules": schedules}, None
        ops = (
            "embed_and_forward, decode_step, forward, forward_and_sample, tokenize, detokenize, kv_info, reference, "
            "shutdown"
        )
        raise RequestError(f"unknown op {op!r}; expected one of {ops}")


class ReferenceWorker:
    """``PP_WORKER_ROLE=reference``: the reference beside a stage, in a process of its own. It
    loads the whole model (``ReferenceModel``, never a stage's) while the stages load, and keeps
    it: a ``reference`` op then only generates. No warm-up generate: tinygrad's ``generate`` resets
    its compiled step on every call, so one before the request would save nothing of the three
    eager passes that each call begins with (a second call on a SmolLM2 model kept in the process
    took as long as the first: 5.6-6.4 s for 32 tokens), and it would take the cores from the
    stages' load. It answers ``reference`` and ``shutdown``; any other op is an error naming the
    two."""

    def __init__(self, env: NodeEnv) -> None:
        self.stage, self.model_name = env.stage, env.model
        self.wire = WireDtype.parse(env.wire_dtype)
        started = time.monotonic()
        self.programs = install_program_cache() if env.program_cache else None
        cache = WeightCache.from_setting(env.weight_cache)
        self.model = ReferenceModel(self.model_name, self.wire, env.num_stages, env.max_context, cache, self.stage)
        self.load_s = time.monotonic() - started

    def ready(self) -> dict[str, Any]:
        weights = self.model.weights
        return {
            "status": "ready",
            "role": "reference",
            "pid": os.getpid(),
            "stage": self.stage,
            "model": self.model_name,
            "wire_dtype": self.wire.name,
            "max_context": self.model.model.max_context,
            "load_s": round(self.load_s, 3),
            "weights": to_json(dataclasses.replace(weights, seconds=round(weights.seconds, 3))),
            "programs": dataclasses.asdict(self.programs) if self.programs else None,
            "schedules": dataclasses.asdict(SCHEDULES) if self.programs else None,
            "framing": ["json"],
        }

    def handle(self, req: dict[str, Any], payload: bytes | None = None) -> tuple[dict[str, Any], bytes | None]:
        rid, op = req.get("request_id"), req.get("op")
        if payload:
            raise RequestError(f"{op} takes no hidden state, got a payload of {len(payload)} bytes")
        if op == "reference":
            ref = self.model.generate(_field(req, "prompt", str), _field(req, "max_tokens", int))
            ref = dataclasses.replace(ref, loaded="beside")
            return {"request_id": rid, **to_json(ref)}, None
        if op == "shutdown":
            programs = dataclasses.asdict(self.programs) if self.programs else None
            schedules = dataclasses.asdict(SCHEDULES) if self.programs else None
            return {"request_id": rid, "status": "bye", "programs": programs, "schedules": schedules}, None
        raise RequestError(f"unknown op {op!r} for a reference worker; expected reference or shutdown")


def _reply(out: BinaryIO, obj: dict[str, Any], payload: bytes | None = None) -> None:
    """One reply: its line, then its payload (the line says how long), in one flush."""
    out.write(json.dumps(obj).encode() + b"\n")
    if payload:
        out.write(payload)
    out.flush()


def _read_payload(stdin: BinaryIO, req: dict[str, Any]) -> bytes | None:
    """The raw bytes that follow request line ``req`` (None: it has no ``payload``, JSON framing)."""
    if "payload" not in req:
        return None
    n = req["payload"]
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_PAYLOAD:
        raise Unframeable(
            f"payload must be a byte count in [0, {MAX_PAYLOAD}], got {str(n)[:40]!r}; "
            "the bytes after this line cannot be framed"
        )
    data = stdin.read(n) if n else b""
    if len(data) != n:
        raise Unframeable(f"stdin ended after {len(data)} of the payload's {n} bytes")
    return data


def main() -> None:
    native_weights_on_the_cpu()  # float32 from a quantized file on the CPU, unless HALF is set
    try:
        env = NodeEnv.from_env()
        worker: Worker | ReferenceWorker = Worker(env) if env.worker_role == "stage" else ReferenceWorker(env)
    except ValueError as e:  # ModelError and bad environment: say why, exit non-zero
        print(f"pp_tinygrad_worker: {e}", file=sys.stderr)
        sys.exit(2)
    stdin, out = sys.stdin.buffer, sys.stdout.buffer
    _reply(out, worker.ready())
    while line := stdin.readline():
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if not isinstance(req, dict):
                raise RequestError(f"a request must be a JSON object, got {type(req).__name__}")
        except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; so is a huge int
            error = f"bad request line: {type(e).__name__}: {str(e)[:200]}"
            _reply(out, {"request_id": None, "op": None, "error": error})
            continue
        rid, op = req.get("request_id"), req.get("op")
        try:
            payload = _read_payload(stdin, req)
        except Unframeable as e:
            _reply(out, {"request_id": rid, "op": op, "error": f"{op}: {e}"})
            print(f"pp_tinygrad_worker: {op}: {e}; exiting", file=sys.stderr)
            sys.exit(3)
        data = None
        try:
            started = time.perf_counter()
            reply, data = worker.handle(req, payload)
            reply["worker_s"] = round(time.perf_counter() - started, 6)  # for the per-token breakdown
        except (RequestError, ValueError) as e:
            reply = {"request_id": rid, "op": op, "error": f"{op}: {e}"}
        except Exception as e:  # tinygrad failed on this input: say so and keep serving
            reply = {"request_id": rid, "op": op, "error": f"{op}: {type(e).__name__}: {e}"}
        _reply(out, reply, data)
        if op == "shutdown":
            return


if __name__ == "__main__":
    main()

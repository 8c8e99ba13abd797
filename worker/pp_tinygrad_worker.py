"""pp_tinygrad_worker: one pipeline stage in tinygrad, behind the spec's stdin/stdout JSON protocol.

Environment (``pytest_ppsmoke.nodeenv.NodeEnv``): the stage and stage count, the model (a name
or a GGUF path), the wire dtype (bf16, f16, f32: the dtype of the hidden states), the context
and whether decode is compiled (the default; off: the spec's uncompiled path).

The protocol's records, their JSON lines and the payload framing are ``stage/pipe.py``'s, shared
with the node's bridge. After the load's progress lines (below), ``Ready``; then one reply per request line::

    {"op": "embed_and_forward", "request_id": 1, "tokens": [...], "position": 0, "prefill": true}  stage 0
    {"op": "decode_step", "request_id": 2, "token_id": 42, "position": 11}              stage 0
    {"op": "forward", "request_id": 3, "hidden_b64": "...", "position": 0, "seq_len": 11}  middle
    {"op": "forward_and_sample", "request_id": 4, "hidden_b64": "...", "position": 0, "seq_len": 11}  last
    {"op": "tokenize", "request_id": 5, "prompt": "Say hello"}
    {"op": "detokenize", "request_id": 6, "token_ids": [...]}
    {"op": "kv_info", "request_id": 7}
    {"op": "reference", "request_id": 8, "prompt": "Say hello", "max_tokens": 64}        any stage
    {"op": "shutdown", "request_id": 9}

While it loads, the worker says how far it is in progress lines (``protocol.LOAD_STEPS``: the step
it has begun, its blocks realized, the programs it has read or generated), which answer no call.
Before its ready line the worker has realized its part (from the weight cache when it holds it:
``weights``), and captured its compiled decode step (``warm_up_s``), so that a request's decode is
compiled from its first token; ``programs`` counts the programs it read from the program cache and
generated (``stage/cache.py``), ``schedules`` the schedules likewise, and so does the ``shutdown``
reply, for the worker's whole life. A reply with a hidden state has ``hidden_digest``, and a reply
to a request that carried one has ``received_digest``: the blake2b (``messages.digest``) of the raw
bytes this worker produced and of those it decoded, so that a stage can show that an activation
arrived as it was sent. ``"prefill": true`` on a compute call at position 0 begins a sequence
(``StageModel``: caches zeroed, writes recorded, the prompt's positions digested).

With ``PP_WORKER_ROLE=reference`` the worker is the reference beside a stage (``ReferenceWorker``):
it loads the whole model before its ready line (``role``: ``reference``), keeps it,
and answers ``reference`` and ``shutdown`` only.

A stage's ``reference`` loads the model afresh (a Transformer of its own, never this stage's) and runs it
in one piece through tinygrad's ``generate`` on this worker's device (while it runs, a progress line
``{"progress": "tokens", "done": n, "total": max_tokens}`` once the model is ready and after each
token: lines with no ``request_id``, which answer no call); with a bf16 or f16 wire its
hidden state is rounded to the wire dtype after each stage's last block, as the pipeline's is
(``ReferenceResult``: the device bytes in use before and after, the reference model dropped
before the reply). The stage's own model and KV cache are left as they were.

A bad request (unknown op, a missing or malformed field, bad base64, wrong shape or dtype, a
position outside the context) gets ``{"request_id": ..., "op": ..., "error": "..."}`` naming the
value, and the worker goes on. So does a payload whose length does not fit the request, one for
an op that takes no hidden state, or one beside ``hidden_b64`` (the worker has read its bytes). A
``payload`` that is not a byte count in [0, ``pipe.MAX_PAYLOAD``], or a payload cut short by the
end of stdin, leaves the stream unframeable: the worker answers with the error, says so on stderr
and exits with status 3. (A request line that is not JSON cannot say whether bytes follow it:
what follows is read as request lines.)
"""

from __future__ import annotations

import time

STARTED = time.monotonic()  # the process's start, near enough: before the imports below

import dataclasses
import json
import os
import sys
from typing import Any, BinaryIO

import numpy as np

from pytest_ppsmoke import failpoints
from pytest_ppsmoke.messages import Hidden, ProgramCounts, Span, WireDtype, digest
from pytest_ppsmoke.nodeenv import NodeEnv
from pytest_ppsmoke.protocol import LOAD_STEPS
from pytest_ppsmoke.runtime import scrub
from pytest_ppsmoke.stage import markers
from pytest_ppsmoke.stage.cache import SCHEDULES, ProgramStats, ScheduleStats, WeightCache, install_program_cache
from pytest_ppsmoke.stage.model import StageModel, Tokenizer, native_weights_on_the_cpu, open_device, realized_model
from pytest_ppsmoke.stage.pipe import (
    Bye,
    CacheUse,
    DecodeStep,
    Detokenize,
    EmbedAndForward,
    Forward,
    ForwardAndSample,
    Framing,
    HiddenOut,
    PipeError,
    ReadKvInfo,
    Ready,
    Reply,
    Request,
    RunReference,
    Sampled,
    Shutdown,
    Text,
    TokenIds,
    Tokenize,
    Unframeable,
    decode_request,
    encode_error,
    encode_progress,
    encode_ready,
    encode_reply,
    payload_size,
    request_head,
)
from pytest_ppsmoke.stage.reference import ReferenceModel, run_reference

IMPORTED = time.monotonic()


class Worker:
    def __init__(self, env: NodeEnv) -> None:
        self.stage, self.num_stages, self.model_name = env.stage, env.num_stages, env.model
        self.wire = WireDtype.parse(env.wire_dtype)
        # node.compute_fault: a wrong computation, made before the digest, so the wire cannot see it
        self.fault = failpoints.parse(env.failpoints).on("node.compute_fault")
        started = time.monotonic()
        self.programs = install_program_cache() if env.program_cache else None
        self.said = said = ProgramsSaid(self.programs)
        said.step(0)
        self.device_s = open_device()
        self.cache = WeightCache.from_setting(env.weight_cache)
        said.step(1)
        model, kv, self.weights = realized_model(
            self.model_name, env.max_context, self.stage, self.num_stages, self.cache, said.blocks
        )
        self.tokenizer = Tokenizer(kv).ready_to_encode() if self.stage == 0 else Tokenizer(kv)  # the last decodes
        self.vocab = len(kv["tokenizer.ggml.tokens"])
        said.step(2)
        built = time.monotonic()
        self.model = StageModel(model, kv, self.stage, self.num_stages, jit=env.jit)
        self.build_s = time.monotonic() - built
        said.step(3)
        self.warm_up_s = self.model.warm_up()  # decode runs compiled from a request's first token
        self.load_s = time.monotonic() - started

    def ready(self) -> Ready:
        m = self.model
        return Ready(
            os.getpid(),
            self.stage,
            self.model_name,
            self.wire,
            m.max_context,
            round(self.load_s, 3),
            tuple(Framing),  # what this worker offers: all of them
            weights=dataclasses.replace(self.weights, seconds=round(self.weights.seconds, 3)),
            programs=_counts(self.programs),
            schedules=_counts(SCHEDULES if self.programs else None),
            num_stages=self.num_stages,
            range=Span(m.lo, m.hi),
            num_blocks=m.total_blocks,
            dim=m.dim,
            end_ids=tuple(sorted(self.tokenizer.end_ids)),
            jit=m.jit,
            param_bytes=m.param_bytes,
            warm_up_s=round(self.warm_up_s, 3),
            # the parts of the process's start to this line (with the weights' seconds)
            wall_s=round(time.monotonic() - STARTED, 3),
            imports_s=round(IMPORTED - STARTED, 3),
            device_s=round(self.device_s, 3),
            build_s=round(self.build_s, 3),
        )

    def _hidden_in(self, req: Forward | ForwardAndSample, framed: bool) -> tuple[np.ndarray, bytes]:
        """The request's hidden state and the digest of its raw bytes."""
        if req.dtype is not None and req.dtype is not self.wire:
            raise PipeError(f"hidden dtype {req.dtype.name!r} differs from this worker's wire dtype {self.wire.name}")
        try:
            return Hidden(int(self.wire), (req.seq_len, self.model.dim), req.hidden).to_array(), digest(req.hidden)
        except ValueError as e:
            raise PipeError(f"payload of {len(req.hidden)} bytes: {e}" if framed else str(e)) from None

    def _hidden_out(self, x: np.ndarray, received: bytes | None = None) -> HiddenOut:
        h = Hidden.from_array(-x if self.fault else x, self.wire)
        return HiddenOut(h.data, digest(h.data), int(x.shape[0]), self.wire, received)

    def _tokens(self, ids: tuple[int, ...]) -> list[int]:
        bad = [t for t in ids if t >= self.vocab]
        if bad:
            raise PipeError(f"token ids {bad[:5]} are outside the vocabulary of {self.vocab}")
        return list(ids)

    def handle(self, req: Request[Any], framed: bool = False) -> Reply:
        """The reply to ``req`` (``framed``: its hidden state came in the payload framing)."""
        m = self.model
        if isinstance(req, EmbedAndForward):
            if not req.tokens:
                raise PipeError("tokens must not be empty")
            return self._hidden_out(m.embed_and_forward(self._tokens(req.tokens), req.position, req.prefill))
        if isinstance(req, DecodeStep):
            return self._hidden_out(m.embed_and_forward(self._tokens((req.token_id,)), req.position))
        if isinstance(req, Forward):
            hidden, received = self._hidden_in(req, framed)
            return self._hidden_out(m.forward(hidden, req.position, req.prefill), received)
        if isinstance(req, ForwardAndSample):
            hidden, received = self._hidden_in(req, framed)
            return Sampled(m.forward_and_sample(hidden, req.position, req.prefill), received)
        if isinstance(req, Tokenize):
            return TokenIds(tuple(self.tokenizer.chat(req.prompt)))
        if isinstance(req, Detokenize):
            return Text(self.tokenizer.decode(self._tokens(req.token_ids)))
        if isinstance(req, ReadKvInfo):  # with the programs this process read, generated and compiled so far
            return dataclasses.replace(m.kv_info(), programs=_program_counts(self.programs))
        if isinstance(req, RunReference):
            ref = run_reference(
                self.model_name, req.prompt, req.max_tokens, self.wire, self.num_stages, m.max_context, self.cache,
                self.stage, say_tokens, self.said.blocks,
            )  # fmt: skip
            return dataclasses.replace(ref, programs=_program_counts(self.programs))
        if isinstance(req, Shutdown):  # with the programs this process generated and read, over its life
            return Bye(_counts(self.programs), _counts(SCHEDULES if self.programs else None))
        raise PipeError(f"{req.op} has no handler in a stage worker")


class ReferenceWorker:
    """``PP_WORKER_ROLE=reference``: the reference beside a stage, in a process of its own. It
    loads the whole model (``ReferenceModel``, never a stage's) while the stages load, and keeps
    it: a ``reference`` op then only generates. No warm-up generate: tinygrad's ``generate`` resets
    its compiled step on every call, so one before the request would save nothing of the three
    eager passes that each call begins with (a second call takes as long as the first:
    docs/benchmarks.md), and it
    would take the cores from the stages' load. It answers ``reference`` and ``shutdown``; any
    other op is an error naming the two."""

    def __init__(self, env: NodeEnv) -> None:
        self.stage, self.num_stages, self.model_name = env.stage, env.num_stages, env.model
        self.wire = WireDtype.parse(env.wire_dtype)
        started = time.monotonic()
        self.programs = install_program_cache() if env.program_cache else None
        self.said = ProgramsSaid(self.programs)
        cache = WeightCache.from_setting(env.weight_cache)
        self.model = ReferenceModel(self.model_name, self.wire, env.num_stages, env.max_context, cache, self.stage)
        self.load_s = time.monotonic() - started

    def ready(self) -> Ready:
        weights = self.model.weights
        return Ready(
            os.getpid(),
            self.stage,
            self.model_name,
            self.wire,
            self.model.model.max_context,
            round(self.load_s, 3),
            (Framing.json,),
            role="reference",
            weights=dataclasses.replace(weights, seconds=round(weights.seconds, 3)),
            programs=_counts(self.programs),
            schedules=_counts(SCHEDULES if self.programs else None),
            num_stages=self.num_stages,
        )

    def handle(self, req: Request[Any], framed: bool = False) -> Reply:
        if isinstance(req, RunReference):
            ref = self.model.generate(req.prompt, req.max_tokens, say_tokens)
            return dataclasses.replace(ref, loaded="beside", programs=_program_counts(self.programs))
        if isinstance(req, Shutdown):
            return Bye(_counts(self.programs), _counts(SCHEDULES if self.programs else None))
        raise PipeError(f"unknown op {req.op!r} for a reference worker; expected reference or shutdown")


def _program_counts(stats: ProgramStats | None) -> ProgramCounts | None:
    return ProgramCounts(stats.hits, stats.misses, stats.compiled) if stats is not None else None


def _counts(stats: ProgramStats | ScheduleStats | None) -> CacheUse | None:
    if isinstance(stats, ProgramStats):
        return CacheUse(stats.hits, stats.misses, round(stats.seconds, 3), tuple(stats.errors), stats.compiled)
    return CacheUse(stats.hits, stats.misses) if stats is not None else None


def main() -> None:
    # it holds no key, unless a test's failpoint hands it some; its stdout is the node's pipe
    scrub.install(scrub.secrets_in_env(), stdout=False)
    native_weights_on_the_cpu()  # float32 from a quantized file on the CPU, unless HALF is set
    try:
        env = NodeEnv.from_env()
        markers.log_secrets(env, stdout=False)  # the failpoint: the keys it was handed, every way it writes
        worker: Worker | ReferenceWorker = Worker(env) if env.worker_role == "stage" else ReferenceWorker(env)
    except ValueError as e:  # ModelError and bad environment: say why, exit non-zero
        print(f"pp_tinygrad_worker: {e}", file=sys.stderr)
        sys.exit(2)
    stdin, out = sys.stdin.buffer, sys.stdout.buffer
    _write(out, encode_ready(worker.ready()))
    while line := stdin.readline():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; so is a huge int
            _write(out, encode_error(None, None, f"bad request line: {type(e).__name__}: {str(e)[:200]}"))
            continue
        rid, op = request_head(obj)
        try:
            n = payload_size(obj) if isinstance(obj, dict) else None
            payload = (stdin.read(n) if n else b"") if n is not None else None
            if n is not None and payload is not None and len(payload) != n:
                raise Unframeable(f"stdin ended after {len(payload)} of the payload's {n} bytes")
        except Unframeable as e:
            _write(out, encode_error(rid, op, f"{op}: {e}"))
            print(f"pp_tinygrad_worker: {op}: {e}; exiting", file=sys.stderr)
            sys.exit(3)
        framing = Framing.payload if payload is not None else Framing.json
        try:
            started = time.perf_counter()
            worker.said.begin()
            req = decode_request(obj, payload)
            reply = worker.handle(req, payload is not None)
            # the seconds inside the worker, for the per-token breakdown
            _write(out, encode_reply(rid, reply, framing, round(time.perf_counter() - started, 6)))
        except ValueError as e:  # PipeError, and the model's refusals (a position outside the context)
            _write(out, encode_error(rid, op, f"{op}: {e}"))
        except Exception as e:  # tinygrad failed on this input: say so and keep serving
            _write(out, encode_error(rid, op, f"{op}: {type(e).__name__}: {e}"))
        else:
            if isinstance(req, Shutdown):
                return


class ProgramsSaid:
    """The stage's load as it goes, in progress lines before the ready line (``protocol.LOAD_STEPS``):
    the step begun, the blocks realized, and with the program cache on, each program read or
    generated (counted from the load's start, then from each request's: ``begin``). The node
    keeps the load's latest for its status, and passes a prefill's or a reference's on to the
    orchestrator as notes, so that its live line counts work while tinygrad makes programs."""

    def __init__(self, programs: ProgramStats | None) -> None:
        self.counted = 0
        if programs is not None:
            programs.on_program = self._program

    def begin(self) -> None:
        """A request begins: its programs count from 1."""
        self.counted = 0

    def step(self, index: int) -> None:
        _write(sys.stdout.buffer, encode_progress("step", index + 1, len(LOAD_STEPS)))

    def blocks(self, done: int, total: int) -> None:
        _write(sys.stdout.buffer, encode_progress("blocks", done, total))

    def _program(self) -> None:
        self.counted += 1
        _write(sys.stdout.buffer, encode_progress("programs", self.counted, 0))


def say_tokens(done: int, total: int) -> None:
    """The reference's tokens so far, as a progress line before its reply (``pipe.encode_progress``)."""
    _write(sys.stdout.buffer, encode_progress("tokens", done, total))


def _write(out: BinaryIO, data: bytes) -> None:
    """One line (and the payload it announces) in one flush."""
    out.write(data)
    out.flush()


if __name__ == "__main__":
    main()
    # asked to shut down (or its node gone), every reply written: out at once, not through the
    # interpreter's teardown of tinygrad's graphs and buffers one object at a time, which held a
    # node's exit (and a destroyed instance's end) for seconds. The OS takes the memory back and
    # the driver the device's context; the program cache commits each program as it stores it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

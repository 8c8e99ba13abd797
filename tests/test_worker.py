"""worker/pp_tinygrad_worker.py over its stdin/stdout JSON protocol, with the real SmolLM2 weights
(its tokens and text are checked); the configuration errors on the session's synthetic model."""

from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from pytest_ppsmoke.messages import Hidden, Span, WireDtype, digest
from pytest_ppsmoke.nodeenv import NodeEnv
from pytest_ppsmoke.protocol import LOAD_STEPS
from pytest_ppsmoke.stage.pipe import (
    Bye,
    DecodeStep,
    Detokenize,
    EmbedAndForward,
    ErrorReply,
    ForwardAndSample,
    Framing,
    HiddenOut,
    ReadKvInfo,
    Ready,
    Request,
    RunReference,
    Shutdown,
    Tokenize,
    answers,
    decode_ready,
    decode_reply,
    encode_request,
    progress_of,
)

from .helpers import SMOLLM2, SYNTH

pytestmark = pytest.mark.local

DIM, BLOCKS, HALF = SMOLLM2.dim, SMOLLM2.blocks, SMOLLM2.blocks // 2
CONTEXT = NodeEnv().max_context  # the default: what the pipeline's and the spec suite's workers have
WORKER = Path(__file__).resolve().parent.parent / "worker" / "pp_tinygrad_worker.py"
R = TypeVar("R")


class Worker:
    def __init__(self, **env: str) -> None:
        full = {**os.environ, "MODEL": SMOLLM2.name, "PP_MAX_CONTEXT": "128", **env}
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER)], env=full, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip

    ids = itertools.count(1)

    def line(self) -> Any:
        assert self.proc.stdout is not None
        out = self.proc.stdout.readline()
        assert out, f"worker closed stdout; stderr:\n{self.proc.stderr.read() if self.proc.stderr else ''}"
        return json.loads(out)

    def ready(self) -> Ready:
        """The ready line; the load's progress lines before it (``protocol.LOAD_STEPS``) in ``said``."""
        self.said: list[tuple[str, int, int]] = []
        while (counted := progress_of(obj := self.line())) is not None:
            self.said.append(counted)
        return decode_ready(obj)

    def _send(self, line: str) -> Any:
        """The reply to ``line``: the first line after it that is not a progress line (a call's
        counts as it runs, ``pipe.encode_progress``, which answers no call)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        while progress_of(out := self.line()) is not None:
            pass
        return out

    def answer(self, req: Request[R]) -> R | ErrorReply:
        """The reply to ``req`` (its line in the JSON framing, as the spec writes it)."""
        obj = self._send(encode_request(next(self.ids), req, Framing.json).decode().rstrip("\n"))
        return decode_reply(req.reply, obj)

    def ask(self, req: Request[R]) -> R:
        reply = self.answer(req)
        assert not isinstance(reply, ErrorReply), reply
        return reply

    def refused(self, raw: dict[str, Any] | str) -> ErrorReply:
        """The error reply to a request line no record makes (a malformed field, not JSON)."""
        error = decode_reply(Bye, self._send(raw if isinstance(raw, str) else json.dumps(raw)))
        assert isinstance(error, ErrorReply), error
        return error


@pytest.fixture(scope="module")
def workers(smollm2: str) -> Iterator[dict[int, Worker]]:
    """Both stages of a two-stage split, started together so that they load side by side, with
    the context the pipeline's runs have (``CONTEXT``): the same programs as theirs, made once."""
    started = {
        0: Worker(STAGE="0", NUM_STAGES="2", PP_WIRE_DTYPE="f32", PP_MAX_CONTEXT=str(CONTEXT)),
        1: Worker(STAGE="1", NUM_STAGES="2", PP_WIRE_DTYPE="bf16", PP_MAX_CONTEXT=str(CONTEXT)),
    }
    yield started
    for w in started.values():
        w.proc.kill()
        w.proc.wait()


@pytest.fixture(scope="module")
def last_stage(workers: dict[int, Worker]) -> tuple[Worker, Ready]:
    return workers[1], workers[1].ready()


def test_ready_line_comes_first_and_describes_the_stage(last_stage: tuple[Worker, Ready]) -> None:
    worker, ready = last_stage
    # before it, only the load's own counts: its steps in order, its blocks, its programs
    said = worker.said
    assert [d for w, d, t in said if w == "step"] == list(range(1, len(LOAD_STEPS) + 1)), said
    blocks = [(d, t) for w, d, t in said if w == "blocks"]
    assert blocks and blocks[-1] == (BLOCKS - HALF, BLOCKS - HALF) and blocks == sorted(blocks), said
    programs = [d for w, d, _ in said if w == "programs"]
    assert programs == list(range(1, len(programs) + 1)), said  # one line a program, counted from 1
    assert ready.programs is None or len(programs) == ready.programs.hits + ready.programs.misses
    assert ready.pid > 0 and ready.role == "stage" and ready.framing == (Framing.json, Framing.payload)
    assert (ready.stage, ready.num_stages, ready.range, ready.num_blocks) == (1, 2, Span(HALF, BLOCKS), BLOCKS)
    assert (ready.dim, ready.wire_dtype, ready.jit) == (DIM, WireDtype.bf16, True)
    assert 2 in ready.end_ids  # <|im_end|>
    # the parts of its start, each within the whole, and read into the figures a node reports
    assert ready.weights is not None
    named = [ready.imports_s, ready.device_s, ready.build_s, ready.warm_up_s, ready.weights.seconds]
    assert min(named) >= 0 and ready.imports_s > 0 and ready.wall_s >= sum(named) > 0
    load = ready.load_figures()
    assert (load.wall_s, load.imports_s, load.warm_up_s) == (ready.wall_s, ready.imports_s, ready.warm_up_s)
    assert load.parts().startswith(f"{ready.wall_s:.2f} s: imports {ready.imports_s:.2f}, device ")


def test_bad_requests_get_errors_that_name_the_value_and_the_worker_goes_on(last_stage: tuple[Worker, Ready]) -> None:
    w, _ = last_stage
    before = w.ask(ReadKvInfo())  # the module's worker: other tests' requests came first
    good = base64.b64encode(Hidden.from_array(np.zeros((2, DIM), np.float32), "bf16").data).decode()
    cases = [
        ({"op": "fly", "request_id": 1}, "unknown op 'fly'; expected one of embed_and_forward"),
        ({"op": "forward_and_sample", "request_id": 2, "hidden_b64": "!!!", "position": 0, "seq_len": 2},
         "hidden_b64 is not valid base64"),
        ({"op": "forward_and_sample", "request_id": 3, "hidden_b64": good, "position": 0, "seq_len": 3},
         f"hidden state of shape (3, {DIM}) in bf16 needs {3 * DIM * 2} bytes, got {2 * DIM * 2}"),
        ({"op": "forward_and_sample", "request_id": 4, "hidden_b64": good, "position": 0, "seq_len": 2, "dtype": "f32"},
         "hidden dtype 'f32' differs from this worker's wire dtype bf16"),
        ({"op": "forward_and_sample", "request_id": 5, "hidden_b64": good, "position": CONTEXT - 1, "seq_len": 2},
         f"positions {CONTEXT - 1}..{CONTEXT} do not fit the context of {CONTEXT}"),
        ({"op": "forward_and_sample", "request_id": 6, "hidden_b64": good, "position": -1, "seq_len": 2},
         "position must be a non-negative integer, got -1"),
        ({"op": "embed_and_forward", "request_id": 7, "tokens": [1, 2], "position": 0},
         "stage 1 has no embedding: embed_and_forward runs on stage 0"),
        ({"op": "detokenize", "request_id": 8, "token_ids": [10**9]}, f"outside the vocabulary of {SMOLLM2.vocab}"),
        ({"op": "forward_and_sample", "request_id": 9, "hidden_b64": good, "position": 3, "seq_len": 2,
          "prefill": True}, "a prefill starts at position 0, got position 3"),
        ({"op": "forward_and_sample", "request_id": 10, "hidden_b64": good, "position": 0, "seq_len": 2,
          "prefill": 1}, "prefill must be true or false, got 1"),
    ]  # fmt: skip
    for req, message in cases:
        error = w.refused(req)
        assert (error.request_id, error.op) == (req["request_id"], req["op"])
        assert message in error.error, error
    assert "bad request line" in w.refused("{not json").error
    assert "must be a JSON object, got list" in w.refused("[1, 2]").error
    assert "bad request line: ValueError" in w.refused('{"op": "kv_info", "x": ' + "9" * 5000 + "}").error
    assert "bad request line: RecursionError" in w.refused("[" * 100_000 + "]" * 100_000).error
    # still serving, and a real forward pass works after all that
    reply = w.ask(ForwardAndSample(base64.b64decode(good), 0, 2))
    assert 0 <= reply.token_id < SMOLLM2.vocab
    assert reply.received_digest == digest(base64.b64decode(good))
    info = w.ask(ReadKvInfo())
    span = (info.first_block, info.end_block, info.prefill_len, info.writes)
    # the bad requests left no trace: the caches hold what they held, and the one good write
    assert span == (HALF, BLOCKS, before.prefill_len, (*before.writes, Span(0, 2)))
    assert w.ask(Detokenize((57, 5248, 2))).text == "I'm"


def test_kv_info_reads_every_block_and_the_caches_of_a_sequence(last_stage: tuple[Worker, Ready]) -> None:
    w, _ = last_stage
    rng = np.random.default_rng(0)
    prompt, step, other = (
        Hidden.from_array(x.astype(np.float32), "bf16").data
        for x in (rng.standard_normal((4, DIM)), rng.standard_normal((1, DIM)), np.ones((4, DIM)))
    )
    w.ask(ForwardAndSample(step, 9, 1))  # a row that the prefill clears
    w.ask(ForwardAndSample(prompt, 0, 4, prefill=True))
    w.ask(ForwardAndSample(step, 4, 1))
    info = w.ask(ReadKvInfo())
    assert (info.prefill_len, info.writes) == (4, (Span(0, 5),))
    blocks = info.blocks
    assert [b.block for b in blocks] == list(range(BLOCKS))
    for b in blocks[:HALF]:  # stage 0's: not even an object here
        assert (b.owned, b.present, b.weights_realized, b.cache_shape, b.filled) == (False, False, False, (), ())
    for b in blocks[HALF:]:
        assert (b.owned, b.present, b.weights_realized) == (True, True, True)
        assert b.cache_shape[0] == 2 and b.cache_shape[-2] == CONTEXT  # K and V, the context
        assert b.filled == (Span(0, 5),)  # row 9, written before the prefill, was zeroed by it
        assert len(b.prefill_digest) == 16 and b.digest == b.prefill_digest
    # a recompute of the prompt over the same positions: same bits, but the writes say so
    w.ask(ForwardAndSample(prompt, 0, 4))
    again = w.ask(ReadKvInfo())
    assert again.writes == (Span(0, 5), Span(0, 4))
    # a different prompt rewritten at [0, 4) without a prefill: the digest shows it
    w.ask(ForwardAndSample(other, 0, 4))
    changed = w.ask(ReadKvInfo())
    assert all(b.digest != b.prefill_digest for b in changed.blocks[HALF:])


def test_shutdown_answers_and_exits_cleanly(workers: dict[int, Worker]) -> None:
    w = workers[0]  # no other test uses it
    assert w.ready().stage == 0
    ids = w.ask(Tokenize("Say hello")).token_ids
    assert ids[:1] == (1,) and ids[-4:] == (1, 520, 9531, 198)  # ends with "<|im_start|>assistant\n"
    out = w.ask(EmbedAndForward(ids, 0))
    h = Hidden(int(WireDtype.f32), (out.seq_len, DIM), out.hidden).to_array()
    assert out.seq_len == len(ids) and np.isfinite(h).all() and h.std() > 0
    assert isinstance(w.ask(Shutdown()), Bye)
    assert w.proc.wait(timeout=30) == 0


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MODEL": "gpt5:1t"}, "unknown model 'gpt5:1t'; expected one of smollm2:135m, llama3.2:1b"),
        ({"MODEL": "/nonexistent/model.gguf"}, "model file '/nonexistent/model.gguf' does not exist"),
        ({"STAGE": "2", "NUM_STAGES": "2"}, "stage 2 of 2 is not a valid stage"),
        ({"PP_WIRE_DTYPE": "fp8"}, "unknown wire dtype 'fp8'"),
    ],
)
def test_bad_configuration_exits_with_a_clear_message(env: dict[str, str], message: str, synth_model: str) -> None:
    w = Worker(**({"MODEL": synth_model} | env))
    assert w.proc.wait(timeout=120) == 2
    assert w.proc.stderr is not None and message in w.proc.stderr.read()


def test_a_broken_model_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    w = Worker(MODEL=str(bad))
    assert w.proc.wait(timeout=120) == 2
    assert w.proc.stderr is not None and f"({bad}) is not a loadable llama GGUF" in w.proc.stderr.read()


# --- the session's synthetic model: the uncompiled path, decode_step, the reference op -----------

PROMPT = "Say hello"


def _f32(reply: HiddenOut, dim: int) -> np.ndarray:
    assert reply.dtype is WireDtype.f32, reply
    assert len(reply.hidden) == reply.seq_len * dim * 4  # seq_len x hidden x 4 bytes
    return Hidden(int(WireDtype.f32), (reply.seq_len, dim), reply.hidden).to_array()


@pytest.fixture(scope="module")
def synth(synth_model: str) -> Iterator[dict[str, Worker]]:
    """Workers on the session's synthetic model with an f32 wire: both stages of the spec's
    uncompiled path (``PP_JIT=0``), and a compiled stage 0. Each test writes the KV history it
    reads from position 0, so the order of the tests does not matter."""
    env = {"MODEL": synth_model, "NUM_STAGES": "2", "PP_WIRE_DTYPE": "f32"}
    started = {
        "eager0": Worker(STAGE="0", PP_JIT="0", **env),
        "eager1": Worker(STAGE="1", PP_JIT="0", **env),
        "jit0": Worker(STAGE="0", **env),
    }
    try:
        for name, w in started.items():
            ready = w.ready()
            assert (ready.jit, ready.dim) == (name == "jit0", SYNTH.dim), ready
        yield started
    finally:
        for w in started.values():
            w.proc.kill()
            w.proc.wait()


def test_the_uncompiled_split_gives_the_unsplit_models_tokens(synth: dict[str, Worker], synth_model: str) -> None:
    """The spec's literal path: stage 0 and stage 1 with every step eager (``PP_JIT=0``), the
    hidden state crossing in f32, give token for token what tinygrad's unsplit ``generate``
    gives (the ``reference`` op: a model of its own, in one piece). The synthetic model's greedy
    tokens settle on a repeated one, so stage 0's hidden states are checked too, bit for bit,
    against tinygrad's own blocks [0, k) of the unsplit model run here over the same tokens."""
    from tinygrad import Tensor

    from pytest_ppsmoke.stage.model import load_model

    # eager: each position makes its own programs in all three processes (on a fresh machine ~15
    # each, generated and compiled): the prompt and three decode steps, each at a new position
    s0, s1, n = synth["eager0"], synth["eager1"], 4
    ids = s0.ask(Tokenize(PROMPT)).token_ids
    unsplit, _ = load_model(synth_model, 128)
    k = SYNTH.blocks // 2

    def first_stage(tokens: list[int], position: int) -> HiddenOut:
        op = DecodeStep(tokens[0], position) if position else EmbedAndForward(tuple(tokens), position)
        reply = s0.ask(op)
        x = unsplit.token_embd(Tensor([tokens]))
        for block in unsplit.blk[:k]:
            x = block(x, position)
        want = x.numpy()[0]
        assert np.array_equal(_f32(reply, SYNTH.dim), want), f"stage 0's hidden state at {position} is not the model's"
        return reply

    def last_stage(hidden: HiddenOut, position: int) -> int:
        return s1.ask(ForwardAndSample(hidden.hidden, position, hidden.seq_len, dtype=hidden.dtype)).token_id

    tokens = [last_stage(first_stage(list(ids), 0), 0)]
    while len(tokens) < n:
        position = len(ids) + len(tokens) - 1
        tokens.append(last_stage(first_stage([tokens[-1]], position), position))
    ref = s0.ask(RunReference(PROMPT, n))
    assert (ref.method, ref.prompt_token_ids) == ("unsplit", ids)
    assert tuple(tokens) == ref.token_ids


def test_decode_step_is_the_eager_forward_of_that_token_at_that_position(synth: dict[str, Worker]) -> None:
    """``decode_step`` (compiled: TinyJit, a symbolic position) against the uncompiled
    ``embed_and_forward`` of the same token at the same position over the same KV history, on
    two workers: one position of hidden state in the wire dtype, bit-identical, at every step,
    also once the JIT replays its captured kernels (from the third call)."""
    compiled, eager = synth["jit0"], synth["eager0"]
    ids = compiled.ask(Tokenize(PROMPT)).token_ids
    prefill = [w.ask(EmbedAndForward(ids, 0)) for w in (compiled, eager)]
    assert prefill[0].hidden == prefill[1].hidden
    seen = []
    for i, token in enumerate([5, 77, 300, 12, 9, 9]):
        position = len(ids) + i
        got = compiled.ask(DecodeStep(token, position))
        want = eager.ask(EmbedAndForward((token,), position))
        assert got.seq_len == 1
        assert np.array_equal(_f32(got, SYNTH.dim), _f32(want, SYNTH.dim)), f"step {i} (token {token} at {position})"
        seen.append(got.hidden)
    assert seen[-1] != seen[-2]  # the same token one position later: the position reaches the state


def test_a_reference_worker_keeps_its_model_and_answers_as_a_fresh_one(
    synth: dict[str, Worker], synth_model: str
) -> None:
    """``PP_WORKER_ROLE=reference``: the whole model loaded before the ready line, and kept. Its
    tokens are those of a model loaded afresh (the stage worker's ``reference`` op), and the
    first prompt asked again after another gives its tokens again: nothing of one generate
    reaches the next. It answers only reference and shutdown."""
    ref = Worker(MODEL=synth_model, STAGE="0", NUM_STAGES="2", PP_WIRE_DTYPE="f32", PP_WORKER_ROLE="reference")
    try:
        ready = ref.ready()
        assert (ready.role, ready.stage, ready.wire_dtype) == ("reference", 0, WireDtype.f32)
        assert ready.load_s > 0 and ready.weights is not None and ready.weights.source in ("gguf", "cache")
        story = "Tell me a long story"
        answers = [ref.ask(RunReference(prompt, 5)) for prompt in (PROMPT, story, PROMPT)]
        # the second prompt against a model loaded afresh (the first is the pipeline's, in
        # test_pipeline.py); the first again, after another generate: the same tokens
        fresh = synth["jit0"].ask(RunReference(story, 5))
        got = answers[1]
        assert (got.loaded, fresh.loaded) == ("beside", "after")
        assert got.load_s > 0 and got.generate_s > 0
        assert (got.prompt_token_ids, got.token_ids) == (fresh.prompt_token_ids, fresh.token_ids)
        assert all(a.mem_after > a.mem_before for a in answers)  # the model stays, for the next query
        assert answers[0].token_ids == answers[2].token_ids and len(answers[0].token_ids) == 5
        refused = ref.answer(ReadKvInfo())
        assert isinstance(refused, ErrorReply) and "expected reference or shutdown" in refused.error
        refused = ref.answer(RunReference(PROMPT, 0))
        assert isinstance(refused, ErrorReply) and "max_tokens must be at least 1, got 0" in refused.error
        assert isinstance(ref.ask(Shutdown()), Bye)
        assert ref.proc.wait(timeout=30) == 0
    finally:
        ref.proc.kill()
        ref.proc.wait()


def test_the_reference_op_leaves_the_stage_as_it_was(synth: dict[str, Worker]) -> None:
    """A model of its own: the stage's KV cache and compiled decode are as before, and the
    reference's memory is returned once it has answered."""
    w = synth["jit0"]
    ids = w.ask(Tokenize(PROMPT)).token_ids
    w.ask(EmbedAndForward(ids, 0))
    first = w.ask(DecodeStep(7, len(ids)))
    kv = w.ask(ReadKvInfo())
    ref = w.ask(RunReference(PROMPT, 4))
    assert len(ref.token_ids) == 4 and ref.prompt_token_ids == ids
    assert ref.device and ref.load_s > 0 and ref.generate_s > 0
    assert ref.mem_after <= ref.mem_before, "the reference model's memory was not returned"
    after = w.ask(ReadKvInfo())
    # every block's cache, its spans and digests (the programs counted: the reference's were made since)
    assert dataclasses.replace(after, programs=None) == dataclasses.replace(kv, programs=None)
    again = w.ask(DecodeStep(7, len(ids)))
    assert again.hidden == first.hidden
    for req, message in [
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"max_tokens": 1000}, f"prompt of {len(ids)} tokens + max_tokens 1000 exceed the context of 128"),
        ({"prompt": 5, "max_tokens": 2}, "prompt must be a string, got int"),
    ]:
        error = w.refused({"op": "reference", "request_id": 8, "prompt": PROMPT, **req})
        assert message in error.error, error


@pytest.mark.parametrize(("half", "expected"), [(None, 0), ("1", 1)])
def test_on_the_cpu_a_worker_keeps_the_ggufs_dtype_unless_half_is_chosen(
    synth_model: str, half: str | None, expected: int
) -> None:
    """tinygrad casts every weight to float16 by default (``HALF=1``); on the CPU, where float32
    runs 2-4x faster, the worker keeps the file's dtype instead (float32 for a quantized one),
    unless the user set ``HALF``. Its ready line says which ``HALF`` its load saw."""
    env = {k: v for k, v in os.environ.items() if k != "HALF"} | {"MODEL": synth_model, "CPU": "1"}
    if half is not None:
        env["HALF"] = half
    proc = subprocess.Popen(
        [sys.executable, str(WORKER)], env=env, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = proc.communicate("", timeout=120)
    finally:
        proc.kill()
    assert out, err[-2000:]
    ready = decode_ready(answers(out.splitlines())[0])
    assert ready.weights is not None and ready.weights.half == expected, ready.weights


def test_the_cpu_rule_for_half_sets_it_only_when_unset() -> None:
    from pytest_ppsmoke.stage.model import native_weights_on_the_cpu

    env: dict[str, str] = {}
    assert native_weights_on_the_cpu(env) is True and env == {"HALF": "0"}  # this machine's device is the CPU
    chosen = {"HALF": "1"}
    assert native_weights_on_the_cpu(chosen) is False and chosen == {"HALF": "1"}

"""One test per claim of the spec, against the session's deployment (the plugin's fixtures).

Run: ``pytest --pyargs pytest_ppsmoke.spec -m local`` on this machine (the vast.ai emulator,
SmolLM2 on the CPU), or ``pytest --pyargs pytest_ppsmoke.spec -m vastai --vastai-key ...`` on
rented GPUs. The session's figures go to the JUnit XML as properties and to the terminal summary.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from pytest_ppsmoke.harness.deployment import Deployment
from pytest_ppsmoke.harness.figures import ReferenceFigures
from pytest_ppsmoke.harness.pipeline import InferenceResult
from pytest_ppsmoke.harness.session import SmokeSession
from pytest_ppsmoke.harness.settings import Settings
from pytest_ppsmoke.messages import DIGEST_SIZE, Hidden, ProbeReport, RelayProbe, Span, StageStats, WireDtype
from pytest_ppsmoke.protocol import STAGE_ACTOR, reference_method, stage_name
from pytest_ppsmoke.runtime.codec import ActorAddress, MembersQuery, MemberStatus, MembersView
from pytest_ppsmoke.runtime.node import NODE_ACTOR

pytestmark = [pytest.mark.local, pytest.mark.vastai]


def test_cluster_converges_to_all_members_with_one_view(
    ppsmoke_session: SmokeSession, ppsmoke_cluster: Deployment
) -> None:
    """Spec: both nodes join the local cluster (1 + N members), and SWIM agrees everywhere."""
    seed = ppsmoke_cluster.seed
    assert seed is not None
    want = sorted((i, "alive") for i in ppsmoke_cluster.members)
    assert len(want) == 1 + ppsmoke_session.settings.num_stages
    assert list(seed.membership.view()) == want
    for member in ppsmoke_cluster.members[1:]:
        view = ppsmoke_session.call(seed.request(ActorAddress(member, NODE_ACTOR), MembersQuery(), timeout=10))
        assert isinstance(view, MembersView)
        seen = sorted((m.id, MemberStatus(m.status).name) for m in view.members if m.status != MemberStatus.dead)
        assert seen == want, f"{member[:10]} sees {seen}"


def test_stage_names_resolve_to_their_stages(
    ppsmoke_names: dict[str, ActorAddress], ppsmoke_cluster: Deployment
) -> None:
    """Spec: stage 0 registers pp-entry, the last stage pp-exit, every stage pp-stage-i."""
    ids = ppsmoke_cluster.members[1:]  # each stage's current node (a replaced host's is gone)
    assert ppsmoke_names["pp-entry"] == ActorAddress(ids[0], STAGE_ACTOR)
    assert ppsmoke_names["pp-exit"] == ActorAddress(ids[-1], STAGE_ACTOR)
    for i, node in enumerate(ids):
        assert ppsmoke_names[stage_name(i)] == ActorAddress(node, STAGE_ACTOR)


def _stages(result: InferenceResult, n: int) -> list[StageStats]:
    assert len(result.stages) == n, (
        f"the figures of {n} stages were expected after the inference, got {len(result.stages)} "
        "(the orchestrator could not collect them: its log says why)"
    )
    return result.stages


def _spans(spans: tuple[Span, ...]) -> str:
    return ", ".join(f"[{s.start}, {s.end})" for s in spans) or "none"


def test_every_activation_arrives_as_it_was_sent(
    ppsmoke_session: SmokeSession,
    ppsmoke_inference: InferenceResult,
    ppsmoke_names: dict[str, ActorAddress],
    ppsmoke_cluster: Deployment,
) -> None:
    """Spec: hidden states cross from stage to stage as raw bytes of the wire dtype plus the
    shape. Evidence from the inference itself, recorded on the nodes: the worker that produced an
    activation digests its raw wire bytes (before base64), the worker that decoded it on the next
    stage digests what it decoded, and each node records (request id, position, seq_len, bytes,
    digest) of every activation out and in. For every hop, what stage i sent equals what stage
    i+1 received, in order: one prefill activation at position 0 of P positions, then G - 1
    decode activations of one position at P, P+1, ... (P prompt tokens, G generated); each of
    seq_len x hidden x the wire dtype's bytes. Extra probe: a known hidden state relayed from
    stage 0 to stage 1 over the same wire comes back bit-identical."""
    n = ppsmoke_session.settings.num_stages
    stages = _stages(ppsmoke_inference, n)
    wire = WireDtype.parse(ppsmoke_session.settings.wire_dtype)
    dim = ppsmoke_cluster.ready[0].dim
    p, g = len(ppsmoke_inference.prompt_token_ids), len(ppsmoke_inference.token_ids)
    positions, seq_lens = [0, *range(p, p + g - 1)], [p] + [1] * (g - 1)
    rid = ppsmoke_inference.request_id
    for i in range(n - 1):
        hop = f"{stage_name(i)} -> {stage_name(i + 1)}"
        sent = [(h.request_id, h.position, h.seq_len, h.bytes, h.digest) for h in stages[i].hops_out]
        received = [(a.request_id, a.position, a.seq_len, a.bytes, a.digest) for a in stages[i + 1].activations_in]
        assert [s[1] for s in sent] == positions, (
            f"{hop}: positions sent {[s[1] for s in sent]}; expected 0, then {p}..{p + g - 2} (P={p}, G={g})"
        )
        assert [s[2] for s in sent] == seq_lens, f"{hop}: seq_lens sent {[s[2] for s in sent]}; expected {p}, then 1s"
        assert {s[0] for s in sent} == {rid}, f"{hop}: request ids sent {sorted({s[0] for s in sent})}, expected {rid}"
        for s in sent:
            assert s[3] == s[2] * dim * wire.itemsize, (
                f"{hop}: position {s[1]} sent {s[3]} bytes; expected {s[2]} x {dim} x {wire.itemsize} ({wire.name})"
            )
            assert len(s[4]) == DIGEST_SIZE, f"{hop}: position {s[1]} has no digest of its wire bytes ({s[4]!r})"
        for k, (a, b) in enumerate(zip(sent, received, strict=False)):
            assert a == b, (
                f"{hop}: activation {k} arrived other than it was sent: sent (request, position, seq_len, bytes, "
                f"digest) {a[:4]} {a[4].hex()}, received {b[:4]} {b[4].hex()}"
            )
        assert len(received) == len(sent), f"{hop}: {len(sent)} activations sent, {len(received)} received"
    # the extra probe: a known hidden state, k/8 for |k| <= 125 (exact in bf16, f16 and f32)
    values = ((np.arange(5 * dim) % 251) - 125).astype(np.float32).reshape(5, dim) / 8
    probe = Hidden.from_array(values, wire)
    seed = ppsmoke_cluster.seed
    assert seed is not None
    report = ppsmoke_session.call(
        seed.request(ppsmoke_names[stage_name(0)], RelayProbe(stage_name(1), probe), timeout=30)
    )
    assert isinstance(report, ProbeReport) and report.received_by == stage_name(1)
    assert report.hidden.wire_dtype is wire and tuple(report.hidden.shape) == (5, dim)
    assert bytes(report.hidden.data) == bytes(probe.data) and np.array_equal(report.hidden.to_array(), values)


def test_kv_cache_lives_on_the_stage_that_owns_the_blocks(
    ppsmoke_session: SmokeSession, ppsmoke_inference: InferenceResult
) -> None:
    """Spec: stage 0 caches K/V for blocks [0, k), stage 1 for [k, N), filled across decode.
    Evidence read from each worker's tensors right after the answer, for every block of the model:
    an owned block has realized weights and a cache whose K rows are non-zero at exactly positions
    0..P+G-2 (P prompt tokens, G generated: the last token is never fed back), and whose positions
    [0, P) have the digest they had right after prefill (the prompt was not recomputed into it);
    a block the stage does not own has no cache and no realized weights there. The worker's record
    of its writes is one span [0, P+G-1): every position written once, in order (a recompute that
    wrote the same bits again would leave the cache as it was; this record shows it)."""
    n = ppsmoke_session.settings.num_stages
    kv = ppsmoke_inference.kv
    assert len(kv) == n, f"the KV caches of {n} stages were expected after the inference, got {len(kv)}"
    total = kv[-1].end_block
    k = total // n
    split = [(i * k, (i + 1) * k if i < n - 1 else total) for i in range(n)]
    assert [(x.first_block, x.end_block) for x in kv] == split
    p, g = len(ppsmoke_inference.prompt_token_ids), len(ppsmoke_inference.token_ids)
    filled = (Span(0, p + g - 1),)
    for x in kv:
        stage = stage_name(x.stage)
        assert [b.block for b in x.blocks] == list(range(total)), (
            f"{stage} reported blocks {[b.block for b in x.blocks]}"
        )
        assert x.prefill_len == p, f"{stage}: prefill of {x.prefill_len} positions, the prompt has {p}"
        assert x.writes == filled, (
            f"{stage} wrote positions {_spans(x.writes)} into its caches, in that order; "
            f"expected one pass over [0, {p + g - 1})"
        )
        for b in x.blocks:
            owner = next(i for i, (lo, hi) in enumerate(split) if lo <= b.block < hi)
            where = f"{stage}, block {b.block} (owned by {stage_name(owner)})"
            assert b.owned == (owner == x.stage), f"{where}: reported owned={b.owned}"
            if owner != x.stage:
                assert not b.cache_shape, f"{where}: holds a KV cache of shape {b.cache_shape}"
                assert not b.weights_realized, f"{where}: its weights are realized here"
                continue
            assert b.present and b.weights_realized, (
                f"{where}: present={b.present}, weights realized={b.weights_realized}"
            )
            assert b.cache_shape, f"{where}: no KV cache"
            assert b.filled == filled, f"{where}: K rows non-zero at {_spans(b.filled)}; expected [0, {p + g - 1})"
            assert len(b.prefill_digest) == DIGEST_SIZE, f"{where}: no digest was taken after prefill"
            assert b.digest == b.prefill_digest, (
                f"{where}: positions [0, {p}) changed since prefill "
                f"(digest {b.prefill_digest.hex()} -> {b.digest.hex()})"
            )


def test_decode_loop_closes_without_the_orchestrator(
    ppsmoke_session: SmokeSession, ppsmoke_inference: InferenceResult
) -> None:
    """Spec: decode loops from the last stage straight back to stage 0 (NextToken), not through
    the orchestrator. Evidence: every node counts the frames it sends and receives by message
    type. The orchestrator's decode window runs from the FirstToken's arrival (the boundary: that
    frame is counted in prefill) to the InferenceResponse's arrival (counted in decode); in it,
    membership traffic (SWIM, the registry) aside, it receives the InferenceResponse and nothing
    else, and sends nothing. Over the request, stage 0 receives exactly G NextToken frames (G
    generated tokens: G - 1 that each drive a decode step, and the last, marked done, that frees
    it), all sent by the last stage, and the orchestrator none."""
    n = ppsmoke_session.settings.num_stages
    _stages(ppsmoke_inference, n)
    g = len(ppsmoke_inference.token_ids)
    frames = ppsmoke_inference.frames
    seed = frames.orchestrator
    prefill, decode = seed.prefill, seed.decode
    assert prefill is not None and decode is not None, (
        f"no FirstToken reached the orchestrator, so decode has no window: {seed}"
    )
    assert prefill.received.get("FirstToken") == 1, f"orchestrator, prefill: received {prefill.received}"
    assert decode.received == {"InferenceResponse": 1}, (
        f"orchestrator, decode: received {decode.received} (membership aside); expected only the InferenceResponse"
    )
    assert decode.sent == {}, f"orchestrator, decode: sent {decode.sent} (membership aside); expected nothing"
    assert not {"NextToken", "StageActivation"} & (set(prefill.received) | set(prefill.sent)), (
        f"orchestrator, prefill: {prefill}"
    )
    first, last = frames.stages[stage_name(0)], frames.stages[stage_name(n - 1)]
    assert first.received.get("NextToken") == g, (
        f"{stage_name(0)} received {first.received.get('NextToken', 0)} NextToken frames for {g} generated tokens"
    )
    assert last.sent.get("NextToken") == g, f"{stage_name(n - 1)} sent {last.sent.get('NextToken', 0)} NextToken"


def test_output_is_coherent_text(ppsmoke_session: SmokeSession, ppsmoke_inference: InferenceResult) -> None:
    """Spec: the response is non-empty, and the split forward pass still produces coherent output.
    This is a floor (non-empty, valid UTF-8, mostly words), not the proof: the claim rests on
    ``test_tokens_equal_the_unsplit_reference``, since text token for token the same as the
    model's run in one piece is exactly as coherent as that model is. The text is in the report
    (``text``) and in the JUnit properties (``ppsmoke_text``) for a reader to judge."""
    text = ppsmoke_inference.text
    assert ppsmoke_session.report.text == text
    assert text.strip(), f"empty response (token ids {ppsmoke_inference.token_ids})"
    text.encode("utf-8")  # a str that came through the codec: valid UTF-8 by construction; check anyway
    words = text.split()
    wordlike = [w for w in words if re.fullmatch(r"[^\W\d_]+(['\u2019-][^\W\d_]+)*[.,!?;:]*", w)]
    assert len(wordlike) >= 0.6 * len(words), f"mostly not words: {text!r}"


def test_tokens_equal_the_unsplit_reference(
    ppsmoke_settings: Settings, ppsmoke_inference: InferenceResult, ppsmoke_reference: ReferenceFigures
) -> None:
    """Token-exact agreement with the model run in one piece, on the machines that ran the
    pipeline: after the request, stage 0's worker loads the model afresh (not its stage) and runs
    tinygrad's own ``generate`` on its device (a rented GPU, or this machine's CPU with ``-m
    local``). With an f32 wire that is the unsplit model; with bf16/f16 the same with the hidden
    state rounded to the wire dtype after each stage's last block, since rounding can change a
    greedy token. The prompt's token ids must agree too."""
    ref, wire = ppsmoke_reference, ppsmoke_settings.wire_dtype
    assert ref.method == reference_method(wire), f"a reference for the wrong wire: {ref.method!r}, wire {wire}"
    assert ref.prompt_token_ids == ppsmoke_inference.prompt_token_ids, "the prompt tokenized differently"
    got = ppsmoke_inference.token_ids
    assert got == ref.token_ids, (
        f"the pipeline's tokens differ from the reference's ({stage_name(ref.stage)}, {ref.device}) at index "
        f"{ref.first_difference}: pipeline {got}, reference {ref.token_ids}"
    )
    assert ref.match is True


def test_teardown_leaves_no_instance_with_the_runs_label(ppsmoke_teardown: SmokeSession) -> None:
    """Spec: destroy both instances. Runs last (the plugin orders it so): the session is torn
    down, then vast.ai's own list is asked for the run's label. Every create sent was destroyed,
    also when the deployment failed part way."""
    report = ppsmoke_teardown.report
    if not report.creates_sent:
        pytest.skip(f"nothing to destroy: no instance was created (the deployment failed at {report.failed_phase})")
    assert report.instances and all(i.final_state in ("destroyed", "destroying") for i in report.instances)
    left = report.left_after_teardown
    assert left is not None, "vast.ai's list of the run's instances could not be read after the teardown"
    assert left == [], f"still rented: {[(i.id, i.label) for i in left or []]}"
    if report.emulator is not None:
        assert report.emulator.live_instances == []

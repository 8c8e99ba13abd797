"""The claims a run proves, each judged by one function: the spec's tests
(``pytest_ppsmoke/spec/test_spec.py``) call them on what their fixtures hold, and ``pp-smoke-run``'s
verdict block calls them on what the run recorded (:func:`verdict`), so the two cannot disagree.

A judge returns its evidence in words (a figure a reader can check) or raises
:class:`ClaimFailed` (an ``AssertionError``: in a test it is the test's failure) naming what
differed; :class:`NotChecked` says why a claim could not be judged (the run failed before its
evidence existed; a local run has no NAT to cross). The names are the README's table's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..messages import DIGEST_SIZE, Span, StageStats, WireDtype
from ..protocol import STAGE_ACTOR, reference_method, stage_name
from ..runtime.codec import ActorAddress
from .figures import ClaimFigures, ClaimState

if TYPE_CHECKING:
    from ..messages import KvInfo
    from .figures import ReferenceFigures
    from .pipeline import InferenceResult
    from .report import Report

CLUSTER = "the cluster forms"
DIRECT = "the machines reach each other directly"
NAMES = "the names resolve"
ACTIVATIONS = "activations arrive as sent"
KV = "the KV cache stays with its blocks"
DECODE = "decode closes without the orchestrator"
TOKENS = "the tokens are exact"
TEXT = "the output is text"
LEFT = "nothing is left rented"
PREFLIGHT = "nothing is rented in vain"
CLAIMS = (CLUSTER, DIRECT, NAMES, ACTIVATIONS, KV, DECODE, TOKENS, TEXT, LEFT, PREFLIGHT)  # the README's order


class ClaimFailed(AssertionError):
    """The claim's evidence contradicts it; the message says where."""


class NotChecked(Exception):
    """The claim could not be judged; the message says why."""


State = ClaimState
Judgement = ClaimFigures  # a claim, how it was judged, and its evidence in words


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ClaimFailed(message)


# --- the judges -------------------------------------------------------------------------------


def cluster_forms(members: Sequence[str], views: Mapping[str, Sequence[tuple[str, str]]]) -> str:
    """1 + N members, every one alive in every member's own view (``views``: each node's, by id)."""
    want = sorted((m, "alive") for m in members)
    nodes = [m for m in members[1:]]
    for node in [m for m in members[:1] if m in views] + nodes:  # the orchestrator's too, when given
        seen = sorted(views.get(node, ()))
        _check(seen == want, f"{node[:10]} sees {seen}; expected all {len(want)} members alive")
    return f"{len(members)} members alive in each of the {len(nodes)} nodes' views and the orchestrator's"


def names_resolve(names: Mapping[str, ActorAddress], nodes: Sequence[str]) -> str:
    """``pp-entry`` on stage 0, ``pp-exit`` on the last stage, ``pp-stage-i`` on stage i (``nodes``:
    each stage's node id, in stage order)."""
    _check(bool(nodes), "no stage's node is known")
    want = {"pp-entry": nodes[0], "pp-exit": nodes[-1], **{stage_name(i): n for i, n in enumerate(nodes)}}
    for name, node in want.items():
        got = names.get(name)
        _check(got == ActorAddress(node, STAGE_ACTOR), f"{name} resolved to {got}; expected stage {node[:10]}")
    return ", ".join(want)


def activations(
    stages: Sequence[StageStats],
    num_stages: int,
    wire: WireDtype,
    dim: int,
    prompt_len: int,
    generated: int,
    request_id: int | None,
) -> str:
    """Every hop's records on both nodes agree: one prefill activation of the prompt at position 0,
    then one decode activation a position at P, P+1, ...; each seq_len x dim x the wire dtype's
    bytes, with a digest of its raw wire bytes; what stage i sent is what stage i+1 received."""
    _check(
        len(stages) == num_stages,
        f"the figures of {num_stages} stages were expected after the inference, got {len(stages)}",
    )
    p, g = prompt_len, generated
    positions, seq_lens = [0, *range(p, p + g - 1)], [p] + [1] * (g - 1)
    count = 0
    for i in range(num_stages - 1):
        hop = f"{stage_name(i)} -> {stage_name(i + 1)}"
        sent = [(h.request_id, h.position, h.seq_len, h.bytes, h.digest) for h in stages[i].hops_out]
        received = [(a.request_id, a.position, a.seq_len, a.bytes, a.digest) for a in stages[i + 1].activations_in]
        _check(
            [s[1] for s in sent] == positions,
            f"{hop}: positions sent {[s[1] for s in sent]}; expected 0, then {p}..{p + g - 2} (P={p}, G={g})",
        )
        _check([s[2] for s in sent] == seq_lens, f"{hop}: seq_lens sent {[s[2] for s in sent]}; expected {p}, then 1s")
        _check({s[0] for s in sent} == {request_id}, f"{hop}: request ids sent {sorted({s[0] for s in sent})}")
        for s in sent:
            _check(
                s[3] == s[2] * dim * wire.itemsize,
                f"{hop}: position {s[1]} sent {s[3]} bytes; expected {s[2]} x {dim} x {wire.itemsize} ({wire.name})",
            )
            _check(len(s[4]) == DIGEST_SIZE, f"{hop}: position {s[1]} has no digest of its wire bytes ({s[4]!r})")
        for k, (a, b) in enumerate(zip(sent, received, strict=False)):
            _check(
                a == b,
                f"{hop}: activation {k} arrived other than it was sent: sent (request, position, seq_len, bytes, "
                f"digest) {a[:4]} {a[4].hex()}, received {b[:4]} {b[4].hex()}",
            )
        _check(len(received) == len(sent), f"{hop}: {len(sent)} activations sent, {len(received)} received")
        count += len(sent)
    return f"{count} activations over {num_stages - 1} hop(s), each as its digest was sent ({wire.name})"


def _spans(spans: tuple[Span, ...]) -> str:
    return ", ".join(f"[{s.start}, {s.end})" for s in spans) or "none"


def kv_cache(kv: Sequence[KvInfo], num_stages: int, prompt_len: int, generated: int) -> str:
    """Each stage caches K/V for exactly its blocks, filled once over [0, P+G-1), the prompt's
    positions as they were after prefill; a block it does not own has no cache and no weights."""
    _check(len(kv) == num_stages, f"the KV caches of {num_stages} stages were expected, got {len(kv)}")
    total = kv[-1].end_block
    k = total // num_stages
    split = [(i * k, (i + 1) * k if i < num_stages - 1 else total) for i in range(num_stages)]
    _check([(x.first_block, x.end_block) for x in kv] == split, f"blocks {[(x.first_block, x.end_block) for x in kv]}")
    p, g = prompt_len, generated
    filled = (Span(0, p + g - 1),)
    for x in kv:
        stage = stage_name(x.stage)
        _check(
            [b.block for b in x.blocks] == list(range(total)), f"{stage} reported blocks {[b.block for b in x.blocks]}"
        )
        _check(x.prefill_len == p, f"{stage}: prefill of {x.prefill_len} positions, the prompt has {p}")
        _check(
            x.writes == filled,
            f"{stage} wrote positions {_spans(x.writes)} into its caches; expected one pass over [0, {p + g - 1})",
        )
        for b in x.blocks:
            owner = next(i for i, (lo, hi) in enumerate(split) if lo <= b.block < hi)
            where = f"{stage}, block {b.block} (owned by {stage_name(owner)})"
            _check(b.owned == (owner == x.stage), f"{where}: reported owned={b.owned}")
            if owner != x.stage:
                _check(not b.cache_shape, f"{where}: holds a KV cache of shape {b.cache_shape}")
                _check(not b.weights_realized, f"{where}: its weights are realized here")
                continue
            _check(b.present and b.weights_realized, f"{where}: present={b.present}, realized={b.weights_realized}")
            _check(bool(b.cache_shape), f"{where}: no KV cache")
            _check(b.filled == filled, f"{where}: K rows non-zero at {_spans(b.filled)}; expected [0, {p + g - 1})")
            _check(len(b.prefill_digest) == DIGEST_SIZE, f"{where}: no digest was taken after prefill")
            _check(
                b.digest == b.prefill_digest,
                f"{where}: positions [0, {p}) changed since prefill ({b.prefill_digest.hex()} -> {b.digest.hex()})",
            )
    return f"{total} blocks over {num_stages} stages, each cache filled once over [0, {p + g - 1})"


def decode_closes(frames: Any, num_stages: int, generated: int) -> str:
    """The token loop never passes through the orchestrator: in decode it receives the answer and,
    counted apart as membership traffic is, the last stage's progress notes (counts for its live
    line, one way, never answered), and sends nothing, notes included; stage 0 receives G
    NextToken frames, all from the last stage (``frames``: ``InferenceResult.frames``)."""
    g = generated
    seed = frames.orchestrator
    prefill, decode = seed.prefill, seed.decode
    _check(prefill is not None and decode is not None, f"no FirstToken reached the orchestrator: {seed}")
    _check(prefill.received.get("FirstToken") == 1, f"orchestrator, prefill: received {prefill.received}")
    _check(
        decode.received == {"InferenceResponse": 1},
        f"orchestrator, decode: received {decode.received} (membership aside); expected only the InferenceResponse",
    )
    _check(decode.sent == {}, f"orchestrator, decode: sent {decode.sent} (membership aside); expected nothing")
    _check(
        prefill.notes.sent == decode.notes.sent == 0,
        f"orchestrator: sent {prefill.notes.sent + decode.notes.sent} progress notes; it only receives them",
    )
    _check(
        not {"NextToken", "StageActivation"} & (set(prefill.received) | set(prefill.sent)),
        f"orchestrator, prefill: {prefill}",
    )
    first, last = frames.stages[stage_name(0)], frames.stages[stage_name(num_stages - 1)]
    _check(
        first.received.get("NextToken") == g,
        f"{stage_name(0)} received {first.received.get('NextToken', 0)} NextToken frames for {g} generated tokens",
    )
    _check(last.sent.get("NextToken") == g, f"{stage_name(num_stages - 1)} sent {last.sent.get('NextToken', 0)}")
    notes = decode.notes.received
    return (
        f"{g} NextToken frames from {stage_name(num_stages - 1)} to {stage_name(0)}; the orchestrator got the "
        f"answer and {notes} progress note{'' if notes == 1 else 's'} in decode, and sent nothing"
    )


def tokens_exact(ref: ReferenceFigures, wire: str, prompt_token_ids: Sequence[int], token_ids: Sequence[int]) -> str:
    """The pipeline's tokens equal those of the model in one piece on stage 0's own device."""
    if ref.state != "done":
        raise NotChecked(f"the reference was {ref.state}" + (f": {ref.detail}" if ref.detail else ""))
    _check(ref.method == reference_method(wire), f"a reference for the wrong wire: {ref.method!r}, wire {wire}")
    _check(list(ref.prompt_token_ids) == list(prompt_token_ids), "the prompt tokenized differently")
    _check(
        list(token_ids) == list(ref.token_ids),
        f"the pipeline's tokens differ from the reference's ({stage_name(ref.stage or 0)}, {ref.device}) at index "
        f"{ref.first_difference}: pipeline {list(token_ids)}, reference {list(ref.token_ids)}",
    )
    return f"{len(token_ids)} tokens equal the unsplit model's on {stage_name(ref.stage or 0)} ({ref.device})"


def output_text(text: str, token_ids: Sequence[int], noise: bool = False) -> str:
    """Non-empty, valid UTF-8, mostly words: a floor; the token-exact claim is the proof. A model
    of random weights (``noise``: a synthetic GGUF) says nothing in words: its text must only be
    non-empty UTF-8."""
    _check(bool(text.strip()), f"empty response (token ids {list(token_ids)})")
    if noise:
        text.encode("utf-8")
        return f"{len(text)} characters of UTF-8 (a model of random weights: its words are not judged)"
    text.encode("utf-8")
    words = text.split()
    wordlike = [w for w in words if re.fullmatch(r"[^\W\d_]+(['\u2019-][^\W\d_]+)*[.,!?;:]*", w)]
    _check(len(wordlike) >= 0.6 * len(words), f"mostly not words: {text!r}")
    return f"{len(words)} words, {len(wordlike)} of them word-like"


def nothing_left(report: Report) -> str:
    """Every instance destroyed, and vast.ai's own list shows none with the run's label."""
    if not report.creates_sent:
        return "no instance was ever created"
    kept = [(i.id, i.final_state) for i in report.instances if i.final_state not in ("destroyed", "destroying")]
    _check(bool(report.instances) and not kept, f"not destroyed: {kept}")
    left = report.left_after_teardown
    _check(left is not None, "vast.ai's list of the run's instances could not be read after the teardown")
    _check(left == [], f"still rented: {[(i.id, i.label) for i in left or []]}")
    if report.emulator is not None:
        _check(report.emulator.live_instances == [], f"the emulator still runs {report.emulator.live_instances}")
    return f"{len(report.instances)} of {len(report.instances)} destroyed; vast.ai lists none with the run's label"


def direct_paths(report: Report) -> str:
    """Over the internet, every stage's path from the orchestrator is direct (not relayed)."""
    links = report.paths.links if report.paths is not None else {}
    if report.mode == "local" and report.network is None:
        raise NotChecked("one machine over loopback: no NAT to cross (--network internet, or vast.ai, checks it)")
    if not links:
        raise NotChecked("no path was recorded")
    relayed = [name for name, p in links.items() if p is None or p.path != "direct"]
    _check(not relayed, f"relayed, not direct: {', '.join(relayed)}")
    return ", ".join(f"{name} {p.path}" for name, p in links.items() if p is not None)


def preflight(report: Report) -> str:
    """Before the first create: the key, the credit, the image, the offers and the stages checked."""
    found = report.preflight
    if found is None:
        raise NotChecked("the pre-flight was off, or the run failed before it ended")
    image = "the image in its registry" if found.image is not None else "the image not asked for"
    return f"key, credit, {image}, {found.offers} offers and the stages checked before the first create"


# --- the verdict ------------------------------------------------------------------------------


@dataclass
class Evidence:
    """What a run recorded for its claims, as it went (the driver fills it)."""

    members: list[str] = field(default_factory=list)  # the orchestrator's id, then each stage's node's
    views: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # each node's view, after converge
    names: dict[str, ActorAddress] = field(default_factory=dict)
    result: InferenceResult | None = None
    dim: int | None = None  # the model's hidden size (stage 0's ready status)
    noise: bool = False  # the model has random weights (a synthetic GGUF): its text is not words


def judge(claim: str, work: Any, *args: Any) -> Judgement:
    """``work(*args)`` as the judgement of ``claim``."""
    try:
        return Judgement(claim, State.PASSED, work(*args))
    except ClaimFailed as e:
        return Judgement(claim, State.FAILED, str(e))
    except NotChecked as e:
        return Judgement(claim, State.NOT_CHECKED, str(e))


def verdict(report: Report, ev: Evidence) -> list[Judgement]:
    """Every claim of :data:`CLAIMS`, judged on what the run recorded; one whose evidence the run
    never reached is not checked, saying where the run stopped."""
    failed = (
        f"the run stopped at {report.failed_phase}, before its evidence"
        if report.failed_phase
        else "the run stopped first"
    )

    def absent(claim: str) -> Judgement:
        return Judgement(claim, State.NOT_CHECKED, failed)

    n, r = report.num_stages, ev.result
    out = [
        judge(CLUSTER, cluster_forms, ev.members, ev.views) if ev.views or len(ev.members) == 1 else absent(CLUSTER),
        judge(DIRECT, direct_paths, report),
        judge(NAMES, names_resolve, ev.names, ev.members[1:]) if ev.names else absent(NAMES),
    ]
    if r is not None and r.stages and ev.dim is not None:
        p, g = len(r.prompt_token_ids), len(r.token_ids)
        wire = WireDtype.parse(report.wire_dtype)
        out.append(judge(ACTIVATIONS, activations, r.stages, n, wire, ev.dim, p, g, r.request_id))
        out.append(judge(KV, kv_cache, r.kv, n, p, g) if r.kv else absent(KV))
        out.append(judge(DECODE, decode_closes, r.frames, n, g))
    else:
        out += [absent(ACTIVATIONS), absent(KV), absent(DECODE)]
    if r is not None:
        out.append(
            judge(TOKENS, tokens_exact, report.reference, str(report.wire_dtype), r.prompt_token_ids, r.token_ids)
        )
        out.append(judge(TEXT, output_text, r.text, r.token_ids, ev.noise))
    else:
        out += [absent(TOKENS), absent(TEXT)]
    out.append(judge(LEFT, nothing_left, report))
    out.append(judge(PREFLIGHT, preflight, report))
    return sorted(out, key=lambda j: CLAIMS.index(j.claim))


def block(report: Report) -> list[str]:
    """The verdict block: PASS or FAIL, then a line per claim (its state and evidence), the
    replaced hosts, and for a FAIL its one-line cause (the caller's last line)."""
    counts = {s: sum(1 for c in report.claims if c.state is s) for s in State}
    tally = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    head = "PASS" if report.ok else "FAIL" + (f" at {report.failed_phase}" if report.failed_phase else "")
    width = max(len(s) for s in State)
    lines = [f"{head}: {tally} of the {len(report.claims)} claims"]
    lines += [f"  {c.state:<{width}}  {c.claim}: {c.evidence}" for c in report.claims]
    if (replaced := report.replaced_line()) is not None:
        lines.append(f"  the run needed the cloud's second try: {replaced}")
    return lines

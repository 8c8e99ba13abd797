"""One test per claim of the spec, against the session's deployment (the plugin's fixtures).

Run: ``pytest --pyargs pytest_ppsmoke.spec -m local`` on this machine (the vast.ai emulator,
SmolLM2 on the CPU), or ``pytest --pyargs pytest_ppsmoke.spec -m vastai --vastai-key ...`` on
rented GPUs. The session's figures go to the JUnit XML as properties and to the terminal summary.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from pytest_ppsmoke.cloud.lifecycle import Deployment
from pytest_ppsmoke.harness.pipeline import InferenceResult
from pytest_ppsmoke.harness.report import ReferenceFigures
from pytest_ppsmoke.harness.session import SmokeSession
from pytest_ppsmoke.harness.settings import Settings
from pytest_ppsmoke.protocol import STAGE_ACTOR, reference_method
from pytest_ppsmoke.runtime.codec import (
    ActorAddress,
    Hidden,
    KvInfo,
    KvInfoQuery,
    MembersQuery,
    MemberStatus,
    MembersView,
    ProbeReport,
    RelayProbe,
    WireDtype,
)
from pytest_ppsmoke.runtime.node import NODE_ACTOR

pytestmark = [pytest.mark.local, pytest.mark.vastai]


def test_cluster_converges_to_all_members_with_one_view(
    ppsmoke_session: SmokeSession, ppsmoke_cluster: Deployment
) -> None:
    """Spec: both nodes join the local cluster (1 + N members), and SWIM agrees everywhere."""
    seed = ppsmoke_cluster.seed
    assert seed is not None
    want = sorted((i, "alive") for i in ppsmoke_cluster.keys.ids)
    assert len(want) == 1 + ppsmoke_session.settings.num_stages
    assert list(seed.membership.view()) == want
    for member in ppsmoke_cluster.keys.ids[1:]:
        view = ppsmoke_session.call(seed.request(ActorAddress(member, NODE_ACTOR), MembersQuery(), timeout=10))
        assert isinstance(view, MembersView)
        seen = sorted((m.id, MemberStatus(m.status).name) for m in view.members if m.status != MemberStatus.dead)
        assert seen == want, f"{member[:10]} sees {seen}"


def test_stage_names_resolve_to_their_stages(
    ppsmoke_names: dict[str, ActorAddress], ppsmoke_cluster: Deployment
) -> None:
    """Spec: stage 0 registers pp-entry, the last stage pp-exit, every stage pp-stage-i."""
    ids = [i.endpoint_id for i in sorted(ppsmoke_cluster.instances, key=lambda i: i.stage) if i.stage >= 0]
    assert ppsmoke_names["pp-entry"] == ActorAddress(ids[0], STAGE_ACTOR)
    assert ppsmoke_names["pp-exit"] == ActorAddress(ids[-1], STAGE_ACTOR)
    for i, node in enumerate(ids):
        assert ppsmoke_names[f"pp-stage-{i}"] == ActorAddress(node, STAGE_ACTOR)


def test_activation_round_trip_is_bit_identical_in_the_wire_dtype(
    ppsmoke_session: SmokeSession, ppsmoke_names: dict[str, ActorAddress], ppsmoke_cluster: Deployment
) -> None:
    """Spec: hidden states cross from stage to stage as raw bytes of the wire dtype plus the
    shape. A known hidden state goes from pp-stage-0 to pp-stage-1 over the activation wire and
    comes back exactly; its size is seq_len x hidden x the dtype's bytes."""
    wire = WireDtype.parse(ppsmoke_session.settings.wire_dtype)
    dim = ppsmoke_cluster.ready[0].dim
    seq_len = 5
    # k/8 for |k| <= 125: exact in bf16, f16 and f32, so the bytes are known in advance
    values = ((np.arange(seq_len * dim) % 251) - 125).astype(np.float32).reshape(seq_len, dim) / 8
    sent = Hidden.from_array(values, wire)
    assert len(sent.data) == seq_len * dim * wire.itemsize
    seed = ppsmoke_cluster.seed
    assert seed is not None
    report = ppsmoke_session.call(seed.request(ppsmoke_names["pp-stage-0"], RelayProbe("pp-stage-1", sent), timeout=30))
    assert isinstance(report, ProbeReport) and report.received_by == "pp-stage-1"
    assert report.hidden.wire_dtype is wire and tuple(report.hidden.shape) == (seq_len, dim)
    assert bytes(report.hidden.data) == bytes(sent.data)
    assert np.array_equal(report.hidden.to_array(), values)


def test_kv_cache_lives_on_the_stage_that_owns_the_blocks(
    ppsmoke_session: SmokeSession, ppsmoke_inference: InferenceResult, ppsmoke_cluster: Deployment
) -> None:
    """Spec: stage 0 caches K/V for blocks [0, k), stage 1 for [k, N), filled across decode."""
    n = ppsmoke_session.settings.num_stages
    kv: list[KvInfo] = []
    for i in range(n):
        seed = ppsmoke_cluster.seed
        assert seed is not None
        info = ppsmoke_session.call(seed.request(ppsmoke_cluster.names[f"pp-stage-{i}"], KvInfoQuery(), timeout=30))
        assert isinstance(info, KvInfo)
        kv.append(info)
    total = kv[-1].end_block
    k = total // n
    split = [(i * k, (i + 1) * k if i < n - 1 else total) for i in range(n)]
    assert [(x.first_block, x.end_block) for x in kv] == split
    for x in kv:
        assert list(x.blocks_cached) == list(range(x.first_block, x.end_block)), f"stage {x.stage}: {x.blocks_cached}"
    filled = len(ppsmoke_inference.prompt_token_ids) + len(ppsmoke_inference.token_ids) - 1
    assert [x.filled for x in kv] == [filled] * n


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
        f"the pipeline's tokens differ from the reference's (pp-stage-{ref.stage}, {ref.device}) at index "
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
    assert report.instances and all(i["final_state"] in ("destroyed", "destroying") for i in report.instances)
    left = report.left_after_teardown
    assert left is not None, "vast.ai's list of the run's instances could not be read after the teardown"
    assert left == [], f"still rented: {[(i.get('id'), i.get('label')) for i in left or []]}"
    if report.emulator is not None:
        assert report.emulator["live_instances"] == []

"""The verdict's own logic, without a run (``harness/claims.py``, ``Report.finish``): every claim
of the README's table is judged and has a phase; a failed claim fails the run with exit 1; a
claim whose evidence the run never reached is not checked, saying where it stopped; the block's
lines. The judges' verdicts on real runs: tests/test_driver.py (PASS), test_lifecycle.py (a
compute fault, a stage dropping out mid-decode)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pytest_ppsmoke.harness import claims
from pytest_ppsmoke.harness.figures import ClaimFigures, ClaimState, Mode, ReferenceFigures, ReferenceState, WireDtype
from pytest_ppsmoke.harness.report import CLAIM_PHASES, Report
from pytest_ppsmoke.protocol import Phase

pytestmark = pytest.mark.local

README = Path(__file__).resolve().parent.parent / "README.md"


def report(**kw: object) -> Report:
    r = Report(Mode.LOCAL, "m", "Say hello", 4, 2, WireDtype.BF16)
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_every_claim_is_the_readmes_and_has_the_phase_it_is_judged_in() -> None:
    assert set(CLAIM_PHASES) == set(claims.CLAIMS)
    table = README.read_text()
    for claim in claims.CLAIMS:
        assert re.search(rf"^\| {re.escape(claim)} \|", table, re.M), f"{claim!r} is not a row of the README's table"


def test_a_failed_claim_fails_the_run_as_its_phase_and_a_passed_verdict_exits_0() -> None:
    ok = report(text="hello", claims=[ClaimFigures(c, ClaimState.PASSED, "fine") for c in claims.CLAIMS])
    ok.finish()
    assert (ok.ok, ok.exit_code, ok.error) == (True, 0, None)
    bad = report(text="hello", claims=[ClaimFigures(claims.TOKENS, ClaimState.FAILED, "differ at 0")])
    bad.finish()
    assert (bad.ok, bad.exit_code, bad.failed_phase) == (False, 1, Phase.REFERENCE)
    assert bad.error == "reference: the tokens are exact: no: differ at 0"
    assert claims.block(bad)[0] == "FAIL at reference: 1 failed of the 1 claims"
    # a not-checked claim alone does not fail a run
    quiet = report(text="hello", claims=[ClaimFigures(claims.DIRECT, ClaimState.NOT_CHECKED, "loopback")])
    quiet.finish()
    assert quiet.exit_code == 0 and claims.block(quiet) == [
        "PASS: 1 not checked of the 1 claims",
        "  not checked  the machines reach each other directly: loopback",
    ]


def test_claims_the_run_never_reached_are_not_checked_saying_where_it_stopped() -> None:
    r = report(failed_phase=Phase.DECODE, error="decode: pp-stage-1 dropped", creates_sent=0)
    judged = {j.claim: j for j in claims.verdict(r, claims.Evidence(members=["seed", "a", "b"]))}
    assert list(judged) == list(claims.CLAIMS)
    for name in (claims.CLUSTER, claims.NAMES, claims.ACTIVATIONS, claims.KV, claims.DECODE, claims.TOKENS):
        assert judged[name].state is ClaimState.NOT_CHECKED
        assert judged[name].evidence == "the run stopped at decode, before its evidence", judged[name]
    assert judged[claims.LEFT].state is ClaimState.PASSED  # nothing was created: nothing is left
    assert judged[claims.DIRECT].evidence.startswith("one machine over loopback")


def test_the_judges_name_what_differed() -> None:
    members = ["s", "a", "b"]
    alive = [("a", "alive"), ("b", "alive"), ("s", "alive")]
    assert claims.cluster_forms(members, {"a": alive, "b": alive}).startswith("3 members alive")
    with pytest.raises(claims.ClaimFailed, match=r"^b sees \[\('a', 'alive'\), \('s', 'alive'\)\]"):
        claims.cluster_forms(members, {"a": alive, "b": alive[:1] + alive[2:]})
    with pytest.raises(claims.ClaimFailed, match="mostly not words"):
        claims.output_text("\u00e9a<|x|> 1 2 3", [1])
    assert "random weights" in claims.output_text("\u00e9a<|x|>", [1], noise=True)
    with pytest.raises(claims.NotChecked, match="the reference was off"):
        claims.tokens_exact(ReferenceFigures(ReferenceState.OFF), "bf16", [1], [2])


def test_the_references_frames_in_a_request_window_are_counted_apart() -> None:
    """The reference, asked as stage 0 is ready, may answer while the request decodes: its answer
    is the reference's, not traffic the token loop sent through the orchestrator."""
    from pytest_ppsmoke.harness.pipeline import frame_window
    from pytest_ppsmoke.runtime.codec import MESSAGE_TYPES

    code = {cls.__name__: c for c, cls in MESSAGE_TYPES.items()}
    window = frame_window({code["InferenceResponse"]: (0, 1), code["ReferenceResult"]: (0, 1), code["Ping"]: (2, 2)})
    assert window.received == {"InferenceResponse": 1} and window.sent == {}
    assert (window.reference.received, window.membership.sent) == (1, 2)
    window = frame_window({code["InferenceResponse"]: (0, 1), code["NextToken"]: (0, 1)})
    assert window.received == {"InferenceResponse": 1, "NextToken": 1}  # the loop's own: still seen

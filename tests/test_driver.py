"""The one run driver and its two faces: ``pp-smoke-run`` and the pytest plugin write the same
report; one settings table makes both faces' options; the plugin loads light; a failed phase
shows once, as one line."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from pytest_ppsmoke import failpoints, protocol
from pytest_ppsmoke.cloud.rental import STEPS
from pytest_ppsmoke.harness import claims, cli, driver
from pytest_ppsmoke.harness import reference as reference_step
from pytest_ppsmoke.harness.figures import ApiFigures, Mode, ReferenceFigures, ReferenceState, WireDtype
from pytest_ppsmoke.harness.report import SCHEMA_VERSION, Report, schema
from pytest_ppsmoke.harness.settings import OPTIONS, WIRE_DTYPES, Settings
from pytest_ppsmoke.harness.settings import STEPS as RUN_STEPS
from pytest_ppsmoke.messages import ReferenceResult
from pytest_ppsmoke.protocol import Names, Phase
from pytest_ppsmoke.stage.bridge import stderr_text

from .ptyread import Terminal, counted, drawings, plain
from .smoke import report_problems

pytestmark = pytest.mark.local


def _keys(value: Any, prefix: str = "") -> set[str]:
    """Every key path of a JSON value: dict keys, and the keys of the dicts inside lists."""
    out: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            out.add(prefix + k)
            out |= _keys(v, prefix + k + ".")
    elif isinstance(value, list):
        for v in value:
            out |= _keys(v, prefix + "[].")
    return out


def _empty_lists(value: Any, prefix: str = "") -> set[str]:
    """The key paths of the empty lists in a JSON value (``_keys``'s form)."""
    out: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            out |= {prefix + k} if v == [] else _empty_lists(v, prefix + k + ".")
    elif isinstance(value, list):
        for v in value:
            out |= _empty_lists(v, prefix + "[].")
    return out


def _same_keys(a: Any, b: Any) -> None:
    """The same key paths at every level, but inside a list that one of them has empty: what a
    run measured (a stall of its event loop, on a loaded machine) is in one and not the other; and
    but the API's endpoints by name, which are those each run called."""
    empty = _empty_lists(a) | _empty_lists(b)
    odd = {
        k
        for k in _keys(a) ^ _keys(b)
        if not any(k.startswith(e + ".[].") for e in empty) and not k.startswith("vast_api.endpoints.")
    }
    assert not odd, sorted(odd)


INFER = """
import pytest
pytestmark = pytest.mark.local

def test_infer(ppsmoke_inference, ppsmoke_reference):
    assert ppsmoke_inference.text and ppsmoke_reference.match
"""


SLOW_REFERENCE = 4.0  # seconds the plugin's reference waits on stage 0's node before it generates
# every phase of a passing local run, each drawn on the terminal as it runs
PHASES_DRAWN = [p.value for p in Phase]
# the claims the verdict names as passed on a local run (the direct paths need NATs to cross)
EIGHT_CLAIMS = (
    claims.CLUSTER,
    claims.NAMES,
    claims.ACTIVATIONS,
    claims.KV,
    claims.DECODE,
    claims.TOKENS,
    claims.TEXT,
    claims.LEFT,
)


def timeline_agrees(r: dict[str, Any]) -> None:
    """The report's timeline against its timings: every timed phase, in the phases' order, each
    ``end - start`` its ``timings`` entry (both rounded to 0.1 ms), none overlapping the next;
    each instance's steps between the rent's start and the end of the phase that waits for them
    (on the same clock: seconds since the rent began); the run's start and the budget around them."""
    tl = r["timeline"]
    spans = tl["phases"]
    assert [p["phase"] for p in spans] == [p.value for p in Phase if p.value in r["timings"]], spans
    for span in spans:
        assert span["end"] - span["start"] == pytest.approx(r["timings"][span["phase"]], abs=2e-4), span
    for a, b in itertools.pairwise(spans):
        assert a["end"] <= b["start"] + 1e-4, (a, b)
    by = {p["phase"]: p for p in spans}
    waits = {p.waits_for: p.value for p in Phase if p.waits_for}
    waits["reached"] = "converge"  # a node heard from: on its way to joined
    for inst in r["instances"]:
        for step, at in inst["timeline"].items():
            assert by["rent"]["start"] - 1e-3 <= at <= by[waits[step]]["end"] + 1e-3, (inst["stage"], step, at)
    assert tl["started"] <= spans[0]["start"] and spans[-1]["end"] <= tl["budget_end"]
    assert tl["budget_end"] - tl["started"] == pytest.approx(tl["budget"], abs=2e-4)
    assert tl["started"] < tl["steps_deadline"] < tl["budget_end"]


def test_the_cli_and_the_plugin_write_the_same_report(
    pytester: pytest.Pytester, synth_model: str, tmp_path: Path
) -> None:
    """The same run through both faces: the same keys at every level, the same settings, and
    both report a passed run with every instance destroyed. The plugin runs with no asyncio
    plugin at all (``-p no:asyncio``): it needs none.

    Each face runs on a terminal of its own (a pty: the CLI's stderr, the plugin's stdout and
    stderr), read whole: every drawing of its live line, from the first phase to the teardown,
    carries a count of work (n of m), not only a clock, and within each phase the count never
    goes back."""
    env = {k: v for k, v in os.environ.items() if k not in ("VAST_API_KEY", "PPSMOKE_MODE", "VAST_URL")}
    env["PY_COLORS"] = "0"  # pytest's summary in plain words, on a terminal too
    args = ["--model", synth_model, "--max-tokens", "4", "--prompt", "hi"]
    from_cli = tmp_path / "cli.json"
    # the two runs side by side (each has its own emulator): most of a run is waiting; each
    # writes to a terminal whose every byte a thread reads, so that neither can stall
    cli_tty, plugin_tty = Terminal(), Terminal()
    cli_run = subprocess.Popen(
        [sys.executable, "-m", "pytest_ppsmoke.harness.cli", "--local", *args, "--report", str(from_cli)],
        stdout=subprocess.DEVNULL, stderr=cli_tty.slave, env=env,
    )  # fmt: skip
    cli_tty.close_slave()
    plugin_run = None
    try:
        pytester.makepyfile(INFER)
        from_plugin = tmp_path / "plugin.json"
        plugin_run = subprocess.Popen(
            [
                sys.executable, "-m", "pytest", "--ppsmoke-mode", "local", "-p", "no:cacheprovider",
                "-p", "no:asyncio", "--ppsmoke-report", str(from_plugin), "--ppsmoke-reference-load", "beside",
                *(a.replace("--", "--ppsmoke-", 1) if a.startswith("--") else a for a in args),
            ],
            stdin=subprocess.DEVNULL, stdout=plugin_tty.slave, stderr=plugin_tty.slave, cwd=pytester.path,
            # its reference held 4 s on stage 0's node before it generates: the request comes meanwhile
            env={**env, "PP_FAILPOINTS": f"vast.slow_reference={SLOW_REFERENCE}"},
        )  # fmt: skip
        plugin_tty.close_slave()
        plugin_run.wait(timeout=240)
        cli_run.wait(timeout=240)
    finally:
        for proc in (cli_run, plugin_run):
            if proc is not None and proc.returncode is None:
                proc.kill()
                proc.wait()
    cli_said, plugin_said = cli_tty.text(), plugin_tty.text()
    assert cli_run.returncode == 0, plain(cli_said)[-3000:]
    assert plugin_run.returncode == 0 and re.search(r"=+ 1 passed in ", plain(plugin_said)), plain(plugin_said)[-3000:]
    for face, said in (("pp-smoke-run", cli_said), ("the plugin", plugin_said)):
        phases = counted(drawings(said))  # every drawing carries a count: n of m
        assert [p for p, _ in phases] == PHASES_DRAWN, (face, phases)
        for phase, done in phases:
            # within a phase it never goes back; how soon it moves on is the machine's speed, not
            # a property a test may assert (a loaded runner draws a phase many times between two
            # steps of its work): the counts' pace is in the benchmark runs, docs/benchmarks.md
            assert done == sorted(done), (face, phase, done)
    a, b = json.loads(from_cli.read_text()), json.loads(from_plugin.read_text())
    _same_keys(a, b)
    assert set(a) == {"schema_version", *(f.name for f in dataclasses.fields(Report))}
    assert a["schema_version"] == b["schema_version"] == SCHEMA_VERSION
    for r in (a, b):
        assert r["ok"] is True and r["exit_code"] == 0 and r["error"] is None
        assert (r["mode"], r["model"], r["prompt"], r["max_tokens"]) == ("local", synth_model, "hi", 4)
        assert r["creates_sent"] == 2 and r["left_after_teardown"] == [] and r["emulator"]["live_instances"] == []
        assert [i["final_state"] for i in r["instances"]] == ["destroyed", "destroyed"]
        for inst in r["instances"]:  # each instance's own steps, stamped in order
            assert list(inst["timeline"]) == list(STEPS), inst["timeline"]
            assert sorted(inst["timeline"].values()) == list(inst["timeline"].values()), inst["timeline"]
        timeline_agrees(r)
        assert 1 <= len(r["token_ids"]) <= 4
        ref = r["reference"]  # on stage 0's node, after the request: the same tokens
        assert (ref["state"], ref["stage"], ref["match"], ref["method"]) == (
            "done",
            0,
            True,
            "unsplit, boundaries rounded to bf16",
        )
        assert ref["token_ids"] == r["token_ids"] and ref["prompt_token_ids"] == r["prompt_token_ids"]
        assert ref["load_s"] > 0 and ref["generate_s"] > 0
    # the CLI's (after, on the CPU) asked at its step; the plugin's (beside) as stage 0 was ready,
    # its answer then waited for at the step
    assert a["reference"]["early_s"] is None and a["timings"]["reference"] >= a["reference"]["generate_s"]
    assert b["reference"]["early_s"] >= b["reference"]["generate_s"] and b["timings"]["reference"] >= 0
    # ... and held there (the failpoint) while stage 0 took the request: a reference in a worker of
    # its own holds no request back (one in the stage's worker does: test_pipeline's Busy)
    assert b["reference"]["early_s"] >= SLOW_REFERENCE
    # pp-smoke-run lets stage 1's instance go when the reference starts on stage 0's node (nothing
    # after it asks stage 1); the plugin keeps both to the teardown (its tests ask any node, in any
    # order). Either way, both are destroyed
    for r, released in ((a, [False, True]), (b, [False, False])):
        assert [i["released"] for i in sorted(r["instances"], key=lambda i: i["stage"])] == released, r["instances"]
    # ... the CLI's stage 1 destroyed alone, then stage 0's; the plugin's two in one call
    calls = [{k: v["calls"] for k, v in r["vast_api"]["endpoints"].items() if k.startswith("destroy")} for r in (a, b)]
    assert calls == [{"destroy": 2}, {"destroy_many": 1}], calls
    # the verdict: every claim a local run can check passed, each with its figure, from the same
    # judges as the spec's tests (harness/claims.py); the block says so at the end of the CLI's output
    checked = {c["claim"]: c for c in a["claims"]}
    assert list(checked) == list(claims.CLAIMS)
    for name in EIGHT_CLAIMS:
        assert checked[name]["state"] == "passed" and checked[name]["evidence"], checked[name]
    direct = checked[claims.DIRECT]
    assert direct["state"] == "not checked" and "loopback" in direct["evidence"]
    assert checked[claims.TOKENS]["evidence"].startswith(f"{len(a['token_ids'])} tokens equal the unsplit model's")
    said = plain(cli_said).splitlines()
    block = said[said.index("pp-smoke-run: PASS: 9 passed, 1 not checked of the 10 claims") :]
    lines = [re.fullmatch(r"pp-smoke-run:   (passed|failed|not checked) +(.+?): .+", line) for line in block[1:11]]
    assert [m.group(2) if m else None for m in lines] == list(claims.CLAIMS), block
    assert "(emulated: nothing was billed)" in plain(cli_said)
    # the CLI's stage 0 (auto, on the CPU) loaded the model afresh after the request and dropped
    # it; the plugin's (beside) had a reference worker load it beside the stages, and keep it
    assert (a["reference"]["loaded"], b["reference"]["loaded"]) == ("after", "beside")
    assert a["reference"]["mem_after"] <= a["reference"]["mem_before"]
    assert b["reference"]["mem_after"] > b["reference"]["mem_before"]


def test_the_shipped_schema_names_every_key_the_report_writes_with_its_type() -> None:
    """harness/report.schema.json, shipped as package data: ``schema_version`` first, then every
    field of Report, each required, no other key (tests/test_typed.py walks every part)."""
    s = schema()
    assert s["additionalProperties"] is False and s["properties"]["schema_version"]["const"] == SCHEMA_VERSION
    fields = [f.name for f in dataclasses.fields(Report)]
    assert list(s["properties"]) == s["required"] == ["schema_version", *fields]
    assert s["properties"]["reference"] == {"$ref": "#/$defs/ReferenceFigures"}
    assert s["properties"]["max_tokens"] == {"type": "integer"} and s["properties"]["error"]["type"] == [
        "string",
        "null",
    ]
    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert "report.schema.json" in pyproject["tool"]["setuptools"]["package-data"]["pytest_ppsmoke.harness"]


def test_a_report_validates_and_an_unknown_key_is_refused() -> None:
    report = Report("local", "smollm2:135m", "hi", 4, 2, "bf16")
    assert report_problems(report.to_json()) == []  # before anything ran
    report.fail(Phase.CONVERGE, "converge: 1 of 3 members alive")
    report.reference = ReferenceFigures(state="failed", detail="the node is gone")
    report.finish()
    assert report_problems(report.to_json()) == []
    assert report_problems({**report.to_json(), "extra": 1}) == [
        "(top): Additional properties are not allowed ('extra' was unexpected)"
    ]
    assert report_problems({**report.to_json(), "max_tokens": "4"}) == ["max_tokens: '4' is not of type 'integer'"]


def test_the_headline_is_one_line_whatever_the_error_holds() -> None:
    """A failure is one line: an error that spans lines (a worker's traceback, a node's message)
    is joined, its blank lines dropped; the hint follows it on the same line."""
    report = Report("local", "m", "hi", 4, 2, "bf16")
    report.fail(Phase.LOAD, "load: pp-stage-1 worker exited with status 1; Traceback:\n  File x\n\nValueError: bad\n")
    assert report.headline() == (
        "load: pp-stage-1 worker exited with status 1; Traceback: | File x | ValueError: bad "
        f"({Phase.LOAD.advice(Names())})"
    )
    assert stderr_text("") == "its stderr is empty" and stderr_text("one\n") == "its stderr ends: one"
    assert stderr_text("Traceback:\n  File x\nValueError: bad\n\n") == (
        "its stderr ends: ValueError: bad (the last of 3 lines; the node's log has them)"
    )


HUNG = "is hung, or cut off: no answer over the cluster within 4 s while vast.ai shows its instance running"


@pytest.mark.parametrize("point", sorted(failpoints.POINTS))
def test_every_failpoints_headline_is_short_and_names_its_phase_and_cause(point: str) -> None:
    """Each failpoint, failing each phase, in the worst shape a failure has: its cause (the point's
    own words, and a long detail after them) and 30 nodes' accounts, as ``pp-smoke-run --local
    --num-stages 30`` printed them. The headline is at most 300 characters, starts with the phase
    and the cause's first words, counts the other accounts and ends with the phase's advice; the
    report's error stays whole. (The messages the suite's own runs fail with:
    tests/test_lifecycle.py's ``assert_failed_at`` holds each line to 300 characters too.)"""
    doc = failpoints.POINTS[point].doc
    words = [f"pp-stage-{k} {HUNG}" for k in range(30)]
    for phase in Phase:
        cause = f"{point} is on ({doc}); " + "; ".join(f"instance {k} (stage {k}) did not answer" for k in range(30))
        error = f"{phase}: {cause}; " + "; ".join(words) + " (each node's log tail: the report's instances[].log_tail)"
        report = Report("local", "m", "hi", 4, 30, "bf16")
        report.instances = [cast(Any, SimpleNamespace(node_words=w)) for w in words]
        report.fail(phase, error)
        line = report.headline(Names())
        assert len(line) <= 300, (phase, len(line), line)
        assert line.startswith(f"{phase}: {point} is on"), line
        advised = phase.hint and not ("interrupted" in doc or "budget" in doc)  # an interruption has no advice
        assert line.endswith(f" ({phase.advice(Names())})" if advised else "instances[].log_tail)"), line
        assert "; and 29 more (each node's log tail: " in line or "; the accounts of 30 node(s)" in line, line
        assert report.error == error


def test_a_headline_keeps_what_fits_whole() -> None:
    """A short cause and one account: nothing is cut; the error and the headline are the same line."""
    report = Report("local", "m", "hi", 4, 2, "bf16")
    report.instances = [cast(Any, SimpleNamespace(node_words=f"pp-stage-1 {HUNG}"))]
    error = f"load: 1 of 2 workers ready after 240 s; pp-stage-1 {HUNG} (each node's log tail: X)"
    report.fail(Phase.LOAD, error)
    assert report.headline() == f"{error} ({Phase.LOAD.advice(Names())})"


def test_each_figure_has_the_step_after_which_it_is_final() -> None:
    """The JUnit properties: each name once, each with a driver step (or the run's end)."""
    report = Report("local", "m", "hi", 4, 2, "bf16")
    report.fail(Phase.RENT, "rent: no offers")
    report.timings = {"rent": 1.0, "decode": 2.0, "total": 3.0, "teardown": 0.5}
    report.vast_api = ApiFigures(calls=3)
    figures = report.figures()
    names = [name for _, name, _ in figures]
    assert len(names) == len(set(names)) and [(n, v) for _, n, v in figures] == report.properties()
    step = {name: s for s, name, _ in figures}
    assert set(step.values()) <= {"", *RUN_STEPS}
    assert (step["ppsmoke_time_rent"], step["ppsmoke_time_decode"], step["ppsmoke_text"]) == ("rent", "infer", "infer")
    assert step["ppsmoke_time_total"] == step["ppsmoke_cost_usd"] == step["ppsmoke_error"] == step["ppsmoke_vast_calls"]
    assert step["ppsmoke_time_total"] == "" == step["ppsmoke_failed_phase"]
    assert dict(report.properties())["ppsmoke_failed_phase"] == "rent"


def test_every_figure_is_a_plain_value_that_xdist_can_carry() -> None:
    """A JUnit property travels from a pytest-xdist worker to its controller, which serializes
    only plain values: no enum (the report's mode, phase, the reference's state) reaches it."""
    report = Report(Mode.LOCAL, "m", "hi", 4, 2, WireDtype.BF16)
    report.fail(Phase.DECODE, "decode: lost")
    report.reference = ReferenceFigures(ReferenceState.DONE, stage=0, token_ids=[1], match=True)
    for _, name, value in report.figures():
        assert type(value) in (str, int, float, bool, type(None)), (name, type(value))


def test_one_table_makes_both_faces_options() -> None:
    """Every option has a flag on at least one face; the CLI's defaults are the table's; the
    plugin has the deadlines the CLI has; the wire dtypes are protocol's one list."""
    flags = {a.dest: a for a in cli.parser()._actions}
    for opt in OPTIONS:
        assert opt.cli or opt.pytest, opt.name
        if opt.cli:
            assert flags[opt.name].option_strings == [opt.cli]
            assert opt.help in (flags[opt.name].help or "")
    deadlines = {o.name for o in OPTIONS if o.group == "deadlines"}
    assert {"converge_timeout", "load_timeout", "resolve_timeout", "teardown_timeout"} <= deadlines
    assert all(o.pytest for o in OPTIONS if o.group == "deadlines")
    assert WIRE_DTYPES is protocol.WIRE_DTYPES
    _, s = cli.parse_args(["--local", "--model", "smollm2:135m"])
    assert s == Settings.resolve({"mode": "local", "model": "smollm2:135m"})
    assert (s.poll_interval, s.budget, s.num_stages, s.wire_dtype, s.reference) == (0.25, 300.0, 2, "bf16", True)
    assert cli.parse_args(["--local", "--reference", "off"])[1].reference is False
    assert Settings.resolve({"api_key": "k"}).mode == "vastai"
    assert Settings.resolve({"api_key": "k"}).model == "llama3.2:1b"
    assert "k-secret" not in repr(Settings.resolve({"api_key": "k-secret"}))


def test_importing_the_plugin_loads_neither_the_runtime_nor_an_asyncio_plugin() -> None:
    probe = (
        "import sys, pytest_ppsmoke.plugin; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'iroh', 'aiohttp', 'numpy', 'tinygrad', 'pytest_asyncio', 'asyncio'}))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


SPEC_ONLY = "pytest_ppsmoke.spec"
KEY = "vk-FAILED-RENT-0d4e-NEVER-SHOWN"
# a traceback frame in this package, as pytest prints one (path.py:LINE) or Python does (File "path.py", line LINE)
OUR_FRAME = re.compile(r"pytest_ppsmoke/[\w/]*\.py(?::\d+|\", line \d+)")


def test_a_failed_rent_shows_once_in_one_line_with_no_traceback(pytester: pytest.Pytester) -> None:
    """The spec suite against an address where nothing answers (as with no network): the first
    test that needs the deployment shows the error, naming the phase, the cause and what to do;
    the others point at it; nothing claims something may be billing, since nothing was created."""
    result = pytester.runpytest_subprocess(
        "--pyargs", SPEC_ONLY, "-p", "no:cacheprovider", "--ppsmoke-mode", "vastai",
        "--vastai-key", KEY, "--vast-url", "http://127.0.0.1:9", "-rs",
    )  # fmt: skip
    result.assert_outcomes(errors=7, skipped=2)  # skipped: one as before, and the layout grid (not asked for)
    out = result.stdout.str() + result.stderr.str()
    first = [line for line in out.splitlines() if "deployment failed at preflight: cannot reach vast.ai at" in line]
    assert len(first) == 1, out
    assert "127.0.0.1:9" in first[0] and first[0].endswith("(nothing was rented)"), first[0]
    assert "HTTPS_PROXY" in first[0] and "--vast-url" in first[0], first[0]
    assert out.count("the deployment failed at preflight; the error is shown at test_spec.py::") == 6
    assert out.count("cannot reach vast.ai at") == 1
    for absent in ("Traceback", "During handling", "billing", KEY):
        assert absent not in out, absent
    # no frame of this package (another plugin's warning may name its own file: pytest-asyncio's does)
    frames = [line for line in out.splitlines() if OUR_FRAME.search(line) and not line.startswith("SKIPPED [")]
    assert not frames, frames  # -rs names each skip's test by file and line: not a frame
    assert "nothing to destroy: no instance was created (the deployment failed at preflight)" in out


async def test_the_reference_step_records_a_mismatch_a_failure_and_a_lack_of_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """None of them fails the run (the spec's token-exact test fails on them); each is in the
    report with what a reader needs: where the tokens first differ, the error, the budget left."""
    answers: list[Any] = []

    async def reference(
        seed: object, prompt: str, max_tokens: int, timeout: float, on_progress: Any, beside: str | None = None
    ) -> ReferenceResult:
        assert timeout <= run.remaining() - reference_step.REFERENCE_MARGIN + 0.1
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[no-any-return]

    monkeypatch.setattr(reference_step, "request_reference", reference)
    run = driver.SmokeRun(Settings.resolve({"mode": "local", "budget": 100}))
    run.deployment = SimpleNamespace(seed=object(), phase="decode")  # type: ignore[assignment]
    run.result = SimpleNamespace(token_ids=[7, 8, 9])  # type: ignore[assignment]
    run.started = time.monotonic()
    method = "unsplit, boundaries rounded to bf16"
    answers.append(ReferenceResult(0, method, "CPU", (1,), (7, 8, 4), 0.5, 1.5))
    await run._reference()
    ref = run.report.reference
    assert (ref.state, ref.match, ref.first_difference, ref.token_ids) == ("done", False, 2, [7, 8, 4])
    assert "MISMATCH at token 2" in ref.line() and run.failure is None and "reference" in run.report.timings
    answers.append(ReferenceResult(0, method, "CPU", (1,), (7, 8), 0.5, 1.5))  # ended early
    await run._reference()
    assert (run.report.reference.match, run.report.reference.first_difference) == (False, 2)
    answers.append(TimeoutError("no reply from pp-entry to ReferenceQuery within 97 s"))
    await run._reference()
    assert (run.report.reference.state, run.report.reference.detail) == (
        "failed",
        "no reply from pp-entry to ReferenceQuery within 97 s",
    )
    run.started = time.monotonic() - 95  # 5 s of the budget left
    await run._reference()
    assert run.report.reference.state == "skipped" and "of the budget of 100 s were left" in str(
        run.report.reference.detail
    )
    run.settings = Settings.resolve({"mode": "local", "reference": False})
    await run._reference()
    assert run.report.reference.state == "off" and answers == [] and run.failure is None


async def test_a_reference_loaded_beside_is_asked_as_stage_0_joins_and_its_step_takes_the_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Beside the stages (its own worker), stage 0's node is asked as soon as it has joined (its
    reference actor, by its id), before its stage's worker is ready and before any request; the
    step takes that answer, and lets no stage go early (the teardown destroys them all at once).
    Loaded after the request, it is asked at the step (``pp-entry``). A reference never answered
    is cancelled when the run closes."""
    asked: list[str] = []
    hold = asyncio.Event()

    async def reference(
        seed: object, prompt: str, max_tokens: int, timeout: float, on_progress: Any, beside: str | None = None
    ) -> ReferenceResult:
        asked.append(("request in" if run.result is not None else "before the request") + f" at {beside}")
        await hold.wait()
        return ReferenceResult(0, "unsplit, boundaries rounded to bf16", "CUDA", (1,), (7, 8, 9), 0.5, 1.5)

    monkeypatch.setattr(reference_step, "request_reference", reference)
    released: list[int] = []

    async def release(keep: int) -> None:
        released.append(keep)

    for load in ("beside", "after"):
        run = driver.SmokeRun(Settings.resolve({"mode": "local", "budget": 100}))
        run.deployment = SimpleNamespace(  # type: ignore[assignment]
            seed=object(), phase="load", config=SimpleNamespace(reference_load=load), release=release
        )
        run.started, run.release_early = time.monotonic(), True
        stage0, stage1 = SimpleNamespace(stage=0, endpoint_id="id0"), SimpleNamespace(stage=1, endpoint_id="id1")
        for inst, step in [(stage1, "joined"), (stage1, "loaded"), (stage0, "rented"), (stage0, "running")]:
            run._stage_step(inst, step)  # type: ignore[arg-type]  # not the entry stage, or not joined yet
        assert run.asker.early is None
        run._stage_step(stage0, "joined")  # type: ignore[arg-type]
        assert (run.asker.early is not None) == (load == "beside")
        await asyncio.sleep(0)
        assert asked == (["before the request at id0"] if load == "beside" else [])
        run._stage_step(stage0, "loaded")  # type: ignore[arg-type]  # once only
        run.result = SimpleNamespace(token_ids=[7, 8, 9])  # type: ignore[assignment]
        asyncio.get_running_loop().call_later(0.01, hold.set)  # answered after the step began
        await run._reference()
        ref = run.report.reference
        assert (ref.state, ref.match) == ("done", True)
        assert (ref.early_s is not None) == (load == "beside") and ("asked as its node joined" in ref.line()) == (
            load == "beside"
        )
        # asked early: nothing released (the teardown's one call takes them all, rather than stage
        # 0's destroy waiting out vast.ai's destroy limit after theirs); asked at the step: the
        # others go meanwhile
        if run.releasing is not None:
            await run.releasing
        assert released == ([] if load == "beside" else [0]), load
        # once: beside, at stage 0's reference actor; after, at the step, through pp-entry
        assert asked == (["before the request at id0"] if load == "beside" else ["request in at None"]), load
        asked.clear()
        hold.clear()
    run = driver.SmokeRun(Settings.resolve({"mode": "local", "budget": 100}))
    run.deployment = SimpleNamespace(seed=object(), config=SimpleNamespace(reference_load="beside"))  # type: ignore[assignment]
    run.started = time.monotonic()
    run._stage_step(SimpleNamespace(stage=0, endpoint_id="id0"), "joined")  # type: ignore[arg-type]
    await asyncio.sleep(0)
    early = run.asker.early
    assert early is not None and not early.done()
    await run.asker.close()
    assert early.cancelled()

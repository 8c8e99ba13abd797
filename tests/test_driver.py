"""The one run driver and its two faces: ``pp-smoke-run`` and the pytest plugin write the same
report; one settings table makes both faces' options; the plugin loads light; a failed phase
shows once, as one line."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_ppsmoke import protocol
from pytest_ppsmoke.cloud.rental import STEPS
from pytest_ppsmoke.harness import cli, driver
from pytest_ppsmoke.harness.figures import ApiFigures, Mode, ReferenceFigures, ReferenceState, WireDtype
from pytest_ppsmoke.harness.report import SCHEMA_VERSION, Report, schema
from pytest_ppsmoke.harness.settings import OPTIONS, WIRE_DTYPES, Settings
from pytest_ppsmoke.harness.settings import STEPS as RUN_STEPS
from pytest_ppsmoke.messages import ReferenceResult
from pytest_ppsmoke.protocol import Names, Phase
from pytest_ppsmoke.stage.bridge import stderr_text

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
    run measured (a stall of its event loop, on a loaded machine) is in one and not the other."""
    empty = _empty_lists(a) | _empty_lists(b)
    odd = {k for k in _keys(a) ^ _keys(b) if not any(k.startswith(e + ".[].") for e in empty)}
    assert not odd, sorted(odd)


INFER = """
import pytest
pytestmark = pytest.mark.local

def test_infer(ppsmoke_inference, ppsmoke_reference):
    assert ppsmoke_inference.text and ppsmoke_reference.match
"""


def test_the_cli_and_the_plugin_write_the_same_report(
    pytester: pytest.Pytester, synth_model: str, tmp_path: Path
) -> None:
    """The same run through both faces: the same keys at every level, the same settings, and
    both report a passed run with every instance destroyed. The plugin runs with no asyncio
    plugin at all (``-p no:asyncio``): it needs none."""
    env = {k: v for k, v in os.environ.items() if k not in ("VAST_API_KEY", "PPSMOKE_MODE", "VAST_URL")}
    args = ["--model", synth_model, "--max-tokens", "4", "--prompt", "hi"]
    from_cli = tmp_path / "cli.json"
    # the two runs side by side (each has its own emulator): most of a run is waiting; the CLI's
    # output goes to a file, which cannot fill up and stall it as an unread pipe would
    cli_err = tmp_path / "cli.stderr"
    with cli_err.open("w") as sink:
        cli_run = subprocess.Popen(
            [sys.executable, "-m", "pytest_ppsmoke.harness.cli", "--local", *args, "--report", str(from_cli)],
            stdout=subprocess.DEVNULL, stderr=sink, env=env,
        )  # fmt: skip
    try:
        pytester.makepyfile(INFER)
        from_plugin = tmp_path / "plugin.json"
        result = pytester.runpytest_subprocess(
            "--ppsmoke-mode", "local", "-p", "no:cacheprovider", "-p", "no:asyncio",
            "--ppsmoke-report", str(from_plugin), "--ppsmoke-reference-load", "beside",
            *(a.replace("--", "--ppsmoke-", 1) if a.startswith("--") else a for a in args),
        )  # fmt: skip
        cli_run.wait(timeout=240)
    finally:
        if cli_run.returncode is None:
            cli_run.kill()
            cli_run.wait()
    assert cli_run.returncode == 0, cli_err.read_text()[-3000:]
    result.assert_outcomes(passed=1)
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
        assert 1 <= len(r["token_ids"]) <= 4
        ref = r["reference"]  # on stage 0's node, after the request: the same tokens
        assert (ref["state"], ref["stage"], ref["match"], ref["method"]) == (
            "done",
            0,
            True,
            "unsplit, boundaries rounded to bf16",
        )
        assert ref["token_ids"] == r["token_ids"] and ref["prompt_token_ids"] == r["prompt_token_ids"]
        assert ref["load_s"] > 0 and ref["generate_s"] > 0 and r["timings"]["reference"] >= ref["generate_s"]
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

    async def reference(seed: object, prompt: str, max_tokens: int, timeout: float) -> ReferenceResult:
        assert timeout <= run.remaining() - driver.REFERENCE_MARGIN + 0.1
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[no-any-return]

    monkeypatch.setattr(driver, "request_reference", reference)
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

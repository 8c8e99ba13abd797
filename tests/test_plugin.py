"""The pytest plugin, tested with pytester: options and their precedence, usage errors, the skip
without a key, finalizers after a failure and after a timeout, and the spec suite itself with
its JUnit properties."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from .helpers import PYTESTER_INI, SYNTH, TEST_TAG, node_processes

pytestmark = pytest.mark.local

SHOW_SETTINGS = """
import json

def test_show(ppsmoke_settings):
    s = ppsmoke_settings
    fields = ("mode", "model", "num_stages", "wire_dtype", "vast_url", "budget", "max_tokens", "gpu_ram", "report")
    print("SETTINGS " + json.dumps({f: str(getattr(s, f)) for f in fields}))
"""


def settings_of(result: pytest.RunResult) -> dict[str, str]:
    found = re.search(r"SETTINGS (\{.*\})", result.stdout.str())
    assert found, result.stdout.str()
    return json.loads(found.group(1))  # type: ignore[no-any-return]


def test_each_option_comes_from_the_flag_then_the_environment_then_the_ini(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VAST_API_KEY", raising=False)
    monkeypatch.setenv("VAST_URL", "http://127.0.0.1:9/from-env")
    pytester.makeini(
        PYTESTER_INI
        + "ppsmoke_stages = 3\n"
        + "ppsmoke_wire_dtype = f16\n"
        + "ppsmoke_vast_url = http://127.0.0.1:9/from-ini\n"
        + "ppsmoke_budget = 100\n"
        + "ppsmoke_max_tokens = 7\n"
    )
    pytester.makepyfile(SHOW_SETTINGS)
    result = pytester.runpytest("-s", "--ppsmoke-stages", "4", "--ppsmoke-gpu-ram", "24")
    result.assert_outcomes(passed=1)
    s = settings_of(result)
    assert s["num_stages"] == "4" and s["gpu_ram"] == "24.0"  # flag over ini
    assert s["vast_url"] == "http://127.0.0.1:9/from-env"  # environment over ini
    assert (s["wire_dtype"], s["budget"], s["max_tokens"]) == ("f16", "100.0", "7")  # ini over default
    assert (s["mode"], s["model"], s["report"]) == ("local", "smollm2:135m", "None")  # defaults
    monkeypatch.delenv("VAST_URL")
    assert settings_of(pytester.runpytest("-s"))["vast_url"] == "http://127.0.0.1:9/from-ini"


def test_a_key_selects_vastai_unless_local_is_asked_for(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VAST_API_KEY", "vk-precedence-test")
    pytester.makepyfile("import pytest\npytestmark = [pytest.mark.local, pytest.mark.vastai]\n" + SHOW_SETTINGS)
    assert settings_of(pytester.runpytest("-s"))["mode"] == "vastai"
    assert settings_of(pytester.runpytest("-s"))["model"] == "llama3.2:1b"
    assert settings_of(pytester.runpytest("-s", "--ppsmoke-mode", "local"))["mode"] == "local"
    assert settings_of(pytester.runpytest("-s", "-m", "local"))["mode"] == "vastai"  # -m only selects tests
    monkeypatch.delenv("VAST_API_KEY")
    assert settings_of(pytester.runpytest("-s", "-m", "vastai"))["mode"] == "local"
    monkeypatch.setenv("PPSMOKE_MODE", "vastai")
    assert settings_of(pytester.runpytest("-s"))["mode"] == "vastai"


def test_the_help_shows_each_options_default(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pytest --help`` gives each option its default, from the settings table's value."""
    from pytest_ppsmoke.harness.settings import OPTIONS

    monkeypatch.setenv("COLUMNS", "10000")  # no line breaks inside a default
    pytester.makeini(PYTESTER_INI)
    text = " ".join(pytester.runpytest("--help").stdout.str().split())
    for opt in OPTIONS:
        if opt.pytest and "(default" in opt.help:
            assert " ".join(opt.help[opt.help.rindex("(default") :].split()) in text, opt.name


def test_the_help_groups_the_options_by_task_with_values_and_real_variables(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pytest --help``: the options in a group per task, each with a value as its metavar (its
    choices, N, SECONDS, URL...), never the option's name in capitals, and the variable it really
    reads; no RST backticks."""
    from pytest_ppsmoke.harness.settings import GROUPS, OPTIONS

    monkeypatch.setenv("COLUMNS", "10000")
    pytester.makeini(PYTESTER_INI)
    lines = pytester.runpytest("--help").stdout.lines
    titles = [f"pytest-ppsmoke: {title}:" for title in GROUPS.values()]
    assert [line for line in lines if line.startswith("pytest-ppsmoke:")] == titles
    section = ""
    for line in lines:
        if line and not line.startswith(" "):
            section = line
        for opt in OPTIONS:
            if opt.pytest and line.strip().startswith(f"{opt.pytest}="):
                assert section == f"pytest-ppsmoke: {GROUPS[opt.group]}:", (opt.name, section)
                assert line.split()[0] == f"{opt.pytest}={opt.metavar}", line
                assert opt.metavar not in (opt.name.upper(), "PPSMOKE_" + opt.name.upper()), line
    text = "\n".join(lines)
    for opt in OPTIONS:
        if opt.pytest and opt.env:
            assert f"env {opt.env}" in text, opt.name
    words = set(text.split())
    assert {"--ppsmoke-wire-dtype={bf16,f16,f32}", "--ppsmoke-max-tokens=N", "--vastai-key=KEY"} <= words
    assert {"--ppsmoke-converge-timeout=SECONDS", "--vast-url=URL", "VAST_API_KEY"} <= words
    assert "PPSMOKE_API_KEY" not in text
    ours = [line for line in lines if "ppsmoke" in line]
    assert not any("``" in line for line in ours)


@pytest.mark.parametrize(
    ("args", "ini", "message"),
    [
        (
            ["--ppsmoke-stages", "1"],
            "",
            "--ppsmoke-stages must be an integer of at least 2, got '1'",
        ),
        (
            [],
            "ppsmoke_wire_dtype = f8",
            "--ppsmoke-wire-dtype (from ini ppsmoke_wire_dtype) names an unknown wire dtype 'f8'",
        ),
        (["--ppsmoke-budget", "-5"], "", "--ppsmoke-budget must be a positive number, got '-5'"),
        (
            [],
            "ppsmoke_min_reliability = 1.5",
            "(from ini ppsmoke_min_reliability) must be a number between 0 and 1, got '1.5'",
        ),
        (
            ["--ppsmoke-max-tokens", "many"],
            "",
            "--ppsmoke-max-tokens must be an integer of at least 1, got 'many'",
        ),
        ([], "ppsmoke_load_timeout = soon", "(from ini ppsmoke_load_timeout) must be a positive number, got 'soon'"),
    ],
)
def test_a_bad_value_is_a_usage_error_naming_it_and_its_source(
    pytester: pytest.Pytester, args: list[str], ini: str, message: str
) -> None:
    pytester.makeini(f"{PYTESTER_INI}{ini}\n")
    pytester.makepyfile("def test_nothing(): pass")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()


def test_vastai_without_a_key_skips_and_names_the_option(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VAST_API_KEY", raising=False)
    pytester.makepyfile(
        """
        import pytest
        pytestmark = pytest.mark.vastai

        def test_needs_gpus(ppsmoke_instances):
            raise AssertionError("must not run")
        """
    )
    result = pytester.runpytest("--ppsmoke-mode", "vastai", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*vastai mode needs a vast.ai API key: pass --vastai-key or set VAST_API_KEY*"])


FAILING = """
import time
import pytest
pytestmark = pytest.mark.local

def test_fails_with_instances_rented(ppsmoke_instances):
    assert len(ppsmoke_instances.instances) == 2
    {body}
"""


@pytest.mark.parametrize(
    ("body", "args", "outcome"),
    [
        ("assert False, 'deliberately'", [], "deliberately"),
        # the test's own body times out: the deployment's setup may take longer than 4 s on loaded cores
        ("time.sleep(120)", ["--timeout", "4", "-o", "timeout_func_only=true"], "Timeout"),
    ],
    ids=["failing test", "timeout"],
)
def test_finalizers_destroy_everything_after_a_failure_or_a_timeout(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    synth_model: str,
    body: str,
    args: list[str],
    outcome: str,
) -> None:
    pytester.makepyfile(FAILING.format(body=body))
    report = pytester.path / "r.json"
    tag = f"plugin-{os.getpid()}-{len(args)}"
    monkeypatch.setenv(TEST_TAG, tag)  # the nodes inherit it, through the emulator
    result = pytester.runpytest_subprocess(
        "-m", "local", "--ppsmoke-model", synth_model, "--ppsmoke-report", str(report), *args
    )  # fmt: skip
    result.assert_outcomes(failed=1)
    assert outcome in result.stdout.str()
    figures = json.loads(report.read_text())
    assert len(figures["instances"]) == 2
    assert all(i["final_state"] == "destroyed" for i in figures["instances"])
    assert figures["emulator"]["live_instances"] == []
    assert sorted(figures["emulator"]["destroyed_instances"]) == sorted(i["id"] for i in figures["instances"])
    assert node_processes(tag) == []


KEY = "vk-JUNIT-5b1e07c2-NEVER-IN-XML"


def test_the_spec_suite_passes_and_junit_carries_the_figures(
    pytester: pytest.Pytester, tmp_path: Path, synth_model: str
) -> None:
    """``pytest --pyargs pytest_ppsmoke.spec -m local``, against an emulator that requires a
    distinctive key and pushes back as vast.ai does: rate limits (scaled down: create 0.4 s apart
    or a 1.5 s penalty, show 0.2 s apart), the cheapest offer taken between search and create, and
    destroyed instances that stay listed on their way out. Every spec test passes, the teardown
    claim included; the JUnit XML carries the figures, what the API cost among them; the key is
    nowhere. Every figure appears once in the JUnit XML, on the test it belongs to. On the
    synthetic model, whose random weights make no words: the test of coherent text
    is left out here (the suite runs the spec tests on SmolLM2 too, ``testpaths``)."""
    pushback = "vast.rate_limit=create:0.4:1.5,show:0.2;vast.race_offers=1:404;vast.destroy_linger=60"
    emulator = subprocess.Popen(
        [sys.executable, "-m", "pytest_ppsmoke.cloud.emulator", "--faults", pushback],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "VAST_API_KEY": KEY},
    )  # fmt: skip
    try:
        assert emulator.stdout is not None
        url = emulator.stdout.readline().strip()
        xml = tmp_path / "out.xml"
        result = pytester.runpytest_subprocess(
            "--pyargs", "pytest_ppsmoke.spec", "-m", "local", "-p", "no:cacheprovider", "--ppsmoke-mode", "local",
            "--vast-url", url, "--vastai-key", KEY, "--ppsmoke-max-tokens", "12", f"--junitxml={xml}", "-rA",
            "--ppsmoke-model", synth_model, "-k", "not test_output_is_coherent_text",
            "--ppsmoke-report", str(tmp_path / "report.json"),  # checked against the schema (conftest.py)
        )  # fmt: skip
    finally:
        emulator.terminate()
        emulator.wait(30)
    result.assert_outcomes(passed=7, skipped=1, deselected=1)  # skipped: the layout grid, not asked for
    out = result.stdout.str()
    assert f"pytest-ppsmoke: local, {synth_model}, 2 stages, bf16" in out  # the terminal summary
    assert re.search(r"vast\.ai API: \d+ calls; \d+ answered 429 \(absorbed: .*1 offer\(s\) taken by someone else", out)
    hop = SYNTH.dim * 2  # bytes of one token's hidden state in bf16
    assert f"pp-stage-0->pp-stage-1 decode: 11 x [{hop}] B" in out
    assert "orchestrator frames in decode: received InferenceResponse 1; sent nothing (membership:" in out
    text = xml.read_text()
    assert KEY not in text and KEY not in out and "vk-JUNIT" not in text
    root = ET.fromstring(text)
    names = [p.get("name") for p in root.iter("property")]  # the suite's and every test case's
    assert names and len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    props: dict[str, str] = {}  # each figure, once
    on: dict[str, str] = {}  # the test that carries it
    for case in root.iter("testcase"):
        if case.find("skipped") is not None:  # the layout grid's test, not asked for: no deployment
            assert case.get("name") == "test_layout_grid_fits_its_cost_model_and_writes_the_report"
            assert case.find("properties") is None
            continue
        for p in case.iter("property"):
            props[str(p.get("name"))], on[str(p.get("name"))] = str(p.get("value")), str(case.get("name"))
    assert props["ppsmoke_mode"] == "local" and props["ppsmoke_run_id"]
    assert float(props["ppsmoke_time_rent"]) >= 0 and float(props["ppsmoke_cost_usd"]) > 0
    assert len(props["ppsmoke_instances"].split(",")) == 2
    assert props["ppsmoke_offers_skipped"] == "4100068"  # the cheapest, raced away
    assert int(props["ppsmoke_vast_rate_limited"]) >= 1 and float(props["ppsmoke_vast_retry_wait_s"]) > 0
    assert float(props["ppsmoke_time_decode_tokens_per_s"]) > 0
    assert props["ppsmoke_hop_pp-stage-0->pp-stage-1_decode_bytes"] == f"[{hop}]"
    assert props["ppsmoke_text"] and len(props["ppsmoke_token_ids"].split(",")) == 12
    assert props["ppsmoke_reference_state"] == "done" and props["ppsmoke_reference_match"] == "True"
    assert props["ppsmoke_reference_token_ids"] == props["ppsmoke_token_ids"]
    assert float(props["ppsmoke_time_reference"]) > 0
    # each on the test it belongs to: a step's figures on the first test (in the order they ran,
    # which a reordering plugin may shuffle) that saw the step done, the run's end's on the test
    # that tore the deployment down (always last)
    ran = [str(c.get("name")) for c in root.iter("testcase") if c.find("skipped") is None]
    converge = "test_cluster_converges_to_all_members_with_one_view"  # the one test that needs no more than load
    inference = [n for n in ran if n not in (converge, "test_stage_names_resolve_to_their_stages")]
    assert {on[n] for n in ("ppsmoke_mode", "ppsmoke_time_rent", "ppsmoke_time_load", "ppsmoke_instances")} == {
        ran[0]
    }, on
    assert on["ppsmoke_time_resolve"] == next(n for n in ran if n != converge), on
    assert on["ppsmoke_text"] == on["ppsmoke_time_decode"] == inference[0], on
    reference = "test_tokens_equal_the_unsplit_reference"
    assert {on[n] for n in ("ppsmoke_reference_match", "ppsmoke_time_reference")} == {reference}, on
    last = "test_teardown_leaves_no_instance_with_the_runs_label"
    assert ran[-1] == last and {on[n] for n in ("ppsmoke_cost_usd", "ppsmoke_time_total", "ppsmoke_vast_calls")} == {
        last
    }, on


LOST = """
import pytest
pytestmark = pytest.mark.local

def test_infer(ppsmoke_inference):
    pass
"""


def test_a_host_lost_mid_decode_fails_the_session_naming_its_stage(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, synth_model: str
) -> None:
    """Stage 1's host stops answering mid-decode (vast.ai shows its instance offline; its node is
    frozen, so no connection closes and SWIM would take seconds): the test that needs the inference
    errors at once, in one line naming pp-stage-1, its instance and what vast.ai reported; both
    instances are destroyed and no node is left running. The failing test's JUnit record carries
    each node's account: pp-stage-1 dead, with its marker in the tail vast.ai's logs served, and
    the keys both nodes wrote into their logs (text, hex, base64) redacted there and in the output."""
    pytester.makepyfile(LOST)
    tag = f"plugin-{os.getpid()}-lost"
    word = f"lost-{os.getpid()}"
    monkeypatch.setenv(TEST_TAG, tag)
    faults = f"vast.lose_host=1:offline;vast.kill_after_tokens=2;vast.say=1:{word};vast.log_secrets=0,1"
    monkeypatch.setenv("PP_FAILPOINTS", faults)
    report, junit = pytester.path / "r.json", pytester.path / "out.xml"
    result = pytester.runpytest_subprocess(
        "-m", "local", "-p", "no:cacheprovider", "--ppsmoke-model", synth_model, "--ppsmoke-max-tokens", "512",
        "--ppsmoke-report", str(report), f"--junitxml={junit}",
    )  # fmt: skip
    result.assert_outcomes(errors=1)
    case = ET.parse(junit).getroot().find(".//testcase[@name='test_infer']")
    assert case is not None
    props = {p.get("name"): p.get("value", "") for p in case.iter("property")}
    lost_tail, other_tail = props["ppsmoke_log_tail_pp-stage-1"], props["ppsmoke_log_tail_pp-stage-0"]
    assert lost_tail.startswith("pp-stage-1 is dead: vast.ai shows its instance offline"), lost_tail[:300]
    # its own words (the marker each decode step writes: the newest lines), as vast.ai served them
    assert f"marker: {word} (decode step)" in lost_tail and "vast.ai logs" in lost_tail, lost_tail[-2000:]
    assert sum("node.log_secrets:" in ln for ln in other_tail.splitlines()) >= 6, other_tail[-3000:]
    # wherever a key was written (the XML, the report, the output), what is left of its encoding is
    # at most the few characters a base64 offset adds (test_tails decodes every place with the keys)
    texts = [junit.read_text(), report.read_text(), *result.outlines, *result.errlines]
    for text in texts:
        for ln in re.findall(r"node\.log_secrets: [a-z0-9' ]+ (?:in|as|URL)[^:\n]*: [^\n\\&\"]+", text):
            assert len(ln.split(": ", 2)[2].replace("[redacted]", "")) <= 12, ln  # padding URL-quoted: %3D%3D
    figures = json.loads(report.read_text())
    lost = next(i for i in figures["instances"] if i["stage"] == 1)
    where = re.escape(f"pp-stage-1 on instance {lost['id']} ({lost['label']})")
    said = r"vast\.ai reports the instance offline \(.+\); its host was lost mid-run"
    tails = r"\(each node's log tail: the report's instances\[\]\.log_tail\)"
    line = rf"the local deployment failed at decode: {where}: {said} {tails} \(.+\)"
    result.stdout.re_match_lines([line])
    assert figures["failed_phase"] == "decode" and "pp-stage-1" in figures["error"]
    assert [i["final_state"] for i in figures["instances"]] == ["destroyed", "destroyed"]
    assert figures["emulator"]["live_instances"] == [] and node_processes(tag) == []


INTERRUPTED = """
import pathlib, time
import pytest
pytestmark = pytest.mark.local

def test_waits_to_be_interrupted(ppsmoke_instances):
    import signal
    pathlib.Path("sigint").write_text(repr(signal.getsignal(signal.SIGINT)))
    pathlib.Path("rented").write_text(str([i.id for i in ppsmoke_instances.instances]))
    time.sleep(120)
"""


# pytest as a user starts it from a terminal, where Ctrl-C raises KeyboardInterrupt: a child
# inherits an ignored SIGINT (a suite started in the background by a non-interactive shell, under
# nohup), and Python then leaves it ignored
AS_IN_A_TERMINAL = (
    "import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.exit(pytest.main(sys.argv[1:]))"
)


def test_ctrl_c_runs_the_finalizers_and_destroys_everything(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, synth_model: str
) -> None:
    pytester.makepyfile(INTERRUPTED)
    tag = f"plugin-{os.getpid()}-sigint"
    monkeypatch.setenv(TEST_TAG, tag)
    report = pytester.path / "r.json"
    argv = ["-m", "local", "-p", "no:cacheprovider", "--ppsmoke-model", synth_model, "--ppsmoke-report", str(report)]
    proc = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-c", AS_IN_A_TERMINAL, *argv],
        cwd=pytester.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    rented = pytester.path / "rented"
    deadline = time.monotonic() + 60
    while not rented.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.1)
    assert (pytester.path / "sigint").read_text() == repr(signal.default_int_handler)  # as in a terminal
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    try:
        out, _ = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        out, _ = proc.communicate(timeout=20)
        # the session's own deadlines (teardown 60 s + 30 s) should have ended it: say where it is stuck
        raise AssertionError("the session did not end within 100 s of Ctrl-C; its threads:\n" + out[-12000:]) from None
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out
    assert "KeyboardInterrupt" in out
    figures = json.loads(report.read_text())
    assert [i["id"] for i in figures["instances"]] == json.loads(rented.read_text())
    assert all(i["final_state"] == "destroyed" for i in figures["instances"])
    assert figures["emulator"]["live_instances"] == []
    assert node_processes(tag) == []


CLUSTER = """
import pytest
pytestmark = pytest.mark.local

def test_cluster(ppsmoke_cluster):
    pass
"""


def test_a_failed_converge_then_failing_destroys_name_converge_in_the_junit_message(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, synth_model: str
) -> None:
    """The first cause stays the cause in the JUnit XML: the test fails with converge's message, not
    with the teardown's failed destroys that came after it."""
    pytester.makepyfile(CLUSTER)
    tag = f"plugin-{os.getpid()}-converge"
    monkeypatch.setenv(TEST_TAG, tag)
    monkeypatch.setenv("PP_FAILPOINTS", "vast.no_join=1;vast.destroy_fails=0:9,1:9")
    report, junit = pytester.path / "r.json", pytester.path / "out.xml"
    pytester.runpytest_subprocess(
        "-m", "local", "-p", "no:cacheprovider", "--ppsmoke-model", synth_model, "--ppsmoke-converge-timeout", "8",
        "--ppsmoke-replace-hosts", "off", "--ppsmoke-report", str(report), f"--junitxml={junit}",
    )  # fmt: skip
    figures = json.loads(report.read_text())
    assert figures["failed_phase"] == "converge" and figures["teardown_error"], figures["error"]
    case = ET.parse(junit).getroot().find(".//testcase[@name='test_cluster']")
    assert case is not None
    said = [e.get("message", "") for e in case if e.tag in ("error", "failure")]
    assert said and "the local deployment failed at converge: 2 of 3 members alive" in said[0], said
    assert "NOT destroyed" not in said[0]

"""``pp-smoke-run --local`` as users run it: a subprocess, its exit status, its report."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from .helpers import CLI, SYNTH, SYNTH_SEED, TEST_TAG, alive, descendants, node_processes, run_cli, without_key

pytestmark = pytest.mark.local


TAG = f"cli-{os.getpid()}"


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env=without_key() | {TEST_TAG: TAG}, timeout=timeout)


def test_local_run_says_hello_reports_everything_and_leaves_nothing(tmp_path: Path, synth_model: str) -> None:
    report_path = tmp_path / "r.json"
    # with the reference left out (its step: tests/test_driver.py and the spec suite), which this
    # run also shows: no step, the report says so, and the run passes
    args = ["--model", synth_model, "--max-tokens", "16", "--reference", "off", "--report", str(report_path)]
    out = run("--local", "-v", "--weight-cache", str(tmp_path / "weights"), *args)
    assert out.returncode == 0, out.stderr[-3000:]
    for phase in ("preflight", "rent", "boot", "converge", "load", "resolve", "prefill", "decode", "teardown"):
        assert f"] {phase}" in out.stdout
        assert f"] start {phase}\n" in out.stderr  # without a terminal: a line as each phase starts
    report = json.loads(report_path.read_text())
    assert report["ok"] is True and report["exit_code"] == 0 and report["error"] is None
    assert report["reference"]["state"] == "off" and report["reference"]["token_ids"] == []
    assert "reference" not in report["timings"] and "reference" not in out.stdout
    assert report["text"].strip() and report["text"] in out.stdout
    assert out.stdout.index(report["text"]) < out.stdout.index("] teardown")  # the answer as soon as it came
    assert 1 <= len(report["token_ids"]) <= 16 and len(report["prompt_token_ids"]) > 5
    ids = [i["id"] for i in report["instances"]]
    half = SYNTH.blocks // 2
    assert [{k: v for k, v in st.items() if k != "load"} for st in report["split"]] == [
        {"stage": 0, "blocks": [0, half], "instance": ids[0]},
        {"stage": 1, "blocks": [half, SYNTH.blocks], "instance": ids[1]},
    ]
    for st in report["split"]:  # each worker said where its weights came from and what it generated
        note = r" \(HALF=0\)" if os.environ.get("HALF") == "0" else ""  # the suite's HALF=0 (conftest.py) keeps f16
        load = rf"weights from the GGUF in [\d.]+ s, f16{note}; programs: \d+ cached, \d+ generated, \d+ compiled"
        assert re.fullmatch(load, st["load"]), st
    assert len(list((tmp_path / "weights").glob("*.weights"))) == 2  # --weight-cache reached both workers
    assert set(report["timings"]) >= {
        "preflight", "rent", "boot", "converge", "load", "resolve", "prefill", "decode", "teardown", "total",
        "decode_tokens_per_s",
    }  # fmt: skip
    # the embedded emulator's account and offers were checked; its image is not asked (not on loopback)
    found = report["preflight"]
    assert found["credit_usd"] == 100.0 and found["offers"] >= 2 and found["image"] is None
    assert found["image_checked"] == "local mode asks only a registry on this machine, not ghcr.io"
    assert 0 < found["worst_case_usd"] < 1 and found["model_blocks"] == SYNTH.blocks
    hop = report["hops"]["pp-stage-0->pp-stage-1"]
    assert hop["prefill"]["bytes_each"] == [len(report["prompt_token_ids"]) * SYNTH.dim * 2]  # bf16
    assert hop["decode"]["bytes_each"] == [SYNTH.dim * 2]
    filled = len(report["prompt_token_ids"]) + len(report["token_ids"]) - 1
    assert [k["filled"] for k in report["kv"]] == [
        [{"blocks": [[0, half]], "positions": [[0, filled]]}],
        [{"blocks": [[half, SYNTH.blocks]], "positions": [[0, filled]]}],
    ]
    assert [(k["cached"], k["prefill_digest_changed"], k["writes"]) for k in report["kv"]] == [
        ([[0, half]], [], [[0, filled]]), ([[half, SYNTH.blocks]], [], [[0, filled]])
    ]  # fmt: skip
    assert report["frames"]["orchestrator"]["decode"]["received"] == {"InferenceResponse": 1}
    assert report["frames"]["stages"]["pp-stage-0"]["received"]["NextToken"] == len(report["token_ids"])
    # each stage's own word on how it reaches its peers, as the orchestrator's own links are told
    told = report["paths"]["stages"]
    assert {"pp-stage-0->orchestrator", "pp-stage-0->pp-stage-1", "pp-stage-1->orchestrator"} <= set(told), told
    for link in told.values():
        assert set(link) == {"path", "remote_addr", "rtt_ms", "dialled_by", "selected"}, link
        assert link["path"] in ("direct", "relay") and isinstance(link["selected"], bool), link
    # the two cheapest offers that match, each destroyed, and the cost from dph_total x time (each
    # priced for the storage the search allocates: above its dph_base)
    # (the cheaper Blackwell cards, and hosts downloading at 50-80 Mbit/s, are skipped by the query)
    assert [i["offer"]["gpu_name"] for i in report["instances"]] == ["RTX 3090", "RTX 4090"]
    assert [round(i["dph_total"], 4) for i in report["instances"]] == [0.3822, 0.4233]  # + 20 GB of storage
    assert all(i["final_state"] == "destroyed" and i["label"].startswith("ppsmoke-") for i in report["instances"])
    expected = sum(i["dph_total"] * i["seconds"] / 3600 for i in report["instances"])
    assert report["cost_usd"] == pytest.approx(expected, abs=1e-6) and report["cost_usd"] > 0
    assert all(0 < i["seconds"] <= report["timings"]["total"] for i in report["instances"])
    assert report["emulator"] == {"live_instances": [], "destroyed_instances": ids, "host_losses": []}
    assert node_processes(TAG) == []
    # no secret anywhere: every 64-hex string printed or reported is a public endpoint id
    public = {i["endpoint_id"] for i in report["instances"]}
    seen = set(re.findall(r"[0-9a-f]{64}", out.stdout + out.stderr + report_path.read_text()))
    assert seen <= public
    assert "member" in out.stderr  # -v really logged membership events, so the check saw them


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--local", "--num-stages", "1"], "--num-stages must be an integer of at least 2, got '1'"),
        (
            ["--local", "--wire-dtype", "f8"],
            "--wire-dtype names an unknown wire dtype 'f8'; expected one of bf16, f16, f32",
        ),
        (["--local", "--budget", "0"], "--budget must be a positive number, got '0'"),
        (["--local", "--max-tokens", "0"], "--max-tokens must be an integer of at least 1, got '0'"),
        (["--local", "--load-timeout", "-1"], "--load-timeout must be a positive number, got '-1'"),
        (["--local", "--model", "gpt5:1t"], "unknown model 'gpt5:1t'; expected one of smollm2:135m"),
        (["--local", "--min-reliability", "2"], "--min-reliability must be a number between 0 and 1, got '2'"),
        ([], "one of the arguments --local --vastai --reap --check is required"),
        # a bad flag or value is named before a missing mode
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["--max-tokens", "abc"], "--max-tokens must be an integer of at least 1, got 'abc'"),
        (["--local", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["--vastai"], "a vast.ai API key is needed: set VAST_API_KEY or pass --api-key"),
        (["--reap"], "a vast.ai API key is needed"),
        (
            ["--vastai", "--api-key", "k", "--model", "/tmp/m.gguf"],
            "--vastai needs a model name the instances can fetch",
        ),
        (["--local", "--vastai"], "argument --vastai: not allowed with argument --local"),
    ],
)
def test_bad_arguments_say_what_was_expected(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One line that says what was wrong and a pointer to --help: no usage block first. The
    command's own entry point, in this process with the environment ``run`` gives the command
    (no vast.ai key): each refusal is made before anything else; that the command itself says
    no more than these two lines is the next test's."""
    from pytest_ppsmoke.harness import cli

    monkeypatch.delenv("VAST_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exited:
        cli.main(args)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert message in lines[0], err
    assert len(lines) == 2 and "usage:" not in err, err
    assert lines[-1] == "pp-smoke-run --help lists the options"


def test_the_command_says_a_bad_argument_in_those_two_lines_and_nothing_else() -> None:
    """``pp-smoke-run`` itself, a process: the same two lines on its stderr and nothing before
    them (no warning of an import, no log line), exit status 2, nothing on its stdout."""
    out = run("--local", "--num-stages", "1", timeout=60)
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert out.stderr.splitlines() == [
        "pp-smoke-run: error: --num-stages must be an integer of at least 2, got '1'",
        "pp-smoke-run --help lists the options",
    ], out.stderr


def test_version_prints_the_packages_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    from pytest_ppsmoke.harness import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"pp-smoke-run {version('pytest-ppsmoke')}\n"


def test_the_usage_line_names_every_mode(capsys: pytest.CaptureFixture[str]) -> None:
    """Every flag of the mode group (whichever the parser declares) is in the usage line that
    ``--help`` starts with."""
    from pytest_ppsmoke.harness import cli

    p = cli.parser()
    [group] = p._mutually_exclusive_groups
    modes = [a.option_strings[0] for a in group._group_actions]
    assert len(modes) == 4, modes
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    usage = capsys.readouterr().out.splitlines()[0]
    assert usage.startswith("usage: pp-smoke-run (")
    assert all(re.search(rf"[(| ]{m}[ |)]", usage) for m in modes), usage


def test_help_fits_a_screen_and_says_where_every_option_is(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--help`` at 80 columns is at most 40 lines: the modes, the common options, and where the
    rest is; ``--help-all`` has every flag of the settings table."""
    from pytest_ppsmoke.harness import cli
    from pytest_ppsmoke.harness.settings import OPTIONS

    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    short = capsys.readouterr().out
    assert exited.value.code == 0 and len(short.splitlines()) <= 40, short
    assert all(m in short for m in cli.MODES)
    assert short.rstrip().endswith("every option: pp-smoke-run --help-all, or the options table of docs/run.md")
    with pytest.raises(SystemExit):
        cli.main(["--help-all"])
    full = capsys.readouterr().out.split()
    assert all(o.cli in full for o in OPTIONS if o.cli), [o.cli for o in OPTIONS if o.cli not in full]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "pp-layout: error: the following arguments are required: command"),
        (["grid"], "pp-layout grid: error: the following arguments are required: --out"),
        (["grid", "--out", "x", "--stages", "0"], "argument --stages: expected positive integers, got '0'"),
        (["grid", "--out", "x", "--wires", "f8"], "'f8' names an unknown wire dtype 'f8'; expected one of bf16"),
        (["predict", "layout.json", "--network", "wan", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_pp_layouts_bad_arguments_are_one_line_and_a_pointer_to_help(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from pytest_ppsmoke.layout.cli import main

    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage:" not in err and len(err.splitlines()) <= 3, err
    assert err.splitlines()[-1].endswith("--help lists the options")


def test_the_help_is_grouped_by_task_and_shows_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pp-smoke-run --help``: every option in its task's group (none in a catch-all), its
    choices or a value as its metavar (never its name in capitals), the variable it reads, and
    the description without RST backticks."""
    from pytest_ppsmoke.harness import cli
    from pytest_ppsmoke.harness.settings import GROUPS, OPTIONS

    monkeypatch.setenv("COLUMNS", "10000")
    p = cli.parser()
    text = p.format_help()
    assert "``" not in text and "`" not in text
    titles = {g.title: g for g in p._action_groups}
    for opt in OPTIONS:
        if opt.cli is None:
            continue
        [action] = [a for a in p._actions if a.dest == opt.name]
        assert action in titles[GROUPS[opt.group]]._group_actions, opt.name
        assert action.metavar == opt.metavar and opt.metavar not in (opt.name.upper(), ""), opt.name
        if opt.env:
            assert f"env {opt.env}" in (action.help or ""), opt.name
    catch_all = [a.option_strings[0] for a in titles["options"]._group_actions]
    assert catch_all == ["-h", "--help-all", "--version", "-v"]
    words = set(text.split())
    assert {"--wire-dtype", "{bf16,f16,f32}", "--max-tokens", "N", "--budget", "SECONDS", "--vast-url", "URL"} <= words
    assert "WIRE_DTYPE" not in text and "MAX_TOKENS" not in text


def _start(tmp_path: Path, model: str) -> tuple[subprocess.Popen[str], Path]:
    report = tmp_path / "r.json"
    proc = subprocess.Popen(
        [*CLI, "--local", "--model", model, "--report", str(report)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:  # the nodes have joined; their workers are loading the model
        if "] converge" in line:
            return proc, report
    pytest.fail(f"no converge line; stderr:\n{proc.stderr.read() if proc.stderr else ''}")


def _spawned(pid: int, want: int = 4, seconds: float = 30) -> set[int]:
    """The nodes and their workers, once all of them exist (a node starts its worker after joining)."""
    deadline = time.monotonic() + seconds
    while len(found := descendants(pid)) < want and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def _wait_gone(pids: set[int], seconds: float) -> set[int]:
    deadline = time.monotonic() + seconds
    while (left := {p for p in pids if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_nodes_exit_when_the_orchestrator_is_killed_outright(tmp_path: Path, synth_model: str) -> None:
    proc, _ = _start(tmp_path, synth_model)
    spawned = _spawned(proc.pid)
    assert len(spawned) >= 4
    proc.kill()  # no teardown at all; the embedded emulator dies too, and its nodes see stdin EOF
    proc.wait()
    assert not _wait_gone(spawned, 30)


def test_eight_stages_run_within_vast_ais_rate_limits_and_none_answers_429(tmp_path: Path) -> None:
    """Every documented rate limit is on in the embedded emulator (by default, at the suite's time
    scale), and the client paces every endpoint by the same table: 8 stages rented, booted
    (watched with one list a round), run and destroyed in parallel without a single 429."""
    from pytest_ppsmoke.stage.synth import write

    model = tmp_path / "synth-8.gguf"
    write(model, dataclasses.replace(SYNTH, blocks=8), SYNTH_SEED)
    report_path = tmp_path / "r.json"
    args = ["--num-stages", "8", "--model", str(model), "--max-tokens", "4", "--reference", "off"]
    out = run("--local", *args, "--report", str(report_path))
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["ok"] is True and len(report["instances"]) == 8
    api = report["vast_api"]
    assert api["rate_limited"] == 0, api
    # the eight destroyed in one call (one by one, vast.ai's destroy limit would space them 3 s apart)
    assert api["endpoints"]["create"]["calls"] == 8 and api["endpoints"]["destroy_many"]["calls"] == 1, api
    assert "destroy" not in api["endpoints"], api

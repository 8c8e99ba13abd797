"""What this machine can run (``pp-smoke-run --check``), and a run that needs a tool this machine
lacks refused before anything starts, in one line that says what to install: by the command line
(status 2, as for a bad argument) and by the plugin (the session's first test fails with it). The
tool is made unfindable by a PATH without it. And a pre-flight that gets no answer from vast.ai
names the fixes on this machine: its network, its proxy, ``--vast-url``."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_ppsmoke.harness import check
from pytest_ppsmoke.protocol import Names

from .helpers import run_cli

pytestmark = pytest.mark.local

ROOT = Path(__file__).resolve().parent.parent


def _without(tools: tuple[str, ...], tmp_path: Path) -> dict[str, str]:
    """This environment with a PATH of a folder that has every command of PATH's but ``tools``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for folder in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            link = bin_dir / name
            if name not in tools and not os.path.lexists(link):
                link.symlink_to(Path(folder) / name)
    return {**os.environ, "PATH": str(bin_dir), "PYTHONPATH": str(ROOT)}


def test_check_says_for_each_mode_ok_or_what_to_install(tmp_path: Path) -> None:
    env = _without(("iptables-restore", "buildah"), tmp_path)
    env.pop("VAST_API_KEY", None)
    env["VAST_URL"] = "http://127.0.0.1:1"  # a report of this machine: no key asked for
    out = run_cli("--check", env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == len(check.NEEDS) and not out.stderr, out.stdout + out.stderr
    assert all(line.endswith(": ok") or ": missing: " in line for line in lines), lines
    by_mode = {line.split(":", 1)[0]: line for line in lines}
    assert by_mode["--network internet, internet-far (NATs)"].endswith("missing: apt-get install -y iptables")
    image = by_mode["--runtime image (run and build the node image)"]
    assert "missing: apt-get install -y buildah" in image, image
    assert by_mode["the main job (--local"] == check.report()[0]  # clang: as this machine has it or not


@pytest.mark.parametrize(
    ("args", "tool", "line"),
    [
        (
            ["--network", "internet"],
            "iptables-restore",
            "--network internet needs iptables-restore, which this machine lacks: apt-get install -y iptables",
        ),
        (
            ["--runtime", "image"],
            "buildah",
            "--runtime image needs buildah, which this machine lacks: apt-get install -y buildah",
        ),
    ],
)
def test_a_run_that_needs_a_missing_tool_is_refused_in_one_line_that_names_it(
    tmp_path: Path, args: list[str], tool: str, line: str
) -> None:
    out = run_cli("--local", *args, env=_without((tool,), tmp_path), timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [f"pp-smoke-run: error: {line}"], out.stderr  # one line, naming the tool
    assert not out.stdout  # no phase started


def test_the_plugin_fails_the_sessions_first_test_with_the_same_line(tmp_path: Path) -> None:
    env = _without(("iptables-restore",), tmp_path)
    run_in = tmp_path / "run"
    run_in.mkdir()
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:xdist"]
    cmd += ["--pyargs", "pytest_ppsmoke.spec", "-m", "local", "--ppsmoke-network", "internet", "-q", "-rfE"]
    done = subprocess.run(cmd, cwd=run_in, env=env, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    want = "failed at preflight: --ppsmoke-network internet needs iptables-restore, which this machine lacks: "
    first = next(x for x in out.splitlines() if "failed at preflight" in x)
    assert want + "apt-get install -y iptables" in first, first
    assert "Traceback" not in out and "Error:" not in out, out[-3000:]
    pointer = "the deployment failed at preflight; the error is shown at"
    pointers = [x for x in out.splitlines() if x.startswith(pointer)]
    assert len(pointers) == 6 and all("test_spec.py::test_cluster_converges" in x for x in pointers), out[-3000:]


def test_a_run_on_an_emulator_started_apart_or_on_vastai_asks_nothing_of_this_machine() -> None:
    from pytest_ppsmoke.harness.settings import read

    apart = read(
        {"mode": "local", "network": "internet", "vast_url": "http://127.0.0.1:1", "api_key": "k"}, env={}, face="cli"
    )
    vast = read({"mode": "vastai", "runtime": "image", "api_key": "k"}, env={}, face="cli")
    names = Names()
    assert check.refusal(apart, names) is None and check.refusal(vast, names) is None


def test_a_preflight_that_gets_no_answer_from_vastai_names_the_fixes() -> None:
    with socket.socket() as s:  # a port on loopback that nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    out = run_cli("--vastai", "--api-key", "vk-test", "--vast-url", url, timeout=120)
    assert out.returncode == 1, out.stderr
    [line] = [x for x in out.stderr.splitlines() if "failed at preflight" in x]
    assert line.startswith(f"pp-smoke-run: failed at preflight: cannot reach vast.ai at {url} ("), line
    assert "check this machine's network and its proxy (HTTPS_PROXY), or point --vast-url at the API" in line
    assert "0 of 0 instance(s) destroyed" in out.stderr


GIB = 2**30


def test_a_local_run_this_machine_cannot_hold_is_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """30 stages on 2 cores and 24 GiB (the machine injected): one line, exit 2, naming what the
    nodes need (from check.py's measured figures) and what the machine has; no run is made."""
    from pytest_ppsmoke.harness import cli

    monkeypatch.setattr(check.Machine, "here", classmethod(lambda cls: cls(2, 24 * GIB)))
    monkeypatch.setattr(cli, "SmokeRun", lambda *a, **k: pytest.fail("a run was made"))
    with pytest.raises(SystemExit) as exited:
        cli.main(["--local", "--num-stages", "30"])
    assert exited.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    cores = 30 * check.CORES_PER_NODE
    assert line.startswith("pp-smoke-run: error: 30 local nodes need "), line
    assert re.search(
        rf"need [\d.]+ GiB of memory and {cores:g} cores; this machine has 24.0 GiB available and 2 ", line
    )
    assert line.endswith("lower --num-stages to at most 8, or rent the stages on vast.ai"), line


@pytest.mark.parametrize("stages", [2, 3, 4, 8])  # every stage count the suite runs (tests/, NUM_STAGES)
@pytest.mark.parametrize("model", ["smollm2:135m", "synth"])
def test_runs_that_fit_are_not_refused(stages: int, model: str, tmp_path: Path) -> None:
    from pytest_ppsmoke.harness.settings import read
    from pytest_ppsmoke.stage.synth import write

    from .helpers import SYNTH, SYNTH_SEED

    if model == "synth":
        model = str(tmp_path / "synth.gguf")
        write(Path(model), SYNTH, SYNTH_SEED)
    s = read({"mode": "local", "num_stages": stages, "model": model}, env={}, face="cli")
    assert check.refusal(s, Names(), check.Machine(2, 24 * GIB)) is None


def test_the_memory_the_nodes_need_is_checked_too() -> None:
    """Many cores, little memory: refused for memory, with the most stages that fit."""
    from pytest_ppsmoke.harness.settings import face_names, read

    s = read({"mode": "local", "num_stages": 8}, env={}, face="cli")
    line = check.refusal(s, face_names("pytest"), check.Machine(64, 4 * GIB))
    assert line is not None, "8 stages in 4 GiB"
    want = r"8 local nodes need [\d.]+ GiB of memory and 2 cores; this machine has 4.0 GiB available and 64 core\(s\): "
    assert re.fullmatch(want + r"lower --ppsmoke-stages to at most [2-7], or rent the stages on vast.ai", line), line
    assert check.refusal(s, face_names("pytest"), check.Machine(64, 64 * GIB)) is None

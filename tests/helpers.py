"""What several test modules share: the two models the suite runs, the command line runner, the
stand-in process, cluster configs, and the scans of /proc that show what a test left behind."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

from pytest_ppsmoke.cloud.vast import strip_strings
from pytest_ppsmoke.runtime.node import NodeConfig
from pytest_ppsmoke.runtime.swimconfig import SwimConfig
from pytest_ppsmoke.stage.synth import Shape

# --- models ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    name: str  # what --model, MODEL and --ppsmoke-model take (a name or a GGUF path)
    blocks: int
    dim: int
    vocab: int


# Tests of tokens or text: the real model (facts.md: SmolLM2-135M-Instruct, Q4_1).
SMOLLM2 = ModelShape("smollm2:135m", blocks=30, dim=576, vocab=49152)

# Tests of orchestration (lifecycle, signals, error rows, the plugin): a random-weight llama from
# pp-synth-gguf, made once per session by the ``synth_model`` fixture. The smallest shape that
# still splits into two stages of one block each; with this seed its greedy reply to the suite's
# prompts never samples the end token within 64 tokens (f32 and bf16 wires), so decode lasts
# long enough to be interrupted, and a tokens-per-stage split is never cut short.
SYNTH = Shape(blocks=2, dim=32, heads=2, kv_heads=1, ffn=64, vocab=320, context=1024)
SYNTH_SEED = 0


# --- processes -------------------------------------------------------------------------------

# every pytester project's ini starts with this (tests/conftest.py writes it; a test's own makeini
# starts from it): pytest-asyncio, one of the dev tools, warns in every session that leaves it
# unset; hypothesis, the dev tool of this suite's own property tests, is not loaded: its plugin
# costs every inner session a second (1.8 s against 0.8 s here), and about 90 of them run; nor is
# pytest-randomly, as in the suite's own addopts (it imports numpy and looks for four test-data
# libraries: 0.85 s against 0.5 s a session), unless a test asks for it with ``-p randomly``
PYTESTER_INI = (
    "[pytest]\nasyncio_default_fixture_loop_scope = function\naddopts = -p no:hypothesispytest -p no:randomly\n"
)
TEST_TAG = "PPSMOKE_TEST_TAG"  # not PP_*: the emulator passes everything else through to its nodes

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]  # an instance that is not a node


# ``data`` with every string stripped, as vast-cli strips an instance's record (the emulator pads
# them, as vast.ai does): the client's own
stripped = strip_strings


CLI = [sys.executable, "-m", "pytest_ppsmoke.harness.cli"]  # pp-smoke-run, in this Python


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``pp-smoke-run *args`` to its end, output captured."""
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


def tagged_processes(prefix: str) -> dict[int, str]:
    """Live processes (zombies excluded: already dead) whose ``TEST_TAG`` starts with ``prefix``,
    with that tag: the nodes and workers a test started, and nothing another run here started."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z":
            continue
        for var in env:
            name, _, value = var.decode(errors="replace").partition("=")
            if name == TEST_TAG and value.startswith(prefix):
                found[int(d.name)] = value
    return found


def node_processes(tag: str) -> list[int]:
    """Live processes whose environment carries exactly ``TEST_TAG=tag``, less an emulated
    network's switch (the emulator's own, which lives as long as the emulator, not a node)."""
    return sorted(pid for pid, t in tagged_processes(tag).items() if t == tag and not _is_switch(pid))


def _is_switch(pid: int) -> bool:
    try:
        return b"pytest_ppsmoke.network.switch" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def process_state(pid: int) -> str:
    """The state letter of ``/proc/<pid>/stat`` (``Z``: a zombie), or ``gone``."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return "gone"


def alive(pid: int) -> bool:
    return process_state(pid) not in ("gone", "Z")  # a zombie still answers kill(0)


def descendants(pid: int) -> set[int]:
    """Every descendant of ``pid`` (nodes and their workers)."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - found
        found |= frontier
    return found


def without_key(env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment (or ``env``) without a vast.ai key."""
    return {k: v for k, v in (os.environ if env is None else env).items() if k != "VAST_API_KEY"}


# --- clusters in this process ------------------------------------------------------------------


def cluster_configs(n: int, swim: SwimConfig | None = None) -> list[NodeConfig]:
    """n configs that allow each other; the first is the seed (set ``seed`` on the rest)."""
    configs = [NodeConfig.generate(swim=swim or SwimConfig.loopback()) for _ in range(n)]
    allowed = frozenset(c.id for c in configs)
    for c in configs:
        c.allowed = allowed
    return configs


BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_bench(name: str) -> types.ModuleType:
    """``bench/<name>.py``, imported by its path (bench/ is no package): a test of a benchmark's
    own logic runs the very module the benchmark runs."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module

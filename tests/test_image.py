"""The node image, checked as far as this machine allows (no Docker engine here): the Dockerfile's
rules, then its install steps replayed in a clean virtual environment whose ``pp-gpu-node``
entrypoint serves a real run through the emulator (the session's synthetic model: quick)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from pytest_ppsmoke.cloud.fake_vast import FakeVast

pytestmark = pytest.mark.local

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_the_dockerfile_follows_its_rules() -> None:
    ins = instructions()
    words = [w for w, _ in ins]
    assert set(words) <= {"ARG", "FROM", "ENV", "RUN", "COPY", "USER", "WORKDIR", "ENTRYPOINT"}, words
    args = dict(a.partition("=")[::2] for w, a in ins if w == "ARG")
    assert "nvidia/cuda" in args["BASE"] and "runtime" in args["BASE"]  # nvrtc, for tinygrad's CUDA
    assert ("FROM", "${BASE}") in ins and "BAKE_MODEL" in args
    assert ins[-1] == ("ENTRYPOINT", '["pp-gpu-node"]')  # exec form: signals reach the node
    assert [a for w, a in ins if w == "USER"] == ["node"]
    env = " ".join(a for w, a in ins if w == "ENV")
    assert "CUDA=1" in env
    # no secrets: nothing named like one is set or passed at build time
    for w, a in ins:
        if w in ("ENV", "ARG"):
            assert not re.search(r"KEY|SECRET|TOKEN|PASSWORD", a.split("=")[0], re.I), a
    # every file copied exists, and .dockerignore lets it into the build context
    ignore = (ROOT / ".dockerignore").read_text().split()
    for w, a in ins:
        if w == "COPY":
            *sources, _ = a.split()
            for src in sources:
                assert (ROOT / src).exists(), src
                assert f"!{src}" in ignore or f"!{src}/" in ignore, f"{src} is excluded from the build context"
    runs = " ".join(a for w, a in ins if w == "RUN")
    assert "pip install /src" in runs and "rm -rf /var/lib/apt/lists/*" in runs


def site_dirs() -> list[str]:
    """Where this interpreter finds its packages: a virtual environment's own site-packages (and
    the system's, if it was made with them), or the system's."""
    dirs = [*site.getsitepackages(), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return list(dict.fromkeys(d for d in dirs if Path(d).is_dir()))


@pytest.fixture
def installed(tmp_path: Path, repo_wheel: Path) -> Path:
    """The Dockerfile's steps: a virtual environment, then ``pip install`` of the source tree (not
    editable; its wheel, which pip builds first anyway, is built once per session). The
    dependencies come from this interpreter's environment instead of the network, whether that
    is the system's or a virtual environment's: a ``.pth`` file puts its site-packages after the
    new environment's own (``--system-site-packages`` would give the base interpreter's, which
    lack them when this one is a venv). Returns the new environment's ``pp-gpu-node``."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    where = [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
    purelib = Path(subprocess.run(where, capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    (purelib / "_this_environment.pth").write_text("".join(f"{d}\n" for d in site_dirs()))
    # this interpreter's pip installs into the new environment (which has none), offline
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index"]
    pip = subprocess.run([*install, str(repo_wheel)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-2000:]
    probe = "import pytest_ppsmoke.stage.gpu_node as g; print(g.__file__); print(g.default_worker_path())"
    where = subprocess.run(  # not from the checkout: python -c puts the working directory first on the path
        [str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    package, worker = where.stdout.split()
    assert package.startswith(str(venv)) and worker.startswith(str(venv))  # the installed copy and its worker
    assert Path(worker).is_file()
    entrypoint = venv / "bin" / "pp-gpu-node"
    assert entrypoint.is_file()
    return entrypoint


async def test_the_images_install_steps_give_a_working_entrypoint(
    installed: Path, tmp_path: Path, synth_model: str
) -> None:
    entrypoint = installed
    async with FakeVast(node_argv=[str(entrypoint)]) as fake:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pytest_ppsmoke.harness.cli", "--local", "--vast-url", fake.url,
            "--model", synth_model,
            "--max-tokens", "6", "--report", str(tmp_path / "r.json"),
            env={**os.environ, "VAST_API_KEY": fake.api_key},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 240)
        assert proc.returncode == 0, err.decode()[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ok"] and 1 <= len(report["token_ids"]) <= 6
    assert [i["final_state"] for i in report["instances"]] == ["destroyed", "destroyed"]
    assert [i.proc.argv for i in fake.destroyed if i.proc] == [[str(entrypoint)]] * 2

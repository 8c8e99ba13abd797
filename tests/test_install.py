"""What a wheel install gets, and the plugin's commands with the main install only. The wheel (the
session's ``repo_wheel``, built once in each xdist worker that asks for it: both its users are
here) carries every module of the package, the worker, the shipped spec tests, the typing marker
and the entry points (a wheel has no repository around it to find the worker in). Installed with
no pytest-xdist, pytest-asyncio or hypothesis, the commands run from the checkout (whose
conftest.py and pyproject.toml pytest then loads) and from another folder.

The virtualenv here has the wheel and the runtime dependencies it declares, linked from this
interpreter's own site-packages (nothing downloaded), and nothing else: the dev tools installed
here are not in it. ``bench/main_install.sh`` does the same with the README's own install, from
the package index, and runs the whole spec."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import zipfile
from email.parser import HeaderParser
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.local

ROOT = Path(__file__).resolve().parent.parent
DEV_TOOLS = ("xdist", "pytest_asyncio", "hypothesis")


def _requirements(wheel: Path) -> list[Requirement]:
    """The wheel's runtime requirements (its ``Requires-Dist`` without an extra)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        headers = HeaderParser().parsestr(z.read(meta).decode())
    return [r for r in map(Requirement, headers.get_all("Requires-Dist") or []) if _applies(r)]


def _applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate({"extra": ""})


def _closure(requirements: list[Requirement]) -> dict[str, metadata.Distribution]:
    """Every distribution installed here that ``requirements`` need, theirs included."""
    found: dict[str, metadata.Distribution] = {}
    todo = list(requirements)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in found:
            continue
        dist = metadata.distribution(req.name)
        assert dist.version in req.specifier or not req.specifier, f"{req} but {dist.version} is installed"
        found[name] = dist
        todo += [r for r in map(Requirement, dist.requires or []) if _applies(r)]
    return found


def _link_tops(dist: metadata.Distribution, into: Path) -> None:
    """Links each top-level entry of ``dist`` (its packages, modules, libraries, dist-info) into ``into``."""
    files = dist.files
    assert files is not None, f"{dist.metadata['Name']} has no RECORD: its files are unknown"
    base = Path(str(dist.locate_file("")))
    for top in {f.parts[0] for f in files if f.parts[0] not in ("..", "__pycache__")}:
        link = into / top
        if not link.exists() and (base / top).exists():
            link.symlink_to(base / top)


def test_the_wheel_carries_the_worker_the_spec_tests_and_the_entry_points(repo_wheel: Path) -> None:
    with zipfile.ZipFile(repo_wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    for path in (
        "pytest_ppsmoke/worker/pp_tinygrad_worker.py",
        "pytest_ppsmoke/spec/test_spec.py",
        "pytest_ppsmoke/py.typed",
        "pytest_ppsmoke/plugin.py",
    ):
        assert path in names, path
    source = ROOT / "pytest_ppsmoke"
    modules = {p.relative_to(source.parent).as_posix() for p in source.rglob("*.py") if "__pycache__" not in p.parts}
    assert modules <= names, f"modules the wheel leaves out: {sorted(modules - names)}"  # a package not listed
    # vast.ai's API description, which the emulator holds every call against (apidoc.py), and its allow-list
    described = {p.relative_to(source.parent).as_posix() for p in (source / "cloud" / "emulator" / "openapi").iterdir()}
    assert len(described) == 10 and described <= names, sorted(described - names)
    for line in (
        "pp-smoke-run = pytest_ppsmoke.harness.cli:main",
        "pp-gpu-node = pytest_ppsmoke.stage.gpu_node:main",
        "pp-fake-vast = pytest_ppsmoke.cloud.emulator.server:main",
        "ppsmoke = pytest_ppsmoke.plugin",
    ):
        assert line in entry_points, line


@pytest.fixture(scope="module")
def main_install(repo_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv's python with the wheel and its runtime dependencies only."""
    work = tmp_path_factory.mktemp("main-install")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    deps = work / "deps"
    deps.mkdir()
    for dist in _closure(_requirements(repo_wheel)).values():
        _link_tops(dist, deps)
    [site] = (venv / "lib").glob("python3.*/site-packages")
    (site / "runtime-deps.pth").write_text(f"{deps}\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index"]
    done = subprocess.run([*pip, str(repo_wheel)], capture_output=True, text=True, timeout=300, env=_env())
    assert done.returncode == 0, done.stderr[-2000:]
    return python


def _env() -> dict[str, str]:
    """This environment without what would reach past the virtualenv (PYTHONPATH) or change a
    session (pytest's and xdist's variables)."""
    drop = ("PYTHONPATH", "PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_TESTRUNUID")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PYTEST_XDIST")}


def _pytest(python: Path, cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [str(python), "-m", "pytest", "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_env())


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_virtualenv_has_the_package_and_none_of_the_dev_tools(main_install: Path) -> None:
    probe = (
        "import importlib.metadata as m, importlib.util as u; "
        f"print([n for n in {DEV_TOOLS!r} if u.find_spec(n)], m.version('pytest-ppsmoke'))"
    )
    done = subprocess.run([str(main_install), "-c", probe], capture_output=True, text=True, timeout=60, env=_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", metadata.version("pytest-ppsmoke")]


@pytest.mark.parametrize("where", ["the checkout", "another folder"])
def test_the_spec_collects_with_the_main_install(main_install: Path, tmp_path: Path, where: str) -> None:
    cwd = ROOT if where == "the checkout" else tmp_path
    done = _pytest(main_install, cwd, "--pyargs", "pytest_ppsmoke.spec", "-m", "local", "--collect-only", "-q")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "test_spec.py::test_tokens_equal_the_unsplit_reference" in out and "error" not in out.lower(), out[-3000:]
    assert "warning" not in out.lower(), out[-3000:]  # no unknown ini key of a dev tool, no plugin's complaint


@pytest.mark.parametrize("where", ["the checkout", "another folder"])
def test_the_spec_on_vastai_without_an_answer_ends_at_the_preflight_in_one_line(
    main_install: Path, tmp_path: Path, where: str
) -> None:
    """From the checkout too: the suite's own settings (local, conftest.py) are not the user's."""
    url = f"http://127.0.0.1:{_closed_port()}"
    args = ("--vastai-key=vk-test", "--vast-url", url, "--pyargs", "pytest_ppsmoke.spec", "-m", "vastai", "-q")
    done = _pytest(main_install, ROOT if where == "the checkout" else tmp_path, *args)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    said = [x for x in out.splitlines() if "failed at preflight:" in x]  # its error, and -r's summary of it
    assert said and all("cannot reach" in x and "HTTPS_PROXY" in x for x in said), said
    assert "--vast-url" in said[0], said
    assert "Traceback" not in out and "INTERNALERROR" not in out, out[-3000:]


def test_the_suite_without_the_dev_install_names_the_install(main_install: Path) -> None:
    done = _pytest(main_install, ROOT, "-m", "local", "--collect-only", "-q", "tests/test_install.py")
    out = done.stdout + done.stderr
    assert done.returncode == 4, out[-3000:]
    assert "the project's suite needs the dev install" in out and "'.[dev]'" in out, out[-3000:]

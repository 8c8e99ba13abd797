"""What a wheel install gets: every module of the package, the worker, the shipped spec tests, the
typing marker, and the entry points (a wheel has no repository around it to find the worker in)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.local


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
    source = Path(__file__).resolve().parent.parent / "pytest_ppsmoke"
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

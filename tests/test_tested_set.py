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

"""The run's phases are one table, ``protocol.Phase``: every ``PhaseError`` names a member (no
string), docs/lifecycle.md's table of phases lists the members in order, and each member's
step and instance step are ones the driver and the rental know."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import pytest_ppsmoke
from pytest_ppsmoke.cloud.rental import STEPS as INSTANCE_STEPS
from pytest_ppsmoke.harness.settings import STEPS
from pytest_ppsmoke.protocol import Phase, PhaseError

pytestmark = pytest.mark.local

PACKAGE = Path(pytest_ppsmoke.__file__).parent
DOCS = Path(__file__).parent.parent / "docs"


def phase_error_calls() -> list[tuple[Path, ast.Call]]:
    """Every call of ``PhaseError(...)`` in the package."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "PhaseError":
                out.append((path, node))
    return out


def test_no_phase_error_names_its_phase_by_a_string() -> None:
    calls = phase_error_calls()
    assert len(calls) > 30  # the walk finds them: a check that finds none checks nothing
    strings = [
        f"{path.relative_to(PACKAGE)}:{call.lineno}"
        for path, call in calls
        if call.args and isinstance(call.args[0], (ast.Constant, ast.JoinedStr))
    ]
    assert strings == []


def test_a_phase_error_refuses_a_string_at_run_time_too() -> None:
    with pytest.raises(TypeError, match="must be a Phase, got 'load'"):
        PhaseError("load", "x")  # type: ignore[arg-type]
    assert str(PhaseError(Phase.LOAD, "x")) == "load: x"


def test_each_phase_names_a_driver_step_and_an_instance_step_that_exist() -> None:
    for phase in Phase:
        assert phase.step in (*STEPS, ""), phase
        assert phase.waits_for in (*INSTANCE_STEPS, None), phase
    # the driver's steps run the phases in their order
    order = [STEPS.index(p.step) for p in Phase if p.step]
    assert order == sorted(order)


def test_the_next_phase_follows_the_table() -> None:
    assert [p.next for p in Phase][:-1] == list(Phase)[1:]
    assert Phase.TEARDOWN.next is Phase.TEARDOWN


def test_the_docs_table_of_phases_is_the_enum() -> None:
    text = (DOCS / "lifecycle.md").read_text()
    section = text.split("## Phases and deadlines", 1)[1]
    rows = re.findall(r"^\| (\w+) \|", section, re.M)
    assert rows[0] == "phase"  # the header
    assert rows[1 : 1 + len(Phase)] == [p.value for p in Phase]

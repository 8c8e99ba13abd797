"""The package's rooms stay small enough to live in: no module over 700 lines, no class over 400,
and a stage's name formatted in one place (``protocol.stage_name``)."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

import pytest_ppsmoke

pytestmark = pytest.mark.local

PACKAGE = Path(pytest_ppsmoke.__file__).parent
SOURCES = sorted([*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "worker").glob("*.py")])
MODULE_LINES, CLASS_LINES = 700, 400
FORMS = ("pp-stage-%", "pp-stage-{}", "pp-stage-{0}", "pp-stage-{stage")  # templates of a stage name


def test_no_module_over_700_lines_and_no_class_over_400() -> None:
    big = []
    for path in SOURCES:
        text = path.read_text()
        where = path.relative_to(PACKAGE.parent)
        if (n := len(text.splitlines())) > MODULE_LINES:
            big.append(f"{where}: {n} lines")
        for node in ast.walk(ast.parse(text, str(path))):
            size = (node.end_lineno or 0) - node.lineno + 1 if isinstance(node, ast.ClassDef) else 0
            if isinstance(node, ast.ClassDef) and size > CLASS_LINES:
                big.append(f"{where}: class {node.name}, {size} lines")
    assert not big, "rooms too big: " + "; ".join(big)


def hand_formatted(tree: ast.AST) -> list[int]:
    """Lines that format a stage name by hand: an f-string with ``pp-stage-`` before a field, or a
    ``%`` or ``str.format`` template of one (a docstring that shows the form is not a format)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = node.values
            for a, b in itertools.pairwise(parts):
                if (
                    isinstance(a, ast.Constant)
                    and str(a.value).endswith("pp-stage-")
                    and isinstance(b, ast.FormattedValue)
                ):
                    lines.append(node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and any(t in node.value for t in FORMS):
            lines.append(node.lineno)
    return lines


def test_stage_names_are_formatted_only_in_protocol() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in SOURCES
        if path != PACKAGE / "protocol.py"
        for line in hand_formatted(ast.parse(path.read_text(), str(path)))
    ]
    assert not found, "pp-stage- formatted by hand (use protocol.stage_name): " + ", ".join(found)


def test_the_stage_name_check_finds_each_hand_made_form() -> None:
    made = 'f"pp-stage-{i}"\n"pp-stage-%d" % i\n"pp-stage-{}".format(i)\nf"to pp-stage-{s + 1} on"'
    assert sorted(hand_formatted(ast.parse(made))) == [1, 2, 3, 4]
    assert hand_formatted(ast.parse('"""Sends to ``pp-stage-{i+1}``."""\nstage_name(i)')) == []

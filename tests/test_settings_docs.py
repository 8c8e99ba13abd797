"""The options table of the docs lists exactly the settings table's options (harness/settings.py),
each with its flags, ini key, variable and help (which says its default)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_ppsmoke.harness.settings import OPTIONS

# in the suite that .ci/run and the README's command run (-m local): a check that never runs checks nothing
pytestmark = pytest.mark.local

# the file that holds the options table (the one whose header starts with HEADER)
OPTIONS_DOC = Path(__file__).parent.parent / "docs" / "run.md"
HEADER = "| `pp-smoke-run` | pytest | ini | env | what, and the default |"
MODE_FLAGS = "`--local` / `--vastai`"  # the mode is two flags of pp-smoke-run's, not one option


def table_rows() -> list[list[str]]:
    lines = OPTIONS_DOC.read_text().splitlines()
    start = lines.index(HEADER) + 2  # past the header and its |---| line
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def code(text: str | None) -> str:
    return f"`{text}`" if text else ""


def test_the_options_table_lists_every_option_as_the_settings_table_declares_it() -> None:
    rows = table_rows()
    assert len(rows) == len(OPTIONS), (len(rows), len(OPTIONS))
    by_pytest = {row[1]: row for row in rows}
    for opt in OPTIONS:
        row = by_pytest.get(code(opt.pytest))
        assert row is not None, f"{opt.name} ({opt.pytest}) is missing from {OPTIONS_DOC.name}'s options table"
        cli = code(opt.cli) if opt.cli else MODE_FLAGS
        want = [cli, code(opt.pytest), code(opt.ini_name) or "(none)", code(opt.env), opt.help]
        assert row == want, (opt.name, row, want)
        if isinstance(opt.default, (int, float)) and not isinstance(opt.default, bool):
            assert f"default {opt.default:g}" in row[4], (opt.name, opt.default, row[4])


def test_the_table_is_in_the_settings_tables_order() -> None:
    assert [row[1] for row in table_rows()] == [code(o.pytest) for o in OPTIONS]


def test_a_lower_layers_message_names_each_faces_own_flags() -> None:
    """cloud/ names a setting by its field name (protocol.setting); each face writes its own flag."""
    from pytest_ppsmoke.harness.settings import in_face
    from pytest_ppsmoke.protocol import reap_advice, setting

    message = f"Relax {setting('gpu_ram')} or {setting('max_price')}; run {reap_advice('r1')}"
    assert in_face(message, "cli") == "Relax --gpu-ram or --max-price; run pp-smoke-run --reap --run-id r1"
    assert in_face(message, "pytest") == (
        "Relax --ppsmoke-gpu-ram or --ppsmoke-max-price; run pp-smoke-run --reap --run-id r1"
    )
    assert in_face(setting("num_stages"), "pytest") == "--ppsmoke-stages"


def test_every_test_the_docs_name_exists() -> None:
    """docs/lifecycle.md names, for each vast.ai behaviour it relies on, the test that holds it
    (``test_file.py::test_name``): each must be a test function of that file, or the table claims
    a hold that nothing has."""
    import ast
    import re

    root = Path(__file__).parent.parent
    named = set(re.findall(r"`(test_\w+\.py)::(test_\w+)`", (root / "docs" / "lifecycle.md").read_text()))
    assert len(named) >= 20, named
    defined: dict[str, set[str]] = {}
    for file in {f for f, _ in named}:
        tree = ast.parse((root / "tests" / file).read_text())
        defined[file] = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    missing = sorted(f"{f}::{t}" for f, t in named if t not in defined[f])
    assert not missing, f"docs/lifecycle.md names tests that do not exist: {missing}"

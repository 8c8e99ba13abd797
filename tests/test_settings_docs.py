"""The options table of the docs lists exactly the settings table's options (harness/settings.py),
each with its flags, ini key, variable and help (which says its default); each default is
written once, as the value, and the help texts get it from there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pytest_ppsmoke import nodeenv
from pytest_ppsmoke.harness.options import Option
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


# "default" then a value written by hand: "(default 64)", "default: auto", "bf16 (default)"
BY_HAND = re.compile(r"\(default\b|\bdefault\s*[:=]?\s*[\d'\"~]|\w+ \(default\)")


@pytest.mark.parametrize("text", ["tokens to generate (default 64)", "auto (default: beside)", "bf16 (default), f16"])
def test_the_scan_finds_a_default_written_by_hand(text: str) -> None:
    assert BY_HAND.search(text)


def test_no_help_text_writes_a_default_by_hand() -> None:
    """An option's ``about`` (and a node variable's doc) says what it is; the default is the
    value's, added by the help (``Option.help``), so the two cannot disagree."""
    for opt in OPTIONS:
        assert not BY_HAND.search(opt.about), (opt.name, opt.about)
        assert opt.help.startswith(opt.about)
    for var in nodeenv.variables():
        assert not BY_HAND.search(var.doc), (var.name, var.doc)


def shown_default(opt: Option) -> str:
    """The default as the help should give it: the value, written by the option's check."""
    if opt.default_text:
        return opt.default_text
    text = opt.check.show(opt.default)
    return repr(text) if " " in text else text


def test_the_generated_help_shows_each_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pp-smoke-run --help`` shows every option's default, taken from its value."""
    from pytest_ppsmoke.harness import cli

    monkeypatch.setenv("COLUMNS", "10000")  # no line breaks inside a default (argparse breaks at hyphens)
    text = " ".join(cli.parser().format_help().split())
    for opt in OPTIONS:
        if opt.default in (None, "") and not opt.default_text:
            assert "(default" not in opt.help, opt.name
            continue
        want = f"(default {shown_default(opt)})"
        assert opt.help.endswith(want), (opt.name, opt.help)
        if opt.cli:
            assert " ".join(want.split()) in text, (opt.name, want)


def test_the_table_is_in_the_settings_tables_order() -> None:
    assert [row[1] for row in table_rows()] == [code(o.pytest) for o in OPTIONS]


def test_a_lower_layers_message_names_each_faces_own_flags() -> None:
    """cloud/ names a setting through the face's ``Names``, by its field name; each face's names
    are its own flags, in a message and in a phase's advice alike."""
    from pytest_ppsmoke.harness.settings import face_names
    from pytest_ppsmoke.protocol import Names, Phase

    def message(names: Names) -> str:
        return f"Relax {names.setting('gpu_ram')} or {names.setting('max_price')}; run {names.reap('r1')}"

    assert message(face_names("cli")) == "Relax --gpu-ram or --max-price; run pp-smoke-run --reap --run-id r1"
    assert message(face_names("pytest")) == (
        "Relax --ppsmoke-gpu-ram or --ppsmoke-max-price; run pp-smoke-run --reap --run-id r1"
    )
    assert face_names("pytest").setting("num_stages") == "--ppsmoke-stages"
    assert "check --ppsmoke-model and" in Phase.LOAD.advice(face_names("pytest"))
    assert "check --model and" in Phase.LOAD.advice(face_names("cli"))
    assert "{" not in Phase.BOOT.advice(Names()) and "image" in Phase.BOOT.advice(Names())


def test_every_phase_advice_names_only_settings() -> None:
    """A phase's advice names a setting by a field of the settings table, never a flag: a
    misspelt name would be written as it is, which no face's flag matches."""
    import string

    from pytest_ppsmoke.harness.settings import OPTIONS
    from pytest_ppsmoke.protocol import Phase

    fields = {o.name for o in OPTIONS}
    for phase in Phase:
        named = {f for _, f, _, _ in string.Formatter().parse(phase.hint) if f}
        assert named <= fields, (phase, named - fields)
        assert "--" not in phase.hint, phase


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

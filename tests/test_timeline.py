"""The run's timeline drawn as an image (``harness/timeline.py``, ``pp-smoke-run --timeline``),
from a report built here: one row per instance and one per phase, read back from the plotted
bars, not only the file. The timeline in a real run's report, checked against its timings:
tests/test_driver.py (``timeline_agrees``)."""

from __future__ import annotations

import builtins
import io
from pathlib import Path
from typing import Any

import pytest

from pytest_ppsmoke.harness import cli
from pytest_ppsmoke.harness.figures import InstanceFigures, OfferFigures, PhaseSpan, RunTimeline
from pytest_ppsmoke.harness.report import Report
from pytest_ppsmoke.harness.timeline import INSTALL, NoPlotting, draw, rows

pytestmark = pytest.mark.local

PHASES = [
    ("preflight", -0.2, -0.1), ("rent", 0.0, 4.7), ("boot", 4.7, 6.9), ("converge", 6.9, 7.0),
    ("load", 7.0, 9.7), ("resolve", 9.7, 9.71), ("prefill", 9.72, 11.9), ("decode", 11.9, 20.2),
    ("reference", 20.3, 34.0), ("teardown", 34.0, 37.1),
]  # fmt: skip


def instance(stage: int, id: int, **timeline: float) -> InstanceFigures:
    offer = OfferFigures(id, id, "RTX 4090", 1, 24564, 0.4, 0.99, "here")
    return InstanceFigures(
        id, stage, f"ppsmoke-x-stage{stage}", "", offer, 0.4, 37.0, 0.004, "destroyed", None, None, None,
        dict(timeline), 0, None, None, None,
    )  # fmt: skip


def report() -> Report:
    r = Report("local", "m", "hi", 4, 2, "bf16")  # type: ignore[arg-type]
    r.run_id = "20261206T000000-abcdef"
    r.instances = [
        instance(0, 12400001, rented=2.1, running=4.9, reached=6.95, joined=6.97, loaded=9.1),
        instance(1, 12400002, rented=4.6, running=6.8, reached=6.96, joined=6.99, loaded=9.6),
    ]
    r.timeline = RunTimeline([PhaseSpan(*p) for p in PHASES], -0.3, 600.0, 569.7, 599.7)
    return r


def test_the_image_has_a_row_per_instance_and_per_phase(tmp_path: Path) -> None:
    path = tmp_path / "t.png"
    fig = draw(report(), path)
    assert path.stat().st_size > 0
    (ax,) = fig.axes
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["pp-stage-0 #12400001", "pp-stage-1 #12400002", *(p for p, _, _ in PHASES)]
    ticks = list(ax.get_yticks())

    # every bar, as plotted: its row (the label at its y) and its start and end
    def row(b: Any) -> str:
        return labels[ticks.index(round(b.get_y() + b.get_height() / 2))]

    bars = [(row(b), round(b.get_x(), 3), round(b.get_x() + b.get_width(), 3)) for c in ax.containers for b in c]
    for phase, start, end in PHASES:  # each phase once, on its own row
        assert [(a, b) for row, a, b in bars if row == phase] == [(start, end)], phase
    stage1 = sorted((a, b) for row, a, b in bars if row == "pp-stage-1 #12400002")
    assert stage1 == [(4.6, 6.8), (6.8, 6.96), (6.96, 6.99), (6.99, 9.6), (9.6, 37.1)]  # each step to the next
    assert len(bars) == len(PHASES) + 10


def test_the_rows_come_from_the_report_or_its_json() -> None:
    r = report()
    assert rows(r) == rows(r.to_json())
    assert rows(Report("local", "m", "hi", 4, 2, "bf16")) == []  # type: ignore[arg-type]  # nothing ran


def test_without_matplotlib_the_cli_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.split(".")[0] == "matplotlib":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(NoPlotting, match=INSTALL.replace("[", r"\[").replace("]", r"\]")):
        draw(report())
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    cli.draw_timeline(report(), tmp_path / "t.png")
    assert err.getvalue() == f"pp-smoke-run: no timeline drawn: drawing the timeline needs matplotlib: {INSTALL}\n"
    assert not (tmp_path / "t.png").exists()

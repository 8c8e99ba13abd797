"""A run's timeline as an image (``pp-smoke-run --timeline FILE.png``): where the time went.

    figure = draw(report)                   # a Report, or its JSON as read back
    figure.savefig("timeline.png")

One row per instance (``pp-stage-1 #12400002``: its steps, rented to loaded, each segment from
one step to the next, and a replaced one's end), then one row per phase (its start to its end),
on one clock: seconds since the rent began (the report's ``timeline`` and
``instances[].timeline``). The steps' deadline and the budget's end are vertical lines where they
fall within the run's time; the title gives the budget either way.

matplotlib comes with the plotting extra (``pip install 'pytest-ppsmoke[layout]'``); without it
:func:`draw` raises :class:`NoPlotting`, whose message says how to get it. matplotlib is imported
only here, when a drawing is asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..cloud.rented import STEPS
from ..protocol import stage_name
from .report import Report

INSTALL = "pip install 'pytest-ppsmoke[layout]'"  # the plotting extra (in a checkout: pip install -e '.[layout]')
COLOURS = {"rented": "#c6dbef", "running": "#6baed6", "reached": "#fd8d3c", "joined": "#74c476", "loaded": "#31a354"}
PHASE_COLOUR = "#9e9ac8"


class NoPlotting(RuntimeError):
    """matplotlib is not installed: the message says how to get it."""


def _as_json(report: Report | dict[str, Any]) -> dict[str, Any]:
    return report.to_json() if isinstance(report, Report) else report


def instance_label(inst: dict[str, Any]) -> str:
    return f"{stage_name(inst['stage'])} #{inst['id']}" if inst.get("id") is not None else stage_name(inst["stage"])


def rows(report: Report | dict[str, Any]) -> list[tuple[str, list[tuple[float, float, str]]]]:
    """The image's rows, top to bottom: each instance's label and its segments ``(start, end,
    step)`` (from each step reached to the next; the last one, to its replacement or the run's
    last phase's end), then each phase's name and its one span."""
    r = _as_json(report)
    phases = (r.get("timeline") or {}).get("phases") or []
    last = max((p["end"] for p in phases), default=0.0)
    out: list[tuple[str, list[tuple[float, float, str]]]] = []
    for inst in r.get("instances", []):
        steps = [(s, inst["timeline"][s]) for s in STEPS if s in inst["timeline"]]
        end = inst.get("replaced_at") if inst.get("replaced_at") is not None else last
        segments = [(at, nxt, step) for (step, at), (_, nxt) in zip(steps, [*steps[1:], ("", end)], strict=True)]
        out.append((instance_label(inst), [(a, max(a, b), s) for a, b, s in segments]))
    out += [(p["phase"], [(p["start"], p["end"], p["phase"])]) for p in phases]
    return out


def draw(report: Report | dict[str, Any], path: Path | None = None) -> Any:
    """The timeline as a matplotlib Figure (saved to ``path`` when given); raises
    :class:`NoPlotting` where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed: the image is a file
        import matplotlib.pyplot as plt
    except ImportError:
        raise NoPlotting(f"drawing the timeline needs matplotlib: {INSTALL}") from None
    r = _as_json(report)
    drawn = rows(r)
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.35 * len(drawn)))
    for y, (_, segments) in enumerate(drawn):
        for start, end, what in segments:
            colour = COLOURS.get(what, PHASE_COLOUR)
            ax.barh(y, end - start, left=start, height=0.6, color=colour, edgecolor="black", linewidth=0.4, label=what)
    ax.set_yticks(range(len(drawn)), [label for label, _ in drawn])
    ax.invert_yaxis()  # the first instance on top, the phases below in their order
    ax.set_xlabel("seconds since the rent began")
    timeline = r.get("timeline") or {}
    ends = [e for _, segs in drawn for _, e, _ in segs]
    shown = max(ends, default=0.0)
    for name in ("steps_deadline", "budget_end"):
        at = timeline.get(name)
        if at is not None and at <= shown * 1.1:
            ax.axvline(at, color="red", linestyle="--", linewidth=0.8)
    budget = f"; budget {timeline['budget']:g} s" if timeline.get("budget") else ""
    ax.set_title(f"{r.get('run_id') or 'run'}: {r.get('num_stages')} stages, {r.get('mode')}{budget}")
    handles = {h.get_label(): h for h in ax.containers}
    keep = [s for s in STEPS if s in handles]
    if keep:
        ax.legend([handles[s] for s in keep], keep, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path)
    return fig


__all__ = ["INSTALL", "NoPlotting", "draw", "rows"]

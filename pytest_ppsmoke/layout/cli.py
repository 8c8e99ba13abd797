"""pp-layout: measure a layout grid, fit its cost model, write the report; or predict from one.

    pp-layout grid --prompts 32,128,512 --stages 1,2,3,4 --networks loopback,wan,far --out layout/
    pp-layout report layout/grid.json --out layout/             # fit and write again, no measuring
    pp-layout predict layout/layout.json --network rtt=40ms,bw=1gbit --stages 1,2,4 --prompts 128

``grid`` runs on this machine through the vast.ai emulator (``layout/grid.py``) and writes
``grid.json`` as it goes, then the report (``layout/report.py``): ``layout.json``, ``layout.md``
and the plots. ``predict`` needs no run: a saved report's fit and a network description; it warns
on stderr for each stage count or prompt length outside those the fit saw (an extrapolation).
Exit status: 0, 1 when a measurement or the fit failed (the message says which), 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .. import checks
from ..harness.gridspec import WEIGHTS, GridSpec, grid_spec
from ..harness.options import Parser
from ..harness.settings import add_option
from .grid import HOLD_OUT, hold_out, new_grid, run_grid
from .points import Grid

if TYPE_CHECKING:
    from ..harness.settings import Settings


_GRID = GridSpec()  # the grid's defaults


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _names(text: str) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return values


def _scheme(text: str) -> str:
    scheme = text.strip()
    if scheme not in ("saved", *HOLD_OUT[:-1]):
        n = scheme.removeprefix("stages=")
        if not scheme.startswith("stages=") or not n.isdigit() or int(n) < 2:
            raise argparse.ArgumentTypeError(
                f"hold-out scheme {text!r}: expected saved, {', '.join(HOLD_OUT[:-1])} or stages=N (N >= 2)"
            )
    return scheme


def _report(grid: Grid, out: Path) -> list[Path]:
    from .fit import fit
    from .report import write_report

    out.mkdir(parents=True, exist_ok=True)
    return write_report(grid, fit(grid), out)


def grid_from_settings(settings: Settings) -> int:
    """``pp-smoke-run --grid``: the grid its ``--grid`` describes, deployed as the run would be
    (``run_grid``'s ``settings``), then ``grid.json`` and the report in ``--grid-out``. Every
    deployment is torn down as it ends, and on SIGINT/SIGTERM (the task is cancelled into its
    teardowns). Exit status 0, or 1 with a line saying what failed; the points measured before a
    failure are kept in ``grid.partial.json``."""
    spec = grid_spec(settings.grid, settings.model, settings.network)
    assert spec is not None  # "off" never gets here
    grid = new_grid(spec, settings)

    async def run() -> Grid:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, task.cancel)
        return await run_grid(spec, lambda line: print(line, file=sys.stderr, flush=True), settings, grid)

    def failed(why: str) -> int:
        kept = ""
        if grid.points:
            settings.grid_out.mkdir(parents=True, exist_ok=True)
            grid.save(settings.grid_out / "grid.partial.json")
            kept = f" ({len(grid.points)} point(s) measured before it are in {settings.grid_out / 'grid.partial.json'})"
        print(f"pp-smoke-run: grid: {why}{kept}", file=sys.stderr)
        return 1

    try:
        asyncio.run(run())
        settings.grid_out.mkdir(parents=True, exist_ok=True)
        grid.save(settings.grid_out / "grid.json")
        written = _report(grid, settings.grid_out)
    except asyncio.CancelledError:
        return failed("interrupted (every deployment made was torn down)")
    except Exception as e:  # a phase, the API, the fit: still one line, and nothing left rented
        return failed(f"{type(e).__name__}: {e}")
    for path in [settings.grid_out / "grid.json", *written]:
        print(path)
    return 0


def main(argv: list[str] | None = None) -> None:
    # A flag that is a setting of a run (the model, the tokens, the wire dtypes, the GPUs, the report's
    # directory) comes from the settings table (add_option): its check, its help; its default is the
    # grid's (GridSpec). The rest are the grid's own: lists of prompt lengths, stage counts (1:
    # unsplit) and network profile names (a network description may hold commas), the repeats, the
    # weights, the hold-out and the prediction's inputs.
    p = Parser(prog="pp-layout", description=__doc__.split("\n\n")[0])  # a bad argument: one line
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("grid", help="measure a grid on this machine, then write the report")
    add_option(g, "model", default=_GRID.model)
    g.add_argument("--prompts", type=_ints, default=_GRID.prompts, metavar="N,...", help="prompt lengths in tokens")
    g.add_argument("--stages", type=_ints, default=_GRID.stages, metavar="N,...", help="stage counts (1: unsplit)")
    g.add_argument("--networks", type=_names, default=_GRID.networks, metavar="NAME,...", help="network profiles")
    add_option(g, "wire_dtype", "--wires", many=True, default=_GRID.wires)
    g.add_argument(
        "--repeats", type=int, default=_GRID.repeats, metavar="N", help="measurements per point (default %(default)s)"
    )
    add_option(g, "max_tokens", default=_GRID.max_tokens)
    g.add_argument(
        "--weights",
        choices=tuple(WEIGHTS),
        default=_GRID.weights,
        help="f16 (tinygrad's HALF=1) or native (HALF=0: the GGUF's dtype, float32 for a quantized file; "
        "on a CPU much faster: docs/benchmarks.md) (default %(default)s)",
    )
    add_option(g, "gpus")
    add_option(g, "grid_out", "--out", required=True)
    r = sub.add_parser("report", help="fit a saved grid.json and write the report again")
    r.add_argument("grid", type=Path)
    add_option(r, "grid_out", "--out", required=True)
    r.add_argument(
        "--hold-out",
        type=_scheme,
        default="saved",
        metavar="SCHEME",
        help="the points the fit must not see: saved (as saved in grid.json); layouts (one split stage count "
        "per network, in turn); prompt (the middle prompt length); largest (the largest stage count, every "
        "network); stages=N (stage count N) (default %(default)s)",
    )
    q = sub.add_parser("predict", help="predict from a saved report for a network never measured")
    q.add_argument("report", type=Path, help="a layout.json")
    q.add_argument(
        "--network", required=True, metavar="NETWORK", help="a measured profile's name, or e.g. rtt=40ms,bw=1gbit"
    )
    q.add_argument(
        "--stages",
        type=_ints,
        default=(1, 2, 4),
        metavar="N,...",
        help="stage counts, 1 to the model's blocks; outside the grid's fitted ones: a warning (an extrapolation)",
    )
    q.add_argument(
        "--prompts", type=_ints, default=(128,), metavar="N,...", help="prompt lengths; outside the grid's: a warning"
    )
    add_option(q, "wire_dtype", "--wire")
    a = p.parse_args(argv)
    try:
        if a.command == "grid":
            spec = GridSpec(
                a.model,
                a.prompts,
                a.stages,
                a.networks,
                a.wire_dtype,
                a.repeats,
                a.max_tokens,
                gpus=checks.items(a.gpus),
                weights=a.weights,
            )
            spec.check()
            a.grid_out.mkdir(parents=True, exist_ok=True)
            grid = asyncio.run(run_grid(spec, log=lambda line: print(line, file=sys.stderr, flush=True)))
            grid.save(a.grid_out / "grid.json")
            written = _report(grid, a.grid_out)
        elif a.command == "report":
            grid = Grid.load(a.grid)
            if a.hold_out != "saved":
                grid.held_out = hold_out(grid.points, a.hold_out)
            written = _report(grid, a.grid_out)
        else:
            from .fit import Fit
            from .report import beyond_the_grid, predict_table

            saved = json.loads(a.report.read_text())
            grid = Grid.from_json(saved["grid"])
            ref = grid.points[0]
            dph = min((min(pt.dph) for pt in grid.points if pt.dph), default=0.0)
            table = predict_table(
                Fit.from_json(saved["fit"]),
                a.network,
                a.stages,
                a.prompts,
                a.wire_dtype,
                ref.dim,
                ref.num_blocks,
                dph,
                grid,
            )
            for warning in beyond_the_grid(grid, a.stages, a.prompts):
                print(f"pp-layout predict: warning: {warning}", file=sys.stderr)
            print(table)
            return
    except (ValueError, RuntimeError, OSError, KeyError) as e:
        print(f"pp-layout {a.command}: {e}", file=sys.stderr)
        sys.exit(1)
    for path in written:
        print(path)


if __name__ == "__main__":
    main()

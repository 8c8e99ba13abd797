"""The layout grid in a pytest session (``--ppsmoke-grid small``, or a grid description): measured
as the session's run would deploy (local: through the emulator, on each network of the grid;
``--vastai-key``: on rented instances), its cost model fitted, the report written to
``--ppsmoke-grid-out``; the fitted link figures (alpha, beta) and the recommended layouts go to the
JUnit XML as properties and to the terminal summary. Skipped unless a grid is asked for.

Run: ``pytest --pyargs pytest_ppsmoke.spec -m local --ppsmoke-grid small`` (or ``-m vastai
--vastai-key ...``, where stage count 1, the model unsplit on this machine, is left out).
"""

from __future__ import annotations

import asyncio
import math

import pytest

from pytest_ppsmoke.harness.settings import Settings

pytestmark = [pytest.mark.local, pytest.mark.vastai]


def test_layout_grid_fits_its_cost_model_and_writes_the_report(
    ppsmoke_settings: Settings, request: pytest.FixtureRequest
) -> None:
    from pytest_ppsmoke.harness.gridspec import grid_spec
    from pytest_ppsmoke.layout.fit import fit
    from pytest_ppsmoke.layout.grid import run_grid
    from pytest_ppsmoke.layout.report import layout_name, predictions, recommendations, write_report

    s = ppsmoke_settings

    def record_property(name: str, value: object) -> None:  # the JUnit properties, as the plugin adds its own
        request.node.user_properties.append((name, value))

    spec = grid_spec(s.grid, s.model, s.network)
    if spec is None:
        pytest.skip("no layout grid asked for (--ppsmoke-grid small, or a grid description)")
    grid = asyncio.run(run_grid(spec, log=lambda line: None, settings=s))
    model = fit(grid)
    written = write_report(grid, model, s.grid_out)
    assert {p.name for p in written} >= {"layout.json", "layout.md"}, written
    for name, link in model.links.items():
        record_property(f"ppsmoke_layout_alpha_ms_{name}", round(link.alpha_s * 1e3, 4))
        beta = link.beta_Bps / 1e6 if math.isfinite(link.beta_Bps) else "inf"
        record_property(f"ppsmoke_layout_beta_MBps_{name}", beta if isinstance(beta, str) else round(beta, 3))
    for rec in recommendations(predictions(grid, model)):
        key = f"ppsmoke_layout_{rec['objective']}_{rec['phase']}_{rec['network']}"
        if rec["phase"] == "prefill":
            key += f"_P{rec['prompt_tokens']}"
        record_property(key, layout_name(rec["stages"], rec["wire"]))
    held = model.held_out_errors(grid)
    for what in ("ttft", "tpot"):
        worst = getattr(held, f"{what}_max")
        if worst is not None:
            record_property(f"ppsmoke_layout_heldout_{what}_max_error", round(worst, 4))
    record_property("ppsmoke_layout_report", str(s.grid_out / "layout.md"))

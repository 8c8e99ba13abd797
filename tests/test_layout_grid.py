"""A layout grid measured through the real path (pytest_ppsmoke/layout/grid.py): the emulator rents
the instances, the nodes run the session's synthetic model, and each point holds what the run
recorded: hops with the bytes the spec's wire format gives, worker calls with their blocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_ppsmoke.layout.grid import GridSpec, prompt_text, run_grid
from pytest_ppsmoke.layout.points import Grid

from .helpers import SYNTH

pytestmark = pytest.mark.local


async def test_a_grid_measures_every_point_and_each_hop_carries_the_wire_bytes(
    synth_model: str, tmp_path: Path
) -> None:
    spec = GridSpec(
        model=synth_model, prompts=(40, 64, 96), stages=(1, 2), networks=("loopback",), repeats=1, max_tokens=8
    )
    lines: list[str] = []
    grid = await run_grid(spec, log=lines.append)
    assert sorted((p.stages, p.network) for p in grid.points) == [(1, "loopback")] * 3 + [(2, "loopback")] * 3
    lengths = sorted({p.prompt_tokens for p in grid.points})
    assert len(lengths) == 3 and all(abs(n - t) <= 6 for n, t in zip(lengths, spec.prompts, strict=True)), lengths
    for p in grid.points:
        assert p.dim == SYNTH.dim and p.num_blocks == SYNTH.blocks and len(p.ttft_s) == len(p.tpot_s) == 1
        assert p.ttft_s[0] > 0 and p.tpot_s[0] > 0 and p.dph and min(p.dph) > 0
        if p.stages == 1:  # the model in one piece: no hop, every block, both ends
            assert not p.hops and {(c.blocks, c.first, c.last) for c in p.compute} == {(SYNTH.blocks, True, True)}
            continue
        assert len(p.dph) == 2  # both instances' $/hour
        prefill = [h for h in p.hops if h.phase == "prefill"]
        decode = [h for h in p.hops if h.phase == "decode"]
        assert [h.bytes for h in prefill] == [p.prompt_tokens * SYNTH.dim * 2]  # bf16: 2 bytes a value
        assert decode and {h.bytes for h in decode} == {SYNTH.dim * 2}
        assert all(h.seconds >= 0 for h in p.hops)
        calls = {(c.stage, c.blocks, c.first, c.last, c.phase, c.tokens) for c in p.compute}
        assert (0, 1, True, False, "prefill", p.prompt_tokens) in calls and (1, 1, False, True, "decode", 1) in calls
    # the middle length is held out of the fit, on every stage count
    held = {grid.points[i].prompt_tokens for i in grid.held_out}
    assert held == {lengths[1]} and len(grid.held_out) == 2
    assert any("2 stages" in line for line in lines)
    grid.save(tmp_path / "grid.json")
    assert Grid.load(tmp_path / "grid.json") == grid


def test_a_prompt_is_sized_from_the_template_and_the_word() -> None:
    assert prompt_text(40, 30) == " ".join(["hello"] * 10)
    assert prompt_text(40, 30, 2) == " ".join(["hello"] * 5)
    assert prompt_text(10, 30) == "hello"  # never empty
    with pytest.raises(ValueError, match="max_tokens >= 8"):
        GridSpec(max_tokens=4).check()
    with pytest.raises(ValueError, match="stage counts must be at least 1"):
        GridSpec(stages=(0, 2)).check()

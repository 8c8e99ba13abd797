"""A layout grid measured through the real path (pytest_ppsmoke/layout/grid.py): the emulator rents
the instances, the nodes run a synthetic model of four blocks (one file for both grids), and each
point holds what the run recorded: hops with the bytes the spec's wire format gives, worker calls
with their blocks, their decode positions and their stages' idle gaps; the weights in the dtype
the grid asked for."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pytest_ppsmoke.harness.gridspec import GridSpec
from pytest_ppsmoke.layout.grid import _check_weights, hold_out, prompt_text, run_grid
from pytest_ppsmoke.layout.points import Grid
from pytest_ppsmoke.messages import WeightLoad
from pytest_ppsmoke.stage.synth import SHAPES, write

from .smoke import Smoke, assert_nothing_left

REPORT_FILES = ("layout.json", "layout.md", "ttft_vs_prompt.png", "tpot_vs_delay.png", "cost_vs_latency.png")

pytestmark = pytest.mark.local

TINY = SHAPES["tiny"]  # 4 blocks: room for 3 stages


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One synthetic model for both grids, so that the second one's points find the first one's
    programs (the same shapes at the same prompt lengths)."""
    path = tmp_path_factory.mktemp("grid") / "tiny.gguf"
    write(path, TINY)
    return path


async def test_a_grid_measures_every_point_and_each_hop_carries_the_wire_bytes(
    tiny_model: Path, tmp_path: Path
) -> None:
    spec = GridSpec(
        model=str(tiny_model),
        prompts=(40, 64, 96),
        stages=(1, 2),
        networks=("loopback",),
        repeats=1,
        max_tokens=8,
        weights="native",  # HALF=0, not tinygrad's default: each worker's load line must say it got it
    )
    lines: list[str] = []
    grid = await run_grid(spec, log=lines.append)
    assert grid.weights == "f16"  # the synthetic GGUF's own dtype, kept
    assert sorted((p.stages, p.network) for p in grid.points) == [(1, "loopback")] * 3 + [(2, "loopback")] * 3
    lengths = sorted({p.prompt_tokens for p in grid.points})
    assert len(lengths) == 3 and all(abs(n - t) <= 6 for n, t in zip(lengths, spec.prompts, strict=True)), lengths
    for p in grid.points:
        assert p.dim == TINY.dim and p.num_blocks == TINY.blocks and len(p.ttft_s) == len(p.tpot_s) == 1
        assert p.ttft_s[0] > 0 and p.tpot_s[0] > 0 and p.dph and min(p.dph) > 0
        if p.stages == 1:  # the model in one piece: no hop, every block, both ends
            assert not p.hops and {(c.blocks, c.first, c.last) for c in p.compute} == {(TINY.blocks, True, True)}
            continue
        assert len(p.dph) == 2  # both instances' $/hour
        prefill = [h for h in p.hops if h.phase == "prefill"]
        decode = [h for h in p.hops if h.phase == "decode"]
        assert [h.bytes for h in prefill] == [p.prompt_tokens * TINY.dim * 2]  # bf16: 2 bytes a value
        assert decode and {h.bytes for h in decode} == {TINY.dim * 2}
        assert all(h.seconds >= 0 for h in p.hops)
        calls = {(c.stage, c.blocks, c.first, c.last, c.phase, c.tokens) for c in p.compute}
        half = TINY.blocks // 2
        assert (0, half, True, False, "prefill", p.prompt_tokens) in calls
        assert (1, half, False, True, "decode", 1) in calls
        # a decode call's context is the position it decodes: the prompt's end on; stage 0 waits
        # for each token to come back through stage 1 (its idle gap), which is never nothing
        for stage in (0, 1):
            mine = [c for c in p.compute if c.phase == "decode" and c.stage == stage]
            assert [c.context for c in mine] == list(range(p.prompt_tokens, p.prompt_tokens + len(mine))), stage
            assert all(c.idle_s >= 0 for c in mine)
        assert all(c.idle_s > 0 for c in p.compute if c.phase == "decode" and c.stage == 0)
        assert all(c.context == 0 and c.idle_s == 0 for c in p.compute if c.phase == "prefill")
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
    with pytest.raises(ValueError, match="weights 'f32': expected one of f16, native"):
        GridSpec(weights="f32").check()
    native = GridSpec(weights="native")
    f32 = WeightLoad("cache", 1.0, 10, dtype="f32", half=0)
    f16_gguf, f16_cache = WeightLoad("gguf", 2.0, 10, dtype="f16"), WeightLoad("cache", 1.0, 10, dtype="f16")
    assert _check_weights(native, [f32]) == "f32"
    assert _check_weights(GridSpec(), [f16_cache, f16_gguf]) == "f16"  # from the cache or not: one record
    with pytest.raises(RuntimeError, match=r"asked for native weights \(HALF=0\) but a worker loaded: f16 with HALF=1"):
        _check_weights(native, [f32, f16_gguf])
    with pytest.raises(RuntimeError, match=r"asked for f16 weights \(HALF=1\) but a worker loaded: nothing"):
        _check_weights(GridSpec(), [f16_cache, None])  # a worker that did not say
    with pytest.raises(RuntimeError, match=r"different dtypes: \['bf16', 'f16'\]"):
        _check_weights(GridSpec(), [f16_cache, WeightLoad("gguf", 1.0, 10, dtype="bf16")])


async def test_pp_smoke_run_grid_rents_where_the_run_would(
    emulator: Callable[..., Any], tiny_model: Path, tmp_path: Path
) -> None:
    """``pp-smoke-run --grid`` on a vast.ai API named by URL and key (an emulator started apart,
    as vast.ai would be): every deployment rents there and is destroyed, the points are of its one
    network, stage count 1 (this machine) is left out and said so, the report is in --grid-out,
    and the key appears nowhere."""
    fake = await emulator("")
    out, tiny = tmp_path / "layout", tiny_model
    grid_text = "prompts=40,64,96;stages=1,2,3;repeats=1;max_tokens=8"
    run = Smoke(fake, tmp_path, "--grid", grid_text, "--grid-out", str(out))
    run.argv[run.argv.index("--model") + 1] = str(tiny)
    async with run as smoke:
        rc = await smoke.finish(timeout=240)  # under pytest's 300 s: an overrun says what it was doing
    assert rc == 0, smoke.stderr[-3000:]
    assert smoke.stdout.split() == [str(out / n) for n in ("grid.json", *REPORT_FILES)], smoke.stdout
    assert "stage count 1 (the model unsplit) runs on this machine: left out" in smoke.stderr
    grid = Grid.load(out / "grid.json")
    assert sorted({(p.network, p.stages) for p in grid.points}) == [("loopback", 2), ("loopback", 3)]
    assert grid.device == f"instances rented from {fake.url}" and len(grid.points) == 6
    # two split stage counts on one network: the layouts scheme holds the second one out
    assert sorted({grid.points[i].stages for i in grid.held_out}) == [3] and len(grid.held_out) == 3
    # which on one network is the largest stage count (the scheme the 8-stage grid is checked by),
    # and the report's held-out errors are the fit's predictions for it
    assert hold_out(grid.points, "largest") == grid.held_out
    held = json.loads((out / "layout.json").read_text())["held_out"]
    assert sorted(r["index"] for r in held["rows"]) == grid.held_out and held["tpot_max"] is not None
    assert len(fake.destroyed) == 2 + 3  # a deployment of 2 instances, then one of 3
    await assert_nothing_left(fake, smoke, created=5)
    assert "## Recommended layouts" in (out / "layout.md").read_text()


async def test_pp_smoke_run_grid_of_a_model_that_is_not_there_fails_in_one_line_renting_nothing(
    emulator: Callable[..., Any], tmp_path: Path
) -> None:
    fake = await emulator("")
    bad = tmp_path / "bad"
    run = Smoke(fake, bad, "--grid", "prompts=40;stages=2,3;repeats=1;max_tokens=8", "--grid-out", str(bad))
    run.argv[run.argv.index("--model") + 1] = "/nonexistent.gguf"
    async with run as smoke:
        rc = await smoke.finish(timeout=120)
    assert rc != 0 and not (bad / "grid.json").exists()
    said = [x for x in smoke.stderr.splitlines() if x.startswith("pp-smoke-run: error:")]
    assert len(said) == 1 and "nonexistent.gguf" in said[0], smoke.stderr[-2000:]
    await assert_nothing_left(fake, smoke, created=0)  # refused before anything was rented


async def test_pp_smoke_run_grid_keeps_what_it_measured_before_a_layout_the_preflight_refuses(
    emulator: Callable[..., Any], tiny_model: Path, tmp_path: Path
) -> None:
    """More stages than the model has blocks: the 2-stage layout is measured, then the pre-flight
    refuses the 5-stage one in one line (nothing rented for it), and what was measured is kept."""
    fake = await emulator("")
    bad, tiny = tmp_path / "bad", tiny_model
    run = Smoke(fake, bad, "--grid", "prompts=40;stages=2,5;repeats=1;max_tokens=8", "--grid-out", str(bad))
    run.argv[run.argv.index("--model") + 1] = str(tiny)
    async with run as smoke:
        rc = await smoke.finish(timeout=120)
    assert rc == 1 and not (bad / "grid.json").exists()
    last = smoke.stderr.strip().splitlines()[-1]
    assert last.startswith(f"pp-smoke-run: grid: PhaseError: preflight: --model '{tiny}' has 4 block(s)"), last
    assert "fewer than the 5 stages; lower --num-stages to at most 4" in last, last
    assert last.endswith(f"(1 point(s) measured before it are in {bad / 'grid.partial.json'})"), last
    assert [p.stages for p in Grid.load(bad / "grid.partial.json").points] == [2]
    await assert_nothing_left(fake, smoke, created=2)


def test_pp_layouts_flags_that_are_settings_come_from_the_settings_table(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """pp-layout's model, max-tokens, wire dtype(s), GPUs and --out are the settings table's
    options: its checks and help, with the grid's defaults."""
    from pytest_ppsmoke.harness.settings import OPTIONS
    from pytest_ppsmoke.layout.cli import main

    about = {o.name: o.about for o in OPTIONS}
    monkeypatch.setenv("COLUMNS", "10000")
    with pytest.raises(SystemExit):
        main(["grid", "--help"])
    text = capsys.readouterr().out
    grid = GridSpec()
    assert f"{about['max_tokens']} (default {grid.max_tokens})" in text
    assert f"{about['model']} (default {grid.model})" in text
    assert f"{about['wire_dtype']}, comma-separated (default {','.join(grid.wires)})" in text
    assert about["gpus"] in text and about["grid_out"] in text
    for argv, message in [
        (
            ["grid", "--out", "x", "--max-tokens", "0"],
            "argument --max-tokens: must be an integer of at least 1, got '0'",
        ),
        (
            ["grid", "--out", "x", "--wires", "bf16,f8"],
            "names an unknown wire dtype 'f8'; expected one of bf16, f16, f32",
        ),
        (["predict", "r.json", "--network", "wan", "--wire", "int4"], "argument --wire: names an unknown wire dtype"),
        (["grid"], "the following arguments are required: --out"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err

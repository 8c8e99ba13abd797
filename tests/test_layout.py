"""The layout report's model and report over synthetic grids made from known coefficients: the
fit recovers them, predicts held-out points, does the arithmetic the model states, and the report
names the layouts to rent. Pure Python: no model, no nodes."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from pytest_ppsmoke.layout.cli import main
from pytest_ppsmoke.layout.fit import Fit, Link, Overhead, Wake, fit, layer_range, stage_shapes
from pytest_ppsmoke.layout.grid import hold_out
from pytest_ppsmoke.layout.points import WIRE_BYTES, Grid, HopSample, Point, StageSample
from pytest_ppsmoke.layout.report import (
    Row,
    beyond_the_grid,
    layout_name,
    layouts,
    pareto_frontier,
    predict_table,
    recommendations,
    write_report,
)

pytestmark = pytest.mark.local

DIM, BLOCKS, GENERATED, DPH = 576, 30, 8, 0.5
LINKS = {"loopback": Link(0.0002, 2e9), "wan": Link(0.02, 1.25e8), "far": Link(0.06, 5e7)}
RTT = {"loopback": 0.0, "wan": 40.0, "far": 120.0}
PREFILL = {
    "block": 1e-3,
    "block_t": 2e-5,
    "block_t2": 1e-8,
    "head": 2e-3,
    "head_t": 5e-5,
    "embed": 1e-4,
    "embed_t": 1e-6,
    "call": 5e-4,
}
DECODE = {"block": 8e-4, "block_ctx": 2e-7, "head": 3e-3, "embed": 1e-4, "call": 1e-3, "wake": 0.015}
# a stage idle for more than 120 ms before a decode call pays up to 15 ms to wake (from 270 ms on)
WAKE = Wake(0.12, 0.27)
# split: the orchestrator and the bridge (a constant, a term per stage) and, for the first token,
# the request in and the token out (2 one-way delays: the orchestrator on the same network);
# unsplit: one process, its own
TTFT_OVERHEAD = Overhead(constant_s=0.01, per_stage_s=0.003, delay_hops=2.0, unsplit_s=0.004)
TPOT_OVERHEAD = Overhead(constant_s=0.001, per_stage_s=0.0005, delay_hops=0.0, unsplit_s=0.0002)


def truth(
    delay_hops: float = TTFT_OVERHEAD.delay_hops,
    wake: Wake = WAKE,
    wake_s: float = DECODE["wake"],
    prefill: dict[str, float] = PREFILL,
) -> Fit:
    ttft = replace(TTFT_OVERHEAD, delay_hops=delay_hops)
    decode = {**DECODE, "wake": wake_s}
    return Fit(dict(LINKS), dict(RTT), dict(prefill), decode, ttft, TPOT_OVERHEAD, [], wake=wake)


def decode_call(model: Fit, blocks: int, first: bool, last: bool, context: int, tpot: float) -> tuple[float, float]:
    """A stage's decode call and its idle gap in a pipeline making a token every ``tpot``: the
    gap is the token's time less the call (solved by iteration)."""
    call = model.decode_stage_s(blocks, first, last, context)
    for _ in range(100):
        call = model.decode_stage_s(blocks, first, last, context, tpot - call)
    return call, tpot - call


def synthetic_grid(
    noise: float = 0.005,
    seed: int = 16,
    wires: tuple[str, ...] = ("bf16",),
    delay_hops: float = 2.0,
    model: Fit | None = None,
) -> Grid:
    """Every point the true model's, each sample off by ``noise`` (relative, Gaussian); every
    seventh point held out."""
    rng = random.Random(seed)
    model = truth(delay_hops) if model is None else model

    def jitter(x: float) -> float:
        return x * (1 + rng.gauss(0, noise))

    points = []
    for network, link in LINKS.items():
        for stages in (1, 2, 3, 4):
            for wire in wires:
                for prompt in (16, 128, 512):
                    wb = WIRE_BYTES[wire]
                    hops, compute = [], []
                    pred = model.predict(stages, link, prompt, wire, DIM, BLOCKS, DPH)
                    for stage, (blocks, first, last) in enumerate(stage_shapes(BLOCKS, stages)):
                        t = model.prefill_stage_s(blocks, first, last, prompt)
                        compute.append(StageSample(stage, blocks, first, last, "prefill", prompt, jitter(t)))
                        for k in range(GENERATED):
                            t, idle = decode_call(model, blocks, first, last, prompt + k, pred.tpot_s)
                            sample = StageSample(stage, blocks, first, last, "decode", 1, jitter(t), prompt + k, idle)
                            compute.append(sample)
                    if stages > 1:
                        hops += [
                            HopSample("prefill", prompt * DIM * wb, jitter(link.hop(prompt * DIM * wb)))
                            for _ in range(stages - 1)
                        ]
                        for _ in range(GENERATED):
                            hops += [
                                HopSample("decode", DIM * wb, jitter(link.hop(DIM * wb))) for _ in range(stages - 1)
                            ]
                            hops.append(HopSample("decode", 8, jitter(link.hop(8))))  # the token back
                    points.append(
                        Point(
                            network,
                            RTT[network],
                            stages,
                            wire,
                            prompt,
                            DIM,
                            BLOCKS,
                            ttft_s=[jitter(pred.ttft_s) for _ in range(3)],
                            tpot_s=[jitter(pred.tpot_s) for _ in range(3)],
                            hops=hops,
                            compute=compute,
                            dph=[DPH] * stages,
                        )
                    )
    return Grid("synthetic", "cpu", "test", "now", points, held_out=list(range(3, len(points), 7)))


@pytest.fixture(scope="module")
def grid() -> Grid:
    return synthetic_grid()


@pytest.fixture(scope="module")
def fitted(grid: Grid) -> Fit:
    return fit(grid)


def close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)


def test_split_is_the_specs() -> None:
    assert [layer_range(30, s, 4) for s in range(4)] == [(0, 7), (7, 14), (14, 21), (21, 30)]
    assert stage_shapes(5, 2) == [(2, True, False), (3, False, True)]
    assert stage_shapes(5, 1) == [(5, True, True)]
    with pytest.raises(ValueError, match="5 stages need at least as many blocks; the model has 4"):
        layer_range(4, 0, 5)


def test_fit_recovers_the_links(grid: Grid, fitted: Fit) -> None:
    assert set(fitted.links) == set(LINKS)
    assert fitted.fitted == [i for i in range(len(grid.points)) if i not in grid.held_out]
    for name, link in LINKS.items():
        got = fitted.links[name]
        assert close(got.alpha_s, link.alpha_s, 0.03), (name, got, link)
        assert close(got.beta_Bps, link.beta_Bps, 0.05), (name, got, link)
    assert fitted.rtt_ms == RTT


def test_fit_recovers_the_compute(fitted: Fit) -> None:
    for key in ("block", "block_t", "block_t2"):
        assert close(fitted.prefill[key], PREFILL[key], 0.05), (key, fitted.prefill[key], PREFILL[key])
    assert close(fitted.decode["block"], DECODE["block"], 0.03), fitted.decode
    assert close(fitted.decode["block_ctx"], DECODE["block_ctx"], 0.05), fitted.decode
    assert close(fitted.decode["wake"], DECODE["wake"], 0.05), fitted.decode
    assert abs(fitted.wake.from_s - WAKE.from_s) <= 0.02 and abs(fitted.wake.to_s - WAKE.to_s) <= 0.05, fitted.wake
    assert fitted.wake.per == "call"
    # a wake-up that grows with the stage's blocks (its weights to bring back) is told apart
    per_block = fit(synthetic_grid(seed=5, model=truth(wake=Wake(0.05, 0.15, "block"), wake_s=0.0008)))
    assert per_block.wake.per == "block" and close(per_block.decode["wake"], 0.0008, 0.05), per_block.wake
    # head, embedding and the per-call constant trade off within the noise; each stage's sum must not
    model = truth()
    for stages in (1, 2, 3, 4):
        for blocks, first, last in stage_shapes(BLOCKS, stages):
            for prompt in (16, 100, 512):
                want = model.prefill_stage_s(blocks, first, last, prompt)
                assert close(fitted.prefill_stage_s(blocks, first, last, prompt), want, 0.03), (stages, prompt)
            for context, idle in ((0, 0.0), (500, 0.0), (100, 0.2), (100, 0.5)):
                want = model.decode_stage_s(blocks, first, last, context, idle)
                got = fitted.decode_stage_s(blocks, first, last, context, idle)
                assert close(got, want, 0.02), (stages, blocks, context, idle)
    ttft, tpot = fitted.ttft_overhead, fitted.tpot_overhead
    assert close(ttft.delay_hops, TTFT_OVERHEAD.delay_hops, 0.05), ttft
    assert tpot.delay_hops == 0.0, tpot  # decode's ring does not pass the orchestrator: not fitted
    for got, want in ((ttft, TTFT_OVERHEAD), (tpot, TPOT_OVERHEAD)):
        # within the noise of the medians they are fitted to: 0.5% of ttft (~0.1-3 ms), of tpot (~0.1-1 ms)
        for stages in (1, 2, 4):
            assert abs(got.at(stages, 0.02) - want.at(stages, 0.02)) < 2e-3, (stages, got, want)
        assert abs(got.per_stage_s - want.per_stage_s) < 1e-3, (got, want)
    assert not fitted.notes, fitted.notes


def test_delays_outside_the_stages_are_fitted() -> None:
    """Where the orchestrator's links are not the stages' (time to first token does not grow with
    the stages' delay beyond their hops), the fit finds no such delays and still predicts."""
    grid = synthetic_grid(delay_hops=0.0, seed=3)
    f = fit(grid)
    assert f.ttft_overhead.delay_hops < 0.05, f.ttft_overhead
    assert abs(f.ttft_overhead.at(3, 0.06) - TTFT_OVERHEAD.at(3, 0.0)) < 2e-3, f.ttft_overhead
    held = f.held_out_errors(grid)
    assert held.ttft_max is not None and held.ttft_max < 0.03, held.to_json()


def test_held_out_errors_are_small(grid: Grid, fitted: Fit) -> None:
    held = fitted.held_out_errors(grid)
    assert [r.index for r in held.rows] == grid.held_out
    assert held.ttft_max is not None and held.tpot_max is not None
    assert held.ttft_max < 0.03 and held.tpot_max < 0.03, held.to_json()
    assert held.ttft_median is not None and held.ttft_median <= held.ttft_max
    row = held.rows[0]
    p = grid.points[row.index]
    assert row.ttft_meas_s == sorted(p.ttft_s)[1] and row.tpot_meas_s == sorted(p.tpot_s)[1]
    assert row.ttft_err == pytest.approx(abs(row.ttft_pred_s - row.ttft_meas_s) / row.ttft_meas_s)
    # a fit that saw everything still answers for the held-out points; one that saw none is not a fit
    assert fit(grid, exclude=[]).fitted == list(range(len(grid.points)))
    with pytest.raises(ValueError, match="no points to fit: the grid has 36, 36 excluded"):
        fit(grid, exclude=range(len(grid.points)))


def test_holding_out_a_prompt_length_stays_within_the_goal(grid: Grid) -> None:
    """Holding out every point of the middle prompt length leaves the fit two lengths: no room for
    attention's quadratic term (a note says so), and still within 20% (the grid's goal)."""
    middle = replace(grid, held_out=[i for i, p in enumerate(grid.points) if p.prompt_tokens == 128])
    f = fit(middle)
    assert len(f.notes) == 1 and f.notes[0].startswith("prefill: 2 distinct prompt length(s): fitted without block_t2 ")
    assert f.prefill["block_t2"] == 0.0
    held = f.held_out_errors(middle)
    assert len(held.rows) == 12 and held.ttft_max is not None and held.tpot_max is not None
    assert held.ttft_max < 0.2 and held.tpot_max < 0.05, held.to_json()


def test_the_wake_up_is_what_makes_slow_links_slower(grid: Grid, fitted: Fit, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage idle for long before its call pays a wake-up: without that term the fit spreads it
    over every call, and the held-out points of the quiet link and the slow one both miss; a grid
    that did not measure the idle gaps says so and fits without it."""
    import pytest_ppsmoke.layout.fit as fit_module

    with_wake = fitted.held_out_errors(grid)
    monkeypatch.setattr(fit_module, "WAKE_MIN_GAIN", 1.01)  # never worth it: the term left out
    blind = fit(grid)
    assert blind.wake == Wake() and blind.decode["wake"] == 0.0
    assert any(n.startswith("decode: no wake-up ramp over the idle gaps") for n in blind.notes), blind.notes
    without = blind.held_out_errors(grid)
    assert with_wake.tpot_max is not None and without.tpot_max is not None
    assert without.tpot_max > 3 * with_wake.tpot_max, (without.tpot_max, with_wake.tpot_max)
    monkeypatch.undo()
    unmeasured = replace(
        grid,
        points=[replace(p, compute=[replace(c, idle_s=0.0) for c in p.compute]) for p in grid.points],
    )
    f = fit(unmeasured)
    assert f.wake == Wake() and any("idle gaps span 0 ms (< 50): no wake-up term" in n for n in f.notes), f.notes


def test_the_time_per_token_solves_for_the_wake_up() -> None:
    """Each stage waits the token's time less its own call, and a long wait makes its call slower:
    the predicted time per token is the fixed point of the two, by hand for two stages."""
    f = hand_fit()
    f.decode = {"block": 1e-3, "block_ctx": 1e-6, "head": 0.0, "embed": 0.0, "call": 0.0, "wake": 0.01}
    f.wake = Wake(0.0, 1.0)  # 0.01 ms more a call per ms idle, up to 10 ms
    f.tpot_overhead = Overhead()
    tpot = f.predict(2, "rtt=100ms", 100, "bf16", 64, 10, 1.0).tpot_s  # 5 blocks a stage, 2 x 50 ms hops
    call = 5 * (1e-3 + 1e-6 * 100)  # 5.5 ms without the wake-up
    # tpot = 2 (call + wake) + 0.1 with wake = 0.01 (tpot - call - wake), below the cap
    wake = 0.01 * (tpot - call) / 1.01
    assert wake < 0.01 and tpot == pytest.approx(2 * (call + wake) + 0.1, abs=1e-6)
    # idle past the ramp: the whole wake-up, whatever the wait
    f.wake = Wake(0.0, 0.01)
    far = f.predict(2, "rtt=200ms", 100, "bf16", 64, 10, 1.0).tpot_s
    assert far == pytest.approx(2 * (call + 0.01) + 0.2, abs=1e-6)
    assert f.predict(1, "rtt=200ms", 100, "bf16", 64, 10, 1.0).tpot_s == pytest.approx(2 * call)  # never idle


def test_a_block_never_gets_faster_with_a_longer_prompt() -> None:
    """Noise that bends the prefill curve down (a GPU's host-bound calls) must not make the model
    predict a longer prompt faster: the negative growth term is dropped, and the note says so."""
    bent = {**PREFILL, "block_t2": -2e-8}  # slower at 16 than at 512 tokens past ~500: not physical
    f = fit(synthetic_grid(seed=9, model=truth(prefill=bent)))
    assert f.prefill["block_t2"] == 0.0 and f.prefill["block_t"] > 0, f.prefill
    assert any(n.startswith("prefill: the fitted block_t2 is negative") for n in f.notes), f.notes
    times = [f.predict(2, "loopback", p, "bf16", DIM, BLOCKS, DPH).ttft_s for p in (16, 128, 256, 512, 1024)]
    assert times == sorted(times), times


def test_the_fit_survives_json(grid: Grid, fitted: Fit) -> None:
    back = Fit.from_json(json.loads(json.dumps(fitted.to_json(), allow_nan=False)))
    assert back == fitted
    free = Fit(
        {"x": Link(0.001)},
        {"x": 1.0},
        dict(PREFILL),
        dict(DECODE),
        Overhead(),
        Overhead(1, 2, 3, 4),
        [0],
        {"x": 2},
        ["note"],
    )  # an unmeasurable bandwidth is null in JSON, inf again after
    assert Fit.from_json(json.loads(json.dumps(free.to_json(), allow_nan=False))) == free
    with pytest.raises(ValueError, match="not a saved fit: KeyError 'links'"):
        Fit.from_json({"prefill": {}})


def hand_fit() -> Fit:
    return Fit(
        links={"wan": Link(0.02, 1e8)},
        rtt_ms={"wan": 40.0},
        prefill=dict.fromkeys(PREFILL, 0.0) | {"block": 0.001, "head": 0.002, "embed": 0.0005},
        decode={"block": 1e-4, "head": 2e-3, "embed": 1e-4, "call": 5e-4},
        ttft_overhead=Overhead(0.01, 0.0, 0.0, 0.01),
        tpot_overhead=Overhead(0.002, 0.0, 0.0, 0.002),
        fitted=[],
    )


def test_predict_arithmetic_by_hand() -> None:
    f = hand_fit()
    # one stage: 5 blocks, the head and the embedding, no hops
    one = f.predict(1, "wan", 100, "bf16", 64, 5, 1.8)
    assert one.ttft_s == pytest.approx(5 * 0.001 + 0.002 + 0.0005 + 0.01)
    assert one.tpot_s == pytest.approx(5 * 1e-4 + 2e-3 + 1e-4 + 5e-4 + 0.002)
    assert one.chip_seconds_per_token == pytest.approx(one.tpot_s)
    assert one.usd_per_token == pytest.approx(1.8 / 3600 * one.tpot_s)
    # two stages: 2 blocks + embedding | 3 blocks + head; one activation hop of 100 x 64 x 2 bytes
    # for prefill; per token one activation of 64 x 2 bytes and the token back
    two = f.predict(2, "wan", 100, "bf16", 64, 5, 1.8)
    assert f.prefill_stage_s(2, True, False, 100) == pytest.approx(2e-3 + 5e-4)  # the first: the embedding
    assert f.prefill_stage_s(3, False, True, 100) == pytest.approx(3e-3 + 2e-3)  # the last: the head
    assert f.decode_stage_s(3, False, True) == pytest.approx(3e-4 + 2e-3 + 5e-4)
    assert two.ttft_s == pytest.approx((2e-3 + 5e-4) + (3e-3 + 2e-3) + (0.02 + 12800 / 1e8) + 0.01)
    assert two.tpot_s == pytest.approx((2e-4 + 1e-4 + 5e-4) + (3e-4 + 2e-3 + 5e-4) + 2 * (0.02 + 128 / 1e8) + 0.002)
    assert two.chip_seconds_per_token == pytest.approx(2 * two.tpot_s)
    assert two.usd_per_token == pytest.approx(2 * 1.8 / 3600 * two.tpot_s)
    # f32 doubles the bytes; a described network is as good as a fitted one
    assert f.predict(2, "wan", 100, "f32", 64, 5, 1.8).ttft_s == pytest.approx(two.ttft_s + 12800 / 1e8)
    assert f.predict(2, "rtt=40ms,bw=800mbit", 100, "bf16", 64, 5, 1.8) == two
    # the overheads: per stage, per one-way delay (the request in, the first token out); unsplit its own
    f.ttft_overhead = Overhead(0.01, 0.003, 2.0, 0.004)
    f.tpot_overhead = Overhead(0.002, 0.0005, 0.0, 0.0001)
    assert f.predict(2, "wan", 100, "bf16", 64, 5, 1.8).ttft_s == pytest.approx(two.ttft_s + 2 * 0.003 + 2 * 0.02)
    assert f.predict(2, "wan", 100, "bf16", 64, 5, 1.8).tpot_s == pytest.approx(two.tpot_s + 2 * 0.0005)
    assert f.predict(1, "rtt=10ms", 100, "bf16", 64, 5, 1.8).ttft_s == pytest.approx(one.ttft_s - 0.01 + 0.004)
    assert f.predict(1, "wan", 100, "bf16", 64, 5, 1.8).tpot_s == pytest.approx(one.tpot_s - 0.002 + 0.0001)


def test_link_descriptions() -> None:
    assert Link.parse("rtt=40ms,bw=1gbit") == Link(0.02, 1.25e8)
    assert Link.parse("delay=5ms, bw=100MB/s") == Link(0.005, 1e8)
    assert Link.parse("rtt=0.1s") == Link(0.05, math.inf)
    assert Link.parse("rtt=40") == Link(0.02)  # milliseconds unless told
    assert Link(0.01, 1e6).hop(1e6) == pytest.approx(1.01)
    for bad, message in [
        ("rtt=40parsecs", "rtt='40parsecs': expected a number with a unit"),
        ("bw=fast", "bw='fast': expected a number with a unit"),
        ("jitter=1ms", "'jitter=1ms' is not one of rtt=..., delay=..., bw=..."),
        ("rtt=40ms,rtt=50ms", "'rtt=50ms' is not one of"),
        ("rtt=40ms,delay=20ms", "give rtt .* or delay .*, not both"),
        ("bw=0gbit", "bw must be > 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            Link.parse(bad)
    with pytest.raises(ValueError, match="alpha_s=-1"):
        Link(-1)
    with pytest.raises(ValueError, match="beta_Bps=0"):
        Link(0.0, 0)


def test_predict_names_bad_inputs(fitted: Fit) -> None:
    f = hand_fit()
    for kwargs, message in [
        ({"network": "mars"}, r"network 'mars' has no fitted link; fitted: \['wan'\]"),
        ({"wire": "int4"}, "wire 'int4': expected one of"),
        ({"stages": 6}, "6 stages need at least as many blocks; the model has 5"),
        ({"stages": 0}, "stages=0: expected at least 1"),
        ({"prompt_tokens": 0}, "prompt_tokens=0: expected at least 1"),
        ({"dph_per_instance": -1.0}, "dph_per_instance=-1.0: expected a finite number >= 0"),
        ({"network": "rtt=fast"}, "rtt='fast'"),
    ]:
        args = {"stages": 2, "network": "wan", "prompt_tokens": 10, "wire": "bf16", "dim": 8, "num_blocks": 5}
        with pytest.raises(ValueError, match=message):
            f.predict(**(args | {"dph_per_instance": 1.0} | kwargs))  # type: ignore[arg-type]
    # the unsplit layout (one process) needs no link: any name will do
    assert f.predict(1, "mars", 10, "bf16", 8, 5, 1.0).ttft_s > 0


def test_fit_names_bad_grids(grid: Grid) -> None:
    def one(**changes: object) -> Grid:
        p = grid.points[5]
        return Grid("m", "cpu", "t", "now", [replace(p, **changes), *grid.points[:4]])  # type: ignore[arg-type]

    with pytest.raises(ValueError, match=r"network 'moon': 1 hop sample\(s\) over 1 split point\(s\) .*too few"):
        fit(one(network="moon", stages=2, hops=[HopSample("decode", 8, 0.1)]))
    with pytest.raises(ValueError, match=r"point 0 \('loopback', 2, 'bf16', 512\) ttft_s: no repeats measured"):
        fit(one(ttft_s=[]))
    with pytest.raises(ValueError, match="wire 'fp8' is not one of"):
        fit(one(wire="fp8"))
    with pytest.raises(ValueError, match="excluded point 99: the grid has 36 points"):
        fit(grid, exclude=[99])
    with pytest.raises(ValueError, match="held-out index 77: the grid has 36 points"):
        fit(grid).held_out_errors(Grid("m", "cpu", "t", "now", grid.points, held_out=[77]))
    prefill_only = [replace(p, compute=[c for c in p.compute if c.phase == "prefill"]) for p in grid.points]
    no_decode = Grid("m", "cpu", "t", "now", prefill_only)
    with pytest.raises(ValueError, match="no decode stage samples in the fitted points"):
        fit(no_decode)


def test_degenerate_links_and_prompts_are_noted(grid: Grid) -> None:
    flat = [
        replace(p, hops=[HopSample(h.phase, 100, 0.02) for h in p.hops])
        for p in grid.points
        if p.network == "wan" and p.prompt_tokens == 128
    ]
    f = fit(Grid("m", "cpu", "t", "now", flat))
    assert f.links["wan"] == Link(0.02)
    assert any("every hop carried 100 bytes" in n for n in f.notes), f.notes
    assert any("1 distinct prompt length(s): fitted without block_t, block_t2, head_t, embed_t" in n for n in f.notes)
    unsplit = fit(Grid("m", "cpu", "t", "now", [p for p in grid.points if p.stages == 1 or p.network != "far"]))
    assert "far" not in unsplit.links and "far: only unsplit points: no link fitted" in unsplit.notes
    with pytest.raises(ValueError, match=r"network 'far' has no fitted link \(its points were all unsplit"):
        unsplit.predict(2, "far", 16, "bf16", DIM, BLOCKS, 0.0)
    split_only = fit(Grid("m", "cpu", "t", "now", [p for p in grid.points if p.stages > 1]))
    assert "time to first token: no unsplit point fitted: its overhead is the split layouts' line at 1 stage" in (
        split_only.notes
    )
    assert split_only.ttft_overhead.unsplit_s == pytest.approx(
        split_only.ttft_overhead.constant_s + split_only.ttft_overhead.per_stage_s
    )


def test_pareto_frontier_by_hand() -> None:
    pairs = [(1, 10), (2, 5), (3, 7), (2, 5), (4, 1), (5, 1), (0.5, 20), (3, 4)]
    assert pareto_frontier(pairs) == [6, 0, 1, 7, 4]
    assert pareto_frontier([]) == []
    assert pareto_frontier([(1.0, 1.0)]) == [0]


def test_recommendations_pick_fastest_and_cheapest() -> None:
    rows = [  # two stages decode faster, one stage costs less per token
        Row("wan", 1, "bf16", 64, 0.20, 0.010, 0.010, 0.010 * 2 / 3600, 0.20 * 2 / 3600 / 64),
        Row("wan", 2, "bf16", 64, 0.15, 0.006, 0.012, 0.012 * 2 / 3600, 2 * 0.15 * 2 / 3600 / 64),
    ]
    recs = {(r["phase"], r["objective"]): r for r in recommendations(rows)}
    assert recs["decode", "latency"]["stages"] == 2 and recs["decode", "cost"]["stages"] == 1
    assert recs["prefill", "latency"]["stages"] == 2 and recs["prefill", "cost"]["stages"] == 1
    assert recs["prefill", "latency"]["prompt_tokens"] == 64 and recs["decode", "cost"]["prompt_tokens"] is None
    assert recs["decode", "latency"]["latency_s"] == 0.006


def test_report_is_written(grid: Grid, fitted: Fit, tmp_path: Path) -> None:
    paths = write_report(grid, fitted, tmp_path)
    assert [p.name for p in paths] == [
        "layout.json",
        "layout.md",
        "ttft_vs_prompt.png",
        "tpot_vs_delay.png",
        "cost_vs_latency.png",
    ]
    for p in paths[2:]:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000, p
    data = json.loads(paths[0].read_text())
    assert Grid.from_json(data["grid"]) == grid and Fit.from_json(data["fit"]) == fitted
    assert data["held_out"]["ttft_max"] < 0.03
    assert len(data["predictions"]) == 3 * 4 * 3  # networks x stages x prompt lengths, one wire
    # every phase and network has its fastest and cheapest layout, and the Markdown names them
    recs = data["recommendations"]
    assert {(r["phase"], r["network"], r["prompt_tokens"], r["objective"]) for r in recs} == {
        (phase, n, p, o)
        for n in LINKS
        for phase, p in [*(("prefill", p) for p in (16, 128, 512)), ("decode", None)]
        for o in ("latency", "cost")
    }
    md = paths[1].read_text()
    by_row = {}
    for r in recs:
        by_row.setdefault((r["phase"], r["network"], r["prompt_tokens"]), {})[r["objective"]] = r
    for (phase, network, prompt), v in by_row.items():
        fastest = layout_name(v["latency"]["stages"], v["latency"]["wire"])
        cheapest = layout_name(v["cost"]["stages"], v["cost"]["wire"])
        line = f"| {phase} | {network} | {'-' if prompt is None else prompt} | {fastest} |"
        assert any(ln.startswith(line) and f"| {cheapest} |" in ln for ln in md.splitlines()), (line, cheapest)
    assert "| wan | 40.0 | 20.0" in md  # the fitted link: alpha 20 ms
    assert f"- time to first token: {fitted.ttft_overhead.describe()}" in md
    assert "Time to first token: max error" in md and "![cost_vs_latency.png](cost_vs_latency.png)" in md
    with pytest.raises(ValueError, match=r"the grid mixes model shapes \(dim, num_blocks\)"):
        write_report(Grid("m", "c", "t", "w", [*grid.points, replace(grid.points[0], dim=8)]), fitted, tmp_path)


def test_a_runner_shaped_grid(tmp_path: Path) -> None:
    """The grid runner's shape: the unsplit model measured once (its wire is moot) and copied to
    every network, the split layouts in two wires, a whole prompt length held out. The unsplit
    layout is one layout, named without a wire; the report and its plots are written."""
    both = synthetic_grid(wires=("bf16", "f32"), seed=5)
    points = [p for p in both.points if p.stages > 1 or p.wire == "f32"]
    grid = Grid("m", "cpu", "t", "now", points, [i for i, p in enumerate(points) if p.prompt_tokens == 128])
    assert layouts(grid) == [(1, "f32"), *((s, w) for s in (2, 3, 4) for w in ("bf16", "f32"))]
    assert [layout_name(s, w) for s, w in layouts(grid)[:3]] == ["1 stage", "2 stages, bf16", "2 stages, f32"]
    f = fit(grid)
    held = f.held_out_errors(grid)
    assert held.ttft_max is not None and held.ttft_max < 0.2, held.to_json()
    paths = write_report(grid, f, tmp_path)
    data = json.loads(paths[0].read_text())
    assert len(data["predictions"]) == 3 * 7 * 3  # networks x layouts x prompt lengths
    md = paths[1].read_text()
    assert "| decode | far | - | 1 stage | " in md and "bf16" in md and "f32" in md


def test_decode_can_favour_more_stages_in_the_report(grid: Grid, tmp_path: Path) -> None:
    """A model whose stages cost less apart than together (a negative per-call term) recommends
    the split for latency, and still the single stage for cost."""
    f = truth()
    f.decode = DECODE | {"call": -0.002}
    f.links = {n: Link(0.0) for n in LINKS}
    write_report(grid, f, tmp_path, plots=False)
    recs = json.loads((tmp_path / "layout.json").read_text())["recommendations"]
    decode = {(r["network"], r["objective"]): r["stages"] for r in recs if r["phase"] == "decode"}
    assert decode == {(n, o): 4 if o == "latency" else 1 for n in LINKS for o in ("latency", "cost")}, decode
    assert "| decode | far | - | 4 stages, bf16 |" in (tmp_path / "layout.md").read_text()


def test_predict_table(fitted: Fit) -> None:
    table = predict_table(fitted, "rtt=40ms,bw=1gbit", [1, 2, 4], [16, 512], "bf16", DIM, BLOCKS, DPH)
    lines = table.splitlines()
    assert lines[0].startswith("Predicted on rtt=40ms,bw=1gbit (one-way 20 ms, 125 MB/s)")
    rows = [ln for ln in lines if ln.startswith("| ") and ln[2].isdigit()]
    assert [ln.split(" | ")[:2] for ln in rows] == [[f"| {s}", str(p)] for s in (1, 2, 4) for p in (16, 512)]
    want = fitted.predict(4, Link(0.02, 1.25e8), 512, "bf16", DIM, BLOCKS, DPH)
    assert f"| 4 | 512 | {want.ttft_s * 1e3:.2f} | {want.tpot_s * 1e3:.2f} |" in table
    assert "Decode: fastest 1 stage (" in table and "cheapest 1 stage (" in table
    assert "predicted on wan" in predict_table(fitted, "wan", [2], [16], "bf16", DIM, BLOCKS, DPH).lower()
    with pytest.raises(ValueError, match="network 'mars' has no fitted link"):
        predict_table(fitted, "mars", [2], [16], "bf16", DIM, BLOCKS, DPH)
    with pytest.raises(ValueError, match=r"stages \[\] and prompt lengths \[16\]: need one of each"):
        predict_table(fitted, "wan", [], [16], "bf16", DIM, BLOCKS, DPH)


def test_holding_out_the_largest_stage_count_extrapolates_in_stages(grid: Grid) -> None:
    """``largest`` holds out every point of the largest split stage count, on every network at
    every prompt length, and nothing else; ``stages=N`` any one; the fit without them predicts
    them (the synthetic grid is the model's own, so within its noise)."""
    largest = hold_out(grid.points, "largest")
    assert largest == [i for i, p in enumerate(grid.points) if p.stages == 4]
    assert len(largest) == len(LINKS) * 3  # every network, every prompt length
    assert hold_out(grid.points, "stages=3") == [i for i, p in enumerate(grid.points) if p.stages == 3]
    held = replace(grid, held_out=largest)
    assert {p.stages for i, p in enumerate(grid.points) if i not in largest} == {1, 2, 3}
    errors = fit(held).held_out_errors(held)
    assert {(r.network, r.stages) for r in errors.rows} == {(n, 4) for n in LINKS}
    assert errors.ttft_max is not None and errors.tpot_max is not None
    assert errors.ttft_max < 0.03 and errors.tpot_max < 0.03, errors.to_json()
    two = [p for p in grid.points if p.stages <= 2]
    with pytest.raises(ValueError, match=r"largest: needs two split stage counts, the grid has \[2\]"):
        hold_out(two, "largest")
    with pytest.raises(ValueError, match=r"'stages=5': the grid's split stage counts are \[2, 3, 4\]"):
        hold_out(grid.points, "stages=5")
    with pytest.raises(ValueError, match="'stages=x': expected stages=N"):
        hold_out(grid.points, "stages=x")


def test_ramps_the_gaps_cannot_tell_apart_are_chosen_by_the_data_not_by_rounding(grid: Grid) -> None:
    """Without the 4-stage points the largest idle gap fitted is ~0.23 s, so every ramp from 0.12 s
    that ends past it fits the calls exactly as well (its wake-up scaled to the same slope); their
    squared errors differ only in the last bits, which move with the order of the rows (and with
    the processor's BLAS kernels). The fit takes the one that ends soonest, whatever the order."""
    held = replace(grid, held_out=hold_out(grid.points, "largest"))
    wakes = set()
    for seed in range(8):
        rng = random.Random(seed)
        shuffled = [replace(p, compute=rng.sample(p.compute, len(p.compute))) for p in held.points]
        got = fit(replace(held, points=shuffled))
        wakes.add((got.wake, round(got.decode["wake"], 6)))
    assert len(wakes) == 1, wakes
    ((wake, seconds),) = wakes
    assert wake.per == "call" and abs(wake.from_s - WAKE.from_s) < 1e-9, wake
    assert abs(wake.to_s - WAKE.to_s) < 1e-9 and close(seconds, DECODE["wake"], 0.01), (wake, seconds)


def test_predict_warns_beyond_the_grid_and_not_within(grid: Grid, fitted: Fit) -> None:
    """A stage count or prompt length outside what the fitted points measured is an extrapolation:
    one line each, naming the value and the range; inside it (measured or between), none."""
    assert beyond_the_grid(grid, [1, 2, 3, 4], [16, 100, 512]) == []
    warnings = beyond_the_grid(grid, [2, 8, 8], [16, 1024])
    assert warnings == [
        "stage count 8 is outside the grid's fitted stage counts 1-4: the prediction extrapolates",
        "prompt length 1024 is outside the grid's fitted prompt lengths 16-512 tokens: the prediction extrapolates",
    ]
    assert beyond_the_grid(grid, [1], [8]) == [
        "prompt length 8 is outside the grid's fitted prompt lengths 16-512 tokens: the prediction extrapolates"
    ]
    # held-out points are not what the fit measured: without the 4-stage points, 4 extrapolates
    held = replace(grid, held_out=hold_out(grid.points, "largest"))
    assert beyond_the_grid(held, [3, 4], [128]) == [
        "stage count 4 is outside the grid's fitted stage counts 1-3: the prediction extrapolates"
    ]
    table = predict_table(fitted, "wan", [2, 8], [128, 1024], "bf16", DIM, BLOCKS, DPH, grid)
    assert "| 8* | 128 |" in table and "| 2 | 1024* |" in table and "| 2 | 128 |" in table
    assert "Values marked * lie outside the grid's fitted range (stage counts 1-4, prompt lengths 16-512" in table
    inside = predict_table(fitted, "wan", [2, 3], [128], "bf16", DIM, BLOCKS, DPH, grid)
    assert "*" not in inside and "extrapolates" not in inside


def test_predict_takes_any_stage_count_the_model_can_hold(fitted: Fit) -> None:
    table = predict_table(fitted, "wan", [8, BLOCKS], [128], "bf16", DIM, BLOCKS, DPH)
    assert "| 8 | 128 |" in table and f"| {BLOCKS} | 128 |" in table
    with pytest.raises(ValueError, match=rf"stages={BLOCKS + 1}: expected 1 to {BLOCKS}, the model's blocks"):
        predict_table(fitted, "wan", [2, BLOCKS + 1], [128], "bf16", DIM, BLOCKS, DPH)
    with pytest.raises(ValueError, match=rf"stages=0: expected 1 to {BLOCKS}"):
        predict_table(fitted, "wan", [0], [128], "bf16", DIM, BLOCKS, DPH)
    with pytest.raises(ValueError, match="prompt length 0: expected at least 1 token"):
        predict_table(fitted, "wan", [2], [0], "bf16", DIM, BLOCKS, DPH)


def test_pp_layout_predict_warns_on_stderr_and_rejects_too_many_stages(
    grid: Grid, fitted: Fit, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "layout.json"
    saved.write_text(json.dumps({"grid": grid.to_json(), "fit": fitted.to_json()}))
    main(["predict", str(saved), "--network", "wan", "--stages", "2,8", "--prompts", "128"])
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        "pp-layout predict: warning: stage count 8 is outside the grid's fitted stage counts 1-4: "
        "the prediction extrapolates"
    ]
    assert "| 8* | 128 |" in out
    main(["predict", str(saved), "--network", "wan", "--stages", "2,3", "--prompts", "128"])
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as exit_:
        main(["predict", str(saved), "--network", "wan", "--stages", f"4,{BLOCKS + 1}"])
    assert exit_.value.code == 1
    assert f"pp-layout predict: stages={BLOCKS + 1}: expected 1 to {BLOCKS}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(saved), "--out", str(tmp_path), "--hold-out", "stages=1"])
    assert exit_.value.code == 2


def test_the_held_out_points_are_layouts_never_run_on_their_network(grid: Grid) -> None:
    """By default the fit must not see, on each network, one split stage count (another on each
    network in turn), at every prompt length; with one split stage count, the middle prompt length."""
    held = hold_out(grid.points)
    cells = {(grid.points[i].network, grid.points[i].stages) for i in held}
    assert cells == {("loopback", 3), ("wan", 4), ("far", 2)}
    assert len(held) == 3 * 3  # every prompt length of each
    seen = [p for i, p in enumerate(grid.points) if i not in held]
    assert {p.network for p in seen} == set(LINKS) and {p.stages for p in seen} == {1, 2, 3, 4}
    f = fit(replace(grid, held_out=held))
    errors = f.held_out_errors(replace(grid, held_out=held))
    assert errors.ttft_max is not None and errors.tpot_max is not None
    assert errors.ttft_max < 0.03 and errors.tpot_max < 0.03, errors.to_json()
    assert hold_out(grid.points, "prompt") == [i for i, p in enumerate(grid.points) if p.prompt_tokens == 128]
    two = [p for p in grid.points if p.stages <= 2]
    assert hold_out(two) == [i for i, p in enumerate(two) if p.prompt_tokens == 128]  # one split count
    assert hold_out([p for p in two if p.prompt_tokens != 128]) == []  # and two lengths: nothing to spare
    with pytest.raises(ValueError, match="hold-out scheme 'random': expected one of layouts, prompt, largest"):
        hold_out(grid.points, "random")

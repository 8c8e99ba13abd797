"""The layout report: what the grid measured, what the fit makes of it, which layout to rent for
each phase and network, as JSON (``layout.json``), Markdown (``layout.md``) and PNG plots.

A layout is a stage count and a wire dtype. Latency is time to first token for prefill and time
per output token for decode; cost is dollars per token (per prompt token for prefill), or
chip-seconds per token where the grid's instances cost nothing (the emulator's free offers):
with every instance at one price the two rank layouts alike."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pytest_ppsmoke.layout.fit import Fit, Link
from pytest_ppsmoke.layout.points import Grid, Point

PLOTS = ("ttft_vs_prompt.png", "tpot_vs_delay.png", "cost_vs_latency.png")


def pareto_frontier(pairs: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the (latency, cost) pairs no other pair beats on both (at least as good on
    each, better on one), in order of latency; of equal pairs, the first."""
    order = sorted(range(len(pairs)), key=lambda i: (pairs[i][0], pairs[i][1], i))
    out: list[int] = []
    best = math.inf
    for i in order:
        if pairs[i][1] < best:
            out.append(i)
            best = pairs[i][1]
    return out


@dataclass(frozen=True)
class Row:
    """One predicted layout on one network at one prompt length."""

    network: str
    stages: int
    wire: str
    prompt_tokens: int
    ttft_s: float
    tpot_s: float
    chip_seconds_per_token: float
    usd_per_token: float
    usd_per_prompt_token: float  # the prefill's instances x time, over the prompt


def _networks(grid: Grid) -> list[str]:
    """The grid's networks, nearest first."""
    rtt: dict[str, float] = {}
    for p in grid.points:
        rtt[p.network] = max(rtt.get(p.network, 0.0), p.rtt_ms)
    return sorted(rtt, key=lambda n: (rtt[n], n))


def _shape(grid: Grid) -> tuple[int, int, float]:
    """(dim, num_blocks, dph per instance) of the grid's model and offers."""
    if not grid.points:
        raise ValueError("the grid has no points: nothing to report")
    shapes = {(p.dim, p.num_blocks) for p in grid.points}
    if len(shapes) != 1:
        raise ValueError(f"the grid mixes model shapes (dim, num_blocks) {sorted(shapes)}: one model per report")
    (dim, num_blocks) = shapes.pop()
    dphs = [d for p in grid.points for d in p.dph]
    return dim, num_blocks, float(statistics.median(dphs)) if dphs else 0.0


def _row(
    fit: Fit, network: Link | str, name: str, stages: int, wire: str, p: int, dim: int, nb: int, dph: float
) -> Row:
    pr = fit.predict(stages, network, p, wire, dim, nb, dph)
    return Row(
        name,
        stages,
        wire,
        p,
        pr.ttft_s,
        pr.tpot_s,
        pr.chip_seconds_per_token,
        pr.usd_per_token,
        stages * dph / 3600 * pr.ttft_s / p,
    )


def layout_name(stages: int, wire: str) -> str:
    """ "1 stage" (nothing crosses a wire), "2 stages, bf16"."""
    return "1 stage" if stages == 1 else f"{stages} stages, {wire}"


def layouts(grid: Grid) -> list[tuple[int, str]]:
    """The (stages, wire) layouts the grid ran; the unsplit one once, whatever its wire."""
    unsplit = sorted({p.wire for p in grid.points if p.stages == 1})[:1]
    return [(1, w) for w in unsplit] + sorted({(p.stages, p.wire) for p in grid.points if p.stages > 1})


def predictions(grid: Grid, fit: Fit) -> list[Row]:
    """The fit's prediction for every layout the grid ran on every network it ran, at each prompt
    length it ran; a network whose points were all unsplit has no link: only the unsplit layout."""
    dim, nb, dph = _shape(grid)
    rows = []
    for network in _networks(grid):
        for stages, wire in layouts(grid):
            if stages > 1 and network not in fit.links:
                continue
            for prompt in sorted({p.prompt_tokens for p in grid.points}):
                rows.append(_row(fit, network, network, stages, wire, prompt, dim, nb, dph))
    return rows


def _cost_key(r: Row, phase: str) -> tuple[float, float]:
    usd = r.usd_per_prompt_token if phase == "prefill" else r.usd_per_token
    chip = r.stages * (r.ttft_s / r.prompt_tokens if phase == "prefill" else r.tpot_s)
    return usd, chip  # free instances: the chip time decides


def recommendations(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Per phase and network (and prompt length, for prefill), the fastest layout and the cheapest.
    Decode's model does not depend on the prompt length: its rows are the longest prompt's."""
    out: list[dict[str, Any]] = []
    for network in dict.fromkeys(r.network for r in rows):  # in the rows' order
        mine = [r for r in rows if r.network == network]
        longest = max(r.prompt_tokens for r in mine)
        groups: list[tuple[str, int | None, list[Row]]] = [
            ("prefill", p, [r for r in mine if r.prompt_tokens == p]) for p in sorted({r.prompt_tokens for r in mine})
        ]
        groups.append(("decode", None, [r for r in mine if r.prompt_tokens == longest]))
        for phase, prompt, group in groups:
            fastest = min(group, key=lambda r: (r.ttft_s if phase == "prefill" else r.tpot_s, r.stages))
            cheapest = min(group, key=lambda r: _cost_key(r, phase))
            for objective, r in (("latency", fastest), ("cost", cheapest)):
                out.append(
                    {
                        "phase": phase,
                        "network": network,
                        "prompt_tokens": prompt,
                        "objective": objective,
                        "stages": r.stages,
                        "wire": r.wire,
                        "latency_s": r.ttft_s if phase == "prefill" else r.tpot_s,
                        "usd_per_token": _cost_key(r, phase)[0],
                        "chip_seconds_per_token": _cost_key(r, phase)[1],
                    }
                )
    return out


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _usd(x: float) -> str:
    return f"{x:.3g}"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
    ]


def _measured(p: Point) -> tuple[float, float, float]:
    """(ttft, tpot, usd per output token) of a point, medians of its repeats."""
    ttft, tpot = statistics.median(p.ttft_s), statistics.median(p.tpot_s)
    return ttft, tpot, sum(p.dph) / 3600 * tpot


def _markdown(grid: Grid, fit: Fit, held: dict[str, Any], recs: list[dict[str, Any]], plots: list[str]) -> str:
    lines = [
        f"# Layout report: {grid.model} on {grid.device}",
        "",
        f"Measured on {grid.machine} at {grid.when}: {len(grid.points)} points, "
        f"{len(fit.fitted)} fitted, {len(grid.held_out)} held out; {grid.weights} weights.",
        "",
        "## Recommended layouts",
        "",
        "Per phase and network: the layout with the lowest latency (time to first token for prefill, "
        "time per output token for decode) and the one with the lowest cost per token (per prompt token for "
        "prefill), by the fitted model.",
        "",
    ]
    by_key: dict[tuple[str, str, int | None], dict[str, dict[str, Any]]] = {}
    for r in recs:
        by_key.setdefault((r["phase"], r["network"], r["prompt_tokens"]), {})[r["objective"]] = r
    lines += _table(
        ["phase", "network", "prompt", "fastest", "latency ms", "cheapest", "$/token", "chip-s/token"],
        [
            [
                phase,
                network,
                "-" if prompt is None else prompt,
                layout_name(v["latency"]["stages"], v["latency"]["wire"]),
                _ms(v["latency"]["latency_s"]),
                layout_name(v["cost"]["stages"], v["cost"]["wire"]),
                _usd(v["cost"]["usd_per_token"]),
                f"{v['cost']['chip_seconds_per_token']:.3g}",
            ]
            for (phase, network, prompt), v in by_key.items()
        ],
    )
    lines += ["", "## Measured points", "", "Medians of the repeats; * marks a point held out of the fit.", ""]
    rows = []
    for i, p in enumerate(grid.points):
        ttft, tpot, usd = _measured(p)
        rows.append(
            [
                f"{i}{'*' if i in grid.held_out else ''}",
                p.network,
                p.rtt_ms,
                p.stages,
                p.wire,
                p.prompt_tokens,
                _ms(ttft),
                _ms(tpot),
                f"{1 / tpot:.1f}",
                _usd(usd),
                len(p.ttft_s),
            ]
        )
    lines += _table(
        ["#", "network", "rtt ms", "stages", "wire", "prompt", "ttft ms", "tpot ms", "tokens/s", "$/token", "repeats"],
        rows,
    )
    lines += ["", "## The fit", "", "Per link: hop time = alpha + bytes / beta.", ""]
    lines += _table(
        ["network", "rtt ms", "alpha ms", "beta MB/s", "hop samples"],
        [
            [
                name,
                fit.rtt_ms.get(name, "-"),
                f"{link.alpha_s * 1e3:.3f}",
                "inf" if math.isinf(link.beta_Bps) else f"{link.beta_Bps / 1e6:.1f}",
                fit.hop_samples.get(name, 0),
            ]
            for name, link in sorted(fit.links.items(), key=lambda kv: (fit.rtt_ms.get(kv[0], 0.0), kv[0]))
        ],
    )
    lines += [
        "",
        "Per stage call (seconds): prefill = blocks x (block + block_t T + block_t2 T^2) + last x (head + head_t T) "
        "+ first x (embed + embed_t T) + call, T the tokens of the call; decode per token = blocks x (block "
        "+ block_ctx C) + last x head + first x embed + call + wake x ramp(idle), C the position decoded, idle "
        "how long the stage waited since its previous call (a time per token is the fixed point: each stage "
        "waits the token's time less its own call).",
        "",
    ]
    lines += _table(["phase", *fit.prefill], [["prefill", *(f"{v:.4g}" for v in fit.prefill.values())]])
    lines += [""]
    lines += _table(["phase", *fit.decode], [["decode", *(f"{v:.4g}" for v in fit.decode.values())]])
    lines += ["", f"Wake-up: {fit.wake.describe(fit.decode.get('wake', 0.0))}."]
    lines += [
        "",
        "What the model leaves over (the orchestrator, the node <-> worker bridge, the event loops; for a split "
        "layout's first token also the request's way in and the token's way out, in one-way delays):",
        "",
        f"- time to first token: {fit.ttft_overhead.describe()}",
        f"- time per output token: {fit.tpot_overhead.describe()}",
        "",
        "## Held-out points",
        "",
    ]
    if held["rows"]:
        lines += _table(
            ["#", "network", "stages", "wire", "prompt", "ttft ms pred/meas", "error", "tpot ms pred/meas", "error"],
            [
                [
                    h["index"],
                    h["network"],
                    h["stages"],
                    h["wire"],
                    h["prompt_tokens"],
                    f"{_ms(h['ttft_pred_s'])} / {_ms(h['ttft_meas_s'])}",
                    _pct(h["ttft_err"]),
                    f"{_ms(h['tpot_pred_s'])} / {_ms(h['tpot_meas_s'])}",
                    _pct(h["tpot_err"]),
                ]
                for h in held["rows"]
            ],
        )
        lines += [
            "",
            f"Time to first token: max error {_pct(held['ttft_max'])}, median {_pct(held['ttft_median'])}. "
            f"Time per output token: max {_pct(held['tpot_max'])}, median {_pct(held['tpot_median'])}.",
        ]
    else:
        lines += ["No point was held out: the model's error on unseen points is not measured."]
    if fit.notes:
        lines += ["", "## Notes", "", *(f"- {n}" for n in fit.notes)]
    if plots:
        lines += ["", "## Plots", "", *(f"![{name}]({name})" for name in plots)]
    return "\n".join(lines) + "\n"


def _plots(grid: Grid, fit: Fit, rows: list[Row], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig: Any, path: Path) -> Path:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    dim, nb, dph = _shape(grid)
    networks = _networks(grid)
    stage_counts = sorted({p.stages for p in grid.points})
    runs = layouts(grid)
    split_wires = sorted({w for s, w in runs if s > 1})
    several = len(split_wires) > 1  # name the wire in the legends
    style = {w: ("-", "--", ":", "-.")[i % 4] for i, w in enumerate(split_wires)}
    prompts = sorted({p.prompt_tokens for p in grid.points})
    colours = {s: f"C{i}" for i, s in enumerate(stage_counts)}
    paths = []

    # time to first token against prompt length: one panel per network, one line per stage count
    fig, axes = plt.subplots(1, len(networks), figsize=(4.5 * len(networks), 4), squeeze=False, sharey=True)
    span = [round(prompts[0] + (prompts[-1] - prompts[0]) * k / 40) for k in range(41)]
    for ax, network in zip(axes[0], networks, strict=True):
        for stages, wire in runs:
            label = layout_name(stages, wire) if several else layout_name(stages, wire).split(",")[0]
            mine = [p for p in grid.points if (p.network, p.stages) == (network, stages)]
            mine = [p for p in mine if stages == 1 or p.wire == wire]
            if mine:
                xs = [p.prompt_tokens for p in mine]
                ax.plot(xs, [statistics.median(p.ttft_s) * 1e3 for p in mine], "o", color=colours[stages])
            if stages == 1 or network in fit.links:
                ys = [fit.predict(stages, network, max(1, x), wire, dim, nb, dph).ttft_s * 1e3 for x in span]
                ax.plot(span, ys, style.get(wire, "-") if stages > 1 else "-", color=colours[stages], label=label)
        ax.set_title(f"{network} (rtt {fit.rtt_ms.get(network, 0):g} ms)")
        ax.set_xlabel("prompt tokens")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("time to first token, ms (dots: measured, lines: model)")
    axes[0][0].legend()
    paths.append(save(fig, out_dir / PLOTS[0]))

    # time per output token against one-way delay: measured points, the model's lines
    fig, ax = plt.subplots(figsize=(6, 4.5))
    finite = [link.beta_Bps for link in fit.links.values() if math.isfinite(link.beta_Bps)]
    beta = statistics.median(finite) if finite else math.inf
    top = max(max(p.rtt_ms for p in grid.points) / 2, 1.0) * 1.1
    delays = [top * k / 40 for k in range(41)]
    for stages in stage_counts:
        wire = next(w for n, w in runs if n == stages)
        mine = [p for p in grid.points if p.stages == stages]
        ax.plot(
            [p.rtt_ms / 2 for p in mine], [statistics.median(p.tpot_s) * 1e3 for p in mine], "o", color=colours[stages]
        )
        ys = [fit.predict(stages, Link(d / 1e3, beta), prompts[-1], wire, dim, nb, dph).tpot_s * 1e3 for d in delays]
        ax.plot(delays, ys, "-", color=colours[stages], label=f"{stages} stage{'s' if stages > 1 else ''}")
    ax.set_xlabel("one-way delay, ms")
    ax.set_ylabel("time per output token, ms (dots: measured, lines: model)")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(save(fig, out_dir / PLOTS[1]))

    # cost per token against latency, each layout per network; the Pareto frontier
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    free = dph == 0
    for k, network in enumerate(networks):
        here = [r for r in rows if r.network == network and r.prompt_tokens == prompts[-1]]
        pairs = [(r.tpot_s * 1e3, r.chip_seconds_per_token if free else r.usd_per_token) for r in here]
        ax.plot([x for x, _ in pairs], [y for _, y in pairs], "o", color=f"C{k}", label=network)
        for r, (x, y) in zip(here, pairs, strict=True):
            below = several and r.stages > 1 and split_wires.index(r.wire) % 2  # bf16 above, f32 below
            text = f"{r.stages} {r.wire}" if several and r.stages > 1 else str(r.stages)
            ax.annotate(text, (x, y), xytext=(4, -9 if below else 3), textcoords="offset points", fontsize=7)
        front = [pairs[i] for i in pareto_frontier(pairs)]
        ax.step([x for x, _ in front], [y for _, y in front], where="post", color=f"C{k}", alpha=0.6)
    ax.set_xlabel("time per output token, ms (model)")
    ax.set_ylabel("chip-seconds per token" if free else "$ per token")
    ax.set_title("cost against latency (labels: stages; lines: Pareto frontier)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(save(fig, out_dir / PLOTS[2]))
    return paths


def write_report(grid: Grid, fit: Fit, out_dir: Path, plots: bool = True) -> list[Path]:
    """Write layout.json, layout.md and (``plots``) the PNGs into ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = predictions(grid, fit)
    recs = recommendations(rows)
    held = fit.held_out_errors(grid).to_json()
    pngs = _plots(grid, fit, rows, out_dir) if plots else []
    data = {
        "grid": grid.to_json(),
        "fit": fit.to_json(),
        "held_out": held,
        "predictions": [asdict(r) for r in rows],
        "recommendations": recs,
        "plots": [p.name for p in pngs],
    }
    json_path, md_path = out_dir / "layout.json", out_dir / "layout.md"
    json_path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    md_path.write_text(_markdown(grid, fit, held, recs, [p.name for p in pngs]))
    return [json_path, md_path, *pngs]


def measured_range(grid: Grid) -> tuple[tuple[int, int], tuple[int, int]]:
    """(lowest, highest) stage count and prompt length among the points the fit saw (held-out
    points excluded): outside them a prediction extrapolates."""
    seen = [p for i, p in enumerate(grid.points) if i not in set(grid.held_out)]
    if not seen:
        raise ValueError("the grid has no fitted points: no measured range to predict within")
    stages, prompts = [p.stages for p in seen], [p.prompt_tokens for p in seen]
    return (min(stages), max(stages)), (min(prompts), max(prompts))


def _span(lo_hi: tuple[int, int]) -> str:
    return str(lo_hi[0]) if lo_hi[0] == lo_hi[1] else f"{lo_hi[0]}-{lo_hi[1]}"


def beyond_the_grid(grid: Grid, stages_list: Sequence[int], prompt_tokens_list: Sequence[int]) -> list[str]:
    """One line for each stage count and prompt length outside the fitted points' range
    (``measured_range``), where the prediction is an extrapolation."""
    stages, prompts = measured_range(grid)
    out = [
        f"stage count {s} is outside the grid's fitted stage counts {_span(stages)}: the prediction extrapolates"
        for s in dict.fromkeys(stages_list)
        if not stages[0] <= s <= stages[1]
    ]
    out += [
        f"prompt length {p} is outside the grid's fitted prompt lengths {_span(prompts)} tokens: "
        "the prediction extrapolates"
        for p in dict.fromkeys(prompt_tokens_list)
        if not prompts[0] <= p <= prompts[1]
    ]
    return out


def predict_table(
    fit: Fit,
    network_description: str,
    stages_list: Sequence[int],
    prompt_tokens_list: Sequence[int],
    wire: str,
    dim: int,
    num_blocks: int,
    dph: float,
    grid: Grid | None = None,
) -> str:
    """The what-if, with no run: the fit's predictions for each stage count and prompt length on a
    network (a fitted profile's name or a description, e.g. ``"rtt=40ms,bw=1gbit"``), in Markdown.
    Any stage count from 1 to the model's blocks; with the ``grid`` fitted, a value outside its
    fitted range (``beyond_the_grid``) is marked ``*``, an extrapolation."""
    if not stages_list or not prompt_tokens_list:
        raise ValueError(f"stages {list(stages_list)} and prompt lengths {list(prompt_tokens_list)}: need one of each")
    for s in stages_list:
        if not 1 <= s <= num_blocks:
            raise ValueError(
                f"stages={s}: expected 1 to {num_blocks}, the model's blocks (each stage holds one block at least)"
            )
    for p in prompt_tokens_list:
        if p < 1:
            raise ValueError(f"prompt length {p}: expected at least 1 token")
    link = fit.link(network_description)
    rows = [
        _row(fit, link, network_description, s, wire, p, dim, num_blocks, dph)
        for s in stages_list
        for p in prompt_tokens_list
    ]
    fastest = min(rows, key=lambda r: (r.tpot_s, r.stages))
    cheapest = min(rows, key=lambda r: _cost_key(r, "decode"))
    s_range, p_range = measured_range(grid) if grid is not None else ((1, num_blocks), (1, 1 << 62))

    def mark(v: int, lo_hi: tuple[int, int]) -> str:
        return str(v) if lo_hi[0] <= v <= lo_hi[1] else f"{v}*"

    lines = [
        f"Predicted on {network_description} ({link.describe()}), wire {wire}, dim {dim}, {num_blocks} blocks, "
        f"${dph:g}/hour an instance:",
        "",
        *_table(
            ["stages", "prompt", "ttft ms", "tpot ms", "tokens/s", "chip-s/token", "$/token"],
            [
                [
                    mark(r.stages, s_range),
                    mark(r.prompt_tokens, p_range),
                    _ms(r.ttft_s),
                    _ms(r.tpot_s),
                    f"{1 / r.tpot_s:.1f}",
                    f"{r.chip_seconds_per_token:.3g}",
                    _usd(r.usd_per_token),
                ]
                for r in rows
            ],
        ),
        "",
        f"Decode: fastest {layout_name(fastest.stages, wire)} ({_ms(fastest.tpot_s)} ms a token), "
        f"cheapest {layout_name(cheapest.stages, wire)} ({_usd(cheapest.usd_per_token)} $ a token).",
    ]
    if grid is not None and beyond_the_grid(grid, stages_list, prompt_tokens_list):
        lines += [
            "",
            f"Values marked * lie outside the grid's fitted range (stage counts {_span(s_range)}, "
            f"prompt lengths {_span(p_range)} tokens): there the prediction extrapolates.",
        ]
    return "\n".join(lines) + "\n"

"""A cost model fitted to a measured grid, and its predictions for layouts and networks never run.

The model is the textbook one: a transfer costs a latency plus bytes over bandwidth, per link
(``hop = alpha + bytes / beta``); a stage's call costs its blocks plus the embedding (first stage)
or the output head (last stage), plus a constant per call. Prefill's terms grow with the tokens
of the call (a block quadratically: attention), decode's are per token.

A decode call also grows with its context (the KV entries a block's attention reads: ``block_ctx``
per block and position) and pays a wake-up: a stage whose cores sat idle for a while before the
call is slower to start it (cold caches, clocks down). The grid measures each call's idle gap;
the fit finds the ramp ``wake * clamp((idle - from) / (to - from), 0, 1)`` that explains the calls
best. A prediction solves for it: a stage's idle gap is the time per token less its own call.

What the model does not see (the orchestrator, the node <-> worker bridge, the event loops) is an
:class:`Overhead` per phase, fitted to what the model leaves over of each point's median: for a
split layout a constant, a term per stage, and (time to first token only) a number of one-way
delays: the request's way in and the first token's way out cross the orchestrator's links, which
on an emulated network are as slow as the stages' and elsewhere are not (about 2 delays, or 0).
The unsplit layout is the model in one process, as the grid measures it (no bridge, no network):
its overhead is its own, the median of its points'.

Numbers are seconds, bytes and bytes per second throughout; ``beta`` is ``inf`` where the grid
could not see a bandwidth (a link whose hop times do not grow with the bytes)."""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pytest_ppsmoke.layout.points import WIRE_BYTES, Grid, Point, StageSample
from pytest_ppsmoke.protocol import layer_range

PREFILL_TERMS = ("block", "block_t", "block_t2", "head", "head_t", "embed", "embed_t", "call")
DECODE_TERMS = ("block", "block_ctx", "head", "embed", "call", "wake")
# the idle gaps (seconds) where the wake-up ramp may start, and its widths, that the fit tries
WAKE_FROM = tuple(i * 0.01 for i in range(0, 51))
WAKE_WIDTH = (0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4)
WAKE_MIN_SPAN_S = 0.05  # idle gaps spanning less than this cannot show a wake-up: no wake term
WAKE_MIN_GAIN = 0.1  # the wake term is kept only if it takes this share of the squared error away
# ramps whose squared errors differ by less than this share explain the calls equally: the
# difference is rounding, which moves with the processor's BLAS kernels, not with the data
WAKE_TIE = 1e-9


def stage_shapes(num_blocks: int, stages: int) -> list[tuple[int, bool, bool]]:
    """(blocks, first, last) of each stage of the spec's split."""
    if stages < 1:
        raise ValueError(f"stages={stages}: expected at least 1 (1: the model unsplit)")
    out = []
    for s in range(stages):
        lo, hi = layer_range(num_blocks, s, stages)
        out.append((hi - lo, s == 0, s == stages - 1))
    return out


_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_BIT_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}
_BYTE_UNITS = {"b/s": 1.0, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z/]*)\s*$")


def _quantity(key: str, text: str, units: dict[str, float], default_unit: str) -> float:
    m = _QUANTITY.match(text.lower())
    unit = (m.group(2) or default_unit) if m else ""
    if not m or unit not in units:
        raise ValueError(f"{key}={text!r}: expected a number with a unit, one of {sorted(units)}")
    return float(m.group(1)) * units[unit]


@dataclass(frozen=True)
class Link:
    """One network link: a message of ``n`` bytes takes ``alpha_s + n / beta_Bps`` seconds."""

    alpha_s: float
    beta_Bps: float = math.inf

    def __post_init__(self) -> None:
        if not (self.alpha_s >= 0 and math.isfinite(self.alpha_s)):
            raise ValueError(f"a link's latency alpha_s={self.alpha_s!r}: expected a finite number >= 0")
        if not self.beta_Bps > 0:
            raise ValueError(f"a link's bandwidth beta_Bps={self.beta_Bps!r}: expected a number > 0 (inf: unlimited)")

    def hop(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.beta_Bps

    @classmethod
    def parse(cls, description: str) -> Link:
        """A link from ``"rtt=40ms,bw=1gbit"``: ``rtt`` (the round trip; alpha is half of it) or
        ``delay`` (one way), and ``bw`` in bits (``bit``, ``kbit``, ``mbit``, ``gbit``, ``...bps``)
        or bytes per second (``b/s``, ``kb/s``, ``mb/s``, ``gb/s``); no ``bw``: unlimited."""
        fields: dict[str, str] = {}
        for part in description.split(","):
            key, eq, value = part.partition("=")
            key = key.strip().lower()
            if not eq or key not in ("rtt", "delay", "bw") or key in fields:
                raise ValueError(
                    f"network description {description!r}: {part.strip()!r} is not one of rtt=..., delay=..., "
                    "bw=... (each at most once), e.g. 'rtt=40ms,bw=1gbit'"
                )
            fields[key] = value
        if "rtt" in fields and "delay" in fields:
            raise ValueError(f"network description {description!r}: give rtt (round trip) or delay (one way), not both")
        if "rtt" in fields:
            alpha = _quantity("rtt", fields["rtt"], _TIME_UNITS, "ms") / 2
        elif "delay" in fields:
            alpha = _quantity("delay", fields["delay"], _TIME_UNITS, "ms")
        else:
            alpha = 0.0
        beta = math.inf
        if "bw" in fields:
            text = fields["bw"].lower()
            beta = (
                _quantity("bw", text, _BYTE_UNITS, "b/s")
                if text.endswith("b/s")
                else _quantity("bw", text, _BIT_UNITS, "bit") / 8
            )
            if beta <= 0:
                raise ValueError(f"network description {description!r}: bw must be > 0")
        return cls(alpha, beta)

    def describe(self) -> str:
        bw = "unlimited" if math.isinf(self.beta_Bps) else f"{self.beta_Bps / 1e6:.3g} MB/s"
        return f"one-way {self.alpha_s * 1e3:.3g} ms, {bw}"


@dataclass(frozen=True)
class Prediction:
    ttft_s: float
    tpot_s: float
    chip_seconds_per_token: float
    usd_per_token: float


@dataclass(frozen=True)
class HeldOutError:
    index: int
    network: str
    stages: int
    wire: str
    prompt_tokens: int
    ttft_pred_s: float
    ttft_meas_s: float
    ttft_err: float  # |predicted - measured| / measured
    tpot_pred_s: float
    tpot_meas_s: float
    tpot_err: float


@dataclass
class HeldOut:
    rows: list[HeldOutError]

    def _stat(self, attr: str, f: Any) -> float | None:
        values = [getattr(r, attr) for r in self.rows]
        return float(f(values)) if values else None

    @property
    def ttft_max(self) -> float | None:
        return self._stat("ttft_err", max)

    @property
    def ttft_median(self) -> float | None:
        return self._stat("ttft_err", statistics.median)

    @property
    def tpot_max(self) -> float | None:
        return self._stat("tpot_err", max)

    @property
    def tpot_median(self) -> float | None:
        return self._stat("tpot_err", statistics.median)

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "ttft_max": self.ttft_max,
            "ttft_median": self.ttft_median,
            "tpot_max": self.tpot_max,
            "tpot_median": self.tpot_median,
        }


def _lstsq(rows: list[list[float]] | np.ndarray, y: list[float] | np.ndarray) -> tuple[list[float], int]:
    """Least squares with the columns scaled to unit norm first (prompt length squared is five
    orders above a flag); rank-deficient systems get the minimum-norm solution, whose predictions
    are still exact for any combination of the measured rows. Returns (coefficients, rank)."""
    a = np.asarray(rows, dtype=np.float64)
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    coef, _, rank, _ = np.linalg.lstsq(a / norms, np.asarray(y, dtype=np.float64), rcond=None)
    return [float(c) for c in coef / norms], int(rank)


def _median(values: Sequence[float], what: str) -> float:
    if not values:
        raise ValueError(f"{what}: no repeats measured")
    return float(statistics.median(values))


@dataclass(frozen=True)
class Overhead:
    """A phase's time outside the model: ``constant_s + per_stage_s * stages + delay_hops *
    alpha`` for a split layout on a link of one-way delay ``alpha``; ``unsplit_s`` unsplit."""

    constant_s: float = 0.0
    per_stage_s: float = 0.0
    delay_hops: float = 0.0
    unsplit_s: float = 0.0

    def at(self, stages: int, alpha_s: float) -> float:
        if stages == 1:
            return self.unsplit_s
        return self.constant_s + self.per_stage_s * stages + self.delay_hops * alpha_s

    def describe(self) -> str:
        return (
            f"unsplit {self.unsplit_s * 1e3:.2f} ms; split {self.constant_s * 1e3:.2f} ms "
            f"+ {self.per_stage_s * 1e3:.2f} ms x stages + {self.delay_hops:.2f} x one-way delay"
        )


@dataclass(frozen=True)
class Wake:
    """The ramp of a decode call's wake-up cost over its stage's idle gap: 0 up to ``from_s``,
    the fit's ``wake`` seconds from ``to_s`` on, linear between (``to_s == 0``: no wake term)."""

    from_s: float = 0.0
    to_s: float = 0.0
    per: str = "call"  # the fit's ``wake`` seconds are a call's ("call") or a block's ("block")

    def share(self, idle_s: float) -> float:
        if self.to_s <= self.from_s:
            return 0.0
        return min(1.0, max(0.0, (idle_s - self.from_s) / (self.to_s - self.from_s)))

    def cost(self, wake_s: float, blocks: int, idle_s: float) -> float:
        """A call's wake-up: ``wake_s`` a call or a block, times the ramp's share at ``idle_s``."""
        return wake_s * (blocks if self.per == "block" else 1) * self.share(idle_s)

    def describe(self, wake_s: float) -> str:
        if self.to_s <= self.from_s or wake_s <= 0:
            return "none"
        return (
            f"{wake_s * 1e3:.2f} ms a {self.per}, ramping in from {self.from_s * 1e3:.0f} to "
            f"{self.to_s * 1e3:.0f} ms idle"
        )


@dataclass
class Fit:
    """The fitted model: per network a :class:`Link`, per phase the compute terms of a stage call,
    per phase the :class:`Overhead`; ``notes`` say where the grid could not pin a term down."""

    links: dict[str, Link]  # per network profile (absent: its points had no hops, all unsplit)
    rtt_ms: dict[str, float]  # the profiles' round trips, as the grid recorded them
    prefill: dict[str, float]  # PREFILL_TERMS -> seconds (per block / per token / per token^2)
    decode: dict[str, float]  # DECODE_TERMS -> seconds per token (block_ctx: per block and position)
    ttft_overhead: Overhead  # a request's, time to first token
    tpot_overhead: Overhead  # a token's, decode
    fitted: list[int]  # the grid's points the fit saw
    hop_samples: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    wake: Wake = field(default_factory=Wake)

    # -- the model --------------------------------------------------------------------------------

    def prefill_stage_s(self, blocks: int, first: bool, last: bool, tokens: int) -> float:
        c, t = self.prefill, float(tokens)
        return (
            blocks * (c["block"] + c["block_t"] * t + c["block_t2"] * t * t)
            + last * (c["head"] + c["head_t"] * t)
            + first * (c["embed"] + c["embed_t"] * t)
            + c["call"]
        )

    def decode_stage_s(self, blocks: int, first: bool, last: bool, context: int = 0, idle_s: float = 0.0) -> float:
        """One decode call at position ``context`` after ``idle_s`` seconds without a call."""
        d = self.decode
        return (
            blocks * (d.get("block", 0.0) + d.get("block_ctx", 0.0) * context)
            + last * d.get("head", 0.0)
            + first * d.get("embed", 0.0)
            + d.get("call", 0.0)
            + self.wake.cost(d.get("wake", 0.0), blocks, idle_s)
        )

    def decode_token_s(self, shapes: list[tuple[int, bool, bool]], context: int, rest_s: float) -> float:
        """Time per output token of stages of ``shapes`` whose calls are joined by ``rest_s`` a
        token (hops, overhead): the fixed point of each stage waiting the token's time less its
        own call, and its call's wake-up growing with that wait."""
        calls = [self.decode_stage_s(b, f, la, context) for b, f, la in shapes]
        tpot = sum(calls) + rest_s
        for _ in range(200):
            calls = [
                self.decode_stage_s(b, f, la, context, tpot - c) for (b, f, la), c in zip(shapes, calls, strict=True)
            ]
            nxt = sum(calls) + rest_s
            if abs(nxt - tpot) < 1e-7:
                return nxt
            tpot = 0.5 * (tpot + nxt)  # damped: a steep ramp could otherwise swing
        return tpot

    def link(self, network: Link | str) -> Link:
        """A fitted network by its profile name, or a description (``"rtt=40ms,bw=1gbit"``)."""
        if isinstance(network, Link):
            return network
        if "=" in network:
            return Link.parse(network)
        if network not in self.links:
            unsplit = " (its points were all unsplit: no hops to fit)" if network in self.rtt_ms else ""
            raise ValueError(
                f"network {network!r} has no fitted link{unsplit}; fitted: {sorted(self.links)}, "
                "or describe one, e.g. 'rtt=40ms,bw=1gbit'"
            )
        return self.links[network]

    def _model(
        self,
        stages: int,
        network: Link | str,
        prompt_tokens: int,
        wire: str,
        dim: int,
        num_blocks: int,
        tpot_overhead: Overhead | None = None,
    ) -> tuple[float, float, float]:
        """(ttft, tpot, the link's one-way delay: 0 unsplit) without the time to first token's
        overhead; the decode's (``tpot_overhead``, none: 0) is in the tpot, as it lengthens the
        stages' idle gaps. Decode is at the prompt's end (context ``prompt_tokens``)."""
        if wire not in WIRE_BYTES:
            raise ValueError(f"wire {wire!r}: expected one of {sorted(WIRE_BYTES)}")
        if prompt_tokens < 1:
            raise ValueError(f"prompt_tokens={prompt_tokens}: expected at least 1")
        if dim < 1:
            raise ValueError(f"dim={dim}: expected at least 1")
        shapes = stage_shapes(num_blocks, stages)  # checks stages against num_blocks
        ttft = sum(self.prefill_stage_s(b, f, la, prompt_tokens) for b, f, la in shapes)
        link, rest = None, 0.0
        if stages > 1:
            link = self.link(network)
            ttft += (stages - 1) * link.hop(prompt_tokens * dim * WIRE_BYTES[wire])
            rest = stages * link.hop(dim * WIRE_BYTES[wire])  # stages-1 activations, 1 token back
        alpha = link.alpha_s if link is not None else 0.0
        if tpot_overhead is not None:
            rest += tpot_overhead.at(stages, alpha)
        return ttft, self.decode_token_s(shapes, prompt_tokens, rest), alpha

    def predict(
        self,
        stages: int,
        network: Link | str,
        prompt_tokens: int,
        wire: str,
        dim: int,
        num_blocks: int,
        dph_per_instance: float,
    ) -> Prediction:
        """Time to first token, time per output token and the cost per output token of ``stages``
        instances (one stage each, ``dph_per_instance`` dollars an hour each) on ``network``."""
        if not (dph_per_instance >= 0 and math.isfinite(dph_per_instance)):
            raise ValueError(f"dph_per_instance={dph_per_instance!r}: expected a finite number >= 0")
        ttft, tpot, alpha = self._model(stages, network, prompt_tokens, wire, dim, num_blocks, self.tpot_overhead)
        ttft += self.ttft_overhead.at(stages, alpha)
        return Prediction(ttft, tpot, stages * tpot, stages * dph_per_instance / 3600 * tpot)

    def predict_point(self, point: Point) -> Prediction:
        dph = statistics.median(point.dph) if point.dph else 0.0
        return self.predict(
            point.stages, point.network, point.prompt_tokens, point.wire, point.dim, point.num_blocks, dph
        )

    def held_out_errors(self, grid: Grid) -> HeldOut:
        """Each held-out point's predicted against measured (median of its repeats) ttft and tpot."""
        rows = []
        for i in grid.held_out:
            if not 0 <= i < len(grid.points):
                raise ValueError(f"held-out index {i}: the grid has {len(grid.points)} points")
            p = grid.points[i]
            pred = self.predict_point(p)
            ttft = _median(p.ttft_s, f"point {i} {p.key} ttft_s")
            tpot = _median(p.tpot_s, f"point {i} {p.key} tpot_s")
            ttft_err, tpot_err = abs(pred.ttft_s - ttft) / ttft, abs(pred.tpot_s - tpot) / tpot
            rows.append(
                HeldOutError(
                    i,
                    p.network,
                    p.stages,
                    p.wire,
                    p.prompt_tokens,
                    pred.ttft_s,
                    ttft,
                    ttft_err,
                    pred.tpot_s,
                    tpot,
                    tpot_err,
                )
            )
        return HeldOut(rows)

    # -- JSON -------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "links": {
                name: {
                    "alpha_s": link.alpha_s,
                    "beta_Bps": None if math.isinf(link.beta_Bps) else link.beta_Bps,  # JSON has no inf
                    "alpha_ms": link.alpha_s * 1e3,
                    "beta_MBps": None if math.isinf(link.beta_Bps) else link.beta_Bps / 1e6,
                    "samples": self.hop_samples.get(name, 0),
                }
                for name, link in self.links.items()
            },
            "rtt_ms": self.rtt_ms,
            "prefill": self.prefill,
            "decode": self.decode,
            "wake": dataclasses.asdict(self.wake),
            "ttft_overhead": dataclasses.asdict(self.ttft_overhead),
            "tpot_overhead": dataclasses.asdict(self.tpot_overhead),
            "fitted": self.fitted,
            "notes": self.notes,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Fit:
        try:
            links = {
                name: Link(float(v["alpha_s"]), math.inf if v["beta_Bps"] is None else float(v["beta_Bps"]))
                for name, v in data["links"].items()
            }
            prefill = {k: float(data["prefill"][k]) for k in PREFILL_TERMS}
            decode = {k: float(data["decode"].get(k, 0.0)) for k in DECODE_TERMS}  # older fits: fewer terms
            return cls(
                links=links,
                rtt_ms={k: float(v) for k, v in data["rtt_ms"].items()},
                prefill=prefill,
                decode=decode,
                ttft_overhead=Overhead(**{k: float(v) for k, v in data["ttft_overhead"].items()}),
                tpot_overhead=Overhead(**{k: float(v) for k, v in data["tpot_overhead"].items()}),
                fitted=[int(i) for i in data["fitted"]],
                hop_samples={name: int(v.get("samples", 0)) for name, v in data["links"].items()},
                notes=[str(n) for n in data.get("notes", [])],
                wake=_wake(data.get("wake", {})),
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a saved fit: {type(e).__name__} {e} (expected Fit.to_json()'s form)") from e


def _wake(data: dict[str, Any]) -> Wake:
    """A saved :class:`Wake` (an older fit's: none)."""
    return Wake(float(data.get("from_s", 0.0)), float(data.get("to_s", 0.0)), str(data.get("per", "call")))


def _fit_link(network: str, samples: list[tuple[int, float]], notes: list[str]) -> Link:
    xs = [float(b) for b, _ in samples]
    ys = [s for _, s in samples]
    if len(set(xs)) < 2:
        notes.append(f"{network}: every hop carried {int(xs[0])} bytes: no bandwidth to fit (beta = inf)")
        return Link(max(0.0, statistics.fmean(ys)))
    (alpha, slope), _ = _lstsq([[1.0, x] for x in xs], ys)
    if slope <= 0:
        notes.append(
            f"{network}: hop time does not grow with the bytes (slope {slope:.3g} s/B): bandwidth not "
            "measurable (beta = inf); alpha is the mean hop"
        )
        return Link(max(0.0, statistics.fmean(ys)))
    if alpha < 0:
        notes.append(f"{network}: fitted latency {alpha * 1e3:.3g} ms < 0, clamped to 0")
        alpha = 0.0
    return Link(alpha, 1.0 / slope)


def _features(s: StageSample) -> dict[str, float]:
    """A call's column for each term but the wake-up (the ramp search builds that one)."""
    t = float(s.tokens)
    return {
        "block": s.blocks,
        "block_t": s.blocks * t,
        "block_t2": s.blocks * t * t,
        "block_ctx": s.blocks * float(s.context),
        "head": float(s.last),
        "head_t": s.last * t,
        "embed": float(s.first),
        "embed_t": s.first * t,
        "call": 1.0,
    }


def _fit_compute(
    samples: list[StageSample], phase: str, terms: tuple[str, ...], notes: list[str]
) -> tuple[dict[str, float], Wake]:
    """The ``terms`` of a ``phase``'s stage call, least squares over ``samples``; decode also
    searches the wake-up's ramp (``WAKE_FROM`` x ``WAKE_WIDTH``) for the one that explains the
    calls best, and keeps it only if it takes ``WAKE_MIN_GAIN`` of the squared error away."""
    if not samples:
        raise ValueError(f"no {phase} stage samples in the fitted points: nothing to fit {phase} compute to")
    used = [t for t in terms if t != "wake"]
    if phase == "decode" and "block_ctx" in used and len({s.context for s in samples}) < 2:
        used.remove("block_ctx")
        notes.append("decode: every call at one context length: fitted without the context term (block_ctx)")
    if phase == "prefill":
        distinct = len({s.tokens for s in samples})
        if distinct < 3:
            used.remove("block_t2")
            if distinct < 2:
                used = [t for t in used if not t.endswith("_t")]
            notes.append(
                f"prefill: {distinct} distinct prompt length(s): fitted without "
                f"{', '.join(t for t in terms if t not in used)} (attention's quadratic term needs 3 lengths; "
                "without it, prompts between the lengths fitted are predicted a little slow)"
            )

    y = np.asarray([s.seconds for s in samples], dtype=np.float64)
    base = np.asarray([[_features(s)[k] for k in used] for s in samples], dtype=np.float64)
    idle = np.asarray([s.idle_s for s in samples], dtype=np.float64)
    blocks = np.asarray([s.blocks for s in samples], dtype=np.float64)

    def solve(a: np.ndarray) -> tuple[list[float], int, float]:
        coef, rank = _lstsq(a, y)
        return coef, rank, float(np.sum((a @ np.asarray(coef) - y) ** 2))

    coef, rank, sse = solve(base)
    for growth in ("block_t2", "block_t"):  # a longer prompt never makes a block faster
        if phase == "prefill" and growth in used and coef[used.index(growth)] < 0:
            notes.append(
                f"prefill: the fitted {growth} is negative ({coef[used.index(growth)]:.3g} s): a longer prompt "
                f"would make a block faster; fitted without it (the calls' times barely grow with the tokens)"
            )
            keep = [i for i, t in enumerate(used) if t != growth]
            used, base = [used[i] for i in keep], base[:, keep]
            coef, rank, sse = solve(base)
    columns, wake = used, Wake()
    if "wake" in terms:
        span = float(idle.max() - idle.min())
        if span < WAKE_MIN_SPAN_S:
            notes.append(
                f"{phase}: the stages' idle gaps span {span * 1e3:.0f} ms (< {WAKE_MIN_SPAN_S * 1e3:.0f}): "
                "no wake-up term"
            )
        else:
            candidates: list[tuple[float, list[float], int, Wake]] = []
            for start in WAKE_FROM:
                for width in WAKE_WIDTH:
                    share = np.clip((idle - start) / width, 0.0, 1.0)
                    if np.ptp(share) == 0:
                        continue  # every call on one side of the ramp: nothing to fit
                    for per, scale in (("call", 1.0), ("block", blocks)):
                        c, r, e = solve(np.column_stack([base, share * scale]))
                        if c[-1] > 0:
                            candidates.append((e, c, r, Wake(start, start + width, per)))
            best = _least_wake(candidates)
            if best is not None and best[0] <= (1 - WAKE_MIN_GAIN) * sse:
                sse, coef, rank, wake = best
                columns = [*used, "wake"]
            else:
                notes.append(
                    f"{phase}: no wake-up ramp over the idle gaps takes {WAKE_MIN_GAIN:.0%} of the error away: "
                    "no wake-up term"
                )
    if rank < len(columns):
        notes.append(
            f"{phase}: the stage samples pin {rank} of {len(columns)} terms (e.g. only unsplit points: head and "
            "embedding not apart); the minimum-norm split is used, exact for the layouts measured"
        )
    out = dict.fromkeys(terms, 0.0)
    out.update(zip(columns, coef, strict=True))
    return out, wake


def _least_wake(
    candidates: list[tuple[float, list[float], int, Wake]],
) -> tuple[float, list[float], int, Wake] | None:
    """The ramp with the least squared error; among those that tie with it (within ``WAKE_TIE``),
    the one that ends soonest, then starts soonest, then per call. Ramps tie where the idle gaps
    measured cannot tell them apart, e.g. every ramp that starts below the gaps' clusters and ends
    beyond the largest gap, its wake-up scaled to the same slope: the data says nothing past its
    largest gap, so the fit claims the least wake-up there that explains it. Picking by the last
    bits of the error instead made a prediction beyond the gaps move with the processor."""
    if not candidates:
        return None
    least = min(e for e, _, _, _ in candidates)
    tied = [c for c in candidates if c[0] <= least + WAKE_TIE * max(least, np.finfo(np.float64).tiny)]
    return min(tied, key=lambda c: (c[3].to_s, c[3].from_s, c[3].per != "call"))


def fit(grid: Grid, exclude: Sequence[int] | None = None) -> Fit:
    """Fit the model to ``grid``'s points except ``exclude`` (default: the grid's held-out points)."""
    exclude = grid.held_out if exclude is None else exclude
    for i in exclude:
        if not 0 <= i < len(grid.points):
            raise ValueError(f"excluded point {i}: the grid has {len(grid.points)} points")
    used = [i for i in range(len(grid.points)) if i not in set(exclude)]
    if not used:
        raise ValueError(f"no points to fit: the grid has {len(grid.points)}, {len(exclude)} excluded")
    points = [grid.points[i] for i in used]
    for i, p in zip(used, points, strict=True):
        if p.wire not in WIRE_BYTES:
            raise ValueError(f"point {i} {p.key}: wire {p.wire!r} is not one of {sorted(WIRE_BYTES)}")
        _median(p.ttft_s, f"point {i} {p.key} ttft_s")
        _median(p.tpot_s, f"point {i} {p.key} tpot_s")
    notes: list[str] = []

    links: dict[str, Link] = {}
    hop_samples: dict[str, int] = {}
    rtt_ms: dict[str, float] = {}
    for network in sorted({p.network for p in points}):
        mine = [p for p in points if p.network == network]
        rtt_ms[network] = max(p.rtt_ms for p in mine)
        samples = [(h.bytes, h.seconds) for p in mine for h in p.hops]
        split = [p.key for p in mine if p.stages > 1]
        if len(samples) < 2:
            if split:
                raise ValueError(
                    f"network {network!r}: {len(samples)} hop sample(s) over {len(split)} split point(s) "
                    f"({split[0]}, ...): too few to fit a link (need at least 2)"
                )
            notes.append(f"{network}: only unsplit points: no link fitted")
            continue
        links[network] = _fit_link(network, samples, notes)
        hop_samples[network] = len(samples)

    compute = [c for p in points for c in p.compute]
    prefill, _ = _fit_compute([c for c in compute if c.phase == "prefill"], "prefill", PREFILL_TERMS, notes)
    decode, wake = _fit_compute([c for c in compute if c.phase == "decode"], "decode", DECODE_TERMS, notes)
    model = Fit(links, rtt_ms, prefill, decode, Overhead(), Overhead(), used, hop_samples, notes, wake)

    ttft_left, tpot_left = [], []  # (stages, alpha, what the model leaves over)
    for p in points:
        ttft, tpot, alpha = model._model(p.stages, p.network, p.prompt_tokens, p.wire, p.dim, p.num_blocks)
        ttft_left.append((p.stages, alpha, statistics.median(p.ttft_s) - ttft))
        tpot_left.append((p.stages, alpha, statistics.median(p.tpot_s) - tpot))
    model.ttft_overhead = _fit_overhead("time to first token", ttft_left, True, notes)
    model.tpot_overhead = _fit_overhead("time per output token", tpot_left, False, notes)
    return model


def _fit_overhead(what: str, left: list[tuple[int, float, float]], delays: bool, notes: list[str]) -> Overhead:
    """An :class:`Overhead` from (stages, one-way delay, residual) per point: the unsplit points'
    median; for the split ones, least squares for the per-stage and (``delays``) per-delay terms
    where the points vary in them (a negative delay count is dropped: a delay cannot save time),
    then the constant as the median of what those leave."""
    unsplit = [r for s, _, r in left if s == 1]
    split = [(s, a, r) for s, a, r in left if s > 1]
    constant = per_stage = hops = 0.0
    if split:
        terms = [
            t for t, n in (("stages", len({s for s, _, _ in split})), ("delay", len({a for _, a, _ in split}))) if n > 1
        ]
        terms = [t for t in terms if t == "stages" or delays]
        while terms:
            rows = [[1.0, *(float(s) if t == "stages" else a for t in terms)] for s, a, _ in split]
            coef, _ = _lstsq(rows, [r for _, _, r in split])
            got = dict(zip(terms, coef[1:], strict=True))
            if got.get("delay", 0.0) >= 0:
                per_stage, hops = got.get("stages", 0.0), got.get("delay", 0.0)
                break
            notes.append(f"{what}: the residual shrinks with the delay ({got['delay']:.3g} delays): no delay term")
            terms.remove("delay")
        constant = float(statistics.median(r - per_stage * s - hops * a for s, a, r in split))
    if unsplit:
        unsplit_s = float(statistics.median(unsplit))
    else:
        unsplit_s = constant + per_stage
        notes.append(f"{what}: no unsplit point fitted: its overhead is the split layouts' line at 1 stage")
    if not split:
        constant = unsplit_s
    return Overhead(constant, per_stage, hops, unsplit_s)

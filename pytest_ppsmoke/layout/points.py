"""What a grid run measures, one :class:`Point` per (network, stages, wire, prompt length), and
its JSON form. Times are seconds; a Point holds every repeat, so a fit can weigh them."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WIRE_BYTES = {"bf16": 2, "f16": 2, "f32": 4}


@dataclass(frozen=True)
class HopSample:
    """One activation or token crossing one link: what it carried and how long it took."""

    phase: str  # "prefill" or "decode"
    bytes: int
    seconds: float


@dataclass(frozen=True)
class StageSample:
    """One worker call's time inside the worker: ``blocks`` of the model, plus the embedding
    (``first``) or the output head (``last``), on ``tokens`` positions at once; a decode call's
    ``context`` (the position it decodes: the KV entries its attention reads) and ``idle_s``, how
    long its stage had waited since its previous call (a core idle that long is slower to start:
    the fit's wake term)."""

    stage: int
    blocks: int
    first: bool
    last: bool
    phase: str  # "prefill" or "decode"
    tokens: int
    seconds: float
    context: int = 0
    idle_s: float = 0.0


@dataclass
class Point:
    network: str  # the emulated network's profile ("loopback", "wan", "far", ...)
    rtt_ms: float  # its worst round trip (0 on loopback)
    stages: int  # 1: the model unsplit, in one process
    wire: str
    prompt_tokens: int  # the prompt in the chat template, as the model sees it
    dim: int
    num_blocks: int
    ttft_s: list[float] = field(default_factory=list)  # one per repeat: request to first token
    tpot_s: list[float] = field(default_factory=list)  # one per repeat: decode time per output token
    hops: list[HopSample] = field(default_factory=list)
    compute: list[StageSample] = field(default_factory=list)
    dph: list[float] = field(default_factory=list)  # each instance's $/hour

    @property
    def key(self) -> tuple[str, int, str, int]:
        return (self.network, self.stages, self.wire, self.prompt_tokens)


@dataclass
class Grid:
    model: str
    device: str
    machine: str
    when: str
    points: list[Point] = field(default_factory=list)
    held_out: list[int] = field(default_factory=list)  # indices of points the fit must not see
    weights: str = "f16"  # the weights' dtype every worker reported loading (f16, or f32 with HALF=0)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Grid:
        points = [
            Point(
                **{
                    **p,
                    "hops": [HopSample(**h) for h in p.get("hops", [])],
                    "compute": [StageSample(**c) for c in p.get("compute", [])],
                }
            )
            for p in data.get("points", [])
        ]
        return cls(**{**data, "points": points})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Grid:
        return cls.from_json(json.loads(path.read_text()))

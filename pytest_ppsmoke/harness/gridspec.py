"""A layout grid as one setting describes it (the ``grid`` option): :class:`GridSpec` and its
parser :func:`grid_spec`. The settings table checks the option with it at start-up, so this module
imports only the standard library (and the node's environment, for the model's default);
``layout/grid.py`` measures a grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..nodeenv import DEFAULTS as NODE


@dataclass(frozen=True)
class GridSpec:
    model: str = NODE.model
    prompts: tuple[int, ...] = (32, 128, 512)  # target prompt lengths, template included
    stages: tuple[int, ...] = (1, 2, 3, 4)
    networks: tuple[str, ...] = ("loopback", "wan", "far")
    wires: tuple[str, ...] = ("bf16",)
    repeats: int = 2
    max_tokens: int = 12
    timeout: float = 600.0  # seconds for one request
    gpus: tuple[str, ...] = ()  # this machine's GPUs, one per instance in turn (FakeVast's gpus)
    # the weights in every worker: f16 (tinygrad's HALF=1, its default) or native (HALF=0: as the
    # GGUF's loader gives them, float32 for a quantized file; on a CPU faster than f16: docs/benchmarks.md)
    weights: str = "f16"

    def check(self) -> None:
        if not self.prompts or min(self.prompts) < 1:
            raise ValueError(f"prompt lengths must be positive token counts, got {self.prompts}")
        if not self.stages or min(self.stages) < 1:
            raise ValueError(f"stage counts must be at least 1, got {self.stages}")
        if self.repeats < 1 or self.max_tokens < 8:
            raise ValueError(
                f"repeats must be >= 1 and max_tokens >= 8 (decode is timed past its first tokens), "
                f"got {self.repeats} and {self.max_tokens}"
            )
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights {self.weights!r}: expected one of {', '.join(WEIGHTS)}")


WEIGHTS = {"f16": "1", "native": "0"}  # the grid's weights setting -> tinygrad's HALF in every worker
SMALL = {"prompts": (32, 64, 96), "stages": (1, 2), "networks": ("loopback",), "repeats": 1, "max_tokens": 8}
_KEYS = {
    "prompts": int,
    "stages": int,
    "networks": str,
    "wires": str,
    "repeats": int,
    "max_tokens": int,
    "weights": str,
}
_ONE = ("repeats", "max_tokens", "weights")  # keys that take one value


def grid_spec(text: str, model: str, network: str = "loopback") -> GridSpec | None:
    """A grid described in one setting (the ``grid`` option): ``off``; ``small``
    (prompts 32, 64 and 96, 1 and 2 stages, the run's ``network``, one repeat); or ``key=value``
    items separated by ``;``, with keys prompts, stages, networks, wires (comma-separated) and
    repeats, max_tokens, weights (f16 or native), over small's values:
    ``prompts=32,128,512;stages=1,2,4;networks=loopback,wan``."""
    text = text.strip()
    if text in ("", "off"):
        return None
    values: dict[str, Any] = {**SMALL, "networks": (network,)}
    if text != "small":
        for item in filter(None, (i.strip() for i in text.split(";"))):
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or key not in _KEYS:
                raise ValueError(f"grid item {item!r}: expected key=value with a key among {', '.join(_KEYS)}")
            kind = _KEYS[key]
            try:
                parts = tuple(kind(v.strip()) for v in raw.split(",") if v.strip())
            except ValueError:
                raise ValueError(f"grid item {item!r}: {key} takes {kind.__name__} values") from None
            if not parts:
                raise ValueError(f"grid item {item!r}: no value")
            values[key] = parts[0] if key in _ONE else parts
    spec = GridSpec(model=model, **values)
    spec.check()
    return spec

"""The value checks that the three small tables share: the settings (``harness/settings.py``), the
node's environment (``nodeenv.py``) and the failpoints (``failpoints.py``). Each check returns the
value, converted, or raises ValueError; each table says in its own words what it expected.
Standard library only: the plugin loads it at start-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def integer(value: Any, least: int | None = None) -> int:
    """An integer from text or an int (never a bool or a float), at least ``least``."""
    if isinstance(value, (bool, float)):
        raise ValueError(f"not an integer: {value!r}")
    n = int(value)
    if least is not None and n < least:
        raise ValueError(f"{n} is less than {least}")
    return n


def number(value: Any, *, above: float | None = None, least: float | None = None, most: float | None = None) -> float:
    """A number from text or a number (never a bool), within the bounds given (NaN is within none)."""
    if isinstance(value, bool):
        raise ValueError(f"not a number: {value!r}")
    x = float(value)
    if (above is not None and not x > above) or (least is not None and not x >= least):
        raise ValueError(f"{x} is too small")
    if most is not None and not x <= most:
        raise ValueError(f"{x} is too large")
    return x


def one_of(value: str, choices: Sequence[str]) -> str:
    """``value`` if it is among ``choices``."""
    if value not in choices:
        raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
    return value


def items(text: str, sep: str = ",") -> tuple[str, ...]:
    """The non-empty items of a ``sep``-separated list, stripped."""
    return tuple(p.strip() for p in text.split(sep) if p.strip())

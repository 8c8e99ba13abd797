"""The value checks that the small tables share: the settings (``harness/settings.py``), the
node's environment (``nodeenv.py``) and the failpoints (``failpoints.py``).

Two levels. The value functions (:func:`integer`, :func:`number`, :func:`one_of`, :func:`items`)
return a value, converted, or raise ValueError. A :class:`Check` is one kind of value as a table
declares it: how its text is read, which values are valid, how it is written back, and what an
error says was expected. The settings table and ``NodeEnv`` declare every value with a
:class:`Check` from the constructors below, so both read, check and word their errors one way::

    at_least = integers(2)
    at_least.parse("3")             # 3
    at_least.parse("1")             # Invalid: must be an integer of at least 2, got '1'
    f"NUM_STAGES {error}"           # the table puts the value's name in front

Standard library only: the plugin loads it at start-up.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


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


# --- checks: one kind of value, as a table declares it ------------------------------------------


class Invalid(ValueError):
    """A value that fails its check. The message is a predicate that follows the value's name:
    ``must be an integer of at least 2, got '1'``; a table writes ``f"{name} {error}"``."""


def _always(value: Any) -> bool:
    return True


@dataclass(frozen=True)
class Check(Generic[T]):
    """One kind of value. ``convert`` turns text into the value (ValueError when it is not of the
    form); ``valid`` says whether a value is within bounds, or raises :class:`Invalid` in words of
    its own; ``types`` are what a value given as such (not as text) must be; ``show`` writes a
    value back as text; ``noun`` makes a choice's error ``names an unknown <noun> 'x'; expected
    one of ...``; a ``secret`` value never appears in an error, only its length."""

    expected: str
    convert: Callable[[str], T]
    valid: Callable[[T], bool] = _always
    types: tuple[type, ...] = (str,)
    show: Callable[[T], str] = str
    noun: str = ""
    secret: bool = False
    choices: tuple[str, ...] | None = None

    def parse(self, text: str) -> T:
        """The value that ``text`` writes, checked; :class:`Invalid` when it is not one."""
        try:
            value = self.convert(text)
        except Invalid:
            raise
        except ValueError:
            raise Invalid(self.problem(text)) from None
        if not self.valid(value):
            raise Invalid(self.problem(text))
        return value

    def check(self, value: Any) -> T:
        """``value``, given as such (not as text), if it is one of this kind; else :class:`Invalid`."""
        typed = isinstance(value, self.types) and (bool in self.types or not isinstance(value, bool))
        if not typed or not self.valid(value):
            raise Invalid(self.problem(self.show(value) if typed and self.secret else value))
        checked: T = value
        return checked

    def problem(self, got: Any) -> str:
        """What an error says after the value's name: what was expected and what was given."""
        shown = f"{len(str(got))} characters" if self.secret else repr(got)
        if self.noun:
            return f"names an unknown {self.noun} {shown}; expected one of {self.expected}"
        return f"must be {self.expected}, got {shown}"


def integers(least: int, expected: str = "") -> Check[int]:
    """An integer of at least ``least``."""
    return Check(
        expected or f"an integer of at least {least}",
        lambda text: integer(text.strip()),
        lambda n: n >= least,
        types=(int,),
    )


def numbers(
    *, above: float | None = None, least: float | None = None, most: float | None = None, expected: str = ""
) -> Check[float]:
    """A number within the bounds given (NaN is within none); ``expected`` says so in words
    (by default: a positive number, a number between ``least`` and ``most``, a number)."""
    if not expected:
        if above == 0 and least is None and most is None:
            expected = "a positive number"
        elif least is not None and most is not None:
            expected = f"a number between {least:g} and {most:g}"
        else:
            expected = "a number"

    def valid(x: float) -> bool:
        try:
            number(x, above=above, least=least, most=most)
        except ValueError:
            return False
        return not math.isnan(x)

    return Check(expected, float, valid, types=(int, float), show=lambda x: f"{x:g}")


def choice(options: Sequence[str], noun: str = "", expected: str = "") -> Check[str]:
    """One of ``options``, in any case (the option as written in ``options``). With a ``noun``
    the error says ``names an unknown <noun> 'x'; expected one of ...``; without,
    ``must be <expected>, got 'x'`` (``expected`` by default: one of the options)."""
    options = tuple(options)
    by_folded = {o.lower(): o for o in options}

    def convert(text: str) -> str:
        folded = text.strip().lower()
        if folded not in by_folded:
            raise ValueError(text)
        return by_folded[folded]

    words = ", ".join(options) if noun else (expected or "one of " + ", ".join(options))
    return Check(words, convert, lambda v: v in options, noun=noun, choices=options)


def switch(on: str, off: str) -> Check[bool]:
    """A yes or no written as ``on`` or ``off`` (in any case): True or False."""

    def convert(text: str) -> bool:
        word = text.strip().lower()
        if word not in (on, off):
            raise ValueError(text)
        return word == on

    return Check(f"{on} or {off}", convert, types=(bool,), show=lambda v: on if v else off, choices=(on, off))


def text(*, nonempty: bool = False, secret: bool = False, expected: str = "") -> Check[str]:
    """Any text (``nonempty``: not blank)."""
    if nonempty:
        return Check(expected or "a non-empty text", str, lambda v: bool(v.strip()), secret=secret)
    return Check(expected or "text", str, secret=secret)

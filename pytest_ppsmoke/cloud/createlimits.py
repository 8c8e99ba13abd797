"""What a create may carry: the limits vast.ai documents for it (``x-input-validation`` in the
vendored ``create_instance.yaml``, from the one table of vast.ai's limits, ``vastdoc``:
:func:`limits`), and the check that holds a create's body to them before it is sent
(:func:`problems`).

``env`` is read as vast-cli sends it: an object of variables (its ``parse_env`` turns the
document's docker-flag string ``-e K=V -p 7000:7000/udp`` into ``{"K": "V", "-p 7000:7000/udp":
"1"}``); ``max_length`` holds each value, ``max_total_length`` the whole of it written back as the
flag string (``-e K=V`` for a variable, the key alone for a port), the longer of the two readings.
A line names the field, the variable and the lengths, never a value (the env carries keys)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import vastdoc
from .provider import ProviderError
from .vastdoc import env_flags as env_flags  # the reading of env the emulator holds a create to


class OverLimit(ProviderError):
    """A create refused here, before it was sent (nothing was rented): its body breaks a limit vast.ai
    documents. Its status is 400, the answer vast.ai would give it."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__(f"not sent: it breaks vast.ai's documented limits for a create: {'; '.join(lines)}", 400)


@dataclass(frozen=True)
class CreateLimits:
    image_max: int  # characters of the image's name
    args_max: int  # args, args_str and onstart together
    label_max: int
    env_value_max: int  # characters of one env value
    env_total_max: int  # characters of the env as its docker-flag string
    disk_min: float  # GB


@functools.cache
def limits() -> CreateLimits:
    """``create_instance.yaml``'s ``x-input-validation``, from the one table (``vastdoc``)."""
    v = vastdoc.input_limits()["create"]
    return CreateLimits(
        image_max=int(v["image"]["max_length"]),
        args_max=int(v["args"]["max_length"]),
        label_max=int(v["label"]["max_length"]),
        env_value_max=int(v["env"]["max_length"]),
        env_total_max=int(v["env"]["max_total_length"]),
        disk_min=float(v["disk"]["min"]),
    )


def problems(body: Mapping[str, Any]) -> list[str]:
    """How a create's body breaks vast.ai's documented limits, one line each; [] when it fits."""
    lim, out = limits(), []
    image = str(body.get("image") or "")
    if len(image) > lim.image_max:
        out.append(f"image is {len(image)} characters, at most {lim.image_max} expected")
    args = sum(len(str(body.get(k) or "")) for k in ("args", "args_str", "onstart"))
    if args > lim.args_max:
        out.append(f"args, args_str and onstart are {args} characters together, at most {lim.args_max} expected")
    label = str(body.get("label") or "")
    if len(label) > lim.label_max:
        out.append(f"label is {len(label)} characters, at most {lim.label_max} expected")
    env: Mapping[str, str] = body.get("env") or {}
    for key, value in env.items():
        if len(value) > lim.env_value_max:
            out.append(f"env {key}'s value is {len(value)} characters, at most {lim.env_value_max} expected")
    total = len(env_flags(env))
    if total > lim.env_total_max:
        out.append(f"env is {total} characters in all (as -e K=V flags), at most {lim.env_total_max} expected")
    disk = body.get("disk")
    if not isinstance(disk, int | float) or disk < lim.disk_min:
        out.append(f"disk is {disk!r} GB, at least {lim.disk_min:g} GB expected")
    return out


def check(body: Mapping[str, Any]) -> None:
    """:class:`OverLimit` naming every limit ``body`` breaks."""
    found = problems(body)
    if found:
        raise OverLimit(found)

"""The emulator's runtimes, by name: what an instance is on its host. Each name is one class of
:mod:`.runtimes` (a :class:`~.runtimes.Runtime`); a new runtime is a new class there and its line
here. ``pp-fake-vast --runtime``, ``FakeVast(runtime=...)`` and the smoke run's ``runtime``
setting all take these names.

Standard library only. The names themselves are ``cloud/runtimenames.py``'s (the plugin's
settings, read when pytest loads the plugin, list them); this table must name each of them.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..runtimenames import NAMES as NAMES

RUNTIMES: dict[str, str] = {
    "processes": "pytest_ppsmoke.cloud.emulator.runtimes:Processes",  # a node process of this Python
    "image": "pytest_ppsmoke.cloud.emulator.runtimes:Image",  # the image the create call names, in a container
}
if tuple(RUNTIMES) != NAMES:  # one name list: the settings' is runtimenames'
    raise ImportError(f"the runtimes {tuple(RUNTIMES)} are not runtimenames.NAMES {NAMES}")


def load(name: str) -> Any:
    """The runtime class named ``name``; ValueError, naming the choices, for a name not listed."""
    try:
        module, _, qualname = RUNTIMES[name].partition(":")
    except KeyError:
        raise ValueError(f"unknown runtime {name!r}; expected one of {', '.join(RUNTIMES)}") from None
    return getattr(importlib.import_module(module), qualname)

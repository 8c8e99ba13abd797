"""The names of what an emulated instance can be on its host (the emulator's runtimes): the
settings table lists them, so they live here, apart from the emulator. Standard library only
(the plugin's settings are read when pytest loads it). ``emulator/registry.py`` maps each name
to its class."""

from __future__ import annotations

NAMES = (
    "processes",  # a node process of this Python
    "image",  # the image the create call names, in a container
)

"""The plugin's node ids under pytest-xdist, shared by ``plugin`` and ``distributed`` (which import
this module, never each other's ids). Standard library only: the plugin loads it at start-up.

In every worker the plugin appends :data:`XDIST_SUFFIX` to the node id of each test that uses the
deployment; the controller takes it off (:func:`plain_nodeid`) before any report is shown or
cached. ``pytest_ppsmoke.distributed`` says why.
"""

from __future__ import annotations

XDIST_SUFFIX = "@ppsmoke"


def plain_nodeid(nodeid: str) -> str:
    return nodeid.removesuffix(XDIST_SUFFIX)

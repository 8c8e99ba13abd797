"""A node's own instance, from the node's environment: the provider it runs on, picked through
the seam (``provider.OwnInstance``), so that the node destroys its own instance without naming a
provider. vast.ai's host agent (and the emulator, as it) sets ``CONTAINER_ID`` and
``CONTAINER_API_KEY``; a node with neither runs on no provider (this machine), and exiting is all
it has to do."""

from __future__ import annotations

from ..nodeenv import NodeEnv
from .provider import OwnInstance


def own_instance(env: NodeEnv) -> OwnInstance | None:
    """The node's own instance on the provider its environment names, or None for none."""
    if env.container_id is not None and env.container_api_key:
        from .vast import DEFAULT_URL, OwnVastInstance  # aiohttp's client: only a node that outlived its run

        return OwnVastInstance(env.container_id, env.container_api_key, env.vast_url or DEFAULT_URL)
    return None

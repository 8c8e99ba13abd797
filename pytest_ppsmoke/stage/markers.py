"""The node's failpoints that write into its own log: ``node.say`` (a marker line, so that a
test can find this node's words in the tail the orchestrator collects) and ``node.log_secrets``
(the node's own keys, written as text, hex and base64, so that a test can check that no reader
of the log, the node's own ring, vast.ai's logs or the orchestrator, lets one through).

Both log at WARNING: the node's log level (``PP_LOG_LEVEL``) is WARNING unless set otherwise."""

from __future__ import annotations

import base64
import logging

from .. import failpoints
from ..nodeenv import NodeEnv

log = logging.getLogger(__name__)


def say(when: str) -> None:
    """The failpoint ``node.say``: ``marker: <word> (<when>)``."""
    if failpoints.on("node.say"):
        log.warning("marker: %s (%s)", failpoints.value("node.say"), when)


def log_secrets(env: NodeEnv) -> None:
    """The failpoint ``node.log_secrets``: each key the node holds, as written, its text's bytes
    in hex and base64, and (for the node key) its own bytes in hex and base64."""
    if not failpoints.on("node.log_secrets"):
        return
    keys = {"node key": env.node_key.hex(), "container key": env.container_api_key}
    for name, key in keys.items():
        if not key:
            continue
        text = key.encode()
        log.warning("failpoint node.log_secrets: %s %s", name, key)
        log.warning("failpoint node.log_secrets: %s in hex %s", name, text.hex())
        log.warning("failpoint node.log_secrets: %s in base64 %s", name, base64.b64encode(b"k=" + text).decode())
    if env.node_key:
        raw = env.node_key
        log.warning("failpoint node.log_secrets: node key's bytes in base64 %s", base64.b64encode(raw).decode())
        log.warning("failpoint node.log_secrets: node key's bytes in upper hex %s", raw.hex().upper())

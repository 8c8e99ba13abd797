"""What a node says of its own life, at its default log level: so that the tail of a node that
hung (read from vast.ai's logs, where its process can no longer answer) says where it stopped.

    life = Lifecycle(stage_name(1))
    life.joined(node.id)                       # joined the cluster as pp-stage-1 (node 3f2a9c01...)
    life.prefill(1, 11)                        # request 1: prefill of 11 positions begins
    life.decode(1, 12, 64)                     # request 1: decode, 12 of 64 tokens (bounded rate)

Its lines are INFO records of their own logger, which is switched on whatever the node's level
unless that level is quieter than WARNING (``PP_LOG_LEVEL=ERROR`` silences it too). They go where
every record goes, redacted at the source like every other line (``runtime/scrub.py``): the
node's stderr, and its ring for ``LogTail``. Their volume is bounded: a handful per request and
per load, and decode's count at most once every :data:`DECODE_EVERY` seconds (and its last).
"""

from __future__ import annotations

import logging
import time

from ..protocol import LOAD_STEPS

log = logging.getLogger("pytest_ppsmoke.node.lifecycle")
DECODE_EVERY = 5.0  # seconds between two lines of decode's count


def switch_on(level: str) -> None:
    """The lifecycle's lines on at ``level`` (the node's ``PP_LOG_LEVEL``) and below WARNING's
    quiet: on at WARNING (the default), INFO and DEBUG; off at ERROR and CRITICAL."""
    numeric = logging.getLevelName(level.upper())
    on = not isinstance(numeric, int) or numeric <= logging.WARNING
    log.setLevel(logging.INFO if on else logging.NOTSET)


class Lifecycle:
    def __init__(self, name: str) -> None:
        self.name = name
        self._decode_at = 0.0

    def joined(self, node_id: str) -> None:
        log.info("joined the cluster as %s (node %s...)", self.name, node_id[:10])

    def loading(self) -> None:
        log.info("worker loading: %s", ", ".join(LOAD_STEPS))

    def ready(self, first_block: int, end_block: int, seconds: float) -> None:
        log.info(
            "worker ready: blocks [%d, %d), loaded in %.1f s; waiting for a request", first_block, end_block, seconds
        )

    def prefill(self, request_id: int, positions: int) -> None:
        log.info("request %d: prefill of %d positions begins", request_id, positions)

    def prefilled(self, request_id: int) -> None:
        log.info("request %d: prefill passed on; decode begins", request_id)

    def decode(self, request_id: int, tokens: int, max_tokens: int, last: bool = False) -> None:
        now = time.monotonic()
        if last or now - self._decode_at >= DECODE_EVERY:
            self._decode_at = now
            log.info("request %d: decode, %d of %d tokens", request_id, tokens, max_tokens)

    def done(self, request_id: int, tokens: int) -> None:
        log.info("request %d: done, %d tokens", request_id, tokens)

    def reference(self, max_tokens: int) -> None:
        log.info("reference of %d tokens begins", max_tokens)

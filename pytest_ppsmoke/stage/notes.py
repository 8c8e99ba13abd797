"""A stage node's progress notes (``messages.Progress``): counts of work done, one way, to the
orchestrator, so that its live line counts what runs in the nodes.

    notes = Notes(node, stage)
    notes.send(reply_to, request_id, "blocks", end_block, num_blocks, always=True)   # prefill
    notes.send(reply_to, request_id, "tokens", len(tokens), max_tokens)              # decode

A note is sent without waiting for it to be written or answered (``Node.send_nowait``): the
token loop never waits on the orchestrator. Counts only, never a token id. Of each kind, at most
one every :data:`NOTE_EVERY` seconds per node (``always``: the prefill's one note per stage).
"""

from __future__ import annotations

import time

from ..messages import Progress
from ..protocol import STAGE_ACTOR
from ..runtime.codec import ActorAddress
from ..runtime.node import Node

NOTE_EVERY = 1.0  # seconds: at most one note of a kind in this long, per node
NOTE_TIMEOUT = 30.0  # a note's send; one that fails is dropped (logged at debug level)


class Notes:
    def __init__(self, node: Node, stage: int) -> None:
        self.node, self.stage = node, stage
        self.sent_at: dict[str, float] = {}  # each kind's last note, on this process's clock

    def reset(self) -> None:
        """A new request (or reference): its first note of each kind goes at once."""
        self.sent_at.clear()

    def send(
        self, to: ActorAddress | None, request_id: int, what: str, done: int, total: int, *, always: bool = False
    ) -> bool:
        """Note ``done`` of ``total`` ``what`` to ``to`` (None: nobody to tell), unless one of
        this kind went within :data:`NOTE_EVERY` seconds; whether it went."""
        now = time.monotonic()
        last = self.sent_at.get(what)
        if to is None or not to.actor or (not always and last is not None and now - last < NOTE_EVERY):
            return False
        self.sent_at[what] = now
        self.node.send_nowait(to, Progress(request_id, self.stage, what, done, total), NOTE_TIMEOUT, STAGE_ACTOR)
        return True

"""Errors shared by the runtime modules."""

from __future__ import annotations

from .codec import ActorAddress


class RemoteError(RuntimeError):
    """The receiving actor failed the request; ``kind`` is its short tag (``unknown_actor``, ...)."""

    def __init__(self, address: ActorAddress, kind: str, message: str) -> None:
        super().__init__(f"{address}: {kind}: {message}")
        self.address = address
        self.kind = kind

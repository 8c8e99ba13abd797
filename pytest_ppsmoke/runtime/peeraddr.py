"""Who an endpoint is and how to reach it, apart from the transport that connects to it: its id
from its secret key, and :class:`PeerAddr` (an id with direct addresses or a relay, written as an
endpoint ticket). Only the iroh binding's value types: no endpoint, no frames, so that what only
names or parses addresses (the emulator's faults, child processes' keys) imports no transport."""

from __future__ import annotations

import os
from dataclasses import dataclass

import iroh


@dataclass(frozen=True)
class PeerAddr:
    """How to reach an endpoint: its id, and direct addresses or a relay where there is no discovery."""

    id: str
    addrs: tuple[str, ...] = ()
    relay: str | None = None

    def ticket(self) -> str:
        return str(iroh.EndpointTicket.from_addr(self.to_iroh()))

    def to_iroh(self) -> iroh.EndpointAddr:
        return iroh.EndpointAddr(iroh.EndpointId.from_string(self.id), self.relay, list(self.addrs))

    @classmethod
    def from_iroh(cls, addr: iroh.EndpointAddr) -> PeerAddr:
        return cls(str(addr.id()), tuple(addr.direct_addresses()), addr.relay_url())

    @classmethod
    def parse(cls, text: str) -> PeerAddr:
        """An endpoint id (64 hex characters, found through discovery) or a full ticket."""
        text = text.strip()
        if len(text) == 64 and all(c in "0123456789abcdef" for c in text.lower()):
            return cls(text.lower())
        try:
            return cls.from_iroh(iroh.EndpointTicket.from_string(text).endpoint_addr())
        except Exception as e:  # the binding raises its own error types
            raise ValueError(
                f"peer address {text[:80]!r} is neither an endpoint id (64 hex characters) nor an endpoint ticket: {e}"
            ) from None


def endpoint_id(secret_key: bytes) -> str:
    """The endpoint id that a 32-byte secret key gives."""
    return str(iroh.SecretKey.from_bytes(secret_key).public())


def new_secret_key() -> bytes:
    return os.urandom(32)

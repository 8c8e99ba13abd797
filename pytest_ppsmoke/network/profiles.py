"""Network profiles: what a link between two members does to the packets on it.

A link is directed (``src -> dst``): one-way delay with jitter, loss (independent or bursty) and a
rate. A :class:`NetworkSpec` is a default profile plus per-link overrides, written as text:
``wan`` or ``wan;host->1=far;1->0=lan`` (members are named ``host`` (the orchestrator) and
``0``, ``1``, ... (the stages)). ``internet`` and ``internet-far`` are ``wan`` and ``far`` with NAT:
the orchestrator behind a home router, each instance behind its host's public address.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class LinkProfile:
    """One direction of a link.

    - ``delay_ms``: one-way delay; each packet waits ``delay_ms`` + uniform(-``jitter_ms``, +``jitter_ms``)
      (never below 0). Packets of one link never overtake each other, so jitter only stretches a
      packet that would have, like a real FIFO path (netem reorders instead; we do not).
    - ``loss``: the long-run fraction of packets dropped.
    - ``loss_corr``: P(drop | the link's previous packet was dropped), a two-state Gilbert model
      whose mean is ``loss``; 0 means independent drops. Must be 0 or at least ``loss``.
    - ``rate_mbit``: serialisation at that rate on a FIFO of ``queue`` packets (tail drop); 0 = unlimited.
    """

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    loss_corr: float = 0.0
    rate_mbit: float = 0.0
    queue: int = 1000

    def __post_init__(self) -> None:
        for name in ("delay_ms", "jitter_ms", "rate_mbit"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected a value >= 0")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss={self.loss!r}: expected a fraction in [0, 1)")
        if not (self.loss_corr == 0.0 or self.loss <= self.loss_corr < 1.0):
            raise ValueError(f"loss_corr={self.loss_corr!r}: expected 0 (independent) or a value in [loss, 1)")
        if self.queue < 1:
            raise ValueError(f"queue={self.queue!r}: expected at least 1 packet")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        parts = [f"{self.delay_ms:g} ms"]
        if self.jitter_ms:
            parts.append(f"+-{self.jitter_ms:g} ms")
        if self.loss:
            parts.append(f"{self.loss * 100:g}% loss" + (f" (corr {self.loss_corr:g})" if self.loss_corr else ""))
        if self.rate_mbit:
            parts.append(f"{self.rate_mbit:g} Mbit/s")
        return " ".join(parts)


# The figures of each profile (docs/network.md): one-way, per direction.
PROFILES: dict[str, LinkProfile | None] = {
    "loopback": None,  # no namespaces and no switch: everything on 127.0.0.1, as before
    "lan": LinkProfile(delay_ms=0.2, rate_mbit=1000),
    "wan": LinkProfile(delay_ms=20, jitter_ms=2, loss=0.001, rate_mbit=100),
    "far": LinkProfile(delay_ms=60, jitter_ms=5, loss=0.005, rate_mbit=50),
    "slow": LinkProfile(delay_ms=300, jitter_ms=50),  # Jepsen's "slow"
    "flaky": LinkProfile(loss=0.2, loss_corr=0.75),
}
# The internet between the machines: the links of a profile above, and the orchestrator behind a
# home NAT, each instance on a private address behind its host's public one (docs/network.md)
NAT_PROFILES: dict[str, str] = {"internet": "wan", "internet-far": "far"}

_LINK = re.compile(r"^\s*([A-Za-z0-9_]+)\s*->\s*([A-Za-z0-9_]+)\s*=\s*([a-z]+)\s*$")


@dataclass(frozen=True)
class NetworkSpec:
    """A default profile and per-link overrides; ``default is None`` is loopback (nothing emulated)."""

    name: str
    default: LinkProfile | None
    overrides: dict[tuple[str, str], LinkProfile] = field(default_factory=dict)
    nat: bool = False  # the internet: a home NAT before the orchestrator, each instance behind its host's

    @property
    def profile(self) -> str:
        """The base profile's name (``wan`` of ``wan;host->1=far``)."""
        return self.name.split(";", 1)[0].strip()

    @property
    def emulated(self) -> bool:
        return self.default is not None

    def link(self, src: str, dst: str) -> LinkProfile:
        assert self.default is not None, "loopback has no links"
        return self.overrides.get((src, dst), self.default)

    def to_json(self) -> dict[str, Any]:
        assert self.default is not None, "loopback has no links"
        return {
            "default": self.default.to_json(),
            "overrides": {f"{s}->{d}": p.to_json() for (s, d), p in self.overrides.items()},
            "nat": self.nat,
        }


def parse_network(text: str) -> NetworkSpec:
    """``PROFILE[;SRC->DST=PROFILE]...``, e.g. ``wan;host->1=far;1->0=lan``."""
    known = ", ".join([*PROFILES, *NAT_PROFILES])
    parts = [p for p in text.split(";")]
    base = parts[0].strip()
    nat = base in NAT_PROFILES
    if base not in PROFILES and not nat:
        raise ValueError(f"network {text!r}: unknown profile {base!r}; known profiles: {known}")
    default = PROFILES[NAT_PROFILES.get(base, base)]
    overrides: dict[tuple[str, str], LinkProfile] = {}
    for part in parts[1:]:
        m = _LINK.match(part)
        if m is None:
            raise ValueError(f"network {text!r}: override {part.strip()!r} is not SRC->DST=PROFILE (e.g. host->1=far)")
        src, dst, prof = m.groups()
        if default is None:
            raise ValueError(f"network {text!r}: loopback has no links to override; start from another profile")
        target = PROFILES.get(prof)
        if target is None:
            raise ValueError(f"network {text!r}: override {part.strip()!r} names {prof!r}; known profiles: {known}")
        if src == dst:
            raise ValueError(f"network {text!r}: override {part.strip()!r} links a member to itself")
        overrides[(src, dst)] = target
    return NetworkSpec(text.strip(), default, overrides, nat)

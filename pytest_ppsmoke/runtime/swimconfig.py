"""The failure detector's settings and counts: ``SwimConfig`` (the one place for its numbers, with
the presets for loopback, a shared CPU and the WAN, and the ``PP_SWIM`` round trip) and
``SwimStats``. Kept apart from the protocol in ``swim.py``, as memberlist keeps its ``Config``
apart: the orchestrator, the harness and the benchmarks choose and report timings without the
membership state machine. The suspicion bounds follow memberlist's ``suspicionTimeout`` and
Lifeguard's dynamic suspicion (``suspicion.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class SwimConfig:
    """Timing of the failure detector, the one place for its numbers (docs/runtime.md).

    ``suspicion_timeout`` is the shortest suspicion of a cluster of up to 10 members (memberlist's
    ``SuspicionMult * ProbeInterval``); it grows with ``log10(n)`` beyond. A suspicion that no other
    member confirms lasts ``suspicion_max_mult`` times as long. ``awareness_max`` caps the local
    health multiplier: the probe period and timeout stretch up to that factor.
    """

    protocol_period: float = 0.25
    ping_timeout: float = 0.12
    indirect_checks: int = 2
    suspicion_timeout: float = 2.0
    suspicion_max_mult: float = 3.0
    awareness_max: int = 8
    gossip_interval: float = 0.05
    gossip_fanout: int = 3
    retransmit_mult: int = 4
    max_piggyback: int = 16
    sync_interval: float = 5.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not v > 0:
                raise ValueError(f"SWIM {f.name} must be positive, got {v!r}")
        if self.ping_timeout >= self.protocol_period:
            raise ValueError(
                f"SWIM ping_timeout ({self.ping_timeout}) must be shorter than protocol_period ({self.protocol_period})"
            )
        if self.suspicion_max_mult < 1:
            raise ValueError(
                f"SWIM suspicion_max_mult must be at least 1 (the maximum suspicion is that multiple of the "
                f"minimum), got {self.suspicion_max_mult!r}"
            )
        if self.awareness_max < 1 or self.awareness_max != int(self.awareness_max):
            raise ValueError(f"SWIM awareness_max must be a whole number >= 1, got {self.awareness_max!r}")

    @classmethod
    def loopback(cls) -> SwimConfig:
        """Members on one machine, nothing else running: fast detection."""
        return cls()

    @classmethod
    def shared_cpu(cls) -> SwimConfig:
        """Loopback, with the stages' tinygrad workers on the same few cores: a node's event
        loop can be starved for seconds, which must not read as death (seen on 2 cores with
        two runs at once: the orchestrator declared both live stages dead after a flat 5 s
        suspicion). A lone accuser waits 4 x 3 s; a confirmed suspicion 3 s."""
        return cls(suspicion_timeout=3.0, suspicion_max_mult=4.0)

    @classmethod
    def wan(cls) -> SwimConfig:
        """Round trips of tens to hundreds of milliseconds between continents: memberlist's LAN
        timing (probe 1 s, timeout 500 ms, 3 indirect checks, suspicion 4 probe periods), with
        a shorter maximum (x3, memberlist x6) so that a lone accuser's suspicion ends in 12 s."""
        return cls(
            protocol_period=1.0,
            ping_timeout=0.5,
            indirect_checks=3,
            suspicion_timeout=4.0,
            suspicion_max_mult=3.0,
            gossip_interval=0.2,
            sync_interval=15.0,
        )

    def suspicion_bounds(self, n: int) -> tuple[float, float]:
        """(minimum, maximum) suspicion timeout in a cluster of ``n`` members (memberlist's
        ``suspicionTimeout``: the minimum grows with ``log10(n)`` from 10 members on)."""
        lo = self.suspicion_timeout * max(1.0, math.log10(max(n, 1)))
        return lo, lo * self.suspicion_max_mult

    def detection_bound(self, n: int, confirmed: bool = True) -> float:
        """Seconds from a member's death to its declaration at the latest, by a healthy prober
        in a cluster of ``n`` members: the target is probed within two rounds of ``n - 1``
        periods (the round-robin is reshuffled after each round), the probe ends within a period
        or three ping timeouts (the direct ping, then the helpers' wait), then the suspicion runs
        its minimum (confirmed by another member's failed probe) or its maximum (a lone
        accuser). A prober whose awareness is up stretches the first two terms by it."""
        lo, hi = self.suspicion_bounds(n)
        probed = 2 * max(1, n - 1) * self.protocol_period
        probe = max(self.protocol_period, 3 * self.ping_timeout)
        return probed + probe + (lo if confirmed else hi)

    def to_env(self) -> str:
        """The ``PP_SWIM`` value that gives a member this configuration."""
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    def with_overrides(self, spec: str) -> SwimConfig:
        """Apply ``"name=value,name=value"`` (for example from the ``PP_SWIM`` variable)."""
        names = {f.name: f.type for f in fields(self)}
        changes: dict[str, float | int] = {}
        for item in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in names:
                raise ValueError(f"bad SWIM setting {item!r}; expected name=value with name in {sorted(names)}")
            try:
                changes[key] = int(value) if names[key] in (int, "int") else float(value)
            except ValueError:
                raise ValueError(f"SWIM setting {key} needs a number, got {value!r}") from None
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class SwimStats:
    """What this member's failure detector has done so far (for reports and benchmarks).

    ``awareness`` is the current local health score (0 healthy .. ``awareness_max - 1``);
    ``suspicions_raised`` counts members our own probes made suspect; ``suspicions_refuted``
    suspicions we held that ended with the member's refutation; ``confirmations`` independent
    confirmations of suspicions we held (another accuser, or our own failed probe of a member
    someone else suspected); ``deaths_declared`` members whose suspicion ran out here (deaths
    learned from others are not counted); ``refuted_about_me`` suspicions or deaths of ours we
    refuted; ``stalls_excused`` probes whose deadline fired late because our own event loop
    stalled, counted against our local health instead of the target."""

    awareness: int = 0
    suspicions_raised: int = 0
    suspicions_refuted: int = 0
    confirmations: int = 0
    deaths_declared: int = 0
    refuted_about_me: int = 0
    stalls_excused: int = 0

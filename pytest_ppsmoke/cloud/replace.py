"""Replacing a host that never boots: the policy the rental follows, and the assumptions about
vast.ai's boots it rests on, shared with the simulation that chose it (``bench/replacement_sim.py``,
which runs the rental itself on a virtual clock; docs/benchmarks.md has its table).

A smoke test's verdict is about the deployment, not about the cloud. vast.ai puts a boot at
"typically 1-5 minutes", and some hosts never finish: waiting the whole boot window for one,
then failing, tells a user's CI that the deployment is broken. So an instance that has not
reached ``running`` by its per-host deadline (from its create), or whose node has not joined by
its join deadline (from its running), is replaced: the next offer, on another machine, rented
and the slow instance destroyed. Only when a replacement fits the rest of the budget, by the
estimate below; otherwise the slow host keeps its own boot window, the best chance left.

``ReplacePolicy(on=False)`` is the spec's error table as written: a host that never runs, or a
node that never joins, fails the run.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ..protocol import PhaseError


@dataclass(frozen=True)
class BootAssumption:
    """How long a vast.ai host takes from its create to ``running``, as the simulation assumes
    it: a log-normal distribution whose 5th and 95th percentiles are ``p5`` and ``p95``
    seconds (vast.ai documents "typically 1-5 minutes", the image's size deciding; boots are
    skewed: most are quick, a few very slow), and a share ``never`` of hosts that never boot."""

    p5: float = 60.0
    p95: float = 300.0
    never: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.p5 < self.p95:
            raise ValueError(f"boot percentiles must be 0 < p5 < p95, got p5={self.p5} p95={self.p95}")
        if not 0 <= self.never < 1:
            raise ValueError(f"the share of hosts that never boot must be in [0, 1), got {self.never}")

    @property
    def median(self) -> float:
        return math.sqrt(self.p5 * self.p95)

    @property
    def sigma(self) -> float:
        return math.log(self.p95 / self.p5) / (2 * 1.6448536269514722)  # z of the 95th percentile

    def sample(self, rng: random.Random) -> float | None:
        """One host's boot in seconds; None for a host that never boots."""
        if rng.random() < self.never:
            return None
        return rng.lognormvariate(math.log(self.median), self.sigma)


# vast.ai's documented range, with the search's own bound: hosts of at least MIN_INET_DOWN
# Mbit/s, whose download of the image and the model fits in about a minute, are the quick end of
# it. The replacement's estimate below is this assumption's median
FAST_HOSTS = BootAssumption(p5=30.0, p95=150.0)
DOCUMENTED = BootAssumption(p5=60.0, p95=300.0)


@dataclass(frozen=True)
class ReplacePolicy:
    """When the rental replaces a host, and what it assumes a replacement costs in time.

    ``host_deadline``: seconds from an instance's create to ``running`` before it is replaced.
    ``keep_slow``: a host past that deadline but still booting keeps booting beside its
    replacement, and the first of the two to run goes on (the other is destroyed then); off,
    it is destroyed at once. ``join_deadline``: seconds from its running to its node joined (a
    node that has not is replaced at once). ``most``: replacements in one run (None: one a
    stage).
    ``boot_estimate``, ``join_estimate`` and ``rest_estimate``: the seconds a replacement's
    boot and its node's join are assumed to take, and the seconds the run needs once every host
    has joined (load, resolve, inference): a replacement is rented only when all three fit
    before the budget's end. The defaults are the simulation's (docs/benchmarks.md)."""

    on: bool = True
    host_deadline: float = 30.0
    keep_slow: bool = True
    join_deadline: float = 60.0
    most: int | None = None
    boot_estimate: float = round(FAST_HOSTS.median)
    join_estimate: float = 15.0
    rest_estimate: float = 75.0

    def __post_init__(self) -> None:
        for name in ("host_deadline", "join_deadline", "boot_estimate", "join_estimate", "rest_estimate"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        if self.most is not None and self.most < 0:
            raise ValueError(f"most must be at least 0 replacements, got {self.most}")

    def refusal(self, made: int, left: float | None, stages: int) -> str | None:
        """Why no replacement may be rented (None: one may), ``made`` replacements into a run of
        ``stages`` with ``left`` seconds of its budget (None: no budget): replacement off, the
        run's replacements spent, or too little left for a replacement's boot and the rest of
        the run."""
        if not self.on:
            return "replacement is off"
        most = stages if self.most is None else self.most
        if made >= most:
            return f"the run's {most} replacement(s) are spent"
        need = self.boot_estimate + self.join_estimate + self.rest_estimate
        if left is not None and left < need:
            return (
                f"the budget has {max(left, 0):.0f} s left, and a replacement needs about {need:.0f} s (a boot of "
                f"{self.boot_estimate:g} s and a join of {self.join_estimate:g} s assumed, then "
                f"{self.rest_estimate:g} s for the rest of the run)"
            )
        return None


SPEC = ReplacePolicy(on=False)  # the spec's error table: a host that never runs fails the run


class Replaceable(Exception):
    """A host that did not get there in time (``error``: the failure it is, if it is not
    replaced): its node never joined, it is dead, or (``slow``) it is still booting past its
    per-host deadline. The rental replaces it, or raises ``error``."""

    def __init__(self, error: PhaseError, *, slow: bool = False) -> None:
        super().__init__(str(error))
        self.error, self.slow = error, slow  # slow: still booting, it may yet run

"""What a rental is made of, apart from its steps (``rental.py``) and its teardown
(``teardown.py``), which both use them: the config renting needs (:class:`RentalConfig`), and
one rented instance with its timeline and cost (:class:`RentedInstance`)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from .. import DEFAULT_IMAGE
from ..nodeenv import DEFAULTS
from ..protocol import BOOT_POLL_INTERVAL, BOOT_POLLS, BUDGET, DIRECT_PORT, Names, stage_name
from .preflight import image_check
from .provider import Instance, Offer, OfferQuery, ProviderError
from .replace import ReplacePolicy

# an instance's own steps, in order: each is stamped in its timeline as it is reached
STEPS = ("rented", "running", "reached", "joined", "loaded")


@dataclass
class RentalConfig:
    """What renting needs. ``RunConfig`` (the harness's) extends it with the cluster's settings."""

    num_stages: int = DEFAULTS.num_stages
    model: str = DEFAULTS.model  # the pre-flight checks a GGUF's blocks against the stage count
    image: str = DEFAULT_IMAGE
    disk_gb: float = OfferQuery.disk_gb
    query: OfferQuery = field(default_factory=OfferQuery)
    transport: str = DEFAULTS.transport  # local: loopback; wan: the internet (a forwarded UDP port per create)
    polls: int = BOOT_POLLS  # the spec's boot polls, at vast.ai's pace: the boot window (boot_window)
    poll_interval: float = BOOT_POLL_INTERVAL  # how often the boot looks (a local run: faster)
    port: int = DIRECT_PORT  # wan: the UDP port each create asks vast.ai to forward (0: none, relays only)
    offer_races: int = 4  # offers raced away between search and create that the run moves past
    redestroys: int = 2  # destroys sent again when vast.ai accepted one but still shows the instance running
    preflight: bool = True  # the checks before the first create (.preflight)
    check_image: bool | str | None = None  # ask the image's registry; a str: why not; None: image_check decides
    budget: float = BUDGET  # the run's seconds: the credit must cover the offers' $/h for this long
    names: Names = field(default_factory=Names)  # how the face names a setting in a failure's advice
    replacement: ReplacePolicy = field(default_factory=ReplacePolicy)  # a host that never boots (.replace)

    def __post_init__(self) -> None:
        if self.num_stages < 2:
            raise ValueError(f"num_stages must be at least 2, got {self.num_stages}")
        if self.transport not in ("local", "wan"):
            raise ValueError(f"transport must be 'local' or 'wan', got {self.transport!r}")
        if self.polls < 1:
            raise ValueError(f"polls must be at least 1, got {self.polls}")
        if self.offer_races < 0:
            raise ValueError(f"offer_races must be at least 0, got {self.offer_races}")
        if self.check_image is None:
            self.check_image = image_check(self.image, vastai=self.transport != "local")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be a UDP port (1..65535), or 0 for none, got {self.port}")
        if self.direct and not self.query.direct_ports:
            self.query = dataclasses.replace(self.query, direct_ports=1)

    @property
    def boot_window(self) -> float:
        """Seconds an instance has to run: the spec's polls at vast.ai's pace (60 x 3 s = 180 s),
        however often the run looks (``poll_interval``). vast.ai's docs put a boot at 1-5 minutes
        (the image's size decides); the search skips hosts whose download would eat the window
        (``OfferQuery.min_inet_down``). Each node knows it: until the orchestrator first reaches
        it, a node waits this long plus its grace before it removes itself."""
        return self.polls * BOOT_POLL_INTERVAL

    @property
    def direct(self) -> bool:
        """Whether each create asks vast.ai to forward a UDP port, for a direct path to its node."""
        return self.transport == "wan" and self.port > 0


@dataclass
class RentedInstance:
    stage: int
    offer: Offer
    label: str
    id: int | None = None
    created_at: float | None = None  # wall clock, for the cost
    ended_at: float | None = None
    state: str | None = None  # last actual_status seen; then "destroyed" (gone) or "destroying" (still listed)
    status_msg: str = ""
    endpoint_id: str = ""
    destroy_error: str | None = None
    public_udp: str | None = None  # where vast.ai forwards its node's UDP port from (its record's ports)
    timeline: dict[str, float] = field(default_factory=dict)  # STEPS reached: seconds since the run began
    replacement: int = 0  # 0: its stage's first instance; k: the k-th to replace it
    replaces: int | None = None  # the id of the instance it replaced
    replaced: str | None = None  # why it was replaced (then destroyed): it never ran, or never joined
    replaced_at: float | None = None  # when: seconds since the run began
    started: float | None = None  # the rental's clock at its create: its per-host deadline counts from it
    late: str | None = None  # why a replacement was rented to race it (it may yet run first)

    @property
    def name(self) -> str:
        return f"instance {self.id} (stage {self.stage})"

    @property
    def where(self) -> str:
        """How a failure names it: ``pp-stage-1 on instance N (label)``."""
        return f"{stage_name(self.stage)} on instance {self.id} ({self.label})"

    def reached(self, step: str, since: float, now: float | None = None) -> None:
        """Stamp ``step`` (one of :data:`STEPS`) at the seconds from ``since`` to ``now`` (times of
        one clock; ``now`` by default: ``time.monotonic()``)."""
        if step not in STEPS:
            raise ValueError(f"unknown instance step {step!r}; expected one of {', '.join(STEPS)}")
        self.timeline.setdefault(step, round((time.monotonic() if now is None else now) - since, 3))

    def seconds(self) -> float:
        if self.created_at is None:
            return 0.0
        return (self.ended_at or time.time()) - self.created_at

    def cost_usd(self) -> float:
        return self.offer.dph_total * self.seconds() / 3600

    def seen(self, record: Instance) -> None:
        """What vast.ai last showed of it."""
        self.state, self.status_msg = record.actual_status, record.status_msg

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "stage": self.stage,
            "label": self.label,
            "endpoint_id": self.endpoint_id,
            "offer": self.offer.summary(),
            "dph_total": self.offer.dph_total,
            "seconds": round(self.seconds(), 3),
            "cost_usd": round(self.cost_usd(), 6),
            "final_state": self.state,
            "status_msg": self.status_msg,
            "destroy_error": self.destroy_error,
            "public_udp": self.public_udp,
            "timeline": {step: self.timeline[step] for step in STEPS if step in self.timeline},
            "replacement": self.replacement,
            "replaces": self.replaces,
            "replaced": self.replaced,
            "replaced_at": self.replaced_at,
        }


def adopted(record: Instance) -> RentedInstance:
    """An instance of the run's label that the run held no id for (a create cancelled in flight,
    or whose answer was lost), as the run's own: to be destroyed."""
    label = str(record.label)
    if record.id is None:
        raise ProviderError(f"a record labelled {label} without an id", 200)
    stage = record.run_label.stage if record.run_label is not None else -1
    orphan = RentedInstance(stage, record.machine, label, record.id, record.start_date)
    orphan.state = record.actual_status
    return orphan

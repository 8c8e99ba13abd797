"""The provider seam: what renting asks of a GPU provider, and the records it answers in.

:class:`Provider` is a ``typing.Protocol`` of primitive calls only: the account's credit, the offers
for a query, a create (with a label and an environment), one instance shown, the instances listed
by a label prefix, a destroy, an instance's log. Everything built on those calls (waiting for
running, sweeping by label, destroying with checks and retries, watching the hosts, the
pre-flight) is shared code above the seam (``rental.py``, ``waits.py``, ``preflight.py``), run on
an injected clock; a provider re-implements none of it.

The records here are provider-neutral: an :class:`Offer`, an :class:`OfferQuery`, an
:class:`Instance`, the run's :class:`Label`, and the errors a call ends in (:class:`ProviderError`,
:class:`OfferGone`, :class:`NeverRuns`). A provider maps its own answers onto them; an instance's
states are named as vast.ai names them (``actual_status``, ``intended_status``, ``cur_state``,
``next_state``), the common vocabulary another provider maps its own states onto.

A node destroys its own instance through the same seam (:class:`OwnInstance`), picked from its
environment by ``own.py``. Standard library only: the settings table reads :class:`OfferQuery`'s
defaults.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..protocol import COMPUTE_CAPS

LABEL_PREFIX = "ppsmoke-"  # every instance this tool rents carries a label that starts so


class ProviderError(RuntimeError):
    """A provider's call failed for good. ``status`` is its answer's status, an HTTP status where the
    provider speaks HTTP (0: no answer at all: a create may then have rented all the same)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class OfferGone(ProviderError):
    """A create whose offer was taken between search and create: nothing was rented, and the next
    matching offer may be tried."""


class QuotaExceeded(ProviderError):
    """A call the provider refuses until a quota resets (vast.ai's daily search quota): not
    retried, and its message is said as it stands."""


class NeverRuns(ProviderError):
    """An instance that will never run: a dead state (:data:`DEAD_STATES`), or an error in its
    ``status_msg`` (``failure``: ``image pull``, ``container start``; "" for a dead state)."""

    def __init__(self, message: str, failure: str = "", status: int = 0) -> None:
        super().__init__(message, status)
        self.failure = failure


@dataclass(frozen=True)
class Label:
    """The label this tool gives an instance, ``ppsmoke-<run id>-stage<i>`` (a replacement's:
    ``...-stage<i>r<k>``, so that no two instances of a run share one): how a run finds its
    instances again (a create whose answer was lost, a sweep, ``--reap``). :meth:`format` writes it,
    :meth:`parse` reads it back; :meth:`prefix` is what a run's (or every run's) labels start with."""

    run_id: str
    stage: int
    replacement: int = 0  # 0: the stage's first instance; k: its k-th replacement (``...stage1r2``)

    def format(self) -> str:
        tail = f"r{self.replacement}" if self.replacement else ""
        return f"{self.prefix(self.run_id)}stage{self.stage}{tail}"

    def __str__(self) -> str:
        return self.format()

    @staticmethod
    def prefix(run_id: str | None = None) -> str:
        """What the labels of run ``run_id`` start with; of every run of this tool if None."""
        return f"{LABEL_PREFIX}{run_id}-" if run_id else LABEL_PREFIX

    @classmethod
    def parse(cls, text: str | None) -> Label | None:
        """The run id and stage of a label :meth:`format` wrote; None for any other text."""
        if not text or not text.startswith(LABEL_PREFIX):
            return None
        run_id, sep, tail = text[len(LABEL_PREFIX) :].rpartition("-stage")
        stage, r, again = tail.partition("r")
        if not sep or not run_id or not _digits(stage) or (r and not (_digits(again) and int(again) > 0)):
            return None
        return cls(run_id, int(stage), int(again) if r else 0)


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


# the least download speed (offers' inet_down, Mbit/s) of a host a run rents: a new host downloads
# the image, then the node the model, before the first token; at this speed both fit in about a
# minute, a third of the boot window (docs/lifecycle.md has the arithmetic), where vast.ai's
# slowest hosts (tens of Mbit/s) would take the whole window and more
MIN_INET_DOWN = 200.0


@dataclass(frozen=True)
class OfferQuery:
    """What a stage needs from a machine (a provider writes it as its own search)."""

    num_gpus: int = 1
    gpu_ram_gb: float = 8.0
    min_reliability: float = 0.95
    min_cuda: float = 12.4
    max_dph: float | None = 2.0  # dollars per hour, per instance
    disk_gb: float = 20.0
    verified: bool = True
    limit: int = 64
    direct_ports: int = 0  # ports the machine must be able to forward
    # the GPUs the image's NVRTC compiles for (compute capability, x100): protocol.COMPUTE_CAPS
    compute_caps: tuple[int, int] = (min(COMPUTE_CAPS), max(COMPUTE_CAPS))
    min_inet_down: float = MIN_INET_DOWN  # Mbit/s (0: any host)

    def describe(self) -> str:
        price = f", at most ${self.max_dph}/h with {self.disk_gb:g} GB of storage" if self.max_dph is not None else ""
        lo, hi = (c / 100 for c in self.compute_caps)
        return (
            f"{self.num_gpus} GPU, >= {self.gpu_ram_gb:g} GB GPU RAM, compute capability {lo:g}-{hi:g}, "
            f"reliability >= {self.min_reliability}, CUDA >= {self.min_cuda}, disk >= {self.disk_gb:g} GB"
            f"{', verified' if self.verified else ''}{price}"
            + (f", >= {self.direct_ports} direct port(s)" if self.direct_ports else "")
            + (f", download >= {self.min_inet_down:g} Mbit/s" if self.min_inet_down else "")
        )


@dataclass(frozen=True)
class Offer:
    """A machine to rent, and its price. ``raw``: the provider's own record (never shown)."""

    id: int
    gpu_name: str
    num_gpus: int
    gpu_ram_mb: float
    dph_total: float
    reliability: float
    geolocation: str
    raw: Mapping[str, Any] = field(repr=False, compare=False)
    machine_id: int = 0  # the host machine behind the offer (0: not known); a replacement avoids it

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "machine_id": self.machine_id,
            "gpu_name": self.gpu_name,
            "num_gpus": self.num_gpus,
            "gpu_ram_mb": self.gpu_ram_mb,
            "dph_total": self.dph_total,
            "reliability": self.reliability,
            "geolocation": self.geolocation,
        }


UNKNOWN_MACHINE = Offer(0, "?", 1, 0.0, 0.0, 0.0, "?", {})


@dataclass(frozen=True)
class Instance:
    """An instance as its provider shows it (show, list). A field the provider's record lacks is
    None (``status_msg`` then ""). ``forwarded``: where the provider forwards each of the
    instance's UDP ports from (``{port: "address:port"}``); ``machine``: what it runs on, as an
    offer (the cost of an instance found by its label); ``raw``: the provider's own record, never
    shown (it may hold the instance's key and its environment)."""

    id: int | None
    label: str | None  # the provider's text; ``run_label`` is it parsed, if this tool wrote it
    actual_status: str | None  # null (new), loading, running, exited, offline, unknown, ...
    intended_status: str | None  # what the owner wants: running, or stopped once destroyed
    cur_state: str | None
    next_state: str | None
    status_msg: str
    start_date: float | None
    forwarded: Mapping[int, str] = field(default_factory=dict, compare=False)
    machine: Offer = field(default=UNKNOWN_MACHINE, compare=False)
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def run_label(self) -> Label | None:
        return Label.parse(self.label)

    def public_udp(self, port: int) -> str | None:
        """Where the instance's UDP ``port`` is forwarded from (``address:port``); None for none."""
        return self.forwarded.get(port)

    def names(self) -> dict[str, Any]:
        """What names it and its state, for a report (nothing secret)."""
        return {
            "id": self.id,
            "label": self.label,
            "actual_status": self.actual_status,
            "intended_status": self.intended_status,
            "next_state": self.next_state,
        }


# never running from there. Not ``unknown``: vast.ai's "no recent heartbeat from the host" is a
# gap in the host's reports, which vast-cli's own wait loop polls through (it fails on offline,
# stopped and exited); a gap the boot window outlasts still ends the boot
DEAD_STATES = ("exited", "offline", "stopped", "frozen")
GONE_STATES = ("destroyed", "terminated")  # a status read as gone, whichever field holds it


def going_away(inst: Instance | None) -> bool:
    """Whether an instance whose destroy was accepted counts as gone: no record at all;
    ``cur_state`` ``unloaded`` (its hardware released on destroy); ``destroyed`` or ``terminated``
    in ``intended_status`` or ``actual_status``, or ``offline`` (an offline host bills nothing); or
    both ``intended_status`` and ``next_state`` present and neither ``running`` (on its way out).
    ``actual_status`` may still say running while the container stops, and a destroy does not
    change ``intended_status`` to stopped, so neither alone is asked. A record that still intends
    to run, on a contract still held (``cur_state`` running), is not going away: the destroy was
    lost. (docs/lifecycle.md gives vast.ai's sources for each.)"""
    if inst is None:
        return True
    if inst.cur_state == "unloaded" or inst.actual_status == "offline":
        return True
    if inst.intended_status in GONE_STATES or inst.actual_status in GONE_STATES:
        return True
    intended, nxt = inst.intended_status, inst.next_state
    return intended is not None and nxt is not None and "running" not in (intended, nxt)


class Provider(Protocol):
    """A GPU provider's primitive calls. Each raises :class:`ProviderError` (or a kind of it) when
    it fails for good; retries of a transport (a REST API's 429s and 5xx) are the provider's own,
    bounded by ``deadline``. Nothing here waits for a state, sweeps or checks a destroy: that is
    the shared code's, above the seam."""

    deadline: float | None  # a monotonic time no retry of a call may wait past (None: none)

    @property
    def where(self) -> str:
        """Where the provider is (its API's URL), for a message that says it cannot be reached."""
        ...

    async def credit(self) -> float | None:
        """The account's credit in dollars (None where the account shows none); ProviderError
        with status 401 or 403 when the provider refuses the key."""
        ...

    async def search_offers(self, query: OfferQuery) -> list[Offer]:
        """The offers that match ``query``, cheapest first."""
        ...

    async def create_instance(
        self, offer_id: int, *, image: str, env: Mapping[str, str], label: str, disk_gb: float = 20.0
    ) -> int:
        """Rent ``offer_id`` running ``image`` with ``env``, labelled ``label`` (unique to it: how
        it is found again); its id. :class:`OfferGone` when the offer was taken first."""
        ...

    async def show_instance(self, instance_id: int) -> Instance | None:
        """The instance's record, or None once it no longer exists."""
        ...

    async def list_instances(self, label_prefix: str | None = None) -> list[Instance]:
        """Every instance of the account, or those whose label starts with ``label_prefix``."""
        ...

    async def destroy_instance(self, instance_id: int) -> bool:
        """Destroy it; False if it was already gone. An accepted destroy may stay listed for a
        while (:func:`going_away`)."""
        ...

    async def destroy_instances(self, instance_ids: Sequence[int]) -> None:
        """Destroy them all in one call; ProviderError unless every one was accepted (then
        :meth:`destroy_instance` each). What each became is for the caller to read."""
        ...

    async def request_logs(self, instance_id: int, tail: int) -> str:
        """The last ``tail`` lines of the instance's log."""
        ...

    def spacing(self, call: str) -> float:
        """The least seconds between two calls of ``call`` (``list``, ``create``, ...) that the
        provider's limits leave (0: not spaced): a poll that shares a call with other steps keeps
        to a share of it (``Rental.watch``)."""
        ...

    def secrets(self) -> list[str]:
        """What it holds that must never be shown (its key, each created instance's own key)."""
        ...

    def calls_summary(self) -> dict[str, Any]:
        """Its calls, for the run's report (``vast_api``): counts and seconds waited."""
        ...

    async def close(self) -> None: ...


class OwnInstance(Protocol):
    """A node's own instance, as the provider it runs on lets the node destroy it (``own.py``
    picks it from the node's environment)."""

    @property
    def id(self) -> int: ...

    async def destroy(self) -> bool:
        """Destroy it; False if it was already gone. ProviderError when the provider refuses."""
        ...

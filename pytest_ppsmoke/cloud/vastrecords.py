"""vast.ai's records as this tool reads and writes them, apart from the client (``vast.py``) that
fetches them: the errors a call ends in (:class:`VastError` and its kinds), the instance label
(:class:`Label`), an instance (:class:`Instance`, with :func:`going_away`), the search
(:class:`OfferQuery`) and an offer (:class:`Offer`), and the client's per-endpoint counts
(:class:`ApiStats`). Each decodes vast.ai's JSON once, in ``from_json``; a record's values never
reach a message (they hold secrets: an instance's key, its ``extra_env``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ..protocol import COMPUTE_CAPS

LABEL_PREFIX = "ppsmoke-"  # every instance this tool rents carries a label that starts so


class VastError(RuntimeError):
    """A vast.ai call failed for good. ``status`` is the HTTP status (0: no answer at all)."""

    def __init__(self, method: str, path: str, status: int, message: str) -> None:
        super().__init__(f"vast.ai {method} {path}: {f'HTTP {status}' if status else 'no answer'}: {message}")
        self.method, self.path, self.status = method, path, status


class SearchQuotaExceeded(VastError):
    """vast.ai's daily search quota is spent (429 ``search_quota_exceeded``): it resets at UTC
    midnight, so the call is not retried."""


class OfferGone(VastError):
    """A create whose offer was taken between search and create (404/410 ``no_such_ask``):
    nothing was rented, and the next matching offer may be tried."""


class NeverRuns(VastError):
    """An instance that will never run: a dead state, or an error in its ``status_msg``
    (``failure``: ``image pull``, ``container start``; "" for a dead state)."""

    def __init__(self, method: str, path: str, status: int, message: str, failure: str = "") -> None:
        super().__init__(method, path, status, message)
        self.failure = failure


@dataclass(frozen=True)
class Label:
    """The label this tool gives an instance, ``ppsmoke-<run id>-stage<i>``: how a run finds its
    instances again (a create whose answer was lost, a sweep, ``--reap``). :meth:`format` writes it,
    :meth:`parse` reads it back; :meth:`prefix` is what a run's (or every run's) labels start with."""

    run_id: str
    stage: int

    def format(self) -> str:
        return f"{self.prefix(self.run_id)}stage{self.stage}"

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
        run_id, sep, stage = text[len(LABEL_PREFIX) :].rpartition("-stage")
        if not sep or not run_id or not (stage.isascii() and stage.isdigit()):
            return None
        return cls(run_id, int(stage))


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class Instance:
    """An instance as vast.ai shows it (show, list), decoded once by :meth:`from_json`: the fields
    this tool reads. A field the record lacks (or holds as another type) is None, ``status_msg``
    then ""; fields it does not read stay in ``raw`` (never shown: a record holds the instance's
    key and its ``extra_env``)."""

    id: int | None
    label: str | None  # vast.ai's text; ``run_label`` is it parsed, if this tool wrote it
    actual_status: str | None  # null (new), loading, running, exited, offline, unknown, ...
    intended_status: str | None  # what the owner wants: running, or stopped once destroyed
    cur_state: str | None
    next_state: str | None
    status_msg: str
    start_date: float | None
    raw: Mapping[str, Any] = field(repr=False, compare=False)

    @property
    def run_label(self) -> Label | None:
        return Label.parse(self.label)

    @classmethod
    def from_json(cls, record: Any, method: str = "GET", path: str = "/api/v1/instances/") -> Instance:
        """The record vast.ai answered (for ``method`` ``path``); VastError if it is not an object."""
        if not isinstance(record, Mapping):
            raise VastError(method, path, 200, f"expected an instance record, got {shape(record)}")
        iid = record.get("id")
        start = record.get("start_date")
        return cls(
            id=iid if isinstance(iid, int) and not isinstance(iid, bool) else None,
            label=_text(record.get("label")),
            actual_status=_text(record.get("actual_status")),
            intended_status=_text(record.get("intended_status")),
            cur_state=_text(record.get("cur_state")),
            next_state=_text(record.get("next_state")),
            status_msg=str(record.get("status_msg") or ""),
            start_date=start if isinstance(start, float) else None,
            raw=record,
        )

    def public_udp(self, port: int) -> str | None:
        """``public_ipaddr:HostPort`` where vast.ai forwards the container's UDP ``port`` from (the
        record's ``ports["<port>/udp"]``); None when the record shows no such mapping."""
        ip, ports = self.raw.get("public_ipaddr"), self.raw.get("ports")
        if not isinstance(ip, str) or not ip or not isinstance(ports, Mapping):
            return None
        bindings = ports.get(f"{port}/udp")
        if not isinstance(bindings, list):
            return None
        for b in bindings:
            host_port = b.get("HostPort") if isinstance(b, Mapping) else None
            if isinstance(host_port, (str, int)) and str(host_port).isdigit():
                return f"{ip}:{int(host_port)}"
        return None

    def names(self) -> dict[str, Any]:
        """What names it and its state, for a report (nothing secret)."""
        return {
            "id": self.id,
            "label": self.label,
            "actual_status": self.actual_status,
            "intended_status": self.intended_status,
            "next_state": self.next_state,
        }

    def machine(self) -> Offer:
        """The machine it runs on, as an offer (for the cost of an instance found by its label)."""
        r = self.raw
        price = r.get("dph_total")
        return Offer(
            int(r.get("bundle_id") or 0),
            str(r.get("gpu_name") or "?"),
            int(r.get("num_gpus") or 1),
            float(r.get("gpu_ram") or 0),
            float(price) if isinstance(price, (int, float)) else 0.0,
            float(r.get("reliability2") or 0),
            str(r.get("geolocation") or "?"),
            {},
        )


GONE_STATES = ("destroyed", "terminated")  # a status vast-cli reads as gone, whichever field holds it


def going_away(inst: Instance | None) -> bool:
    """Whether an instance whose destroy vast.ai accepted counts as gone, its record as vast.ai's
    sources describe one: no record at all (a 404, or ``instances: null``); ``cur_state``
    ``unloaded`` (vast.ai's docs: its hardware "released on destroy"); ``destroyed`` or
    ``terminated`` in ``intended_status`` or ``actual_status``, or ``offline`` (vast-cli's
    ``instance_exist``: an offline host bills nothing); or both ``intended_status`` and
    ``next_state`` present and neither ``running`` (on its way out). ``actual_status`` may still
    say running while the container stops, and a destroy does not change ``intended_status`` to
    stopped, so neither alone is asked. A record that still intends to run, on a contract still
    held (``cur_state`` running), is not going away: the destroy was lost."""
    if inst is None:
        return True
    if inst.cur_state == "unloaded" or inst.actual_status == "offline":
        return True
    if inst.intended_status in GONE_STATES or inst.actual_status in GONE_STATES:
        return True
    intended, nxt = inst.intended_status, inst.next_state
    return intended is not None and nxt is not None and "running" not in (intended, nxt)


# the least download speed (offers' inet_down, Mbit/s) of a host a run rents: a new host downloads
# the image, then the node the model, before the first token; at this speed both fit in about a
# minute, a third of the boot window (docs/lifecycle.md has the arithmetic), where vast.ai's
# slowest hosts (tens of Mbit/s) would take the whole window and more
MIN_INET_DOWN = 200.0


@dataclass(frozen=True)
class OfferQuery:
    """What a stage needs from a machine; ``body()`` is vast.ai's search query."""

    num_gpus: int = 1
    gpu_ram_gb: float = 8.0
    min_reliability: float = 0.95
    min_cuda: float = 12.4
    max_dph: float | None = 2.0  # dollars per hour, per instance
    disk_gb: float = 20.0
    verified: bool = True
    limit: int = 64
    direct_ports: int = 0  # ports the machine must be able to forward (offers' direct_port_count)
    # the GPUs the image's NVRTC compiles for (offers' compute_cap, x100): protocol.COMPUTE_CAPS
    compute_caps: tuple[int, int] = (min(COMPUTE_CAPS), max(COMPUTE_CAPS))
    min_inet_down: float = MIN_INET_DOWN  # Mbit/s (0: any host)

    def body(self) -> dict[str, Any]:
        """vast.ai's search body. ``allocated_storage`` is the disk the create rents: vast.ai
        prices each offer's ``dph_total`` for it (its default is 8 GB, vast-cli's 5 GB)."""
        q: dict[str, Any] = {
            "num_gpus": {"eq": self.num_gpus},
            "gpu_ram": {"gte": self.gpu_ram_gb * 1000},  # vast.ai counts GPU RAM in MB
            "reliability": {"gte": self.min_reliability},
            "cuda_max_good": {"gte": self.min_cuda},
            "compute_cap": {"gte": self.compute_caps[0], "lte": self.compute_caps[1]},
            "disk_space": {"gte": self.disk_gb},
            "rentable": {"eq": True},
            "rented": {"eq": False},
            "external": {"eq": False},
            "order": [["dph_total", "asc"]],
            "type": "on-demand",
            "limit": self.limit,
            "allocated_storage": self.disk_gb,
        }
        if self.min_inet_down:
            q["inet_down"] = {"gte": self.min_inet_down}
        if self.verified:
            q["verified"] = {"eq": True}
        if self.max_dph is not None:
            q["dph_total"] = {"lte": self.max_dph}
        if self.direct_ports:
            q["direct_port_count"] = {"gte": self.direct_ports}
        return q

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
    id: int
    gpu_name: str
    num_gpus: int
    gpu_ram_mb: float
    dph_total: float
    reliability: float
    geolocation: str
    raw: Mapping[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, o: Mapping[str, Any]) -> Offer:
        try:
            return cls(
                int(o["id"]),
                str(o.get("gpu_name", "?")),
                int(o.get("num_gpus", 1)),
                float(o.get("gpu_ram", 0)),
                float(o["dph_total"]),
                float(o.get("reliability", o.get("reliability2", 0)) or 0),
                str(o.get("geolocation") or "?"),
                o,
            )
        except (KeyError, TypeError, ValueError) as e:
            what = f"an offer without a usable {e}; it has {sorted(o)[:20]}"
            raise VastError("POST", "/api/v0/bundles/", 200, what) from None

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "gpu_name": self.gpu_name,
            "num_gpus": self.num_gpus,
            "gpu_ram_mb": self.gpu_ram_mb,
            "dph_total": self.dph_total,
            "reliability": self.reliability,
            "geolocation": self.geolocation,
        }


@dataclass
class EndpointStats:
    """One endpoint's calls: ``calls`` requests sent (retries included), ``rate_limited`` answers
    429, ``rate_limit_retries`` of them retried, ``retries`` retries after a 5xx or no answer,
    ``retry_wait_s`` seconds slept before retries (both kinds), ``pace_wait_s`` seconds calls
    waited for their endpoint's pace."""

    calls: int = 0
    rate_limited: int = 0
    rate_limit_retries: int = 0
    retries: int = 0
    retry_wait_s: float = 0.0
    pace_wait_s: float = 0.0


@dataclass
class ApiStats:
    """Every endpoint's :class:`EndpointStats`, and their totals."""

    endpoints: dict[str, EndpointStats] = field(default_factory=dict)

    def of(self, endpoint: str) -> EndpointStats:
        return self.endpoints.setdefault(endpoint, EndpointStats())

    @property
    def total(self) -> EndpointStats:
        out = EndpointStats()
        for e in self.endpoints.values():
            out.calls += e.calls
            out.rate_limited += e.rate_limited
            out.rate_limit_retries += e.rate_limit_retries
            out.retries += e.retries
            out.retry_wait_s += e.retry_wait_s
            out.pace_wait_s += e.pace_wait_s
        return out

    def summary(self) -> dict[str, Any]:
        """JSON-ready: the totals, and each endpoint's (seconds rounded to ms)."""

        def row(e: EndpointStats) -> dict[str, Any]:
            return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(e).items()}

        return {**row(self.total), "endpoints": {name: row(e) for name, e in sorted(self.endpoints.items())}}


def shape(data: Any) -> str:
    """What an unexpected answer looked like, without its values: answers can hold secrets
    (``instance_api_key``, an instance's ``extra_env`` with the cluster keys)."""
    if isinstance(data, dict):
        return f"an object with keys {sorted(data)[:20]}"
    if isinstance(data, list):
        return f"a list of {len(data)}"
    return type(data).__name__

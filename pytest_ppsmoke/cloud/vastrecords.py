"""vast.ai's records as this tool reads and writes them, apart from the client (``vast.py``) that
fetches them: its errors (:class:`VastError` and its kinds, each a :class:`~.provider.ProviderError`),
its answers decoded once onto the provider-neutral records of ``provider.py`` (:func:`instance_from_json`,
:func:`offer_from_json`), the search body of an :class:`~.provider.OfferQuery` (:func:`search_body`),
and the client's per-endpoint counts (:class:`ApiStats`). A record's values never reach a message
(they hold secrets: an instance's key, its ``extra_env``). The neutral records are re-exported."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

# the neutral records, re-exported: code of the vast.ai client's own may name them from here
from .provider import DEAD_STATES as DEAD_STATES
from .provider import GONE_STATES as GONE_STATES
from .provider import LABEL_PREFIX as LABEL_PREFIX
from .provider import MIN_INET_DOWN as MIN_INET_DOWN
from .provider import Instance as Instance
from .provider import Label as Label
from .provider import NeverRuns as NeverRuns
from .provider import Offer as Offer
from .provider import OfferGone as OfferGone
from .provider import OfferQuery as OfferQuery
from .provider import ProviderError, QuotaExceeded
from .provider import going_away as going_away


class VastError(ProviderError):
    """A vast.ai call failed for good. ``status`` is the HTTP status (0: no answer at all)."""

    def __init__(self, method: str, path: str, status: int, message: str) -> None:
        super().__init__(f"vast.ai {method} {path}: {f'HTTP {status}' if status else 'no answer'}: {message}", status)
        self.method, self.path = method, path


class SearchQuotaExceeded(VastError, QuotaExceeded):
    """vast.ai's daily search quota is spent (429 ``search_quota_exceeded``): it resets at UTC
    midnight, so the call is not retried."""


class VastOfferGone(VastError, OfferGone):
    """A create whose offer was taken between search and create (404 with ``no_such_ask`` in its
    ``msg``, 410 ``no_such_ask``)."""


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def instance_from_json(record: Any, method: str = "GET", path: str = "/api/v1/instances/") -> Instance:
    """The instance record vast.ai answered (for ``method`` ``path``), decoded once: the fields this
    tool reads, the UDP ports it forwards (``public_ipaddr`` and ``ports["<port>/udp"]``), the
    machine it runs on; VastError if it is not an object. A field the record lacks (or holds as
    another type) is None, ``status_msg`` then ""."""
    if not isinstance(record, Mapping):
        raise VastError(method, path, 200, f"expected an instance record, got {shape(record)}")
    iid = record.get("id")
    start = record.get("start_date")
    return Instance(
        id=iid if isinstance(iid, int) and not isinstance(iid, bool) else None,
        label=_text(record.get("label")),
        actual_status=_text(record.get("actual_status")),
        intended_status=_text(record.get("intended_status")),
        cur_state=_text(record.get("cur_state")),
        next_state=_text(record.get("next_state")),
        status_msg=str(record.get("status_msg") or ""),
        start_date=start if isinstance(start, float) else None,
        forwarded=_forwarded(record),
        machine=_machine(record),
        raw=record,
    )


def _forwarded(record: Mapping[str, Any]) -> dict[int, str]:
    """``{port: "public_ipaddr:HostPort"}`` for each container UDP port the record shows forwarded
    (its ``ports["<port>/udp"]``, the first binding with a numeric host port)."""
    ip, ports = record.get("public_ipaddr"), record.get("ports")
    if not isinstance(ip, str) or not ip or not isinstance(ports, Mapping):
        return {}
    out: dict[int, str] = {}
    for key, bindings in ports.items():
        port, _, proto = str(key).partition("/")
        if proto != "udp" or not port.isdigit() or not isinstance(bindings, list):
            continue
        for b in bindings:
            host_port = b.get("HostPort") if isinstance(b, Mapping) else None
            if isinstance(host_port, (str, int)) and str(host_port).isdigit():
                out[int(port)] = f"{ip}:{int(host_port)}"
                break
    return out


def _int(v: Any) -> int:
    """A record's id field as an int; 0 where it is missing or not a whole number (a dirty record)."""
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _machine(r: Mapping[str, Any]) -> Offer:
    """The machine an instance runs on, as an offer (for the cost of an instance found by its label)."""
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
        _int(r.get("machine_id")),
    )


def search_body(query: OfferQuery) -> dict[str, Any]:
    """vast.ai's search body for ``query``. ``allocated_storage`` is the disk the create rents:
    vast.ai prices each offer's ``dph_total`` for it (its default is 8 GB, vast-cli's 5 GB)."""
    q: dict[str, Any] = {
        "num_gpus": {"eq": query.num_gpus},
        "gpu_ram": {"gte": query.gpu_ram_gb * 1000},  # vast.ai counts GPU RAM in MB
        "reliability": {"gte": query.min_reliability},
        "cuda_max_good": {"gte": query.min_cuda},
        "compute_cap": {"gte": query.compute_caps[0], "lte": query.compute_caps[1]},
        "disk_space": {"gte": query.disk_gb},
        "rentable": {"eq": True},
        "rented": {"eq": False},
        "external": {"eq": False},
        "order": [["dph_total", "asc"]],
        "type": "on-demand",
        "limit": query.limit,
        "allocated_storage": query.disk_gb,
    }
    if query.min_inet_down:
        q["inet_down"] = {"gte": query.min_inet_down}
    if query.verified:
        q["verified"] = {"eq": True}
    if query.max_dph is not None:
        q["dph_total"] = {"lte": query.max_dph}
    if query.direct_ports:
        q["direct_port_count"] = {"gte": query.direct_ports}
    return q


def offer_from_json(o: Mapping[str, Any]) -> Offer:
    """An offer of vast.ai's search answer; VastError for one without a usable id or price."""
    try:
        return Offer(
            int(o["id"]),
            str(o.get("gpu_name", "?")),
            int(o.get("num_gpus", 1)),
            float(o.get("gpu_ram", 0)),
            float(o["dph_total"]),
            float(o.get("reliability", o.get("reliability2", 0)) or 0),
            str(o.get("geolocation") or "?"),
            o,
            _int(o.get("machine_id")),
        )
    except (KeyError, TypeError, ValueError) as e:
        what = f"an offer without a usable {e}; it has {sorted(o)[:20]}"
        raise VastError("POST", "/api/v0/bundles/", 200, what) from None


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

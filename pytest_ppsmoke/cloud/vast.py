"""A vast.ai REST client on aiohttp: offers, create, show, label, list, destroy.

    async with VastClient(api_key) as vast:
        offers = await vast.search_offers(OfferQuery(gpu_ram_gb=16, max_dph=1.0))
        instance_id = await vast.create_instance(offers[0].id, image=..., env={...}, label="ppsmoke-...")
        await vast.destroy_instance(instance_id)

Paths, fields and status values follow vast.ai's API as its official SDK (``vastai`` 1.9) uses it. The
key goes only into the ``Authorization`` header; it is never part of a repr, a log line or an
error. Every call has a timeout. How vast.ai misbehaves, and what the client does about it:

- 5xx answers and connection errors are retried as the SDK does (6 attempts, 0.15 s growing x1.5).
- 429: vast.ai limits each endpoint per identity (key, session, address): a call sooner than the
  endpoint's threshold after the last one (create: 4.5 s) is refused, and so is every call for a
  penalty after that (create: 12 s), often in plain text and without Retry-After. The SDK's 2 s of
  retries end inside that penalty, so a 429 has its own schedule: 0.5 s doubling up to 8 s, each
  wait jittered (uniform in [half, full]) so that clients refused together do not return together.
  It gives up, naming the 429s and the seconds they cost, once the next wait would end more than
  ``rate_limit_window`` seconds after the call's first attempt, or past ``deadline`` (the run's
  budget, set by whoever owns the client).
- A 429 whose text names the endpoint's ``threshold=X`` paces that endpoint from then on: its
  calls are sent one at a time, at least X (+5%) apart. Other endpoints are not slowed.
- A create is not blindly retried: a create whose answer was lost may have rented an instance, so
  the client first looks for an instance with the same label. A create whose offer was taken
  between search and create (404/410 ``no_such_ask``) raises :class:`OfferGone`, so that the caller
  can move to the next offer.
- A destroy answered 404 means the instance is already gone. A destroyed instance may still be
  listed for a while; :func:`going_away` says whether its record shows it on its way out.

``VastClient.stats`` counts, per endpoint (:data:`VAST_ENDPOINTS`' names), the calls, the 429s, the
other retries and the seconds spent waiting on retries and on pacing; ``stats.summary()`` is for
the run's report.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import Any

import aiohttp

from .. import checks
from ..protocol import COMPUTE_CAPS, VAST_ENDPOINTS

log = logging.getLogger(__name__)

DEFAULT_URL = "https://console.vast.ai"
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
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


def endpoint_name(method: str, path: str) -> str:
    """The endpoint a call goes to, by :data:`VAST_ENDPOINTS`' names (``PUT /api/v0/asks/7/`` ->
    ``create``): numeric path segments are the ``{id}``. A path it does not name: ``METHOD route``."""
    route = "/".join("{id}" if seg.isdigit() else seg for seg in path.split("?", 1)[0].split("/"))
    return VAST_ENDPOINTS.get((method, route), f"{method} {route}")


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
            raise VastError(method, path, 200, f"expected an instance record, got {_shape(record)}")
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


def going_away(inst: Instance | None) -> bool:
    """Whether a destroyed instance that vast.ai still lists counts as gone: its contract is
    released (``cur_state`` ``unloaded``, which vast.ai sets on destroy while ``intended_status``
    may stay running: a destroy is not a stop), its status says destroyed, or its record says it is
    on its way out (``intended_status`` and ``next_state`` both present and neither ``running``).
    ``actual_status`` may still say running while it stops; an instance whose host crashed keeps
    ``intended_status`` running and is not going away. None (no longer listed at all) is gone."""
    if inst is None or inst.cur_state == "unloaded":
        return True
    if inst.actual_status in ("destroyed", "terminated") or inst.intended_status in ("destroyed", "terminated"):
        return True
    intended, nxt = inst.intended_status, inst.next_state
    return intended is not None and nxt is not None and "running" not in (intended, nxt)


_THRESHOLD = re.compile(r"threshold\s*=\s*([0-9]+(?:\.[0-9]+)?)")
MAX_RETRY_AFTER = 60.0  # the longest Retry-After waited out (vast-cli's bound); a longer one ends the call
PACE_MARGIN = 1.05  # a paced endpoint's calls are this much more than its threshold apart
# vast.ai's documented create threshold (a create sooner than this after the last is refused, then
# every create for 12 s): a run's creates are paced by it from the first, since a second create
# refused costs the penalty (a two-stage rent 14.2 s against the emulator with vast.ai's limits)
# where pacing costs the threshold once (4.7 s)
VAST_PACE = {"create": 4.5}


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
    min_inet_down: float = 0.0  # Mbit/s: hosts whose download would eat the boot window are skipped

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


class _Retries:
    """One call's retry schedule. A 429 waits ``rate_limit_first`` seconds growing by
    ``rate_limit_factor`` up to ``rate_limit_cap``, each wait drawn uniformly from [half, full],
    until the next wait would end past the window after the first attempt or past the client's
    deadline; a 5xx or a lost answer waits ``backoff`` growing x1.5, for ``attempts`` attempts."""

    def __init__(self, client: VastClient, method: str, path: str) -> None:
        self.client, self.method, self.path = client, method, path
        self.stats = client.stats.of(endpoint_name(method, path))
        self.first = time.monotonic()
        self.limited = self.errors = 0
        self.delay = client.backoff
        self.full = client.rate_limit_first  # the next 429 wait's upper bound

    async def after_429(self, text: str, retry_after: float | None = None) -> None:
        """Sleep before the next try, or raise VastError when the 429s have outlasted the limits.
        A ``Retry-After`` is waited exactly, up to :data:`MAX_RETRY_AFTER` seconds; a longer one
        ends the call at once."""
        c = self.client
        self.limited += 1
        full, self.full = self.full, min(self.full * c.rate_limit_factor, c.rate_limit_cap)
        wait = c.rng.uniform(full / 2, full) if retry_after is None else retry_after
        now = time.monotonic()
        spent = now - self.first
        stop = None
        if retry_after is not None and retry_after > MAX_RETRY_AFTER:
            stop = f"vast.ai asks to wait {retry_after:g} s (Retry-After), more than {MAX_RETRY_AFTER:g} s"
        elif now + wait > self.first + c.rate_limit_window:
            stop = f"the next retry would end past the {c.rate_limit_window:g} s rate-limit window"
        elif c.deadline is not None and now + wait > c.deadline:
            stop = f"the next retry would end past the run's budget ({max(c.deadline - now, 0):.1f} s left)"
        if stop is not None:
            answers = f"{self.limited} answer{'s' * (self.limited > 1)} 429"
            msg = f"rate limited: {answers} over {spent:.1f} s ({text or 'no text'}); gave up: {stop}"
            raise VastError(self.method, self.path, 429, msg)
        self.stats.rate_limit_retries += 1
        await self._sleep(f"rate limited ({text or 'HTTP 429'})", self.limited, wait)

    async def after_error(self, status: int, last: str, note: str = "") -> None:
        """Sleep before the next try, or raise VastError once the attempts are spent."""
        self.errors += 1
        attempts = self.client.attempts
        if self.errors >= attempts:
            raise VastError(
                self.method, self.path, status, f"{last} (after {attempts} attempt{'s' * (attempts > 1)}{note})"
            )
        self.stats.retries += 1
        wait, self.delay = self.delay, self.delay * 1.5
        await self._sleep(last, self.errors, wait)

    async def _sleep(self, why: str, n: int, wait: float) -> None:
        log.info("vast.ai %s %s: %s; retry %d in %.2f s", self.method, self.path, why, n, wait)
        self.stats.retry_wait_s += wait
        await asyncio.sleep(wait)


class VastClient:
    """vast.ai's REST API. ``deadline`` (a ``time.monotonic()`` time, None for none) bounds the
    waits on 429s: the owner sets it to the end of the run's budget. ``rng`` draws the jitter.
    ``pace``: endpoint -> a threshold known beforehand, paced from the first call."""

    def __init__(
        self,
        api_key: str,
        base_url: str = DEFAULT_URL,
        *,
        timeout: float = 30.0,
        attempts: int = 6,
        backoff: float = 0.15,
        rate_limit_first: float = 0.5,
        rate_limit_factor: float = 2.0,
        rate_limit_cap: float = 8.0,
        rate_limit_window: float = 45.0,
        rng: random.Random | None = None,
        pace: Mapping[str, float] | None = None,
    ) -> None:
        if not api_key:
            raise ValueError("a vast.ai API key is needed (--api-key or VAST_API_KEY)")
        if attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {attempts}")
        if not 0 < rate_limit_first <= rate_limit_cap or rate_limit_factor < 1 or rate_limit_window <= 0:
            got = f"{rate_limit_first}, {rate_limit_factor}, {rate_limit_cap}, {rate_limit_window}"
            raise ValueError(
                f"the 429 schedule needs 0 < first <= cap, factor >= 1, window > 0; got {got} (in that order)"
            )
        self._key = api_key
        self.base_url = base_url.rstrip("/")
        self.timeout, self.attempts, self.backoff = timeout, attempts, backoff
        self.rate_limit_first, self.rate_limit_factor = rate_limit_first, rate_limit_factor
        self.rate_limit_cap, self.rate_limit_window = rate_limit_cap, rate_limit_window
        self.rng = rng or random.Random()
        self.deadline: float | None = None
        self.stats = ApiStats()
        # endpoint -> the least seconds between its calls: from ``pace`` (thresholds known before the
        # first call, e.g. VAST_PACE), or learned from a 429 that names its threshold
        self.pace: dict[str, float] = {k: checks.number(v, above=0) * PACE_MARGIN for k, v in (pace or {}).items()}
        self._pace_locks: dict[str, asyncio.Lock] = {}
        self._last_send: dict[str, float] = {}
        self._session: aiohttp.ClientSession | None = None

    @property
    def calls(self) -> int:
        """HTTP requests made, retries included."""
        return self.stats.total.calls

    @property
    def retries(self) -> int:
        """Requests sent again, after a 429, a 5xx or no answer."""
        t = self.stats.total
        return t.rate_limit_retries + t.retries

    def __repr__(self) -> str:
        return f"VastClient({self.base_url!r})"  # never the key

    async def __aenter__(self) -> VastClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {self._key}", "Accept": "application/json"},
                timeout=aiohttp.ClientTimeout(total=self.timeout),
            )
        return self._session

    async def _send(
        self, method: str, path: str, body: Any, params: Mapping[str, str] | None
    ) -> tuple[int, str, str, float | None]:
        """One request, after its endpoint's pace (if learned): (status, text, what went wrong, the
        seconds of a 429's ``Retry-After``), status 0 for no answer. A 429 that names the
        endpoint's threshold paces it from now on; one that says the daily search quota is spent
        raises :class:`SearchQuotaExceeded`."""
        endpoint = endpoint_name(method, path)
        stats = self.stats.of(endpoint)
        if endpoint in self.pace:  # one at a time, spaced: the lock is held for the wait, not the call
            async with self._pace_locks.setdefault(endpoint, asyncio.Lock()):
                wait = self._last_send.get(endpoint, -math.inf) + self.pace[endpoint] - time.monotonic()
                if wait > 0:
                    stats.pace_wait_s += wait
                    await asyncio.sleep(wait)
                self._last_send[endpoint] = time.monotonic()
        else:
            self._last_send[endpoint] = time.monotonic()
        stats.calls += 1
        try:
            async with self._http().request(method, self.base_url + path, json=body, params=params) as resp:
                status, text, headers = resp.status, await resp.text(), resp.headers
        except (aiohttp.ClientError, TimeoutError) as e:
            # the message of a connection error names host and port, never headers
            why = f"{type(e).__name__}: {e}" if str(e) else f"{type(e).__name__} after {self.timeout:g} s"
            return 0, "", why, None
        retry_after = None
        if status == 429:
            stats.rate_limited += 1
            data = _parse(method, path, status, text)
            if isinstance(data, dict) and data.get("error") == "search_quota_exceeded":
                reset = headers.get("X-RateLimit-Reset")
                when = f"; it resets at {reset}" if reset else "; it resets at midnight UTC"
                raise SearchQuotaExceeded(
                    method, path, 429, f"vast.ai's daily search quota is used up ({_error_text(data)}){when}"
                )
            with contextlib.suppress(TypeError, ValueError):
                retry_after = max(0.0, float(headers.get("Retry-After", "")))
            if (m := _THRESHOLD.search(text)) and float(m.group(1)) > 0:
                pace = float(m.group(1)) * PACE_MARGIN
                if self.pace.get(endpoint) != pace:
                    log.info("vast.ai %s: threshold %s s; its calls are paced %.2f s apart", endpoint, m.group(1), pace)
                self.pace[endpoint] = pace
        return status, text, _message(text) if status >= 400 else "", retry_after

    async def _call(
        self, method: str, path: str, *, body: Any = None, params: Mapping[str, str] | None = None, retry: bool = True
    ) -> tuple[int, Any]:
        """One API call with retries; returns (status, parsed JSON) for any answer that is not
        retried, raises VastError once the retries are spent. With ``retry=False`` every answer
        is returned, and only a call with no answer at all raises (status 0)."""
        retries = _Retries(self, method, path)
        while True:
            status, text, last, retry_after = await self._send(method, path, body, params)
            if status and (status not in RETRY_STATUSES or not retry):
                return status, _parse(method, path, status, text)
            if not retry:
                raise VastError(method, path, 0, f"{last} (after 1 attempt)")
            if status == 429:
                await retries.after_429(last, retry_after)
            else:
                await retries.after_error(status, last or f"HTTP {status}")

    async def _ok(self, method: str, path: str, **kw: Any) -> Any:
        status, data = await self._call(method, path, **kw)
        if not 200 <= status < 300 or (isinstance(data, dict) and data.get("success") is False):
            raise VastError(method, path, status, _error_text(data))
        return data

    # --- the API -----------------------------------------------------------------------------

    async def current_user(self) -> dict[str, Any]:
        """The account (``users/current``), less its ``api_key``: a refused key raises VastError 401."""
        data = await self._ok("GET", "/api/v0/users/current")
        if not isinstance(data, dict):
            raise VastError("GET", "/api/v0/users/current", 200, f"expected an account record, got {_shape(data)}")
        data.pop("api_key", None)
        return data

    async def search_offers(self, query: OfferQuery) -> list[Offer]:
        """Offers that match ``query``, cheapest first."""
        data = await self._ok("POST", "/api/v0/bundles/", body=query.body())
        offers = data.get("offers") if isinstance(data, dict) else None
        if not isinstance(offers, list):
            raise VastError("POST", "/api/v0/bundles/", 200, f"expected {{'offers': [...]}}, got {_shape(data)}")
        return sorted((Offer.from_json(o) for o in offers), key=lambda o: o.dph_total)

    async def create_instance(
        self,
        offer_id: int,
        *,
        image: str,
        env: Mapping[str, str],
        label: str,
        disk_gb: float = 20.0,
        onstart: str | None = None,
    ) -> int:
        """Rent ``offer_id``; returns the new instance id. ``label`` must be unique to this
        instance: it is how a create whose answer was lost is found again."""
        path = f"/api/v0/asks/{offer_id}/"
        body = {
            "client_id": "me",
            "image": image,
            "env": dict(env),
            "disk": disk_gb,
            "label": label,
            "onstart": onstart,
            "runtype": "args",  # run the image's entrypoint (pp-gpu-node)
            "price": None,  # on-demand
            "cancel_unavail": True,  # an error if the host cannot schedule it, never a stopped instance
        }
        retries = _Retries(self, "PUT", path)
        while True:
            status, text, last, retry_after = await self._send("PUT", path, body, None)
            data = _parse("PUT", path, status, text) if status else None
            if 200 <= status < 300 and isinstance(data, dict) and data.get("success") is not False:
                try:
                    return int(data["new_contract"])
                except (KeyError, TypeError, ValueError):
                    raise VastError("PUT", path, status, f"no new_contract among {sorted(data)}") from None
            if status in (404, 410) and isinstance(data, dict) and data.get("error") == "no_such_ask":
                what = f"{_error_text(data)} (the offer was taken between search and create)"
                raise OfferGone("PUT", path, status, what)
            if status and status not in RETRY_STATUSES:
                raise VastError("PUT", path, status, _error_text(data))
            if status == 429:  # refused before anything was rented: safe to send again
                await retries.after_429(last, retry_after)
                continue
            # no answer, or a 5xx: the instance may exist; look before renting again
            last = last if not status else f"HTTP {status}: {last}"
            found = await self._find_label(label)
            if found is not None:
                log.info("create of %s lost its answer, but instance %d exists", label, found)
                return found
            await retries.after_error(status, last, f"; no instance has label {label}")

    async def _find_label(self, label: str, looks: int = 3) -> int | None:
        """The instance with this label, looked for a few times (a new instance may take a moment
        to be listed). A list that fails raises: renting again blind could rent twice."""
        for look in range(looks):
            for inst in await self.list_instances(label):
                if inst.label == label and inst.id is not None:
                    return inst.id
            if look < looks - 1:
                await asyncio.sleep(self.backoff * 2)
        return None

    async def show_instance(self, instance_id: int) -> Instance | None:
        """The instance's record, or None once it no longer exists."""
        path = f"/api/v0/instances/{instance_id}/"
        status, data = await self._call("GET", path, params={"owner": "me"})
        if status == 404:
            return None
        if not 200 <= status < 300 or not isinstance(data, dict):
            raise VastError("GET", path, status, _error_text(data))
        inst = data.get("instances")
        if inst is None:
            return None
        if isinstance(inst, dict):
            return Instance.from_json(inst, "GET", path)
        raise VastError("GET", path, status, f"expected {{'instances': {{...}}}}, got {_shape(data)}")

    async def destroy_instance(self, instance_id: int) -> bool:
        """Destroy it; False if it was already gone: any 404 (vast.ai documents ``not_found``; older
        answers say ``no_such_instance``). An accepted destroy may stay listed for a while
        (:func:`going_away`)."""
        path = f"/api/v0/instances/{instance_id}/"
        status, data = await self._call("DELETE", path)
        if status == 404:
            return False
        if not 200 <= status < 300 or (isinstance(data, dict) and data.get("success") is False):
            raise VastError("DELETE", path, status, _error_text(data))
        return True

    async def label_instance(self, instance_id: int, label: str) -> None:
        await self._ok("PUT", f"/api/v0/instances/{instance_id}/", body={"label": label})

    async def list_instances(self, label_prefix: str | None = None) -> list[Instance]:
        """Every instance of this account (``/api/v1/instances/``, following ``next_token``), or
        those whose label starts with ``label_prefix``."""
        out: list[Instance] = []
        params = {"limit": "25"}
        for _ in range(1000):  # a bound on pages: 25,000 instances
            data = await self._ok("GET", "/api/v1/instances/", params=params)
            page = data.get("instances") if isinstance(data, dict) else None
            if not isinstance(page, list):
                what = f"expected {{'instances': [...]}}, got {_shape(data)}"
                raise VastError("GET", "/api/v1/instances/", 200, what)
            out.extend(Instance.from_json(r) for r in page)
            token = data.get("next_token")
            if not token:
                if label_prefix is None:
                    return out
                return [i for i in out if (i.label or "").startswith(label_prefix)]
            params = {"limit": "25", "after_token": str(token)}
        raise VastError("GET", "/api/v1/instances/", 200, "more than 1000 pages of instances")

    async def wait_running(
        self,
        instance_id: int,
        polls: int,
        interval: float,
        on_poll: Callable[[int, Instance | None], None] | None = None,
    ) -> Instance:
        """Poll until ``actual_status`` is ``running``; at most ``polls`` polls (the spec: 60).
        Fails at once (:class:`NeverRuns`) on a state that never becomes running (:data:`DEAD_STATES`)
        and on a ``status_msg`` that names an error (:func:`start_failure`: a pull vast.ai's host
        retries for hours); a host that is merely slow gets every poll."""
        last: Instance | None = None
        started = time.monotonic()
        path = f"/api/v0/instances/{instance_id}/"
        for poll in range(1, polls + 1):
            last = await self.show_instance(instance_id)
            if on_poll is not None:
                on_poll(poll, last)
            if last is None and poll > 3:  # a new instance can take a moment to be shown
                raise VastError("GET", path, 200, "the instance no longer exists")
            if last is None:
                await asyncio.sleep(interval)
                continue
            state = last.actual_status
            if state == "running":
                return last
            msg = last.status_msg or "no status message"
            if state in DEAD_STATES:
                raise NeverRuns("GET", path, 200, f"instance {instance_id} is {state} ({msg}); it will never run")
            failure = start_failure(last.status_msg)
            if failure is not None:
                raise NeverRuns(
                    "GET", path, 200, f"instance {instance_id} is {state or 'new'}, and its {failure} failed: {msg}",
                    failure,
                )  # fmt: skip
            if poll < polls:
                await asyncio.sleep(interval)
        state = last.actual_status if last else None
        msg = (last.status_msg if last else "") or "no status message"
        raise TimeoutError(
            f"instance {instance_id} not running after {polls} polls in {time.monotonic() - started:.1f} s "
            f"(last status {state!r}: {msg})"
        )


DEAD_STATES = ("exited", "unknown", "offline", "stopped", "frozen")  # never running from there
_ERROR_WORDS = ("error", "fail", "denied", "unauthorized", "not found", "manifest unknown", "does not exist")
_PULL_WORDS = ("pull", "manifest", "not found", "unauthorized", "denied", "repository", "reference")


def start_failure(status_msg: str) -> str | None:
    """What a ``status_msg`` says failed, as vast-cli's wait loop reads it: ``image pull`` (it
    names a pull, a manifest, a missing or refused repository) or ``container start`` (any other
    error); None when it names no error (``Pulling image ...``, ``success, running ...``)."""
    text = status_msg.lower()
    if not any(w in text for w in _ERROR_WORDS):
        return None
    return "image pull" if any(w in text for w in _PULL_WORDS) else "container start"


class NeverRuns(VastError):
    """An instance that will never run: a dead state, or an error in its ``status_msg``
    (``failure``: ``image pull``, ``container start``; "" for a dead state)."""

    def __init__(self, method: str, path: str, status: int, message: str, failure: str = "") -> None:
        super().__init__(method, path, status, message)
        self.failure = failure


def strip_strings(value: Any) -> Any:
    """Every string in ``value`` (values, not keys) without its surrounding whitespace: vast.ai
    serves strings padded (its own example of ``local_ipaddrs`` is ``"10.2.202.31 172.17.0.1 \\n"``),
    and vast-cli strips every string of every instance row (``_strip_strings``). A status of
    ``"running "`` is running; an address with a newline would be refused by iroh."""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, dict):
        return {k: strip_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [strip_strings(v) for v in value]
    return value


def _parse(method: str, path: str, status: int, text: str) -> Any:
    """An answer's JSON, every string in it stripped (:func:`strip_strings`)."""
    if not text:
        return None
    try:
        return strip_strings(json.loads(text))
    except ValueError:
        if 200 <= status < 300:
            raise VastError(method, path, status, f"the answer is not JSON: {text[:200]!r}") from None
        return {"success": False, "msg": text[:300]}


def _message(text: str) -> str:
    try:
        return _error_text(json.loads(text))
    except ValueError:
        return text.strip()[:300]


def _error_text(data: Any) -> str:
    if isinstance(data, dict):
        parts = [str(data[k]) for k in ("error", "msg", "detail") if data.get(k)]
        if parts:
            return ": ".join(parts)
    return f"unexpected answer {_shape(data)}"


def _shape(data: Any) -> str:
    """What an unexpected answer looked like, without its values: answers can hold secrets
    (``instance_api_key``, an instance's ``extra_env`` with the cluster keys)."""
    if isinstance(data, dict):
        return f"an object with keys {sorted(data)[:20]}"
    if isinstance(data, list):
        return f"a list of {len(data)}"
    return type(data).__name__

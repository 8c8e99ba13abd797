"""A vast.ai REST client on aiohttp: offers, create, show, label, list, destroy, logs.

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
- Every endpoint is paced from the first call by vast.ai's documented limits (read from its
  OpenAPI files, :mod:`.vastdoc`): its calls one at a time, each at least the threshold (+5%)
  after the last one's answer. A 429 (its body JSON ``{"detail": ...}`` or plain text) whose text
  names the endpoint's ``threshold=X`` paces that endpoint by X from then on.
- A create is not blindly retried: a create whose answer was lost may have rented an instance, so
  the client first looks for an instance with the same label. A create whose offer was taken
  between search and create (a 404 naming ``no_such_ask`` in its ``msg``, or a 410 ``no_such_ask``)
  raises :class:`OfferGone`, so that the caller can move to the next offer; any other 404 fails.
- A destroy answered 404 means the instance is already gone. A destroyed instance may still be
  listed for a while; :func:`going_away` says whether its record shows it on its way out.
- An instance's logs come in two calls, as vast-cli makes them: ``request_logs`` answers a
  ``result_url`` (an upload, readable by whoever holds the URL), which is then read without the
  key, polled while it is not there yet (:data:`LOG_POLLS` times, :data:`LOG_POLL_INTERVAL` apart).

``VastClient.stats`` counts, per endpoint (:data:`VAST_ENDPOINTS`' names), the calls, the 429s, the
other retries and the seconds spent waiting on retries and on pacing; ``stats.summary()`` is for
the run's report.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import aiohttp

from .. import checks
from ..protocol import VAST_ENDPOINTS
from ..redact import Redactor
from . import createlimits, vastdoc
from .pacing import Pacer

# the records, re-exported: code that rents through the client may name them from here
from .provider import DEAD_STATES as DEAD_STATES
from .vastrecords import (
    ApiStats,
    SearchQuotaExceeded,
    VastOfferGone,
    instance_from_json,
    offer_from_json,
    search_body,
    shape,
)
from .vastrecords import Instance as Instance
from .vastrecords import Label as Label
from .vastrecords import NeverRuns as NeverRuns
from .vastrecords import Offer as Offer
from .vastrecords import OfferGone as OfferGone
from .vastrecords import OfferQuery as OfferQuery
from .vastrecords import VastError as VastError
from .vastrecords import going_away as going_away
from .waits import start_failure as start_failure
from .waits import wait_running

log = logging.getLogger(__name__)

DEFAULT_URL = "https://console.vast.ai"
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


def endpoint_name(method: str, path: str) -> str:
    """The endpoint a call goes to, by :data:`VAST_ENDPOINTS`' names (``PUT /api/v0/asks/7/`` ->
    ``create``): numeric path segments are the ``{id}``. A path it does not name: ``METHOD route``."""
    route = "/".join("{id}" if seg.isdigit() else seg for seg in path.split("?", 1)[0].split("/"))
    return VAST_ENDPOINTS.get((method, route), f"{method} {route}")


_THRESHOLD = re.compile(r"threshold\s*=\s*([0-9]+(?:\.[0-9]+)?)")
MAX_RETRY_AFTER = 60.0  # the longest Retry-After waited out (vast-cli's bound); a longer one ends the call
PACE_MARGIN = 1.05  # a paced endpoint's calls are this much more than its threshold apart
LOG_POLLS, LOG_POLL_INTERVAL = 30, 0.3  # vast-cli's reads of a log's result URL while it is not uploaded yet


class _Retries:
    """One call's retry schedule. A 429 waits ``rate_limit_first`` seconds growing by
    ``rate_limit_factor`` up to ``rate_limit_cap``, each wait drawn uniformly from [half, full],
    until the next wait would end past the window after the first attempt or past the client's
    deadline; a 5xx or a lost answer waits ``backoff`` growing x1.5, for ``attempts`` attempts."""

    def __init__(self, client: VastClient, method: str, path: str) -> None:
        self.client, self.method, self.path = client, method, path
        self.stats = client.stats.of(endpoint_name(method, path))
        self.first = client.clock()
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
        now = c.clock()
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
        await self.client.sleep(wait)


class VastClient:
    """vast.ai's REST API. ``deadline`` (a ``clock()`` time, None for none) bounds the waits on
    429s: the owner sets it to the end of the run's budget. ``rng`` draws the jitter. ``pace``:
    endpoint -> (calls, seconds) known beforehand, paced from the first call (default: vast.ai's
    documented limits, :func:`.vastdoc.pace`, at ``PP_VAST_TIME_SCALE``; ``{}``: none until a 429
    names a threshold). ``clock`` and ``sleep``
    are the time every wait of the client reads and spends (pacing, retries, polls): the real
    ones (``time.monotonic``, ``asyncio.sleep``) unless a test runs the client on a virtual clock."""

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
        pace: Mapping[str, tuple[int, float]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
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
        self.clock, self.sleep = clock, sleep
        self.deadline: float | None = None
        self.stats = ApiStats()
        # the shared pacing (cloud/pacing.py), per endpoint: vast.ai's documented limits (read from its
        # files, vastdoc), and a threshold learned from a 429 that names it
        table = {k: (int(checks.number(n, least=1)), checks.number(t, above=0)) for k, (n, t) in (
            vastdoc.pace() if pace is None else pace
        ).items()}  # fmt: skip
        self.pacer = Pacer.of(table, margin=PACE_MARGIN, clock=clock, sleep=sleep)
        self._session: aiohttp.ClientSession | None = None
        self._bare: aiohttp.ClientSession | None = None  # no key: for URLs vast.ai hands out (logs)
        self.container_keys: dict[int, str] = {}  # each created instance's own key (its create's answer)

    @property
    def pace(self) -> dict[str, float]:
        """Endpoint -> the least seconds between its calls: documented (``pace``) or learned."""
        return self.pacer.spacing

    def spacing(self, call: str) -> float:
        return self.pacer.spacing.get(call, 0.0)

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

    @property
    def where(self) -> str:
        return self.base_url

    def calls_summary(self) -> dict[str, Any]:
        """The per-endpoint counts (``stats.summary()``), for the run's report."""
        return self.stats.summary()

    def secrets(self) -> list[str]:
        """What the client holds that must never be shown: its API key and each created instance's
        own key (for a redactor; never logged)."""
        return [self._key, *self.container_keys.values()]

    async def __aenter__(self) -> VastClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        for session in (self._session, self._bare):
            if session is not None:
                await session.close()
        self._session = self._bare = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {self._key}", "Accept": "application/json"},
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                # vast.ai's API through the environment's proxy (HTTPS_PROXY, NO_PROXY), as curl
                # takes it; an emulator's plain HTTP never (HTTP_PROXY is not meant for it)
                trust_env=self.base_url.startswith("https://"),
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
        try:
            # one at a time, spaced from the last answer, where paced (pacing.Pacer.call)
            async with self.pacer.call(endpoint) as waited:
                stats.pace_wait_s += waited  # added after the wait: calls paced together each count theirs
                stats.calls += 1
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
            raise VastError("GET", "/api/v0/users/current", 200, f"expected an account record, got {shape(data)}")
        data.pop("api_key", None)
        return data

    async def credit(self) -> float | None:
        """The account's ``credit`` ($), None where its record has none."""
        credit = (await self.current_user()).get("credit")
        return float(credit) if isinstance(credit, (int, float)) and not isinstance(credit, bool) else None

    async def search_offers(self, query: OfferQuery) -> list[Offer]:
        """Offers that match ``query``, cheapest first."""
        data = await self._ok("POST", "/api/v0/bundles/", body=search_body(query))
        offers = data.get("offers") if isinstance(data, dict) else None
        if not isinstance(offers, list):
            raise VastError("POST", "/api/v0/bundles/", 200, f"expected {{'offers': [...]}}, got {shape(data)}")
        return sorted((offer_from_json(o) for o in offers), key=lambda o: o.dph_total)

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
        body = create_body(image=image, env=env, label=label, disk_gb=disk_gb, onstart=onstart)
        createlimits.check(body)  # over a documented limit: refused here, unsent (OverLimit)
        retries = _Retries(self, "PUT", path)
        while True:
            status, text, last, retry_after = await self._send("PUT", path, body, None)
            data = _parse("PUT", path, status, text) if status else None
            if 200 <= status < 300 and isinstance(data, dict) and data.get("success") is not False:
                try:
                    iid = int(data["new_contract"])
                except (KeyError, TypeError, ValueError):
                    raise VastError("PUT", path, status, f"no new_contract among {sorted(data)}") from None
                if isinstance(data.get("instance_api_key"), str):  # a secret to keep out of its logs
                    self.container_keys[iid] = data["instance_api_key"]
                return iid
            if status in (404, 410) and _no_such_ask(data):
                what = f"{_error_text(data)} (the offer was taken between search and create)"
                raise VastOfferGone("PUT", path, status, what)
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
                await self.sleep(self.backoff * 2)
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
            return instance_from_json(inst, "GET", path)
        raise VastError("GET", path, status, f"expected {{'instances': {{...}}}}, got {shape(data)}")

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

    async def destroy_instances(self, instance_ids: Sequence[int]) -> None:
        """Destroy them in one call (``DELETE /api/v0/instances/`` with ``instance_ids``, as
        vast-cli's SDK destroys a list): VastError unless every one was accepted, at the first
        answer (not retried: the caller's fallback, each destroyed alone, is its retry). Not in
        vast.ai's API document: its limit is held to one destroy's (``vastdoc.rate_limits``)."""
        path = "/api/v0/instances/"
        body = {"instance_ids": [int(i) for i in instance_ids]}
        status, data = await self._call("DELETE", path, body=body, retry=False)
        if not 200 <= status < 300 or not isinstance(data, dict) or data.get("success") is not True:
            raise VastError("DELETE", path, status, _error_text(data))

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
                what = f"expected {{'instances': [...]}}, got {shape(data)}"
                raise VastError("GET", "/api/v1/instances/", 200, what)
            out.extend(instance_from_json(r) for r in page)
            token = data.get("next_token")
            if not token:
                if label_prefix is None:
                    return out
                return [i for i in out if (i.label or "").startswith(label_prefix)]
            params = {"limit": "25", "after_token": str(token)}
        raise VastError("GET", "/api/v1/instances/", 200, "more than 1000 pages of instances")

    async def request_logs(self, instance_id: int, tail: int) -> str:
        """The last ``tail`` lines of the instance's log, as ``vastai logs`` reads them: ask for
        them (``request_logs``: vast.ai uploads them and answers the ``result_url``), then read
        that URL without the key (it is another host's, and needs none), polling while it answers
        anything but 200, up to :data:`LOG_POLLS` reads within the client's deadline."""
        if not isinstance(tail, int) or isinstance(tail, bool) or tail < 1:
            raise ValueError(f"tail must be a number of lines >= 1, got {tail!r}")
        path = f"/api/v0/instances/request_logs/{instance_id}/"
        data = await self._ok("PUT", path, body={"tail": str(tail)})  # a string, as vast-cli sends it
        url = data.get("result_url") if isinstance(data, dict) else None
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise VastError("PUT", path, 200, f"expected {{'result_url': 'http...'}}, got {shape(data)}")
        return await self._read_result(url)

    async def _read_result(self, url: str) -> str:
        """The text at a log's result URL, once uploaded: read with no key, every
        :data:`LOG_POLL_INTERVAL` seconds while it answers anything but 200."""
        stats = self.stats.of("logs_result")
        folder, _, token = url.partition("?")[0].rpartition("/")
        shown = folder + "/..."  # the token (the last part of its path) stays out of messages
        # and out of an error's text, which may quote the URL, with its signature (the query)
        unsigned = Redactor([token, url.partition("?")[2]])
        if self._bare is None:  # a proxy from the environment for https only, as the API's session
            self._bare = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout), trust_env=url.startswith("https://")
            )
        last = "no read yet"
        for poll in range(1, LOG_POLLS + 1):
            stats.calls += 1
            try:
                async with self._bare.get(url) as resp:
                    if resp.status == 200:
                        return await resp.text()
                    last = f"HTTP {resp.status}"
            except (aiohttp.ClientError, TimeoutError) as e:
                last = f"{type(e).__name__}: {unsigned.text(str(e))}" if str(e) else type(e).__name__
            if poll == LOG_POLLS:
                break
            if self.deadline is not None and self.clock() + LOG_POLL_INTERVAL > self.deadline:
                raise VastError("GET", shown, 0, f"the log was not uploaded before the deadline ({poll} reads; {last})")
            stats.retry_wait_s += LOG_POLL_INTERVAL
            await self.sleep(LOG_POLL_INTERVAL)
        raise VastError("GET", shown, 0, f"the log was not uploaded after {LOG_POLLS} reads ({last})")

    async def wait_running(
        self,
        instance_id: int,
        polls: int,
        interval: float,
        on_poll: Callable[[int, Instance | None], None] | None = None,
    ) -> Instance:
        """The shared wait (:func:`.waits.wait_running`) on this client and its clock."""
        return await wait_running(self, instance_id, polls, interval, on_poll, clock=self.clock, sleep=self.sleep)


class OwnVastInstance:
    """A node's own instance on vast.ai (or the emulator), destroyed with the instance's own key
    (``CONTAINER_API_KEY``, set by vast.ai's host agent): :class:`~.provider.OwnInstance`."""

    def __init__(self, instance_id: int, key: str, url: str = DEFAULT_URL) -> None:
        self._id, self._key, self.url = instance_id, key, url

    def __repr__(self) -> str:
        return f"OwnVastInstance({self._id}, {self.url!r})"  # never the key

    @property
    def id(self) -> int:
        return self._id

    async def destroy(self) -> bool:
        async with VastClient(self._key, self.url, timeout=10, attempts=4) as vast:
            return await vast.destroy_instance(self._id)


def create_body(
    *, image: str, env: Mapping[str, str], label: str, disk_gb: float, onstart: str | None = None
) -> dict[str, Any]:
    """What a create sends (``PUT /api/v0/asks/{id}/``), as vast-cli sends it: ``env`` an object."""
    return {
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


def _no_such_ask(data: Any) -> bool:
    """Whether a create's 404 or 410 says its offer is gone: vast.ai describes the 404 as
    ``invalid_args`` with ``no_such_ask`` in its ``msg`` ("error 404/3603: no_such_ask Instance
    type by id ... is not available."), the 410 as ``no_such_ask`` itself."""
    if not isinstance(data, dict):
        return False
    return data.get("error") == "no_such_ask" or "no_such_ask" in str(data.get("msg") or "")


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
    return f"unexpected answer {shape(data)}"

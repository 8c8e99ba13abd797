"""A vast.ai REST client on aiohttp: offers, create, show, label, list, destroy.

    async with VastClient(api_key) as vast:
        offers = await vast.search_offers(OfferQuery(gpu_ram_gb=16, max_dph=1.0))
        instance_id = await vast.create_instance(offers[0].id, image=..., env={...}, label="ppsmoke-...")
        await vast.destroy_instance(instance_id)

Paths, fields and status values follow vast.ai's API as its official SDK (``vastai`` 1.9) uses it. The
key goes only into the ``Authorization`` header; it is never part of a repr, a log line or an
error. Every call has a timeout; 429, 5xx and connection errors are retried with backoff (as the
SDK does: 0.15 s growing x1.5). A create is not blindly retried: a create whose answer was lost
may have rented an instance, so the client first looks for an instance with the same label.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import aiohttp

log = logging.getLogger(__name__)

DEFAULT_URL = "https://console.vast.ai"
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
LABEL_PREFIX = "ppsmoke-"  # every instance this tool rents carries a label that starts so


class VastError(RuntimeError):
    """A vast.ai call failed for good. ``status`` is the HTTP status (0: no answer at all)."""

    def __init__(self, method: str, path: str, status: int, message: str) -> None:
        super().__init__(f"vast.ai {method} {path}: {f'HTTP {status}' if status else 'no answer'}: {message}")
        self.method, self.path, self.status = method, path, status


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

    def body(self) -> dict[str, Any]:
        q: dict[str, Any] = {
            "num_gpus": {"eq": self.num_gpus},
            "gpu_ram": {"gte": self.gpu_ram_gb * 1000},  # vast.ai counts GPU RAM in MB
            "reliability": {"gte": self.min_reliability},
            "cuda_max_good": {"gte": self.min_cuda},
            "disk_space": {"gte": self.disk_gb},
            "rentable": {"eq": True},
            "rented": {"eq": False},
            "external": {"eq": False},
            "order": [["dph_total", "asc"]],
            "type": "on-demand",
            "limit": self.limit,
        }
        if self.verified:
            q["verified"] = {"eq": True}
        if self.max_dph is not None:
            q["dph_total"] = {"lte": self.max_dph}
        return q

    def describe(self) -> str:
        price = f", at most ${self.max_dph}/h" if self.max_dph is not None else ""
        return (
            f"{self.num_gpus} GPU, >= {self.gpu_ram_gb:g} GB GPU RAM, reliability >= {self.min_reliability}, "
            f"CUDA >= {self.min_cuda}, disk >= {self.disk_gb:g} GB{', verified' if self.verified else ''}{price}"
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


class VastClient:
    def __init__(
        self,
        api_key: str,
        base_url: str = DEFAULT_URL,
        *,
        timeout: float = 30.0,
        attempts: int = 6,
        backoff: float = 0.15,
    ) -> None:
        if not api_key:
            raise ValueError("a vast.ai API key is needed (--api-key or VAST_API_KEY)")
        if attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {attempts}")
        self._key = api_key
        self.base_url = base_url.rstrip("/")
        self.timeout, self.attempts, self.backoff = timeout, attempts, backoff
        self._session: aiohttp.ClientSession | None = None
        self.calls = 0  # HTTP requests made, retries included
        self.retries = 0

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

    async def _call(
        self, method: str, path: str, *, body: Any = None, params: Mapping[str, str] | None = None, retry: bool = True
    ) -> tuple[int, Any]:
        """One API call with retries; returns (status, parsed JSON) for any answer that is not
        retried, raises VastError once the attempts are spent. With ``retry=False`` every answer
        is returned, and only a call with no answer at all raises (status 0)."""
        last = ""
        delay = self.backoff
        attempts = self.attempts if retry else 1
        for attempt in range(1, attempts + 1):
            self.calls += 1
            status = 0
            try:
                async with self._http().request(method, self.base_url + path, json=body, params=params) as resp:
                    status = resp.status
                    text = await resp.text()
            except (aiohttp.ClientError, TimeoutError) as e:
                # the message of a connection error names host and port, never headers
                last = f"{type(e).__name__}: {e}" if str(e) else f"{type(e).__name__} after {self.timeout:g} s"
            else:
                if status not in RETRY_STATUSES or not retry:
                    return status, _parse(method, path, status, text)
                last = _message(text) or f"HTTP {status}"
            if attempt < attempts:
                self.retries += 1
                log.info("vast.ai %s %s: %s; retry %d in %.2f s", method, path, last, attempt, delay)
                await asyncio.sleep(delay)
                delay *= 1.5
        raise VastError(method, path, status, f"{last} (after {attempts} attempt{'s' * (attempts > 1)})")

    async def _ok(self, method: str, path: str, **kw: Any) -> Any:
        status, data = await self._call(method, path, **kw)
        if not 200 <= status < 300 or (isinstance(data, dict) and data.get("success") is False):
            raise VastError(method, path, status, _error_text(data))
        return data

    # --- the API -----------------------------------------------------------------------------

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
        }
        delay = self.backoff
        last = ""
        for attempt in range(1, self.attempts + 1):
            try:
                status, data = await self._call("PUT", path, body=body, retry=False)
            except VastError as e:
                status, data, last = 0, None, str(e)
            if 200 <= status < 300 and isinstance(data, dict) and data.get("success") is not False:
                try:
                    return int(data["new_contract"])
                except (KeyError, TypeError, ValueError):
                    raise VastError("PUT", path, status, f"no new_contract among {sorted(data)}") from None
            if status and status not in RETRY_STATUSES:
                raise VastError("PUT", path, status, _error_text(data))
            if status == 429:  # refused before anything was rented: safe to send again
                last = _error_text(data)
            else:  # no answer, or a 5xx: the instance may exist; look before renting again
                last = last if not status else f"HTTP {status}: {_error_text(data)}"
                found = await self._find_label(label)
                if found is not None:
                    log.info("create of %s lost its answer, but instance %d exists", label, found)
                    return found
            if attempt < self.attempts:
                self.retries += 1
                await asyncio.sleep(delay)
                delay *= 1.5
        raise VastError("PUT", path, status, f"{last} (after {self.attempts} attempts; no instance has label {label})")

    async def _find_label(self, label: str, looks: int = 3) -> int | None:
        """The instance with this label, looked for a few times (a new instance may take a moment
        to be listed). A list that fails raises: renting again blind could rent twice."""
        for look in range(looks):
            for inst in await self.list_instances(label):
                if inst.get("label") == label:
                    return int(inst["id"])
            if look < looks - 1:
                await asyncio.sleep(self.backoff * 2)
        return None

    async def show_instance(self, instance_id: int) -> dict[str, Any] | None:
        """The instance's record, or None once it no longer exists."""
        path = f"/api/v0/instances/{instance_id}/"
        status, data = await self._call("GET", path, params={"owner": "me"})
        if status == 404:
            return None
        if not 200 <= status < 300 or not isinstance(data, dict):
            raise VastError("GET", path, status, _error_text(data))
        inst = data.get("instances")
        if inst is None or isinstance(inst, dict):
            return inst
        raise VastError("GET", path, status, f"expected {{'instances': {{...}}}}, got {_shape(data)}")

    async def destroy_instance(self, instance_id: int) -> bool:
        """Destroy it; False if it was already gone (vast.ai's 404 ``no_such_instance``)."""
        path = f"/api/v0/instances/{instance_id}/"
        status, data = await self._call("DELETE", path)
        if status == 404:
            return False
        if not 200 <= status < 300 or (isinstance(data, dict) and data.get("success") is False):
            raise VastError("DELETE", path, status, _error_text(data))
        return True

    async def label_instance(self, instance_id: int, label: str) -> None:
        await self._ok("PUT", f"/api/v0/instances/{instance_id}/", body={"label": label})

    async def list_instances(self, label_prefix: str | None = None) -> list[dict[str, Any]]:
        """Every instance of this account (``/api/v1/instances/``, following ``next_token``), or
        those whose label starts with ``label_prefix``."""
        out: list[dict[str, Any]] = []
        params = {"limit": "25"}
        for _ in range(1000):  # a bound on pages: 25,000 instances
            data = await self._ok("GET", "/api/v1/instances/", params=params)
            page = data.get("instances") if isinstance(data, dict) else None
            if not isinstance(page, list):
                what = f"expected {{'instances': [...]}}, got {_shape(data)}"
                raise VastError("GET", "/api/v1/instances/", 200, what)
            out.extend(page)
            token = data.get("next_token")
            if not token:
                if label_prefix is None:
                    return out
                return [i for i in out if str(i.get("label") or "").startswith(label_prefix)]
            params = {"limit": "25", "after_token": str(token)}
        raise VastError("GET", "/api/v1/instances/", 200, "more than 1000 pages of instances")

    async def wait_running(self, instance_id: int, polls: int, interval: float, on_poll: Any = None) -> dict[str, Any]:
        """Poll until ``actual_status`` is ``running``; at most ``polls`` polls (the spec: 60).
        Fails at once on a state that never becomes running (exited, unknown, offline)."""
        last: dict[str, Any] | None = None
        started = time.monotonic()
        for poll in range(1, polls + 1):
            last = await self.show_instance(instance_id)
            if on_poll is not None:
                on_poll(poll, last)
            if last is None and poll > 3:  # a new instance can take a moment to be shown
                raise VastError("GET", f"/api/v0/instances/{instance_id}/", 200, "the instance no longer exists")
            if last is None:
                await asyncio.sleep(interval)
                continue
            state = last.get("actual_status")
            if state == "running":
                return last
            if state in ("exited", "unknown", "offline"):
                raise VastError(
                    "GET",
                    f"/api/v0/instances/{instance_id}/",
                    200,
                    f"instance {instance_id} is {state} ({last.get('status_msg') or 'no status message'}); "
                    "it will never run",
                )
            if poll < polls:
                await asyncio.sleep(interval)
        state = last.get("actual_status") if last else None
        msg = (last or {}).get("status_msg") or "no status message"
        raise TimeoutError(
            f"instance {instance_id} not running after {polls} polls in {time.monotonic() - started:.1f} s "
            f"(last status {state!r}: {msg})"
        )


def _parse(method: str, path: str, status: int, text: str) -> Any:
    if not text:
        return None
    try:
        return json.loads(text)
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

"""The emulator's HTTP face: vast.ai's paths, methods, JSON fields and error codes (as its official
client, ``vastai`` 1.9, calls them), its authentication and, at the door, the faults of
:mod:`.faults` (429 bursts, rate limits, an orchestrator cut off).

Its answers about offers and instances carry every string value padded with whitespace (a
trailing space or newline, a leading space), as vast.ai serves them (:func:`padded`); what the
emulator holds is not padded.

Every call needs ``Authorization: Bearer <key>`` (or ``api_key=``): the account's key, or an
instance's container key, which may act on that instance only. The handlers find the emulator as
``request.app[EMULATOR]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ...protocol import VAST_ENDPOINTS
from . import NETWORK_PATH, apidoc, catalogue, faults, logs
from .answers import EMULATOR
from .answers import error_answer as _error
from .answers import json_answer as _json
from .instances import Instance, parse_env, parse_ports

if TYPE_CHECKING:
    from .protocols import Emulator

log = logging.getLogger(__name__)


def app(vast: Emulator) -> web.Application:
    """The API of ``vast``, as an aiohttp application."""
    a = web.Application(middlewares=[_gate])
    a[EMULATOR] = vast
    r = a.router
    r.add_get("/api/v0/gpu_names/unique/", gpu_names)  # the CLI asks at start, with no key
    r.add_get("/api/v0/users/current", current_user)
    r.add_get("/api/v0/instances/filters/", instance_filters)
    r.add_post("/api/v0/bundles/", search_offers)
    r.add_delete("/api/v0/instances/", destroy_instances)
    r.add_put("/api/v0/asks/{id}/", create_instance)
    r.add_get("/api/v1/instances/", list_v1)
    r.add_get("/api/v0/instances/{id}/", show_instance)
    r.add_put("/api/v0/instances/{id}/", update_instance)
    r.add_delete("/api/v0/instances/{id}/", destroy_instance)
    r.add_get(NETWORK_PATH, network_info)  # the emulator's own, not vast.ai's
    r.add_put(logs.REQUEST_PATH, logs.request_logs)
    r.add_get(logs.RESULT_PATH + "{token}", logs.result)  # the emulator's own: a log's upload, read with no key
    return a


def key_of(request: web.Request) -> str:
    """The key a call carries: ``Authorization: Bearer <key>``, or the ``api_key`` parameter."""
    auth = request.headers.get("Authorization", "")
    return auth[7:].strip() if auth.startswith("Bearer ") else request.query.get("api_key", "")


def identity(request: web.Request) -> str:
    """Who a rate limit counts a call against: the key it carries and the address it came from."""
    return f"{key_of(request)}@{request.remote}"


def endpoint_of(request: web.Request) -> str | None:
    """The request's endpoint name in :data:`VAST_ENDPOINTS` (None: a path it does not name)."""
    info = request.match_info.route.resource
    return VAST_ENDPOINTS.get((request.method, info.canonical)) if info is not None else None


PADS = ("{} ", "{}\n", " {}", " {} \n")  # how vast.ai pads a string it serves, in turn


def padded(data: Any) -> Any:
    """``data`` with every string value (not a key), however deep, padded with whitespace: each
    in turn with one of :data:`PADS`, so that a client which strips only some pads is caught."""
    n = 0

    def pad(v: Any) -> Any:
        nonlocal n
        if isinstance(v, str):
            n += 1
            return PADS[n % len(PADS)].format(v)
        if isinstance(v, dict):
            return {k: pad(x) for k, x in v.items()}
        if isinstance(v, list):
            return [pad(x) for x in v]
        return v

    return pad(data)


# --- the door: faults, then the key ---------------------------------------------------------


@web.middleware
async def _gate(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    vast = request.app[EMULATOR]
    if faults.burst(vast.faults, len(vast.requests)):
        vast.requests.append((request.method, request.path, 429))
        after = vast.faults.value("vast.retry_after")  # vast.ai's mostly have none
        return web.Response(
            status=429, text="Too Many Requests", headers={"Retry-After": f"{after:g}"} if after else {}
        )
    if time.monotonic() < vast.isolated_until and identity(request).startswith(vast.api_key + "@"):
        # the orchestrator's network is down: its calls get no answer (the nodes' still do)
        vast.requests.append((request.method, request.path, 0))
        if request.transport is not None:
            request.transport.abort()
        return web.Response(status=503)  # never sent: the connection is gone
    limits = vast.faults.value("vast.rate_limit")
    if limits != vast.limiter.source:  # faults changed since (a test may set them on a running emulator)
        vast.limiter = faults.RateLimiter(limits)
    endpoint = endpoint_of(request)
    refused = vast.limiter.refuse(endpoint, identity(request)) if endpoint else None
    if refused is not None:
        vast.requests.append((request.method, request.path, 429))
        # the documented body (create_instance.yaml's 429: {"detail": ...}), no Retry-After
        return web.json_response({"detail": refused}, status=429)
    refused_by_doc = await _held_to_the_document(vast, request)
    resp = refused_by_doc or await _authorized(vast, request, handler)
    if refused_by_doc is None and not request.path.startswith(OWN_PATHS):
        resp = _answer_held_to_the_document(vast, request, resp)
    vast.requests.append((request.method, request.path, resp.status))
    if vast.faults.value("vast.api_latency"):
        await asyncio.sleep(vast.faults.value("vast.api_latency"))
    return resp


OWN_PATHS = ("/ppsmoke/",)  # the emulator's own paths, not vast.ai's: not held to its document
# a refused key's msg: vast.ai's word for it (search_offers.yaml's example; vast-cli's main.py reads
# 401 "Invalid user key" as a deleted key, on any command)
INVALID_KEY = apidoc.error_schema("POST /api/v0/bundles/", 404)["msg"]["example"]


def _documented(request: web.Request, status: int, error: str, msg: str | None = None, **values: Any) -> web.Response:
    """The error answer vast.ai's description gives the request's endpoint for ``status``
    (:func:`apidoc.documented_error`): its examples, ``values`` (``ask_id``) and the path's id in
    place of theirs; ``error`` where it gives no example, ``msg`` in place of its example (None:
    the example). Where it describes no such answer, or another ``error`` (a fault it does not
    describe), ``{"success": false, "error": error, "msg": msg}``: a guess."""
    op = apidoc.find(request.method, request.path)
    props = apidoc.error_schema(op.endpoint, status) if op is not None else {}
    if op is not None and props:
        given = None if "example" in (props.get("error") or {}) else error
        kept = {k: v for k, v in values.items() if k in props}
        try:
            body = apidoc.documented_error(op.endpoint, status, error=given, msg=msg, path=request.match_info, **kept)
            return _json(body, status)
        except ValueError:
            pass  # a fault the description does not give (an error outside its enum)
    return _error(status, error, msg or error)


def _violations(vast: Emulator, found: list[apidoc.Violation]) -> list[apidoc.Violation]:
    """The violations the allow-list does not explain; each is kept (``vast.violations``) and,
    unless the call is to fail (:func:`apidoc.strict`), logged."""
    left = apidoc.unexplained(found)
    vast.violations.extend(left)
    if left and not apidoc.strict():
        for v in left:
            log.warning("vast.ai's API description: %s", v)
    return left


async def _held_to_the_document(vast: Emulator, request: web.Request) -> web.Response | None:
    """The request against vast.ai's description of its endpoint (``apidoc``): None to go on;
    in strict mode a 400 ``openapi_violation`` naming the endpoint, the field and the rule."""
    if request.path.startswith(OWN_PATHS):
        return None
    raw = await request.read() if request.body_exists else b""
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        return None  # the handler answers 400 for a body that is not JSON
    op = apidoc.find(request.method, request.path)
    if op is not None and apidoc.over_limits(op.endpoint, body):
        return None  # over an input limit: the handler answers the 400 vast.ai describes for it
    found = apidoc.validate_request(request.method, request.path, request.query, body, bool(raw))
    left = _violations(vast, found)
    if left and apidoc.strict():
        return _error(400, "openapi_violation", "; ".join(map(str, left)))
    return None


def _answer_held_to_the_document(vast: Emulator, request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
    """The answer against vast.ai's description: in strict mode, one that breaks it becomes a
    500 ``openapi_violation`` naming the endpoint, the field and the rule (the emulator's own
    defect: a test must not pass on an answer vast.ai would never give)."""
    if not isinstance(resp, web.Response) or not isinstance(resp.body, bytes):
        return resp
    found = apidoc.validate_response(request.method, request.path, resp.status, resp.content_type, resp.body)
    left = _violations(vast, found)
    if left and apidoc.strict():
        return _error(500, "openapi_violation", "the emulator's answer: " + "; ".join(map(str, left)))
    return resp


async def _authorized(
    vast: Emulator, request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    if request.path == "/api/v0/gpu_names/unique/" or request.path.startswith(logs.RESULT_PATH):
        public: web.StreamResponse = await handler(request)  # public on vast.ai too
        return public
    key = key_of(request)
    if not key:
        return _documented(request, 401, "auth_error", "authentication required: send Authorization: Bearer <api key>")
    if not secrets.compare_digest(key, vast.api_key):
        own = next((i for i in vast.listed() if secrets.compare_digest(key, i.container_key)), None)
        if own is None or request.path not in (f"/api/v0/instances/{own.id}/", logs.request_path(own.id)):
            return _documented(request, 401, "auth_error", INVALID_KEY)
    try:
        resp: web.StreamResponse = await handler(request)
    except json.JSONDecodeError as e:
        return _documented(request, 400, "invalid_args", f"the body is not JSON: {e}")
    return resp


# --- account and catalogue --------------------------------------------------------------------


async def gpu_names(request: web.Request) -> web.Response:
    return _json({"gpu_names": sorted({o["gpu_name"] for o in request.app[EMULATOR].catalogue})})


async def current_user(request: web.Request) -> web.Response:
    vast = request.app[EMULATOR]
    return _json(
        {
            "id": 1,
            "username": "ppsmoke",
            "email": "ppsmoke@localhost",
            "credit": vast.credit,  # $ the account can spend
            "balance": 0.0,  # $ owed
            "host_agreement_accepted": False,
        }
    )


async def instance_filters(request: web.Request) -> web.Response:
    records = [i.record() for i in request.app[EMULATOR].listed()]
    keys = ("actual_status", "verification", "gpu_name")
    return _json(padded({"filters": [{k: r[k] for k in keys} for r in records]}))


async def network_info(request: web.Request) -> web.Response:
    """The emulated network an orchestrator of these instances must join (``pp-smoke-run
    --local --vast-url URL --network ...``): its description and the host address to bind."""
    net = request.app[EMULATOR].network
    if net is None:
        return _error(404, "no_network", "this emulator runs its nodes on loopback (start it with --network)")
    return _json({"spec": net.spec.name, "host_addr": net.host_addr, "subnet": net.subnet})


async def search_offers(request: web.Request) -> web.Response:
    vast = request.app[EMULATOR]
    if vast.faults.on("vast.search_quota"):  # a daily quota: it resets at midnight UTC
        reset = time.strftime("%Y-%m-%dT00:00:00Z", time.gmtime(time.time() + 86400))
        resp = _error(429, "search_quota_exceeded", "daily search quota exceeded")
        resp.headers["X-RateLimit-Reset"] = reset
        return resp
    query = await request.json() if request.body_exists else {}
    if not isinstance(query, dict):
        return _documented(request, 400, "invalid_args", f"the query must be an object, got {type(query).__name__}")
    if isinstance(query.get("q"), dict):  # some clients wrap the query
        query = query["q"]
    vast.purge()
    try:
        found = catalogue.search(vast.catalogue, query)
    except ValueError as e:
        return _documented(request, 400, "invalid_args", str(e))
    try:
        limit = int(query.get("limit") or 64)
    except (TypeError, ValueError):
        return _documented(request, 400, "invalid_args", f"limit must be a number, got {query.get('limit')!r}")
    if vast.faults.on("vast.offers"):
        limit = min(limit, vast.faults.value("vast.offers"))
    return _json(padded({"offers": found[:limit]}))


# --- instances --------------------------------------------------------------------------------


CREATE = "PUT /api/v0/asks/{id}/"


def _ask_id(request: web.Request) -> int | str:
    raw = request.match_info["id"]
    return int(raw) if raw.isdigit() else raw


def _over_limits(request: web.Request, endpoint: str, body: Any) -> web.Response | None:
    """A 400 for a body over any of ``endpoint``'s input limits (``x-input-validation``), as
    vast.ai describes its 400: None if it is within them."""
    over = apidoc.over_limits(endpoint, body)
    if not over:
        return None
    what = "; ".join(f"{field}: {broken}" for field, broken in over)
    if endpoint == CREATE:
        error = "invalid_price" if [f for f, _ in over] == ["price"] else "invalid_args"
        return _documented(request, 400, error, f"Invalid args: over the input limits: {what}", ask_id=_ask_id(request))
    return _documented(request, 400, "label_too_long" if over[0][0] == "label" else "invalid_args")


async def create_instance(request: web.Request) -> web.Response:
    vast = request.app[EMULATOR]
    vast.creates += 1
    n = vast.creates
    ask = _ask_id(request)
    body = await request.json()
    if not isinstance(body, dict):
        return _documented(request, 400, "invalid_args", "the body must be a JSON object", ask_id=ask)
    if n in vast.faults.value("vast.reject_create"):
        msg = f"create call {n} rejected (failpoint vast.reject_create)"
        return _documented(request, 400, "invalid_args", msg, ask_id=ask)
    refused = _over_limits(request, CREATE, body)
    if refused is not None:
        return refused
    vast.purge()
    offer = next((o for o in vast.catalogue if str(o["id"]) == request.match_info["id"]), None)
    raced = vast.faults.value("vast.race_offers").get(n)
    if offer is not None and offer["rentable"] and raced is not None:
        # someone else rented it between the search and this call, and keeps it
        catalogue.rent(offer)
        log.info("create call %d: offer %d taken by someone else (failpoint vast.race_offers)", n, offer["id"])
        return _documented(request, raced, "no_such_ask", ask_id=ask)  # 404 or 410, as described
    if offer is None or not offer["rentable"]:
        return _documented(request, 404, "no_such_ask", ask_id=ask)
    image = body.get("image")
    if not isinstance(image, str) or not image:
        return _documented(request, 400, "invalid_args", "image is required", ask_id=ask)
    try:
        env = parse_env(body.get("env"))
        ports = parse_ports(body.get("env"))
        disk = float(body.get("disk") or 10)
    except (TypeError, ValueError) as e:
        return _documented(request, 400, "invalid_args", str(e), ask_id=ask)
    if len(ports) > int(offer.get("direct_port_count") or 0):
        msg = f"offer {offer['id']} forwards {offer.get('direct_port_count')} ports; the create asks for {len(ports)}"
        return _documented(request, 400, "invalid_args", msg, ask_id=ask)
    inst = vast.rent(
        Instance(
            vast.new_id(),
            n,
            offer,
            image,
            env,
            body.get("label") or None,
            disk,
            body.get("onstart") or None,
            [str(a) for a in body.get("args") or []],
            container_key=secrets.token_hex(32),
            cancel_unavail=body.get("cancel_unavail") is True,
            ports=ports,
        )
    )
    if n in vast.faults.value("vast.hold_create"):  # rented, but the answer is held (a lost answer)
        await vast.held()
    return _json({"success": True, "new_contract": inst.id, "instance_api_key": inst.container_key})


def _find(request: web.Request, lingering: bool = True) -> Instance | None:
    """The instance the path names: a live one, or (``lingering``) a destroyed one still listed."""
    try:
        iid = int(request.match_info["id"])
    except ValueError:
        return None
    return request.app[EMULATOR].find(iid, lingering)


async def show_instance(request: web.Request) -> web.Response:
    inst = _find(request)
    return _json(padded({"instances": inst.record() if inst else None}))


async def update_instance(request: web.Request) -> web.Response:
    inst = _find(request, lingering=False)
    if inst is None:
        return _documented(request, 404, "no_such_instance")
    body = await request.json()
    if not isinstance(body, dict) or not ({"label", "state"} & set(body)):
        return _error(400, "invalid_args", "expected a body with 'label' or 'state'")
    refused = _over_limits(request, "PUT /api/v0/instances/{id}/", body)
    if refused is not None:
        return refused
    if "label" in body:
        inst.label = str(body["label"])
    if "state" in body:
        return _error(400, "invalid_args", f"state changes ({body['state']!r}) are not emulated")
    return _json({"success": True})


async def destroy_instance(request: web.Request) -> web.Response:
    vast = request.app[EMULATOR]
    inst = _find(request)
    if inst is None:
        return _documented(request, 404, "not_found")  # vast.ai's answer: already gone
    if inst.destroyed_at is not None:
        return _json({"success": True})  # lingering: already on its way out
    outcome = faults.destroy_outcome(vast.faults, inst)  # counted now (destroy_attempts), answered after any wait
    if vast.faults.value("vast.slow_destroy"):
        await asyncio.sleep(vast.faults.value("vast.slow_destroy"))
    if outcome == "failed":
        return _error(500, "server_error", f"destroy of {inst.id} failed (failpoint vast.destroy_fails)")
    if outcome == "done":
        vast.destroy(inst)  # vast.ai answers at once and tears the container down behind the answer
    return _json({"success": True})  # "ignored" too: accepted, and nothing happens


async def destroy_instances(request: web.Request) -> web.Response:
    vast = request.app[EMULATOR]
    body = await request.json()
    ids = body.get("instance_ids") if isinstance(body, dict) else None
    if not isinstance(ids, list):
        return _error(400, "invalid_args", "expected {'instance_ids': [...]}")
    failed = []
    for i in ids:
        inst = vast.instances.get(int(i)) if str(i).isdigit() else None
        outcome = faults.destroy_outcome(vast.faults, inst) if inst is not None else "gone"
        if inst is not None and outcome == "done":
            vast.destroy(inst)
        elif outcome == "failed":
            failed.append(str(i))
    if failed:
        return _error(500, "server_error", f"destroy of {', '.join(failed)} failed (failpoint vast.destroy_fails)")
    return _json({"success": True})


async def list_v1(request: web.Request) -> web.Response:
    try:
        limit = min(int(request.query.get("limit", "25")), 25)
        after = int(request.query.get("after_token") or 0)
        filters = json.loads(request.query.get("select_filters") or "{}")
    except ValueError as e:
        return _documented(request, 400, "invalid_request", f"bad list parameters: {e}")
    listed = request.app[EMULATOR].listed()
    records = [i.record() for i in listed if i.id > after]
    try:
        records = [r for r in records if catalogue.match_offer(r, filters)]
    except ValueError as e:
        return _documented(request, 400, "invalid_request", str(e))
    page = records[:limit]
    token = str(page[-1]["id"]) if len(records) > limit else None
    labels: dict[str, int] = {}
    for i in listed:
        labels[i.label or ""] = labels.get(i.label or "", 0) + 1
    answer = {"instances": page, "next_token": token, "total_instances": len(listed), "label_counts": labels}
    return _json(padded(answer))

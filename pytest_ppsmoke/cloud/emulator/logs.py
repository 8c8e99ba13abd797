"""An instance's logs, as vast.ai serves them (``vastai logs ID``): ``PUT
/api/v0/instances/request_logs/{id}/`` with ``{"tail": "<lines>"}`` (and optionally ``filter``)
answers ``{"success": true, "result_url": ...}``; vast.ai uploads the log and the URL serves it
to anyone who holds it, with no key (an S3 object's). vast-cli fetches it, polling until it
answers 200.

The log is the instance's node's output when asked: its process's stderr tail (with its stdout
lines that are not events), as :class:`~pytest_ppsmoke.runtime.localproc.ChildProcess` keeps it;
empty for an instance whose node never started. ``filter`` keeps the lines a regular expression
matches (vast.ai greps); ``tail`` (default 1000, vast.ai's) the last lines of those. The text is
served as the container wrote it, as vast.ai serves it: whoever holds the URL reads it, so what
keeps a key out of it is the node, which redacts its own output before it writes
(``runtime/scrub.py``); :func:`secrets_of` names what a test looks for there.

The result URL is the emulator's own (:data:`RESULT_PATH`), on the address the call came to, and
names an unguessable token (``secrets.token_urlsafe``) bound to that one snapshot; the last
:data:`KEPT` results of an emulator are kept, an older one answers 404 as an expired upload would.
The upload is not there at once: the URL answers 404 (S3's ``NoSuchKey``) until the failpoint
``vast.log_upload`` (0.5 s by default) has passed since the request, which is why vast-cli polls
it (30 reads, 0.3 s apart). How long vast.ai's upload takes is not documented; the default is a
guess, and docs/lifecycle.md says so.
"""

from __future__ import annotations

import re
import secrets
import time
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING

from aiohttp import web

from ...nodeenv import variables
from ...runtime.localproc import LINES_KEPT
from .answers import EMULATOR, error_answer, json_answer

if TYPE_CHECKING:
    from .instances import Instance
    from .protocols import Emulator

REQUEST_PATH = "/api/v0/instances/request_logs/{id}/"  # vast-cli's (logs.yaml's has no trailing slash)
RESULT_PATH = "/ppsmoke/logs/"  # + the token: the emulator's own, standing in for vast.ai's S3 upload
DEFAULT_TAIL = 1000  # lines, vast.ai's default
KEPT = 64  # results an emulator keeps, the newest

# each emulator's results, by token: (the instance's id, the text, when its upload is done on the
# monotonic clock); gone with the emulator
_results: weakref.WeakKeyDictionary[Emulator, OrderedDict[str, tuple[int, str, float]]] = weakref.WeakKeyDictionary()
NOT_YET = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NoSuchKey</Code>'
    "<Message>The specified key does not exist.</Message></Error>"
)


def request_path(iid: int) -> str:
    """The path of instance ``iid``'s log request: its container key may call it."""
    return REQUEST_PATH.replace("{id}", str(iid))


def secrets_of(vast: Emulator, inst: Instance) -> list[str]:
    """What must never be served in ``inst``'s log: the account's key, its container key, and the
    values of the node's secret variables in its create's ``env``."""
    found = [vast.api_key, inst.container_key]
    found += [inst.env[v.name] for v in variables() if v.form.secret and v.name in inst.env]
    return [s for s in found if s]


def log_text(vast: Emulator, inst: Instance, tail: int, grep: re.Pattern[str] | None) -> str:
    """The log as its result URL serves it: as written, filtered, its last ``tail`` lines."""
    out = inst.proc.stderr_tail(LINES_KEPT) if inst.proc is not None else ""
    lines = [ln for ln in out.splitlines() if grep is None or grep.search(ln)]
    return "\n".join(lines[-tail:] if tail else [])


async def request_logs(request: web.Request) -> web.Response:
    vast = request.app[EMULATOR]
    try:
        inst = vast.find(int(request.match_info["id"]))
    except ValueError:
        inst = None
    if inst is None:
        return error_answer(404, "invalid_id", "Invalid instance id.")  # logs.yaml's 404
    body = await request.json() if request.body_exists else {}
    if not isinstance(body, dict):
        return error_answer(400, "invalid_args", "the body must be a JSON object")
    if body.get("daemon_logs"):
        return error_answer(400, "invalid_args", "daemon logs are not emulated (an instance here has no host daemon)")
    try:
        tail = int(str(body.get("tail") or DEFAULT_TAIL))  # a string in logs.yaml; a number is taken too
        grep = re.compile(str(body["filter"])) if body.get("filter") else None
    except (ValueError, re.error) as e:
        return error_answer(400, "invalid_args", f"bad tail or filter: {e}")
    if tail < 0:
        return error_answer(400, "invalid_args", f"tail must be a number of lines >= 0, got {tail}")
    kept = _results.setdefault(vast, OrderedDict())
    token = secrets.token_urlsafe(32)
    upload = float(vast.faults.value("vast.log_upload"))
    kept[token] = (inst.id, log_text(vast, inst, tail, grep), time.monotonic() + upload)
    while len(kept) > KEPT:
        kept.popitem(last=False)
    url = f"{request.url.origin()}{RESULT_PATH}{token}"
    return json_answer({"success": True, "result_url": url, "msg": "logs uploaded"})


async def result(request: web.Request) -> web.Response:
    """A result URL: the text of the one log it names, to anyone, with no key."""
    kept = _results.get(request.app[EMULATOR])
    found = kept.get(request.match_info["token"]) if kept is not None else None
    if found is None:
        return web.Response(status=404, text="no such log (an unknown or expired result)")
    if time.monotonic() < found[2]:  # not uploaded yet
        return web.Response(status=404, text=NOT_YET, content_type="application/xml")
    return web.Response(text=found[1])

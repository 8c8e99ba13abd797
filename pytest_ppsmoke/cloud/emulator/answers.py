"""What every handler of the emulator shares: where it finds the emulator, and how it answers."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from .protocols import Emulator

EMULATOR: web.AppKey[Emulator] = web.AppKey("emulator")  # request.app[EMULATOR]: the emulator serving it


def json_answer(data: Any, status: int = 200) -> web.Response:
    # exactly "application/json": the official CLI rejects the offers answer otherwise, and
    # aiohttp's json_response would add "; charset=utf-8"
    return web.Response(body=json.dumps(data).encode(), status=status, headers={"Content-Type": "application/json"})


def error_answer(status: int, error: str, msg: str) -> web.Response:
    """vast.ai's error shape: ``{"success": false, "error": ..., "msg": ...}``."""
    return json_answer({"success": False, "error": error, "msg": msg}, status)

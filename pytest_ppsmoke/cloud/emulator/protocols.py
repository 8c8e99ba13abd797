"""What the emulator's API handlers need of the emulator (``server.FakeVast`` is it), as a
``Protocol``: the routes (``api.py``), the log requests (``logs.py``) and the shared answers
(``answers.py``) name this, not ``FakeVast``, which builds their routes; so no two of the
emulator's modules name each other, not even for the type checker."""

from __future__ import annotations

from typing import Any, Protocol

from ... import failpoints
from .apidoc import Violation
from .faults import RateLimiter
from .instances import Instance


class Emulator(Protocol):
    """The account and its instances as the handlers read and change them."""

    api_key: str
    credit: float  # the account's credit in $, as users/current shows it
    catalogue: list[dict[str, Any]]  # the offers
    faults: failpoints.Scenario
    limiter: RateLimiter  # vast.ai's rate limits (replaced when the faults change)
    requests: list[tuple[str, str, int]]  # method, path, status: every call answered
    violations: list[Violation]  # calls that broke vast.ai's description (apidoc)
    creates: int  # create calls answered or held, counted from 1
    isolated_until: float  # vast.isolate_orchestrator: the account's calls get no answer until then
    instances: dict[int, Instance]  # live: rented and not destroyed
    network: Any  # the EmulatedNetwork, or None on loopback

    def listed(self) -> list[Instance]: ...
    def purge(self) -> None: ...
    def find(self, iid: int, lingering: bool = True) -> Instance | None: ...
    def new_id(self) -> int: ...
    def rent(self, inst: Instance) -> Instance: ...
    def destroy(self, inst: Instance) -> None: ...
    async def held(self) -> None: ...

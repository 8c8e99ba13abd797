"""Waiting on a provider, above the seam (``provider.py``): an instance polled until it runs
(:func:`wait_running`), and what its ``status_msg`` says failed (:func:`start_failure`). Every
wait reads and spends the ``clock`` and ``sleep`` it is given (the real ones in a run, a virtual
clock in a test), so no provider re-implements it and no test waits for real."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

from .provider import DEAD_STATES, Instance, NeverRuns, Provider

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]

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


class Board:
    """The records of a run's instances, from one list call (by the run's label prefix) shared
    by every wait that looks within ``fresh`` seconds of it: eight booting instances cost one
    list a round, not eight shows (a provider limits each endpoint per client: vast.ai's show to
    one call in 2 s, its list to one in 1 s). A wait that looks while a list is in flight gets
    that list's answer."""

    def __init__(self, provider: Provider, label_prefix: str, fresh: float, *, clock: Clock) -> None:
        self.provider, self.label_prefix, self.fresh, self.clock = provider, label_prefix, fresh, clock
        self._round: asyncio.Future[Mapping[int | None, Instance]] | None = None
        self._at = float("-inf")
        self.lists = 0  # list calls made

    async def _list(self) -> Mapping[int | None, Instance]:
        self.lists += 1
        listed = {r.id: r for r in await self.provider.list_instances(self.label_prefix)}
        self._at = self.clock()
        return listed

    async def look(self, instance_id: int) -> Instance | None:
        """The instance's record as the latest list shows it (None: not listed)."""
        r = self._round
        if r is None or (
            r.done() and (r.cancelled() or r.exception() is not None or self.clock() - self._at >= self.fresh)
        ):
            r = self._round = asyncio.ensure_future(self._list())
        return (await asyncio.shield(r)).get(instance_id)


async def wait_running(
    provider: Provider,
    instance_id: int,
    polls: int,
    interval: float,
    on_poll: Callable[[int, Instance | None], None] | None = None,
    *,
    clock: Clock,
    sleep: Sleep,
    look: Callable[[int], Awaitable[Instance | None]] | None = None,
) -> Instance:
    """Poll until ``actual_status`` is ``running``; at most ``polls`` polls, ``interval`` apart.
    Fails at once (:class:`NeverRuns`) on a state that never becomes running (:data:`DEAD_STATES`)
    and on a ``status_msg`` that names an error (:func:`start_failure`: a pull the host retries
    for hours); TimeoutError when the polls are spent (ProviderError: the provider's own, from a
    show it gave up on). A host that is merely slow gets every poll. ``look``: how a poll reads
    the record (default: the provider's show; a :class:`Board`'s look: a list shared by every wait).

    An instance shown as null (vast.ai's answer for one it does not show) is polled through, as
    vast-cli's own wait loop does ("No information returned ... Retrying"): a new instance can be
    invisible for a while after its create, and the polls remain the deadline."""
    last: Instance | None = None
    unshown = 0  # the polls in a row that showed no record
    started = clock()
    for poll in range(1, polls + 1):
        shown = await (look or provider.show_instance)(instance_id)
        if on_poll is not None:
            on_poll(poll, shown)
        if shown is None:
            unshown += 1
            if poll < polls:
                await sleep(interval)
            continue
        last, unshown = shown, 0
        state = last.actual_status
        if state == "running":
            return last
        msg = last.status_msg or "no status message"
        if state in DEAD_STATES:
            raise NeverRuns(f"instance {instance_id} is {state} ({msg}); it will never run")
        failure = start_failure(last.status_msg)
        if failure is not None:
            raise NeverRuns(f"instance {instance_id} is {state or 'new'}, and its {failure} failed: {msg}", failure)
        if poll < polls:
            await sleep(interval)
    took = f"instance {instance_id} not running after {polls} polls in {clock() - started:.1f} s"
    if last is None:
        raise TimeoutError(f"{took} (never shown: every poll answered null)")
    msg = last.status_msg or "no status message"
    gone = f"; not shown in its last {unshown} polls" if unshown else ""
    raise TimeoutError(f"{took} (last status {last.actual_status!r}: {msg}{gone})")

"""A stage's instance seen through to its node joined, replaced when it does not get there in
time (``replace.py``'s policy): the part of :class:`.rental.Rental` that renews a stage.

A host past its per-host deadline that is still booting may yet run: destroying it at once
throws away a boot that was nearly done, and a replacement starts a whole boot again. So with
``keep_slow`` (the default) the replacement races it: the first of the two to run goes on, and
the other is destroyed then. A host vast.ai shows dead, or whose node never joined, is
destroyed at once. Every instance retired is marked ``replaced`` (why, when), and the rental's
``on_retire`` hears of it (the harness revokes its node's id over the cluster).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from ..protocol import Phase, PhaseError
from .provider import Offer
from .rented import RentalConfig, RentedInstance
from .replace import Replaceable

log = logging.getLogger(__name__)

Renew = Callable[[RentedInstance], Awaitable[tuple[Mapping[str, str], str]]]


class Renter(Protocol):
    """What renewing needs of its rental (``rental.Rental`` is one)."""

    config: RentalConfig
    instances: list[RentedInstance]
    offers: list[Offer]
    replacements: int
    began: float
    clock: Callable[[], float]
    on_retire: Callable[[RentedInstance], None] | None

    def cannot_replace(self) -> str | None: ...
    async def wait_running(self, inst: RentedInstance, deadline: bool = True) -> None: ...
    async def rent(
        self, stage: int, env: Mapping[str, str], offers: list[Offer], endpoint_id: str, replacement: int = 0
    ) -> RentedInstance: ...
    async def _destroy(self, inst: RentedInstance) -> None: ...
    async def _within(self, seconds: float, work: Awaitable[None]) -> None: ...
    def next_replacement(self, stage: int) -> int: ...
    async def _first_running(self, inst: RentedInstance, rival: RentedInstance | None) -> RentedInstance: ...
    async def _retire(self, inst: RentedInstance, why: str) -> None: ...
    async def _renewed(self, old: RentedInstance, renew: Renew) -> RentedInstance: ...
    async def replace(self, inst: RentedInstance, why: str, renew: Renew) -> RentedInstance: ...


class Renewing:
    """The rental's renewal of a stage (a mixin of ``Rental``: each method reads the rental)."""

    async def see_through(
        self: Renter,
        inst: RentedInstance,
        renew: Renew,
        after_running: Callable[[RentedInstance], Awaitable[None]],
        stamp: Callable[[RentedInstance, str], None] = lambda i, step: None,
        spare: RentedInstance | None = None,
    ) -> RentedInstance:
        """``inst`` running (``wait_running``), then ``after_running`` (the cluster's join),
        replaced by another instance of its stage each time it does not get there in time
        (``after_running`` raises :class:`Replaceable`, or does not end within the policy's join
        deadline): ``renew`` gives the replacement's environment and endpoint id. ``spare``:
        another instance of the stage, rented beside it; the first of the two to run goes on.
        Returns the instance that got there; raises the failure of the last one that did not
        (with replacement off: the failure itself, as the spec's error table has it)."""
        p = self.config.replacement
        rival = spare
        while True:
            try:
                inst = await self._first_running(inst, rival)
                rival = None
                stamp(inst, "running")
                if not p.on:
                    await after_running(inst)
                    return inst
                try:
                    await self._within(p.join_deadline, after_running(inst))
                except TimeoutError:
                    late = f"{inst.where}: its node did not join within {p.join_deadline:g} s of running"
                    raise Replaceable(PhaseError(Phase.CONVERGE, late)) from None
                return inst
            except Replaceable as e:
                if not p.on:
                    raise e.error from None
                why = self.cannot_replace()
                if why is not None:
                    raise PhaseError(e.error.phase, f"{e.error.reason}; not replaced: {why}") from None
                if e.slow and p.keep_slow and rival is None:  # still booting: its replacement races it
                    log.warning("%s is past its per-host deadline; renting a replacement to race it", inst.where)
                    self.replacements += 1
                    inst.late = e.error.reason
                    rival = await self._renewed(inst, renew)
                    stamp(rival, "rented")
                    continue
                inst = await self.replace(inst, e.error.reason, renew)
                stamp(inst, "rented")

    def next_replacement(self: Renter, stage: int) -> int:
        """The next replacement number of ``stage`` (its label's ``r<k>``): one past any it has had."""
        return 1 + max((i.replacement for i in self.instances if i.stage == stage), default=0)

    async def _first_running(self: Renter, inst: RentedInstance, rival: RentedInstance | None) -> RentedInstance:
        """``inst`` running; with a ``rival`` (a spare, or a replacement racing a slow host),
        whichever of the two runs first within its boot window, the other one retired. When
        neither runs, the rival is retired and ``inst``'s failure raised."""
        if rival is None:
            await self.wait_running(inst)
            return inst
        waits = {asyncio.ensure_future(self.wait_running(i, deadline=False)): i for i in (inst, rival)}
        first: BaseException | None = None
        try:
            for done in asyncio.as_completed(list(waits)):
                try:
                    await done
                except (PhaseError, Replaceable) as e:
                    first = first or e
                    continue
                winner = next(i for t, i in waits.items() if t.done() and not t.cancelled() and not t.exception())
                loser = rival if winner is inst else inst
                late = f"{loser.late}; " if loser.late else ""
                await self._retire(loser, f"{late}instance {winner.id}, of the same stage, ran first")
                return winner
        finally:
            for t in waits:
                t.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        await self._retire(rival, f"neither it nor instance {inst.id}, of the same stage, ran in time")
        assert first is not None
        error = first.error if isinstance(first, Replaceable) else first
        if not isinstance(error, PhaseError):
            raise first
        rented = rival.timeline.get("rented")
        since = f", rented at {rented:.0f} s," if rented is not None else ""
        raise PhaseError(
            error.phase, f"{error.reason}; nor did instance {rival.id}{since} which raced it, within its own window"
        ) from None

    async def _retire(self: Renter, inst: RentedInstance, why: str) -> None:
        """Mark ``inst`` replaced (``why``), tell ``on_retire``, and destroy it (a destroy that
        fails is reported against it, and tried again at the close)."""
        inst.replaced, inst.replaced_at = why, round(self.clock() - self.began, 3)
        if self.on_retire is not None:
            self.on_retire(inst)
        await self._destroy(inst)

    async def _renewed(self: Renter, old: RentedInstance, renew: Renew) -> RentedInstance:
        """A new instance of ``old``'s stage, on the next offer on a machine this run has not
        rented; ``renew`` gives its environment and endpoint id (a new key, admitted)."""
        env, endpoint_id = await renew(old)
        new = await self.rent(old.stage, env, self.offers, endpoint_id, replacement=self.next_replacement(old.stage))
        new.replaces = old.id
        return new

    async def replace(self: Renter, inst: RentedInstance, why: str, renew: Renew) -> RentedInstance:
        """Destroy ``inst`` (``why``: what it did not do in time) and rent its stage again."""
        self.replacements += 1
        log.warning("replacing %s: %s", inst.where, why)
        await self._retire(inst, why)
        return await self._renewed(inst, renew)

"""A run's teardown on any provider: every instance of the rental destroyed, each checked as the
provider shows it afterwards, a destroy sent again while it still shows one intended running,
and the run's label swept for an instance whose create answer was lost; within the teardown's
deadline on the rental's clock, never stopping at the first failure (:class:`Teardown`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from ..protocol import Phase, PhaseError
from .provider import Instance, Provider, going_away
from .rented import RentalConfig, RentedInstance, adopted

log = logging.getLogger(__name__)
GONE = ("destroyed", "destroying")  # an instance's state once its destroy was accepted


def _gone(inst: RentedInstance, record: Instance | None) -> bool:
    """After an accepted destroy, whether vast.ai's record of ``inst`` (None: not shown) says it is
    gone (``destroyed``) or listed on its way out (``destroying``: its state fields no longer
    intend it to run); its state then says which. Otherwise the record is taken as seen."""
    if record is None or going_away(record):
        inst.state = "destroyed" if record is None else "destroying"
        return True
    inst.seen(record)
    return False


async def within(seconds: float, work: Awaitable[None], sleep: Callable[[float], Awaitable[None]]) -> None:
    """``work``, cancelled with TimeoutError once ``seconds`` of ``sleep``'s clock have passed."""
    task = asyncio.ensure_future(work)
    timer = asyncio.ensure_future(sleep(seconds))
    try:
        await asyncio.wait([task, timer], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, timer):
            t.cancel()
        await asyncio.gather(task, timer, return_exceptions=True)
    if task.cancelled():
        raise TimeoutError
    task.result()


class Torn(Protocol):
    """What a teardown needs of its rental (``rental.Rental`` is one)."""

    provider: Provider
    config: RentalConfig
    run_id: str
    instances: list[RentedInstance]
    creates_sent: int
    uncertain_creates: bool
    teardown_timeout: float
    teardown_errors: list[str]
    listed_after: list[Instance] | None
    sleep: Callable[[float], Awaitable[None]]

    @property
    def label_prefix(self) -> str: ...


class Teardown:
    """The teardown of one rental: its instances, its settings and its clock are the rental's."""

    def __init__(self, rental: Torn) -> None:
        self.rental = rental

    async def close(self) -> None:
        """Destroy every instance of this run. Raises PhaseError(Phase.TEARDOWN) naming every instance
        that could not be destroyed; never stops at the first failure, and ends within
        ``teardown_timeout`` even when vast.ai does not answer."""
        r = self.rental
        try:
            await within(r.teardown_timeout, self._destroy_all(), r.sleep)
        except TimeoutError:
            for i in r.instances:
                if i.state not in ("destroyed", "destroying") and not i.destroy_error:
                    i.destroy_error = f"no answer within the teardown's {r.teardown_timeout:.0f} s"
            r.teardown_errors.append(f"the teardown did not finish within {r.teardown_timeout:.0f} s")
        failed = [i for i in r.instances if i.destroy_error]
        problems = [f"{i.name} was NOT destroyed: {i.destroy_error}" for i in failed] + r.teardown_errors
        if problems:
            advice = (
                f". Something may still be billing: run {r.config.names.reap(r.run_id)}, or check the vast.ai console"
                if r.creates_sent
                else " (no instance was ever created)"
            )
            raise PhaseError(Phase.TEARDOWN, "; ".join(problems) + advice)

    async def _destroy_all(self) -> None:
        r = self.rental
        r.listed_after = None
        todo = [i for i in r.instances if i.id is not None and i.state not in GONE]
        listed = await self.destroy_together(todo) if len(todo) > 1 else None
        await asyncio.gather(*(self.destroy(i) for i in r.instances if i.id is not None))
        await self._sweep(listed)

    async def destroy_together(self, todo: list[RentedInstance]) -> list[Instance] | None:
        """``todo`` destroyed in one call, then one list of the run's label read for what each
        became: a provider spaces its destroys (vast.ai: one in 3 s), so N instances one by one
        cost 3(N-1) s more. What is gone or going is done; one still intended running is left to
        :meth:`destroy`, as is everything when the call or the list fails. The list, for the sweep."""
        r = self.rental
        try:
            await r.provider.destroy_instances([i.id for i in todo if i.id is not None])
        except Exception as e:  # refused, or no such call: each is destroyed alone
            log.info("destroying %d instances in one call failed (%s): destroying each alone", len(todo), e)
            return None
        accepted = time.time()
        try:
            listed = await r.provider.list_instances(r.label_prefix)
        except Exception as e:
            log.info("%d destroys accepted in one call; the list afterwards failed: %s", len(todo), e)
            return None
        shown = {record.id: record for record in listed}
        for inst in todo:
            if _gone(inst, shown.get(inst.id)):
                inst.ended_at = inst.ended_at or accepted  # billing stops with the accepted destroy
                inst.destroy_error = None
            else:
                log.warning("%s: destroy accepted in a list, but vast.ai still shows it intended running", inst.name)
        return listed

    async def destroy(self, inst: RentedInstance) -> None:
        """Destroy it, then ask vast.ai: gone (``destroyed``), still listed on its way out
        (``destroying``: its state fields no longer intend it to run), or still intended running
        although the destroy was accepted: then the destroy is sent again, ``redestroys`` times,
        before it is reported as not destroyed."""
        r = self.rental
        assert inst.id is not None
        if inst.state in GONE:
            return
        for attempt in range(1 + r.config.redestroys):
            try:
                await r.provider.destroy_instance(inst.id)
            except Exception as e:  # any failure is reported against this instance; the others go on
                inst.destroy_error = str(e) or type(e).__name__
                log.warning("could not destroy %s: %s", inst.name, inst.destroy_error)
                return
            inst.ended_at = inst.ended_at or time.time()  # billing stops with the accepted destroy
            inst.destroy_error = None
            try:
                record = await r.provider.show_instance(inst.id)
            except Exception as e:
                log.info("destroy of %s accepted; the check afterwards failed: %s", inst.name, e)
                inst.state = "destroying"
                return
            if _gone(inst, record):
                return
            log.warning("%s: destroy accepted, but vast.ai still shows it intended running", inst.name)
            if attempt < r.config.redestroys:
                await r.sleep(min(2.0, r.config.poll_interval))
        inst.ended_at = None  # still billing
        inst.destroy_error = (
            f"vast.ai accepted {1 + r.config.redestroys} destroys but still shows it intended running "
            f"(actual_status {inst.state!r})"
        )

    async def _sweep(self, listed: list[Instance] | None = None) -> None:
        """Destroy instances with this run's label that the run holds no id for: a create that
        was cancelled in flight, or whose answer was lost. Such an instance may be listed only a
        moment later, so after an uncertain create the list is read a few times. ``listed``: a
        list read after the destroys, taken as the first look (when no destroy came after it).
        The last look, when no destroy came after it either, is the rental's ``listed_after``:
        vast.ai's word on what is left, which the run need not ask again."""
        r = self.rental
        if not r.creates_sent:
            return  # nothing was ever asked of vast.ai: nothing can carry this run's label
        if listed is not None and any(i.id is not None and i.state not in GONE for i in r.instances):
            listed = None  # a destroy went out after it (or failed): read again
        looks = 4 if r.uncertain_creates else 1
        swept = False
        for look in range(looks):
            if listed is None or look:
                try:
                    listed = await r.provider.list_instances(r.label_prefix)
                except Exception as e:
                    r.teardown_errors.append(f"could not list this run's instances to sweep them: {e}")
                    return
            known = {i.id for i in r.instances}
            for record in listed:
                if record.id not in known:
                    orphan = adopted(record)
                    log.warning(
                        "destroying instance %s (%s): created by this run, its answer lost", orphan.id, orphan.label
                    )
                    r.instances.append(orphan)
                    await self.destroy(orphan)
                    swept = True
            if look < looks - 1:
                await r.sleep(min(2.0, r.config.poll_interval))
        r.listed_after = None if swept else listed

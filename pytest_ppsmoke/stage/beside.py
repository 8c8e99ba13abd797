"""Stage 0's reference worker beside its stage's (``PP_REFERENCE=beside``): its start, watched,
and the wait a ``ReferenceQuery`` makes for it within the query's own deadline."""

from __future__ import annotations

import asyncio
import logging

from ..protocol import stage_name
from ..runtime.localproc import emit
from .bridge import WorkerBridge, WorkerDied, WorkerError
from .pipe import Ready

log = logging.getLogger(__name__)


class ReferenceBeside:
    """Stage 0's reference worker (``PP_REFERENCE=beside``, ``PP_WORKER_ROLE=reference``), started
    with the stage's worker: the whole model loads while the stages load, and a
    ``ReferenceQuery`` only generates. Its start is a task; the query waits for it within its
    own deadline, and a worker that did not start is the query's error, not the stage's."""

    def __init__(self, bridge: WorkerBridge, ready_timeout: float) -> None:
        self.bridge = bridge
        self.starting: asyncio.Future[Ready] = asyncio.ensure_future(bridge.start(ready_timeout))
        self.starting.add_done_callback(self._started)

    def _started(self, fut: asyncio.Future[Ready]) -> None:
        if fut.cancelled():
            return
        if fut.exception() is not None:
            log.error("the reference worker did not start: %s", fut.exception())
            return
        ready = fut.result()
        emit({"event": "reference_ready", "pid": ready.pid, "load_s": ready.load_s})

    async def ready(self, timeout: float) -> WorkerBridge:
        """The worker, once it has loaded; TimeoutError or RuntimeError (it did not start) say why."""
        try:
            await asyncio.wait_for(asyncio.shield(self.starting), timeout)
        except (TimeoutError, WorkerDied, WorkerError, ValueError) as e:
            if not self.starting.done():
                raise TimeoutError(
                    f"the reference worker beside {stage_name(0)} is still loading after this query's {timeout:.0f} s"
                ) from None
            raise RuntimeError(
                f"the reference worker beside {stage_name(0)} did not start: {e}; with reference=after the stage's "
                "worker loads the model after the request instead"
            ) from None
        return self.bridge

    async def close(self) -> None:
        if not self.starting.done():
            self.starting.cancel()
        await self.bridge.close()

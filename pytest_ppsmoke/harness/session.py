"""The run driver stepped from synchronous code: the pytest plugin's session fixtures.

    session = SmokeSession(settings)
    try:
        session.step("load")          # rented, booted, converged, workers loaded
        result = session.step("infer").result
    finally:
        session.teardown()

Everything asynchronous (iroh, SWIM, the vast.ai client, the emulator and its node processes)
runs on one event loop in a background thread, so the fixtures work whatever asyncio plugin the
user runs (none is needed), and a pytest-timeout signal or Ctrl-C in the main thread interrupts a
wait without stopping the loop that the teardown then needs.

While a step or the teardown waits, the waiting thread shows the run's progress (a
:class:`~.progress.Relay` given as ``relay``): the plugin's live line on a terminal, or a line
as each phase starts and ends in a pipe.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ..protocol import PhaseError
from .driver import SmokeRun
from .progress import REFRESH, Relay
from .report import Report
from .settings import Settings

T = TypeVar("T")

SLACK = 30.0  # seconds the loop thread waits beyond the driver's own deadlines, as a backstop


class LoopThread:
    """An asyncio loop in a daemon thread; ``run`` waits for a coroutine with a deadline."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="ppsmoke-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float, on_wait: Callable[[], None] | None = None) -> T:
        """The coroutine's result, within ``timeout``; ``on_wait`` is called every
        :data:`~.progress.REFRESH` seconds while it runs (in this thread)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                try:
                    return fut.result(max(0.0, min(left, REFRESH)) if on_wait is not None else timeout)
                except concurrent.futures.TimeoutError:
                    if on_wait is None or left <= REFRESH:
                        raise
                    on_wait()
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"not done within {timeout:.0f} s") from None
        except BaseException:  # a pytest-timeout signal, Ctrl-C: stop the work, keep the loop
            fut.cancel()
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        if not self.thread.is_alive():
            self.loop.close()


class SmokeSession:
    def __init__(self, settings: Settings, relay: Relay | None = None) -> None:
        self.settings = settings
        self.relay = relay  # the progress shown while a step waits
        on_phase, on_start = (relay.on_phase, relay.on_start) if relay is not None else (None, None)
        self.run = SmokeRun(settings, face="pytest", on_phase=on_phase, on_start=on_start)
        if relay is not None:
            relay.progress.watch(self.run)
        self.loop = LoopThread()
        self.started = False
        self.closed = False

    def __repr__(self) -> str:
        return f"SmokeSession({self.run!r})"

    @property
    def report(self) -> Report:
        return self.run.report

    @property
    def failure(self) -> PhaseError | None:
        return self.run.failure

    def remaining(self) -> float:
        return self.run.remaining()

    def step(self, name: str) -> SmokeRun:
        """Run the driver up to step ``name`` (rent, boot, converge, load, resolve, infer, reference)."""
        if self.closed:
            raise PhaseError(self.run.phase, "the session is already torn down")
        try:
            if not self.started:
                self.started = True
                self.loop.run(self.run.start(), SLACK, self._tick)
            self.loop.run(self.run.step(name), max(0.0, self.remaining()) + SLACK, self._tick)
        except PhaseError:
            raise
        except BaseException as e:  # a test's timeout, Ctrl-C: the phase it cut short is the cause
            phase = self.run.phase
            self.run.fail(phase, f"{phase}: interrupted ({type(e).__name__})")
            raise
        finally:
            self._done()
        return self.run

    def _tick(self) -> None:
        if self.relay is not None:
            self.relay.tick()

    def _done(self) -> None:
        if self.relay is not None:
            self.relay.done()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run a coroutine on the session's loop (a test's own request to a stage)."""
        return self.loop.run(coro, min(timeout, max(1.0, self.remaining())))

    def teardown(self) -> None:
        """Destroy everything rented, close the loop; idempotent. The outcome is in the report
        (``error`` names what could not be destroyed)."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.started:
                self.loop.run(self.run.close(), self.settings.teardown_timeout + SLACK, self._tick)
        finally:
            self._done()
            self.loop.close()

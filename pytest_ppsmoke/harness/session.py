"""One smoke session, driven step by step from synchronous code (the pytest fixtures).

    session = SmokeSession(Settings(mode="local"))
    try:
        session.rent(); session.form_cluster(); session.resolve()
        result = session.infer()
    finally:
        session.teardown()

Everything asynchronous (iroh, SWIM, the vast.ai client, the emulator and its node processes)
runs on one event loop in a background thread, so the fixtures work whatever the user's
pytest-asyncio configuration, and a pytest-timeout signal or Ctrl-C in the main thread
interrupts a wait without stopping the loop that the teardown then needs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..cloud.fake_vast import FakeVast
from ..cloud.lifecycle import DEFAULT_IMAGE, Deployment, RunConfig
from ..cloud.vast import DEFAULT_URL, OfferQuery, VastClient
from ..protocol import PhaseError
from .pipeline import InferenceResult, run_inference

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Settings:
    mode: str = "local"  # local: the emulator on loopback; vastai: real vast.ai
    key: str = field(default="", repr=False)
    vast_url: str = DEFAULT_URL
    model: str = "smollm2:135m"
    num_stages: int = 2
    wire_dtype: str = "bf16"
    image: str = DEFAULT_IMAGE
    budget: float = 300.0
    max_tokens: int = 64
    prompt: str = "Say hello"
    gpu_ram: float = 8.0
    max_price: float = 2.0
    min_reliability: float = 0.95
    report: Path | None = None

    def run_config(self) -> RunConfig:
        local = self.mode == "local"
        return RunConfig(
            num_stages=self.num_stages,
            model=self.model,
            wire_dtype=self.wire_dtype,
            image=self.image,
            query=OfferQuery(gpu_ram_gb=self.gpu_ram, max_dph=self.max_price, min_reliability=self.min_reliability),
            network="local" if local else "wan",
            poll_interval=0.25 if local else 3.0,
        )


class LoopThread:
    """An asyncio loop in a daemon thread; ``run`` waits for a coroutine with a deadline."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="ppsmoke-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
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
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.started = time.monotonic()
        self.loop = LoopThread()
        self.fake: FakeVast | None = None
        self.vast: VastClient | None = None
        self.deployment: Deployment | None = None
        self.result: InferenceResult | None = None
        self.error: str | None = None
        self.emulator_record: dict[str, list[int]] | None = None
        self.left_after_teardown: list[dict[str, Any]] | None = None  # the run's label, listed after
        self.closed = False

    def __repr__(self) -> str:
        return f"SmokeSession({self.settings.mode}, {self.deployment!r})"

    def remaining(self) -> float:
        return self.settings.budget - (time.monotonic() - self.started)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        left = self.remaining()
        if left <= 0:
            coro.close()
            raise PhaseError("budget", f"the session's budget of {self.settings.budget:.0f} s is spent")
        try:
            return self.loop.run(coro, left)
        except PhaseError as e:
            self.error = self.error or str(e)
            raise
        except TimeoutError:
            phase = self.deployment.phase if self.deployment else "rent"
            self.error = self.error or f"{phase}: the session's budget of {self.settings.budget:.0f} s is spent"
            raise PhaseError(phase, f"the session's budget of {self.settings.budget:.0f} s is spent") from None

    # --- the steps, in order; each one runs those before it that have not run ------------------

    def rent(self) -> Deployment:
        if self.deployment is None:
            self.deployment = self._run(self._rent())
        return self.deployment

    async def _rent(self) -> Deployment:
        s = self.settings
        if s.mode == "local" and s.vast_url == DEFAULT_URL:  # else: an emulator the user runs
            self.fake = FakeVast()
            await self.fake.start()
            self.vast = VastClient(self.fake.api_key, self.fake.url)
        else:
            self.vast = VastClient(s.key, s.vast_url)
        dep = Deployment(self.vast, s.run_config())
        self.deployment = dep  # before the first create: teardown must know of it
        await dep.rent()
        await dep.boot()
        return dep

    def form_cluster(self) -> Deployment:
        dep = self.rent()
        if "load" not in dep.timings:
            self._run(self._form_cluster(dep))
        return dep

    async def _form_cluster(self, dep: Deployment) -> None:
        await dep.converge()
        await dep.load()

    def resolve(self) -> Deployment:
        dep = self.form_cluster()
        if "resolve" not in dep.timings:
            self._run(dep.resolve())
        return dep

    def infer(self) -> InferenceResult:
        if self.result is None:
            dep = self.resolve()
            assert dep.seed is not None
            s = self.settings
            self.result = self._run(
                run_inference(dep.seed, s.num_stages, s.prompt, s.max_tokens, max(1.0, self.remaining()))
            )
        return self.result

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run a coroutine on the session's loop (a test's own request to a stage)."""
        return self.loop.run(coro, min(timeout, max(1.0, self.remaining())))

    # --- teardown ------------------------------------------------------------------------------

    def teardown(self) -> None:
        """Destroy everything; idempotent. Raises PhaseError("teardown") if something was not
        destroyed (after everything else has been closed)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.loop.run(self._teardown(), 300)
        finally:
            self.loop.close()

    async def _teardown(self) -> None:
        try:
            if self.deployment is not None:
                await self.deployment.close()
        except PhaseError as e:
            self.error = self.error or str(e)
            raise
        finally:
            if self.vast is not None:
                if self.deployment is not None:  # vast.ai's own word on what is left
                    try:
                        self.left_after_teardown = await self.vast.list_instances(self.deployment.label_prefix)
                    except Exception as e:
                        log.warning("could not list the run's instances after teardown: %s", e)
                await self.vast.close()
            if self.fake is not None:
                self.emulator_record = {
                    "live_instances": [i.id for i in self.fake.live()],
                    "destroyed_instances": [i.id for i in self.fake.destroyed],
                }
                with contextlib.suppress(Exception):
                    await self.fake.close()

    # --- figures -------------------------------------------------------------------------------

    def figures(self) -> dict[str, Any]:
        """What the session has measured so far: the report, and the JUnit properties."""
        dep, r = self.deployment, self.result
        out: dict[str, Any] = {
            "mode": self.settings.mode,
            "model": self.settings.model,
            "num_stages": self.settings.num_stages,
            "wire_dtype": self.settings.wire_dtype,
            "error": self.error,
            "run_id": dep.run_id if dep else None,
            "timings": dict(dep.timings) if dep else {},
            "instances": [i.summary() for i in dep.instances] if dep else [],
            "cost_usd": round(dep.cost_usd(), 6) if dep else 0.0,
        }
        if r is not None:
            out["timings"].update(r.timings)
            out.update(
                text=r.text,
                prompt_token_ids=r.prompt_token_ids,
                token_ids=r.token_ids,
                hops=r.hops,
                kv=r.kv_summary(),
            )
        if self.emulator_record is not None:
            out["emulator"] = self.emulator_record
        return out

"""A provider in memory, the seam's second implementation (``cloud/provider.py``), and the virtual
clock it and the shared code run on: instances whose states advance with virtual time, a host that
never boots, an image that fails to pull, a create whose answer is lost, destroys that are lost or
that linger, a destroy that hangs. Nothing here waits for real, and nothing names vast.ai's client,
its records or the emulator (``tests/test_layers.py`` checks it): the unchanged ``Rental`` and
``Deployment`` run against it (``tests/test_provider.py``)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pytest_ppsmoke.cloud.pacing import Pacer
from pytest_ppsmoke.cloud.provider import Instance, Offer, OfferGone, OfferQuery, ProviderError


class VirtualClock:
    """Virtual time for ``clock=`` and ``sleep=``: ``sleep(s)`` parks its caller until the clock
    reaches now + s; the clock jumps to the earliest parked caller once every task that can run has
    run (each gets a few turns of the loop first). Callers parked at once wake in time order."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = self.start = start
        self._parked: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._runner: asyncio.Task[None] | None = None

    def __call__(self) -> float:
        return self.now

    @property
    def elapsed(self) -> float:
        return self.now - self.start

    async def sleep(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        wake: asyncio.Future[None] = loop.create_future()
        heapq.heappush(self._parked, (self.now + max(seconds, 0.0), next(self._seq), wake))
        if self._runner is None or self._runner.done():
            self._runner = loop.create_task(self._advance())
        await wake

    async def _advance(self) -> None:
        while self._parked:
            for _ in range(20):  # every task that can run, runs (and may park) before time moves
                await asyncio.sleep(0)
            if not self._parked:
                return
            when, _, wake = heapq.heappop(self._parked)
            if wake.done():  # its sleeper was cancelled
                continue
            self.now = max(self.now, when)
            wake.set_result(None)


@dataclass
class MemInstance:
    id: int
    offer: Offer
    label: str
    env: dict[str, str]
    created: float
    boot_s: float | None  # seconds from create to running; None: never
    pull_error: str = ""  # a status_msg naming a failed pull, from its first show
    destroyed: float | None = None  # when a destroy was accepted
    exits_at: float | None = None  # its host dies (exited) at this time


def offers(n: int = 4) -> list[Offer]:
    """``n`` offers, the cheapest first by id."""
    return [Offer(100 + i, f"GPU-{i}", 1, 24_000.0, 0.1 * (i + 1), 0.99, "here", {}, 500 + i) for i in range(n)]


@dataclass
class MemProvider:
    """The seam's calls on dicts, timed by ``clock``. The faults: ``boot_s`` (each create's boot,
    by create order; the last value for the rest; None: never runs), ``pull_errors`` (creates, by
    order, whose image pull fails), ``taken`` (offers someone else rents first), ``lost_answers``
    (creates, by order, whose instance is rented but whose answer is lost), ``lost_destroys``
    (accepted destroys the provider forgets, in all), ``linger_s`` (how long a destroyed instance
    stays listed, on its way out), ``hang_destroys`` (a destroy that never answers), ``bulk_refused``
    (a destroy of a list refused: each is destroyed alone). ``pace``: the
    documented limits its calls go through (name -> (calls, seconds), the shared ``Pacer``, as a
    provider's transport takes its turns); ``times``: when each call was made, by name."""

    clock: VirtualClock
    catalogue: list[Offer] = field(default_factory=offers)
    boot_s: list[float | None] = field(default_factory=lambda: [30.0])
    pull_errors: set[int] = field(default_factory=set)
    taken: set[int] = field(default_factory=set)
    lost_answers: set[int] = field(default_factory=set)
    lost_destroys: int = 0
    linger_s: float = 0.0
    hang_destroys: bool = False
    bulk_refused: bool = False
    credit_usd: float | None = 50.0
    deadline: float | None = None
    instances: dict[int, MemInstance] = field(default_factory=dict)
    calls: Counter[str] = field(default_factory=Counter)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(7001))
    _creates: int = 0
    pace: Mapping[str, tuple[int, float]] = field(default_factory=dict)
    times: dict[str, list[float]] = field(default_factory=dict)
    pacer: Pacer | None = None

    def __post_init__(self) -> None:
        self.pacer = Pacer.of(self.pace, clock=self.clock, sleep=self.clock.sleep)

    async def _call(self, name: str) -> None:
        """One call of ``name``: its turn on the pacer, counted and timed (a call here takes no time)."""
        assert self.pacer is not None
        async with self.pacer.call(name):
            self.calls[name] += 1
            self.times.setdefault(name, []).append(self.clock())

    @property
    def where(self) -> str:
        return "memory"

    def spacing(self, call: str) -> float:
        assert self.pacer is not None
        return self.pacer.spacing.get(call, 0.0)

    def live(self) -> list[MemInstance]:
        """Instances not destroyed: what would still be billing."""
        return [i for i in self.instances.values() if i.destroyed is None]

    async def credit(self) -> float | None:
        await self._call("credit")
        return self.credit_usd

    async def search_offers(self, query: OfferQuery) -> list[Offer]:
        await self._call("search")
        rented = {i.offer.id for i in self.live()}
        fit = [
            o for o in self.catalogue if o.id not in rented and (query.max_dph is None or o.dph_total <= query.max_dph)
        ]
        return sorted(fit, key=lambda o: o.dph_total)

    async def create_instance(
        self, offer_id: int, *, image: str, env: Mapping[str, str], label: str, disk_gb: float = 20.0
    ) -> int:
        await self._call("create")
        await asyncio.sleep(0)
        if offer_id in self.taken:
            raise OfferGone(f"offer {offer_id} was taken first", 410)
        offer = next(o for o in self.catalogue if o.id == offer_id)
        n = self._creates
        self._creates += 1
        boot = self.boot_s[min(n, len(self.boot_s) - 1)]
        pull = "Error response from daemon: manifest unknown" if n in self.pull_errors else ""
        inst = MemInstance(next(self._ids), offer, label, dict(env), self.clock(), boot, pull)
        self.instances[inst.id] = inst
        if n in self.lost_answers:
            raise ProviderError("no answer (the create's answer was lost)", 0)
        return inst.id

    def record(self, inst: MemInstance) -> Instance | None:
        """What the provider shows of ``inst`` now; None once it is gone."""
        now = self.clock()
        if inst.destroyed is not None:
            if now >= inst.destroyed + self.linger_s:
                return None
            return self._instance(inst, "running", "running", "unloaded", "unloaded", "destroying")
        if inst.exits_at is not None and now >= inst.exits_at:
            return self._instance(inst, "exited", "running", "stopped", "running", "its host died")
        if inst.pull_error:
            return self._instance(inst, "loading", "running", "running", "running", inst.pull_error)
        if inst.boot_s is None or now < inst.created + inst.boot_s:
            return self._instance(inst, "loading", "running", "running", "running", "Pulling image")
        return self._instance(inst, "running", "running", "running", "running", "success, running")

    def _instance(self, inst: MemInstance, actual: str, intended: str, cur: str, nxt: str, msg: str) -> Instance:
        return Instance(inst.id, inst.label, actual, intended, cur, nxt, msg, inst.created, {}, inst.offer, {})

    async def show_instance(self, instance_id: int) -> Instance | None:
        await self._call("show")
        await asyncio.sleep(0)
        inst = self.instances.get(instance_id)
        return None if inst is None else self.record(inst)

    async def list_instances(self, label_prefix: str | None = None) -> list[Instance]:
        await self._call("list")
        await asyncio.sleep(0)
        shown = [self.record(i) for i in self.instances.values() if i.label.startswith(label_prefix or "")]
        return [r for r in shown if r is not None]

    async def destroy_instance(self, instance_id: int) -> bool:
        await self._call("destroy")
        if self.hang_destroys:
            await self.clock.sleep(10_000)
        inst = self.instances.get(instance_id)
        if inst is None or self.record(inst) is None:
            return False
        if self.lost_destroys > 0:
            self.lost_destroys -= 1
            return True  # accepted, and forgotten: it still intends to run
        if inst.destroyed is None:
            inst.destroyed = self.clock()
        return True

    async def destroy_instances(self, instance_ids: Sequence[int]) -> None:
        await self._call("destroy_many")
        if self.bulk_refused:
            raise ProviderError("destroy of a list refused (bulk_refused)")
        if self.hang_destroys:
            await self.clock.sleep(10_000)
        for instance_id in instance_ids:
            inst = self.instances.get(instance_id)
            if inst is None or self.record(inst) is None:
                continue
            if self.lost_destroys > 0:
                self.lost_destroys -= 1
                continue  # accepted, and forgotten: it still intends to run
            if inst.destroyed is None:
                inst.destroyed = self.clock()

    async def request_logs(self, instance_id: int, tail: int) -> str:
        await self._call("logs")
        return "\n".join(f"line {n}" for n in range(tail))

    def secrets(self) -> list[str]:
        return []

    def calls_summary(self) -> dict[str, Any]:
        return {"calls": sum(self.calls.values()), "endpoints": dict(self.calls)}

    async def close(self) -> None:
        pass

"""The one way to set up a run: settings in, a place to rent out, and its deployments.

    async with await open_place(settings) as place:            # the emulator or vast.ai, the network
        async with place.deployment(on_phase=print_line) as dep:  # rent ... resolve, teardown
            ...

``pp-smoke-run`` and the pytest plugin (both through the driver, ``SmokeRun``) and the layout
grid (``layout/grid.py``, one place per network and a deployment per layout on it) all get their
deployments here, so a grid measures what a run would rent.

A place is one of three:
- the embedded emulator (local mode with no URL): started here, with its catalogue widened to
  the stage count, its runtime, its GPUs and its emulated network; behind an internet profile's
  home NAT, this process enters the home namespace before its endpoint binds;
- an emulator started apart (local mode with a URL), whose network (``--network``) must be the
  one asked for: the seed binds on its host address;
- vast.ai itself (``vastai`` mode), its creates paced at vast.ai's documented threshold.

This is the one module above ``cloud/`` that names a provider (vast.ai's client, the emulator):
the rest of the harness sees a :class:`~..cloud.provider.Provider`, and what the report needs of
the emulator comes through :meth:`Place.emulated_record`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..cloud import vastdoc
from ..cloud.emulator import NETWORK_PATH
from ..cloud.emulator.catalogue import widened
from ..cloud.preflight import image_check
from ..cloud.provider import OfferQuery, Provider
from ..cloud.vast import DEFAULT_URL, VastClient
from ..cloud.vastrecords import search_body
from ..protocol import Names, Phase, PhaseError
from ..runtime.resource import Resource
from .deployment import Deployment
from .runconfig import RunConfig
from .settings import REPLACE, Settings

if TYPE_CHECKING:
    from ..cloud.emulator.server import FakeVast
    from ..network import NetworkSpec

log = logging.getLogger(__name__)

OnPhase = Callable[[str, float, str], None]

# RunConfig's fields that the settings give under the same name; the settings whose value a lower
# record names otherwise, by the name each becomes there (the one table of these renames: a node's
# are runconfig.NODE_FIELDS); the rest are derived below (the transport, local or wan, follows from
# the mode and the emulated network; the reference's load and the weight cache from their "auto")
_SAME = {f.name for f in dataclasses.fields(RunConfig)} & {f.name for f in dataclasses.fields(Settings)}
RUN_FIELDS = {"disk": "disk_gb"}
QUERY_FIELDS = {
    "gpu_ram": "gpu_ram_gb",
    "max_price": "max_dph",
    "min_reliability": "min_reliability",
    "min_cuda": "min_cuda",
    "disk": "disk_gb",
}


def reference_load(s: Settings) -> str:
    """Stage 0's ``PP_REFERENCE``: ``auto`` is beside on GPUs (vast.ai's, or this machine's with
    ``--gpus``) and after on this machine's CPU, where a reference worker loading beside the
    stages takes the cores they load on; a run that asks for no reference has no worker load it
    beside the stages."""
    if not s.reference:
        return "after"
    if s.reference_load == "auto":
        return "beside" if not s.local or s.gpus else "after"
    return s.reference_load


def weight_cache(s: Settings) -> str:
    """The nodes' ``PP_WEIGHT_CACHE``: ``auto`` is their default directory on this machine and off
    on vast.ai, where every instance is new: a cache written there is never read, and writing it
    was most of a cold stage's load (docs/benchmarks.md)."""
    if s.weight_cache == "auto":
        return "" if s.local else "off"
    return s.weight_cache


def run_config(s: Settings, names: Names | None = None) -> RunConfig:
    """The deployment's config from the settings: each field of the same name or of the tables
    (:data:`RUN_FIELDS`, :data:`QUERY_FIELDS`), then the derived ones."""
    return RunConfig(
        **{name: getattr(s, name) for name in sorted(_SAME - {"reference_load", "weight_cache"})},
        **{field: getattr(s, name) for name, field in RUN_FIELDS.items()},
        weight_cache=weight_cache(s),
        reference_load=reference_load(s),
        query=OfferQuery(**{field: getattr(s, name) for name, field in QUERY_FIELDS.items()}),
        # an emulated internet (behind NATs) runs the transport's internet mode, as on vast.ai
        transport="local" if s.local and not internet(s.network) else "wan",
        check_image=image_check(s.image, vastai=not s.local),
        names=names or Names(),
        replacement=dataclasses.replace(REPLACE, on=s.replace_hosts, host_deadline=s.host_deadline),
    )


def internet(network: str) -> bool:
    """Whether an emulated network is an internet profile (NATs, the transport's internet mode)."""
    from ..network.profiles import NAT_PROFILES

    return network.split(";", 1)[0].strip() in NAT_PROFILES


def rtt_of(spec: NetworkSpec) -> float:
    """The worst round trip of a network's links, in seconds."""
    links = [p for p in (spec.default, *spec.overrides.values()) if p is not None]
    return max((2 * (p.delay_ms + p.jitter_ms) for p in links), default=0.0) / 1000


async def emulated_network(url: str, key: str, spec: str, names: Names) -> dict[str, str]:
    """The emulated network of the emulator at ``url`` (its own ``/ppsmoke/network``), which
    must be the one asked for: its description and the host address the orchestrator binds."""
    import aiohttp

    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
            http.get(url.rstrip("/") + NETWORK_PATH, headers=headers) as resp,
        ):
            status, body = resp.status, await resp.text()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise PhaseError(Phase.RENT, f"could not ask the emulator at {url} for its network: {e}") from None
    if status != 200:
        raise PhaseError(
            Phase.RENT,
            f"{names.setting('network')} {spec!r}: the emulator at {url} has no emulated network (HTTP {status}); "
            f"start it with pp-fake-vast --network {spec}",
        )
    found = json.loads(body)
    if found.get("spec") != spec:
        raise PhaseError(
            Phase.RENT, f"{names.setting('network')} {spec!r}: the emulator at {url} emulates {found.get('spec')!r}"
        )
    return {k: str(found[k]) for k in ("spec", "host_addr", "subnet")}


@dataclass
class Emulated:
    """What the embedded emulator saw of a run, for the report: its own record (``emulator``:
    ``live_instances``, ``destroyed_instances``, ``host_losses``) and its network's counts per link
    (``network_stats``, None without an emulated network)."""

    emulator: dict[str, Any]
    network_stats: dict[str, Any] | None = None


@dataclass
class Place(Resource):
    """Where a run rents: a provider (vast.ai's API: vast.ai, or an emulator) and the network
    between its instances. ``config`` is the run's config bound to that network (the seed's
    address, SWIM's round trip); :meth:`deployment` makes one on it. Closing it closes the
    provider's client, then the embedded emulator, if any."""

    provider: Provider
    config: RunConfig
    url: str
    fake: FakeVast | None = None
    network: dict[str, Any] | None = None  # the emulated network, as the report gives it

    def deployment(self, on_phase: OnPhase | None = None, **changes: Any) -> Deployment:
        """A deployment on this place, of its config with ``changes`` (a grid's layout)."""
        config = dataclasses.replace(self.config, **changes) if changes else self.config
        return Deployment(self.provider, config, on_phase=on_phase)

    async def emulated_record(self) -> Emulated | None:
        """What the embedded emulator saw (its instances, its host losses, its network's counts),
        taken before it closes; None where the run rents from anything else. A network whose
        counts cannot be read gives None for them."""
        fake = self.fake
        if fake is None:
            return None
        stats = None
        if fake.network is not None:
            try:
                stats = await fake.network.stats()
            except Exception:  # the counts are the report's; the run's outcome is not theirs
                log.debug("the emulated network's counts could not be read", exc_info=True)
        record: dict[str, Any] = {
            "live_instances": [i.id for i in fake.live()],
            "destroyed_instances": [i.id for i in fake.destroyed],
            "host_losses": list(fake.host_losses),
        }
        return Emulated(record, stats)

    async def start(self) -> None:
        """Made started by :func:`open_place`."""

    async def close(self) -> None:
        try:
            await self.provider.close()
        finally:
            if self.fake is not None:
                await self.fake.close()


async def open_place(
    s: Settings,
    *,
    network: str | None = None,
    stages: int | None = None,
    deadline: float | None = None,
    names: Names | None = None,
) -> Place:
    """The place ``s`` rents out, started: on the embedded emulator ``network`` (default: the
    settings') is the one it emulates and ``stages`` (default: the settings') the most stages
    its catalogue must offer; ``deadline`` (monotonic) is the client's: no retry waits past it;
    ``names``: how the face names a setting in a failure's advice."""
    names = names or Names()
    config = run_config(s, names)
    network = s.network if network is None else network
    if s.embedded_emulator:
        return await _embedded(s, config, network, stages or s.num_stages, deadline)
    url, key = s.vast_url or DEFAULT_URL, s.api_key
    found: dict[str, Any] | None = None
    if s.local and internet(network):
        raise PhaseError(
            Phase.RENT,
            f"{names.setting('network')} {network!r} puts this process behind the emulated home NAT, which only the "
            "embedded emulator can do: run pp-smoke-run --local --network ... without --vast-url",
        )
    if s.local and network != "loopback":  # an emulator started apart, with its network
        found = await emulated_network(url, key, network, names)
        from ..network import parse_network  # the network package loads only for a network

        config.bind, config.rtt = f"{found['host_addr']}:0", rtt_of(parse_network(found["spec"]))
    # vast.ai's documented limits pace every endpoint from the first call: vast.ai itself at its own
    # seconds; an emulator started apart at the time scale both sides read (PP_VAST_TIME_SCALE)
    vast = VastClient(key, url, pace=vastdoc.pace(scale=None if s.local else 1.0))
    vast.deadline = deadline
    return Place(vast, config, url, network=found)


def provider_for(s: Settings) -> Provider:
    """The provider the settings name, for a call outside a run (the reap): vast.ai's API at the
    settings' URL (vast.ai itself, or an emulator started apart). The caller closes it."""
    return VastClient(s.api_key, s.vast_url or DEFAULT_URL)


async def _embedded(s: Settings, config: RunConfig, network: str, stages: int, deadline: float | None) -> Place:
    gpus = [g for g in s.gpus.split(",") if g] or None
    # the catalogue widened to the stage count where the query takes fewer (catalogue.widened)
    offers = widened(stages, search_body(config.query))
    from ..cloud.emulator.server import FakeVast  # aiohttp's server, the API's description: only when embedded

    fake = FakeVast(gpus=gpus, runtime=s.runtime, network=network, catalogue=offers)
    await fake.start()
    try:
        url, report = fake.url, None
        net = fake.network
        if net is not None and net.home_netns is not None:
            # the internet: this process goes behind the home NAT, before its endpoint binds, and
            # reaches the API as it reaches anything, through it; SWIM timed for the worst link
            net.enter_home()
            url, config.rtt = fake.node_url, rtt_of(net.spec)
            report = {
                "spec": net.spec.name, "public_addr": net.host_addr, "home_addr": net.home_addr,
                "subnet": net.subnet, "prefix": net.prefix,
            }  # fmt: skip
        elif net is not None:  # the seed on the network's host address, SWIM timed for its worst link
            config.bind, config.rtt = f"{net.host_addr}:0", rtt_of(net.spec)
            report = {
                "spec": net.spec.name, "host_addr": net.host_addr, "subnet": net.subnet, "prefix": net.prefix,
            }  # fmt: skip
        # the emulator's own limits (the documented table at the time scale, or a test's failpoint)
        # pace the client from the first call: one table for both sides
        pace = {
            k: (r.requests, r.window) if r.requests else (1, r.threshold)
            for k, r in fake.limiter.limits.items()
            if r.threshold or r.requests
        }
        vast = VastClient(fake.api_key, url, pace=pace)
        vast.deadline = deadline
    except BaseException:
        await fake.close()
        raise
    return Place(vast, config, url, fake=fake, network=report)

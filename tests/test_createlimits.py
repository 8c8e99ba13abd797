"""What a create may carry (``cloud/createlimits.py``): the limits vast.ai documents, read from the
vendored description; every stage count's create bodies fit them; a body over one is refused
before it is sent, naming the field and the lengths, never a value."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pytest_ppsmoke import nodeenv
from pytest_ppsmoke.cloud import createlimits
from pytest_ppsmoke.cloud.emulator.server import FakeVast
from pytest_ppsmoke.cloud.vast import VastClient, create_body
from pytest_ppsmoke.cloud.vastrecords import OfferQuery
from pytest_ppsmoke.harness.deployment import Deployment
from pytest_ppsmoke.harness.runconfig import RunConfig, swim_for_rtt
from pytest_ppsmoke.protocol import LEAST_DISK_GB
from pytest_ppsmoke.stage.catalog import MODELS

from .helpers import SLEEPER
from .memprovider import MemProvider, VirtualClock, offers

pytestmark = pytest.mark.local

# a loopback ticket as long as a seed's: its id and a few addresses
TICKET = "ticket:" + "ab" * 32 + "@127.0.0.1:40000,[::1]:40000,10.231.0.1:40000"


def test_the_limits_are_read_from_the_vendored_description() -> None:
    lim = createlimits.limits()
    assert (lim.image_max, lim.args_max, lim.label_max) == (1024, 4096, 256)
    assert (lim.env_value_max, lim.env_total_max, lim.disk_min) == (256, 32768, 8.0)
    assert lim.env_value_max == nodeenv.VALUE_MAX  # what NodeEnv splits its long lists at
    assert lim.disk_min == LEAST_DISK_GB  # what the settings refuse less than, up front
    assert OfferQuery().disk_gb >= lim.disk_min  # the client's default disk


BIGGEST = max(MODELS, key=lambda m: m.blocks)  # the most stages any catalogue model takes (a stage a block)


def _stage_counts() -> list[int]:
    """2..8, and the most the catalogue's models take."""
    return [*range(2, 9), BIGGEST.blocks]


@pytest.mark.parametrize("transport", ["wan", "local"])
@pytest.mark.parametrize("num_stages", _stage_counts())
async def test_every_stage_counts_create_bodies_fit_every_documented_limit(num_stages: int, transport: str) -> None:
    """Each stage's create, as the run builds it (``Deployment._env`` through ``Rental.rent``, the
    forwarded port's key beside it on wan), and as the client sends it (``create_body``)."""
    clock = VirtualClock()
    provider = MemProvider(clock, catalogue=offers(num_stages))
    config = RunConfig(
        num_stages=num_stages,
        model=BIGGEST.name,
        transport=transport,
        check_image="not asked",
        reference_load="beside",
        rtt=0.3333,
        query=OfferQuery(max_dph=None),  # the in-memory offers' prices rise with their number
    )
    dep = Deployment(provider, config, clock=clock, sleep=clock.sleep)
    dep.seed = SimpleNamespace(id=dep.keys.ids[0], ticket=lambda: TICKET)  # type: ignore[assignment]
    found = await dep.rental.check()
    for stage in range(num_stages):
        await dep.rental.rent(stage, dep._env(stage, dep.keys.keys[1 + stage]), found, dep.keys.ids[1 + stage])
    assert len(provider.instances) == num_stages
    for inst in provider.instances.values():
        body = create_body(image=config.image, env=inst.env, label=inst.label, disk_gb=config.disk_gb)
        assert createlimits.problems(body) == [], (num_stages, transport)
        read = nodeenv.NodeEnv.from_env(inst.env)  # every id the orchestrator chose, and no other
        assert read.allowed_ids == tuple(dep.keys.ids)


@pytest.mark.parametrize("rtt", [0.0, 0.0123456789, 0.31234567, 1.7777777, 12.345678901])
def test_the_swim_timing_a_node_is_given_fits_one_env_value_for_any_round_trip(rtt: float) -> None:
    """``PP_SWIM`` carries the timing the orchestrator chose from the measured round trips: its
    floats are written to a tenth of a millisecond, never with a float's noise digits, so that
    the value stays under vast.ai's 256 characters whatever the round trip, and a node reads back
    exactly the orchestrator's timing."""
    swim = swim_for_rtt(rtt)
    value = swim.to_env()
    assert len(value) <= createlimits.limits().env_value_max, value
    decimals = [v.partition(".")[2] for _, _, v in (item.partition("=") for item in value.split(","))]
    assert all(len(d) <= 4 for d in decimals), value
    assert type(swim).wan().with_overrides(value) == swim


def test_a_body_over_a_limit_is_named_by_field_and_length_never_by_value() -> None:
    secret = "k" * 300
    env = {"PP_NODE_KEY": secret, **{f"V{n}": "x" * 250 for n in range(140)}}
    body = create_body(image="i" * 1025, env=env, label="l" * 257, disk_gb=4.0, onstart="o" * 4097)
    lines = createlimits.problems(body)
    assert lines == [
        "image is 1025 characters, at most 1024 expected",
        "args, args_str and onstart are 4097 characters together, at most 4096 expected",
        "label is 257 characters, at most 256 expected",
        "env PP_NODE_KEY's value is 300 characters, at most 256 expected",
        f"env is {len(createlimits.env_flags(env))} characters in all (as -e K=V flags), at most 32768 expected",
        "disk is 4.0 GB, at least 8 GB expected",
    ]
    with pytest.raises(createlimits.OverLimit) as e:
        createlimits.check(body)
    assert secret not in str(e.value) and e.value.status == 400
    assert str(e.value).startswith("not sent: it breaks vast.ai's documented limits for a create: image is 1025")
    # the flag string, as vast-cli's parse_env reads it back: a port's key as it stands
    assert createlimits.env_flags({"A": "1", "-p 7000:7000/udp": "1"}) == "-e A=1 -p 7000:7000/udp"


async def test_the_client_refuses_a_create_over_a_limit_without_sending_it() -> None:
    async with FakeVast(node_argv=SLEEPER) as fake, VastClient(fake.api_key, fake.url) as vast:
        offer = (await vast.search_offers(OfferQuery()))[0]
        with pytest.raises(createlimits.OverLimit, match="disk is 4 GB, at least 8 GB expected"):
            await vast.create_instance(offer.id, image="i", env={}, label="ppsmoke-x-stage0", disk_gb=4)
        assert not any(method == "PUT" for method, _, _ in fake.requests) and fake.live() == []

"""The emulator's vast.ai misbehaviour, each behind its failpoint: rate limits, offers raced away,
lingering and ignored destroys, hosts that die; and the official ``vastai`` SDK and CLI meeting
its 429s. The answers are checked raw (status, body, headers) where they are the point."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import requests
from vastai import VastAI

from pytest_ppsmoke import failpoints
from pytest_ppsmoke.cloud.emulator import apidoc
from pytest_ppsmoke.cloud.emulator.faults import RateLimiter
from pytest_ppsmoke.cloud.emulator.instances import Instance
from pytest_ppsmoke.cloud.emulator.server import FakeVast

from .helpers import SLEEPER, process_state, stripped
from .test_vast import KEY, vastai

pytestmark = pytest.mark.local

# a stand-in node that samples one token (what the host-loss watcher waits for) and ignores SIGTERM,
# so that only a kill without grace ends it quickly
TOKENER = [
    sys.executable,
    "-c",
    "import json, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print(json.dumps({'event': 'token', 'n': 1}), flush=True); time.sleep(600)",
]


@pytest_asyncio.fixture
async def fake(request: pytest.FixtureRequest) -> AsyncIterator[FakeVast]:
    faults, argv = getattr(request, "param", ("", SLEEPER))
    # raw calls, one right after another, each checked for its answer: vast.ai's rate limits (on by
    # default) are off here unless a test names them; they have tests of their own
    limits = "" if "vast.rate_limit" in faults else "vast.rate_limit=off;"
    async with FakeVast(api_key=KEY, faults=f"vast.boot_delay=0;{limits}{faults}", node_argv=argv) as vast:
        yield vast
    assert not vast.live()


async def call(
    fake: FakeVast, method: str, path: str, body: Any = None, key: str = KEY
) -> tuple[int, Any, Mapping[str, str]]:
    """One raw call: status, body (JSON if it is, else its text), headers."""
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as s, s.request(method, fake.url + path, json=body, headers=headers) as r:
        text = await r.text()
        try:
            data = json.loads(text)
        except ValueError:
            data = text
        return r.status, data, r.headers


async def search(fake: FakeVast) -> list[int]:
    status, data, _ = await call(fake, "POST", "/api/v0/bundles/", {"rentable": {"eq": True}, "num_gpus": {"eq": 1}})
    assert status == 200, data
    return [o["id"] for o in data["offers"]]


async def create(fake: FakeVast, offer: int, stage: int = 0) -> tuple[int, Any]:
    body = {"image": "img:1", "env": {"STAGE": str(stage)}, "label": f"t-stage{stage}", "disk": 10}
    status, data, _ = await call(fake, "PUT", f"/api/v0/asks/{offer}/", body)
    return status, data


async def show(fake: FakeVast, iid: int) -> Any:
    """The instance's record, its strings stripped."""
    status, data, _ = await call(fake, "GET", f"/api/v0/instances/{iid}/")
    assert status == 200, data
    return stripped(data["instances"])


async def until(what: str, check: Any, seconds: float = 10) -> None:
    """Poll ``check()`` (sync or async) until it is true; fail naming ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not ((await r) if asyncio.iscoroutine(r := check()) else r):
        assert time.monotonic() < deadline, f"not {what} after {seconds} s"
        await asyncio.sleep(0.02)


def states(rec: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(rec[k] for k in ("actual_status", "intended_status", "cur_state", "next_state"))


async def test_rate_limits_per_endpoint_and_identity_with_a_penalty(fake: FakeVast) -> None:
    now = [100.0]  # the limiter's clock, moved by hand
    fake.faults = failpoints.parse(f"{fake.faults};vast.rate_limit=documented")
    # the documented table at vast.ai's own seconds (the suite's emulators run it scaled down)
    fake.limiter = RateLimiter(fake.faults.value("vast.rate_limit"), clock=lambda: now[0], scale=1)
    offers = await search(fake)
    assert (await create(fake, offers[0]))[0] == 200  # t=0
    now[0] += 1
    status, text, headers = await call(fake, "PUT", f"/api/v0/asks/{offers[1]}/", {"image": "i"})
    # vast.ai's documented 4.5 s, in the body create_instance.yaml documents for a 429
    assert (status, text) == (429, {"detail": "API requests too frequent endpoint threshold=4.5"})
    assert headers["Content-Type"].startswith("application/json") and "Retry-After" not in headers
    now[0] += 6  # past the threshold, inside the 12 s penalty (counted from the refusal)
    assert (await create(fake, offers[1]))[0] == 429
    assert await search(fake) == offers[1:]  # another endpoint (its own limit: 10 a minute) is not held back
    now[0] += 6.1  # the penalty is over (refusals did not extend it)
    status, data = await create(fake, offers[1])
    assert status == 200, data
    a, b = list(fake.instances)
    assert (await call(fake, "GET", f"/api/v0/instances/{a}/"))[0] == 200  # show: 2 s, no penalty
    status, text, _ = await call(fake, "GET", f"/api/v0/instances/{a}/")
    assert (status, text) == (429, {"detail": "API requests too frequent endpoint threshold=2"})
    # a container's key is another identity: its own show goes through while the account's is refused
    assert (await call(fake, "GET", f"/api/v0/instances/{a}/", key=fake.instances[a].container_key))[0] == 200
    now[0] += 2
    assert (await call(fake, "GET", f"/api/v0/instances/{b}/"))[0] == 200
    assert fake.limiter.refused == {"create": 2, "show": 1}
    assert (await call(fake, "DELETE", f"/api/v0/instances/{a}/"))[0] == 200
    status, text, _ = await call(fake, "DELETE", f"/api/v0/instances/{b}/")  # destroy: 3 s, no penalty
    assert (status, text) == (429, {"detail": "API requests too frequent endpoint threshold=3"})
    now[0] += 3
    assert (await call(fake, "DELETE", f"/api/v0/instances/{b}/"))[0] == 200
    assert fake.limiter.refused == {"create": 2, "show": 1, "destroy": 1}


def taken(status: int, offer: int) -> tuple[int, dict[str, Any]]:
    """create_instance.yaml's answer for a taken offer: its examples, the offer's id for 1234567."""
    msg = {
        404: f"error 404/3603: no_such_ask Instance type by id {offer} is not available.",
        410: f"error 410/3907: no_such_ask Instance type {offer} is no longer available.",
    }[status]
    error = "invalid_args" if status == 404 else "no_such_ask"
    return status, {"success": False, "error": error, "msg": msg, "ask_id": offer}


@pytest.mark.parametrize("fake", [("vast.race_offers=1:410,3:404", SLEEPER)], indirect=True)
async def test_offers_raced_away_answer_no_such_ask_and_stay_taken(fake: FakeVast) -> None:
    offers = await search(fake)
    assert await create(fake, offers[0]) == taken(410, offers[0])
    assert await search(fake) == offers[1:]  # someone else has it
    status, data = await create(fake, offers[1])
    assert status == 200 and data["success"] is True, data
    assert await create(fake, offers[2]) == taken(404, offers[2])
    assert await search(fake) == offers[3:]
    assert await create(fake, offers[0]) == taken(404, offers[0])  # the raced offer stays rented, as vast.ai says
    assert [i.offer["id"] for i in fake.live()] == [offers[1]]  # no instance for a raced create
    assert (await call(fake, "DELETE", f"/api/v0/instances/{data['new_contract']}/"))[0] == 200
    assert await search(fake) == [offers[1], *offers[3:]]  # ours is back, the raced ones are not


@pytest.mark.parametrize("fake", [("vast.destroy_linger=60", SLEEPER)], indirect=True)
async def test_a_destroyed_instance_lingers_going_away_then_is_gone(fake: FakeVast) -> None:
    offer = (await search(fake))[0]
    iid = (await create(fake, offer))[1]["new_contract"]
    await until("running", lambda: fake.instances[iid].actual_status == "running")
    assert states(await show(fake, iid)) == ("running", "running", "running", "running")
    inst = fake.instances[iid]
    asked = time.monotonic()
    assert (await call(fake, "DELETE", f"/api/v0/instances/{iid}/"))[:2] == (200, {"success": True})
    answered = time.monotonic()
    assert fake.live() == [] and fake.destroyed == [inst]  # destroyed, though still listed
    # released on destroy: cur_state and next_state unloaded; still intended running (a destroy is
    # not a stop), and running as last seen until its container is stopped
    rec = await show(fake, iid)
    assert rec["cur_state"] == "unloaded" and rec["next_state"] == "unloaded", rec
    assert rec["intended_status"] == "running" and rec["actual_status"] in ("running", "exited"), rec
    await until("stopped", lambda: inst.proc is not None and inst.proc.proc is not None and inst.proc.proc.returncode)
    rec = await show(fake, iid)
    assert states(rec) == ("exited", "running", "unloaded", "unloaded") and "destroyed" in rec["status_msg"]
    v1 = stripped((await call(fake, "GET", "/api/v1/instances/"))[1])
    assert [states(r) for r in v1["instances"]] == [states(rec)]
    assert [r["id"] for r in v1["instances"]] == [iid] and v1["total_instances"] == 1
    assert (await call(fake, "DELETE", f"/api/v0/instances/{iid}/"))[:2] == (200, {"success": True})  # again
    assert offer not in await search(fake)  # its machine is not free yet
    assert asked + 60 <= inst.linger_until <= answered + 60  # the knob's seconds from the destroy (the first)
    inst.linger_until = 0.0  # its time is up
    assert await show(fake, iid) is None
    assert (await call(fake, "GET", "/api/v1/instances/"))[1]["instances"] == []
    assert offer in await search(fake)
    gone = (404, {"success": False, "error": "not_found", "msg": "Instance not found"})
    assert (await call(fake, "DELETE", f"/api/v0/instances/{iid}/"))[:2] == gone
    assert (await call(fake, "DELETE", "/api/v0/instances/77/"))[:2] == gone
    label_gone = {"success": False, "error": "no_such_instance", "msg": f"Instance {iid} not found."}
    assert (await call(fake, "PUT", f"/api/v0/instances/{iid}/", {"label": "x"}))[:2] == (404, label_gone)


@pytest.mark.parametrize("fake", [("vast.destroy_ignored=1:2", SLEEPER)], indirect=True)
async def test_ignored_destroys_answer_success_and_do_nothing(fake: FakeVast) -> None:
    offers = await search(fake)
    zero, one = [(await create(fake, o, stage))[1]["new_contract"] for stage, o in enumerate(offers[:2])]
    await until("running", lambda: all(i.actual_status == "running" for i in fake.live()))
    for _ in range(2):
        assert (await call(fake, "DELETE", f"/api/v0/instances/{one}/"))[:2] == (200, {"success": True})
        assert states(await show(fake, one)) == ("running", "running", "running", "running")
        assert one in fake.instances
    assert (await call(fake, "DELETE", f"/api/v0/instances/{zero}/"))[0] == 200  # another stage: done at once
    assert (await call(fake, "DELETE", f"/api/v0/instances/{one}/"))[0] == 200  # the third: done
    assert fake.live() == [] and await show(fake, one) is None


def proc_state(inst: Instance) -> str:
    """The process's state letter in /proc (T: stopped); "gone" once it is reaped; "not started"
    before its process is spawned (the instance holds its ChildProcess from the create on)."""
    assert inst.proc is not None
    if inst.proc.proc is None:
        return "not started"
    return process_state(inst.proc.pid)  # "gone" also while the kernel tears the process down


@pytest.mark.parametrize(
    "fake", [("vast.lose_host=0:exited,1:offline;vast.kill_after_tokens=1", TOKENER)], indirect=True
)
async def test_lost_hosts_go_offline_frozen_or_exited_killed(fake: FakeVast) -> None:
    offers = await search(fake)
    ids = [(await create(fake, o, stage))[1]["new_contract"] for stage, o in enumerate(offers[:2])]
    exited, offline = (fake.instances[i] for i in ids)
    await until("offline", lambda: offline.actual_status == "offline")
    await until("frozen", lambda: proc_state(offline) == "T")
    rec = await show(fake, offline.id)
    assert states(rec) == ("offline", "running", "running", "running")
    assert rec["status_msg"] == f"host {offline.offer['machine_id']} stopped answering (no heartbeat)"
    assert exited.boot is not None
    await until("exited, its boot task done", lambda: exited.boot is not None and exited.boot.done())
    rec = await show(fake, exited.id)  # the process's end did not overwrite what the host's death said
    assert states(rec) == ("exited", "running", "stopped", "running")
    assert rec["status_msg"] == f"host {exited.offer['machine_id']} failed: its container was lost"
    assert proc_state(exited) == "gone"
    # the frozen node ignores SIGTERM: a lost host's node is stopped with no grace (killed at
    # once); a live one gets its 5 s
    graces: dict[int, float] = {}
    stop = fake.runs.stop

    async def recorded(inst: Instance, grace: float) -> None:
        graces[inst.id] = grace
        await stop(inst, grace)

    fake.runs.stop = recorded  # type: ignore[method-assign]
    for iid in ids:
        assert (await call(fake, "DELETE", f"/api/v0/instances/{iid}/"))[0] == 200
    await until("killed", lambda: proc_state(offline) == "gone")
    assert graces.get(offline.id) == 0.0, graces


@pytest.mark.parametrize(
    "fake", [("vast.kill_stage=0;vast.kill_after_tokens=1;vast.status_lag=600", TOKENER)], indirect=True
)
async def test_a_killed_node_with_a_lagging_record_still_shows_running_and_its_kill_is_recorded(
    fake: FakeVast,
) -> None:
    [offer] = (await search(fake))[:1]
    iid = (await create(fake, offer, 0))[1]["new_contract"]
    inst = fake.instances[iid]
    await until("killed and reaped", lambda: inst.proc is not None and proc_state(inst) == "gone")
    rec = await show(fake, iid)  # the node is gone; its host has not said so yet
    assert rec["actual_status"] == "running", states(rec)
    [loss] = fake.host_losses
    assert (loss["instance"], loss["stage"], loss["how"], loss["after_tokens"]) == (iid, 0, "killed", 1), loss
    assert (await call(fake, "DELETE", f"/api/v0/instances/{iid}/"))[0] == 200


# --- the official vastai SDK and CLI -----------------------------------------------------------


@pytest.mark.parametrize("fake", [("vast.rate_limit=create:1:2.5,show:1:2.5", SLEEPER)], indirect=True)
async def test_the_vastai_sdk_and_cli_against_the_emulator_and_its_429s(fake: FakeVast, tmp_path: Path) -> None:
    sdk = VastAI(api_key=KEY, server_url=fake.url)  # its default: 3 tries, 0.15 s apart growing x1.5
    patient = VastAI(api_key=KEY, server_url=fake.url, retry=8)  # 4.8 s of waits in all
    # GPU RAM: the SDK and CLI take GB (x1000), the REST answer is MB
    offers = await asyncio.to_thread(
        sdk.search_offers, "gpu_ram>=24.57 gpu_ram<30 num_gpus=1 reliability>0.99", order="dph+"
    )
    assert [(o["gpu_name"].strip(), o["gpu_ram"]) for o in offers] == [("RTX 3090", 24576)]
    offers = await asyncio.to_thread(sdk.search_offers, "gpu_ram>=16 num_gpus=1 reliability>0.99", order="dph+")
    assert [o["gpu_name"].strip() for o in offers] == [
        "RTX 5090", "B200", "RTX 3090", "RTX 4090", "RTX A6000", "L40S", "A100 SXM4", "H100 SXM"
    ]  # fmt: skip
    assert [o["dph_total"] for o in offers] == sorted(o["dph_total"] for o in offers)
    # the limiter's clock stands still (a slow machine cannot outlast a penalty by accident), and
    # moves past the penalty only once a patient client has been refused once
    now = [0.0]
    fake.limiter = RateLimiter(fake.faults.value("vast.rate_limit"), clock=lambda: now[0])
    refused = fake.limiter.refused

    async def thaw(endpoint: str, refusals: int) -> None:
        while refused.get(endpoint, 0) < refusals:
            await asyncio.sleep(0.01)
        now[0] += 10

    made = await asyncio.to_thread(sdk.create_instance, offers[0]["id"], image="img:1", env={"STAGE": "0"}, label="sdk")
    assert made["success"] is True
    a = made["new_contract"]
    shown = stripped(await asyncio.to_thread(sdk.show_instance, a))  # this SDK leaves vast.ai's padding
    env = {k.strip(): v for k, v in shown["extra_env"].items()}  # it made the padded pairs a dict
    assert shown["label"] == "sdk" and shown["gpu_ram"] == offers[0]["gpu_ram"] and env == {"STAGE": "0"}

    with pytest.raises(requests.HTTPError) as info:  # the second create, at once: refused 3 times
        await asyncio.to_thread(sdk.create_instance, offers[1]["id"], image="img:1", label="sdk")
    assert info.value.response.status_code == 429 and refused["create"] == 3
    assert info.value.response.json() == {"detail": "API requests too frequent endpoint threshold=1"}
    thawing = asyncio.ensure_future(thaw("create", 4))
    made = await asyncio.to_thread(patient.create_instance, offers[1]["id"], image="img:1", label="sdk")
    await thawing
    assert made["success"] is True  # it outlasted the penalty
    b = int(made["new_contract"])

    assert (await call(fake, "GET", f"/api/v0/instances/{a}/"))[0] == 200  # the clock moved: a fresh interval
    assert (await call(fake, "GET", f"/api/v0/instances/{a}/"))[0] == 429  # ... and at once: the penalty
    shows = refused["show"]
    out = await asyncio.to_thread(vastai, fake.url, tmp_path, "show", "instance", str(a), "--raw")
    assert out.stdout == "" and json.loads(out.stderr) == {  # (its exit status is 0 all the same)
        "error": True,
        "status_code": 429,
        "msg": None,  # what it makes of the documented body ({"detail": ...}: it reads "msg")
    }
    assert refused["show"] == shows + 3
    thawing = asyncio.ensure_future(thaw("show", shows + 4))
    out = await asyncio.to_thread(vastai, fake.url, tmp_path, "show", "instance", str(a), "--raw", "--retry", "8")
    await thawing
    assert out.returncode == 0 and json.loads(out.stdout)["label"].strip() == "sdk", out.stderr
    assert fake.instances[b].label == "sdk"
    for iid in (a, b):
        assert (await asyncio.to_thread(sdk.destroy_instance, iid))["success"] is True
    assert fake.live() == []
    with pytest.raises(requests.HTTPError) as info:
        await asyncio.to_thread(sdk.destroy_instance, a)
    assert info.value.response.status_code == 404 and info.value.response.json()["error"] == "not_found"


CREATE_LIMITS = apidoc.input_limits("PUT /api/v0/asks/{id}/")  # create_instance.yaml's x-input-validation


def over(field: str) -> dict[str, Any]:
    """A create's body over one of create_instance.yaml's input limits, by the limit as read."""
    lim = CREATE_LIMITS[field.split(":")[0]]
    if field == "image":
        return {"image": "i" * (lim["max_length"] + 1)}
    if field == "args":  # args, args_str and onstart together
        third = lim["max_length"] // 3 + 1
        return {"args": ["a" * third], "args_str": "s" * third, "onstart": "o" * third}
    if field == "label":
        return {"label": "l" * (lim["max_length"] + 1)}
    if field == "env:value":
        return {"env": {"STAGE": "0", "LONG": "v" * (lim["max_length"] + 1)}}
    if field == "env:total":  # every value within its limit, the flags together over theirs
        n = lim["max_total_length"] // lim["max_length"] + 1
        return {"env": {f"V{i}": "v" * lim["max_length"] for i in range(n)}}
    if field == "price:min":
        return {"price": lim["min"] / 2}
    if field == "price:max":
        return {"price": lim["max"] * 2}
    assert field == "disk"
    return {"disk": lim["min"] / 2}


@pytest.mark.parametrize(
    "field", ["image", "args", "label", "env:value", "env:total", "price:min", "price:max", "disk"]
)
async def test_a_create_over_an_input_limit_is_refused_400_as_vast_ai_describes(fake: FakeVast, field: str) -> None:
    """create_instance.yaml's ``x-input-validation`` (read from the file): a create over any limit
    is refused by default with its described 400 (``invalid_price`` for a price, ``invalid_args``
    otherwise; the ask id), naming the field and the limit, never the value; nothing is rented."""
    offer = (await search(fake))[0]
    body = {"image": "img:1", "env": {"STAGE": "0"}, "label": "t", "disk": 10, **over(field)}
    status, data, _ = await call(fake, "PUT", f"/api/v0/asks/{offer}/", body)
    name = field.split(":")[0]
    assert status == 400 and data["success"] is False and data["ask_id"] == offer, data
    assert data["error"] == ("invalid_price" if name == "price" else "invalid_args")
    assert data["msg"].startswith(f"Invalid args: over the input limits: {name}: "), data
    assert "vvvvvvvv" not in data["msg"] and "llllllll" not in data["msg"]  # no value shown
    assert fake.live() == [] and offer in await search(fake)
    # within every limit (the limits' own edges), the same create rents
    edge = {
        "image": "i" * CREATE_LIMITS["image"]["max_length"],
        "label": "l" * CREATE_LIMITS["label"]["max_length"],
        "env": {"STAGE": "0", "LONG": "v" * CREATE_LIMITS["env"]["max_length"]},
        "onstart": "o" * CREATE_LIMITS["args"]["max_length"],
        "price": CREATE_LIMITS["price"]["max"],
        "disk": CREATE_LIMITS["disk"]["min"],
    }
    status, data, _ = await call(fake, "PUT", f"/api/v0/asks/{offer}/", edge)
    assert status == 200 and data["success"] is True, data
    assert (await call(fake, "DELETE", f"/api/v0/instances/{data['new_contract']}/"))[0] == 200


async def test_a_label_over_label_instances_limit_is_refused_label_too_long(fake: FakeVast) -> None:
    """label_instance.yaml's ``x-input-validation``: a label over its max_length is refused with
    the described 400 ``label_too_long`` and its example's words; the label stays as it was."""
    limit = apidoc.input_limits("PUT /api/v0/instances/{id}/")["label"]["max_length"]
    iid = (await create(fake, (await search(fake))[0]))[1]["new_contract"]
    status, data, _ = await call(fake, "PUT", f"/api/v0/instances/{iid}/", {"label": "l" * (limit + 1)})
    described = apidoc.error_schema("PUT /api/v0/instances/{id}/", 400)["msg"]["example"]
    assert (status, data) == (400, {"success": False, "error": "label_too_long", "msg": described})
    assert fake.instances[iid].label == "t-stage0"
    assert (await call(fake, "PUT", f"/api/v0/instances/{iid}/", {"label": "l" * limit}))[:2] == (
        200,
        {"success": True},
    )
    assert (await call(fake, "DELETE", f"/api/v0/instances/{iid}/"))[0] == 200

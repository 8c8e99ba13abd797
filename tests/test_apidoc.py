"""The emulator against vast.ai's own description of its API (``cloud/emulator/apidoc.py``): the
vendored files are upstream's, byte for byte; every call is held against them (the suite runs
strict); a body the description refuses fails the call, naming the endpoint, the field and the
rule, and never the value; every allowed disagreement names its source."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from pytest_ppsmoke.cloud import vastdoc
from pytest_ppsmoke.cloud.emulator import apidoc
from pytest_ppsmoke.cloud.emulator.server import FakeVast
from pytest_ppsmoke.cloud.vast import VastClient
from pytest_ppsmoke.cloud.vastrecords import OfferQuery, search_body

from .helpers import SLEEPER

pytestmark = pytest.mark.local


def test_the_vendored_files_are_upstreams_byte_for_byte() -> None:
    """Each file's git blob id is the one UPSTREAM names (as ``git ls-tree`` at that commit shows
    it; ``python -m pytest_ppsmoke.cloud.emulator.apidoc --upstream CLONE`` checks against
    a clone); a byte changed, a file added or one missing is named."""
    up = apidoc.upstream()
    assert (
        up["repository"] == "vast-ai/docs" and len(up["commit"]) == 40 and up["path"] == "api-reference/openapi/yaml/"
    )
    assert apidoc.check_vendored() == []
    named = sorted(k[5:] for k in up if k.startswith("file:"))
    assert named == sorted(p.name for p in apidoc.DOCS.glob("*.yaml")) and len(named) == 8
    # the blob id is git's own: "blob <size>\0<bytes>" under SHA-1
    assert apidoc.blob_id(b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"
    body = (apidoc.DOCS / "show_user.yaml").read_bytes()
    assert apidoc.blob_id(body + b" ") != up["file:show_user.yaml"]
    # every endpoint the client calls is described, or allowed as undocumented with its source
    calls = [("POST", "/api/v0/bundles/"), ("PUT", "/api/v0/asks/7/"), ("GET", "/api/v0/instances/7/"),
             ("PUT", "/api/v0/instances/7/"), ("DELETE", "/api/v0/instances/7/"), ("GET", "/api/v1/instances/"),
             ("GET", "/api/v0/users/current")]  # fmt: skip
    for method, path in calls:
        assert apidoc.find(method, path) is not None, (method, path)
    # the emulator and the client read them with libyaml where PyYAML has it: the same documents
    # as its pure-Python parser gives
    assert vastdoc.YAML_LOADER is apidoc.YAML_LOADER
    for p in apidoc.DOCS.glob("*.yaml"):
        assert yaml.load(p.read_text(), Loader=apidoc.YAML_LOADER) == yaml.safe_load(p.read_text()), p.name


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, check=True, timeout=60).stdout


def test_upstream_names_each_vendored_file_changed_since_its_commit_in_a_clone_or_a_plain_tree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--upstream CLONE``: each vendored file's blob at UPSTREAM's commit against the clone's
    newest commit (a temporary repository: the files as vendored, then a commit that changes one
    and removes another), or, for a plain tree (``git archive``'s, no .git), the files on disk
    hashed as git does. Nothing is fetched."""
    up = apidoc.upstream()
    repo = tmp_path / "docs"
    where = repo / up["path"]
    where.mkdir(parents=True)
    for p in apidoc.DOCS.glob("*.yaml"):
        shutil.copyfile(p, where / p.name)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "as vendored")
    what, problems = apidoc.changed_upstream(repo)
    assert problems == [] and "newest commit" in what
    with pytest.raises(SystemExit) as e:
        apidoc.main(["--upstream", str(repo)])
    assert e.value.code == 0 and "and none changed since in" in capsys.readouterr().out

    (where / "create_instance.yaml").write_bytes((where / "create_instance.yaml").read_bytes() + b"# new\n")
    (where / "logs.yaml").unlink()
    _git(repo, "commit", "-qam", "a change upstream")
    _, problems = apidoc.changed_upstream(repo)
    assert [p.split(":")[0] for p in problems] == ["create_instance.yaml", "logs.yaml"], problems
    assert problems[0].startswith(f"create_instance.yaml: changed upstream since {up['commit'][:12]}: blob ")
    assert "removed upstream" in problems[1]
    with pytest.raises(SystemExit) as e:
        apidoc.main(["--upstream", str(repo)])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "apidoc: create_instance.yaml: changed upstream" in err and "Traceback" not in err

    plain = tmp_path / "plain"
    plain.mkdir()
    archive = subprocess.run(["git", "-C", str(repo), "archive", "HEAD"], capture_output=True, check=True, timeout=60)
    subprocess.run(["tar", "-x", "-C", str(plain)], input=archive.stdout, check=True, timeout=60)
    assert not (plain / ".git").exists()
    what, plain_problems = apidoc.changed_upstream(plain)
    assert "no git" in what
    assert [p.split(":")[0] for p in plain_problems] == ["create_instance.yaml", "logs.yaml"], plain_problems
    shutil.copyfile(apidoc.DOCS / "logs.yaml", plain / up["path"] / "logs.yaml")
    shutil.copyfile(apidoc.DOCS / "create_instance.yaml", plain / up["path"] / "create_instance.yaml")
    assert apidoc.changed_upstream(plain)[1] == []

    with pytest.raises(SystemExit) as e:  # neither: one line, no traceback
        apidoc.main(["--upstream", str(tmp_path / "nothing")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("apidoc: --upstream: ") and "Traceback" not in err


def test_every_allowed_disagreement_names_its_source() -> None:
    entries = json.loads((apidoc.DOCS / "allowed.json").read_text())
    assert len(entries) == len(apidoc.allowed()) >= 10
    for e in entries:
        assert set(e) - {"allows"} == {"endpoint", "where", "field", "rule", "source", "why"}, e
        assert e["source"].startswith(("vast-cli ", "vast.ai's docs ")) and e["why"].strip(), e
        assert e["where"] in ("request", "response"), e
        assert e["rule"] not in ("type", "enum") or e["allows"], e  # a type or a value, never any
    # docs/lifecycle.md lists each
    doc = (apidoc.DOCS.parent.parent.parent.parent / "docs" / "lifecycle.md").read_text()
    for e in entries:
        assert f"`{e['endpoint']}` {e['where']} `{e['field']}`" in doc, e


async def call(fake: FakeVast, method: str, path: str, body: Any) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {fake.api_key}"}
    async with aiohttp.ClientSession(headers=headers) as http, http.request(method, fake.url + path, json=body) as resp:
        return resp.status, await resp.json()


async def test_a_body_the_description_refuses_fails_the_call_naming_the_field_never_the_value() -> None:
    """The suite runs strict: ``type: "bogus"`` is outside the search's enum (ondemand, bid,
    reserved, and vast-cli's on-demand, allowed); the call fails with 400 naming the endpoint,
    the field and the rule. A create whose env is not a string is allowed (vast-cli's form), but one
    whose disk is not a number is not: the answer names disk, and not the key in env beside it."""
    assert os.environ["PP_EMULATOR_OPENAPI"] == "strict" and apidoc.strict()
    async with FakeVast(node_argv=SLEEPER) as fake:
        status, data = await call(fake, "POST", "/api/v0/bundles/", {**search_body(OfferQuery()), "type": "bogus"})
        assert status == 400 and data["error"] == "openapi_violation", data
        assert data["msg"] == "POST /api/v0/bundles/ request: type: not one of ['ondemand', 'bid', 'reserved'] (enum)"
        status, data = await call(fake, "POST", "/api/v0/bundles/", search_body(OfferQuery()))  # vast-cli's "on-demand"
        assert status == 200 and data["offers"]
        secret = "0123456789abcdef" * 4
        body = {"image": "i:1", "env": {"PP_NODE_KEY": secret}, "disk": "lots", "label": "x", "price": None}
        status, data = await call(fake, "PUT", f"/api/v0/asks/{data['offers'][0]['id']}/", body)
        assert status == 400 and "PUT /api/v0/asks/{id}/ request: disk: expected type 'number' (type)" in data["msg"]
        assert secret not in json.dumps(data) and fake.instances == {}
        assert [str(v) for v in fake.violations] == [
            "POST /api/v0/bundles/ request: type: not one of ['ondemand', 'bid', 'reserved'] (enum)",
            "PUT /api/v0/asks/{id}/ request: disk: expected type 'number' (type)",
        ]


async def test_an_answer_that_breaks_the_description_fails_and_every_real_answer_does_not() -> None:
    """The emulator's own answers are held too: a record whose type the description refuses (here
    ``num_gpus`` served as text) becomes a 500 naming the field; a whole create, show, list and
    destroy through the client meets the description (or the allow-list) at every call."""
    async with (
        # raw calls right after another, each checked against the description: the rate limits
        # (on by default; tested apart) are off
        FakeVast(node_argv=SLEEPER, faults="vast.boot_delay=0.05;vast.rate_limit=off") as fake,
        VastClient(fake.api_key, fake.url) as vast,
    ):
        offer = (await vast.search_offers(OfferQuery()))[0]
        iid = await vast.create_instance(offer.id, image="i:1", env={"STAGE": "0"}, label="ppsmoke-r-stage0")
        await vast.wait_running(iid, 100, 0.05)
        assert [i.id for i in await vast.list_instances("ppsmoke-r-")] == [iid]
        assert fake.violations == []
        fake.instances[iid].offer["num_gpus"] = "1"  # a record vast.ai would never serve
        status, data = await call(fake, "GET", f"/api/v0/instances/{iid}/", None)
        assert status == 500 and data["error"] == "openapi_violation", data
        assert "GET /api/v0/instances/{id}/ response: instances.num_gpus: expected type 'integer' (type)" in data["msg"]
        fake.instances[iid].offer["num_gpus"] = 1
        assert await vast.destroy_instance(iid) is True
        assert await vast.show_instance(iid) is None  # {"instances": null}: allowed, vast-cli reads it so


CREATE = "PUT /api/v0/asks/{id}/"


def answer(status: int, body: Any, content_type: str = "application/json") -> list[tuple[str, str, str, str]]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    found = apidoc.validate_response("PUT", "/api/v0/asks/4100000/", status, content_type, raw)
    return [(v.endpoint, v.where, v.field, v.rule) for v in found]


def test_error_answers_are_held_to_the_description() -> None:
    """An error answer breaks vast.ai's description, each named by its endpoint and field: an
    ``error`` outside the described enum, one other than the described example for its status, a
    status not described, a body that is not JSON where JSON is described (an HTML error page), a
    described ``error`` or ``msg`` missing. The answers assembled from the examples keep to it."""
    taken = apidoc.documented_error(CREATE, 404, ask_id=4100000)
    assert taken == {
        "success": False,
        "error": "invalid_args",
        "msg": "error 404/3603: no_such_ask Instance type by id 4100000 is not available.",
        "ask_id": 4100000,
    }
    assert answer(404, taken) == [] and answer(410, apidoc.documented_error(CREATE, 410, ask_id=7)) == []
    assert answer(404, {**taken, "error": "no_such_ask"}) == [(CREATE, "response", "error", "example")]
    assert answer(400, {"success": False, "error": "bogus", "msg": "m"}) == [(CREATE, "response", "error", "enum")]
    assert answer(409, {"success": False, "error": "conflict", "msg": "m"}) == [
        (CREATE, "response", "(status)", "status")
    ]
    html = b"<html><body>404 Not Found</body></html>"
    assert answer(404, html, "text/html") == [(CREATE, "response", "(body)", "json")]
    assert answer(404, html) == [(CREATE, "response", "(body)", "json")]  # labelled JSON, and not
    assert answer(410, {"success": False, "error": "no_such_ask"}) == [(CREATE, "response", "msg", "required")]
    assert answer(401, {"success": False, "msg": "Invalid user key"}) == [(CREATE, "response", "error", "required")]
    # a 429 (the rate limiter's) and a 5xx are judged only where described
    assert answer(429, b"API requests too frequent", "text/plain") == [] and answer(502, b"<html/>", "text/html") == []
    # where the description gives no example, the emulator's own words are asked for, never made up
    with pytest.raises(ValueError, match="no example of \\['error', 'msg'\\]"):
        apidoc.documented_error(CREATE, 401)
    with pytest.raises(ValueError, match="error is documented"):
        apidoc.documented_error(CREATE, 404, error="no_such_ask")
    with pytest.raises(ValueError, match="not one of"):
        apidoc.documented_error(CREATE, 400, error="bogus", msg="m")


async def test_an_undescribed_error_answer_fails_the_call_in_strict_mode() -> None:
    """Over HTTP: the emulator's answer to the logs endpoint's bad tail (a 400 logs.yaml does not
    describe) becomes a 500 ``openapi_violation`` naming the endpoint and the status."""
    async with FakeVast(api_key="k", node_argv=SLEEPER) as fake, VastClient("k", fake.url) as vast:
        iid = await vast.create_instance(fake.catalogue[0]["id"], image="i", env={}, label="l")
        logs_url = f"{fake.url}/api/v0/instances/request_logs/{iid}/"
        async with (
            aiohttp.ClientSession(headers={"Authorization": "Bearer k"}) as s,
            s.put(logs_url, json={"tail": "-1"}) as r,
        ):
            data = await r.json()
        await vast.destroy_instance(iid)
    assert r.status == 500 and data["error"] == "openapi_violation", data
    assert data["msg"].startswith("the emulator's answer: PUT /api/v0/instances/request_logs/{id} response: (status)")

"""The pre-flight: before the first create, the key, the image in its registry, the model (its
blocks against the stages, a GGUF cut short), the offers and the credit, each refused in one line
with nothing rented; and the emulator's hosts pulling images as vast.ai's do (a missing or
private image stays ``loading``, its error in ``status_msg``, and the run ends on that message,
not after 60 polls).

The registry is real: Debian's ``docker-registry`` on a loopback port (``tests/registry.py``),
one open and one behind htpasswd (a private image), filled by ``buildah push``."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_ppsmoke.cloud import oci
from pytest_ppsmoke.cloud.emulator.server import FakeVast
from pytest_ppsmoke.cloud.preflight import image_check
from pytest_ppsmoke.cloud.vast import VastClient, start_failure
from pytest_ppsmoke.cloud.vastrecords import NeverRuns
from pytest_ppsmoke.ggufinfo import block_count, metadata
from pytest_ppsmoke.harness.deployment import Deployment, RunConfig
from pytest_ppsmoke.protocol import PhaseError
from pytest_ppsmoke.stage.catalog import MODELS, declared, model_names, resolve_model

from . import registry
from .helpers import SLEEPER, SMOLLM2, SYNTH, run_cli

SHOW = re.compile(r"/api/v0/instances/\d+/")  # an instance's record: the run's boot polls

pytestmark = pytest.mark.local
KEY = "vk-preflight-0123456789abcdef"
LOGIN = ("ppsmoke", "s3cret-pull-password")


class Registries:
    def __init__(self, public: registry.LocalRegistry, private: registry.LocalRegistry) -> None:
        self.public, self.private = public, private
        self.tiny = public.push(registry.tiny_image("localhost/pp-tiny:amd64"), "ppsmoke/tiny:1")
        self.arm = public.push(registry.tiny_image("localhost/pp-tiny:arm64", arch="arm64"), "ppsmoke/tiny:arm64")
        self.secret = private.push("localhost/pp-tiny:amd64", "ppsmoke/tiny:1")


@pytest.fixture(scope="module")
def regs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registries]:
    why = registry.missing()
    if why:
        pytest.skip(f"the registry tests need docker-registry and buildah: {why}")
    root = tmp_path_factory.mktemp("registries")
    with registry.LocalRegistry(root / "public") as public, registry.LocalRegistry(root / "private", LOGIN) as private:
        yield Registries(public, private)


def test_the_tests_registry_takes_a_push_only_of_what_it_does_not_hold(
    regs: Registries, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An open registry that holds a name as the very image pushed (its config's digest) is not
    pushed to again (the node image's push compresses every layer: 16 s of CPU); another image
    under that name is."""
    pushes: list[list[str]] = []
    run = registry.subprocess.run

    def counted(args: list[str], *a: object, **k: object) -> object:
        pushes.extend([args] if "push" in args else [])
        return run(args, *a, **k)  # type: ignore[call-overload]

    monkeypatch.setattr(registry.subprocess, "run", counted)
    tiny, arm = "localhost/pp-tiny:amd64", "localhost/pp-tiny:arm64"
    assert regs.public.config_digest("ppsmoke/tiny:1") == registry.image_id(tiny) != registry.image_id(arm)
    assert regs.public.push(tiny, "ppsmoke/tiny:1") == regs.tiny and not pushes
    assert regs.public.config_digest("ppsmoke/moved:1") is None
    regs.public.push(tiny, "ppsmoke/moved:1")
    regs.public.push(arm, "ppsmoke/moved:1")  # another image under the name
    assert len(pushes) == 2 and regs.public.config_digest("ppsmoke/moved:1") == registry.image_id(arm)
    assert regs.private.config_digest("ppsmoke/tiny:1") is None  # behind a login: not asked, pushed
    regs.private.push(tiny, "ppsmoke/tiny:1")
    assert len(pushes) == 3


def raw_manifest(name: str) -> tuple[str, dict[str, object]]:
    """The manifest and its digest as the registry serves them, asked without our client."""
    ref = oci.ImageRef.parse(name)
    req = urllib.request.Request(
        f"http://{ref.registry}/v2/{ref.repository}/manifests/{ref.tag}", headers={"Accept": oci.ACCEPT}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.headers["Docker-Content-Digest"], json.loads(resp.read())


async def test_the_registry_is_asked_as_a_pull_asks_it(regs: Registries) -> None:
    info = await oci.inspect_image(regs.tiny)
    digest, manifest = raw_manifest(regs.tiny)
    layers = manifest["layers"]
    assert isinstance(layers, list)
    assert info.digest == digest and info.platforms == ("linux/amd64",) and info.layers == len(layers) == 1
    config = manifest["config"]
    assert isinstance(config, dict)
    assert info.compressed_bytes == sum(int(la["size"]) for la in layers) + int(config["size"]) > 0
    assert str(info.ref) == regs.tiny and info.ref.api.startswith("http://127.0.0.1:")  # plain HTTP on loopback


@pytest.mark.parametrize(
    "which, kind, words",
    [
        ("missing tag", "not found", "MANIFEST_UNKNOWN"),
        ("missing repository", "not found", "does not exist"),
        ("private", "private", "asks for a login"),
        ("arm64 only", "platform", "has no linux/amd64 manifest (it has linux/arm64)"),
        ("nothing listening", "unreachable", "preflight off"),
        ("no registry", "bad name", "names no registry"),
        ("no tag", "bad name", "names no tag"),
    ],
)
async def test_each_image_problem_is_one_line_that_names_the_image_and_the_fix(
    regs: Registries, which: str, kind: str, words: str
) -> None:
    name = {
        "missing tag": regs.tiny.replace(":1", ":404"),
        "missing repository": f"{regs.public.host}/ppsmoke/nothing-here:1",
        "private": regs.secret,
        "arm64 only": regs.arm,
        "nothing listening": f"127.0.0.1:{registry.free_port()}/ppsmoke/tiny:1",
        "no registry": "pytest-ppsmoke/gpu-node:0.1.0",
        "no tag": f"{regs.public.host}/ppsmoke/tiny",
    }[which]
    with pytest.raises(oci.ImageProblem) as e:
        await oci.inspect_image(name, timeout=5)
    message = str(e.value)
    assert e.value.kind == kind and words in message and "\n" not in message, message
    assert name.split("/", 1)[-1].split(":")[0] in message  # it names the image


async def test_a_bearer_challenge_gets_an_anonymous_token_as_docker_pull_asks_it(
    regs: Registries, tmp_path: Path
) -> None:
    """The token flow of Docker Hub and GHCR, against the distribution registry configured for it
    (it verifies each token's signature): a 401 with a Bearer challenge, an anonymous token for
    the challenge's scope, then the manifest. A repository the token service grants nothing on
    anonymously is private, as GHCR answers for a private package."""
    with (
        registry.TokenService(tmp_path, public={"ppsmoke/open"}) as tokens,
        registry.LocalRegistry(tmp_path / "data", tokens=tokens) as reg,
    ):
        open_name = reg.push("localhost/pp-tiny:amd64", "ppsmoke/open:1")
        closed = reg.push("localhost/pp-tiny:amd64", "ppsmoke/closed:1")
        tokens.asked.clear()
        info = await oci.inspect_image(open_name)
        assert info.platforms == ("linux/amd64",) and info.layers == 1
        assert tokens.asked and all(auth == "" for _, auth in tokens.asked)  # anonymous, as a host pulls
        assert tokens.asked[0][0] == "repository:ppsmoke/open:pull"  # the challenge's own scope
        with pytest.raises(oci.ImageProblem) as e:
            await oci.inspect_image(closed)
        assert e.value.kind == "private" and "vast.ai's hosts pull anonymously" in str(e.value)


def test_local_mode_asks_only_a_registry_on_this_machine() -> None:
    assert image_check("ghcr.io/pytest-ppsmoke/gpu-node:0.1.0", vastai=True) is True
    why = image_check("ghcr.io/pytest-ppsmoke/gpu-node:0.1.0", vastai=False)
    assert why == "local mode asks only a registry on this machine, not ghcr.io"
    assert image_check("127.0.0.1:5000/x/y:1", vastai=False) is True
    assert image_check("localhost:5000/x/y:1", vastai=False) is True
    assert image_check("no-registry:1", vastai=False) is True  # asked, to fail on the name


def test_the_orchestrator_reads_a_ggufs_blocks_without_tinygrad(synth_model: str, tmp_path: Path) -> None:
    assert block_count(synth_model) == SYNTH.blocks
    assert metadata(synth_model, ("general.architecture",)) == {"general.architecture": "llama"}
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        block_count(bad)
    bad.write_bytes(Path(synth_model).read_bytes()[:30])
    with pytest.raises(ValueError, match="ends early"):
        block_count(bad)


def test_the_catalogue_declares_every_model_tinygrad_loads_with_its_blocks(smollm2: str) -> None:
    """One declaration per model: the names and URLs are tinygrad's table, which the stages load
    from, and the blocks known without the file are the file's where it is here (SmolLM2's)."""
    from tinygrad.apps.llm import models

    assert {m.name: m.file for m in MODELS if m.package is None} == models
    assert model_names() == [m.name for m in MODELS] and model_names()[0] == smollm2
    assert all(m.blocks >= 1 for m in MODELS)
    entry = declared(smollm2)
    assert entry is not None and entry.blocks == block_count(resolve_model(smollm2)) == SMOLLM2.blocks
    llama = declared("llama3.2:1b")
    assert llama is not None and llama.blocks == 16  # meta-llama/Llama-3.2-1B-Instruct: 16 layers
    assert declared("/data/m.gguf") is None


# --- the pre-flight in a deployment: nothing is created ----------------------------------------


def creates(fake: FakeVast) -> list[tuple[str, str, int]]:
    return [r for r in fake.requests if r[0] == "PUT" and r[1].startswith("/api/v0/asks/")]


@pytest.mark.parametrize("case", ["refused key", "missing image", "private image", "credit", "stages"])
async def test_a_run_that_cannot_succeed_is_refused_before_any_create(
    regs: Registries, synth_model: str, case: str
) -> None:
    fake = FakeVast(api_key=KEY, node_argv=SLEEPER, credit=0.0001 if case == "credit" else 100.0)
    image = {"missing image": regs.tiny.replace(":1", ":2"), "private image": regs.secret}.get(case, regs.tiny)
    config = RunConfig(image=image, model=synth_model, num_stages=3 if case == "stages" else 2)
    assert config.check_image is True  # a registry on loopback: asked in local mode too
    expected = {
        "refused key": "vast.ai refused the API key (HTTP 401); check api_key",
        "missing image": "does not exist (MANIFEST_UNKNOWN: manifest unknown)",
        "private image": "is private",
        "credit": "the account's credit, $0.00, does not cover the run's worst case",
        "stages": f"has {SYNTH.blocks} block(s), fewer than the 3 stages; lower num_stages",
    }[case]
    async with fake:
        async with VastClient("not-the-key" if case == "refused key" else KEY, fake.url) as vast:
            dep = Deployment(vast, config)
            with pytest.raises(PhaseError) as e:
                await dep.rent()
        # nothing waited for: the key asked once, not retried, and no instance polled
        assert [p for _, p, _ in fake.requests].count("/api/v0/users/current") == 1, fake.requests
        assert not any(p.startswith("/api/v0/instances") for _, p, _ in fake.requests), fake.requests
        assert e.value.phase == "preflight" and expected in str(e.value), str(e.value)
        assert creates(fake) == [] and dep.creates_sent == 0 and dep.seed is None  # nothing rented, nothing started
        assert [p for _, p, _ in fake.requests][:1] == ["/api/v0/users/current"]  # the key first


@pytest.mark.parametrize(
    ("model", "stages", "blocks"), [("smollm2:135m", 40, 30), ("smollm2:135m", 99, 30), ("llama3.2:1b", 17, 16)]
)
async def test_a_named_models_blocks_refuse_more_stages_before_the_offer_search(
    model: str, stages: int, blocks: int
) -> None:
    """A name the catalogue declares: its blocks, known without the file, before any offer is
    searched (the line names the blocks, not the offers), downloaded or rented."""
    async with FakeVast(api_key=KEY, node_argv=SLEEPER) as fake, VastClient(KEY, fake.url) as vast:
        dep = Deployment(vast, RunConfig(model=model, num_stages=stages, check_image="not asked"))
        with pytest.raises(PhaseError) as e:
            await dep.rent()
        assert e.value.phase == "preflight"
        assert str(e.value) == (
            f"preflight: model {model!r} has {blocks} block(s), fewer than the {stages} stages; "
            f"lower num_stages to at most {blocks}"
        )
        assert [p for _, p, _ in fake.requests] == ["/api/v0/users/current"]  # no offer search, no create


@pytest.fixture
def cut_model(synth_model: str, tmp_path: Path) -> tuple[Path, int]:
    """The session's synthetic GGUF cut to half its size, and that size."""
    cut = tmp_path / "cut.gguf"
    whole = Path(synth_model).read_bytes()
    cut.write_bytes(whole[: len(whole) // 2])
    return cut, len(whole) // 2


async def test_a_gguf_cut_short_is_refused_naming_the_file_before_any_create(cut_model: tuple[Path, int]) -> None:
    cut, size = cut_model
    async with FakeVast(api_key=KEY, node_argv=SLEEPER) as fake, VastClient(KEY, fake.url) as vast:
        dep = Deployment(vast, RunConfig(model=str(cut), check_image="not asked"))
        with pytest.raises(PhaseError) as e:
            await dep.rent()
        assert e.value.phase == "preflight"
        assert f"model '{cut}': {cut} is cut short: " in str(e.value)
        assert f"but the file has {size:,} bytes" in str(e.value)
        assert creates(fake) == [] and dep.creates_sent == 0


async def test_a_run_that_can_succeed_records_what_the_preflight_found(regs: Registries) -> None:
    async with FakeVast(api_key=KEY, node_argv=SLEEPER, credit=12.5) as fake, VastClient(KEY, fake.url) as vast:
        dep = Deployment(vast, RunConfig(image=regs.tiny, budget=120.0))
        offers = await dep.check()
        found = dep.preflight
        assert found is not None and found.image is not None and found.credit == 12.5
        assert found.offers == offers and len(offers) >= 2
        assert found.worst_case_usd == pytest.approx((offers[0].dph_total + offers[1].dph_total) * 120 / 3600)
        summary = found.summary()
        assert summary["image"]["image"] == regs.tiny and summary["image_checked"] == "checked"
        assert dep.timings["preflight"] > 0 and creates(fake) == []


@pytest.mark.parametrize("case", ["missing image", "private image", "refused key"])
def test_the_command_refuses_in_one_line_without_waiting_and_creates_nothing(
    regs: Registries, synth_model: str, case: str
) -> None:
    image = (
        regs.tiny.replace(":1", ":7")
        if case == "missing image"
        else regs.secret
        if case == "private image"
        else regs.tiny
    )
    expected = {
        "missing image": f"failed at preflight: image {image} does not exist (MANIFEST_UNKNOWN: manifest unknown); "
        "publish it (a version tag runs the image workflow) or pass --image",
        "private image": f"failed at preflight: image {image} is private: {regs.private.host} asks for a login",
        "refused key": "failed at preflight: vast.ai refused the API key (HTTP 401); check --api-key",
    }[case]

    async def main() -> None:
        async with FakeVast(api_key=KEY, node_argv=SLEEPER) as fake:
            key = "vk-wrong-key-0000" if case == "refused key" else KEY
            args = ["--local", "--vast-url", fake.url, "--model", synth_model, "--image", image]
            done = await asyncio.to_thread(run_cli, *args, env={**os.environ, "VAST_API_KEY": key}, timeout=60)
            # nothing waited for: the key asked once, not retried, and no instance polled
            assert [p for _, p, _ in fake.requests].count("/api/v0/users/current") == 1, fake.requests
            assert not any(p.startswith("/api/v0/instances") for _, p, _ in fake.requests), fake.requests
            assert done.returncode == 1, done.stderr
            (line,) = [ln for ln in done.stderr.splitlines() if "failed at" in ln]
            assert line.startswith(f"pp-smoke-run: {expected}"), line
            assert "Traceback" not in done.stderr and key not in done.stderr + done.stdout
            assert creates(fake) == []  # the emulator's record: no create was sent

    asyncio.run(main())


@pytest.mark.parametrize("case", ["default model", "llama3.2:1b", "cut gguf"])
def test_the_command_refuses_a_model_that_cannot_run_in_one_line(cut_model: tuple[Path, int], case: str) -> None:
    """The model's blocks against the stage count, or a GGUF cut short: one line, exit 1, no
    create, nothing downloaded (the named model's blocks are the catalogue's)."""
    cut = cut_model[0]
    args, expected = {
        "default model": (
            ["--num-stages", "40"],
            "failed at preflight: --model 'smollm2:135m' has 30 block(s), fewer than the 40 stages; "
            "lower --num-stages to at most 30",
        ),
        "llama3.2:1b": (
            ["--model", "llama3.2:1b", "--num-stages", "17"],
            "failed at preflight: --model 'llama3.2:1b' has 16 block(s), fewer than the 17 stages; "
            "lower --num-stages to at most 16",
        ),
        "cut gguf": (  # the path twice is over 300 characters with the advice: the line leaves the middle out
            ["--model", str(cut)],
            f"failed at preflight: --model '{cut}':",
        ),
    }[case]

    async def main() -> None:
        async with FakeVast(api_key=KEY, node_argv=SLEEPER) as fake:
            env = {**os.environ, "VAST_API_KEY": KEY}
            done = await asyncio.to_thread(run_cli, "--local", "--vast-url", fake.url, *args, env=env, timeout=60)
            assert done.returncode == 1, done.stderr
            (line,) = [ln for ln in done.stderr.splitlines() if "failed at" in ln]
            assert line.startswith(f"pp-smoke-run: {expected}") and len(line) <= 300, line
            assert case != "cut gguf" or " bytes; download or copy it again (" in line, line
            assert "Traceback" not in done.stderr
            assert creates(fake) == [] and not [p for _, p, _ in fake.requests if p.startswith("/api/v0/bundles")]

    asyncio.run(main())


def test_an_unreachable_registry_names_preflight_off_which_skips_the_checks(
    regs: Registries, synth_model: str, tmp_path: Path
) -> None:
    """A registry that does not answer is refused in one line that names ``--preflight off``;
    with it off the run goes on (this emulator's instances are processes: they pull nothing) and
    passes."""

    async def main() -> None:
        async with FakeVast(api_key=KEY, faults="vast.boot_delay=0.05") as fake:
            unreachable = f"127.0.0.1:{registry.free_port()}/ppsmoke/tiny:1"
            args = ["--local", "--vast-url", fake.url, "--model", synth_model, "--max-tokens", "2"]
            args += ["--reference", "off", "--image", unreachable]
            env = {**os.environ, "VAST_API_KEY": KEY}
            done = await asyncio.to_thread(run_cli, *args, env=env, timeout=120)
            assert done.returncode == 1, done.stderr
            (line,) = [ln for ln in done.stderr.splitlines() if "failed at preflight" in ln]
            assert f"cannot ask {unreachable.split('/')[0]} for image {unreachable}" in line, line
            assert "or skip this check with --preflight off" in line and "Traceback" not in done.stderr
            assert creates(fake) == []
            report = tmp_path / "r.json"
            done = await asyncio.to_thread(
                run_cli, *args, "--preflight", "off", "--report", str(report), env=env, timeout=120
            )
            assert done.returncode == 0, done.stderr[-2000:]
            assert json.loads(report.read_text())["preflight"] is None and len(creates(fake)) == 2

    asyncio.run(main())


def test_with_the_preflight_off_a_missing_image_ends_the_boot_on_its_pull_error(
    regs: Registries, synth_model: str, tmp_path: Path
) -> None:
    """What the pre-flight saves, shown without it: vast.ai's hosts keep an instance whose image
    cannot be pulled ``loading``; the run reads the pull error in ``status_msg`` and fails the boot
    at once, naming the image, instead of after the spec's 60 polls."""
    image = regs.tiny.replace(":1", ":8")
    report = tmp_path / "r.json"

    async def main() -> None:
        async with FakeVast(api_key=KEY, runtime="image", faults="vast.boot_delay=0") as fake:
            args = ["--local", "--vast-url", fake.url, "--model", synth_model, "--image", image]
            args += ["--preflight", "off", "--poll-interval", "0.5", "--report", str(report)]
            done = await asyncio.to_thread(run_cli, *args, env={**os.environ, "VAST_API_KEY": KEY}, timeout=120)
            shown = [path for method, path, _ in fake.requests if method == "GET" and SHOW.fullmatch(path)]
            polls = collections.Counter(shown)
            assert polls and max(polls.values()) < 60, (polls, done.stderr)  # not the spec's 60 polls of each
            assert done.returncode == 1, done.stderr
            (line,) = [ln for ln in done.stderr.splitlines() if "failed at" in ln]
            assert line.startswith("pp-smoke-run: failed at boot: stage ") and len(line) <= 300, line
            assert "is loading, and its image pull failed: Error response from" in line and "pass --image" in line
            error = json.loads(report.read_text())["error"]  # the daemon's words whole, in the report
            assert "is loading, and its image pull failed: Error response from daemon:" in error, error
            assert "manifest unknown" in error and f"check that image {image} exists and is public" in error, error
            assert len(creates(fake)) == 2 and not fake.instances  # both rented, both destroyed
        await fake.torn_down()

    asyncio.run(main())


# --- the emulator's hosts pull as vast.ai's do -------------------------------------------------


@pytest.mark.parametrize("case", ["missing", "private"])
async def test_an_image_that_cannot_be_pulled_stays_loading_and_the_wait_ends_on_its_message(
    regs: Registries, case: str
) -> None:
    name = regs.tiny.replace(":1", ":9") if case == "missing" else regs.secret
    async with FakeVast(api_key=KEY, runtime="image", faults="vast.boot_delay=0") as fake:
        async with VastClient(KEY, fake.url) as vast:
            offers = await vast.search_offers(RunConfig().query)
            iid = await vast.create_instance(offers[0].id, image=name, env={}, label="ppsmoke-pull-stage0")
            assert fake.instances[iid].cancel_unavail is True  # an error, never a stopped instance
            seen: list[str] = []
            with pytest.raises(NeverRuns) as e:
                await vast.wait_running(iid, 60, 0.25, lambda n, r: seen.append(r.actual_status if r else "none"))
            assert e.value.failure == "image pull" and len(seen) < 60  # ended on the message, not the 60 polls
            word = "manifest unknown" if case == "missing" else "unauthorized"
            assert word in str(e.value) and "Error response from daemon" in str(e.value), str(e.value)
            record = await vast.show_instance(iid)
            assert record is not None and record.actual_status == "loading" and word in record.status_msg
            await asyncio.sleep(0.5)
            assert fake.instances[iid].actual_status == "loading" and fake.instances[iid].proc is None  # never ran
            assert await vast.destroy_instance(iid)
        await fake.torn_down()
    assert fake.instances == {}


async def test_a_pull_lasts_the_images_size_over_the_hosts_bandwidth(regs: Registries) -> None:
    size = (await oci.inspect_image(regs.tiny)).compressed_bytes
    mbps = size * 8 / 1e6 / 2.0  # a 2 s download
    async with FakeVast(api_key=KEY, runtime="image", faults="vast.boot_delay=0", pull_mbps=mbps) as fake:
        async with VastClient(KEY, fake.url) as vast:
            offers = await vast.search_offers(RunConfig().query)
            iid = await vast.create_instance(offers[0].id, image=regs.tiny, env={}, label="ppsmoke-slow-stage0")
            started = time.monotonic()
            msgs = []
            while time.monotonic() - started < 15:
                record = await vast.show_instance(iid)
                assert record is not None
                msgs.append((round(time.monotonic() - started, 1), record.actual_status, record.status_msg))
                if record.actual_status not in (None, "loading"):
                    break
                await asyncio.sleep(0.2)
            loading = [t for t, state, _ in msgs if state == "loading"]
            assert 1.5 <= max(loading) <= 6, msgs  # loading for the modelled download, no longer
            assert any(f"{size / 1e6:.0f} MB at {mbps:g} Mbit/s" in m for _, _, m in msgs), msgs
            # the tiny image has no entrypoint: it fails at start, after the pull, as a broken image does
            assert msgs[-1][1] == "exited" and "neither an ENTRYPOINT nor a CMD" in msgs[-1][2], msgs
            await vast.destroy_instance(iid)
        await fake.torn_down()


def test_a_status_message_is_read_as_vast_cli_reads_it() -> None:
    assert start_failure("Pulling image ghcr.io/x/y:1") is None
    assert start_failure("success, running ghcr.io/x/y:1") is None
    assert start_failure("") is None
    pull = "Error response from daemon: manifest for ghcr.io/x/y:2 not found: manifest unknown: manifest unknown"
    assert start_failure(pull) == "image pull"
    assert start_failure("Error response from daemon: pull access denied for x, repository does not exist") == (
        "image pull"
    )
    assert start_failure("unauthorized: authentication required") == "image pull"
    assert start_failure("OCI runtime create failed: exec: no such file") == "container start"

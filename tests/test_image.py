"""The node image: the Dockerfile's rules, then the image itself, built with buildah on the Debian
base (``python -m pytest_ppsmoke.cloud.image``; ``.ci/run`` builds it before the suite, so the
test's build finds it up to date) and run as both instances of a smoke run through the emulator
(``--runtime image``, the session's synthetic model)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_ppsmoke import DEFAULT_IMAGE
from pytest_ppsmoke.cloud import image
from pytest_ppsmoke.cloud.emulator import registry, server
from pytest_ppsmoke.cloud.emulator.catalogue import default_catalogue
from pytest_ppsmoke.cloud.emulator.instances import Instance
from pytest_ppsmoke.cloud.emulator.runtimes import Image, NetworkMembers, Runtime
from pytest_ppsmoke.cloud.emulator.server import FakeVast
from pytest_ppsmoke.cloud.vastrecords import OfferQuery, search_body
from pytest_ppsmoke.harness import settings
from pytest_ppsmoke.protocol import COMPUTE_CAPS
from pytest_ppsmoke.stage.cudacheck import ARCHES
from tests import registry as test_registry
from tests.helpers import TEST_TAG, tagged_processes

pytestmark = pytest.mark.local

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_the_dockerfile_follows_its_rules() -> None:
    ins = instructions()
    words = [w for w, _ in ins]
    assert set(words) <= {"ARG", "FROM", "ENV", "RUN", "COPY", "USER", "WORKDIR", "ENTRYPOINT"}, words
    args = dict(a.partition("=")[::2] for w, a in ins if w == "ARG")
    assert args["BASE"] == f"debian:{image.release()}-slim" == "debian:bookworm-slim"  # Python 3.11
    assert ("FROM", "${BASE}") in ins and "BAKE_MODEL" in args
    assert ins[-1] == ("ENTRYPOINT", '["pp-gpu-node"]')  # exec form: signals reach the node
    assert [a for w, a in ins if w == "USER"] == ["node"]
    env = dict(kv.partition("=")[::2] for w, a in ins if w == "ENV" for kv in a.split())
    assert env["CUDA"] == "1" and env["PATH"].startswith("/opt/venv/bin:")
    site = "/opt/venv/lib/python3.11/site-packages/nvidia"  # the "cuda" extra's wheels, in the venv
    assert env["CUDA_PATH"] == f"{site}/cuda_runtime" and env["NVRTC_PATH"] == f"{site}/cuda_nvrtc/lib/libnvrtc.so.12"
    # what the NVIDIA container runtime reads to mount the driver and the devices
    assert (env["NVIDIA_VISIBLE_DEVICES"], env["NVIDIA_DRIVER_CAPABILITIES"]) == ("all", "compute,utility")
    # no secrets: nothing named like one is set or passed at build time
    for w, a in ins:
        if w in ("ENV", "ARG"):
            assert not re.search(r"KEY|SECRET|TOKEN|PASSWORD", a.split("=")[0], re.I), a
    # every file copied exists, and .dockerignore lets it into the build context
    ignore = (ROOT / ".dockerignore").read_text().split()
    for w, a in ins:
        if w == "COPY":
            *sources, _ = a.split()
            for src in sources:
                assert (ROOT / src).exists(), src
                assert f"!{src}" in ignore or f"!{src}/" in ignore, f"{src} is excluded from the build context"
    runs = " ".join(a for w, a in ins if w == "RUN")
    assert 'pip install -c /src/constraints.txt "/src[cuda,prebuild]"' in runs and "rm -rf /var/lib/apt/lists/*" in runs


def test_the_local_base_is_the_registry_base_plus_clang() -> None:
    """The two recipes of the one image: docker/debian-base.sh builds the release the
    Dockerfile's BASE names (read from it, not written twice) and adds exactly one package."""
    script = image.DEBIAN_BASE_SCRIPT.read_text()
    assert "ARG BASE=debian:" in script and "Dockerfile" in script  # the release comes from there
    assert re.findall(r"--include=(\S+)", script) == ["clang"]  # tinygrad's CPU device, only here
    assert "--variant=minbase" in script  # what debian:<release>-slim is made from too
    assert image.debian_base() == f"localhost/pp-debian-base:{image.release()}"
    # the publishing workflow builds the Dockerfile's default base: no job overrides BASE
    workflow = (ROOT / ".github" / "workflows" / "image.yml").read_text()
    assert "BASE=" not in workflow and "docker/Dockerfile" in workflow


def test_the_images_cuda_is_the_one_the_offers_ask_for() -> None:
    """NVRTC writes PTX of its own CUDA version, which older drivers refuse: the image's NVRTC
    and headers are one release, the one --min-cuda asks the offers for."""
    text = (ROOT / "pyproject.toml").read_text()
    cuda = re.search(r"^cuda = \[(.*?)^\]", text, re.S | re.M)
    assert cuda, "pyproject.toml has no cuda extra"
    pins = dict(re.findall(r'"(nvidia-[a-z0-9-]+)==([0-9.]+)"', cuda[1]))
    assert set(pins) == {"nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12"}, pins
    assert len(set(pins.values())) == 1, f"NVRTC and the headers are different releases: {pins}"
    major_minor = float(".".join(next(iter(pins.values())).split(".")[:2]))
    assert OfferQuery().min_cuda == major_minor, (OfferQuery().min_cuda, pins)


def test_the_runtimes_are_listed_once_each_name_a_runtime_class() -> None:
    assert settings.RUNTIMES is registry.NAMES is server.RUNTIMES  # one list: the registry's
    assert registry.NAMES == ("processes", "image")
    for name in registry.NAMES:
        cls = registry.load(name)
        assert issubclass(cls, Runtime) and cls.name == name, cls
    with pytest.raises(ValueError, match="unknown runtime 'nat'; expected one of processes, image"):
        FakeVast(runtime="nat")
    with pytest.raises(ValueError, match=r"an emulated network \('wan'\) runs node processes; the runtime 'image'"):
        FakeVast(runtime="image", network="wan")
    assert isinstance(FakeVast(network="wan").runs, NetworkMembers)  # what processes is on a network


def test_the_registry_imports_only_the_standard_library() -> None:
    probe = (
        "import json, sys; before = set(sys.modules); import pytest_ppsmoke.cloud.emulator.registry; "
        "print(json.dumps(sorted(m for m in set(sys.modules) - before if not m.startswith('pytest_ppsmoke'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert all(m.split(".")[0] in sys.stdlib_module_names for m in json.loads(out.stdout)), out.stdout


class TaggedImage(Image):
    """The image runtime, its containers carrying the test's tag as well: the suite finds what a
    test left running by it, and a container gets none of the emulator's environment. With
    ``programs`` set, the containers share one tinygrad cache (``/opt/cache/tinygrad``), so that
    two cold containers make each program once, as two processes of one machine do: this test
    checks how an instance is pulled and run, not its cold start (bench/image_on_gpu.sh measures
    that); on 2 shared cores, two cold compiles beside the rest of the suite starved the nodes'
    event loops past SWIM's suspicion."""

    programs: Path | None = None

    def container_env(self, inst: Instance) -> dict[str, str]:
        return super().container_env(inst) | {TEST_TAG: os.environ[TEST_TAG]}

    def volumes(self, inst: Instance) -> list[str]:
        return [f"{self.programs}:/opt/cache/tinygrad"] if self.programs else []


def test_a_container_gets_the_instance_environment_and_no_other(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TEST_TAG, "not-for-containers")
    fake = FakeVast(runtime="image")
    assert isinstance(fake.runs, Image) and fake.runtime == "image"
    inst = Instance(7, 1, default_catalogue()[0], "img:1", {"STAGE": "1"}, None, 10.0, None, [], container_key="k")
    env = fake.runs.container_env(inst)
    assert env["STAGE"] == "1" and env["CONTAINER_ID"] == "7" and (env["CUDA"], env["CPU"]) == ("0", "1")
    assert not {TEST_TAG, "PATH", "HOME"} & set(env)  # nothing of the emulator's own environment
    assert TaggedImage(fake).container_env(inst)[TEST_TAG] == "not-for-containers"  # the suite's, in tests/


@pytest.fixture(scope="module")
def built_image() -> str:
    """The node image on the Debian base, built (or found up to date); skips, saying why, where
    this machine cannot run buildah."""
    why = image.buildah_missing()
    if why:
        pytest.skip(f"the image tests need buildah: {why}")
    base = image.debian_base()
    subprocess.run([str(image.DEBIAN_BASE_SCRIPT), base], check=True, timeout=1200, capture_output=True)
    image.build(DEFAULT_IMAGE, base)
    return DEFAULT_IMAGE


def run_in(name: str, command: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``command`` in a working container of the image ``name`` (its user, its environment, with
    ``env`` over it), as ``buildah run`` runs it; the container is removed after."""
    ctr = f"pp-check-{os.getpid()}-{os.urandom(3).hex()}"
    subprocess.run([*image.BUILDAH, "from", "--pull=never", "--quiet", "--name", ctr, name], check=True,
                   capture_output=True, timeout=600)  # fmt: skip
    try:
        return subprocess.run(
            [*image.BUILDAH, "run", "--isolation", "chroot", *(f"--env={k}={v}" for k, v in (env or {}).items()),
             ctr, "--", *command],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        subprocess.run([*image.BUILDAH, "rm", ctr], capture_output=True, timeout=120)


@pytest.mark.image
def test_the_image_is_the_release_its_dockerfile_names(built_image: str) -> None:
    # one line in one write: under the full suite buildah run's output was seen lost, once whole,
    # once after its first line
    command = ["sh", "-c", '. /etc/os-release; echo "$VERSION_CODENAME $(python3 --version 2>&1)"']
    done = run_in(built_image, command)
    if done.returncode == 0 and not done.stdout:
        done = run_in(built_image, command)
    assert done.returncode == 0 and done.stdout, (done.stdout, done.stderr)
    codename, python = done.stdout.strip().split(" ", 1)
    assert codename == image.release() and python.startswith("Python 3.11."), done.stdout


@pytest.mark.image
def test_the_images_nvrtc_compiles_f16_and_bf16_kernels_for_the_offers_gpus(built_image: str) -> None:
    """What a node on a rented GPU does first, minus the GPU: tinygrad's CUDA compiler, with only
    the NVRTC and headers the image ships, compiles real f16 and bf16 kernels for every compute
    capability an offer search admits (this machine's own CUDA toolkit, if any, is outside the
    container); and refuses Blackwell's, which the search therefore excludes."""
    admitted = search_body(OfferQuery())["compute_cap"]
    arches = [f"sm_{cap // 10}" for cap in COMPUTE_CAPS]
    assert arches == list(ARCHES) and admitted == {"gte": min(COMPUTE_CAPS), "lte": max(COMPUTE_CAPS)}
    done = run_in(built_image, ["python", "-m", "pytest_ppsmoke.stage.cudacheck"], {"CUDA": "0"})
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["nvrtc"] == str(OfferQuery().min_cuda), result
    for arch in arches:
        for dtype in ("half", "bfloat16"):
            assert result[f"{arch} {dtype}"]["ptx_bytes"] > 1000 and result[f"{arch} {dtype}"]["ptx_isa"] == "8.4"
    # the headers come from the image's CUDA_PATH: without it, the first f16 kernel fails, in one line
    bare = run_in(built_image, ["python", "-m", "pytest_ppsmoke.stage.cudacheck"], {"CUDA": "0", "CUDA_PATH": ""})
    assert bare.returncode == 1, bare.stdout
    # (buildah run adds its own lines after the command's)
    (line,) = [ln for ln in bare.stderr.splitlines() if ln.startswith("cudacheck:")]
    assert line.startswith(f"cudacheck: {arches[0]} half:") and 'cannot open source file "cuda_fp16.h"' in line, line
    # the next compute capability past the range (Blackwell's 10.0 and 12.0): the image's NVRTC refuses it
    each = "for a in sm_100 sm_120; do python -m pytest_ppsmoke.stage.cudacheck --arch $a; echo $a=$?; done"
    past = run_in(built_image, ["sh", "-c", each], {"CUDA": "0"})  # one container for both
    assert "sm_100=1" in past.stdout and "sm_120=1" in past.stdout, (past.stdout, past.stderr[-1000:])
    refused = [ln for ln in past.stderr.splitlines() if ln.startswith("cudacheck:")]
    assert [ln.split()[1] for ln in refused] == ["sm_100", "sm_120"], refused
    assert all("NVRTC_ERROR_INVALID_OPTION" in ln for ln in refused), refused


@pytest.fixture(scope="module")
def published(built_image: str) -> Iterator[test_registry.LocalRegistry]:
    """The built image in a real registry on loopback (its storage kept between runs: .ci/run's
    setup pushes it once); ``.pushed`` is the name a create call carries."""
    why = test_registry.missing()
    if why:
        pytest.skip(f"the image's registry needs docker-registry: {why}")
    with test_registry.LocalRegistry(test_registry.NODE_REGISTRY) as reg:
        reg.pushed = reg.push(built_image, test_registry.NODE_REPOSITORY)
        yield reg


def test_the_image_carries_each_programs_cubin_for_every_admitted_architecture(built_image: str) -> None:
    """The programs made ahead when the image was built (docs/image.md, "Programs in the image"):
    for every architecture the offers admit, the same programs, each stored with a cubin whose ELF
    header names that architecture, stamped for this tinygrad's renderer of it (what a worker on
    such a GPU checks before it loads one), made by the image's own NVRTC. Read inside the image,
    from the database its nodes open."""
    done = run_in(built_image, ["python", "-m", "pytest_ppsmoke.stage.prebuild", "--check", " ".join(ARCHES)])
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert lines, (done.stdout, done.stderr)
    checked = json.loads(lines[-1])
    assert done.returncode == 0 and checked["ok"] and not checked["missing"], checked
    assert checked["cache"] == "/opt/cache/tinygrad/cache.db", checked  # where a node's tinygrad looks
    assert sorted(checked["arches"]) == sorted(ARCHES), checked
    nvrtc = re.search(r"nvidia-cuda-nvrtc-cu12==(\d+\.\d+)", (ROOT / "pyproject.toml").read_text())
    assert nvrtc is not None
    for arch, found in checked["arches"].items():
        assert found["elf"] == [arch] and found["nvrtc"] == [nvrtc.group(1)], (arch, found)
        assert found["programs"] == found["elf_arch_ok"] == found["stamp_ok"], (arch, found)
    # a kernel's program is keyed by its AST, which names no device: every architecture has them all
    assert len({found["programs"] for found in checked["arches"].values()}) == 1, checked


@pytest.mark.image
@pytest.mark.timeout(1200)  # a cold build takes minutes; .ci/run builds first, so it is found up to date
async def test_a_smoke_run_passes_with_both_nodes_in_the_image(
    published: test_registry.LocalRegistry, tmp_path: Path, synth_model: str
) -> None:
    """The image as vast.ai's hosts get it: the pre-flight asks the registry for it, each
    instance pulls it by name (anonymously, from the registry), then runs its entrypoint."""
    name = published.pushed
    programs = tmp_path / "programs"
    programs.mkdir()
    os.chown(programs, 1000, 1000)  # the image's user
    runtime = type("SharedPrograms", (TaggedImage,), {"programs": programs})
    async with FakeVast(runtime=runtime) as fake:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pytest_ppsmoke.harness.cli", "--local", "--vast-url", fake.url,
            "--image", name, "--model", synth_model, "--max-tokens", "4", "--reference", "off",
            "--poll-interval", "1", "-v", "--report", str(tmp_path / "r.json"),
            env={**os.environ, "VAST_API_KEY": fake.api_key},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        talk = asyncio.ensure_future(proc.communicate())
        try:
            _, err = await asyncio.wait_for(asyncio.shield(talk), 240)
        except TimeoutError:  # what the run printed, so that a hang says where it was
            proc.terminate()
            _, err = await asyncio.wait_for(talk, 60)
            pytest.fail(f"pp-smoke-run did not end within 240 s:\n{err.decode()[-3000:]}")
        nodes = "".join(f"\ninstance {i.id}: {i.proc.stderr_tail()[-1500:]}" for i in fake.destroyed if i.proc)
        assert proc.returncode == 0, err.decode()[-3000:] + nodes
        report = json.loads((tmp_path / "r.json").read_text())
        assert report["ok"] and 1 <= len(report["token_ids"]) <= 4
        checked = report["preflight"]["image"]
        assert checked["image"] == name and checked["platforms"] == ["linux/amd64"], checked
        assert checked["compressed_bytes"] > 100e6  # the registry's layers, as a host downloads them
        assert [i["final_state"] for i in report["instances"]] == ["destroyed", "destroyed"]
        # each instance ran as the image's entrypoint in its own working container, now removed
        assert len(fake.destroyed) == 2 and not fake.instances
        for inst in fake.destroyed:
            assert inst.image == name and inst.container is not None and inst.proc is not None, inst
            argv = inst.proc.argv
            assert argv[:4] == [*image.BUILDAH, "run"] and argv[-2:] == ["--", "pp-gpu-node"], argv
            assert inst.container.name in argv and inst.proc.proc is not None
            await asyncio.wait_for(inst.proc.proc.wait(), 30)
        await fake.torn_down()  # the containers are removed after their processes end
        prefix = fake.container_prefix
        assert await asyncio.to_thread(image.containers, prefix) == [], "a working container was left"
    # the containers' processes carry the test's tag (TaggedImage passes it in): none is left
    # (but the registry, the module's, which its fixture stops)
    assert published.proc is not None
    left = tagged_processes(os.environ[TEST_TAG])
    assert set(left) <= {published.proc.pid}, left

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
from pathlib import Path

import pytest

from pytest_ppsmoke import DEFAULT_IMAGE
from pytest_ppsmoke.cloud import image
from pytest_ppsmoke.cloud.emulator import registry, server
from pytest_ppsmoke.cloud.emulator.catalogue import default_catalogue
from pytest_ppsmoke.cloud.emulator.instances import Instance
from pytest_ppsmoke.cloud.emulator.runtimes import Image, NetworkMembers, Runtime
from pytest_ppsmoke.cloud.emulator.server import FakeVast
from pytest_ppsmoke.harness import settings
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
    assert "nvidia/cuda" in args["BASE"] and "runtime" in args["BASE"]  # nvrtc, for tinygrad's CUDA
    assert ("FROM", "${BASE}") in ins and "BAKE_MODEL" in args
    assert ins[-1] == ("ENTRYPOINT", '["pp-gpu-node"]')  # exec form: signals reach the node
    assert [a for w, a in ins if w == "USER"] == ["node"]
    env = " ".join(a for w, a in ins if w == "ENV")
    assert "CUDA=1" in env
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
    assert "pip install /src" in runs and "rm -rf /var/lib/apt/lists/*" in runs


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
    test left running by it, and a container gets none of the emulator's environment."""

    def container_env(self, inst: Instance) -> dict[str, str]:
        return super().container_env(inst) | {TEST_TAG: os.environ[TEST_TAG]}


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


@pytest.mark.image
@pytest.mark.timeout(1200)  # a cold build takes minutes; .ci/run builds first, so it is found up to date
async def test_a_smoke_run_passes_with_both_nodes_in_the_image(
    built_image: str, tmp_path: Path, synth_model: str
) -> None:
    async with FakeVast(runtime=TaggedImage) as fake:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pytest_ppsmoke.harness.cli", "--local", "--vast-url", fake.url,
            "--image", built_image, "--model", synth_model, "--max-tokens", "4", "--reference", "off",
            "--poll-interval", "1", "--report", str(tmp_path / "r.json"),
            env={**os.environ, "VAST_API_KEY": fake.api_key},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 240)
        assert proc.returncode == 0, err.decode()[-3000:]
        report = json.loads((tmp_path / "r.json").read_text())
        assert report["ok"] and 1 <= len(report["token_ids"]) <= 4
        assert [i["final_state"] for i in report["instances"]] == ["destroyed", "destroyed"]
        # each instance ran as the image's entrypoint in its own working container, now removed
        assert len(fake.destroyed) == 2 and not fake.instances
        for inst in fake.destroyed:
            assert inst.container is not None and inst.proc is not None, inst
            argv = inst.proc.argv
            assert argv[:4] == [*image.BUILDAH, "run"] and argv[-2:] == ["--", "pp-gpu-node"], argv
            assert inst.container.name in argv and inst.proc.proc is not None
            await asyncio.wait_for(inst.proc.proc.wait(), 30)
        await fake.torn_down()  # the containers are removed after their processes end
        prefix = fake.container_prefix
        assert await asyncio.to_thread(image.containers, prefix) == [], "a working container was left"
    # the containers' processes carry the test's tag (TaggedImage passes it in): none is left
    assert tagged_processes(os.environ[TEST_TAG]) == {}

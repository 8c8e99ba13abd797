"""On CUDA GPUs (the ``gpu`` marker; skipped where there is none): two stages, each a
``pp-gpu-node`` on its own GPU, rented through the emulator, give the unsplit model's tokens.

Run where GPUs are: ``CUDA=1 python -m pytest -m gpu tests/test_gpu.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_ppsmoke.cloud.fake_vast import FakeVast
from pytest_ppsmoke.cloud.lifecycle import Deployment, RunConfig
from pytest_ppsmoke.cloud.vast import VastClient
from pytest_ppsmoke.harness.pipeline import run_inference
from pytest_ppsmoke.stage.synth import SHAPES, write

pytestmark = pytest.mark.gpu


def cuda_gpus() -> list[str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


GPUS = cuda_gpus()


@pytest.fixture
def on_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    if not GPUS:
        pytest.skip("no CUDA GPU on this machine (nvidia-smi lists none)")
    monkeypatch.setenv("CUDA", "1")  # tinygrad's CUDA backend, in the nodes and their workers too
    yield (GPUS * 2)[:2]


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    write(path, SHAPES["tiny"])
    return path


@pytest.fixture
def reference(on_cuda: list[str], tiny: Path) -> list[int]:
    """The unsplit model's tokens on the first GPU, in a process of its own."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": on_cuda[0]}
    ref = subprocess.run([sys.executable, "-c", REFERENCE, str(tiny)], capture_output=True, text=True, env=env)
    assert ref.returncode == 0, ref.stderr[-3000:]
    return json.loads(ref.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


REFERENCE = """
import json, sys
from pytest_ppsmoke.runtime.codec import WireDtype
from pytest_ppsmoke.stage.model import reference_tokens
print(json.dumps(reference_tokens(sys.argv[1], "Say hello", 8, WireDtype.f32)))
"""


async def test_two_stages_on_two_gpus_give_the_unsplit_models_tokens(
    on_cuda: list[str], tiny: Path, reference: list[int]
) -> None:
    async with FakeVast(gpus=on_cuda) as fake, VastClient(fake.api_key, fake.url) as vast:
        config = RunConfig(model=str(tiny), wire_dtype="f32", poll_interval=0.25)
        async with Deployment(vast, config) as dep:
            assert dep.seed is not None
            result = await run_inference(dep.seed, 2, "Say hello", 8, timeout=300)
            seen = sorted(i.proc.env["CUDA_VISIBLE_DEVICES"] for i in fake.live() if i.proc)
    assert seen == sorted(on_cuda)  # one GPU each
    assert result.token_ids == reference
    assert fake.live() == []

"""On CUDA GPUs (the ``gpu`` marker; skipped where there is none): two stages, each a
``pp-gpu-node`` on its own GPU (one GPU serves both where there is one), rented through the
emulator, give the tokens of the model run in one piece on stage 0's GPU.

Run where GPUs are: ``CUDA=1 python -m pytest -m gpu tests/test_gpu.py -n 0``.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_ppsmoke.cloud.emulator.server import FakeVast
from pytest_ppsmoke.cloud.vast import VastClient
from pytest_ppsmoke.harness.deployment import Deployment, RunConfig
from pytest_ppsmoke.harness.pipeline import request_reference, run_inference
from pytest_ppsmoke.protocol import reference_method
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


@pytest.mark.parametrize("wire", ["f32", "bf16"])
async def test_two_stages_on_two_gpus_give_the_unsplit_models_tokens(on_cuda: list[str], tiny: Path, wire: str) -> None:
    """The reference is the one the spec suite uses: after the request, stage 0's node runs the
    model in one piece on its own GPU (``ReferenceQuery``), through tinygrad's ``generate``."""
    async with FakeVast(gpus=on_cuda) as fake, VastClient(fake.api_key, fake.url) as vast:
        # the f32 run's reference is loaded beside the stages (the default), the bf16 run's after
        loaded = "beside" if wire == "f32" else "after"
        config = RunConfig(model=str(tiny), wire_dtype=wire, poll_interval=0.25, reference_load=loaded)
        async with Deployment(vast, config) as dep:
            assert dep.seed is not None
            result = await run_inference(dep.seed, 2, "Say hello", 8, timeout=300)
            reference = await request_reference(dep.seed, "Say hello", 8, timeout=300)
            seen = sorted(i.proc.env["CUDA_VISIBLE_DEVICES"] for i in fake.live() if i.proc)
    assert seen == sorted(on_cuda)  # one GPU each
    assert (reference.stage, reference.device, reference.method) == (0, "CUDA", reference_method(wire))
    assert reference.prompt_token_ids == tuple(result.prompt_token_ids)
    assert result.token_ids == list(reference.token_ids)
    assert reference.loaded == loaded
    if loaded == "after":
        assert reference.mem_after <= reference.mem_before  # the reference's model was dropped
    else:
        assert reference.mem_after > reference.mem_before  # kept by its own worker
    assert fake.live() == []

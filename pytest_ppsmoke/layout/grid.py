"""A grid run: every (network, stage count, wire, prompt length) of a :class:`GridSpec` measured
through the real path, the emulator renting the instances, in one session.

    grid = asyncio.run(run_grid(GridSpec(prompts=(32, 128, 512), stages=(1, 2, 4))))

For each network the emulator makes it once (``FakeVast(network=...)``); for each stage count and
wire one deployment serves every prompt length (its workers are loaded once); for each prompt
length one warm-up request, then ``repeats`` measured ones. A point records each repeat's time to
first token and time per output token, every hop (bytes, seconds: the sender's and receiver's
stamps) and every worker call (blocks, tokens, seconds inside the worker), and the instances'
$/hour. Stage count 1 is the model unsplit, tinygrad's own ``generate`` in a process of its own
on this machine (``layout/unsplit.py``): it has no hops, so one measurement serves every network.

A prompt of a target length is the chat template around ``hello`` repeated: the template's own
tokens are learnt from the first request, and the point keeps the length the model saw.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..protocol import layer_range
from .points import Grid, HopSample, Point, StageSample

Log = Callable[[str], None]


@dataclass(frozen=True)
class GridSpec:
    model: str = "smollm2:135m"
    prompts: tuple[int, ...] = (32, 128, 512)  # target prompt lengths, template included
    stages: tuple[int, ...] = (1, 2, 3, 4)
    networks: tuple[str, ...] = ("loopback", "wan", "far")
    wires: tuple[str, ...] = ("bf16",)
    repeats: int = 2
    max_tokens: int = 12
    timeout: float = 600.0  # seconds for one request
    gpus: tuple[str, ...] = ()  # this machine's GPUs, one per instance in turn (FakeVast's gpus)

    def check(self) -> None:
        if not self.prompts or min(self.prompts) < 1:
            raise ValueError(f"prompt lengths must be positive token counts, got {self.prompts}")
        if not self.stages or min(self.stages) < 1:
            raise ValueError(f"stage counts must be at least 1, got {self.stages}")
        if self.repeats < 1 or self.max_tokens < 8:
            raise ValueError(
                f"repeats must be >= 1 and max_tokens >= 8 (decode is timed past its first tokens), "
                f"got {self.repeats} and {self.max_tokens}"
            )


SMALL = {"prompts": (32, 64, 96), "stages": (1, 2), "networks": ("loopback",), "repeats": 1, "max_tokens": 8}
_KEYS = {"prompts": int, "stages": int, "networks": str, "wires": str, "repeats": int, "max_tokens": int}


def grid_spec(text: str, model: str) -> GridSpec | None:
    """A grid described in one setting (``--ppsmoke-grid``): ``off``; ``small`` (prompts 32, 64
    and 96, 1 and 2 stages, loopback, one repeat); or ``key=value`` items separated by ``;``, with
    keys prompts, stages, networks, wires (comma-separated) and repeats, max_tokens, over small's
    values: ``prompts=32,128,512;stages=1,2,4;networks=loopback,wan``."""
    text = text.strip()
    if text in ("", "off"):
        return None
    values: dict[str, Any] = dict(SMALL)
    if text != "small":
        for item in filter(None, (i.strip() for i in text.split(";"))):
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or key not in _KEYS:
                raise ValueError(f"grid item {item!r}: expected key=value with a key among {', '.join(_KEYS)}")
            kind = _KEYS[key]
            try:
                parts = tuple(kind(v.strip()) for v in raw.split(",") if v.strip())
            except ValueError:
                raise ValueError(f"grid item {item!r}: {key} takes {kind.__name__} values") from None
            if not parts:
                raise ValueError(f"grid item {item!r}: no value")
            values[key] = parts[0] if key in ("repeats", "max_tokens") else parts
    spec = GridSpec(model=model, **values)
    spec.check()
    return spec


def prompt_text(target: int, template_tokens: int, word_tokens: int = 1) -> str:
    """A prompt that the chat template makes about ``target`` tokens long (at least one word):
    ``template_tokens`` around the prompt, ``word_tokens`` for each ``hello``."""
    return " ".join(["hello"] * max(1, round((target - template_tokens) / max(1, word_tokens))))


def _tpot(stamps: list[float], skip: int = 2) -> float:
    """Time per output token: the median gap between consecutive tokens after the first ``skip``."""
    gaps = sorted(b - a for a, b in zip(stamps[skip:], stamps[skip + 1 :], strict=False))
    if not gaps:
        raise ValueError(f"too few tokens to time decode: {len(stamps)}")
    return gaps[len(gaps) // 2]


def samples(r: Any, num_blocks: int, num_stages: int) -> tuple[list[HopSample], list[StageSample], list[float]]:
    """A request's hops, worker calls and token stamps (``r``: a pipeline.InferenceResult)."""
    hops: list[HopSample] = []
    for a, b in zip(r.stages, r.stages[1:], strict=False):
        received = {h.position: h for h in b.activations_in if h.request_id == a.request_id or not h.request_id}
        for out in a.hops_out:
            got = received.get(out.position)
            if got is not None:
                phase = "prefill" if out.seq_len > 1 or out.position == 0 else "decode"
                hops.append(HopSample(phase, int(out.bytes), max(0.0, got.at - out.at)))
    compute: list[StageSample] = []
    for st in r.stages:
        lo, hi = layer_range(num_blocks, st.stage, num_stages)
        for c in st.compute:
            if c.op not in ("embed_and_forward", "decode_step", "forward", "forward_and_sample") or c.worker_s is None:
                continue
            prefill = (c.position or 0) == 0
            tokens = len(r.prompt_token_ids) if prefill else 1
            phase = "prefill" if prefill else "decode"
            last = st.stage == num_stages - 1
            compute.append(StageSample(st.stage, hi - lo, st.stage == 0, last, phase, tokens, float(c.worker_s)))
    last = r.stages[-1]
    stamps = [c.at + c.s for c in last.compute if c.op == "forward_and_sample"]
    return hops, compute, stamps


async def _pipeline_points(spec: GridSpec, network: str, grid: Grid, log: Log) -> None:
    from ..cloud.fake_vast import FakeVast
    from ..cloud.lifecycle import Deployment, RunConfig
    from ..cloud.vast import VastClient
    from ..harness.driver import rtt_of
    from ..harness.pipeline import run_inference

    gpus = list(spec.gpus) or None
    async with FakeVast(network=network, gpus=gpus) as fake, VastClient(fake.api_key, fake.url) as vast:
        net = fake.network
        rtt = rtt_of(net.spec) if net is not None else 0.0
        for n in (s for s in spec.stages if s >= 2):
            for wire in spec.wires:
                config = RunConfig(model=spec.model, num_stages=n, wire_dtype=wire, poll_interval=0.25)
                if net is not None:
                    config.bind, config.rtt = f"{net.host_addr}:0", rtt
                async with Deployment(vast, config) as dep:
                    assert dep.seed is not None
                    dph = [i.offer.dph_total for i in dep.instances]
                    one = len((await run_inference(dep.seed, n, "hello", 2, spec.timeout)).prompt_token_ids)
                    two = len((await run_inference(dep.seed, n, "hello hello", 2, spec.timeout)).prompt_token_ids)
                    word = max(1, two - one)
                    template = one - word
                    dim = dep.ready[0].dim  # every node said ready with its dim and blocks (load)
                    blocks = max(st.end_block for st in dep.ready.values())
                    for target in spec.prompts:
                        prompt = prompt_text(target, template, word)
                        await run_inference(dep.seed, n, prompt, 2, spec.timeout)  # warm-up at this length
                        point = Point(network, rtt * 1000, n, wire, 0, dim, blocks, dph=dph)
                        for _ in range(spec.repeats):
                            started = time.monotonic()
                            r = await run_inference(dep.seed, n, prompt, spec.max_tokens, spec.timeout)
                            hops, compute, stamps = samples(r, blocks, n)
                            point.prompt_tokens = len(r.prompt_token_ids)
                            point.ttft_s.append(float(r.timings["prefill"]))
                            point.tpot_s.append(_tpot(stamps))
                            point.hops += hops
                            point.compute += compute
                            log(
                                f"{network} {n} stages {wire} P={point.prompt_tokens}: "
                                f"ttft {point.ttft_s[-1]:.3f} s, tpot {1e3 * point.tpot_s[-1]:.1f} ms "
                                f"({time.monotonic() - started:.1f} s)"
                            )
                        grid.points.append(point)


def _unsplit_points(spec: GridSpec, grid: Grid, log: Log) -> None:
    """Stage count 1 on this machine, once, copied to every network (no hop depends on it)."""
    from ..harness.driver import rtt_of
    from ..network import parse_network

    cheapest = min((min(p.dph) for p in grid.points if p.dph), default=0.0)
    for target in spec.prompts:
        argv = [
            sys.executable, "-m", "pytest_ppsmoke.layout.unsplit", "--model", spec.model, "--target", str(target),
            "--max-tokens", str(spec.max_tokens), "--repeats", str(spec.repeats),
        ]  # fmt: skip
        env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": spec.gpus[0]} if spec.gpus else {})}
        out = subprocess.run(argv, capture_output=True, text=True, timeout=spec.timeout * (spec.repeats + 1), env=env)
        if out.returncode:
            raise RuntimeError(f"the unsplit model failed at a {target}-token prompt: {out.stderr[-2000:]}")
        m = json.loads(out.stdout.strip().splitlines()[-1])
        for network in spec.networks:
            rtt = 0.0 if network == "loopback" else rtt_of(parse_network(network))
            point = Point(network, rtt * 1000, 1, "f32", m["prompt_tokens"], m["dim"], m["num_blocks"])
            point.ttft_s, point.tpot_s = list(m["ttft_s"]), list(m["tpot_s"])
            point.compute = [StageSample(**c) for c in m["compute"]]
            point.dph = [cheapest]
            grid.points.append(point)
        log(f"unsplit P={m['prompt_tokens']}: ttft {m['ttft_s']} s, tpot {m['tpot_s']} s")


async def run_grid(spec: GridSpec, log: Log = print) -> Grid:
    """Measure every point of ``spec``; the middle prompt length's points are held out of the fit."""
    spec.check()
    grid = Grid(
        spec.model,
        device=f"CUDA GPUs {','.join(spec.gpus)}" if spec.gpus else "CPU (tinygrad clang)",
        machine=f"{os.cpu_count()} cores, Python {platform.python_version()}",
        when=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    for network in spec.networks:
        await _pipeline_points(spec, network, grid, log)
    if 1 in spec.stages:
        await asyncio.to_thread(_unsplit_points, spec, grid, log)
    middle = sorted(spec.prompts)[len(spec.prompts) // 2] if len(spec.prompts) >= 3 else None
    if middle is not None:
        lengths = sorted({p.prompt_tokens for p in grid.points})
        held = min(lengths, key=lambda n: abs(n - middle)) if lengths else None
        grid.held_out = [i for i, p in enumerate(grid.points) if p.prompt_tokens == held]
    return grid

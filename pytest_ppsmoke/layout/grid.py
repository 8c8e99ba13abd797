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
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..harness.gridspec import WEIGHTS, GridSpec
from ..messages import WeightLoad, from_json
from ..protocol import layer_range
from .points import Grid, HopSample, Point, StageSample

if TYPE_CHECKING:
    from ..harness.settings import Settings
    from ..harness.setup import Place

Log = Callable[[str], None]


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
        free_at = None  # when the stage's previous call ended, as its node saw it
        for c in sorted(st.compute, key=lambda c: c.at):
            idle, free_at = (0.0 if free_at is None else max(0.0, c.at - free_at)), c.at + c.s
            if c.op not in ("embed_and_forward", "decode_step", "forward", "forward_and_sample") or c.worker_s is None:
                continue
            prefill = (c.position or 0) == 0
            tokens = len(r.prompt_token_ids) if prefill else 1
            phase = "prefill" if prefill else "decode"
            last = st.stage == num_stages - 1
            sample = StageSample(st.stage, hi - lo, st.stage == 0, last, phase, tokens, float(c.worker_s))
            if not prefill:
                sample = dataclasses.replace(sample, context=int(c.position or 0), idle_s=idle)
            compute.append(sample)
    last = r.stages[-1]
    stamps = [c.at + c.s for c in last.compute if c.op == "forward_and_sample"]
    return hops, compute, stamps


async def _points_on(spec: GridSpec, settings: Settings, grid: Grid, log: Log, network: str | None = None) -> None:
    """Every split layout on one place (``setup.open_place``): on the embedded emulator, one per
    network of the grid, its catalogue widened to the grid's largest stage count; on a vast.ai
    API (the settings' key and URL: vast.ai itself, or an emulator started apart) the one network
    between the instances it rents (``vastai``; an emulator's its own), whose round trip the
    points record as measured (twice the median decode hop)."""
    from ..harness.settings import face_names
    from ..harness.setup import open_place

    name = network or ("vastai" if not settings.local else settings.network)
    async with await open_place(settings, network=network, stages=max(spec.stages), names=face_names("cli")) as place:
        await _layouts(spec, place, name, grid, log)
    if name == "vastai":
        for p in grid.points:
            decode = sorted(h.seconds for h in p.hops if h.phase == "decode")
            if decode:
                p.rtt_ms = 2e3 * decode[len(decode) // 2]


async def _layouts(spec: GridSpec, place: Place, network: str, grid: Grid, log: Log) -> None:
    """One deployment per split stage count and wire (the place's config for the rest), serving
    every prompt length: a warm-up, then the repeats."""
    from ..harness.pipeline import run_inference

    base, rtt = place.config, place.config.rtt
    for n in (s for s in spec.stages if s >= 2):
        for wire in spec.wires:
            env = {**base.extra_env, "HALF": WEIGHTS[spec.weights]}  # the nodes hand it to their workers
            async with place.deployment(model=spec.model, num_stages=n, wire_dtype=wire, extra_env=env) as dep:
                assert dep.seed is not None
                dph = [i.offer.dph_total for i in dep.instances]
                # a failure names each stage with its instance, as the run does
                places = dep.places()
                one = len((await run_inference(dep.seed, n, "hello", 2, spec.timeout, None, places)).prompt_token_ids)
                two = len(
                    (await run_inference(dep.seed, n, "hello hello", 2, spec.timeout, None, places)).prompt_token_ids
                )
                word = max(1, two - one)
                template = one - word
                dim = dep.ready[0].dim  # every node said ready with its dim and blocks (load)
                grid.weights = _check_weights(spec, [st.load.weights if st.load else None for st in dep.ready.values()])
                blocks = max(st.end_block for st in dep.ready.values())
                for target in spec.prompts:
                    prompt = prompt_text(target, template, word)
                    await run_inference(dep.seed, n, prompt, 2, spec.timeout, None, places)  # warm-up at this length
                    point = Point(network, rtt * 1000, n, wire, 0, dim, blocks, dph=dph)
                    for _ in range(spec.repeats):
                        started = time.monotonic()
                        r = await run_inference(dep.seed, n, prompt, spec.max_tokens, spec.timeout, None, places)
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


def _check_weights(spec: GridSpec, loads: list[WeightLoad | None]) -> str:
    """The weights' dtype of every worker's load (``NodeStatus.load.weights``; None: the worker
    did not say), which must be one and made with the grid's HALF, or the setting did not reach a
    worker (HALF is handed down as this process's environment, which the process runtime's nodes
    inherit)."""
    half = WEIGHTS[spec.weights]
    wrong = [w for w in loads if w is None or not w.dtype or str(w.half) != half]
    if wrong:
        said = "nothing" if wrong[0] is None else f"{wrong[0].dtype or 'no dtype'} with HALF={wrong[0].half}"
        raise RuntimeError(
            f"the grid asked for {spec.weights} weights (HALF={half}) but a worker loaded: {said}; "
            "start the nodes with this process's environment (the process runtime)"
        )
    dtypes = sorted({w.dtype for w in loads if w is not None})
    if len(dtypes) != 1:
        raise RuntimeError(f"the workers loaded their weights in different dtypes: {dtypes}")
    return dtypes[0]


def _unsplit_points(spec: GridSpec, grid: Grid, log: Log) -> None:
    """Stage count 1 on this machine, once, copied to every network (no hop depends on it)."""
    from ..harness.setup import rtt_of
    from ..network import parse_network

    cheapest = min((min(p.dph) for p in grid.points if p.dph), default=0.0)
    for target in spec.prompts:
        argv = [
            sys.executable, "-m", "pytest_ppsmoke.layout.unsplit", "--model", spec.model, "--target", str(target),
            "--max-tokens", str(spec.max_tokens), "--repeats", str(spec.repeats),
        ]  # fmt: skip
        env = {**os.environ, "HALF": WEIGHTS[spec.weights]}
        if spec.gpus:
            env["CUDA_VISIBLE_DEVICES"] = spec.gpus[0]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=spec.timeout * (spec.repeats + 1), env=env)
        if out.returncode:
            raise RuntimeError(f"the unsplit model failed at a {target}-token prompt: {out.stderr[-2000:]}")
        m = json.loads(out.stdout.strip().splitlines()[-1])
        grid.weights = _check_weights(spec, [from_json(WeightLoad, m["weights"], "the unsplit model's weights")])
        for network in spec.networks:
            rtt = 0.0 if network == "loopback" else rtt_of(parse_network(network))
            point = Point(network, rtt * 1000, 1, "f32", m["prompt_tokens"], m["dim"], m["num_blocks"])
            point.ttft_s, point.tpot_s = list(m["ttft_s"]), list(m["tpot_s"])
            point.compute = [StageSample(**c) for c in m["compute"]]
            point.dph = [cheapest]
            grid.points.append(point)
        log(f"unsplit P={m['prompt_tokens']}: ttft {m['ttft_s']} s, tpot {m['tpot_s']} s")


HOLD_OUT = ("layouts", "prompt", "largest", "stages=N")  # the schemes, as the CLI names them


def hold_out(points: list[Point], scheme: str = "layouts") -> list[int]:
    """The points a fit must not see. ``layouts``: on each network (in the order measured) one
    split stage count, another on each network in turn (a Latin square), at every prompt length:
    layouts the fit never saw on that network, the question a user asks before renting; with
    fewer than two split stage counts, ``prompt``. ``prompt``: every point of the middle prompt
    length (interpolating between two lengths; needs three). ``largest``: every point of the
    largest split stage count, on every network at every prompt length (extrapolating in stages:
    needs two split stage counts); ``stages=N``: every point of stage count N (at least 2).
    Unsplit points are never held out: one measurement serves every network."""
    if scheme not in ("layouts", "prompt", "largest") and not scheme.startswith("stages="):
        raise ValueError(f"hold-out scheme {scheme!r}: expected one of {', '.join(HOLD_OUT)}")
    split = sorted({p.stages for p in points if p.stages > 1})
    if scheme == "largest" or scheme.startswith("stages="):
        if scheme == "largest":
            if len(split) < 2:
                raise ValueError(f"hold-out scheme largest: needs two split stage counts, the grid has {split}")
            n = split[-1]
        else:
            try:
                n = int(scheme.removeprefix("stages="))
            except ValueError:
                raise ValueError(f"hold-out scheme {scheme!r}: expected stages=N, N a stage count") from None
            if n not in split:
                raise ValueError(f"hold-out scheme {scheme!r}: the grid's split stage counts are {split}")
            if len(split) < 2:
                raise ValueError(
                    f"hold-out scheme {scheme!r}: the fit needs another split stage count, the grid has {split}"
                )
        return [i for i, p in enumerate(points) if p.stages == n]
    if scheme == "layouts" and len(split) >= 2:
        networks = list(dict.fromkeys(p.network for p in points))
        pick = {net: split[(i + 1) % len(split)] for i, net in enumerate(networks)}
        return [i for i, p in enumerate(points) if p.stages > 1 and pick[p.network] == p.stages]
    lengths = sorted({p.prompt_tokens for p in points})
    if len(lengths) < 3:
        return []
    middle = lengths[len(lengths) // 2]
    return [i for i, p in enumerate(points) if p.prompt_tokens == middle]


def _gpus(spec: GridSpec, settings: Settings | None) -> list[str]:
    """This machine's GPUs for the instances: the grid's, else the run's ``--gpus``."""
    return list(spec.gpus) or ([g for g in settings.gpus.split(",") if g] if settings else [])


def new_grid(spec: GridSpec, settings: Settings | None = None) -> Grid:
    """An empty grid of ``spec`` measured as ``run_grid`` with ``settings`` would."""
    gpus = _gpus(spec, settings)
    grid = Grid(
        spec.model,
        device=f"CUDA GPUs {','.join(gpus)}" if gpus else "CPU (tinygrad clang)",
        machine=f"{os.cpu_count()} cores, Python {platform.python_version()}",
        when=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    if settings is not None and not settings.embedded_emulator:
        grid.device, grid.machine = f"instances rented from {settings.vast_url or 'vast.ai'}", "one stage each"
    return grid


async def run_grid(
    spec: GridSpec, log: Log = print, settings: Settings | None = None, grid: Grid | None = None
) -> Grid:
    """Measure every point of ``spec`` and choose the points held out of the fit (``hold_out``).
    With ``settings`` (``pp-smoke-run --grid``, pytest's ``--ppsmoke-grid``) the deployments are
    made as that run's would be: on an embedded emulator, one per network of the grid (its
    runtime, its GPUs); on a vast.ai API (its key and URL, vast.ai itself or an emulator started
    apart) on the instances it rents, the one network between them, and with no unsplit point
    (stage count 1 runs on this machine). ``grid`` (default: ``new_grid``'s) is filled point by
    point: a caller that passes its own keeps what was measured when a deployment fails."""
    spec.check()
    grid = new_grid(spec, settings) if grid is None else grid
    if settings is None:  # a local run's settings, on this machine's GPUs where the grid names them
        from ..harness.settings import Settings

        settings = Settings.resolve({"mode": "local", "model": spec.model, "gpus": ",".join(spec.gpus)})
    elif spec.gpus:
        settings = dataclasses.replace(settings, gpus=",".join(spec.gpus))
    if not settings.embedded_emulator:
        await _points_on(spec, settings, grid, log)
        if 1 in spec.stages:
            log("stage count 1 (the model unsplit) runs on this machine: left out of a grid on rented instances")
    else:
        for network in spec.networks:
            await _points_on(spec, settings, grid, log, network)
        if 1 in spec.stages:
            await asyncio.to_thread(_unsplit_points, spec, grid, log)
    grid.held_out = hold_out(grid.points)
    return grid

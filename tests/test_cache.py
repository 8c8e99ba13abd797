"""The weight cache and the program cache (pytest_ppsmoke/stage/cache.py): a warm load is a read
and computes the same bytes; a cache of another model, file or tinygrad version, or a damaged
file, is never used. On the session's synthetic model; the worker runs as its own process."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
from tinygrad import nn

from pytest_ppsmoke.messages import LoadFigures
from pytest_ppsmoke.stage import binaries
from pytest_ppsmoke.stage import cache as cache_mod
from pytest_ppsmoke.stage.cache import Part, WeightCache
from pytest_ppsmoke.stage.model import StageModel, load_model, realized_model
from pytest_ppsmoke.stage.pipe import (
    DecodeStep,
    EmbedAndForward,
    ErrorReply,
    Framing,
    PipeError,
    Ready,
    Request,
    RunReference,
    Shutdown,
    decode_reply,
    encode_request,
    progress_of,
    read_ready,
)
from pytest_ppsmoke.stage.synth import write

from .helpers import SYNTH, SYNTH_SEED

R = TypeVar("R")

pytestmark = pytest.mark.local

WORKER = Path(__file__).resolve().parent.parent / "worker" / "pp_tinygrad_worker.py"


def owned_arrays(model: object, part: Part) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in nn.state.get_state_dict(model).items() if part.owns(k)}


def test_a_warm_load_holds_the_same_tensors_and_builds_no_block_it_does_not_own(
    synth_model: str, tmp_path: Path
) -> None:
    cache = WeightCache(tmp_path / "w")
    for stage in (0, 1):
        part = Part.of_stage(stage, 2, SYNTH.blocks)
        cold, _, first = realized_model(synth_model, 64, stage, 2, cache)
        warm, kv, second = realized_model(synth_model, 64, stage, 2, cache)
        assert (first.source, second.source) == ("gguf", "cache"), (first, second)
        assert first.path == second.path and Path(second.path).parent == cache.root and not second.note
        a, b = owned_arrays(cold, part), owned_arrays(warm, part)
        assert a.keys() == b.keys() and a  # the part's tensors, and only those, with the same bytes
        assert all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)
        assert [i for i, blk in enumerate(warm.blk) if blk is not None] == list(range(part.lo, part.hi))
        # the stage built on it computes what the GGUF's stage computes
        x = np.random.default_rng(stage).standard_normal((3, SYNTH.dim)).astype(np.float32)
        s_cold, s_warm = StageModel(cold, kv, stage, 2), StageModel(warm, kv, stage, 2)
        if stage == 0:
            out = [s.embed_and_forward([5, 7, 11], 0, prefill=True) for s in (s_cold, s_warm)]
            assert np.array_equal(*out)
        else:
            assert s_cold.forward_and_sample(x, 0, True) == s_warm.forward_and_sample(x, 0, True)
        info = s_warm.kv_info().blocks
        assert [b.present for b in info] == [part.lo <= i < part.hi for i in range(SYNTH.blocks)]
        assert all(b.weights_realized for b in info if b.owned)


def test_another_model_a_changed_file_or_another_tinygrad_is_never_served_from_the_cache(
    synth_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = WeightCache(tmp_path / "w")
    assert realized_model(synth_model, 64, 0, 2, cache)[2].source == "gguf"
    assert realized_model(synth_model, 64, 0, 2, cache)[2].source == "cache"
    # another model (the same shape, other weights)
    other = tmp_path / "other.gguf"
    write(other, SYNTH, SYNTH_SEED + 1)
    model, _, load = realized_model(str(other), 64, 0, 2, cache)
    assert load.source == "gguf"
    expect = owned_arrays(load_model(str(other), 64)[0], Part.of_stage(0, 2, SYNTH.blocks))
    got = owned_arrays(model, Part.of_stage(0, 2, SYNTH.blocks))
    assert all(np.array_equal(expect[k], got[k]) for k in expect)
    # the same path written again with other weights: its content is the key, not its name
    write(other, SYNTH, SYNTH_SEED + 2)
    assert realized_model(str(other), 64, 0, 2, cache)[2].source == "gguf"
    assert realized_model(str(other), 64, 0, 2, cache)[2].source == "cache"
    # another tinygrad version, or another HALF, keys another file
    real = cache_mod.tinygrad_key()
    monkeypatch.setattr(cache_mod, "tinygrad_key", lambda: {**real, "tinygrad": "0.12.1"})
    assert realized_model(synth_model, 64, 0, 2, cache)[2].source == "gguf"
    monkeypatch.setattr(cache_mod, "tinygrad_key", lambda: {**real, "half": 1 - real["half"]})  # the other HALF
    assert realized_model(synth_model, 64, 0, 2, cache)[2].source == "gguf"
    assert len(cache.entries()) == 5


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("swap", "holds"),  # another key's file under this key's name
        ("flip", "do not match the digest"),
        ("truncate", "is truncated"),
        ("magic", "does not start as a weight cache file"),
    ],
)
def test_a_damaged_or_misplaced_file_is_ignored_said_and_written_again(
    synth_model: str, tmp_path: Path, damage: str, reason: str
) -> None:
    cache = WeightCache(tmp_path / "w")
    realized_model(synth_model, 64, 0, 2, cache)
    realized_model(synth_model, 64, 1, 2, cache)
    digest = cache.model_digest(Path(synth_model))
    path = cache.path_for(cache.key(digest, 0, 2))
    if damage == "swap":
        shutil.copyfile(cache.path_for(cache.key(digest, 1, 2)), path)
    else:
        raw = bytearray(path.read_bytes())
        if damage == "flip":
            raw[-100] ^= 0x40
        elif damage == "truncate":
            raw = raw[: len(raw) - 1000]
        else:
            raw[:4] = b"GGUF"
        path.write_bytes(bytes(raw))
    load = realized_model(synth_model, 64, 0, 2, cache)[2]
    assert load.source == "gguf" and reason in load.note and str(path) in load.note, load
    assert "weight cache not used" in LoadFigures(load).describe()  # the line a person sees
    assert realized_model(synth_model, 64, 0, 2, cache)[2].source == "cache"  # written again, whole


def test_the_directory_keeps_under_its_limit_least_recently_used_first(synth_model: str, tmp_path: Path) -> None:
    cache = WeightCache(tmp_path / "w")
    paths = []
    for stage, num_stages in ((0, 2), (1, 2), (0, 1)):
        paths.append(Path(realized_model(synth_model, 64, stage, num_stages, cache)[2].path))
    sizes = [p.stat().st_size for p in paths]
    os.utime(paths[0], (1, 1))  # the oldest use
    cache.max_bytes = sum(sizes) - 1
    assert cache.prune() == [paths[0]] and not paths[0].exists() and paths[1].exists() and paths[2].exists()
    assert WeightCache.from_setting("off") is None and WeightCache.from_setting("").root == cache_mod.DEFAULT_ROOT


def _start(env: dict[str, str]) -> tuple[subprocess.Popen[str], Ready]:
    proc = subprocess.Popen(
        [sys.executable, str(WORKER)], env=env, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        return proc, read_ready(proc.stdout.readline)
    except PipeError as e:
        raise AssertionError(proc.stderr.read() if proc.stderr else "") from e


def _ask(proc: subprocess.Popen[str], req: Request[R]) -> R:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(encode_request(1, req, Framing.json).decode())
    proc.stdin.flush()
    while progress_of(obj := json.loads(proc.stdout.readline())) is not None:  # a call's counts as it runs
        pass
    reply = decode_reply(req.reply, obj)
    assert not isinstance(reply, ErrorReply), reply
    return reply


def test_a_warm_worker_reads_its_weights_generates_no_program_and_answers_the_same(
    synth_model: str, tmp_path: Path
) -> None:
    """Two worker processes in turn on fresh caches (tinygrad's database included): the first
    realizes from the GGUF and generates its programs and schedules, the second reads all three,
    and their hidden states, tokens and reference are the same bytes."""
    env = {
        **os.environ,
        "MODEL": synth_model,
        "STAGE": "0",
        "NUM_STAGES": "2",
        "PP_WIRE_DTYPE": "f32",
        "PP_MAX_CONTEXT": "64",
        "PP_WEIGHT_CACHE": str(tmp_path / "w"),
        "CACHEDB": str(tmp_path / "tinygrad.db"),
    }
    answers, schedules = [], []
    for _ in ("cold", "warm"):
        proc, ready = _start(env)
        try:
            prefill = _ask(proc, EmbedAndForward((5, 7, 11), 0))
            steps = [_ask(proc, DecodeStep(9 + i, 3 + i)) for i in range(3)]
            ref = _ask(proc, RunReference("hi", 4))
            bye = _ask(proc, Shutdown())
            assert proc.wait(timeout=30) == 0
        finally:
            proc.kill()
            proc.wait()
        assert bye.programs is not None and bye.schedules is not None
        answers.append((ready, prefill, steps, ref, bye.programs))
        schedules.append(bye.schedules)
    (cold, *_, cold_programs), (warm, *_, warm_programs) = answers
    # every graph the warm worker ran (its prefill, the JIT's capture, the reference) was scheduled
    # by the cold one, whose model a GGUF load rebuilds as a cache load builds it; the GGUF's
    # dequantization graphs are not needed
    assert schedules[0].misses > 0 and schedules[0].hits == 0, schedules
    assert schedules[1].misses == 0 and 0 < schedules[1].hits < schedules[0].misses, schedules
    assert cold.weights is not None and warm.weights is not None and cold.programs and warm.programs
    assert cold.weights.source == "gguf" and cold.programs.misses > 0, cold
    assert warm.weights.source == "cache" and warm.weights.path == cold.weights.path, warm
    assert warm.programs.misses == 0 and not warm.programs.errors  # the decode warm-up's are read
    assert cold_programs.misses > 0 and warm_programs.misses == 0, (cold_programs, warm_programs)
    assert 0 < warm_programs.hits < cold_programs.misses  # the dequantization's programs are not needed
    (_, p0, s0, r0, _), (_, p1, s1, r1, _) = answers
    assert p0.hidden_digest == p1.hidden_digest
    assert [s.hidden_digest for s in s0] == [s.hidden_digest for s in s1]
    assert r0.weights is not None and r1.weights is not None
    assert r0.weights.source == "gguf" and r1.weights.source == "cache"  # the reference's own load
    assert r0.token_ids == r1.token_ids and len(r0.token_ids) == 4


def test_the_program_key_follows_every_setting_that_changes_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    from tinygrad import Device, Tensor
    from tinygrad.helpers import Context

    ast = [si for si in (Tensor.ones(4, 4).contiguous() @ Tensor.ones(4, 4)).schedule() if si.ast.op.name == "SINK"][
        -1
    ].ast
    renderer = Device[Device.DEFAULT].renderer
    base = cache_mod._program_key(ast, renderer)
    assert cache_mod._program_key(ast, renderer) == base  # stable
    with Context(DEVECTORIZE=0):  # a ContextVar
        assert cache_mod._program_key(ast, renderer) != base
    monkeypatch.setenv("NOLOCALS", "1")  # a variable tinygrad's code generation reads with getenv
    assert cache_mod._program_key(ast, renderer) != base
    monkeypatch.delenv("NOLOCALS")
    real = cache_mod.tinygrad_key()
    monkeypatch.setattr(cache_mod, "tinygrad_key", lambda: {**real, "tinygrad": "0.13.0"})
    assert cache_mod._program_key(ast, renderer) != base
    monkeypatch.setattr(cache_mod, "tinygrad_key", lambda: real)
    assert cache_mod._program_key(ast, renderer) == base
    other = (Tensor.ones(4, 8).contiguous() @ Tensor.ones(8, 4)).schedule()[-1].ast
    assert other.key != ast.key and cache_mod._program_key(other, renderer) != base  # another kernel


def test_a_gpu_program_is_found_under_any_core_count_and_one_for_another_architecture_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rented host's core count is nobody's choice: a GPU program's key holds the GPU's
    architecture (its renderer's) and no core count, so a program stored under one CPU_COUNT is
    found under another (a CPU program's thread split is in its renderer's key: it follows the
    count). A stored program whose stamp names another architecture or tinygrad version is never
    run: it is refused, counted, said, and made afresh. Rendered for named architectures, as an
    image build would, with no GPU here."""
    from tinygrad import Tensor
    from tinygrad.helpers import Context
    from tinygrad.renderer.cstyle import ClangRenderer, CUDARenderer

    ast = [si for si in (Tensor.ones(4, 4).contiguous() @ Tensor.ones(4, 4)).schedule() if si.ast.op.name == "SINK"][
        -1
    ].ast
    sm86, sm90 = CUDARenderer("sm_86"), CUDARenderer("sm_90")
    with Context(CPU_COUNT=2):
        two = cache_mod._program_key(ast, sm86)
    with Context(CPU_COUNT=16):
        assert cache_mod._program_key(ast, sm86) == two  # the core count is not in a GPU program's key
    assert cache_mod._program_key(ast, sm90) != two  # the architecture is
    cpu, wide = ClangRenderer(), ClangRenderer()
    wide.global_max = (cpu.global_max[0] + 62, 0, 0)  # what another core count gives the CPU's renderer
    assert cache_mod._program_key(ast, wide) != cache_mod._program_key(ast, cpu)
    # a program stored for sm_86, read where sm_86 is asked: used; stamped for sm_90 or another
    # tinygrad under the same key (a cache shipped from elsewhere), or with no stamp: refused
    before = cache_mod.PROGRAMS.refused
    program = Stored(lib=None)
    assert cache_mod._stamped((cache_mod.program_stamp(sm86), program), cache_mod.program_stamp(sm86)) is program
    assert cache_mod._stamped((cache_mod.program_stamp(sm90), program), cache_mod.program_stamp(sm86)) is None
    real = cache_mod.tinygrad_key()
    monkeypatch.setattr(cache_mod, "tinygrad_key", lambda: {**real, "tinygrad": "0.13.0"})
    newer = cache_mod.program_stamp(sm86)
    monkeypatch.setattr(cache_mod, "tinygrad_key", lambda: real)
    assert cache_mod._stamped((newer, program), cache_mod.program_stamp(sm86)) is None
    assert cache_mod._stamped(program, cache_mod.program_stamp(sm86)) is None  # stored with no stamp
    assert cache_mod.PROGRAMS.refused == before + 3
    assert "made for" in cache_mod.PROGRAMS.errors[-1] and "sm_86" in cache_mod.PROGRAMS.errors[-1]


@dataclasses.dataclass(frozen=True)
class Stored:
    """A stored program as the cache sees it: its binary (``ProgramSpec.lib``) is all it reads."""

    lib: bytes | None


def test_a_stored_binary_is_loaded_only_where_the_driver_can_load_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stored program carries its binary and what made it. A cubin of NVRTC 12.4 loads on any
    CUDA 12 driver (minor version compatibility), PTX of NVRTC 12.4 only on a 12.4 driver or
    later (its ISA is that toolkit's); a binary with no record of what made it, or of a kind the
    cache does not know, is never loaded. A refused binary leaves the program without one (it is
    compiled from its source, as tinygrad would), and says why once."""
    stamp = cache_mod.program_stamp(__import__("tinygrad.renderer.cstyle", fromlist=["x"]).CUDARenderer("sm_86"))
    prg = Stored(lib=b"\x7fELF...")
    cubin = {"kind": "cubin", "nvrtc": "12.4", "arch": "sm_86"}
    ptx = {"kind": "ptx", "nvrtc": "12.4", "arch": "sm_86"}
    for driver, binary, loaded in [
        ((12, 2), cubin, True),
        ((13, 0), cubin, True),
        ((11, 8), cubin, False),
        ((12, 4), ptx, True),
        ((12, 2), ptx, False),
        ((12, 4), None, False),
        ((12, 4), {"kind": "fatbin", "nvrtc": "12.4"}, False),
        ((11, 0), {"kind": "native"}, True),
    ]:
        monkeypatch.setattr(binaries, "cuda_driver_version", lambda driver=driver: driver)
        got = cache_mod._stamped((stamp, prg, binary), stamp)
        assert got is not None and (got.lib is not None) == loaded, (driver, binary)
        # a prebuild only stores: it loads nothing, so it keeps every binary
        assert cache_mod._stamped((stamp, prg, binary), stamp, here=False) is prg
    assert any("the driver supports CUDA 11.8" in e for e in cache_mod.PROGRAMS.errors)


def test_a_cubin_names_its_architecture_in_its_elf_header() -> None:
    """What the image's check reads: the machine (190, CUDA) and the SM in the flags' low byte;
    PTX (text) and another machine's ELF are named as what they are."""
    header = bytearray(64)
    header[:4] = b"\x7fELF"
    header[18:20] = (190).to_bytes(2, "little")
    header[48:52] = (0x5A055A).to_bytes(4, "little")  # what NVRTC 12.4 writes for sm_90
    assert binaries.cubin_arch(bytes(header)) == "sm_90"
    header[18:20] = (62).to_bytes(2, "little")
    assert binaries.cubin_arch(bytes(header)) == "not a CUDA ELF (machine 62)"
    assert binaries.cubin_arch(b"//\n// Generated by NVIDIA NVVM Compiler\n.version 8.4") == "not an ELF"


TOGETHER = """
import json, sys
from tinygrad import Tensor
from pytest_ppsmoke.stage.cache import install_program_cache
stats = install_program_cache()
print("ready", flush=True)
sys.stdin.readline()  # the other process is ready too
for n in range(1, 21):
    (Tensor.ones(4, n).contiguous() * n + 1).sum(1).realize()
print(json.dumps({"misses": stats.misses, "hits": stats.hits, "errors": stats.errors}), flush=True)
"""


def together(argv: list[str], env: dict[str, str]) -> list[dict]:
    """Two processes of ``argv``, each saying ``ready``, then told to go at the same moment; the
    JSON line each ends with."""
    procs = [
        subprocess.Popen(argv, env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(2)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        return [json.loads(proc.communicate(timeout=120)[0]) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_processes_that_start_together_make_each_program_once(tmp_path: Path) -> None:
    """Two processes on a fresh database that need the same programs at the same moment (two
    stages on one host): each program is generated and compiled by one of them, and read from
    the cache by the other, which waited for it."""
    env = {**os.environ, "CACHEDB": str(tmp_path / "tinygrad.db")}
    a, b = together([sys.executable, "-c", TOGETHER], env)
    assert not a["errors"] and not b["errors"], (a, b)
    needed = a["misses"] + a["hits"]
    assert needed >= 20 and b["misses"] + b["hits"] == needed, (a, b)
    assert a["misses"] + b["misses"] == needed, (a, b)  # none made twice


def test_a_program_stored_without_its_binary_is_compiled_once_then_read_with_it(tmp_path: Path) -> None:
    """A database from before programs carried their binaries (each entry a stamp and a program):
    the next process compiles each binary once and stores it with the program, the one after
    compiles none."""
    import pickle
    import sqlite3

    env = {**os.environ, "CACHEDB": str(tmp_path / "tinygrad.db")}
    script = TOGETHER.replace("sys.stdin.readline()  # the other process is ready too", "").replace(
        '"errors": stats.errors}', '"errors": stats.errors, "compiled": stats.compiled}'
    )

    def one() -> dict:
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.splitlines()[-1])

    first = one()
    assert first["misses"] > 0 and first["compiled"] == first["misses"], first
    with sqlite3.connect(env["CACHEDB"]) as con:  # every entry as an older build stored it
        (table,) = [t for (t,) in con.execute("SELECT name FROM sqlite_master") if t.startswith("ppsmoke_program")]
        rows = con.execute(f"SELECT key, val FROM '{table}'").fetchall()
        for key, val in rows:
            stamp, prg, _ = pickle.loads(val)
            old = pickle.dumps((stamp, dataclasses.replace(prg, lib=None)))
            con.execute(f"UPDATE '{table}' SET val = ? WHERE key = ?", (old, key))
    second, third = one(), one()
    assert second["misses"] == 0 and second["compiled"] == len(rows), second
    assert third["misses"] == 0 and third["compiled"] == 0 and third["hits"] == second["hits"], third


LOAD_TOGETHER = """
import json, sys
from pytest_ppsmoke.stage.cache import WeightCache
from pytest_ppsmoke.stage.model import realized_model
print("ready", flush=True)
sys.stdin.readline()  # the other process is ready too
model, kv, load = realized_model(sys.argv[1], 64, 0, 2, WeightCache(sys.argv[2]))
print(json.dumps({"source": load.source, "path": load.path, "note": load.note}), flush=True)
"""


def test_processes_that_load_one_part_together_realize_it_once(synth_model: str, tmp_path: Path) -> None:
    """Two processes that load the same stage of the same model at the same moment, on an empty
    weight cache: one realizes it from the GGUF and writes the file while the other waits, then
    reads that file; neither says anything went wrong."""
    loads = together([sys.executable, "-c", LOAD_TOGETHER, synth_model, str(tmp_path / "w")], dict(os.environ))
    assert sorted(load["source"] for load in loads) == ["cache", "gguf"], loads
    assert loads[0]["path"] == loads[1]["path"] and not loads[0]["note"] and not loads[1]["note"], loads


def test_the_body_digest_is_the_same_on_any_number_of_threads_and_sees_every_byte(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pieces hashed on threads, then in order: the count of cores changes nothing, a flipped byte
    anywhere (here in the fourth piece of the payload) changes the digest."""
    monkeypatch.setattr(cache_mod, "DIGEST_CHUNK", 1000)
    meta, payload = bytearray(os.urandom(1500)), bytearray(os.urandom(5500))
    digests = set()
    for cores in (1, 2, 8):
        monkeypatch.setattr(cache_mod.os, "cpu_count", lambda cores=cores: cores)
        digests.add(cache_mod.body_digest(memoryview(meta), memoryview(payload)))
    assert len(digests) == 1
    payload[3500] ^= 1
    assert cache_mod.body_digest(memoryview(meta), memoryview(payload)) not in digests
    # the parts' boundary counts: the same bytes cut elsewhere are another body
    both = bytes(meta) + bytes(payload)
    assert cache_mod.body_digest(memoryview(both[:1400]), memoryview(both[1400:])) != cache_mod.body_digest(
        memoryview(meta), memoryview(payload)
    )


def test_programs_made_ahead_on_the_null_device_are_all_a_cold_worker_needs(synth_model: str, tmp_path: Path) -> None:
    """``pp-prebuild`` runs each stage's worker and the reference on tinygrad's NULL device (no
    computation) for a named target, here this machine's CPU: a worker of the same split and
    prompt that then starts cold on that database (no weight cache) generates no program at all,
    its load's, prefill's, decode's and the reference's alike: it reads every one. (A target's
    programs are stored under the keys a worker on that device looks for: no device is in them.)"""
    from pytest_ppsmoke.nodeenv import NodeEnv, process_env
    from pytest_ppsmoke.stage import prebuild

    env = {**os.environ, "CACHEDB": str(tmp_path / "tinygrad.db"), "HALF": "1"}
    made = prebuild.prebuild("CPU", synth_model, 2, "Say hello", 4, env)
    assert made[0]["generated"] > 0, made
    ids: tuple[int, ...] = ()
    for stage in range(2):
        node = NodeEnv(stage=stage, num_stages=2, model=synth_model, weight_cache="off", program_cache=True)
        cold = prebuild._run({**process_env(node.for_worker()), **env}, stage, 2, ids, 4, "Say hello")
        ids = cold.pop("ids", ids)
        # and each program's binary came with it: nothing compiled
        assert cold["generated"] == 0 and cold["read"] > 0 and cold["compiled"] == 0, (stage, cold, made)
    with pytest.raises(ValueError, match="expected CPU or CUDA:sm_XY"):
        prebuild.prebuild("CUDA:ampere", synth_model, 2, "Say hello", 4, env)

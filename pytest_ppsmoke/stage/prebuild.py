"""Programs made ahead, with no GPU: ``pp-prebuild`` runs each stage's worker, and the reference,
on tinygrad's ``NULL`` device (which allocates nothing and computes nothing) with
``PP_PREBUILD`` naming the target (``CUDA:sm_86``, or ``CPU``), so that every kernel a run of
this model, split and prompt needs is generated for that target and stored in the program cache
(tinygrad's database, ``CACHEDB``) under the key a worker on such a device looks for: a kernel's
AST does not name its device, and the key holds the target's renderer and nothing of this host.

    python -m pytest_ppsmoke.stage.prebuild --target CUDA:sm_86 --model M --stages 2

Each worker loads its part (from the GGUF: the weight cache is off), warms up, and answers the
requests a run makes: the prompt's prefill through every stage, decode steps, and the reference
in one piece. The values are nothing (the device computes nothing), the programs are the ones a
run generates: their shapes are the run's. The counts printed at the end are each worker's
programs generated and read (a second prebuild on the same database generates none).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..nodeenv import NodeEnv, process_env
from .binaries import cubin_arch
from .cache import PREBUILD, prebuild_renderer, program_stamp
from .pipe import (
    DecodeStep,
    EmbedAndForward,
    ErrorReply,
    Forward,
    ForwardAndSample,
    Framing,
    PipeError,
    Request,
    RunReference,
    Shutdown,
    Tokenize,
    answers,
    decode_reply,
    encode_request,
    read_ready,
    worker_script,
)

# the variables that name tinygrad's device (one may be set: the NULL device is this tool's)
DEVICES = frozenset({"DEV", "CPU", "CUDA", "NV", "AMD", "METAL", "CL", "GPU", "HIP", "QCOM", "WEBGPU", "PYTHON", "DSP"})
DECODE_STEPS = 3  # the JIT runs two steps eagerly, then the captured one: every decode program


def prebuild(
    target: str, model: str, stages: int, prompt: str, max_tokens: int, env: dict[str, str]
) -> list[dict[str, Any]]:
    """Every stage's worker of a ``stages``-stage split, then the reference, each on the NULL
    device for ``target``; each worker's programs (generated, read) as its shutdown reply says."""
    prebuild_renderer(target)  # a bad target is named before any worker starts
    counts = []
    ids: tuple[int, ...] = ()
    for stage in range(stages):
        node = NodeEnv(stage=stage, num_stages=stages, model=model, weight_cache="off", program_cache=True)
        worker_env = {k: v for k, v in {**process_env(node.for_worker()), **env}.items() if k not in DEVICES}
        worker_env |= {PREBUILD: target, "NULL": "1"}  # tinygrad's NULL device, and no other named
        counts.append(_run(worker_env, stage, stages, ids, max_tokens, prompt))
        ids = counts[-1].pop("ids", ids)
    return counts


def _run(
    env: dict[str, str], stage: int, stages: int, ids: tuple[int, ...], max_tokens: int, prompt: str
) -> dict[str, Any]:
    """One stage's worker through a run's requests (stage 0 tokenizes ``prompt``, its ``ids``
    are returned; a later stage takes ``ids`` for its shapes): its programs generated and read."""
    with tempfile.TemporaryFile() as err:  # a file, not a pipe: a worker that says much never blocks
        proc = subprocess.Popen(
            [sys.executable, str(worker_script())],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
        )
        try:
            return _drive(proc, stage, stages, ids, max_tokens, prompt)
        except (RuntimeError, PipeError) as e:
            err.seek(0)
            tail = err.read().decode(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"stage {stage}: {e}: {' / '.join(tail)}") from None
        finally:
            proc.kill()
            proc.wait()


def _drive(
    proc: subprocess.Popen[bytes], stage: int, stages: int, ids: tuple[int, ...], max_tokens: int, prompt: str
) -> dict[str, Any]:
    assert proc.stdout is not None
    out: dict[str, Any] = {"stage": stage}
    ready = read_ready(proc.stdout.readline)
    row = ready.dim * ready.wire_dtype.itemsize
    if stage == 0:
        out["ids"] = ids = tuple(_ask(proc, Tokenize(prompt)).token_ids)
    n = len(ids)
    if stage == 0:
        _ask(proc, EmbedAndForward(ids, 0, prefill=True))
        for i in range(DECODE_STEPS):
            _ask(proc, DecodeStep(ids[-1], n + i))
        # the reference's tokens: on a real device, what a run of these programs answers
        out["reference_tokens"] = list(_ask(proc, RunReference(prompt, max_tokens)).token_ids)
    else:
        kind = ForwardAndSample if stage == stages - 1 else Forward
        _ask(proc, kind(bytes(row * n), 0, n, prefill=True))
        for i in range(DECODE_STEPS):
            _ask(proc, kind(bytes(row), n + i, 1))
    bye = _ask(proc, Shutdown())
    programs = bye.programs
    out["generated"], out["read"] = (programs.misses, programs.hits) if programs else (0, 0)
    out["compiled"] = programs.compiled if programs else 0
    out["errors"] = list(programs.errors) if programs else []
    proc.wait(timeout=60)
    return out


_ids = iter(range(1, 1 << 30))


def _ask(proc: subprocess.Popen[bytes], req: Request[Any]) -> Any:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(encode_request(next(_ids), req, Framing.json))
    proc.stdin.flush()
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker exited during {req.op} (status {proc.wait()})")
        found = answers([line])
        if found:
            reply = decode_reply(req.reply, found[0])
            if isinstance(reply, ErrorReply):
                raise RuntimeError(f"the worker refused {req.op}: {reply.error}")
            return reply


def check(db: str, arches: Sequence[str]) -> dict[str, Any]:
    """What a database's stored GPU programs are, per architecture: how many, how many carry a
    cubin whose ELF header names that architecture (:func:`binaries.cubin_arch`), how many are
    stamped for this tinygrad's renderer of it (the stamp a worker on such a GPU checks), and
    the NVRTC versions that made them. ``ok``: every architecture of ``arches`` has programs,
    and every one of them passes both checks."""
    from tinygrad.helpers import VERSION
    from tinygrad.renderer.cstyle import CUDARenderer

    if not os.path.exists(db):
        raise ValueError(f"no program database at {db}")
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute(f"SELECT val FROM 'ppsmoke_program_{VERSION}'").fetchall()
    except sqlite3.OperationalError as e:
        raise ValueError(f"{db} holds no stored programs ({e})") from None
    finally:
        con.close()
    found: dict[str, dict[str, Any]] = {}
    for (val,) in rows:
        entry = pickle.loads(val)
        binary = entry[2] if isinstance(entry, tuple) and len(entry) == 3 else None
        if not binary or binary.get("kind") != "cubin":
            continue
        arch = binary["arch"]
        seen = found.setdefault(arch, {"programs": 0, "elf_arch_ok": 0, "stamp_ok": 0, "nvrtc": set(), "elf": set()})
        seen["programs"] += 1
        elf = cubin_arch(entry[1].lib or b"")
        seen["elf"].add(elf)
        seen["elf_arch_ok"] += elf == arch
        seen["stamp_ok"] += entry[0] == program_stamp(CUDARenderer(arch))
        seen["nvrtc"].add(binary.get("nvrtc"))
    ok = all(a in found and found[a]["programs"] == found[a]["elf_arch_ok"] == found[a]["stamp_ok"] > 0 for a in arches)
    out = {a: {k: sorted(v) if isinstance(v, set) else v for k, v in f.items()} for a, f in sorted(found.items())}
    return {"cache": db, "ok": ok, "missing": [a for a in arches if a not in out], "arches": out}


def settle(db: str) -> None:
    """Write tinygrad's database whole into its file: its write-ahead log checkpointed and
    removed, so that an image's layer holds one file (``-wal`` and ``-shm`` beside it would be
    replayed by the first node to open it)."""
    con = sqlite3.connect(db)
    try:
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        con.execute("PRAGMA journal_mode=DELETE")  # the log's files go with the last connection
    finally:
        con.close()


def stand_in(model: str, directory: str) -> str:
    """A synthetic GGUF with the shape and types of the catalogue's ``model`` (``pp-synth-gguf
    --like``), written into ``directory``: its programs are the real file's."""
    from .synth import LIKE, write

    like = LIKE.get(model)
    if like is None:
        raise ValueError(f"no synthetic stand-in for {model!r}: one of {', '.join(sorted(LIKE))}, or a GGUF path")
    path = os.path.join(directory, "stand-in.gguf")
    write(Path(path), like.shape, 0, like.quant, like.tied, like.rope_scaling)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="pp-prebuild", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="CUDA:sm_XY or CPU; several separated by commas or spaces")
    ap.add_argument("--model", help="a model name or a GGUF path")
    ap.add_argument("--stand-in", action="store_true", help="make the programs with a synthetic model like --model")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--prompt", default="Say hello")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--check", metavar="ARCHES", help="check the database's cubins for these (sm_86 ...), and exit")
    a = ap.parse_args(argv)
    from tinygrad.helpers import CACHEDB

    try:
        if a.check is not None:
            checked = check(os.environ.get("CACHEDB") or str(CACHEDB), a.check.replace(",", " ").split())
            print(json.dumps(checked))
            sys.exit(0 if checked["ok"] else 1)
        if not a.target or not a.model:
            ap.error("--target and --model are needed to make programs")
        targets = a.target.replace(",", " ").split()
        for target in targets:
            prebuild_renderer(target)  # every target named before any work
        with tempfile.TemporaryDirectory(prefix="pp-prebuild.") as tmp:
            model = stand_in(a.model, tmp) if a.stand_in else a.model
            for target in targets:
                started = time.monotonic()
                counts = prebuild(target, model, a.stages, a.prompt, a.max_tokens, dict(os.environ))
                for c in counts:  # the NULL device's: nothing was computed
                    c.pop("reference_tokens", None)
                took = round(time.monotonic() - started, 1)
                print(json.dumps({"target": target, "model": a.model, "seconds": took, "workers": counts}), flush=True)
        settle(os.environ.get("CACHEDB") or str(CACHEDB))
    except (ValueError, RuntimeError) as e:
        sys.exit(f"pp-prebuild: {e}")


if __name__ == "__main__":
    main()

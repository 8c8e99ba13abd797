"""Two caches that turn a warm load into a read: a stage's realized weights, and tinygrad's
generated programs.

    cache = WeightCache.from_setting(env.weight_cache)          # None: off
    model, kv, load = realized_model("smollm2:135m", 1024, Part.of_stage(0, 2, 30), cache)
    install_program_cache()                                      # once per process

**Weights.** Realizing a stage from its GGUF means building the dequantization graph of every
tensor in Python and running it, seconds per stage (docs/benchmarks.md). :class:`WeightCache`
keeps what that produced, the float16 tensors a stage owns, in one file per (model file, part,
tinygrad version, ``HALF``): a header, the GGUF's metadata and the raw tensors. A warm load
builds the model's objects from the metadata, allocates
the owned tensors and copies the bytes in: no graph, no kernel. The key is the model file's
content (blake2b; remembered per file by its inode, size and change times), so a cache of another
model, of a changed file, or of another tinygrad version is never used; the header repeats the
key and a digest of the tensors, and a file whose header or digest does not match is ignored
and written again. Files are written whole and renamed into place, so concurrent writers (two
stages on one host) never expose half a file, and a process that loads a part another one is
realizing waits for it (a lock beside the file) and reads what it wrote. The directory is kept
under ``max_bytes`` by removing the least recently used files.

**Programs.** tinygrad caches compiled kernels on disk (``CACHEDB``), keyed by their source,
but a new process still generates every kernel's source from its AST (linearize and render,
for every program of a stage: docs/benchmarks.md). :func:`install_program_cache` stores each
generated ``ProgramSpec`` in the same database, keyed by the AST, the renderer and every
tinygrad setting in effect, so a warm process skips the generation too. One step earlier, the
kernels a graph becomes (tinygrad's schedule cache, in memory only) are kept there as well, keyed
by the graph and the same settings: a warm process's eager calls (the prefill, the JIT's capture,
the reference) skip the scheduling. Processes that start
together on one host (two stages, the reference beside them) would otherwise each generate and
compile the same programs on the same cores: a lock per program (striped) makes each program once,
and the others read it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import pickle
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..protocol import layer_range
from .binaries import binary_refusal, cubin, nvrtc_version

DEFAULT_ROOT = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "ppsmoke" / "weights"
DEFAULT_MAX_BYTES = 8 << 30
_MAGIC = b"PPSMOKE-WEIGHTS\n"
_FORMAT = 2  # 2: the digest is body_digest's (chunks hashed in parallel)
_ALIGN = 64
_BLOCK = re.compile(r"blk\.(\d+)\.")


class CacheError(ValueError):
    """A cache file that is not what its name promises: the message says what differs."""


@dataclass(frozen=True)
class Part:
    """Which of a model's tensors a stage owns: blocks ``[lo, hi)``, and the embedding and the
    output head (norm and projection) when it is the first or the last stage."""

    lo: int
    hi: int
    embed: bool
    head: bool

    @classmethod
    def of_stage(cls, stage: int, num_stages: int, total: int) -> Part:
        lo, hi = layer_range(total, stage, num_stages)
        return cls(lo, hi, stage == 0, stage == num_stages - 1)

    @classmethod
    def whole(cls, total: int) -> Part:
        return cls(0, total, True, True)

    def owns(self, name: str) -> bool:
        m = _BLOCK.match(name)
        if m:
            return self.lo <= int(m.group(1)) < self.hi
        if name.startswith("token_embd."):
            return self.embed
        return name.startswith(("output.", "output_norm.")) and self.head

    def __str__(self) -> str:
        extra = [w for w, on in (("embedding", self.embed), ("head", self.head)) if on]
        return f"blocks {self.lo}..{self.hi - 1}" + "".join(f" + {w}" for w in extra)


def tinygrad_key() -> dict[str, Any]:
    """What, besides the model file and the part, decides the bytes a realized tensor holds."""
    from tinygrad.helpers import getenv

    return {"tinygrad": _tinygrad_version(), "half": int(getenv("HALF", 1))}


@functools.cache
def _tinygrad_version() -> str:
    """tinygrad's installed version, read once: each program and schedule looked up asks for it
    (its key and its stamp), and importlib.metadata reads the installed distributions each time
    (0.4 ms: some 70 reads in a worker's start)."""
    import importlib.metadata

    return importlib.metadata.version("tinygrad")


DIGEST_CHUNK = 32 << 20  # bytes hashed as one piece


def body_digest(*parts: memoryview) -> str:
    """A file body's digest: each part cut into ``DIGEST_CHUNK`` pieces, each piece's BLAKE2b
    taken on its own thread (hashlib lets go of the GIL for a large buffer), and the BLAKE2b of
    those in order. A warm load checks every byte it reads; on one thread that costs a large
    stage's warm load seconds, and a GPU host has the cores to share it."""
    pieces = [p[i : i + DIGEST_CHUNK] for p in parts for i in range(0, len(p), DIGEST_CHUNK)] or [memoryview(b"")]
    workers = max(1, min(8, os.cpu_count() or 1, len(pieces)))
    if workers == 1:
        sums = [hashlib.blake2b(p, digest_size=32).digest() for p in pieces]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="weight-digest") as pool:
            sums = list(pool.map(lambda p: hashlib.blake2b(p, digest_size=32).digest(), pieces))
    return hashlib.blake2b(b"".join(sums), digest_size=20).hexdigest()


class WeightCache:
    def __init__(self, root: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root, self.max_bytes = Path(root), max_bytes

    @classmethod
    def from_setting(cls, setting: str) -> WeightCache | None:
        """``PP_WEIGHT_CACHE``: empty for the default directory, ``off`` for none, or a directory."""
        if setting.strip().lower() == "off":
            return None
        return cls(Path(setting).expanduser() if setting.strip() else DEFAULT_ROOT)

    # --- the model file's content key -------------------------------------------------------

    def model_digest(self, path: Path) -> str:
        """blake2b of the file's bytes, remembered per (device, inode, size, mtime, ctime): a file
        changed in place gets a new ctime, which no user tool can set back."""
        st = path.stat()
        stamp = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
        index = self.root / "digests.json"
        try:
            known = json.loads(index.read_text())
        except (OSError, ValueError):
            known = {}
        entry = known.get(str(path.resolve())) if isinstance(known, dict) else None
        if isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("blake2b"), str):
            return str(entry["blake2b"])
        h = hashlib.blake2b(digest_size=20)
        with path.open("rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        digest = h.hexdigest()
        known = {p: e for p, e in known.items() if Path(p).exists()} if isinstance(known, dict) else {}
        known[str(path.resolve())] = {"stamp": stamp, "blake2b": digest}
        with contextlib.suppress(OSError):
            _write_atomic(index, json.dumps(known, indent=1).encode())
        return digest

    # --- entries -----------------------------------------------------------------------------

    def key(self, model_digest: str, stage: int, num_stages: int) -> dict[str, Any]:
        """An entry's identity. The block range follows from the split and the model (the
        header records it, and the reader checks it against the metadata)."""
        return {"format": _FORMAT, "model": model_digest, "split": [stage, num_stages], **tinygrad_key()}

    def path_for(self, key: dict[str, Any]) -> Path:
        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return self.root / f"{name}.weights"

    def read(self, key: dict[str, Any]) -> tuple[dict[str, Any], Part, dict[str, np.ndarray | str], Path] | None:
        """(GGUF metadata, the part, tensors by name, path), or None when there is no file for
        ``key``. A tensor stored once for two names (tied weights) appears under the second name
        as the first one's name. Raises CacheError when the file is there but is not this key's,
        or is damaged."""
        path = self.path_for(key)
        try:
            f = path.open("rb")
        except FileNotFoundError:
            return None
        with f:
            if f.read(len(_MAGIC)) != _MAGIC:
                raise CacheError(f"{path} does not start as a weight cache file")
            n = int.from_bytes(f.read(8), "little")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise CacheError(f"{path}: unreadable header ({e})") from None
            if header.get("key") != key:
                raise CacheError(f"{path} holds {header.get('key')!r}, not {key!r}")
            body = bytearray(header["meta_bytes"] + header["payload_bytes"])
            if f.readinto(body) != len(body):
                raise CacheError(f"{path} is truncated: expected {len(body)} bytes after the header")
        view = memoryview(body)
        if body_digest(view[: header["meta_bytes"]], view[header["meta_bytes"] :]) != header["digest"]:
            raise CacheError(f"{path}: its bytes do not match the digest in its header")
        kv = pickle.loads(view[: header["meta_bytes"]])
        payload = view[header["meta_bytes"] :]
        tensors: dict[str, np.ndarray | str] = {}
        for t in header["tensors"]:
            if "alias" in t:
                tensors[t["name"]] = t["alias"]
                continue
            raw = payload[t["offset"] : t["offset"] + t["nbytes"]]
            tensors[t["name"]] = np.frombuffer(raw, dtype=t["dtype"]).reshape(t["shape"])
        with contextlib.suppress(OSError):
            os.utime(path)  # least recently used goes first
        return kv, Part(**header["part"]), tensors, path

    @contextlib.contextmanager
    def making(self, key: dict[str, Any], note: Callable[[str], None]) -> Iterator[None]:
        """Held while this process looks for ``key``'s file and, missing, realizes and writes it:
        processes that load the same part together (a test's clusters, a stage restarted beside
        its old self) wait for the first, then read what it wrote, instead of each realizing it
        from the GGUF on the same cores. ``note``: why it could not be held, if so."""
        with _held(self.path_for(key).with_suffix(".lock"), "weight cache", note):
            yield

    def write(self, key: dict[str, Any], kv: dict[str, Any], part: Part, tensors: dict[str, np.ndarray | str]) -> Path:
        """``tensors``: arrays by name, or for a tied tensor the name of the one it shares."""
        meta = pickle.dumps(kv, protocol=5)
        entries: list[dict[str, Any]] = []
        offset = 0
        arrays = []
        for name, arr in tensors.items():
            if isinstance(arr, str):
                entries.append({"name": name, "alias": arr})
                continue
            entries.append(
                {"name": name, "dtype": arr.dtype.str, "shape": list(arr.shape), "offset": offset, "nbytes": arr.nbytes}
            )
            arrays.append((offset, arr))
            offset += -(-arr.nbytes // _ALIGN) * _ALIGN
        payload = bytearray(offset)
        for at, arr in arrays:
            payload[at : at + arr.nbytes] = np.ascontiguousarray(arr).data.cast("B")
        digest = body_digest(memoryview(meta), memoryview(payload))
        header = json.dumps(
            {
                "key": key,
                "meta_bytes": len(meta),
                "payload_bytes": len(payload),
                "digest": digest,
                "part": dataclasses.asdict(part),
                "tensors": entries,
            }
        ).encode()
        path = self.path_for(key)
        _write_atomic(path, _MAGIC, len(header).to_bytes(8, "little"), header, meta, payload)
        self.prune(keep=path)
        return path

    def entries(self) -> list[Path]:
        return sorted(self.root.glob("*.weights")) if self.root.is_dir() else []

    def prune(self, keep: Path | None = None) -> list[Path]:
        """Remove the least recently used files until the directory holds at most ``max_bytes``."""
        files = []
        for p in self.entries():
            with contextlib.suppress(OSError):
                st = p.stat()
                files.append((st.st_mtime, st.st_size, p))
        total, removed = sum(s for _, s, _ in files), []
        for _, size, p in sorted(files):
            if total <= self.max_bytes:
                break
            if p != keep:
                with contextlib.suppress(OSError):
                    p.unlink()
                    total -= size
                    removed.append(p)
        return removed


def _write_atomic(path: Path, *chunks: bytes | bytearray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# --- tinygrad's generated programs ----------------------------------------------------------


@dataclass
class ProgramStats:
    hits: int = 0
    misses: int = 0
    seconds: float = 0.0  # spent generating (misses) and reading (hits)
    refused: int = 0  # stored programs stamped for another renderer or tinygrad version (not run)
    # programs whose binary this process compiled (or found in tinygrad's compile cache by their
    # source) because the program cache held none this device can load: 0 on a prebuilt image
    compiled: int = 0
    errors: list[str] = field(default_factory=list)
    # told after each program (read or generated): the worker's load counts them as they come
    on_program: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def describe(self) -> str:
        return f"{self.hits} programs from the program cache, {self.misses} generated, {self.compiled} compiled"


PROGRAMS = ProgramStats()
_TABLE = "ppsmoke_program"
HOST_SETTINGS = frozenset({"CPU_COUNT"})  # tinygrad's settings read from the host, kept out of the keys
_FIRST_SEEN: dict[str, str] = {}  # each tinygrad setting's value when this process first saw it
LOCK_STRIPES = 64  # lock files: a program waits only for those that share its stripe
LOCK_WAIT = 120.0  # seconds a process waits for another making the same program


def install_program_cache() -> ProgramStats:
    """Wrap tinygrad's program generation (``engine.realize.get_program``) with a disk cache in
    tinygrad's own database, and back its schedule cache with the same database
    (:func:`install_schedule_cache`); idempotent. Returns the process's program counters."""
    from tinygrad.engine import realize

    install_schedule_cache()

    _settings()  # every setting's value now, before any Context: what "changed" is measured from
    if getattr(realize.get_program, "__ppsmoke_cache__", False):
        return PROGRAMS
    generate = realize.get_program
    target = prebuild_renderer(os.environ.get(PREBUILD, ""))

    def get_program(ast: Any, renderer: Any, opts: Any = None) -> Any:
        started = time.perf_counter()
        if target is not None and renderer.device == "NULL":  # made ahead: for the target, run on nothing
            renderer = target
        if opts is not None:  # a search's candidate: not worth keeping
            return generate(ast, renderer, opts)
        key, stamp = _program_key(ast, renderer), program_stamp(renderer)
        prg, made = _stamped(_diskcache_get(key), stamp, target is None), False
        if prg is None:
            with _generating(key):
                prg = _stamped(_diskcache_get(key), stamp, target is None)  # another process may have made it
                if prg is None:
                    prg, made = generate(ast, renderer, opts), True
                    _store(key, stamp, *_with_binary(prg, target))
        if prg.lib is None and target is None:  # stored without a binary, or one this device refuses:
            prg = _store(key, stamp, *_with_binary(prg, None))  # compiled here, kept for the next process
        PROGRAMS.misses += made
        PROGRAMS.hits += not made
        PROGRAMS.seconds += time.perf_counter() - started
        if PROGRAMS.on_program is not None:
            PROGRAMS.on_program()
        return prg

    get_program.__ppsmoke_cache__ = True  # type: ignore[attr-defined]
    realize.get_program = get_program
    return PROGRAMS


@dataclass
class ScheduleStats:
    hits: int = 0  # schedules read from the database
    misses: int = 0  # schedules this process made (and wrote)


SCHEDULES = ScheduleStats()
_SCHEDULE_TABLE = "ppsmoke_schedule"


class _DiskSchedules(dict):  # type: ignore[type-arg]
    """tinygrad's own schedule cache (``engine.schedule.schedule_cache``: a graph's key, with its
    buffers and bound values stripped, to the kernels it becomes), backed by the database.
    tinygrad only ever ``get``s and sets items, so a dict that looks further on a miss and writes
    through on a set is all it takes."""

    def get(self, key: bytes, default: Any = None) -> Any:
        found = super().get(key)
        if found is None:
            found = _diskcache_get(_schedule_key(key), _SCHEDULE_TABLE)
            if found is None:
                return default
            SCHEDULES.hits += 1
            super().__setitem__(key, found)
        return found

    def __setitem__(self, key: bytes, value: Any) -> None:
        super().__setitem__(key, value)
        SCHEDULES.misses += 1
        _diskcache_put(_schedule_key(key), value, _SCHEDULE_TABLE)


def install_schedule_cache() -> ScheduleStats:
    """Back tinygrad's in-process schedule cache with the database; idempotent. Every process
    that runs a model builds the same graphs (a stage's prefill, its decode step while the JIT
    captures it, the reference's calls), and turning each into kernels (rangeify, the memory
    plan's inputs) costs more than running them on a small model: a second process reads what
    the first made. Returns the process's counters."""
    from tinygrad.engine import schedule

    if not isinstance(schedule.schedule_cache, _DiskSchedules):
        schedule.schedule_cache = _DiskSchedules(schedule.schedule_cache)
    return SCHEDULES


def _schedule_key(graph_key: bytes) -> str:
    """The graph's own key (its structure, devices and dtypes), with every tinygrad setting in
    effect and tinygrad's version, as for programs."""
    return hashlib.sha256(b"schedule\0" + graph_key + _settings()).hexdigest()


@contextlib.contextmanager
def _generating(key: str) -> Iterator[None]:
    """Holds one of ``LOCK_STRIPES`` lock files beside tinygrad's database while this process
    generates (and compiles) the program of ``key``. Processes that start together on one host
    (two stages, the reference beside them, a test's clusters) need the same programs in the same
    order: each waits for the one generating a program and reads it from the cache, so a program
    is made once, not once per process on the same cores. After ``LOCK_WAIT`` seconds, or where
    no lock can be made, this process generates it itself."""
    from tinygrad.helpers import CACHEDB, CACHELEVEL

    if CACHELEVEL.value < 1:  # no disk cache: nothing to wait for
        yield
        return
    locks = Path(CACHEDB).with_name(Path(CACHEDB).name + ".locks")
    with _held(locks / f"{int(key[:4], 16) % LOCK_STRIPES:02x}", "program", PROGRAMS.errors.append):
        yield


@contextlib.contextmanager
def _held(path: Path, what: str, note: Callable[[str], None]) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (made if missing) for the block, waited for at most
    ``LOCK_WAIT`` seconds; where it cannot be made or is still held then, the block runs
    without it, and ``note`` is told why. The lock ends with the process, however it ends."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:  # a read-only cache directory: no lock, made here
        note(f"{what} lock: {e}")
        yield
        return
    try:
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    note(f"{what} lock: still held after {LOCK_WAIT:g} s; made here too")
                    break
                time.sleep(0.005)
        yield
    finally:
        os.close(fd)  # releases the lock


PREBUILD = "PP_PREBUILD"  # a worker on tinygrad's NULL device that makes the programs of this target


def prebuild_renderer(target: str) -> Any:
    """The renderer a worker makes its programs for when it runs on tinygrad's ``NULL`` device
    (which computes nothing) with ``PP_PREBUILD`` set: ``CPU`` (this machine's CPU renderer) or
    ``CUDA:sm_XY``; None with it unset. Its programs are stored for that renderer, under the keys
    a worker on such a device will look for (a kernel's AST does not name its device)."""
    if not target:
        return None
    from tinygrad.renderer.cstyle import ClangJITRenderer, CUDARenderer

    if target == "CPU":
        return ClangJITRenderer()  # the CPU device's own
    kind, _, arch = target.partition(":")
    if kind == "CUDA" and re.fullmatch(r"sm_\d{2,3}", arch):
        return CUDARenderer(arch)
    raise ValueError(f"{PREBUILD}={target!r}: expected CPU or CUDA:sm_XY (e.g. CUDA:sm_86)")


def _program_key(ast: Any, renderer: Any) -> str:
    """The AST's own key, the renderer (:func:`program_stamp`: its class, its arguments such as
    a GPU's architecture, its limits), every tinygrad setting in effect (its ``ContextVar``s and
    the variables its code generation reads with ``getenv``) and tinygrad's version. Nothing of
    the host but what the renderer holds: the CPU's thread count reaches a CPU program through
    the renderer's ``global_max`` alone, and a GPU program not at all, so a program built on a
    machine of one core count is found on another."""
    return hashlib.sha256(program_stamp(renderer).encode() + ast.key + _settings()).hexdigest()


def program_stamp(renderer: Any) -> str:
    """What a stored program is stamped with, and checked against before it is used: tinygrad's
    version and the renderer (its class, its arguments, its device and its limits)."""
    cls = type(renderer)
    limits = tuple(getattr(renderer, k, None) for k in ("global_max", "local_max", "shared_max"))
    return repr((tinygrad_key()["tinygrad"], f"{cls.__module__}.{cls.__qualname__}", renderer.__reduce__()[1],
                 renderer.device, limits))  # fmt: skip


def _stamped(found: Any, stamp: str, here: bool = True) -> Any:
    """A stored program, if its stamp is ``stamp``; None (and a note in the counters' errors)
    if it was made for another architecture, renderer or tinygrad version, or stored without a
    stamp: such a program is never run, it is generated afresh. Its binary (``lib``) comes with
    it only where this device can load it (:func:`binary_refusal`; ``here``: a device that
    runs it, not a prebuild); otherwise the program comes without, and is compiled from its
    source as tinygrad would."""
    if found is None:
        return None
    if isinstance(found, tuple) and len(found) in (2, 3) and found[0] == stamp:
        prg, binary = found[1], found[2] if len(found) == 3 else None
        if prg.lib is not None and here and (why := binary_refusal(binary)):
            if binary is not None:  # (stored before binaries were recorded: compiled again, unsaid)
                _say(f"a cached program's binary not loaded: {why}")
            return dataclasses.replace(prg, lib=None)
        return prg
    stamped = isinstance(found, tuple) and len(found) in (2, 3) and isinstance(found[0], str)
    theirs = found[0] if stamped else "no stamp"
    PROGRAMS.refused += 1
    _say(f"a cached program made for {theirs[:200]}, not {stamp[:200]}: generated afresh")
    return None


def _say(said: str) -> None:
    if said not in PROGRAMS.errors:  # a cache of another build: said once, counted each time
        PROGRAMS.errors.append(said)


# --- a program's binary ------------------------------------------------------------------------
#
# A stored program carries its binary (``ProgramSpec.lib``), with what made it: ``{"kind":
# "cubin" | "ptx" | "native", "nvrtc": "12.4", "arch": "sm_86"}``. A prebuild for a GPU stores
# NVRTC's cubin for the target's architecture (no GPU needed to make it; the driver loads it with
# no JIT); a worker stores what its device's compiler made (PTX on CUDA, which the driver compiles
# at load, or the CPU's machine code). What a device may load: ``binaries.py``.


def _store(key: str, stamp: str, prg: Any, binary: dict[str, str] | None) -> Any:
    """``prg`` stored under ``key`` with its stamp and its binary's record (its uops, which only
    feed DEBUG's estimates, left out); ``prg`` again."""
    _diskcache_put(key, (stamp, dataclasses.replace(prg, uops=None), binary))
    return prg


def _with_binary(prg: Any, target: Any) -> tuple[Any, dict[str, str] | None]:
    """``prg`` with its binary, and what made it. ``target``: a prebuild's renderer (its
    binary made here for that GPU), or None (this process's device compiles it, as tinygrad's
    runner would, reading tinygrad's compile cache first)."""
    if target is not None:
        arch = getattr(target, "arch", "")
        if prg.lib is not None or not arch.startswith("sm_"):
            return prg, ({"kind": "native"} if prg.lib is not None else None)
        lib = cubin(prg.src, arch)
        return dataclasses.replace(prg, lib=lib), {"kind": "cubin", "nvrtc": nvrtc_version(), "arch": arch}
    PROGRAMS.compiled += 1
    if prg.lib is not None:  # the renderer's own compiler made it (tinygrad's CPU device)
        return prg, {"kind": "native"}
    from tinygrad.device import Device

    compiler = Device[prg.device].compiler
    lib = compiler.compile_cached(prg.src)  # tinygrad's compile cache first, as its runner does
    name = type(compiler).__name__
    if name in ("CUDACompiler", "PTXCompiler", "NVCCCompiler"):
        return dataclasses.replace(prg, lib=lib), {"kind": "ptx", "nvrtc": nvrtc_version(), "arch": compiler.arch}
    return dataclasses.replace(prg, lib=lib), {"kind": "native"}


def _settings() -> bytes:
    """Every tinygrad setting in effect (its ``ContextVar``s and the variables its code generation
    reads), and tinygrad's version: what a program's or a schedule's key adds to its own. Not
    ``HALF``, which the weight cache's key holds: it decides the dtype of the weights a load
    makes, and that dtype is in the graph and the AST already. With it, a worker of the synthetic
    model (float16 in its file, so float16 either way) generated every program again under the
    other ``HALF``."""
    from tinygrad.helpers import ContextVar

    # the settings chosen: those set in the environment, and those a Context has changed from the
    # value they were first seen with. Not every ContextVar that exists: which exist depends on
    # the modules a process has imported (a worker on the NULL device had not imported the AMD
    # profiler's), not on what was chosen. Not the CPU's thread count: what it changes, a CPU
    # program's split, the renderer's key holds
    chosen = []
    for k, v in ContextVar._cache.items():
        first = _FIRST_SEEN.setdefault(k, repr(v.value))
        if k not in HOST_SETTINGS and (k in os.environ or repr(v.value) != first):
            chosen.append((k, repr(v.value)))
    settings = sorted(chosen)
    return repr((settings, _codegen_env(), tinygrad_key()["tinygrad"])).encode()


@functools.cache
def _codegen_names() -> tuple[str, ...]:
    """The environment variables tinygrad's code generation reads through ``getenv``."""
    import tinygrad

    root = Path(tinygrad.__file__).parent
    names: set[str] = set()
    for sub in ("codegen", "renderer", "uop", "engine", "schedule"):
        for src in (root / sub).rglob("*.py"):
            names.update(re.findall(r"getenv\(\"([A-Z_0-9]+)\"", src.read_text(errors="replace")))
    return tuple(sorted(names))


def _codegen_env() -> list[tuple[str, str]]:
    return [(n, os.environ[n]) for n in _codegen_names() if n in os.environ]


def _diskcache_get(key: str, table: str = _TABLE) -> Any:
    from tinygrad.helpers import diskcache_get

    try:
        return diskcache_get(table, key)
    except Exception as e:  # a damaged row or a pickle from another build: generate instead
        PROGRAMS.errors.append(f"{type(e).__name__}: {e}")
        return None


def _diskcache_put(key: str, value: Any, table: str = _TABLE) -> None:
    from tinygrad.helpers import diskcache_put

    try:
        diskcache_put(table, key, value)
    except Exception as e:  # a read-only or locked database: the run goes on uncached
        PROGRAMS.errors.append(f"{type(e).__name__}: {e}")

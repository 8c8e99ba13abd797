"""What a stored program's binary is, and whether this host's driver may load it: NVRTC's cubin
for a named architecture (made with no GPU: the image's prebuild), the architecture a cubin's ELF
header names, NVRTC's and the driver's versions, and the rule a stored binary is loaded by
(:func:`binary_refusal`). ``cache.py`` stores each program with a record of what made it."""

from __future__ import annotations

import functools


def cubin(src: str, arch: str) -> bytes:
    """NVRTC's cubin of a CUDA program's source for ``arch`` (``sm_86``), with the options
    tinygrad's CUDA compiler uses; checked to be an ELF for that architecture."""
    from tinygrad.runtime.support.compiler_cuda import NVCompiler

    lib = bytes(NVCompiler(arch).compile(src))
    made = cubin_arch(lib)
    if made != arch:
        raise RuntimeError(f"NVRTC made a binary for {made}, not {arch}")
    return lib


def cubin_arch(lib: bytes) -> str:
    """The architecture a cubin was made for, from its ELF header (``sm_90``), or what it is
    instead: ``not an ELF`` (PTX is text), ``not a CUDA ELF``. A cubin is an ELF of the CUDA
    machine (190) whose flags hold the SM version in their low byte."""
    if lib[:4] != b"\x7fELF":
        return "not an ELF"
    machine = int.from_bytes(lib[18:20], "little")
    if machine != 190:
        return f"not a CUDA ELF (machine {machine})"
    return f"sm_{int.from_bytes(lib[48:52], 'little') & 0xFF}"


@functools.cache
def nvrtc_version() -> str:
    """NVRTC's version as ``major.minor`` (``12.4``)."""
    import ctypes

    from tinygrad.runtime.autogen import nvrtc

    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


@functools.cache
def cuda_driver_version() -> tuple[int, int]:
    """The CUDA version the host's driver supports (``(12, 4)``), from ``cuDriverGetVersion``."""
    import ctypes

    from tinygrad.runtime.autogen import cuda

    v = ctypes.c_int()
    cuda.cuDriverGetVersion(ctypes.byref(v))
    return v.value // 1000, v.value % 1000 // 10


def binary_refusal(binary: dict[str, str] | None) -> str:
    """Why this device must not load a stored binary ("" where it may). A cubin loads on a driver
    of its NVRTC's major version or later (CUDA's minor version compatibility); PTX needs a
    driver of its NVRTC's version or later (its ISA is that toolkit's). The architecture is the
    program's stamp's, checked before. A binary with no record of what made it is not loaded."""
    if binary is None:
        return "no record of what made it"
    kind = binary.get("kind")
    if kind == "native":
        return ""
    if kind not in ("cubin", "ptx"):
        return f"unknown kind {kind!r}"
    try:
        made = tuple(int(x) for x in binary["nvrtc"].split("."))
        driver = cuda_driver_version()
    except Exception as e:  # no driver to ask, or a record without a version
        return f"the driver's version is unknown ({type(e).__name__}: {e})"
    need = made[:1] if kind == "cubin" else made[:2]
    if driver[: len(need)] < need:
        return f"{kind} of NVRTC {binary['nvrtc']}, the driver supports CUDA {driver[0]}.{driver[1]}"
    return ""

"""Can this machine compile the node's CUDA kernels? No GPU is needed to find out.

    python -m pytest_ppsmoke.stage.cudacheck [--arch sm_86 --arch sm_90]

tinygrad's CUDA backend renders every kernel as CUDA C and compiles it at run time with NVRTC;
each f16 or bf16 kernel includes ``cuda_fp16.h`` or ``cuda_bf16.h``, found under
``$CUDA_PATH/include``. This renders a real f16 and a real bf16 kernel (a matmul and a ReLU, as
tinygrad's own CUDA renderer writes them) and compiles each for every ``--arch`` with tinygrad's
own ``CUDACompiler``: the NVRTC library (``NVRTC_PATH``) and the headers an image ships, exactly as
a node on a GPU would use them. It prints one JSON line (the NVRTC version, and the PTX's size and
ISA version for each architecture and dtype) and exits 0; on the first failure it prints
``cudacheck: ...`` naming the architecture, the dtype and NVRTC's own message, and exits 1.

The node image runs it in the suite (``buildah run``, tests/test_image.py): an image that lacks
NVRTC or the headers fails there, on a CPU, not at the first kernel of a rented GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from ..protocol import COMPUTE_CAPS

# every architecture an offer search admits (protocol.COMPUTE_CAPS: 860 -> sm_86)
ARCHES = tuple(f"sm_{cap // 10}" for cap in COMPUTE_CAPS)


def kernel_source(dtype_name: str, arch: str) -> str:
    """The CUDA C tinygrad renders for a 16x16 matmul and ReLU in ``dtype_name`` (half, bfloat16)."""
    from tinygrad import Tensor, dtypes
    from tinygrad.codegen import get_program
    from tinygrad.renderer.cstyle import CUDARenderer

    dtype = getattr(dtypes, dtype_name)
    a, b = (Tensor.empty(16, 16, dtype=dtype, device="CPU") for _ in range(2))
    sinks = [si.ast for si in (a @ b).relu().schedule() if si.ast.op.name == "SINK"]
    if not sinks:
        raise RuntimeError(f"tinygrad scheduled no kernel for a {dtype_name} matmul")
    return str(get_program(sinks[-1], CUDARenderer(arch)).src)


def check(arches: tuple[str, ...] = ARCHES) -> dict[str, object]:
    """Compile an f16 and a bf16 kernel for each of ``arches``; RuntimeError naming the failure."""
    from tinygrad.runtime.support.compiler_cuda import CUDACompiler

    out: dict[str, object] = {
        "CUDA_PATH": os.environ.get("CUDA_PATH", ""),
        "NVRTC_PATH": os.environ.get("NVRTC_PATH", ""),
    }
    for arch in arches:
        compiler = CUDACompiler(arch)
        for dtype_name, header in (("half", "cuda_fp16.h"), ("bfloat16", "cuda_bf16.h")):
            src = kernel_source(dtype_name, arch)
            if header not in src:
                raise RuntimeError(f"tinygrad's {dtype_name} kernel for {arch} no longer includes {header}")
            try:
                ptx = compiler.compile(src).decode(errors="replace")
            except Exception as e:  # tinygrad's CompileError carries NVRTC's log
                raise RuntimeError(
                    f"{arch} {dtype_name}: {' '.join(str(e).replace(chr(0), '').split())[:400]}"
                ) from None
            isa = re.search(r"^\.version (\S+)", ptx, re.M)
            out[f"{arch} {dtype_name}"] = {"ptx_bytes": len(ptx), "ptx_isa": isa.group(1) if isa else ""}
    import ctypes

    from tinygrad.runtime.autogen import nvrtc

    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    out["nvrtc"] = f"{major.value}.{minor.value}"
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pytest_ppsmoke.stage.cudacheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", action="append", help=f"a GPU architecture (default {', '.join(ARCHES)})")
    args = p.parse_args(argv)
    try:
        result = check(tuple(args.arch or ARCHES))
    except Exception as e:  # NVRTC missing, a header missing: one line
        print(f"cudacheck: {' '.join(str(e).split())[:600]}", file=sys.stderr)
        raise SystemExit(1) from None
    print(json.dumps(result))


if __name__ == "__main__":
    main()

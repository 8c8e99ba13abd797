"""The layout fit's answers on this process's processor settings, as one JSON line: what
``test_layout_cpu`` compares across environments (numpy's SIMD features switched off, OpenBLAS on
one thread or another core type). Run as ``python -m tests.layout_answers`` from the checkout."""

from __future__ import annotations

import ctypes
import glob
import json
import os
from dataclasses import replace
from typing import Any

import numpy as np
from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

from pytest_ppsmoke.layout.fit import Fit, fit
from pytest_ppsmoke.layout.grid import hold_out

from .test_layout import synthetic_grid

# the names OpenBLAS's builds give these (numpy's wheels rename its symbols)
CORENAME = ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename")
THREADS = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads", "openblas_get_num_threads")


def blas() -> dict[str, Any]:
    """OpenBLAS's own account of what it runs with: its core type (the kernels it picked for this
    processor, or the one ``OPENBLAS_CORETYPE`` forced) and its threads."""
    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "libscipy_openblas*"))
    if not libs:
        return {}
    lib = ctypes.CDLL(libs[0])
    found: dict[str, Any] = {}
    for key, names in (("core", CORENAME), ("threads", THREADS)):
        fn = next((getattr(lib, n) for n in names if hasattr(lib, n)), None)
        if fn is not None:
            fn.restype = ctypes.c_char_p if key == "core" else ctypes.c_int
            value = fn()
            found[key] = value.decode() if key == "core" else int(value)
    return found


def answers(f: Fit, grid: Any) -> dict[str, Any]:
    held = f.held_out_errors(grid)
    return {
        "ttft_err": [r.ttft_err for r in held.rows],
        "tpot_err": [r.tpot_err for r in held.rows],
        "wake": [f.wake.per, f.wake.from_s, f.wake.to_s, f.decode["wake"]] if f.wake else None,
        "prefill": f.prefill,
        "decode": f.decode,
    }


def main() -> None:
    grid = synthetic_grid()
    largest = replace(grid, held_out=hold_out(grid.points, "largest"))
    print(
        json.dumps(
            {
                "simd": sorted(k for k in __cpu_dispatch__ if __cpu_features__.get(k)),
                "blas": blas(),
                "every_seventh": answers(fit(grid), grid),
                "largest": answers(fit(largest), largest),
            }
        )
    )


if __name__ == "__main__":
    main()

"""The layout fit's answers do not move with the processor: the fit of ``test_layout``'s
synthetic grid (every seventh point held out, and the largest stage count held out) run in
subprocesses with numpy's SIMD loops switched off, OpenBLAS on one thread, OpenBLAS on its
oldest x86-64 kernels, and all three, gives the held-out errors, the coefficients and the
chosen wake-up ramp of a plain run to a billionth, far inside the layout tests' tolerances."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

pytestmark = pytest.mark.local

ROOT = Path(__file__).resolve().parents[1]
KNOBS = ("NPY_DISABLE_CPU_FEATURES", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE", "OMP_NUM_THREADS")
WANTED_OFF = ("AVX512F", "AVX2", "FMA3")  # numpy 1.x's names; numpy 2.4 dispatches groups (X86_V3, ...)
SAME = 1e-9  # relative: the layout tests allow 0.03 held-out error and 1 % on the wake-up


def simd_off() -> str:
    """``NPY_DISABLE_CPU_FEATURES`` that switches off the wider SIMD loops: the names asked for
    where this numpy dispatches them, else every dispatched feature this processor has (numpy
    warns about, and ignores, a name it does not dispatch)."""
    named = [n for n in WANTED_OFF if n in __cpu_dispatch__]
    return " ".join(named or [n for n in __cpu_dispatch__ if __cpu_features__.get(n)])


ENVIRONMENTS: dict[str, dict[str, str]] = {
    "as is": {},
    "numpy's SIMD off": {"NPY_DISABLE_CPU_FEATURES": simd_off()},
    "one BLAS thread": {"OPENBLAS_NUM_THREADS": "1"},
    "BLAS's oldest kernels": {"OPENBLAS_CORETYPE": "Prescott"},
}
ENVIRONMENTS["all three"] = {k: v for env in ENVIRONMENTS.values() for k, v in env.items()}


def run_all() -> dict[str, dict[str, Any]]:
    """``tests.layout_answers`` in each environment, side by side (each about half a second)."""
    base = {k: v for k, v in os.environ.items() if k not in KNOBS}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "tests.layout_answers"],
            cwd=ROOT,
            env={**base, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, env in ENVIRONMENTS.items()
    }
    got = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"{name}: exit {proc.returncode}: {err[-2000:]}"
            assert "cannot disable" not in err, f"{name}: numpy ignored the features: {err[-500:]}"
            got[name] = json.loads(out)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return got


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two answers differ: numbers by more than ``SAME`` (relative), anything else at all."""
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        return [] if math.isclose(a, b, rel_tol=SAME, abs_tol=1e-15) else [f"{where}: {a!r} != {b!r}"]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def test_the_layout_fit_gives_the_same_answers_whatever_the_processors_kernels() -> None:
    got = run_all()
    plain = got["as is"]
    # each environment took: else the comparison below would prove nothing
    assert got["numpy's SIMD off"]["simd"] == [] and got["all three"]["simd"] == []
    if plain["blas"]:  # OpenBLAS says what it runs with (numpy's wheels)
        assert got["one BLAS thread"]["blas"]["threads"] == 1
        oldest = ("Prescott", "Katmai")  # OpenBLAS names the forced Prescott kernels Katmai
        assert got["BLAS's oldest kernels"]["blas"]["core"] in oldest, got["BLAS's oldest kernels"]["blas"]
    for name, answers in got.items():
        for grid in ("every_seventh", "largest"):
            off = differences(plain[grid], answers[grid], grid)
            assert not off, f"{name} moved the fit's answers: " + "; ".join(off[:5])
        held = answers["every_seventh"]  # and within the layout tests' own tolerance, in every environment
        assert max(held["ttft_err"] + held["tpot_err"]) < 0.03, (name, held)
    wake = plain["largest"]["wake"]
    assert wake[:3] == ["call", 0.12, 0.27], wake  # the ramp that ends soonest among those that tie


def test_differences_finds_what_moved() -> None:
    a = {"x": [1.0, 2.0], "w": ["call", 0.12, 0.27]}
    assert differences(a, {"x": [1.0, 2.0 * (1 + 1e-12)], "w": ["call", 0.12, 0.27]}) == []
    assert differences(a, {"x": [1.0, 2.0 * (1 + 1e-6)], "w": ["call", 0.12, 0.27]}) == [
        f".x[1]: 2.0 != {2.0 * (1 + 1e-6)!r}"
    ]
    assert differences(a, {"x": [1.0, 2.0], "w": ["step", 0.12, 0.27]}) == [".w[0]: 'call' != 'step'"]
    assert differences(a, {"x": [1.0], "w": a["w"]}) == [".x: [1.0, 2.0] != [1.0]"]

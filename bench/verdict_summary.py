"""The table of ``bench/verdict_gpu.sh``'s runs: each report's phases, rent to teardown, the
slowest stage's load parts and whether the tokens matched its reference.

    python bench/verdict_summary.py DIR [DIR ...] [--out FILE]

Each DIR holds ``<cold|warm>_<after|beside>.json`` reports (or any ``*.json`` report of
``pp-smoke-run``); a row is ``DIR/NAME``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchio import emit  # bench/ is this script's directory: first on sys.path

PHASES = ("rent", "boot", "converge", "load", "prefill", "decode", "reference", "teardown")


def row(report: dict[str, Any]) -> dict[str, Any]:
    t = report["timings"]
    ref = report.get("reference") or {}
    return {
        "ok": report["ok"],
        "match": ref.get("match"),
        "reference_loaded": ref.get("loaded"),
        "rent_to_teardown_s": round(sum(t.get(p, 0.0) for p in PHASES if p != "resolve"), 3),
        "total_s": t.get("total"),
        "phases_s": {p: t.get(p) for p in PHASES},
        "decode_tokens_per_s": t.get("decode_tokens_per_s"),
        "reference_load_s": ref.get("load_s"),
        "reference_generate_s": ref.get("generate_s"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rows = {f"{d.name}/{f.stem}": row(json.loads(f.read_text())) for d in a.dirs for f in sorted(d.glob("*.json"))}
    emit({"bench": "verdict_gpu", "runs": rows}, a.out)


if __name__ == "__main__":
    main()

"""SWIM at scale, simulated: ``swim.Membership`` (the code the nodes run) with N members on a
virtual clock (``pytest_ppsmoke/network/swimsim.py``), beside memberlist's formulas.

    python bench/bench_swim_scale.py [--sizes 10,30,100,300,1000] [--watch 120] [--out FILE] [--plot PNG]

For each N, on wan's links (20 ms one way, 2 ms jitter, 0.1% loss) with the WAN preset:
- ``converge_s``: every member joins through member 0 at time 0; until every member sees every
  other alive;
- ``detect_first_s`` / ``detect_all_s`` / spread: a healthy member killed once converged; until the
  first member declares it dead, and until the last live one knows;
- ``messages`` and ``bytes`` per member per second over that run (bytes: each message's wire frame).
Then, for false deaths, the same cluster converged on wan and watched ``--watch`` simulated
seconds on flaky's links (20% loss, correlation 0.75) with one member in ten slow (each message
it handles up to 1 s late): with Lifeguard (the preset) and without (``awareness_max=1``,
``suspicion_max_mult=1``), where N allows; these lose a lost packet's message (``datagram``: UDP,
as memberlist and the Lifeguard paper have it). ``lifeguard_quic``: the same with Lifeguard on
the nodes' transport, where QUIC sends a lost packet again (``quic``). A simulated second is not
a wall second: each run says both (``virtual_s``, ``wall_s``).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchio import emit  # bench/ is this script's directory: first on sys.path

from pytest_ppsmoke.network.swimsim import SimSpec, simulate
from pytest_ppsmoke.runtime.swimconfig import SwimConfig

LIFEGUARD_OFF = dataclasses.replace(SwimConfig.wan(), awareness_max=1, suspicion_max_mult=1.0)


def row(n: int, watch: float, off_up_to: int) -> dict[str, Any]:
    out: dict[str, Any] = {"members": n}
    r = simulate(SimSpec(members=n, profile="wan", config=SwimConfig.wan()))
    out["detection"] = {
        k: getattr(r, k)
        for k in (
            "converge_s", "detect_first_s", "detect_all_s", "detect_spread_s", "messages_per_member_s",
            "bytes_per_member_s", "virtual_s", "wall_s", "bounds",
        )
    }  # fmt: skip
    print(n, "detection", out["detection"], flush=True)
    spec = SimSpec(
        members=n, slowed=0.1, slow_s=1.0, kill=False, watch_s=watch, watch_profile="flaky", count_bytes=False
    )
    runs = (("lifeguard", SwimConfig.wan(), "datagram"), ("lifeguard_off", LIFEGUARD_OFF, "datagram"))
    for name, cfg, transport in (*runs, ("lifeguard_quic", SwimConfig.wan(), "quic")):
        if name == "lifeguard_off" and n > off_up_to:
            continue
        f = simulate(dataclasses.replace(spec, config=cfg, transport=transport))
        out[name] = {
            "false_deaths": f.false_deaths,
            "false_deaths_per_member_hour": f.false_deaths_per_member_hour,
            "suspicions": f.suspicions,
            "refuted": f.refuted,
            "virtual_s": f.virtual_s,
            "wall_s": f.wall_s,
        }
        print(n, name, out[name], flush=True)
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["members"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(ns, [r["detection"]["detect_first_s"] for r in rows], "o-", label="first declares dead (simulated)")
    ax.plot(ns, [r["detection"]["detect_all_s"] for r in rows], "s-", label="all know (simulated)")
    ax.plot(ns, [r["detection"]["bounds"]["expected_detection_s"] for r in rows], "--", label="expected (formula)")
    ax.plot(ns, [r["detection"]["bounds"]["memberlist_suspicion_s"] for r in rows], ":", label="memberlist suspicion")
    ax.set_xscale("log")
    ax.set_xlabel("members")
    ax.set_ylabel("seconds after the kill")
    ax.set_title("SWIM + Lifeguard on wan links, WAN preset")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10,30,100,300,1000")
    ap.add_argument("--watch", type=float, default=120.0, help="simulated seconds of flaky links per false-death run")
    ap.add_argument("--off-up-to", type=int, default=300, help="the largest N also run without Lifeguard")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    a = ap.parse_args()
    rows = [row(int(n), a.watch, a.off_up_to) for n in a.sizes.split(",")]
    if a.plot:
        plot(rows, a.plot)
    emit(
        {
            "bench": "swim_scale",
            "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
            "config": dataclasses.asdict(SwimConfig.wan()),
            "watch_s": a.watch,
            "rows": rows,
        },
        a.out,
    )


if __name__ == "__main__":
    main()

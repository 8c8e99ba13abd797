"""Real members against the simulation: SWIM with N member processes (iroh and all), each in a
network namespace of an emulated network, measured as the simulation measures, then the
simulation run at the same N, profile, SWIM configuration and join schedule over many seeds.

    python bench/bench_swim_members.py [--sizes 8,16,32] [--profile wan] [--hold 60] [--sims 20] [--out FILE]

Per size: the cluster forms (member 0, the seed, in this process; the others as they come up),
one member is SIGKILLed, every live member must declare it dead, then the cluster is watched for
``--hold`` seconds (false deaths, suspicions, what each member costs this machine).
``network/swimreal.py`` measures; ``network/swimsim.py`` simulates, with each of its transport
models (``quic``: a lost packet sent again, as the members' iroh streams do; ``datagram``: a lost
packet is a lost message, as memberlist's UDP); ``agreement`` says, figure by figure, whether the
real value lies in the simulated range widened by the stated tolerance. ``--resimulate FILE``
simulates a saved result's real runs again. The
largest N this machine holds is where its cores run out: ``machine_busy`` over the hold says how
close each size came.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench_swim_network import swim_for  # noqa: E402  (bench/, this script's directory, is first on sys.path)

from pytest_ppsmoke.network import EmulatedNetwork, parse_network  # noqa: E402
from pytest_ppsmoke.network.swimreal import RealResult, RealSpec, agreement, run_members  # noqa: E402
from pytest_ppsmoke.network.swimsim import TRANSPORTS, SimSpec, simulate  # noqa: E402
from pytest_ppsmoke.runtime.swimconfig import SwimConfig  # noqa: E402


async def real_run(n: int, profile: str, hold: float, seed: int, wave: int) -> RealResult:
    async with EmulatedNetwork(parse_network(profile), seed=seed) as net:
        spec = RealSpec(members=n, config=swim_for(profile), hold_s=hold, seed=seed, start_wave=wave)
        return await run_members(net, spec)


def simulations(real: RealResult, cfg: SwimConfig, sims: int) -> dict[str, Any]:
    """The simulation of ``real``'s N, profile and join schedule, per transport model: its
    figures per seed and its agreement with the real run."""
    out: dict[str, Any] = {}
    for transport in TRANSPORTS:
        wall = time.monotonic()
        simulated = [
            simulate(
                SimSpec(
                    real.members,
                    real.profile,
                    cfg,
                    join_at=real.join_at,
                    watch_s=real.hold_s,
                    seed=s,
                    transport=transport,
                )
            )
            for s in range(1, sims + 1)
        ]
        out[transport] = {
            "figures": [
                {k: getattr(r, k) for k in ("converge_after_joins_s", "detect_first_s", "detect_all_s", "false_deaths")}
                for r in simulated
            ],
            "wall_s": round(time.monotonic() - wall, 1),
            "agreement": agreement(real, simulated),
        }
    return out


def one_size(n: int, profile: str, hold: float, sims: int, seed: int, wave: int) -> dict[str, Any]:
    cfg = swim_for(profile)
    wall = time.monotonic()
    real = asyncio.run(real_run(n, profile, hold, seed, wave))
    out: dict[str, Any] = {
        "members": n,
        "profile": profile,
        "start_wave": wave,
        "swim": asdict(cfg),
        "real": asdict(real),
    }
    out["real_wall_s"] = round(time.monotonic() - wall, 1)
    out["simulated"] = simulations(real, cfg, sims)
    brief = {t: v["agreement"] for t, v in out["simulated"].items()}
    print(json.dumps({"members": n, "real": asdict(real), "agreement": brief}), flush=True)
    return out


def resimulate(path: Path, sims: int) -> dict[str, Any]:
    """The saved real runs of ``path``, simulated again (the simulation changed, not the members)."""
    saved: dict[str, Any] = json.loads(path.read_text())
    for size in saved["sizes"]:
        real = RealResult(**{**size["real"], "join_at": tuple(size["real"]["join_at"])})
        size.setdefault("swim", asdict(swim_for(real.profile)))
        size["simulated"] = simulations(real, swim_for(real.profile), sims)
    saved["resimulated_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8,16,32")
    ap.add_argument("--profile", default="wan")
    ap.add_argument("--hold", type=float, default=60.0, help="seconds watched for false deaths after the detection")
    ap.add_argument("--sims", type=int, default=20, help="simulated seeds per size")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--wave",
        type=int,
        default=16,
        help="member processes started at a time (0: all at once; 63 at once overload 2 cores)",
    )
    ap.add_argument("--out", type=Path, default=HERE / "results" / "swim_members.json")
    ap.add_argument("--resimulate", type=Path, help="a saved result: simulate its real runs again, run nothing real")
    a = ap.parse_args()
    if a.resimulate:
        a.out.write_text(json.dumps(resimulate(a.resimulate, a.sims), indent=1) + "\n")
        print(a.out)
        return
    res: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()},
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "sizes": [],
    }
    for n in (int(x) for x in a.sizes.split(",")):
        try:
            res["sizes"].append(one_size(n, a.profile, a.hold, a.sims, a.seed, a.wave))
        except Exception as e:  # a size this machine does not hold: the figure, and no larger one
            res["failed"] = {"members": n, "error": f"{type(e).__name__}: {e}", "load_average": os.getloadavg()}
            print(json.dumps(res["failed"]), flush=True)
            break
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(a.out)


if __name__ == "__main__":
    main()

"""Real members against the simulation: SWIM with N member processes (iroh and all), each in a
network namespace of an emulated network, measured as the simulation measures, then the
simulation run at the same N, profile, SWIM configuration and join schedule over many seeds.

    python bench/bench_swim_members.py [--sizes 8,16,32] [--profile wan] [--hold 60] [--sims 20] [--out FILE]

Per size: the cluster forms (member 0, the seed, in this process; the others as they come up),
one member is SIGKILLed, every live member must declare it dead, then the cluster is watched for
``--hold`` seconds (false deaths, suspicions, what each member costs this machine).
``network/swimreal.py`` measures; ``network/swimsim.py`` simulates; ``agreement`` says, figure by
figure, whether the real value lies in the simulated range widened by the stated tolerance. The
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

from pytest_ppsmoke.cloud.lifecycle import RunConfig  # noqa: E402
from pytest_ppsmoke.harness.driver import rtt_of  # noqa: E402
from pytest_ppsmoke.network import EmulatedNetwork, parse_network  # noqa: E402
from pytest_ppsmoke.network.swimreal import RealSpec, agreement, run_members  # noqa: E402
from pytest_ppsmoke.network.swimsim import SimSpec, simulate  # noqa: E402


async def real_run(n: int, profile: str, hold: float, seed: int) -> Any:
    cfg = RunConfig(network="local", rtt=rtt_of(parse_network(profile))).swim
    async with EmulatedNetwork(parse_network(profile), seed=seed) as net:
        return await run_members(net, RealSpec(members=n, config=cfg, hold_s=hold, seed=seed))


def one_size(n: int, profile: str, hold: float, sims: int, seed: int) -> dict[str, Any]:
    cfg = RunConfig(network="local", rtt=rtt_of(parse_network(profile))).swim
    wall = time.monotonic()
    real = asyncio.run(real_run(n, profile, hold, seed))
    real_wall = time.monotonic() - wall
    wall = time.monotonic()
    simulated = [
        simulate(SimSpec(n, profile, cfg, join_at=real.join_at, watch_s=real.hold_s, seed=s))
        for s in range(1, sims + 1)
    ]
    sim_wall = time.monotonic() - wall
    agree = agreement(real, simulated)
    out = {
        "members": n,
        "profile": profile,
        "swim": asdict(cfg),
        "real": asdict(real),
        "real_wall_s": round(real_wall, 1),
        "simulated": [
            {k: getattr(s, k) for k in ("converge_after_joins_s", "detect_first_s", "detect_all_s", "false_deaths")}
            for s in simulated
        ],
        "simulated_wall_s": round(sim_wall, 1),
        "agreement": agree,
    }
    print(json.dumps({"members": n, "real": asdict(real), "agreement": agree}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8,16,32")
    ap.add_argument("--profile", default="wan")
    ap.add_argument("--hold", type=float, default=60.0, help="seconds watched for false deaths after the detection")
    ap.add_argument("--sims", type=int, default=20, help="simulated seeds per size")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "swim_members.json")
    a = ap.parse_args()
    res: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()},
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "sizes": [one_size(int(n), a.profile, a.hold, a.sims, a.seed) for n in a.sizes.split(",")],
    }
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(a.out)


if __name__ == "__main__":
    main()

"""Decode over an emulated network: the per-token time at one-way delays of 0 to 100 ms, against
the prediction ``compute + ring round trip + overhead``.

    python bench/bench_network.py [--delays 0,1,10,40,100] [--rounds 1] [--max-tokens 32]
                                  [--skip 3] [--model GGUF] [--rtt-samples 30] [--out FILE]

Each point is one ``pp-smoke-run --local --network ...`` run (the driver's ``SmokeRun``, in a
process of its own so every point starts cold alike) of the synthetic tiny model (written with
``pp-synth-gguf --shape tiny --seed 1``, a seed whose greedy answer runs the full ``--max-tokens``
without an end token), reference off. Delay 0 is loopback (no namespaces, no switch): the
baseline, measured in the same run; ``sw0`` is the switch with links of 0 ms (its own cost); a
delay ``d > 0`` is a profile of exactly ``d`` ms one way on every link, no jitter, loss or rate.

Per token, from the stages' own records (wall clock; all on one machine): the interval between
two sampled tokens at stage 1, and its parts: stage 0's ``decode_step`` call, the activation's
hop (sent at stage 0 until it arrived at stage 1), stage 1's ``forward_and_sample`` call, and the
way back (stage 1's sample done until stage 0's next ``decode_step`` began: the ``NextToken``
hop and the dispatch). The first ``--skip`` decode tokens are left out (tinygrad's JIT captures
on the first decode steps); medians over the rest.

The prediction for delay ``d``: ``C + 2d + O``, with ``C`` the compute per token of the loopback
run (the two calls), ``2d`` the ring's round trip (the activation to stage 1, ``NextToken`` back to
stage 0), and ``O`` the overhead fitted at the 1 ms point (``O = T(1) - C - 2 ms``). Also the
least-squares line ``T = a + b * 2d`` over the emulated points, whose slope ``b`` above 1 is the
transport's cost growing with the path (QUIC pacing; docs/network.md), and, per delay, a
UDP 64 B and an iroh 2 KB round trip between the host and a member (``--rtt-samples`` each) to
show that cost apart from decode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SELF = Path(__file__).resolve()
HERE = SELF.parent
sys.path.insert(0, str(HERE.parent))


def profile_name(delay: str) -> str:
    return "loopback" if delay == "0" else f"bench{delay}"


def install_profiles(delays: list[str]) -> None:
    """Register ``benchD`` (D ms one way, nothing else) in this process's profile table, so that
    ``--network benchD`` parses here (the emulator and the driver run in this process; the switch
    gets the links' figures, not the name)."""
    from pytest_ppsmoke.network.profiles import PROFILES, LinkProfile

    for d in delays:
        if d != "0":
            PROFILES[f"bench{d}"] = LinkProfile(delay_ms=0.0 if d == "sw0" else float(d))


def med(xs: list[float]) -> float | None:
    return round(statistics.median(xs) * 1e3, 3) if xs else None


def per_token(stages: list[Any], skip: int) -> dict[str, Any]:
    """The decode tokens' intervals and their parts, in ms (medians over the steady tokens)."""
    s0, s1 = stages[0], stages[-1]
    steps = {c.position: c for c in s0.compute if c.op == "decode_step"}
    samples = sorted((c for c in s1.compute if c.op == "forward_and_sample"), key=lambda c: c.at)
    sent = {h.position: h for h in s0.hops_out if h.position}
    arrived = {a.position: a for a in s1.activations_in if a.position}
    parts: dict[str, list[float]] = {k: [] for k in ("token", "stage0", "hop", "stage1_wait", "stage1", "back")}
    decode = [c for c in samples if c.position in steps]  # decode positions only (prefill's is 0)
    for i, c in enumerate(decode):
        if i < skip:
            continue
        step, prev_end = steps[c.position], None
        prev = [p for p in samples if p.at < c.at]
        if prev:
            prev_end = prev[-1].at + prev[-1].s
            parts["token"].append(c.at + c.s - prev_end)
            parts["back"].append(step.at - prev_end)
        parts["stage0"].append(step.s)
        if c.position in sent and c.position in arrived:
            parts["hop"].append(arrived[c.position].at - sent[c.position].at)
            parts["stage1_wait"].append(c.at - arrived[c.position].at)
        parts["stage1"].append(c.s)
    out: dict[str, Any] = {f"{k}_ms": med(v) for k, v in parts.items()}
    out["compute_ms"] = round(out["stage0_ms"] + out["stage1_ms"], 3)
    out["steady_tokens"] = len(parts["token"])
    out["decode_tokens"] = len(decode)
    return out


# --- one point: a run in a process of its own -----------------------------------------------------


def point(network: str, model: str | None, max_tokens: int, skip: int, reference: str = "off") -> dict[str, Any]:
    """One run on ``network`` (a profile's text, or ``benchD``), its figures per token."""
    from pytest_ppsmoke.harness.cli import execute, parse_args
    from pytest_ppsmoke.harness.driver import SmokeRun

    if network.startswith("bench"):
        install_profiles([network.removeprefix("bench")])
    argv = ["--local", "--max-tokens", str(max_tokens), "--reference", reference, "--network", network]
    argv += ["--model", model] if model else []
    _, settings = parse_args(argv)
    run = SmokeRun(settings)
    started = time.perf_counter()
    asyncio.run(execute(run))
    wall = time.perf_counter() - started
    r = run.report
    r.finish()
    out: dict[str, Any] = {"network": network, "ok": r.ok, "error": r.error, "wall_s": round(wall, 2)}
    if run.result is not None:
        out["generated"] = len(run.result.token_ids)
        out["timings"] = run.result.timings
        out["hops"] = run.result.hops
        out["per_token"] = per_token(run.result.stages, skip)
    out["network_stats"] = r.network_stats
    ref = r.reference
    out["reference"] = {
        "state": ref.state,
        "match": ref.match,
        "first_difference": ref.first_difference,
        "detail": ref.detail,
    }
    return out


# --- round trips of the transport alone ---------------------------------------------------------


async def round_trips(delay: str, n: int) -> dict[str, Any]:
    """UDP 64 B and iroh 2 KB frame round trips, host to one member, on the point's profile."""
    import bench_switch as bs

    from pytest_ppsmoke.network import EmulatedNetwork, parse_network
    from pytest_ppsmoke.runtime import codec
    from pytest_ppsmoke.runtime.codec import Echo, Envelope, Message
    from pytest_ppsmoke.runtime.localproc import ChildProcess
    from pytest_ppsmoke.runtime.transport import PeerAddr, Transport, new_secret_key

    got: asyncio.Queue[bytes] = asyncio.Queue()

    def on_message(src: str, env: Envelope, msg: Message) -> None:
        if isinstance(msg, Echo):
            got.put_nowait(msg.payload)

    async with EmulatedNetwork(parse_network(profile_name(delay)), seed=1) as net:
        m = await net.add_member("0")
        host = Transport(new_secret_key(), on_message=on_message, local=True, bind_addr=f"{net.host_addr}:0")
        await host.start()
        p = ChildProcess(
            "peer", m.wrap([sys.executable, str(HERE / "bench_switch.py"), "peer", m.addr, host.ticket()]), os.environ
        )
        await p.start()
        try:
            ev = await p.wait_event(lambda e: "port" in e, 20, "the peer")
            udp = await asyncio.to_thread(bs.udp_rtts, net.host_addr, (m.addr, int(ev["port"])), 64, n)
            host.learn(PeerAddr(ev["id"], tuple(ev["addrs"])))
            rtts = []
            for i in range(n + 5):
                frame = codec.encode_frame(Envelope("a", "b", i + 1, False), Echo(os.urandom(2048)))
                t0 = time.perf_counter()
                await host.send_frame(ev["id"], frame, 10)
                await asyncio.wait_for(got.get(), 10)
                rtts.append(time.perf_counter() - t0)
            return {"udp_64B_ms": med(udp), "iroh_2KB_ms": med(rtts[5:]), "n": n}
        finally:
            await p.stop(grace=1.0)
            await host.close()


# --- the sweep ---------------------------------------------------------------------------------------


def fit(points: dict[str, dict[str, Any]], compute_ms: float) -> dict[str, Any]:
    """``T = C + 2d + O`` with ``O`` from the 1 ms point; and the least-squares line over the
    emulated points ``T = a + b * 2d``."""
    emulated = {float(d): p["token_ms"] for d, p in points.items() if d not in ("0", "sw0")}
    out: dict[str, Any] = {"compute_ms": compute_ms}
    if 1.0 in emulated:
        o = emulated[1.0] - compute_ms - 2.0
        out["overhead_ms"] = round(o, 3)
        out["prediction"] = {}
        for d, p in points.items():
            dd = 0.0 if d in ("0", "sw0") else float(d)
            pred = compute_ms + 2 * dd + o
            own = p["compute_ms"] + 2 * dd + o  # the same with the point's own compute (the machine drifts)
            out["prediction"][d] = {
                "predicted_ms": round(pred, 3),
                "measured_ms": p["token_ms"],
                "error_pct": round((p["token_ms"] - pred) / pred * 100, 1),
                "own_compute_predicted_ms": round(own, 3),
                "own_compute_error_pct": round((p["token_ms"] - own) / own * 100, 1),
            }
    if len(emulated) >= 2:
        xs, ys = [2 * d for d in emulated], list(emulated.values())
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        out["line"] = {"intercept_ms": round(my - b * mx, 3), "slope_per_rtt_ms": round(b, 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delays", default="0,sw0,1,10,40,100", help="one-way ms; 0 = loopback, sw0 = switch at 0 ms")
    ap.add_argument("--rounds", type=int, default=1, help="sweeps, interleaved (medians over them)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--skip", type=int, default=3, help="decode tokens left out (JIT warm-up)")
    ap.add_argument("--model", help="a GGUF (default: the synthetic tiny model, seed 1, written to a temp dir)")
    ap.add_argument("--rtt-samples", type=int, default=30, help="transport round trips per delay (0: none)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "network.json")
    ap.add_argument("--point", help=argparse.SUPPRESS)  # one run, in its own process: a network's text
    ap.add_argument("--reference", default="off", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point is not None:
        print(json.dumps(point(args.point, args.model, args.max_tokens, args.skip, args.reference)))
        return
    delays = [d.strip() for d in args.delays.split(",") if d.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = str(Path(tmp) / "tiny.gguf")
            subprocess.run(
                [sys.executable, "-m", "pytest_ppsmoke.stage.synth", "--shape", "tiny", "--seed", "1", model],
                check=True, capture_output=True,
            )  # fmt: skip
        runs: dict[str, list[dict[str, Any]]] = {d: [] for d in delays}
        for rnd in range(args.rounds):
            for d in delays:
                cmd = [sys.executable, str(SELF), "--point", profile_name(d), "--model", model]
                cmd += ["--max-tokens", str(args.max_tokens), "--skip", str(args.skip)]
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                if out.returncode:
                    raise SystemExit(f"point {d} failed:\n{out.stderr[-3000:]}")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                if not res["ok"]:
                    raise SystemExit(f"point {d}: the run failed: {res['error']}")
                runs[d].append(res)
                print(f"round {rnd} delay {d}: {json.dumps(res['per_token'])}", flush=True)
    points: dict[str, dict[str, Any]] = {}
    for d, rs in runs.items():
        keys = [k for k in rs[0]["per_token"] if k.endswith("_ms")]
        points[d] = {
            k.removesuffix("_ms") + "_ms": round(statistics.median(r["per_token"][k] for r in rs), 3) for k in keys
        }
        points[d]["generated"] = [r["generated"] for r in rs]
        points[d]["steady_tokens"] = [r["per_token"]["steady_tokens"] for r in rs]
    install_profiles(delays)
    rtt: dict[str, Any] = {}
    if args.rtt_samples:
        for d in delays:
            if d != "0":
                rtt[d] = asyncio.run(round_trips(d, args.rtt_samples))
                print(f"round trips at {d}: {rtt[d]}", flush=True)
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()},
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "point"},
        "points": points,
        "fit": fit(points, points["0"]["compute_ms"]) if "0" in points else None,
        "round_trips": rtt,
        "runs": runs,
    }
    print(json.dumps({"points": points, "fit": result["fit"], "round_trips": rtt}, indent=2))
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Where a 4 KiB request/response round trip of our stack spends its time.

    python bench/trace_roundtrip.py [--n 1000] [--out FILE]

A member process and a client process (both ``pytest_ppsmoke``) run with the iroh binding's
``SendStream.write_all`` and ``RecvStream.read``/``read_exact`` wrapped to record wall-clock
timestamps (one clock for both processes on one machine). Matching each request's events gives
the median of every leg:

    client write_all | transit | member handling (our Python) | member write_all | transit
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchio import emit  # bench/ is this script's directory: first on sys.path

HERE = Path(__file__).resolve().parent

TRACER = r"""
import atexit, functools, json, os, signal, time
import iroh
LOG = []
def wrap(cls, name, tag):
    orig = getattr(cls, name)
    @functools.wraps(orig)
    async def traced(self, *a, **k):
        t0 = time.time()
        r = await orig(self, *a, **k)
        LOG.append((tag, t0, time.time(), len(r) if isinstance(r, (bytes, bytearray)) else -1))
        return r
    setattr(cls, name, traced)
wrap(iroh.RecvStream, "read", "read")
wrap(iroh.RecvStream, "read_exact", "read")
wrap(iroh.SendStream, "write_all", "write")
def dump(*_):
    with open(os.environ["PP_TRACE_OUT"], "w") as f:
        json.dump(LOG, f)
atexit.register(dump)
signal.signal(signal.SIGUSR1, dump)
"""


def median_us(xs: list[float]) -> float:
    return round(sorted(xs)[len(xs) // 2] * 1e6, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    from pytest_ppsmoke.runtime.localproc import ClusterKeys, member_env

    tmp = Path(tempfile.mkdtemp(prefix="pp-trace-"))
    (tmp / "pp_tracer.py").write_text(TRACER)
    keys = ClusterKeys(2)
    env = member_env(keys.keys[0], keys.ids, None, [], "")
    env.update(PP_TRACE_OUT=str(tmp / "member.json"), PYTHONPATH=str(tmp))
    run_member = "import pp_tracer, runpy; runpy.run_module('pytest_ppsmoke.runtime.member', run_name='__main__')"
    member = subprocess.Popen([sys.executable, "-c", run_member], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert member.stdout is not None
        ready = json.loads(member.stdout.readline())
        spec = {"key": keys.keys[1].hex(), "allowed": keys.ids, "ticket": ready["ticket"], "id": ready["id"]}
        argv = ["bench_transport.py", "--client", "ppsmoke", json.dumps(spec), str(a.n), "0"]
        run_client = (
            f"import pp_tracer, runpy, sys; sys.argv = {argv!r}; "
            f"runpy.run_path({str(HERE / 'bench_transport.py')!r}, run_name='__main__')"
        )
        cenv = dict(os.environ, PP_TRACE_OUT=str(tmp / "client.json"), PYTHONPATH=str(tmp))
        out = subprocess.run([sys.executable, "-c", run_client], env=cenv, capture_output=True, text=True, check=True)
        total = json.loads(out.stdout.strip().splitlines()[-1])["rt_4k"]["median_us"]
        member.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
    finally:
        member.kill()
        member.wait()
    client = json.loads((tmp / "client.json").read_text())
    mem = json.loads((tmp / "member.json").read_text())
    big = 1000  # 4 KiB frames only, not the SWIM chatter
    c_writes = [e for e in client if e[0] == "write"][100:-10]
    m_read_end = sorted(e[2] for e in mem if e[0] == "read" and e[3] > big)
    m_writes = sorted((e[1], e[2]) for e in mem if e[0] == "write")
    c_read_end = sorted(e[2] for e in client if e[0] == "read" and e[3] > big)
    legs: dict[str, list[float]] = {
        k: [] for k in ("client_write", "transit_out", "member_handling", "member_write", "transit_back")
    }
    for _, w0, w1, _n in c_writes:
        i = bisect.bisect(m_read_end, w1)
        j = bisect.bisect(m_writes, (m_read_end[i], 0.0)) if i < len(m_read_end) else len(m_writes)
        if j >= len(m_writes):
            continue
        k = bisect.bisect(c_read_end, m_writes[j][1])
        if k >= len(c_read_end):
            continue
        legs["client_write"].append(w1 - w0)
        legs["transit_out"].append(m_read_end[i] - w1)
        legs["member_handling"].append(m_writes[j][0] - m_read_end[i])
        legs["member_write"].append(m_writes[j][1] - m_writes[j][0])
        legs["transit_back"].append(c_read_end[k] - m_writes[j][1])
    report = {
        "bench": "trace_roundtrip",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rt_4k_median_us": total,
        "legs_median_us": {k: median_us(v) for k, v in legs.items() if v},
        "matched": len(legs["client_write"]),
    }
    emit(report, a.out)


if __name__ == "__main__":
    main()

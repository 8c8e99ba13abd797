"""The internet between the machines (``--network internet``, ``internet-far``): the orchestrator
behind a home NAT, each instance's node in a container namespace behind its host's public
address, with the UDP port its create asked for forwarded from a random public one, and every
other inbound packet dropped (iptables in the namespaces). The nodes and the orchestrator run the
transport's internet mode (n0's preset, relays on), whose relays and discovery cannot be reached:
a run passes on the direct paths alone, every one dialled by the orchestrator.

Each run is its own ``pp-smoke-run`` or pytest process: the internet profiles move the process
behind the home NAT before iroh starts in it (``EmulatedNetwork.enter_home``). On the synthetic
model: these check paths, NAT and what is left; its reference is still token-exact."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_ppsmoke.network import netns, unavailable
from pytest_ppsmoke.stage.synth import SHAPES, write

from .helpers import CLI

NO_NETNS = unavailable()
pytestmark = [
    pytest.mark.local,
    pytest.mark.netns,
    pytest.mark.skipif(NO_NETNS is not None, reason=f"no network namespaces here: {NO_NETNS}"),
    pytest.mark.skipif(shutil.which("iptables-restore") is None, reason="no iptables here (apt-get install iptables)"),
]


def root_rules() -> str:
    """This machine's own iptables rules (the runs add theirs inside their namespaces only)."""
    out = subprocess.run(["iptables-save"], capture_output=True, text=True, timeout=30).stdout
    return "\n".join(line for line in out.splitlines() if not line.startswith("#"))


def run_cli(
    tmp_path: Path, *args: str, timeout: float = 240, faults: str = ""
) -> tuple[subprocess.CompletedProcess[str], Any]:
    report = tmp_path / "report.json"
    argv = [*CLI, "--local", "--report", str(report), "-v", *args]
    env = {**os.environ, "PP_FAILPOINTS": faults} if faults else None
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    return done, json.loads(report.read_text()) if report.exists() else None


def leftovers(report: dict[str, Any]) -> list[str]:
    """Namespaces and devices of the run's network still on this machine."""
    prefix = report["network"]["prefix"]
    return [n for n in [*netns.netns_names(), *netns.root_links()] if n.startswith(prefix)]


def assert_direct(report: dict[str, Any], stages: int) -> None:
    """Every stage reached directly at its host's public address, on the port vast.ai's record
    shows forwarded (never the port the node binds), and no connection came in to the orchestrator."""
    paths = report["paths"]
    assert paths["accepted"] == 0, paths
    assert paths["dialled"] >= stages, paths
    subnet = report["network"]["subnet"].rsplit(".", 1)[0] + "."
    for inst in report["instances"]:
        link = paths["links"][f"pp-stage-{inst['stage']}"]
        assert link["path"] == "direct" and link["dialled_by"] == "us", link
        assert link["remote_addr"] == inst["public_udp"], (link, inst)
        host, port = inst["public_udp"].rsplit(":", 1)
        assert host.startswith(subnet) and host != report["network"]["public_addr"], inst
        assert int(port) != 7000, inst  # remapped, as vast.ai does
        assert link["rtt_ms"] > 0
    # and each stage, as it said after the request: the orchestrator's address seen through its
    # home NAT, on the connection the orchestrator dialled; the next stage directly
    seen = paths["stages"]
    for stage in range(stages):
        home = seen[f"pp-stage-{stage}->orchestrator"]
        assert home["dialled_by"] == "peer" and home["remote_addr"].startswith(report["network"]["public_addr"] + ":")
    for stage in range(stages - 1):
        assert seen[f"pp-stage-{stage}->pp-stage-{stage + 1}"]["path"] == "direct", seen


def test_three_stages_over_internet_far_pass_on_direct_paths_and_time_swim_to_them(tmp_path: Path) -> None:
    rules = root_rules()
    model = tmp_path / "tiny.gguf"
    write(model, SHAPES["tiny"])  # 4 blocks: room for 3 stages
    done, report = run_cli(
        tmp_path, "--network", "internet-far", "--num-stages", "3", "--model", str(model), "--max-tokens", "6"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert report["ok"] and report["reference"]["match"] is True, report["reference"]
    assert report["network"]["spec"] == "internet-far" and report["network"]["home_addr"] == "192.168.1.2"
    assert_direct(report, 3)
    # SWIM timed to the worst path: far is 2 x 60 ms (+-5) a round trip, and the probe waits three
    swim = report["swim"]
    assert swim["worst_rtt_ms"] >= 110, swim
    assert swim["ping_timeout"] >= 3 * swim["worst_rtt_ms"] / 1000 * 0.95, swim
    assert swim["protocol_period"] >= 2 * swim["ping_timeout"] * 0.999, swim
    assert "SWIM probe timeout" in done.stdout
    # and no member was suspected on the way: no false suspicion over far's paths
    assert swim["stats"]["suspicions_raised"] == 0 and swim["stats"]["refuted_about_me"] == 0, swim["stats"]
    # every packet between the machines crossed the switch with far's delay; none was lost to NAT
    links = report["network_stats"]
    assert links["host->0"]["mean_delay_ms"] >= 55 and links["0->1"]["delivered"] > 0, links
    assert all(i["final_state"] == "destroyed" for i in report["instances"])
    assert leftovers(report) == [] and root_rules() == rules


def test_uneven_hosts_over_the_internet_pass_on_direct_paths(synth_model: str, tmp_path: Path) -> None:
    """vast.ai's hosts as they are: the second boots 8 s after the first (whose node waits for the
    orchestrator, which dials the nodes only once all run, longer than its 4 s orphan grace), the
    first misses its heartbeats (``unknown``) for 2 s as it starts, and every record shows its
    forwarded port 2 s after ``running``. The run passes, the orchestrator reaching each node
    directly at the port its record showed; with the orphan clock started at the node's start, the
    first would have destroyed itself; with ``unknown`` a dead state, the boot would have failed;
    without a second look for the ports, the paths would not be direct."""
    hosts = "vast.boot_delay=0.2,8;vast.heartbeat_gap=0:2;vast.late_ports=2"
    done, report = run_cli(
        tmp_path, "--network", "internet", "--model", synth_model, "--max-tokens", "4", "--orphan-grace", "4",
        "--reference", "off", faults=hosts,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert report["ok"] and report["text"].strip(), report.get("error")
    paths = report["paths"]
    assert paths["accepted"] == 0 and len(report["instances"]) == 2, paths
    for inst in report["instances"]:
        link = paths["links"][f"pp-stage-{inst['stage']}"]
        assert link["path"] == "direct" and link["dialled_by"] == "us", link
        assert inst["public_udp"] and link["remote_addr"] == inst["public_udp"], (link, inst)
        assert inst["final_state"] == "destroyed", inst
    assert leftovers(report) == []


def test_creates_that_ask_for_no_port_fail_at_converge_naming_the_mapping(synth_model: str, tmp_path: Path) -> None:
    done, report = run_cli(
        tmp_path, "--network", "internet", "--port", "0", "--converge-timeout", "4", "--model", synth_model
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert report["failed_phase"] == "converge", report["error"]
    error = report["error"]
    assert "no port was asked of vast.ai (--port 0)" in error and "-p 7000:7000/udp" in error, error
    assert "direct_port_count >= 1" in error
    assert all(i["public_udp"] is None and i["final_state"] == "destroyed" for i in report["instances"])
    assert leftovers(report) == []


def test_the_spec_suite_passes_over_the_internet(pytester: pytest.Pytester, synth_model: str) -> None:
    """The plugin: ``--ppsmoke-network internet``, every spec test but the coherent-text one (the
    synthetic model makes no words)."""
    report = pytester.path / "r.json"
    result = pytester.runpytest_subprocess(
        "--pyargs", "pytest_ppsmoke.spec", "-m", "local", "-p", "no:cacheprovider", "--ppsmoke-mode", "local",
        "--ppsmoke-network", "internet", "--ppsmoke-model", synth_model, "--ppsmoke-max-tokens", "6",
        "--ppsmoke-report", str(report), "-k", "not test_output_is_coherent_text", "-rA",
    )  # fmt: skip
    assert result.ret == 0, result.stdout.str()[-4000:]
    figures = json.loads(report.read_text())
    assert figures["network"]["spec"] == "internet"
    assert_direct(figures, 2)
    assert figures["emulator"]["live_instances"] == []


def test_an_orchestrator_that_already_runs_iroh_is_refused_the_home_nat() -> None:
    """Its runtime's threads stay in the namespace they were made in: its relays and discovery
    would reach the real internet from there. The refusal says why and what to do."""
    code = """
import asyncio, sys
from pytest_ppsmoke.network import EmulatedNetwork, NetworkError, parse_network
from pytest_ppsmoke.runtime.transport import Transport, new_secret_key

async def main():
    t = Transport(new_secret_key(), on_message=lambda *a: None)
    await t.start()
    async with EmulatedNetwork(parse_network("internet")) as net:
        try:
            net.enter_home()
        except NetworkError as e:
            print(e)
        else:
            print("entered")
    await t.close()

asyncio.run(main())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ)
    assert "already runs iroh" in done.stdout and "process of its own" in done.stdout, done.stdout + done.stderr

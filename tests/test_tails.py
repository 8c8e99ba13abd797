"""Each node's own account of a failed run, end to end (``pp-smoke-run`` against the emulator):
a node frozen mid-decode is named hung, and the tail vast.ai's logs served (the emulator's record
shows ``request_logs``, then the read of its result URL) says where it stopped, in its own
lifecycle's words at the default log level; the other's tail comes from the cluster. A node
frozen as its prefill begins says so, and the keys both nodes and a worker wrote in every
encoding, every way a process writes, can be decoded from nothing anyone reads. A node frozen
for a few seconds and continued is named stalled, in its own words. (A node killed is named
dead: ``test_lifecycle.py``'s drop-out test.)"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_ppsmoke.cloud.emulator import logs
from pytest_ppsmoke.cloud.emulator.logs import RESULT_PATH
from pytest_ppsmoke.cloud.emulator.server import FakeVast
from pytest_ppsmoke.cloud.rental import RentedInstance
from pytest_ppsmoke.cloud.vastrecords import offer_from_json
from pytest_ppsmoke.harness import accounts, driver
from pytest_ppsmoke.harness.settings import Settings
from pytest_ppsmoke.protocol import Phase, PhaseError
from pytest_ppsmoke.runtime.localproc import LINES_KEPT

from .helpers import run_cli
from .leakscan import recovered
from .smoke import KEY, Smoke, assert_nothing_left

pytestmark = pytest.mark.local


async def failed(
    emulator: Callable[[str], Any], tmp_path: Path, faults: str, tokens: int = 512
) -> tuple[FakeVast, Smoke, dict[str, Any]]:
    fake = await emulator(faults)
    args = ("--max-tokens", str(tokens), "--budget", "120", "--reference", "off")
    async with Smoke(fake, tmp_path, *args) as smoke:
        assert await smoke.finish() == 1, smoke.stderr[-3000:]
    return fake, smoke, smoke.report()


def every_secret(fake: FakeVast) -> list[str]:
    """Every key the run held: the API key, each instance's container key and node key, and the
    orchestrator's own cluster key (in a node's allowlist only as its id, which is public)."""
    found = [KEY]
    for inst in fake.destroyed:
        found += [inst.container_key, inst.env["PP_NODE_KEY"]]
    return found


def last_said(tail: list[str]) -> str:
    """The last lifecycle line of a node's tail (``stage/lifecycle.py``'s), without its prefix."""
    said = [ln.split(" INFO ", 1)[1] for ln in tail if "pytest_ppsmoke.node.lifecycle INFO " in ln]
    assert said, tail
    return said[-1]


async def test_a_node_frozen_mid_decode_is_hung_its_tail_from_vast_ais_logs_says_where_it_stopped(
    emulator: Callable[[str], Any], tmp_path: Path
) -> None:
    """No failpoint writes to any node's log, and the nodes log at their default level: each
    tail is the node's own lifecycle, and the frozen one's last line names decode and its count."""
    fake, smoke, report = await failed(emulator, tmp_path, "vast.freeze_stage=1:0;vast.kill_after_tokens=3")
    nodes = {i["stage"]: i for i in report["instances"]}
    frozen, other = nodes[1], nodes[0]
    assert frozen["node_state"] == "hung" and frozen["log_source"] == "vast.ai logs", frozen
    assert re.fullmatch(r"request \d+: decode, \d+ of 512 tokens", last_said(frozen["log_tail"])), frozen["log_tail"]
    assert 0 < len(frozen["log_tail"]) <= 50 and len("\n".join(frozen["log_tail"]).encode()) <= 8192
    assert other["node_state"] in ("answered", "stalled") and other["log_source"] == "cluster", other
    assert other["log_tail"] and "request" in last_said(other["log_tail"]), other["log_tail"]
    assert "pp-stage-1 is hung, or cut off: no answer over the cluster" in report["error"], report["error"]
    assert "pp-stage-1 is dead" not in report["error"]
    line = next(ln for ln in smoke.stderr.splitlines() if ln.startswith("pp-smoke-run: failed at "))
    # the report's path, or its name where the path is long (this one's, in the test's folder), and
    # the first account with a count of the rest, within 300 characters
    assert f"{smoke.report_path.name}'s instances[].log_tail" in line and len(line) <= 300, line
    assert "; pp-stage-1 is hung, or cut off" in line or "the accounts of 1 node(s)" in line, line
    # vast.ai's logs: asked for the frozen one alone, then its result URL read
    iid = frozen["id"]
    calls = [(m, p, s) for m, p, s in fake.requests if "request_logs" in p or p.startswith(RESULT_PATH)]
    assert calls[0][:2] == ("PUT", f"/api/v0/instances/request_logs/{iid}/"), calls
    reads = calls[1:]  # the upload takes a while (vast.log_upload): 404s, then the text
    assert reads and all(m == "GET" and p.startswith(RESULT_PATH) for m, p, _ in reads), calls
    assert [s for _, _, s in reads] == [404] * (len(reads) - 1) + [200], calls
    await assert_nothing_left(fake, smoke, 2)


async def test_a_node_frozen_in_prefill_says_so_and_its_keys_in_every_encoding_are_nowhere(
    emulator: Callable[[str], Any], tmp_path: Path
) -> None:
    """Both nodes, and the frozen one's worker, write their keys in every encoding a log line
    carries, every way a process writes (``node.log_secrets``); stage 1 is stopped as its prefill
    begins. What each node wrote, read raw as its instance's output (before the orchestrator),
    vast.ai's logs as served, the report, and pp-smoke-run's own output: no 8 bytes of any key
    can be decoded from any of them (``leakscan``, which decodes with the standard library)."""
    fake, smoke, report = await failed(
        emulator, tmp_path, "vast.freeze_stage=1:0;vast.kill_after_tokens=0;vast.hold_prefill=1:30;vast.log_secrets=0,1"
    )
    nodes = {i["stage"]: i for i in report["instances"]}
    frozen = nodes[1]
    assert frozen["node_state"] == "hung" and frozen["log_source"] == "vast.ai logs", frozen
    assert re.fullmatch(r"request \d+: prefill of \d+ positions begins", last_said(frozen["log_tail"])), frozen
    assert "prefill" in report["error"], report["error"]
    assert all(i["log_tail"] for i in report["instances"]), report["instances"]
    keys = every_secret(fake)
    raw = {f"instance {i.id}'s output": i.proc.stderr_tail(LINES_KEPT) for i in fake.destroyed if i.proc}
    assert all(sum("node.log_secrets:" in ln for ln in text.splitlines()) > 100 for text in raw.values()), raw
    for text in raw.values():  # the worker's relayed words, and every way the node wrote
        assert "worker: node.log_secrets:" in text and "Traceback" in text and "UserWarning" in text, text[-3000:]
    served = {f"vast.ai's log {t}": text for t, (_, text, _) in logs_served(fake).items()}
    assert served, "vast.ai's logs were never asked"
    places = {**raw, **served, "report": json.dumps(report), "stdout": smoke.stdout, "stderr": smoke.stderr}
    for where, text in places.items():
        assert not recovered(text, keys), f"a key in {where}: {recovered(text, keys)[:3]}"
    for token in logs_served(fake):  # a result URL opens its log to anyone: its token is a secret
        assert token not in json.dumps(report) + smoke.stdout + smoke.stderr
    for inst in fake.destroyed:  # no key on a command line; the user's key in no create
        assert inst.proc is not None and not recovered(" ".join(inst.proc.argv), keys), inst.proc.argv
        assert not recovered(json.dumps(inst.env), [KEY]), "the user's vast.ai key in a create's env"
        others = [i.env["PP_NODE_KEY"] for i in fake.destroyed if i is not inst] + [
            i.container_key for i in fake.destroyed if i is not inst
        ]
        assert not recovered(json.dumps(inst.env), others), "another node's key in this one's create"
    await assert_nothing_left(fake, smoke, 2)


def logs_served(fake: FakeVast) -> dict[str, tuple[int, str, float]]:
    """The logs the emulator's result URLs served, by token: (instance id, text, ready at)."""
    return dict(logs._results.get(fake, {}))


async def test_a_node_frozen_then_continued_is_named_stalled_in_its_own_words(
    emulator: Callable[[str], Any], tmp_path: Path
) -> None:
    """Frozen for 2 s after the second token, then continued: shorter than any suspicion lasts,
    so the node is back before the cluster could declare it dead, and the run goes on to fail on
    its last stage's empty text (or, on a starved machine, on a death declared after the node
    came back): either way the node answers for itself, with the stall it measured."""
    fake, smoke, report = await failed(
        emulator, tmp_path, "vast.freeze_stage=1:2;vast.kill_after_tokens=2;vast.empty_text=1;vast.slow_decode=0.1", 64
    )  # 62 steps of 0.1 s after the trigger: the freeze lands mid-decode, not after the run's end
    node = next(i for i in report["instances"] if i["stage"] == 1)
    said = {k: node[k] for k in ("node_state", "node_words", "log_source", "stalls")}
    assert node["node_state"] == "stalled" and node["log_source"] == "cluster", (said, report["error"])
    assert max(s["seconds"] for s in node["stalls"]) >= 1.5, node["stalls"]  # a lower bound only
    assert re.search(r"pp-stage-1 stalled for \d+\.\d s \(its loop was starved\)", report["error"]), report["error"]
    await assert_nothing_left(fake, smoke, 2)


class _Rental:
    """What accounts.gather needs of a Rental: its instances, vast.ai's state of each, its log."""

    def __init__(self, states: dict[int, str], log: str) -> None:
        offer = offer_from_json({"id": 1, "dph_total": 0.1})
        self.instances = [RentedInstance(s, offer, f"l{s}", id=100 + s) for s in states]
        for inst in self.instances[:-1]:  # each joined the cluster once, but the last
            inst.timeline["joined"] = 1.0
        self.states, self.log, self.asked = states, log, []

    @property
    def current(self) -> list[RentedInstance]:
        return self.instances  # none replaced

    async def state_now(self, inst: Any) -> tuple[str, str]:
        return self.states[inst.stage], "as shown"

    async def log_tail(self, inst: Any, lines: int) -> str:
        self.asked.append((inst.stage, lines))
        return self.log


async def test_an_account_from_vast_ai_is_redacted_here_capped_and_named_by_vast_ais_state() -> None:
    """vast.ai's text is redacted by the orchestrator itself (vast.ai does not redact), in every
    form; a running instance whose node gives no account is hung, a gone one dead."""
    node_key = secrets.token_bytes(32)
    log = "\n".join(
        [f"early {i}" for i in range(80)]
        + [f"key {KEY}", f"hex {node_key.hex().upper()}", f"b64 {base64.b64encode(b'xy' + node_key).decode()}"]
    )
    rental = _Rental({0: "running", 1: "exited", 2: "missing", 3: "loading", 4: "loading"}, log)
    found = await accounts.gather(None, rental, [KEY, node_key], 5.0)  # type: ignore[arg-type]
    # a joined node whose instance vast.ai shows loading again is unknown; one that never joined, booting
    assert {s: a.state for s, a in found.items()} == {0: "hung", 1: "dead", 2: "dead", 3: "unknown", 4: "booting"}
    never = "it never joined the cluster, and vast.ai shows its instance loading"
    assert found[4].words == f"pp-stage-4 is booting: {never}"
    assert accounts.failure_words({4: found[4]}) == ""  # the phase's failure says it; the report keeps it
    assert found[0].words.startswith("pp-stage-0 is hung, or cut off: the orchestrator had no cluster")
    assert found[1].words.startswith("pp-stage-1 is dead: vast.ai shows its instance exited")
    tail = found[0].lines
    assert len(tail) == 50 and tail[-3:] == ["key [redacted]", "hex [redacted]", tail[-1]] and "[redacted]" in tail[-1]
    assert not recovered("\n".join(tail), [KEY, node_key.hex()]) and found[0].source == "vast.ai logs"
    assert rental.asked == [(s, 50) for s in range(5)]
    assert accounts.capped(["x" * 10] * 5, 50, 25) == ["x" * 10] * 2  # the byte cap keeps the newest
    assert accounts.capped(["abcdef"], 50, 4) == ["def"]  # a newest line over the cap: its end, with its newline
    assert accounts.capped(["abc"], 50, 1) == []  # no room for a byte beside the newline
    assert "each node's log tail: the report's instances[].log_tail" in accounts.failure_words(found)


def test_a_starved_orchestrator_blames_itself_not_its_stages(synth_model: str, tmp_path: Path) -> None:
    """The orchestrator's process blocked for 2 s mid-decode (a starved runner): every probe it
    had out fires late. Its loop watch measured the stall and its SWIM took it as its own (local
    health, and late probes excused), so no stage was declared dead and the run passes; the
    report says the orchestrator's loop stalled (without the watch it does not). The block stays
    under a suspicion's 3 s, so that the nodes, whose probes of the orchestrator go unanswered
    meanwhile, refute nothing of their own."""
    report = tmp_path / "report.json"
    faults = "vast.starve_orchestrator=2;vast.kill_after_tokens=3;vast.slow_decode=0.05"
    argv = ["--local", "--model", synth_model, "--max-tokens", "48", "--reference", "off", "--report", str(report)]
    done = run_cli(*argv, env={**os.environ, "PP_FAILPOINTS": faults}, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    swim = json.loads(report.read_text())["swim"]
    stalls = swim["orchestrator_stalls"]
    assert stalls["count"] >= 1 and stalls["longest"] >= 1.9 - 0.05, stalls  # a lower bound: load only adds
    assert swim["deaths"] == [] and swim["stats"]["deaths_declared"] == 0, swim


async def test_a_node_that_never_joined_while_its_instance_runs_is_booting_not_hung() -> None:
    rental = _Rental({0: "running", 1: "running"}, "starting")  # stage 1 never joined
    found = await accounts.gather(None, rental, [KEY], 5.0)  # type: ignore[arg-type]
    assert (found[0].state, found[1].state) == ("hung", "booting")
    assert found[1].words == (
        "pp-stage-1 is booting: it never joined the cluster, while vast.ai shows its instance running"
    )


async def test_an_account_that_fails_is_said_as_such_and_the_others_stand() -> None:
    """An answer nobody foresaw (here vast.ai's state read raising ValueError, with the key in its
    text): that node is unknown, its account failed with the error redacted, not "not complete
    within"; the other node's account is unchanged."""

    class Odd(_Rental):
        async def state_now(self, inst: Any) -> tuple[str, str]:
            if inst.stage == 0:
                raise ValueError(f"an odd answer holding {KEY}")
            return await super().state_now(inst)

    found = await accounts.gather(None, Odd({0: "running", 1: "exited"}, "x"), [KEY], 5.0)  # type: ignore[arg-type]
    assert found[0].state == "unknown"
    assert found[0].words == "pp-stage-0 is unknown: its account failed (ValueError: an odd answer holding [redacted])"
    assert found[1].state == "dead"


async def test_cancelled_while_asking_no_ask_outlives_the_gathering() -> None:
    asked, ended = asyncio.Event(), []

    class Slow(_Rental):
        async def state_now(self, inst: Any) -> tuple[str, str]:
            asked.set()
            try:
                await asyncio.sleep(3600)
            finally:
                ended.append(inst.stage)
            raise AssertionError("unreachable")

    gathering = asyncio.ensure_future(accounts.gather(None, Slow({0: "running", 1: "running"}, ""), [], 60.0))  # type: ignore[arg-type]
    await asyncio.wait_for(asked.wait(), 30)
    gathering.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gathering
    assert sorted(ended) == [0, 1]  # each ask was cancelled and ended before the cancel was raised


async def test_an_interruption_while_the_accounts_are_asked_keeps_the_failure_as_the_first_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The step's failure is the report's cause before the nodes are asked: a Ctrl-C or timeout
    that lands while they are asked (up to 12 s) adds to it, never replaces it."""
    asking = asyncio.Event()

    async def gather(*args: Any) -> dict[int, accounts.Account]:
        asking.set()
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    monkeypatch.setattr(driver.accounts, "gather", gather)
    run = driver.SmokeRun(Settings.resolve({"mode": "local", "budget": 100}))
    run.deployment = SimpleNamespace(  # type: ignore[assignment]
        instances=[SimpleNamespace(id=7, stage=0)],
        seed=None,
        rental=None,
        keys=SimpleNamespace(keys=[]),
        phase="decode",
    )
    run.started = time.monotonic()
    cause = PhaseError(Phase.DECODE, "pp-stage-1 dropped out of the cluster mid-request")
    step = asyncio.ensure_future(run._accounted("decode", cause))
    await asyncio.wait_for(asking.wait(), 30)
    step.cancel()
    with pytest.raises(asyncio.CancelledError):
        await step
    run.report.fail(Phase.DECODE, "interrupted by SIGINT")  # what the interruption records after it
    assert run.failure is cause and run.failed_step == "decode"
    assert run.report.failed_phase == "decode" and run.report.error is not None
    assert "pp-stage-1 dropped out of the cluster mid-request" in run.report.error
    assert "interrupted" not in run.report.error

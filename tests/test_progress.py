"""What ``pp-smoke-run`` says while it runs (``harness/progress.py``): the live line drawn from a
fixed state and a fake clock, the start and end lines without a terminal, the answer at once, and
the cache line said once. The real run's lines: tests/test_cli.py."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pytest_ppsmoke.cloud.rental import RentedInstance
from pytest_ppsmoke.cloud.vastrecords import Offer
from pytest_ppsmoke.harness.progress import (
    CLEAR,
    REFRESH,
    Lines,
    Noted,
    Progress,
    Relay,
    cache_line,
    grown_caches,
    human,
    live_line,
    nodes_work,
    program_cache_path,
    size_of,
    stage_doing,
)
from pytest_ppsmoke.harness.session import LoopThread
from pytest_ppsmoke.messages import LoadFigures, NodeStatus, ProgramCounts, WeightLoad
from pytest_ppsmoke.protocol import LOAD_STEPS

pytestmark = pytest.mark.local

PHASES = ("preflight", "rent", "boot", "converge", "load", "resolve", "prefill", "decode", "teardown")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def instance(stage: int, state: str | None = None, **timeline: float) -> RentedInstance:
    offer = Offer(stage + 1, "RTX 4090", 1, 24564, 0.4, 0.99, "here", {})
    inst = RentedInstance(stage, offer, f"ppsmoke-test-{stage}", id=stage + 1, state=state)
    inst.timeline.update(timeline)
    return inst


def loading(stage: int, seconds: int) -> NodeStatus:
    return NodeStatus(stage, "loading", "", seconds)


def test_the_load_line_says_what_each_stage_does_and_for_how_long() -> None:
    insts = [
        instance(0, rented=0.2, running=1.0, reached=1.5, joined=2.0, loaded=6.1),
        instance(1, rented=0.4, running=1.2, reached=1.7, joined=2.2),
    ]
    # stage 1 said "loading for 11 s" at 13.0 s into the run; it is now 14.0 s
    line = live_line("load", 12.34, 2, insts, {1: (loading(1, 11), 13.0)}, at=14.0)
    assert line == "load 12.3 s: 1 of 2 workers ready; stage 0 ready 4.1 s, stage 1 loading 12 s"
    ready = NodeStatus(0, "ready", "", 0, 576, 0, 15)  # stage 0's worker holds blocks [0, 15)
    line = live_line("load", 12.34, 2, insts, {0: (ready, 6.1), 1: (loading(1, 11), 13.0)}, at=14.0)
    assert line == (
        "load 12.3 s: 1 of 2 workers ready, 15 of 15 blocks loaded; stage 0 ready 4.1 s, stage 1 loading 12 s"
    )
    # stage 1's worker said it is warming up, with 6 of its 15 blocks realized and 9 programs
    going = NodeStatus(1, "loading", "", 11, step=len(LOAD_STEPS), blocks_loaded=6, blocks=15, programs=9)
    ready = dataclasses.replace(ready, programs=20)
    line = live_line("load", 12.34, 2, insts, {0: (ready, 6.1), 1: (going, 13.0)}, at=14.0)
    assert line == (
        "load 12.3 s: 1 of 2 workers ready, 21 of 30 blocks loaded, 29 programs; "
        "stage 0 ready 4.1 s, stage 1 loading 12 s (warming up)"
    )


def test_each_waiting_phase_names_its_step_or_the_wait() -> None:
    at = 5.0
    rented = instance(0, rented=1.5)
    assert stage_doing("rent", 0, rented, None, at) == "stage 0 rented 1.5 s"
    assert stage_doing("rent", 1, None, None, at) == "stage 1 renting"
    assert stage_doing("boot", 0, instance(0, "loading", rented=1.0), None, at) == "stage 0 booting (loading) 4.0 s"
    assert stage_doing("boot", 0, instance(0, rented=1.0), None, at) == "stage 0 booting 4.0 s"
    assert stage_doing("boot", 0, instance(0, rented=1.0, running=3.5), None, at) == "stage 0 running 2.5 s"
    assert stage_doing("converge", 0, instance(0, rented=1.0, running=2.0), None, at) == "stage 0 starting 3.0 s"
    joining = instance(0, rented=1.0, running=2.0, reached=4.0)
    assert stage_doing("converge", 0, joining, None, at) == "stage 0 joining 1.0 s"
    joined = instance(0, rented=1.0, running=2.0, reached=4.0, joined=4.5)
    assert stage_doing("converge", 0, joined, None, at) == "stage 0 joined 2.5 s"
    assert stage_doing("load", 0, joined, None, at) == "stage 0 loading 0.5 s"  # no status yet: since it joined


def test_a_stages_load_count_never_runs_back_as_its_statuses_come() -> None:
    inst = instance(0, rented=0.1, running=0.2, reached=0.3, joined=0.4)
    # the node counts whole seconds: 1.9 s in, it says 1; a second later 2.9 s, it says 2
    seen = [stage_doing("load", 0, inst, (loading(0, 1), 10.0), 10.0 + d) for d in (0.0, 0.5, 0.99)]
    seen += [stage_doing("load", 0, inst, (loading(0, 2), 11.0), 11.0 + d) for d in (0.0, 0.5, 0.99, 1.2)]
    counts = [int(line.split()[-2]) for line in seen]
    assert counts == sorted(counts) and counts[0] == 1 and counts[-1] == 3


def test_other_phases_show_their_clock_and_a_narrow_terminal_cuts_the_line() -> None:
    assert live_line("decode", 3.21, 2, [instance(0), instance(1)]) == "decode 3.2 s"
    gone, failed = instance(0, "destroyed"), instance(1, "running")
    failed.destroy_error = "HTTP 500"
    assert live_line("teardown", 0.5, 3, [gone, failed, instance(2, "running")]) == (
        "teardown 0.5 s: 1 of 3 destroyed; stage 0 destroyed, stage 1 not destroyed, stage 2 destroying"
    )
    insts = [instance(s, rented=0.1 * s) for s in range(8)]
    full = live_line("rent", 1.0, 8, insts, at=2.0)
    cut = live_line("rent", 1.0, 8, insts, at=2.0, width=40)
    assert len(full) > 40 and len(cut) == 39 and cut.endswith("…") and full.startswith(cut[:-1])


def test_without_a_terminal_a_phase_starts_and_ends_with_lines_no_end_matcher_takes_for_the_other() -> None:
    out, err, clock = io.StringIO(), io.StringIO(), Clock()
    p = Progress(out, err, live=False, clock=clock)
    for phase in PHASES:
        p.start(phase)
        p.start(phase)  # set again: said once
        clock.now += 1.25
        p(phase, 1.25, "detail")
    starts, ends = err.getvalue().splitlines(), out.getvalue().splitlines()
    assert starts[:2] == ["[   0.00s] start preflight", "[   1.25s] start rent"]
    assert ends[0] == "[   1.25s] preflight    1.250s  detail"
    assert len(starts) == len(ends) == len(PHASES) and CLEAR not in err.getvalue()
    for phase in PHASES:  # tests/smoke.py's wait_line and test_cli's checks look for "] {phase} "
        assert sum(f"] {phase} " in line for line in starts + ends) == 1


def test_the_answer_is_printed_at_once_and_the_live_line_is_cleared_first() -> None:
    out, err, clock = io.StringIO(), io.StringIO(), Clock()
    p = Progress(out, err, live=True, clock=clock)
    p.start("decode")
    clock.now += 2
    p.draw()
    assert err.getvalue() == CLEAR + "decode 0.0 s" + CLEAR + "decode 2.0 s"
    p.answer("Hello!")
    assert out.getvalue() == "Hello!\n" and p.answered and err.getvalue().endswith("decode 2.0 s" + CLEAR)
    p("decode", 2.0)
    assert err.getvalue().endswith("decode 2.0 s" + CLEAR)  # nothing drawn since: nothing more to clear


def test_a_live_line_that_cannot_be_read_is_drawn_as_its_clock_and_fails_nothing() -> None:
    """The live line is a view of the run: a fault in reading it (a record half made, a closed
    seed) draws the phase's clock instead, and never reaches the run it shows."""
    out, err, clock = io.StringIO(), io.StringIO(), Clock()
    p = Progress(out, err, live=True, clock=clock)
    broken: Any = SimpleNamespace(deployment=SimpleNamespace(began=0.0), settings=None, noted={})
    p.watch(broken)  # its deployment lacks what the line reads: line() raises
    with pytest.raises(AttributeError):
        p.line()
    p.start("decode")
    clock.now += 2
    p.draw()
    assert err.getvalue() == CLEAR + "decode 0.0 s" + CLEAR + "decode 2.0 s"


def test_the_live_line_reads_the_runs_instances_and_statuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # the line whole: no terminal here
    out, err, clock = io.StringIO(), io.StringIO(), Clock()
    p = Progress(out, err, live=True, clock=clock)
    dep = SimpleNamespace(
        began=90.0,  # the rent began 10 s ago
        instances=[
            instance(0, rented=0.5, running=1.0, reached=1.5, joined=2.0, loaded=6.1),
            instance(1, rented=0.7, running=1.1, reached=1.6, joined=2.1),
        ],
        statuses={1: (loading(1, 3), 97.0)},
        seed=None,
    )
    settings = SimpleNamespace(num_stages=2, local=True, max_tokens=64)
    run: Any = SimpleNamespace(deployment=dep, settings=settings, noted={})
    p.watch(run)
    p.start("load")
    clock.now += 1.5
    assert p.line() == "load 1.5 s: 1 of 2 workers ready; stage 0 ready 4.1 s, stage 1 loading 7 s"
    # the phases that run in the nodes: what their notes say (SmokeRun.noted)
    p.start("prefill")
    assert p.line() == "prefill 0.0 s: 0 of 2 stages"
    run.noted["blocks"] = (15, 30)
    assert p.line() == "prefill 0.0 s: 15 of 30 blocks"
    p.start("decode")
    run.noted["tokens"] = (12, 64)
    assert p.line() == "decode 0.0 s: 12 of 64 tokens"
    p.start("reference")
    assert p.line() == "reference 0.0 s: 0 of 64 tokens"
    run.noted["reference loading"] = (0, 64)
    assert p.line() == "reference 0.0 s: 0 of 1 model loaded, 0 of 64 tokens"
    run.noted["reference tokens"] = (3, 64)
    assert p.line() == "reference 0.0 s: 1 of 1 model loaded, 3 of 64 tokens"


def test_the_nodes_phases_count_from_their_notes() -> None:
    """The pre-flight counts its checks; resolve, prefill, decode and the reference count what
    the nodes noted (``Noted``): the names, the blocks the prompt has passed (of the model's,
    once the load said them), the tokens."""
    assert nodes_work("resolve", 2, Noted(names=3)) == "3 of 4 names resolved"
    assert nodes_work("preflight", 2, Noted(checks=(3, 5))) == "3 of 5 checks passed"
    assert nodes_work("prefill", 2, Noted(blocks=30)) == "0 of 30 blocks"
    assert nodes_work("prefill", 3, Noted(notes={"stages": (2, 3)})) == "2 of 3 stages"
    assert nodes_work("decode", 2, Noted(8, notes={"tokens": (1, 8)})) == "1 of 8 tokens"
    assert nodes_work("decode", 2, Noted(8)) == "0 of 8 tokens"
    assert nodes_work("load", 2, Noted(8)) == ""  # the orchestrator's own count: work_done's
    # a cold stage compiles as the prompt passes: each stage's programs counted apart, summed
    made = {"blocks": (15, 30), "programs 0": (20, 0), "programs 1": (7, 0)}
    assert nodes_work("prefill", 2, Noted(blocks=30, notes=made)) == "15 of 30 blocks, 27 programs"
    made = {"reference loading": (0, 8), "reference blocks": (4, 30), "reference programs": (12, 0)}
    said = "0 of 1 model loaded, 4 of 30 blocks, 0 of 8 tokens, 12 programs"
    assert nodes_work("reference", 2, Noted(8, notes=made)) == said


def status(stage: int, weights: WeightLoad | None, misses: int) -> NodeStatus:
    load = LoadFigures(weights, ProgramCounts(3, misses))
    return NodeStatus(stage, "ready", "", 0, load=load)


def test_the_caches_a_cold_load_wrote_are_said_once_with_their_size_and_how_to_clear_them(tmp_path: Path) -> None:
    weights, db = tmp_path / "weights", tmp_path / "tinygrad" / "cache.db"
    weights.mkdir()
    (weights / "a.weights").write_bytes(b"x" * 3000)
    db.parent.mkdir()
    db.write_bytes(b"y" * 100)
    cold = [status(0, WeightLoad("gguf", 1.0, 3000, str(weights / "a.weights")), 4), status(1, None, 0)]
    warm = [status(0, WeightLoad("cache", 0.1, 3000, str(weights / "a.weights")), 0)]
    assert grown_caches(cold, db) == [weights, db]
    assert grown_caches(warm, db) == []
    assert grown_caches([status(0, WeightLoad("gguf", 1.0, 3000, ""), 0)], db) == []  # the cache off
    assert size_of(weights) == 3000 and human(3000) == "2.9 kB" and human(3 << 30) == "3.0 GB"
    line = cache_line([(weights, 3000), (db, 100)])
    assert line == f"cache: {weights} grew to 2.9 kB, {db} to 100 B (rm -rf {weights} {db} to clear)"
    assert cache_line([(Path.home() / ".cache" / "ppsmoke", 5 << 20)]) == (
        "cache: ~/.cache/ppsmoke grew to 5.0 MB (rm -rf ~/.cache/ppsmoke to clear)"
    )

    out, err = io.StringIO(), io.StringIO()
    p = Progress(out, err, live=False, clock=Clock())
    dep = SimpleNamespace(began=0.0, instances=[], statuses={}, ready=dict(enumerate(cold)))
    run: Any = SimpleNamespace(deployment=dep, settings=SimpleNamespace(num_stages=2, local=True, runtime="processes"))
    p.watch(run)
    p("load", 1.0)
    p("load", 1.0)
    assert err.getvalue().count("cache: ") == 1 and f"rm -rf {weights}" in err.getvalue()
    for elsewhere in (SimpleNamespace(local=False), SimpleNamespace(local=True, runtime="image")):
        err = io.StringIO()
        quiet = Progress(io.StringIO(), err, live=False)
        quiet.watch(SimpleNamespace(deployment=dep, settings=elsewhere))  # type: ignore[arg-type]
        quiet("load", 1.0)
        assert err.getvalue() == ""  # vast.ai's instances and containers keep their caches on their own disks


def test_the_program_cache_is_where_tinygrad_looks() -> None:
    assert program_cache_path({"CACHEDB": "/x/db"}) == Path("/x/db")
    assert program_cache_path({"XDG_CACHE_HOME": "/c"}) == Path("/c/tinygrad/cache.db")
    from tinygrad.helpers import CACHEDB

    assert program_cache_path() == Path(CACHEDB)


def test_the_live_line_is_drawn_while_the_run_runs_and_taken_away_at_its_end() -> None:
    assert REFRESH <= 1.0  # at least once a second

    async def run(live: bool) -> str:
        err = io.StringIO()
        p = Progress(io.StringIO(), err, live=live, clock=Clock())
        p.start("boot")
        async with p.live():
            for _ in range(3):
                await asyncio.sleep(0)  # the redrawing task's first turn
        return err.getvalue()

    drawn = asyncio.run(run(True))
    assert drawn.count(CLEAR + "boot 0.0 s") >= 2 and drawn.endswith("boot 0.0 s" + CLEAR)
    assert asyncio.run(run(False)) == "[   0.00s] start boot\n"

    async def ended() -> str:  # the phase's line is out: nothing more to show until the next one
        err = io.StringIO()
        p = Progress(io.StringIO(), err, live=True, clock=Clock())
        p.start("teardown")
        p("teardown", 0.1)
        p.start("teardown")  # set again after its line (the deployment's next phase after it)
        async with p.live():
            for _ in range(3):
                await asyncio.sleep(0)
        return err.getvalue()

    assert asyncio.run(ended()) == CLEAR + "teardown 0.0 s" + CLEAR


def test_every_waiting_phase_counts_its_work_as_it_advances() -> None:
    """Not only a clock: each line of rent, boot, converge and load counts the instances that
    reached the step the phase waits for, and the teardown those destroyed; the count rises as
    they get there (a fixed clock: only the work moves)."""
    steps = {"rent": "rented", "boot": "running", "converge": "joined", "load": "loaded"}
    for phase, step in steps.items():
        insts = [instance(0), instance(1), instance(2)]
        seen = []
        for inst in [None, *insts]:
            if inst is not None:
                inst.timeline[step] = 1.0
            seen.append(live_line(phase, 1.0, 3, insts, at=2.0).split(";")[0])
        assert [int(line.split(": ")[1].split()[0]) for line in seen] == [0, 1, 2, 3], (phase, seen)
    gone = [instance(0, "running"), instance(1, "running")]
    seen = [live_line("teardown", 1.0, 2, gone)]
    for inst in gone:
        inst.state = "destroyed"
        seen.append(live_line("teardown", 1.0, 2, gone))
    assert [line.split(";")[0] for line in seen] == [f"teardown 1.0 s: {n} of 2 destroyed" for n in (0, 1, 2)]


def test_the_plugins_relay_draws_on_the_waiting_thread_and_gives_pytests_line_back() -> None:
    """The plugin's session runs its loop in a thread: the driver's calls come from there, are
    queued, and are replayed (and the line drawn) only by the thread that waits; when the step is
    over the line pytest had written is written back."""
    err, clock = io.StringIO(), Clock()
    relay = Relay(Progress(io.StringIO(), err, live=True, clock=clock), lambda: "test_spec.py ..")
    thread = threading.Thread(target=lambda: (relay.on_phase("prefill", 1.5, ""), relay.on_start("decode")))
    thread.start()
    thread.join()
    assert err.getvalue() == ""  # nothing written from the loop's thread
    relay.tick()
    clock.now += 1
    relay.tick()
    assert err.getvalue() == CLEAR + "decode 0.0 s" + CLEAR + "decode 0.0 s" + CLEAR + "decode 1.0 s"
    relay.done()
    assert err.getvalue().endswith("decode 1.0 s" + CLEAR + "test_spec.py ..")

    said: list[str] = []
    plain = Relay(Progress(Lines(said.append), Lines(said.append), live=False, clock=Clock()))
    plain.on_start("boot")
    plain.on_phase("boot", 2.0, "2 running")
    plain.tick()
    plain.done()
    assert said == ["[   0.00s] start boot", "[   0.00s] boot         2.000s  2 running"]  # whole lines, in a pipe


def test_a_wait_on_the_sessions_loop_calls_back_until_it_is_done() -> None:
    """``LoopThread.run``'s ``on_wait``: called while the coroutine runs, on the waiting thread.
    The coroutine ends once it has been called twice: no clock is read."""
    loop = LoopThread()
    called = threading.Event()
    calls: list[str] = []

    def on_wait() -> None:
        calls.append(threading.current_thread().name)
        if len(calls) >= 2:
            called.set()

    async def until_called() -> str:
        while not called.is_set():
            await asyncio.sleep(0.01)
        return "done"

    try:
        assert loop.run(until_called(), 60, on_wait) == "done"
    finally:
        loop.close()
    assert len(calls) >= 2 and set(calls) == {threading.current_thread().name}

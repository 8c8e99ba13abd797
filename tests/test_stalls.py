"""The loop watch (``runtime/stalls.py``) on a fake clock that jumps: a wake-up later than the
threshold is a stall, logged with its length and kept; one within it is nothing; the kept ones
are bounded, the longest kept. No real time is measured here (the real one: test_logtail)."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest

from pytest_ppsmoke.runtime.logbudget import LogBudget
from pytest_ppsmoke.runtime.stalls import LOG_BURST, LOG_EVERY, THRESHOLD, TICK, LoopStall, LoopWatch
from pytest_ppsmoke.runtime.swimconfig import SwimConfig

pytestmark = pytest.mark.local


class Done(Exception):
    """The fake sleep's script is over: the watch's loop ends with it."""


class Script:
    """A clock and a sleep for the watch: each sleep advances the clock by what was asked plus
    the next lateness of ``late`` (how long the loop was starved past the wake-up)."""

    def __init__(self, late: list[float], start: float = 100.0) -> None:
        self.now, self.late = start, list(late)

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        if not self.late:
            raise Done
        self.now += seconds + self.late.pop(0)


def watch_over(late: list[float], **kw: float) -> LoopWatch:
    script = Script(late)
    return LoopWatch(clock=script.clock, sleep=script.sleep, **kw)  # type: ignore[arg-type]


async def run_out(watch: LoopWatch) -> None:
    with pytest.raises(Done):
        await watch.run()


async def test_a_late_wake_up_is_a_stall_logged_with_its_length(caplog: pytest.LogCaptureFixture) -> None:
    watch = watch_over([0.0, 0.5, 0.01, 4.2], tick=0.05, threshold=0.12)
    with caplog.at_level(logging.WARNING, "pytest_ppsmoke.runtime.stalls"):
        await run_out(watch)
    # due at 0.05 s, on time; due at 0.1 s, 0.5 s late; due at 0.65 s, 0.01 s late; due at 0.71 s, 4.2 s late
    assert watch.stalls() == [LoopStall(0.1, 0.5), LoopStall(0.71, 4.2)]
    assert (watch.count, watch.longest) == (2, 4.2)
    assert watch.uptime() == pytest.approx(0.05 * 4 + 0.5 + 0.01 + 4.2)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert said[1].startswith("the event loop stalled for 4.2 s, 0.7 s after the start (starved:"), said


async def test_lateness_up_to_the_threshold_is_no_stall(caplog: pytest.LogCaptureFixture) -> None:
    watch = watch_over([0.11, 0.12, 0.0, 0.119] * 20, tick=0.05, threshold=0.12)
    with caplog.at_level(logging.DEBUG, "pytest_ppsmoke.runtime.stalls"):
        await run_out(watch)
    assert watch.stalls() == [] and watch.count == 0 and not caplog.records


async def test_a_stall_under_way_is_told_before_the_watch_wakes() -> None:
    """Whoever runs first after a stall (a query that waited with the watch) sees it already,
    as long as it has lasted so far, not yet logged or kept; under the threshold, nothing."""
    now, gate = [10.0], asyncio.Event()

    async def sleep(seconds: float) -> None:
        now[0] += seconds + 3.0  # the loop is starved while the watch sleeps
        await gate.wait()
        raise Done

    watch = LoopWatch(tick=0.05, threshold=0.12, clock=lambda: now[0], sleep=sleep)
    task = asyncio.ensure_future(watch.run())
    await asyncio.sleep(0)
    assert watch.stalls() == [LoopStall(0.05, 3.0)] and watch.count == 0
    assert watch.summary() == {"count": 1, "longest": 3.0, "stalls": [{"at": 0.05, "seconds": 3.0}]}  # told whole
    now[0] -= 2.95  # overdue by 0.05 s only
    assert watch.stalls() == []
    gate.set()
    with pytest.raises(Done):
        await task
    now[0] += 10.0
    assert watch.stalls() == []  # asleep no more: nothing is overdue


async def test_the_kept_stalls_are_bounded_the_longest_kept_oldest_first() -> None:
    lengths = [float(n) for n in range(1, 101)]
    random.Random(7).shuffle(lengths)
    watch = watch_over(lengths, tick=0.05, threshold=0.12, keep=5)
    await run_out(watch)
    kept = watch.stalls()
    assert sorted(s.seconds for s in kept) == [96.0, 97.0, 98.0, 99.0, 100.0]
    assert [s.at for s in kept] == sorted(s.at for s in kept)
    assert (watch.count, watch.longest) == (100, 100.0)


async def test_a_loop_that_keeps_stalling_logs_its_first_stalls_then_says_how_many_it_held_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Ten stall lines at once, then one a minute: the five stalls after the tenth, within 16 s,
    are held back (each still counted and kept); the next one, a minute later, is logged and says
    how many were held back before it, and the longest of them."""
    assert (LOG_BURST, LOG_EVERY) == (10, 60.0)
    held = [1.0, 2.0, 3.0, 1.5, 1.2]
    watch = watch_over([1.0] * 10 + held + [60.0], tick=0.05, threshold=0.12)
    with caplog.at_level(logging.WARNING, "pytest_ppsmoke.runtime.stalls"):
        await run_out(watch)
    assert (watch.count, watch.longest) == (16, 60.0) and len(watch.stalls()) == 16
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 11, said
    assert all("not logged" not in line for line in said[:10]), said
    assert said[10].startswith("the event loop stalled for 60 s,"), said
    assert said[10].endswith("; 5 more stalls not logged before it, the longest 3 s"), said


def test_the_log_budget_lets_a_burst_through_then_one_line_per_interval() -> None:
    now = [0.0]
    budget = LogBudget(3, 10.0, lambda: now[0])
    assert [budget.take() for _ in range(5)] == [0, 0, 0, None, None]
    now[0] = 9.9  # not a whole line refilled yet
    assert budget.take() is None
    now[0] = 10.0  # the refill counts on from the last take
    assert budget.take() == 3 and budget.take() is None
    now[0] = 1000.0  # refilled to the burst, not beyond it
    assert [budget.take() for _ in range(4)] == [1, 0, 0, None]
    assert budget.held_total == 5
    with pytest.raises(ValueError, match="a log budget lets at least one line through; burst=0"):
        LogBudget(0, 1.0)
    with pytest.raises(ValueError, match="refill interval must be a positive number of seconds, got inf"):
        LogBudget(1, float("inf"))


async def test_listeners_hear_each_stall_and_a_failing_one_stops_nothing(caplog: pytest.LogCaptureFixture) -> None:
    watch = watch_over([1.0, 0.0, 2.0])
    heard: list[float] = []

    def broken(stall: LoopStall) -> None:
        raise RuntimeError("a listener's bug")

    watch.on_stall += [broken, lambda s: heard.append(s.seconds)]
    await run_out(watch)
    assert heard == [1.0, 2.0] and watch.count == 2
    assert any("a listener of the loop watch failed" in r.getMessage() for r in caplog.records)


def test_the_defaults_are_a_short_tick_and_the_loopback_ping_timeout() -> None:
    """A stall a probe can meet is one longer than a ping timeout; the tick is well under it, so
    that a stall is under-measured by far less than the threshold."""
    assert SwimConfig.loopback().ping_timeout == THRESHOLD and TICK < THRESHOLD / 2


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"tick": 0.0}, "the loop watch's tick must be a positive number of seconds, got 0.0"),
        ({"threshold": -1.0}, "the loop watch's threshold must be a positive number of seconds, got -1.0"),
        ({"threshold": float("nan")}, "the loop watch's threshold must be a positive number of seconds, got nan"),
        ({"keep": 0}, "the loop watch keeps at least one stall; keep=0"),
    ],
)
def test_bad_settings_name_the_value(kw: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LoopWatch(**kw)  # type: ignore[arg-type]


async def test_start_and_close_run_the_watch_in_a_task_and_end_it() -> None:
    watch = LoopWatch()
    watch.start()
    task = watch._task
    assert task is not None and not task.done()
    await watch.close()
    assert task.cancelled() and watch._task is None
    await watch.close()  # twice: nothing left to do

"""What ``pp-smoke-run`` says while it runs: a line per phase, the answer, the cache.

    progress = Progress()                                    # stdout for the record, stderr for the rest
    run = SmokeRun(settings, on_phase=progress, on_start=progress.start, on_answer=progress.answer)
    progress.watch(run)
    async with progress.live(): ...                          # on a terminal: the live line, redrawn

Every phase ends with its line on stdout, ``[elapsed] phase seconds detail``, timed from the
start of the command (what tests and logs read). While a phase runs, stderr says what it is doing:

- on a terminal, one line redrawn in place (``\\r`` and clear to the end of the line) every
  :data:`REFRESH` seconds: the phase, its clock, and what each stage's instance is doing and for
  how long (``load 12.3 s: stage 0 ready 4.1 s, stage 1 loading 12 s``); it is cleared before
  anything else is printed;
- elsewhere (a log, CI), a line as each phase starts, ``[elapsed] start phase``, which no phase
  line's ``] phase `` can be mistaken for.

The answer is printed on stdout as soon as it has come back, before the reference and the
teardown. The first time a load writes to the caches on this machine (a stage's weights realized
from the GGUF, programs generated), one line on stderr says where they are, how large they have
grown and how to clear them.

A small piece of its own rather than a terminal library: one line on stderr is all it draws, the
phase lines must stay plain on stdout (a live display that takes both streams over would change
them), and the main install stays free of another dependency.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import queue
import shutil
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from ..protocol import LOAD_STEPS, Phase, stage_names

if TYPE_CHECKING:
    from ..cloud.rental import RentedInstance
    from ..messages import NodeStatus
    from ..runtime.node import Node
    from .driver import SmokeRun

log = logging.getLogger(__name__)

REFRESH = 0.25  # seconds between two drawings of the live line
CLEAR = "\r\x1b[K"  # back to the start of the line, and clear it
# the words for the phases that wait on every instance (the step each waits for:
# ``Phase.waits_for``), as a stage's goes through one: the word for that step once reached, the
# step its time in the phase counts from ("": the rent's start), and the word for the wait
WAITS = {
    Phase.RENT: ("rented", "", "renting"),
    Phase.BOOT: ("running", "rented", "booting"),
    Phase.CONVERGE: ("joined", "running", "starting"),
    Phase.LOAD: ("ready", "joined", "loading"),
}


def stage_doing(
    phase: str, stage: int, inst: RentedInstance | None, status: tuple[NodeStatus, float] | None, at: float
) -> str:
    """What one stage's instance is doing in ``phase`` (one of :data:`WAITS`), and for how long:
    ``stage 1 booting 3.2 s``, ``stage 1 loading 12 s`` (what its node said, in whole seconds),
    or, once it has reached the step the phase waits for, how long that took (``stage 0 ready
    4.1 s``). ``at``: the seconds since the rent began (the instances' timelines count from it);
    ``status``: the stage's last ``NodeStatus`` during the load, and when it came (the same
    seconds)."""
    step, (done, since, waiting) = Phase[phase.upper()].waits_for, WAITS[Phase[phase.upper()]]
    if inst is None:
        return f"stage {stage} {waiting}"
    timeline = inst.timeline
    start = timeline.get(since, 0.0) if since else 0.0
    if step in timeline:
        return f"stage {stage} {done} {max(0.0, timeline[step] - start):.1f} s"
    word, seconds = waiting, at - start
    if phase == "boot" and inst.state:
        word = f"{waiting} ({inst.state})"  # vast.ai's word for it
    elif phase == "converge" and "reached" in timeline:
        word, seconds = "joining", at - timeline["reached"]
    elif phase == "load" and status is not None:
        # the node's whole seconds in its state, and the time since it said so: counted in whole
        # seconds too, the sum never runs back when the next status comes
        st, came = status
        doing = f" ({LOAD_STEPS[st.step - 1]})" if st.state == "loading" and 0 < st.step <= len(LOAD_STEPS) else ""
        return f"stage {stage} {st.state} {int(st.seconds + max(0.0, at - came))} s{doing}"
    return f"stage {stage} {word} {max(0.0, seconds):.1f} s"


def teardown_word(inst: RentedInstance) -> str:
    if inst.state == "destroyed":
        return "destroyed"
    return "not destroyed" if inst.destroy_error else "destroying"


@dataclass
class Noted:
    """What the orchestrator knows of the work that runs in the nodes: the names it has resolved
    (of ``num_stages + 2``), the blocks of the model (0: not known), the request's ``max_tokens``,
    and the stages' progress notes (``SmokeRun.noted``: each kind's done and total)."""

    max_tokens: int = 0
    blocks: int = 0
    names: int = 0
    notes: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    checks: tuple[int, int] | None = None  # the pre-flight's checks passed, of how many


def nodes_work(phase: str, num_stages: int, noted: Noted) -> str:
    """The count of a phase that runs in the nodes, from their notes (and the pre-flight's checks
    passed, which run before any node): the names resolved; the
    blocks (or stages) the prompt has passed in the prefill (``3 of 30 blocks``); the tokens
    sampled in the decode (``12 of 64 tokens``: the first with the prefill's end) and in the
    reference, whose model first loads (``0 of 1 model loaded, 0 of 64 tokens``; a model loaded
    beside the stages is loaded at once); in the prefill and the reference also the programs
    the stages' workers read or generated (``, 12 programs``: a cold worker compiles). "": none."""
    notes = noted.notes
    if phase == "preflight":
        return f"{noted.checks[0]} of {noted.checks[1]} checks passed" if noted.checks else ""
    if phase == "resolve":
        return f"{noted.names} of {num_stages + 2} names resolved"
    if phase == "prefill":
        made = sum(done for what, (done, _) in notes.items() if what.startswith("programs "))
        programs = f", {made} programs" if made else ""  # a cold stage compiles as the prompt passes
        if "blocks" in notes or ("stages" not in notes and noted.blocks):
            done, total = notes.get("blocks", (0, noted.blocks))
            return f"{done} of {total} blocks{programs}"
        done, total = notes.get("stages", (0, num_stages))
        return f"{done} of {total} stages{programs}"
    if phase == "decode":
        done, total = notes.get("tokens", (0, noted.max_tokens))
        return f"{done} of {total} tokens"
    if phase == "reference":
        made = notes.get("reference programs", (0, 0))[0]
        programs = f", {made} programs" if made else ""  # its load and generate compile
        if "reference tokens" in notes:
            done, total = notes["reference tokens"]
            return f"1 of 1 model loaded, {done} of {total} tokens{programs}"
        if "reference loading" in notes:
            done, total = notes.get("reference blocks", (0, 0))
            blocks = f", {done} of {total} blocks" if total else ""  # its load, as it goes
            return f"0 of 1 model loaded{blocks}, 0 of {noted.max_tokens} tokens{programs}"
        return f"0 of {noted.max_tokens} tokens{programs}"
    return ""


def preflight_checks(rental: object) -> tuple[int, int]:
    """The pre-flight's checks passed, of how many (none yet before it has begun)."""
    from ..cloud.preflight import Preflight  # the driver has loaded it: a run is watched

    found = getattr(rental, "preflight", None)
    return (found.checks if isinstance(found, Preflight) else 0), Preflight.of


def resolved(seed: Node | None, num_stages: int) -> int:
    """The stages' names (of ``num_stages + 2``) the orchestrator's registry holds (none once
    the seed has closed)."""
    names = [n for i in range(num_stages) for n in stage_names(i, num_stages)]
    registry = getattr(seed, "registry", None)
    return 0 if registry is None else sum(1 for n in names if registry.lookup(n) is not None)


def work_done(
    phase: str,
    num_stages: int,
    instances: Sequence[RentedInstance] = (),
    statuses: dict[int, tuple[NodeStatus, float]] | None = None,
    noted: Noted | None = None,
) -> str:
    """The count of work the phase has done, as the orchestrator sees it: the instances that
    reached the step a waiting phase waits for (``1 of 2 running``), in the load also the blocks
    the workers have realized and the programs they have read or made (:func:`load_counts`), in
    the teardown the instances destroyed; in the phases that run in the nodes (resolve, prefill,
    decode, the reference), ``noted``'s count
    (:func:`nodes_work`). "": the phase has no count."""
    if noted is not None and (count := nodes_work(phase, num_stages, noted)):
        return count
    current = {i.stage: i for i in instances if not i.replaced}  # each stage's latest
    if phase in WAITS and num_stages:
        step, (done, _, _) = Phase[phase.upper()].waits_for, WAITS[Phase[phase.upper()]]
        reached = sum(1 for i in current.values() if step in i.timeline)
        if phase != "load":
            return f"{reached} of {num_stages} {done}"
        return f"{reached} of {num_stages} workers ready" + load_counts([st for st, _ in (statuses or {}).values()])
    if phase == "teardown" and instances:
        gone = sum(1 for i in instances if i.state == "destroyed")
        return f"{gone} of {len(instances)} destroyed"
    return ""


def load_counts(statuses: Iterable[NodeStatus]) -> str:
    """The load's work in the stages' last statuses: the blocks realized, of those the workers
    said they hold (a ready worker's part whole), and the programs their loads read or generated
    (``, 17 of 30 blocks loaded, 12 programs``); "" before any worker has said either."""
    loaded = total = programs = 0
    for st in statuses:
        if st.state == "ready":
            loaded, total = loaded + st.end_block - st.first_block, total + st.end_block - st.first_block
        else:
            loaded, total = loaded + st.blocks_loaded, total + st.blocks
        programs += st.programs
    return (f", {loaded} of {total} blocks loaded" if total else "") + (f", {programs} programs" if programs else "")


def live_line(
    phase: str,
    phase_s: float,
    num_stages: int,
    instances: Sequence[RentedInstance] = (),
    statuses: dict[int, tuple[NodeStatus, float]] | None = None,
    at: float = 0.0,
    width: int = 0,
    noted: Noted | None = None,
) -> str:
    """The live line: the phase and its clock, the count of its work done (:func:`work_done`),
    and while the run waits on its instances (rent to load) what each stage's is doing
    (:func:`stage_doing`), in the teardown whether it is gone. ``width``: the terminal's
    columns, the line cut to fit them (a line that wraps cannot be redrawn in place); 0 leaves it
    whole. The count comes before the stages' words: a cut line keeps it."""
    line = f"{phase} {phase_s:.1f} s"
    count = work_done(phase, num_stages, instances, statuses, noted)
    if count:
        line += f": {count}"
    if phase in WAITS and num_stages:
        by_stage = {i.stage: i for i in instances}
        line += "; " + ", ".join(
            stage_doing(phase, s, by_stage.get(s), (statuses or {}).get(s), at) for s in range(num_stages)
        )
    elif phase == "teardown" and instances:
        line += "; " + ", ".join(f"stage {i.stage} {teardown_word(i)}" for i in instances)
    if width and len(line) >= width:
        line = line[: max(0, width - 2)] + "…"
    return line


# --- the caches on this machine -----------------------------------------------------------------


def program_cache_path(environ: dict[str, str] | None = None) -> Path:
    """Where tinygrad keeps its disk cache (the nodes' programs and schedules), as tinygrad finds
    it from the environment (``CACHEDB``, ``XDG_CACHE_HOME``), without importing tinygrad."""
    env = os.environ if environ is None else environ
    if env.get("CACHEDB"):
        return Path(env["CACHEDB"]).expanduser().absolute()
    root = env.get("XDG_CACHE_HOME") or os.path.expanduser(
        "~/Library/Caches" if sys.platform == "darwin" else "~/.cache"
    )
    return Path(root, "tinygrad", "cache.db").absolute()


def grown_caches(ready: Iterable[NodeStatus], programs: Path) -> list[Path]:
    """The caches a load wrote to: the weight cache's directory of each stage that realized its
    weights from the GGUF and wrote them (``WeightLoad.path``), and ``programs`` (tinygrad's
    database) where a stage generated programs; only those that exist on this machine."""
    found: list[Path] = []
    for st in ready:
        load = st.load
        if load is None:
            continue
        if load.weights is not None and load.weights.source == "gguf" and load.weights.path:
            found.append(Path(load.weights.path).parent)
        if load.programs is not None and load.programs.misses:
            found.append(programs)
    return [p for p in dict.fromkeys(found) if p.exists()]


def size_of(path: Path) -> int:
    """Bytes in a file, or in the files under a directory (those that vanish meanwhile: none)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for p in path.rglob("*"):
        with contextlib.suppress(OSError):
            if p.is_file():
                total += p.stat().st_size
    return total


def human(nbytes: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def tilde(path: Path) -> str:
    home = Path.home()
    return f"~/{path.relative_to(home)}" if path.is_relative_to(home) and path != home else str(path)


def cache_line(grown: Sequence[tuple[Path, int]]) -> str:
    """``cache: ~/.cache/ppsmoke/weights grew to 1.2 GB (rm -rf ~/.cache/ppsmoke/weights to clear)``,
    for each cache that grew (path, bytes)."""
    sizes = ", ".join(f"{tilde(p)} {'grew ' if i == 0 else ''}to {human(n)}" for i, (p, n) in enumerate(grown))
    return f"cache: {sizes} (rm -rf {' '.join(tilde(p) for p, _ in grown)} to clear)"


# --- the printer ----------------------------------------------------------------------------------


class Progress:
    """The phase lines, the start lines or the live line, the answer and the cache line of one run."""

    def __init__(
        self,
        out: TextIO | None = None,
        err: TextIO | None = None,
        *,
        live: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.out = sys.stdout if out is None else out
        self.err = sys.stderr if err is None else err
        self.live_line = self.err.isatty() if live is None else live  # redrawn in place, or start lines
        self.clock = clock
        self.started = clock()
        self.phase: str | None = None  # the phase last started
        self.running = False  # it has not ended yet: the live line shows it
        self.phase_started = self.started
        self.answered = False  # the answer has been printed
        self.cache_said = False
        self.run: SmokeRun | None = None
        self._drawn = False

    def watch(self, run: SmokeRun) -> None:
        """The run whose instances the live line describes, and whose load the cache line reads."""
        self.run = run

    def stamp(self) -> str:
        return f"[{self.clock() - self.started:7.2f}s]"

    def __call__(self, phase: str, seconds: float, detail: str = "") -> None:
        """A phase has ended: its line on stdout (the driver's ``on_phase``)."""
        self.clear()
        if phase == self.phase:
            self.running = False
        line = f"{self.stamp()} {phase:<9} {seconds:8.3f}s"
        print(f"{line}  {detail}" if detail else line, file=self.out, flush=True)
        if phase == "load":
            self.say_cache()

    def start(self, phase: str) -> None:
        """A phase has begun (the driver's ``on_start``; said once however often it is set)."""
        if phase == self.phase:
            return
        self.phase, self.phase_started, self.running = phase, self.clock(), True
        if self.live_line:
            self.draw()
        else:
            print(f"{self.stamp()} start {phase}", file=self.err, flush=True)

    def answer(self, text: str) -> None:
        """The text has come back: on stdout at once (the driver's ``on_answer``)."""
        self.clear()
        print(text, file=self.out, flush=True)
        self.answered = True

    def line(self) -> str:
        """The live line now."""
        phase = self.phase or "start"
        run = self.run
        dep = run.deployment if run is not None else None
        if run is None or dep is None:
            return live_line(phase, self.clock() - self.phase_started, 0)
        now = self.clock()
        at = now - dep.began
        statuses = {s: (st, came - dep.began) for s, (st, came) in dep.statuses.items()}
        try:  # the terminal stderr is drawn on, which stdout (redirected) may not be
            width = os.get_terminal_size(self.err.fileno()).columns
        except (OSError, ValueError):
            width = shutil.get_terminal_size().columns
        s = run.settings
        noted = Noted(
            s.max_tokens,
            sum(st.end_block - st.first_block for st, _ in dep.statuses.values() if st.state == "ready"),
            resolved(dep.seed, s.num_stages) if phase == "resolve" else 0,
            dict(run.noted),
            preflight_checks(getattr(dep, "rental", None)),
        )
        return live_line(phase, now - self.phase_started, s.num_stages, dep.instances, statuses, at, width, noted)

    def draw(self) -> None:
        try:
            line = self.line()
        except Exception:  # the live line is a view: a fault in it never fails the run it shows
            log.debug("the live line could not be drawn", exc_info=True)
            line = live_line(self.phase or "start", self.clock() - self.phase_started, 0)
        self.err.write(CLEAR + line)
        self.err.flush()
        self._drawn = True

    def clear(self) -> None:
        """Take the live line away, before anything else is printed."""
        if self._drawn:
            self.err.write(CLEAR)
            self.err.flush()
            self._drawn = False

    @contextlib.asynccontextmanager
    async def live(self) -> AsyncIterator[None]:
        """While the block runs, on a terminal: the live line, redrawn every :data:`REFRESH` seconds."""
        if not self.live_line:
            yield
            return

        async def redraw() -> None:
            while True:
                if self.running:
                    self.draw()
                await asyncio.sleep(REFRESH)

        task = asyncio.ensure_future(redraw())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self.clear()

    def say_cache(self) -> None:
        """Once, in a run whose nodes are processes of this machine (not vast.ai's hosts, not
        containers with disks of their own), when its load wrote to their caches: where they
        are, their size, and how to clear them (stderr)."""
        run = self.run
        if self.cache_said or run is None or run.deployment is None:
            return
        if not run.settings.local or run.settings.runtime != "processes":
            return
        grown = grown_caches(run.deployment.ready.values(), program_cache_path())
        if grown:
            self.cache_said = True
            print(cache_line([(p, size_of(p)) for p in grown]), file=self.err, flush=True)


# --- the pytest plugin's ------------------------------------------------------------------------


class Lines(io.StringIO):
    """A text stream whose complete lines each go to ``write_line`` (pytest's terminal reporter's,
    in a pipe or CI: each on a line of its own, whatever pytest was writing)."""

    def __init__(self, write_line: Callable[[str], None]) -> None:
        super().__init__()
        self.write_line, self.pending = write_line, ""

    def write(self, text: str) -> int:
        *done, self.pending = (self.pending + text).split("\n")
        for line in done:
            self.write_line(line)
        return len(text)


class Around(io.StringIO):
    """A text stream that writes to ``file`` within ``around()`` (pytest's capture manager's
    ``global_and_fixture_disabled``: a test's setup runs with its output captured, and the live
    line is the terminal's, as pytest's own live logging writes there)."""

    def __init__(self, file: TextIO, around: Callable[[], contextlib.AbstractContextManager[object]]) -> None:
        super().__init__()
        self.file, self.around = file, around

    def write(self, text: str) -> int:
        with self.around():
            self.file.write(text)
            self.file.flush()
        return len(text)

    def fileno(self) -> int:
        return self.file.fileno()

    def isatty(self) -> bool:
        return self.file.isatty()


class Relay:
    """The live line of a run stepped from another thread (the pytest plugin's session, whose
    event loop runs in a thread of its own): the driver's ``on_phase`` and ``on_start`` queue
    their calls, and the thread that waits for the step replays them and redraws the line
    (:meth:`tick`, every :data:`REFRESH` seconds), so that only that thread writes to the
    terminal. :meth:`done`, when the step is over, takes the line away and gives back what the
    terminal's line held before (``restore()``: pytest's own, the test's path and its dots)."""

    def __init__(self, progress: Progress, restore: Callable[[], str] = str) -> None:
        self.progress, self.restore = progress, restore
        self.calls: queue.SimpleQueue[tuple[str, tuple[str, ...]]] = queue.SimpleQueue()
        self.shown = False  # the live line covers the terminal's line: done() gives it back

    def on_phase(self, phase: str, seconds: float, detail: str = "") -> None:
        self.calls.put(("phase", (phase, f"{seconds!r}", detail)))

    def on_start(self, phase: str) -> None:
        self.calls.put(("start", (phase,)))

    def _replay(self) -> None:
        p = self.progress
        while True:
            try:
                call, args = self.calls.get_nowait()
            except queue.Empty:
                return
            if call == "start":
                with contextlib.suppress(RuntimeError):  # its first drawing read a changing state
                    p.start(args[0])
                self.shown = self.shown or p.live_line
            else:
                p(args[0], float(args[1]), args[2])

    def tick(self) -> None:
        """Replay what the driver said, and redraw the live line (on a terminal)."""
        self._replay()
        p = self.progress
        if p.live_line and p.running:
            with contextlib.suppress(RuntimeError):  # the run's state changed while read: the next tick
                p.draw()
            self.shown = True

    def done(self) -> None:
        """The step is over: what it said, then the terminal's own line back."""
        self._replay()
        self.progress.clear()
        if self.shown:
            self.progress.err.write(self.restore())
            self.progress.err.flush()
            self.shown = False

"""``pp-smoke-run``: the one command that proves a pipeline-parallel deployment works.

    pp-smoke-run --vastai                 # rent on vast.ai (key from VAST_API_KEY or --api-key)
    pp-smoke-run --local --report r.json  # the same lifecycle against the vast.ai emulator, on loopback
    pp-smoke-run --reap                   # destroy every instance this tool labelled
    pp-smoke-run --local --grid small     # a layout grid instead: measured, fitted, reported (--grid-out)
    pp-smoke-run --check                  # what this machine can run, and what to install for the rest

The lifecycle: rent one instance per stage (cheapest matching offers), boot (each instance
running), converge (1 + N members under SWIM), load (every worker ready), resolve the stage
names, prefill and decode "Say hello" through the chain, the reference (the model in one piece
on stage 0's node: the tokens must be the same; ``--reference off`` leaves it out), teardown
(destroy everything rented). A line per phase with its time; the text on stdout; ``--report``
writes the JSON report. The run ends on its verdict (``harness/claims.py``): PASS or FAIL, then
a line per claim of the README's table, passed, failed or not checked, with its evidence.

Exit status: 0 for PASS: nothing failed, the response is non-empty, every instance was destroyed
and no claim the run checked failed (a token-exact reference that differs fails the run); 1 for
FAIL: a phase failed (the message names it), a claim failed, a destroy failed, or
SIGINT/SIGTERM/SIGHUP (everything rented is destroyed first); 2 for bad arguments, or a tool the
run needs that this machine lacks (one line that says what to install, before anything starts;
``--check`` lists them all).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path

from .. import __version__, checks
from ..protocol import PhaseError
from . import claims
from .accounts import WHERE
from .driver import SmokeRun
from .options import Parser, SettingError
from .progress import Progress
from .report import HEADLINE, Report
from .settings import GROUPS, OPTIONS, STEPS, Settings, face_names, read

log = logging.getLogger(__name__)


MODES = ("--local", "--vastai", "--reap", "--check")
# what ``--help`` shows beside the modes; ``--help-all`` and docs/run.md's options table list every option
SHORT = ("report", "model", "num_stages", "max_tokens", "api_key", "run_id", "verbose")
REST = "every option: pp-smoke-run --help-all, or the options table of docs/run.md"


def parser() -> argparse.ArgumentParser:
    """The flags, generated from the settings table (all read as text, checked by the table) and
    grouped by task (``GROUPS``), each with its values as the metavar. A bad argument is one line
    and a pointer to ``--help`` (``settings.Parser``). ``--help`` is the modes and the common
    options (:data:`SHORT`); ``--help-all`` is every option."""
    usage = f"%(prog)s ({' | '.join(MODES)}) [options]"
    p = Parser(prog="pp-smoke-run", usage=usage, description=__doc__, add_help=False)
    groups = {name: p.add_argument_group(title) for name, title in GROUPS.items()}
    mode = groups["run"].add_mutually_exclusive_group()  # required, but said after a bad flag or value
    mode.add_argument("--vastai", action="store_true", help="rent real GPUs on vast.ai")
    mode.add_argument(
        "--local", action="store_true", help="this machine: the vast.ai emulator, nodes on loopback, CPU tinygrad"
    )
    mode.add_argument("--reap", action="store_true", help="destroy every instance labelled by pp-smoke-run")
    mode.add_argument(
        "--check", action="store_true", help="say what this machine can run and what to install for the rest"
    )
    for opt in OPTIONS:
        if opt.cli is None:
            continue
        env = f"; env {opt.env}" if opt.env else ""
        groups[opt.group].add_argument(opt.cli, dest=opt.name, default=None, metavar=opt.metavar, help=opt.help + env)
    groups["run"].add_argument("--run-id", metavar="RUN_ID", help="--reap: only this run's instances")
    p.add_argument("-h", "--help", action=_Help, help="the modes and the common options")
    p.add_argument("--help-all", action=_Help, help="every option, grouped by task")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log membership, stage and API events to stderr")
    return p


def short_help(p: argparse.ArgumentParser) -> str:
    """``--help``: the usage, what the command is and its examples, the modes and the options of
    :data:`SHORT`, each under its group, and where the rest is."""
    f = p._get_formatter()
    f.add_usage(p.usage, p._actions, p._mutually_exclusive_groups)
    f.add_text("\n\n".join(__doc__.split("\n\n")[:2]))
    for group in p._action_groups:
        shown = [a for a in group._group_actions if {*a.option_strings} & {*MODES, "--help"} or a.dest in SHORT]
        if shown:
            f.start_section(group.title)
            f.add_arguments(shown)
            f.end_section()
    f.add_text(REST)
    return f.format_help()


class _Help(argparse.Action):
    """``--help`` (the short help) or ``--help-all`` (argparse's whole help), then exit 0."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(
        self, p: argparse.ArgumentParser, ns: argparse.Namespace, values: object, option_string: str | None = None
    ) -> None:
        p._print_message(p.format_help() if "--help-all" in self.option_strings else short_help(p), sys.stdout)
        p.exit()


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Settings]:
    """The arguments and the settings they give. A bad flag or value is named first: an unknown
    flag (argparse's own), then each value by its option's check, then a missing mode."""
    p = parser()
    args = p.parse_args(argv)
    flags = {o.name: getattr(args, o.name) for o in OPTIONS if o.cli}
    if not (args.vastai or args.local or args.reap or args.check):
        for o in OPTIONS:
            if o.cli and isinstance(flags[o.name], str):
                try:
                    o.parse(flags[o.name])
                except checks.Invalid as e:
                    p.error(f"{o.cli} {e}")
        p.error(f"one of the arguments {' '.join(MODES)} is required")
    flags["mode"] = "vastai" if args.vastai or args.reap else "local"
    try:
        settings = read(flags, face="cli")
    except SettingError as e:
        p.error(str(e))
    if args.check:  # a report of this machine: no key, no model
        return args, settings
    if (args.vastai or args.reap or settings.vast_url) and not settings.api_key:
        p.error("a vast.ai API key is needed: set VAST_API_KEY or pass --api-key")
    if not args.reap:
        from ..stage.catalog import ModelError, model_names, resolve_model

        if args.vastai and settings.model not in model_names():
            names = ", ".join(model_names())
            p.error(f"--vastai needs a model name the instances can fetch ({names}), got {settings.model!r}")
        try:
            if args.local:
                resolve_model(settings.model)
        except ModelError as e:
            p.error(str(e))
    if args.local and settings.grid == "off":
        from .check import refusal  # a tool this run needs and this machine lacks: nothing starts

        if (why := refusal(settings, face_names("cli"))) is not None:  # one line, the tool to install last
            p.exit(2, f"{p.prog}: error: {why}\n")
    return args, settings


async def do_reap(settings: Settings, run_id: str | None) -> int:
    from ..cloud.provider import ProviderError
    from ..cloud.rental import reap
    from .setup import provider_for

    provider = provider_for(settings)
    try:
        swept = await reap(provider, run_id)
    except ProviderError as e:
        print(f"pp-smoke-run: reap failed: {e}", file=sys.stderr)
        return 1
    finally:
        await provider.close()
    for entry in swept:
        if entry["destroyed"]:
            print(f"destroyed instance {entry['id']} ({entry['label']}, was {entry['status']})")
        else:
            print(f"could NOT destroy instance {entry['id']} ({entry['label']}): {entry['error']}", file=sys.stderr)
    print(f"reaped {sum(e['destroyed'] for e in swept)} of {len(swept)} labelled instance(s)")
    return 0 if all(e["destroyed"] for e in swept) else 1


async def execute(run: SmokeRun, progress: Progress | None = None) -> None:
    """The run, with SIGINT/SIGTERM/SIGHUP cancelling it into its teardown; ``progress``: its live
    line (on a terminal) while it runs."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()

    def stop(sig: signal.Signals) -> None:
        if progress is not None:
            progress.clear()
        phase = run.phase
        run.fail(phase, f"{phase}: interrupted by {sig.name}")
        if run.tearing_down:  # let the teardown finish: cutting it short would leak instances
            print(f"pp-smoke-run: {sig.name}: already tearing down", file=sys.stderr, flush=True)
            return
        print(f"pp-smoke-run: {sig.name}: destroying everything that was rented", file=sys.stderr, flush=True)
        task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop, sig)
    run.release_early = True  # every step, then the teardown: nothing asks a stage after the request but stage 0
    async with progress.live() if progress is not None else contextlib.nullcontext():
        try:
            await run.start()
            await run.step(STEPS[-1])
        except (PhaseError, asyncio.CancelledError):
            pass  # in the report
        finally:
            await asyncio.shield(run.close())


def main(argv: list[str] | None = None) -> int:
    args, settings = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    if args.check:
        from .check import report

        print("\n".join(report()))
        return 0
    if args.reap:
        return asyncio.run(do_reap(settings, args.run_id))
    if settings.grid != "off":
        from ..layout.cli import grid_from_settings  # the layout package loads only for a grid

        return grid_from_settings(settings)
    progress = Progress(live=None if not args.verbose else False)  # -v's log lines would break a live line
    run = SmokeRun(settings, on_phase=progress, on_start=progress.start, on_answer=progress.answer)
    progress.watch(run)
    try:
        asyncio.run(execute(run, progress))
    except KeyboardInterrupt:
        run.fail(run.phase, f"{run.phase}: interrupted")
    except Exception as e:  # a bug or an unexpected failure: still a clear line and a report
        run.fail(run.phase, f"{run.phase}: {type(e).__name__}: {e}")
    r = run.report
    r.finish()
    if r.text and not progress.answered:
        print(r.text)  # the answer, even when something failed afterwards (a destroy)
    if r.reference.state in ("failed", "skipped") or r.reference.match is False:
        print(f"pp-smoke-run: WARNING: {r.reference.line()}", file=sys.stderr)
    if (api := r.api_line()) is not None:
        print(f"pp-smoke-run: {api}", file=sys.stderr)
    if r.teardown_error:  # said apart, also after an earlier failure: something may still be billing
        print(f"pp-smoke-run: WARNING: {r.teardown_error}", file=sys.stderr)
    money = " (emulated: nothing was billed)" if settings.local else ""
    print(
        f"pp-smoke-run: {r.destroyed()} of {len(r.instances)} instance(s) destroyed; cost ${r.cost_usd:.4f}{money}",
        file=sys.stderr,
    )
    for line in claims.block(r):  # the verdict: PASS or FAIL, a line per claim, what was replaced
        print(f"pp-smoke-run: {line}", file=sys.stderr)
    if not r.ok and args.verbose:  # each node's account of the failure, in its own words
        for name, text in r.tails():
            print(f"pp-smoke-run: {name}:\n  " + "\n  ".join(text.splitlines()), file=sys.stderr)
    if not r.ok and r.error != r.teardown_error:  # the first cause, last: what a user reads first
        print(
            f"{FAILED}{tails_pointed(r, settings.report, args.verbose)}",
            file=sys.stderr,
        )
    if settings.report:
        r.write(settings.report)
    if settings.timeline:
        draw_timeline(r, settings.timeline)
    return r.exit_code


def draw_timeline(report: Report, path: Path, who: str = "pp-smoke-run") -> None:
    """``--timeline``: the run's timeline as an image, or a line saying how to get matplotlib."""
    from .timeline import NoPlotting, draw  # matplotlib: only when asked for

    try:
        draw(report, path)
    except NoPlotting as e:
        print(f"{who}: no timeline drawn: {e}", file=sys.stderr)
    except OSError as e:
        print(f"{who}: no timeline drawn: {path}: {e}", file=sys.stderr)


FAILED = "pp-smoke-run: failed at "


def tails_pointed(r: Report, report: Path | None, verbose: bool) -> str:
    """The one-line failure (``Report.headline``), pointing where each node's log tail is: the
    report file given, the lines above (``-v``), or how to have them; with the prefix, at most
    ``HEADLINE`` characters."""
    shown = report.name if report and len(str(report)) > 40 else report  # a long path: its name, the line stays short
    where = f"{shown}'s instances[].log_tail" if report else ""
    if verbose:
        where = f"above{f', and in {where}' if where else ''}"
    where = where or f"pp-smoke-run -v, or {WHERE} with --report FILE"
    line = r.headline(face_names("cli"), HEADLINE - len(FAILED))
    if WHERE in line:  # the pointer as it will read: a longer one leaves the rest less room
        line = r.headline(face_names("cli"), HEADLINE - len(FAILED) - max(0, len(where) - len(WHERE)))
    return line.replace(WHERE, where)


if __name__ == "__main__":
    sys.exit(main())

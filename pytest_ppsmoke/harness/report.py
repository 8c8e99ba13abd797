"""The report of one smoke run: what ``pp-smoke-run --report`` and ``--ppsmoke-report`` write,
what the terminal summary prints and what the JUnit properties carry. One type, filled by the
driver as the run goes, so that every face of the tool writes the same keys.

Every part of the report is a dataclass of ``harness/figures.py``, typed with primitives,
enums, those dataclasses and lists, tuples and ``dict[str, X]`` maps of them
(``tests/test_typed.py`` checks it). The JSON report carries ``schema_version`` (:data:`SCHEMA_VERSION`);
``report.schema.json``, beside this module and shipped with the package (:func:`schema`), is its
JSON Schema, generated from the dataclasses (:func:`json_schema`;
``python -m pytest_ppsmoke.harness.report --schema > pytest_ppsmoke/harness/report.schema.json``):
every object names all its keys, requires them and refuses any other. A key removed, renamed or
given another type makes the next version. :meth:`Report.write` checks the report against it
before writing it.

:func:`parse` builds a part from the plain records of the layers below (their ``summary()``
dicts), checking every key and type on the way: a producer that drifts from the report fails
there, not in a reader of the report.

This module imports only the standard library, ``protocol`` and its parts (the plugin's terminal
summary uses it); writing a report imports ``jsonschema``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import sys
import time
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from ..protocol import Names, Phase, stage_name
from .figures import (
    ApiFigures,
    ClaimFigures,
    ClaimState,
    EmulatorFigures,
    Frames,
    FrameWindow,
    HopPhases,
    InstanceFigures,
    KvFigures,
    LinkStats,
    ListedInstance,
    Mode,
    NetworkFigures,
    Paths,
    PreflightFigures,
    ReferenceFigures,
    RunTimeline,
    SkippedOffer,
    StageSplit,
    SwimFigures,
    WireDtype,
)

SCHEMA_VERSION = 5
# the phase whose evidence each claim is judged on: a claim that fails is that phase's failure
CLAIM_PHASES = {
    "the cluster forms": Phase.CONVERGE,
    "the machines reach each other directly": Phase.CONVERGE,
    "the names resolve": Phase.RESOLVE,
    "activations arrive as sent": Phase.DECODE,
    "the KV cache stays with its blocks": Phase.DECODE,
    "decode closes without the orchestrator": Phase.DECODE,
    "the tokens are exact": Phase.REFERENCE,
    "the output is text": Phase.DECODE,
    "nothing is left rented": Phase.TEARDOWN,
    "nothing is rented in vain": Phase.PREFLIGHT,
}
HEADLINE = 300  # the most characters of a failure's one line
SCHEMA_FILE = "report.schema.json"  # beside this module, in the package
REGENERATE = "python -m pytest_ppsmoke.harness.report --schema > pytest_ppsmoke/harness/report.schema.json"


@dataclass
class Report:
    mode: Mode
    model: str
    prompt: str
    max_tokens: int
    num_stages: int
    wire_dtype: WireDtype
    ok: bool = False
    exit_code: int = 1
    error: str | None = None  # the first failure, with its phase: "converge: 2 of 3 members alive ..."
    failed_phase: Phase | None = None
    failed_at: float | None = None  # when the first failure was recorded (epoch seconds)
    vast_url: str | None = None
    run_id: str | None = None
    text: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    split: list[StageSplit] = field(default_factory=list)  # each stage's blocks and instance
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase, total, decode tokens/s
    hops: dict[str, HopPhases] = field(default_factory=dict)  # bytes and time per hop, prefill and decode apart
    kv: list[KvFigures] = field(default_factory=list)  # each stage's caches as its worker read them
    frames: Frames = field(default_factory=Frames)  # frames by type: the seed's prefill and decode, each stage's
    preflight: PreflightFigures | None = None  # what the checks before the first create found
    instances: list[InstanceFigures] = field(default_factory=list)  # id, offer, price, final state
    cost_usd: float = 0.0
    creates_sent: int = 0  # create calls sent to vast.ai: nothing can be billing when 0
    teardown_error: str | None = None  # what could not be destroyed, even when an earlier failure is the error
    left_after_teardown: list[ListedInstance] | None = None  # vast.ai's list of the run's label, after
    going_after_teardown: list[ListedInstance] = field(default_factory=list)  # still listed, on their way out
    offers_skipped: list[SkippedOffer] = field(default_factory=list)  # taken by someone else before our create
    claims: list[ClaimFigures] = field(default_factory=list)  # the README's claims as this run judged them
    replacements: int = 0  # hosts replaced (never running, or never joined, by their deadlines): instances[].replaced
    network: NetworkFigures | None = None  # the emulated network
    network_stats: dict[str, LinkStats] | None = None  # the delay switch's counts per link, at the end
    paths: Paths | None = None  # how the orchestrator reached each stage (direct or relay, rtt), accepted
    swim: SwimFigures | None = None  # the round trips measured after converge, SWIM's timing, each node's
    vast_api: ApiFigures | None = None  # the client's calls, 429s, retries and waits (None: no client)
    emulator: EmulatorFigures | None = None  # the embedded emulator's own record (local mode)
    reference: ReferenceFigures = field(default_factory=ReferenceFigures)  # the token-exact reference
    timeline: RunTimeline | None = None  # each phase's start and end, and the budget, beside instances[].timeline

    def fail(self, phase: Phase | None, message: str) -> None:
        """Record a failure; the first one is the cause, later ones are its consequences."""
        if self.error is None:
            self.error = message
            self.failed_phase = phase
            self.failed_at = round(time.time(), 3)

    def amend(self, was: str, now: str) -> None:
        """The recorded cause ``was``, told more fully as ``now`` (the nodes' accounts added to
        it); a cause other than ``was`` stays as it is."""
        if self.error == was:
            self.error = now

    def finish(self) -> None:
        """Decide the verdict: PASS (exit 0) when nothing failed, the answer is non-empty and no
        claim the run checked failed (``claims``); FAIL (exit 1) otherwise, a failed claim the
        cause when nothing failed before it."""
        if self.error is None and not self.text:
            self.fail(None, "no text came back")
        failed = [c for c in self.claims if c.state is ClaimState.FAILED]
        if self.error is None and failed:
            phase = CLAIM_PHASES.get(failed[0].claim)
            said = f"{failed[0].claim}: no: {failed[0].evidence}"
            self.fail(phase, f"{phase}: {said}" if phase is not None else said)
        self.ok = self.error is None and bool(self.text) and not failed
        self.exit_code = 0 if self.ok else 1

    def headline(self, names: Names | None = None, limit: int = HEADLINE) -> str:
        """The failure in one line of at most ``limit`` characters: the phase, the first cause, and
        what to do (the phase's advice, each setting named as ``names``, the face's, writes it).
        The nodes' accounts that :attr:`error` carries (each instance's ``node_words``) are the
        first one and a count of the rest; the error stays whole in the report."""
        if self.error is None:
            return "nothing failed"
        hint = self.failed_phase.advice(names or Names()) if self.failed_phase is not None else ""
        interrupted = "interrupted" in self.error or "budget" in self.error
        words = [i.node_words for i in self.instances if i.node_words]
        return one_line(self.error, words, hint if not interrupted else "", limit)

    def api_line(self) -> str | None:
        """What vast.ai's API cost the run when it pushed back: its 429s (absorbed, and the time
        waited on them), other retries, and the offers taken by someone else first; None when
        every call was answered at once."""
        a = self.vast_api or ApiFigures()
        parts = []
        if a.rate_limited:
            parts.append(
                f"{a.rate_limited} answered 429 (absorbed: {a.retry_wait_s:.1f} s waited on retries, "
                f"{a.pace_wait_s:.1f} s spacing calls)"
            )
        if a.retries:
            parts.append(f"{a.retries} retried after a 5xx or no answer")
        if self.offers_skipped:
            taken = ", ".join(f"{o.offer} (HTTP {o.status}, stage {o.stage})" for o in self.offers_skipped)
            parts.append(f"{len(self.offers_skipped)} offer(s) taken by someone else first: {taken}")
        if not parts:
            return None
        return f"vast.ai API: {a.calls} calls; " + "; ".join(parts)

    def replaced_line(self) -> str | None:
        """The hosts the run replaced, each with why, when and what it cost; None when none was:
        a verdict that needed the cloud's second try says so."""
        gone = [i for i in self.instances if i.replaced]
        if not gone:
            return None
        each = "; ".join(
            f"instance {i.id} (stage {i.stage}, {i.offer.gpu_name} on machine {i.offer.machine_id}) at "
            f"{i.replaced_at:.0f} s for ${i.cost_usd:.4f}: {i.replaced}"
            for i in gone
        )
        return f"{len(gone)} host(s) replaced: {each}"

    def destroyed(self) -> int:
        return sum(i.final_state in ("destroyed", "destroying") for i in self.instances)

    def to_json(self) -> dict[str, Any]:
        """The JSON report: ``schema_version`` first, then every field (``report.schema.json``)."""
        found: dict[str, Any] = json.loads(json.dumps(dataclasses.asdict(self)))  # tuples and enums as JSON has them
        return {"schema_version": SCHEMA_VERSION, **found}

    def problems(self) -> list[str]:
        """What makes :meth:`to_json` not one of :func:`schema`'s, each with its place; none when
        it validates (the check :meth:`write` makes)."""
        return schema_problems(self.to_json())

    def write(self, path: Path) -> None:
        """Write the JSON report to ``path``, checked against :func:`schema`: a report that does
        not match it is a bug here; it is written all the same (the run's figures are kept), then
        ValueError names each problem."""
        found = self.to_json()
        problems = schema_problems(found)
        path.write_text(json.dumps(found, indent=2) + "\n")
        if problems:
            raise ValueError(f"{path} does not match the report's schema ({SCHEMA_FILE}): {'; '.join(problems)}")

    def figures(self) -> list[tuple[str, str, Any]]:
        """The figures as JUnit properties, each with the driver step after which it is final
        (``""``: the run's end, the teardown included): ``(step, name, value)``. The plugin puts
        each on the first test that saw its step done, once (a figure of the run's end, on the
        test during which the run ended)."""
        out: list[tuple[str, str, Any]] = [("rent", "ppsmoke_mode", self.mode), ("rent", "ppsmoke_run_id", self.run_id)]
        out += [(_timing_step(k), f"ppsmoke_time_{k}", v) for k, v in sorted(self.timings.items())]
        for hop, phases in sorted(self.hops.items()):
            for phase, h in (("prefill", phases.prefill), ("decode", phases.decode)):
                out.append(("infer", f"ppsmoke_hop_{hop}_{phase}_bytes", h.bytes_each))
                out.append(("infer", f"ppsmoke_hop_{hop}_{phase}_median_s", h.median_s))
        out.append(("infer", "ppsmoke_text", self.text or ""))
        out.append(("infer", "ppsmoke_token_ids", ",".join(map(str, self.token_ids))))
        ref = self.reference
        out.append(("reference", "ppsmoke_reference_state", ref.state))
        if ref.state == "done":
            out.append(("reference", "ppsmoke_reference_token_ids", ",".join(map(str, ref.token_ids))))
            out.append(("reference", "ppsmoke_reference_match", ref.match))
            out.append(("reference", "ppsmoke_reference_where", f"{stage_name(ref.stage)} {ref.device}: {ref.method}"))
        elif ref.detail:
            out.append(("reference", "ppsmoke_reference_detail", ref.detail))
        if (a := self.vast_api) is not None:
            out += [
                ("", f"ppsmoke_vast_{k}", getattr(a, k))
                for k in ("calls", "rate_limited", "retries", "retry_wait_s", "pace_wait_s")
            ]
        out.append(("rent", "ppsmoke_offers_skipped", ",".join(str(o.offer) for o in self.offers_skipped)))
        out.append(("rent", "ppsmoke_instances", ",".join(str(i.id) for i in self.instances)))
        out.append(("boot", "ppsmoke_replacements", self.replacements))
        out.append(("", "ppsmoke_cost_usd", self.cost_usd))
        if self.error:
            out.append(("", "ppsmoke_error", self.error))
            out.append(("", "ppsmoke_failed_phase", str(self.failed_phase or "")))
        # plain values only: a property travels between pytest-xdist's processes, which carry no enum
        return [(step, name, v.value if isinstance(v, enum.Enum) else v) for step, name, v in out]

    def tails(self) -> list[tuple[str, str]]:
        """Each node's account of a failure as a JUnit property of the failing test:
        ``ppsmoke_log_tail_pp-stage-N``, its words, then its log tail (where it came from)."""
        out = []
        for i in self.instances:
            if i.node_state is None:
                continue
            source = f"its log from {i.log_source}:" if i.log_source else "no log could be read"
            text = "\n".join([i.node_words or i.node_state, source, *i.log_tail])
            out.append((f"ppsmoke_log_tail_{stage_name(i.stage)}", text))
        return out

    def properties(self) -> list[tuple[str, Any]]:
        """The figures as JUnit properties, each once."""
        return [(name, value) for _, name, value in self.figures()]

    def summary(self) -> list[str]:
        """The lines of the terminal summary."""
        t = self.timings
        lines = ["  ".join(f"{p} {t[p]:.2f}s" for p in Phase if p in t)]
        if "decode_tokens_per_s" in t:
            lines.append(f"decode {t['decode_tokens_per_s']} tokens/s, {len(self.token_ids)} tokens")
        for hop, phases in sorted(self.hops.items()):
            for phase, h in (("prefill", phases.prefill), ("decode", phases.decode)):
                lines.append(f"{hop} {phase}: {h.count} x {h.bytes_each} B, median {h.median_s} s")
        for k in self.kv:
            fill = "; ".join(f"blocks {_ranges(f.blocks)} at {_ranges(f.positions)}" for f in k.filled)
            kept, changed = _ranges(k.prefill_digest_kept) or "no block", _ranges(k.prefill_digest_changed)
            lines.append(
                f"{stage_name(k.stage)} KV: owns {_ranges([k.blocks])}, cached {_ranges(k.cached) or 'none'}"
                f" ({fill or 'nothing filled'}); prefill of {k.prefill_len} kept its digest in {kept},"
                f" changed in {changed or 'none'}"
            )
        seed = self.frames.orchestrator
        for who, window in (("decode", seed.decode), ("prefill", seed.prefill)):
            if window is not None:
                lines.append(f"orchestrator frames in {who}: {_window(window)}")
        for name, window in sorted(self.frames.stages.items()):
            lines.append(f"{name} frames: {_window(window)}")
        if self.reference.state != "not run":
            lines.append(self.reference.line())
        if (api := self.api_line()) is not None:
            lines.append(api)
        if (replaced := self.replaced_line()) is not None:
            lines.append(replaced)
        for i in self.instances:
            lines.append(f"instance {i.id} stage {i.stage}: {i.offer.gpu_name} ${i.dph_total:.4f}/h, {i.final_state}")
            if i.node_words:
                lines.append(f"  {i.node_words}")
        failed = f"; failed at {self.failed_phase or 'the start'} (the error is shown above)" if self.error else ""
        lines.append(f"cost ${self.cost_usd:.4f}{failed}")
        return lines


TAILS = " (each node's log tail: "  # how the nodes' accounts on an error end (accounts.failure_words)
MORE = "the report's instances[].node_words"
CAUSE = 80  # the least of the cause a headline keeps, where the rest leaves that much
DETAIL = 24  # a bracketed detail longer than this may be left out of a headline ("(…)")


def one_line(error: str, words: list[str], hint: str, limit: int = HEADLINE) -> str:
    """``error`` (``<phase>: <cause>``, then the nodes' accounts, ``words`` each, and where their
    tails are) as one line of at most ``limit`` characters, ``hint`` last in brackets: the first
    account and a count of the rest; then, where that is still too long, the count alone, and the
    cause :func:`shortened`, so that the phase and the cause's first words always show."""
    line = " | ".join(part.strip() for part in error.splitlines() if part.strip())  # one line, always
    named = [w for w in dict.fromkeys(words) if f"; {w}" in line]
    for w in named:
        line = line.replace(f"; {w}", "", 1)
    tails = ""
    if (at := line.rfind(TAILS)) >= 0 and line.endswith(")"):
        line, tails = line[:at], line[at:]
    end = f" ({hint})" if hint else ""
    tries = [tails, ""]  # what follows the cause, longest first: the tails' pointer is the last to go
    if named:  # where the tails are is where the accounts are too: the report's instances[]
        rest, first, n = len(named) - 1, named[0].split(": ", 1)[0], len(named)  # the node and its state, no more
        count = (f"; and {rest} more" + ("" if tails else f": {MORE}")) if rest else ""
        every = f"; the accounts of {n} node(s)"
        tries = [f"; {named[0]}{count}{tails}", f"; {first}{count}{tails}", every + tails, f"{every}: {MORE}", ""]
    # the first that fits: the accounts whole, or the cause shortened to keep where the tails are,
    # or the cause whole without them, or the cause shortened
    pointed = [a for a in tries if tails and a.endswith(tails)]
    for after, cut in [*((a, False) for a in tries if a), *((a, True) for a in pointed), ("", False)]:
        room = limit - len(after + end)
        if len(line) <= room or (cut and room >= CAUSE):
            return shortened(line, room) + after + end
    after = next((a for a in tries if limit - len(a + end) >= CAUSE), "")
    return (shortened(line, limit - len(after + end)) + after + end)[:limit]


def shortened(text: str, room: int) -> str:
    """``text`` in at most ``room`` characters: its longest bracketed detail (of more than
    ``DETAIL`` characters) as "(…)", again
    until it fits (what to do, after the detail, stays); then its middle as "…", cut at words."""
    while len(text) > room:
        spans, depth, start = [], 0, 0
        for at, char in enumerate(text):
            if char in "([":
                depth, start = depth + 1, at if depth == 0 else start
            elif char in ")]" and depth:
                depth -= 1
                if depth == 0 and at - start > DETAIL:
                    spans.append((start, at))
        if not spans:
            break
        start, stop = max(spans, key=lambda span: span[1] - span[0])
        text = f"{text[: start + 1]}…{text[stop:]}"
    if len(text) <= room:
        return text
    head = text[: max(room - min(40, room // 3), 1)].rsplit(" ", 1)[0]
    tail = text[len(text) - (room - len(head) - 1) :]
    tail = tail.split(" ", 1)[1] if " " in tail[1:] else tail
    return f"{head}…{tail}"[:room]


def _timing_step(key: str) -> str:
    """The driver step after which timing ``key`` is final: a phase's is its step's (prefill and
    decode: the inference step's, as are the inference's own figures); the total, the run's end."""
    if key.upper() in Phase.__members__:
        return Phase[key.upper()].step
    return "infer" if key in ("decode_tokens_per_s", "inference") else ""


def _ranges(ranges: list[tuple[int, int]]) -> str:
    return ", ".join(f"[{a}, {b})" for a, b in ranges)


def _window(window: FrameWindow) -> str:
    """One window of frame counts in a line: the request's own by type, membership summed."""

    def line(counts: dict[str, int]) -> str:
        return ", ".join(f"{name} {n}" for name, n in sorted(counts.items())) or "nothing"

    m = window.membership
    return (
        f"received {line(window.received)}; sent {line(window.sent)} (membership: {m.received} received, {m.sent} sent)"
    )


# --- parts from plain records, and the schema from the dataclasses ---------------------------------

T = TypeVar("T")
_PRIMITIVES: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def parse(cls: type[T], value: Any) -> T:
    """``value`` (a lower layer's plain record: dicts, lists, primitives) as the report's part
    ``cls``, every key and type checked: a key ``cls`` does not name, a field without a default
    that ``value`` lacks, or a value of another type raises TypeError, naming where."""
    found: T = _parse(cls, value, cls.__name__)
    return found


def _parse(hint: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) != 1:
            raise TypeError(f"{where}: a union of {hint} is not a report type")
        return _parse(kinds[0], value, where)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{where}: expected a list, got {type(value).__name__}")
        return [_parse(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise TypeError(f"{where}: expected {len(args)} items, got {value!r}")
        return tuple(_parse(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise TypeError(f"{where}: expected an object keyed by strings, got {type(value).__name__}")
        return {k: _parse(args[1], v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        if not isinstance(value, dict):
            raise TypeError(f"{where}: expected an object for {hint.__name__}, got {type(value).__name__}")
        hints = typing.get_type_hints(hint)
        names = {f.name for f in dataclasses.fields(hint)}
        if unknown := sorted(set(value) - names):
            raise TypeError(f"{where}: {hint.__name__} has no field {', '.join(unknown)}")
        return hint(**{k: _parse(hints[k], v, f"{where}.{k}") for k, v in value.items()})
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise TypeError(f"{where}: {value!r} is not one of {[m.value for m in hint]}") from None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in _PRIMITIVES and isinstance(value, hint) and (hint is bool or not isinstance(value, bool)):
        return value
    raise TypeError(f"{where}: expected {getattr(hint, '__name__', hint)}, got {value!r}")


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of :meth:`Report.to_json`, from the dataclasses: each
    dataclass a ``$defs`` entry whose keys are all named and required, no other allowed; a
    ``dict[str, X]`` map an object whose values are X's; ``X | None`` X's or null; an enum its
    values; a ``tuple`` its items in order. ``report.schema.json`` is this, written out."""
    defs: dict[str, Any] = {}
    top = _object(Report, defs)
    top["properties"] = {"schema_version": {"const": SCHEMA_VERSION}, **top["properties"]}
    top["required"] = ["schema_version", *top["required"]]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "pytest-ppsmoke run report",
        **top,
        "$defs": dict(sorted(defs.items())),
    }


def _object(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    out: dict[str, Any] = {"type": "object"}
    if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):  # not dataclass's own
        out["description"] = " ".join(cls.__doc__.split())
    out["properties"] = {n: _type(hints[n], defs) for n in names}
    out["required"] = names
    out["additionalProperties"] = False
    return out


def _type(hint: Any, defs: dict[str, Any]) -> dict[str, Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) != 1 or len(args) != 2:
            raise TypeError(f"{hint}: only X | None is a report type")
        inner = _type(kinds[0], defs)
        if set(inner) == {"type"}:
            return {"type": [inner["type"], "null"]}
        if set(inner) == {"enum"}:
            return {"enum": [*inner["enum"], None]}
        return {"anyOf": [inner, {"type": "null"}]}
    if origin is list:
        return {"type": "array", "items": _type(args[0], defs)}
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _type(args[0], defs)}
        n = len(args)
        return {"type": "array", "prefixItems": [_type(a, defs) for a in args], "minItems": n, "maxItems": n}
    if origin is dict:
        if args[0] is not str:
            raise TypeError(f"{hint}: a map's keys are strings")
        return {"type": "object", "additionalProperties": _type(args[1], defs)}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if hint.__name__ not in defs:
            defs[hint.__name__] = {}  # taken, for a part that names itself
            defs[hint.__name__] = _object(hint, defs)
        return {"$ref": f"#/$defs/{hint.__name__}"}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return {"enum": [m.value for m in hint]}
    if hint in _PRIMITIVES:
        return {"type": _PRIMITIVES[hint]}
    raise TypeError(f"{hint!r} is not a report type")


def schema() -> dict[str, Any]:
    """The JSON Schema of :meth:`Report.to_json` (``report.schema.json``, shipped in the package)."""
    text = resources.files(__package__).joinpath(SCHEMA_FILE).read_text()
    found: dict[str, Any] = json.loads(text)
    return found


def schema_text() -> str:
    """:func:`json_schema` as ``report.schema.json`` holds it."""
    return json.dumps(json_schema(), indent=2) + "\n"


def schema_problems(report: Any) -> list[str]:
    """What makes ``report`` (a parsed JSON report) not one of :func:`schema`'s: each problem with
    its place in the report; none when it validates."""
    import jsonschema  # a dependency of the package (the emulator's API checks), loaded only here

    validator = jsonschema.Draft202012Validator(schema())
    return [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in validator.iter_errors(report)]


def main(argv: list[str] | None = None) -> int:
    """``python -m pytest_ppsmoke.harness.report --schema``: print the generated schema."""
    args = sys.argv[1:] if argv is None else argv
    if args != ["--schema"]:
        print("usage: python -m pytest_ppsmoke.harness.report --schema > pytest_ppsmoke/harness/report.schema.json")
        return 2
    sys.stdout.write(schema_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

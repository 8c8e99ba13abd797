"""Failpoints: named places where a fault can be switched on, in the manner of fail-rs and gofail.

Every point is declared once, in :data:`POINTS`, with the row of the spec's error table it
serves. Points are off unless one environment variable names them::

    PP_FAILPOINTS="vast.reject_create=2;vast.boot_delay=0.05,2"   # the emulator's points
    PP_FAILPOINTS="node.no_names;node.empty_text"                  # a node's points

``vast.*`` points are evaluated by the vast.ai emulator (``cloud/emulator/``); ``node.*``
points by ``pp-gpu-node``. The emulator switches a node's points on by writing this variable into
that node's environment (``NodeEnv.failpoints``); a real image never sets it. Code asks whether a
point is on, and nothing else in the product reads fault settings::

    if failpoints.on("node.empty_text"):
        text = ""

Tests configure points in process, as fail-rs's ``cfg`` / ``FailScenario`` do::

    with failpoints.scoped({"vast.offers": 1}):
        ...
    failpoints.cfg("node.no_names"); failpoints.remove("node.no_names")

or hand a parsed scenario to the emulator (``FakeVast(faults="vast.no_join=1")``). Unknown
names and bad values raise ValueError naming the point and what it takes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import checks
from .protocol import VAST_ENDPOINTS

ENV = "PP_FAILPOINTS"

# the rows of the spec's error table (section 6), and the rule under it
ROW_OFFERS = "Fewer than 2 GPU offers available"
ROW_CREATE = "Either instance creation rejected"
ROW_RUNNING = "Either instance never reaches `running`"
ROW_CONVERGE = "Cluster never converges to 3 members"
ROW_RESOLVE = "`pp-entry` or `pp-exit` never resolves"
ROW_READY = "Either worker never reports ready"
ROW_TEXT = "Stage 1 reports `done` but no text accumulated"
ROW_DROP = "Either node drops out mid-decode"
ROW_DESTROY = "Destroy fails for either instance"
RULE_DESTROY = "Any path that allocates an instance also destroys it"
RULE_BUDGET = "The whole run, teardown included, ends within its budget"
RULE_TOKENS = "The pipeline's tokens equal the model's run in one piece"


# --- value kinds: each parses the text of PP_FAILPOINTS or a Python value, and prints it back ---


@dataclass(frozen=True)
class Kind:
    what: str  # the expected form, for errors
    parse: Callable[[Any], Any]  # raises ValueError or TypeError on a bad value
    show: Callable[[Any], str]


def _on_off(v: Any) -> bool:
    if v is True or v in ("", "on"):
        return True
    if v is False or v == "off":
        return False
    raise ValueError


def _count(v: Any) -> int:
    return checks.integer(v, 0)


def _seconds(v: Any) -> float:
    return checks.number(v, least=0)  # also refuses NaN


def _delays(v: Any) -> tuple[float, ...]:
    items = [x for x in v.split(",")] if isinstance(v, str) else list(v) if isinstance(v, (list, tuple)) else [v]
    out = tuple(_seconds(x) for x in items)
    if not out:
        raise ValueError
    return out


def _stage_seconds(v: Any) -> dict[int, float]:
    pairs = [item.split(":") for item in v.split(",") if item.strip()] if isinstance(v, str) else list(dict(v).items())
    if any(len(p) != 2 for p in pairs):
        raise ValueError
    return {_count(a): _seconds(b) for a, b in pairs}


_WORD = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _word(v: Any) -> str:
    if not isinstance(v, str) or not _WORD.fullmatch(v.strip()):
        raise ValueError
    return v.strip()


def _stage_words(v: Any) -> dict[int, str]:
    pairs = [item.split(":") for item in v.split(",") if item.strip()] if isinstance(v, str) else list(dict(v).items())
    if not pairs or any(len(p) != 2 for p in pairs):
        raise ValueError
    return {_count(a): _word(b) for a, b in pairs}


def _numbers(v: Any) -> frozenset[int]:
    if isinstance(v, str):
        return frozenset(_count(x) for x in v.split(",") if x.strip())
    if isinstance(v, int):
        return frozenset({_count(v)})
    return frozenset(_count(x) for x in v)


def _counts(v: Any) -> dict[int, int]:
    if isinstance(v, str):
        pairs = [item.split(":") for item in v.split(",") if item.strip()]
        if any(len(p) != 2 for p in pairs):
            raise ValueError
        return {_count(a): _count(b) for a, b in pairs}
    return {_count(a): _count(b) for a, b in dict(v).items()}


def _limits(v: Any) -> str | dict[str, tuple[float, float]]:
    """``documented`` (vast.ai's own table, read by the emulator from its OpenAPI files:
    ``cloud/vastdoc.py``), ``off`` (none) or endpoint:threshold[:penalty] items."""
    if isinstance(v, str) and v.strip() in ("documented", "off"):
        return "documented" if v.strip() == "documented" else {}
    items = [item.split(":") for item in v.split(",") if item.strip()] if isinstance(v, str) else None
    if items is None:
        items = [[k, *(t if isinstance(t, (list, tuple)) else [t])] for k, t in dict(v).items()]
    out = {}
    for item in items:
        if len(item) not in (2, 3) or str(item[0]).strip() not in VAST_ENDPOINTS.values():
            raise ValueError
        threshold, penalty = _seconds(item[1]), _seconds(item[2]) if len(item) == 3 else 0.0
        out[str(item[0]).strip()] = (threshold, penalty)
    return out


def _losses(v: Any) -> dict[int, str]:
    pairs = [item.split(":") for item in v.split(",") if item.strip()] if isinstance(v, str) else list(dict(v).items())
    if any(len(p) != 2 or str(p[1]).strip() not in LOST_STATES for p in pairs):
        raise ValueError
    return {_count(a): str(b).strip() for a, b in pairs}


def _partitions(v: Any) -> dict[int, tuple[str, float]]:
    items = [item.split(":") for item in v.split(",") if item.strip()] if isinstance(v, str) else None
    if items is None:
        items = [[k, *t] for k, t in dict(v).items()]
    out = {}
    for item in items:
        if len(item) != 3 or str(item[1]).strip() not in DIRECTIONS:
            raise ValueError
        out[_count(item[0])] = (str(item[1]).strip(), _seconds(item[2]))
    return out


DIRECTIONS = ("both", "in", "out")  # a partition's direction, from the cut-off node's side
LOST_STATES = ("offline", "exited")  # how vast.ai shows a host that died: unreachable, or its container gone

FLAG = Kind("nothing, 'on' or 'off'", _on_off, lambda v: "")
COUNT = Kind("an integer >= 0", _count, str)
SECONDS = Kind("a number of seconds >= 0", _seconds, lambda v: f"{v:g}")
NUMBERS = Kind("integers >= 0, comma-separated (e.g. 1,2)", _numbers, lambda v: ",".join(map(str, sorted(v))))
DELAYS = Kind(
    "seconds >= 0, one per instance in create order, comma-separated (e.g. 1,75); the last one also for "
    "the instances created after",
    _delays,
    lambda v: ",".join(f"{x:g}" for x in v),
)
STAGE_SECONDS = Kind(
    "stage:seconds pairs, comma-separated (e.g. 1:5)",
    _stage_seconds,
    lambda v: ",".join(f"{a}:{b:g}" for a, b in sorted(v.items())),
)
WORD = Kind("a word of letters, digits, '.', '-' or '_' (at most 64)", _word, str)
STAGE_WORDS = Kind(
    "stage:word pairs, comma-separated, each word of letters, digits, '.', '-' or '_' (e.g. 1:here-i-am)",
    _stage_words,
    lambda v: ",".join(f"{a}:{b}" for a, b in sorted(v.items())),
)
COUNTS = Kind(
    "stage:count pairs, comma-separated (e.g. 1:6)",
    _counts,
    lambda v: ",".join(f"{a}:{b}" for a, b in sorted(v.items())),
)


LIMITS = Kind(
    "'documented' (vast.ai's, from its OpenAPI files: create 4.5 s with a 12 s penalty, show 2 s, list 1 s, ...), "
    "'off', or endpoint:threshold[:penalty] "
    "seconds, comma-separated (e.g. create:4.5:12,show:2); endpoints: search, create, show, label, destroy, list, "
    "destroy_many, user, logs",
    _limits,
    lambda v: v if isinstance(v, str) else ",".join(f"{k}:{t:g}:{p:g}" for k, (t, p) in sorted(v.items())) or "off",
)
PARTITIONS = Kind(
    "stage:direction:seconds, direction both, in or out, comma-separated (e.g. 1:both:5)",
    _partitions,
    lambda v: ",".join(f"{a}:{d}:{t:g}" for a, (d, t) in sorted(v.items())),
)
LOSSES = Kind(
    "stage:state pairs, state offline or exited, comma-separated (e.g. 1:offline)",
    _losses,
    lambda v: ",".join(f"{a}:{b}" for a, b in sorted(v.items())),
)
STATUSES = Kind(
    "create:status pairs, status 404 or 410, comma-separated (e.g. 1:410)",
    lambda v: _statuses(_counts(v)),
    lambda v: ",".join(f"{a}:{b}" for a, b in sorted(v.items())),
)


def _statuses(v: dict[int, int]) -> dict[int, int]:
    if any(s not in (404, 410) for s in v.values()):
        raise ValueError
    return v


@dataclass(frozen=True)
class Point:
    name: str
    kind: Kind
    row: str  # the spec error row it serves
    doc: str  # what happens when it is on
    default: Any = None  # its value when off
    node: str | None = None  # vast.* points that switch a node point on: picked stages, or every node's value


POINTS: dict[str, Point] = {
    p.name: p
    for p in (
        Point("vast.offers", COUNT, ROW_OFFERS, "offer searches answer only the first n matching offers"),
        Point("vast.reject_create", NUMBERS, ROW_CREATE, "these create calls (1-based) get HTTP 400", frozenset()),
        Point("vast.never_running", NUMBERS, ROW_RUNNING, "these stages' instances stay `loading`", frozenset()),
        Point(
            "vast.stuck_machines",
            NUMBERS,
            ROW_RUNNING,
            "these machines (machine_id) never finish booting: any instance on one stays `loading` (the default "
            "catalogue's machines are 31000 and up, its cheapest match 31004)",
            frozenset(),
        ),
        Point(
            "vast.boot_delay",
            DELAYS,
            ROW_RUNNING,
            "seconds each instance spends `loading` (a slow boot), one value per instance in create order, the "
            "last for the rest (a single value: every instance)",
            (0.2,),
        ),
        Point(
            "vast.heartbeat_gap",
            STAGE_SECONDS,
            ROW_RUNNING,
            "stage:seconds: that stage's instance shows `unknown` (no recent heartbeat from the host) for the "
            "seconds from when it would first show `running`; its node runs all along",
            {},
        ),
        Point(
            "vast.late_ports",
            SECONDS,
            ROW_CONVERGE,
            "every instance's record shows `ports` empty until this many seconds after it first shows `running` "
            "(its node's VAST_UDP_PORT_n are set from the start)",
            0.0,
        ),
        Point(
            "vast.no_join",
            NUMBERS,
            ROW_CONVERGE,
            "these stages' nodes get a seed address that answers nothing (a firewall)",
            frozenset(),
        ),
        Point(
            "vast.no_names", NUMBERS, ROW_RESOLVE, "node.no_names in these stages' nodes", frozenset(), "node.no_names"
        ),
        Point(
            "vast.stall_worker",
            NUMBERS,
            ROW_READY,
            "node.stall_worker in these stages' nodes, whose worker deadline becomes 3 s",
            frozenset(),
            "node.stall_worker",
        ),
        Point(
            "vast.compute_fault",
            NUMBERS,
            RULE_TOKENS,
            "node.compute_fault in these stages' nodes",
            frozenset(),
            "node.compute_fault",
        ),
        Point(
            "vast.empty_text",
            NUMBERS,
            ROW_TEXT,
            "node.empty_text in these stages' nodes",
            frozenset(),
            "node.empty_text",
        ),
        Point(
            "vast.crash_node",
            NUMBERS,
            RULE_DESTROY,
            "node.crash in these stages' nodes",
            frozenset(),
            "node.crash",
        ),
        Point(
            "vast.kill_stage", COUNT, ROW_DROP, "SIGKILL this stage's instance once vast.kill_after_tokens were sampled"
        ),
        Point(
            "vast.kill_after_tokens",
            COUNT,
            ROW_DROP,
            "how many tokens vast.kill_stage, vast.lose_host and vast.freeze_stage wait for (0: each waits for "
            "its stage's prefill to begin)",
            1,
        ),
        Point(
            "vast.freeze_stage",
            STAGE_SECONDS,
            ROW_DROP,
            "stage:seconds: that stage's node's process group is stopped (SIGSTOP) once vast.kill_after_tokens "
            "were sampled, and continued (SIGCONT) after the seconds (0: never); vast.ai shows the instance "
            "running all along, and a destroy still ends it",
            {},
        ),
        Point(
            "vast.say",
            STAGE_WORDS,
            ROW_DROP,
            "stage:word: node.say with that word in that stage's node (a marker in its own log)",
            {},
            "node.say",
        ),
        Point(
            "vast.log_secrets",
            NUMBERS,
            ROW_DROP,
            "node.log_secrets in these stages' nodes (their own keys in their log, to be redacted)",
            frozenset(),
            "node.log_secrets",
        ),
        Point(
            "vast.status_lag",
            SECONDS,
            ROW_DROP,
            "an instance whose node ended (vast.kill_stage, a crash) still shows running for this long (its host "
            "reports late): vast.ai's record is then not the first to know, the cluster's failure detection is",
            0.0,
        ),
        Point(
            "vast.log_upload",
            SECONDS,
            ROW_DROP,
            "how long a log's upload takes after request_logs answers: its result URL answers 404 (as an "
            "S3 object not written yet does) until then",
            0.5,
        ),
        Point(
            "vast.lose_host",
            LOSSES,
            ROW_DROP,
            "stage:state: that stage's host dies once vast.kill_after_tokens were sampled; vast.ai then shows the "
            "instance in that state: offline (its node frozen, unreachable) or exited (its node killed)",
            {},
        ),
        Point(
            "vast.partition",
            PARTITIONS,
            ROW_DROP,
            "stage:direction:seconds: with an emulated network, that stage's node is cut off (direction both, in "
            "or out) once vast.kill_after_tokens were sampled, and healed after the seconds (0: never)",
            {},
        ),
        Point(
            "vast.starve_orchestrator",
            SECONDS,
            ROW_DROP,
            "the embedded emulator blocks its process (the orchestrator's) for this long once "
            "vast.kill_after_tokens were sampled: a starved runner, whose late probes must not cost a stage its life",
            0.0,
        ),
        Point(
            "vast.isolate_orchestrator",
            SECONDS,
            RULE_DESTROY,
            "with an emulated network, the orchestrator is cut off from every node for this long once "
            "vast.kill_after_tokens were sampled (its nodes' orphan grace then destroys their instances)",
            0.0,
        ),
        Point(
            "vast.destroy_fails", COUNTS, ROW_DESTROY, "stage:n: the first n destroys of that stage get HTTP 500", {}
        ),
        Point(
            "vast.burst_429",
            COUNT,
            ROW_CREATE,
            "of every vast.throttle_every API calls the first n get HTTP 429 (to be absorbed, not taken for a "
            "rejection)",
            0,
        ),
        Point("vast.throttle_every", COUNT, ROW_CREATE, "the period of vast.burst_429, in API calls", 8),
        Point(
            "vast.retry_after",
            SECONDS,
            ROW_CREATE,
            "the 429s of vast.burst_429 carry Retry-After: this many seconds (0: none, as vast.ai's mostly do)",
            0.0,
        ),
        Point(
            "vast.search_quota",
            FLAG,
            ROW_OFFERS,
            "offer searches get HTTP 429 search_quota_exceeded: the account's daily search quota is spent",
            False,
        ),
        Point(
            "vast.rate_limit",
            LIMITS,
            ROW_CREATE,
            "vast.ai's rate limits, per endpoint and per identity (key and client address), on by default "
            "(documented, scaled by PP_VAST_TIME_SCALE): a call sooner than the threshold after the last one let "
            "through gets HTTP 429 (JSON detail, no Retry-After), and so does every call for the penalty that "
            "follows; 'off' for a test that must send calls faster",
            "documented",
        ),
        Point(
            "vast.race_offers",
            STATUSES,
            ROW_CREATE,
            "create:status: that create call finds its offer taken between search and create (someone else "
            "rented it): HTTP 404 or 410 no_such_ask, and the offer is no longer offered",
            {},
        ),
        Point(
            "vast.destroy_linger",
            SECONDS,
            RULE_DESTROY,
            "seconds a destroyed instance stays listed, on its way out (cur_state and next_state 'unloaded', "
            "intended_status as it was)",
            0.0,
        ),
        Point(
            "vast.destroy_ignored",
            COUNTS,
            RULE_DESTROY,
            "stage:n: the first n destroys of that stage are answered success but not done (the instance stays, "
            "intended running)",
            {},
        ),
        Point(
            "vast.api_latency", SECONDS, RULE_DESTROY, "seconds before each answer (a slow link; a long teardown)", 0.0
        ),
        Point(
            "vast.hold_create",
            NUMBERS,
            RULE_DESTROY,
            "these create calls rent, but their answer waits for FakeVast.release() (a lost answer)",
            frozenset(),
        ),
        Point(
            "vast.slow_decode",
            SECONDS,
            RULE_BUDGET,
            "node.slow_decode with this value in every node (a decode that outlives the budget)",
            0.0,
            "node.slow_decode",
        ),
        Point(
            "vast.hold_prefill",
            STAGE_SECONDS,
            ROW_DROP,
            "stage:seconds: that stage's node gets node.hold_prefill with the seconds (a loss or a freeze after 0 "
            "tokens then lands in its prefill, however late the emulator sees it begin)",
            {},
            "node.hold_prefill",
        ),
        Point(
            "vast.slow_reference",
            SECONDS,
            RULE_DESTROY,
            "node.slow_reference with this value in every node (a reference long enough to be interrupted)",
            0.0,
            "node.slow_reference",
        ),
        Point(
            "vast.slow_destroy",
            SECONDS,
            RULE_DESTROY,
            "seconds each destroy call waits before it is answered (a teardown long enough to be interrupted)",
            0.0,
        ),
        Point("node.no_names", FLAG, ROW_RESOLVE, "the node loads its worker but registers no names", False),
        Point(
            "node.stall_worker",
            FLAG,
            ROW_READY,
            "the node starts, in place of its worker, a process that never reports ready",
            False,
        ),
        Point("node.empty_text", FLAG, ROW_TEXT, "the last stage reports done with empty text", False),
        Point(
            "node.compute_fault",
            FLAG,
            RULE_TOKENS,
            "the stage's worker negates every hidden state it computes before it sends it on: a wrong answer the "
            "wire's digests cannot see (they are taken after it), which only the token-exact reference finds",
            False,
        ),
        Point(
            "node.crash",
            FLAG,
            RULE_DESTROY,
            "the node raises a RuntimeError as it starts (an error nobody planned for)",
            False,
        ),
        Point(
            "node.say",
            WORD,
            ROW_DROP,
            "the node logs 'marker: <word>' (at WARNING) as it joins and at each decode step",
        ),
        Point(
            "node.log_secrets",
            FLAG,
            ROW_DROP,
            "the node logs its own keys (node key, container key) as written, in hex and in base64 (at WARNING), "
            "as it joins: what every reader of its log must redact",
            False,
        ),
        Point("node.slow_decode", SECONDS, RULE_BUDGET, "seconds each decode step on this node waits first", 0.0),
        Point("node.slow_reference", SECONDS, RULE_DESTROY, "seconds a reference on this node waits first", 0.0),
        Point(
            "node.hold_prefill",
            SECONDS,
            ROW_DROP,
            "seconds this node's part of a prefill waits once it has said it begins (a stage after the first)",
            0.0,
        ),
    )
}


def _point(name: str) -> Point:
    p = POINTS.get(name)
    if p is None:
        raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(POINTS)}")
    return p


def _value(name: str, raw: Any) -> Any:
    p = _point(name)
    try:
        return p.kind.parse(raw)
    except (TypeError, ValueError):
        raise ValueError(f"failpoint {name!r} takes {p.kind.what}, got {raw!r}") from None


# --- a scenario: which points are on, with their values -----------------------------------------


@dataclass(frozen=True, eq=True)
class Scenario:
    """A validated set of points that are on. Empty: every point is off."""

    points: dict[str, Any] = field(default_factory=dict)

    def on(self, name: str) -> bool:
        _point(name)
        return name in self.points

    def value(self, name: str) -> Any:
        """The point's value when it is on, its default when it is off."""
        return self.points[name] if name in self.points else _point(name).default

    def for_stage(self, stage: int | None) -> Scenario:
        """The node points that this scenario's ``vast.*`` points switch on in ``stage``: a
        stage-picking point's flag where it picks the stage, another point's value everywhere."""
        on: dict[str, Any] = {}
        for p in POINTS.values():
            if p.node is None or p.name not in self.points:
                continue
            if p.kind is NUMBERS:
                if stage in self.points[p.name]:
                    on[p.node] = True
            elif p.kind in (STAGE_WORDS, STAGE_SECONDS):
                if stage in self.points[p.name]:
                    on[p.node] = self.points[p.name][stage]
            else:
                on[p.node] = self.points[p.name]
        return Scenario(on)

    def __str__(self) -> str:
        """The PP_FAILPOINTS text of this scenario (``parse`` reads it back)."""
        items = []
        for name in POINTS:
            if name in self.points:
                shown = POINTS[name].kind.show(self.points[name])
                items.append(f"{name}={shown}" if shown else name)
        return ";".join(items)

    def __bool__(self) -> bool:
        return bool(self.points)


def parse(spec: str | Mapping[str, Any] | Scenario | None) -> Scenario:
    """``"name;name=value;..."`` (PP_FAILPOINTS's form) or ``{name: value}`` -> a Scenario.
    A flag set to ``off`` (or False) is left out."""
    if isinstance(spec, Scenario):
        return spec
    if spec is None:
        return Scenario()
    if isinstance(spec, str):
        pairs: list[tuple[str, Any]] = []
        for item in filter(None, (s.strip() for s in spec.split(";"))):
            name, _, raw = item.partition("=")
            pairs.append((name.strip(), raw.strip()))
    else:
        pairs = list(spec.items())
    points = {}
    for name, raw in pairs:
        v = _value(name, raw)
        if v is not False:
            points[name] = v
    return Scenario(points)


# --- the process's points: PP_FAILPOINTS, overlaid by cfg() / remove() / scoped() ---------------

_OFF = object()
_overrides: dict[str, Any] = {}


@functools.lru_cache(maxsize=8)
def _from_env(text: str) -> Scenario:
    try:
        return parse(text)
    except ValueError as e:
        raise ValueError(f"{ENV}: {e}") from None


def active() -> Scenario:
    """This process's points: those ``PP_FAILPOINTS`` names, changed by ``cfg``/``remove``/``scoped``."""
    base = _from_env(os.environ.get(ENV, ""))
    if not _overrides:
        return base
    points = {**base.points, **_overrides}
    return Scenario({k: v for k, v in points.items() if v is not _OFF})


def on(name: str) -> bool:
    """Whether the point is on in this process (the check at the point itself)."""
    return active().on(name)


def value(name: str) -> Any:
    return active().value(name)


def cfg(name: str, value: Any = True) -> None:
    """Switch a point on in this process (fail-rs's ``cfg``); ``value`` as in PP_FAILPOINTS or typed."""
    v = _value(name, value)
    _overrides[name] = _OFF if v is False else v


def remove(name: str) -> None:
    """Switch a point off in this process, whatever PP_FAILPOINTS says."""
    _point(name)
    _overrides[name] = _OFF


@contextlib.contextmanager
def scoped(spec: str | Mapping[str, Any] | Scenario) -> Iterator[Scenario]:
    """Points on for the duration of a ``with`` block (fail-rs's ``FailScenario``); afterwards
    every point is as it was."""
    scenario = parse(spec)
    saved = dict(_overrides)
    _overrides.update(scenario.points)
    try:
        yield active()
    finally:
        _overrides.clear()
        _overrides.update(saved)

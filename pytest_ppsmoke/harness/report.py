"""The report of one smoke run: what ``pp-smoke-run --report`` and ``--ppsmoke-report`` write,
what the terminal summary prints and what the JUnit properties carry. One type, filled by the
driver as the run goes, so that every face of the tool writes the same keys.

The JSON report carries ``schema_version`` (:data:`SCHEMA_VERSION`); ``report.schema.json``,
beside this module and shipped with the package (:func:`schema`), is its JSON Schema: every key
with its type, no other key at the top. A key removed, renamed or given another type makes the
next version.

This module imports only the standard library (the plugin's terminal summary uses it).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from ..protocol import Names, Phase, stage_name

SCHEMA_VERSION = 1
SCHEMA_FILE = "report.schema.json"  # beside this module, in the package


@dataclass
class ReferenceFigures:
    """The token-exact reference: the model run in one piece on a stage's node after the request
    (the ``reference`` step). ``state``: ``not run`` (no step asked for it), ``off`` (the setting),
    ``skipped`` or ``failed`` (``detail`` says why), or ``done``. ``match`` compares its tokens
    with the pipeline's; ``first_difference`` is the first index where they differ (or where the
    shorter list ends). A mismatch does not fail the run: the spec's token-exact test fails on it."""

    state: str = "not run"
    detail: str | None = None
    stage: int | None = None
    device: str | None = None  # tinygrad's device on that node: CUDA on a rented GPU, CPU locally
    method: str | None = None  # protocol.reference_method: "unsplit", or rounded at the boundaries
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    match: bool | None = None
    first_difference: int | None = None
    load_s: float | None = None  # in the worker: loading the whole model (beside: while the stages loaded)
    generate_s: float | None = None  # in the worker: tinygrad's generate
    loaded: str | None = None  # beside: a reference worker loaded it with the stages; after: the stage's, afresh
    seconds: float | None = None  # the step as the orchestrator saw it
    mem_before: int | None = None  # the worker's device bytes in use before the load and after the generate
    mem_after: int | None = None  # (after: the model dropped first; beside: the model kept)

    def line(self) -> str:
        """One line for the terminal summary and the command's output."""
        if self.state != "done":
            return f"reference {self.state}" + (f": {self.detail}" if self.detail else "")
        how = "loaded beside the stages" if self.loaded == "beside" else "loaded after the request"
        where = f"{stage_name(self.stage)} ({self.device}, {self.method}, {how})"
        if self.match:
            return f"reference on {where}: the {len(self.token_ids)} tokens match"
        return f"reference on {where}: MISMATCH at token {self.first_difference}"


@dataclass
class Report:
    mode: str
    model: str
    prompt: str
    max_tokens: int
    num_stages: int
    wire_dtype: str
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
    split: list[dict[str, Any]] = field(default_factory=list)  # each stage's blocks and instance
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase, total, decode tokens/s
    hops: dict[str, Any] = field(default_factory=dict)  # bytes and time per hop, prefill and decode apart
    kv: list[dict[str, Any]] = field(default_factory=list)  # each stage's caches as its worker read them
    frames: dict[str, Any] = field(default_factory=dict)  # frames by type: the seed's prefill and decode, each stage's
    preflight: dict[str, Any] | None = None  # what the checks before the first create found (credit, image, offers)
    instances: list[dict[str, Any]] = field(default_factory=list)  # id, offer, price, final state
    cost_usd: float = 0.0
    creates_sent: int = 0  # create calls sent to vast.ai: nothing can be billing when 0
    teardown_error: str | None = None  # what could not be destroyed, even when an earlier failure is the error
    left_after_teardown: list[dict[str, Any]] | None = None  # vast.ai's list of the run's label, after
    going_after_teardown: list[dict[str, Any]] = field(default_factory=list)  # still listed, on their way out
    offers_skipped: list[dict[str, Any]] = field(default_factory=list)  # taken by someone else before our create
    network: dict[str, Any] | None = None  # the emulated network: its profile and each link's figures
    network_stats: dict[str, Any] | None = None  # the delay switch's counts per link, at the end
    paths: dict[str, Any] | None = None  # how the orchestrator reached each stage (direct or relay, rtt), accepted
    swim: dict[str, Any] | None = None  # the round trips measured after converge, SWIM's timing, each node's
    vast_api: dict[str, Any] = field(default_factory=dict)  # the client's calls, 429s, retries and waits
    emulator: dict[str, list[int]] | None = None  # the embedded emulator's own record (local mode)
    reference: ReferenceFigures = field(default_factory=ReferenceFigures)  # the token-exact reference

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
        """Decide the verdict: a non-empty answer, no failure and every instance destroyed."""
        if self.error is None and not self.text:
            self.fail(None, "no text came back")
        self.ok = self.error is None and bool(self.text)
        self.exit_code = 0 if self.ok else 1

    def headline(self, names: Names | None = None) -> str:
        """The failure in one line: the phase, why, and what to do (the phase's advice, each
        setting named as ``names``, the face's, writes it)."""
        if self.error is None:
            return "nothing failed"
        hint = self.failed_phase.advice(names or Names()) if self.failed_phase is not None else ""
        interrupted = "interrupted" in self.error or "budget" in self.error
        error = " | ".join(line.strip() for line in self.error.splitlines() if line.strip())  # one line, always
        return f"{error} ({hint})" if hint and not interrupted else error

    def api_line(self) -> str | None:
        """What vast.ai's API cost the run when it pushed back: its 429s (absorbed, and the time
        waited on them), other retries, and the offers taken by someone else first; None when
        every call was answered at once."""
        a = self.vast_api
        parts = []
        if a.get("rate_limited"):
            parts.append(
                f"{a['rate_limited']} answered 429 (absorbed: {a.get('retry_wait_s', 0):.1f} s waited on retries, "
                f"{a.get('pace_wait_s', 0):.1f} s spacing calls)"
            )
        if a.get("retries"):
            parts.append(f"{a['retries']} retried after a 5xx or no answer")
        if self.offers_skipped:
            taken = ", ".join(f"{o['offer']} (HTTP {o['status']}, stage {o['stage']})" for o in self.offers_skipped)
            parts.append(f"{len(self.offers_skipped)} offer(s) taken by someone else first: {taken}")
        if not parts:
            return None
        return f"vast.ai API: {a.get('calls', 0)} calls; " + "; ".join(parts)

    def destroyed(self) -> int:
        return sum(i.get("final_state") in ("destroyed", "destroying") for i in self.instances)

    def to_json(self) -> dict[str, Any]:
        """The JSON report: ``schema_version`` first, then every field (``report.schema.json``)."""
        return {"schema_version": SCHEMA_VERSION, **dataclasses.asdict(self)}

    def figures(self) -> list[tuple[str, str, Any]]:
        """The figures as JUnit properties, each with the driver step after which it is final
        (``""``: the run's end, the teardown included): ``(step, name, value)``. The plugin puts
        each on the first test that saw its step done, once (a figure of the run's end, on the
        test during which the run ended)."""
        out: list[tuple[str, str, Any]] = [("rent", "ppsmoke_mode", self.mode), ("rent", "ppsmoke_run_id", self.run_id)]
        out += [(_timing_step(k), f"ppsmoke_time_{k}", v) for k, v in sorted(self.timings.items())]
        for hop, phases in sorted(self.hops.items()):
            for phase, h in phases.items():
                out.append(("infer", f"ppsmoke_hop_{hop}_{phase}_bytes", h["bytes_each"]))
                out.append(("infer", f"ppsmoke_hop_{hop}_{phase}_median_s", h["median_s"]))
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
        a = self.vast_api
        out += [
            ("", f"ppsmoke_vast_{k}", a[k])
            for k in ("calls", "rate_limited", "retries", "retry_wait_s", "pace_wait_s")
            if k in a
        ]
        out.append(("rent", "ppsmoke_offers_skipped", ",".join(str(o["offer"]) for o in self.offers_skipped)))
        out.append(("rent", "ppsmoke_instances", ",".join(str(i["id"]) for i in self.instances)))
        out.append(("", "ppsmoke_cost_usd", self.cost_usd))
        if self.error:
            out.append(("", "ppsmoke_error", self.error))
            out.append(("", "ppsmoke_failed_phase", str(self.failed_phase or "")))
        return out

    def tails(self) -> list[tuple[str, str]]:
        """Each node's account of a failure as a JUnit property of the failing test:
        ``ppsmoke_log_tail_pp-stage-N``, its words, then its log tail (where it came from)."""
        out = []
        for i in self.instances:
            if i.get("node_state") is None:
                continue
            source = f"its log from {i['log_source']}:" if i.get("log_source") else "no log could be read"
            text = "\n".join([i.get("node_words") or i["node_state"], source, *i.get("log_tail", [])])
            out.append((f"ppsmoke_log_tail_{stage_name(i['stage'])}", text))
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
            for phase, h in phases.items():
                lines.append(f"{hop} {phase}: {h['count']} x {h['bytes_each']} B, median {h['median_s']} s")
        for k in self.kv:
            fill = "; ".join(f"blocks {_ranges(f['blocks'])} at {_ranges(f['positions'])}" for f in k["filled"])
            kept, changed = _ranges(k["prefill_digest_kept"]) or "no block", _ranges(k["prefill_digest_changed"])
            lines.append(
                f"{stage_name(k['stage'])} KV: owns {_ranges([k['blocks']])}, cached {_ranges(k['cached']) or 'none'}"
                f" ({fill or 'nothing filled'}); prefill of {k['prefill_len']} kept its digest in {kept},"
                f" changed in {changed or 'none'}"
            )
        for who, window in sorted(self.frames.get("orchestrator", {}).items()):
            lines.append(f"orchestrator frames in {who}: {_window(window)}")
        for who, window in sorted(self.frames.get("stages", {}).items()):
            lines.append(f"{who} frames: {_window(window)}")
        if self.reference.state != "not run":
            lines.append(self.reference.line())
        if (api := self.api_line()) is not None:
            lines.append(api)
        for i in self.instances:
            gpu = (i.get("offer") or {}).get("gpu_name", "?")
            lines.append(f"instance {i['id']} stage {i['stage']}: {gpu} ${i['dph_total']:.4f}/h, {i['final_state']}")
            if i.get("node_words"):
                lines.append(f"  {i['node_words']}")
        failed = f"; failed at {self.failed_phase or 'the start'} (the error is shown above)" if self.error else ""
        lines.append(f"cost ${self.cost_usd:.4f}{failed}")
        return lines


def _timing_step(key: str) -> str:
    """The driver step after which timing ``key`` is final: a phase's is its step's (prefill and
    decode: the inference step's, as are the inference's own figures); the total, the run's end."""
    if key.upper() in Phase.__members__:
        return Phase[key.upper()].step
    return "infer" if key in ("decode_tokens_per_s", "inference") else ""


def schema() -> dict[str, Any]:
    """The JSON Schema of :meth:`Report.to_json` (``report.schema.json``, shipped in the package)."""
    text = resources.files(__package__).joinpath(SCHEMA_FILE).read_text()
    found: dict[str, Any] = json.loads(text)
    return found


def _ranges(ranges: list[list[int]]) -> str:
    return ", ".join(f"[{a}, {b})" for a, b in ranges)


def _window(window: dict[str, Any]) -> str:
    """One window of frame counts in a line: the request's own by type, membership summed."""

    def line(counts: dict[str, int]) -> str:
        return ", ".join(f"{name} {n}" for name, n in sorted(counts.items())) or "nothing"

    m = window["membership"]
    return (
        f"received {line(window['received'])}; sent {line(window['sent'])}"
        f" (membership: {m['received']} received, {m['sent']} sent)"
    )

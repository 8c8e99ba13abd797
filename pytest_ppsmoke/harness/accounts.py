"""Each node's own account of a failed run: its last log lines and what became of it, gathered
before the teardown destroys anything.

For every rented instance, at once:

1. its node is asked over the cluster (``LogTailQuery`` to its status actor, within
   :data:`ASK_TIMEOUT`): it answers with its own last lines and the stalls of its event loop;
2. a node that does not answer is looked up on vast.ai (its record's state now) and its log
   read from vast.ai's logs endpoint (``request_logs``, then the result URL).

What each node is then called (:class:`Account`, ``state``):

- ``answered``: it answered, and its loop never stopped for long;
- ``stalled``: it answered, and its own stalls say it stopped and came back (the longest is named:
  "pp-stage-1 stalled for 4.2 s (its loop was starved)");
- ``hung``: it did not answer while vast.ai shows its instance running: "hung, or cut off";
- ``dead``: vast.ai shows its instance gone (exited, offline, stopped, no longer shown);
- ``booting``: it never joined the cluster, and vast.ai shows its instance still on its way up
  (``loading``, ``created``, ``scheduling``): not named in the failure, which says the phase;
- ``unknown``: it did not answer and vast.ai could not say (the message says why).

Every line is redacted (:class:`~pytest_ppsmoke.redact.Redactor`, every secret the orchestrator
knows) before it is kept: the node redacts its own, vast.ai's text is redacted here.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..cloud.provider import DEAD_STATES, ProviderError
from ..cloud.rental import Rental, RentedInstance
from ..messages import LogTail, LogTailQuery
from ..protocol import STATUS_ACTOR, stage_name
from ..redact import Redactor
from ..runtime.codec import ActorAddress
from ..runtime.errors import RemoteError
from ..runtime.node import Node

log = logging.getLogger(__name__)

TAIL_LINES = 50  # the lines of a node's log the report keeps, the newest
TAIL_BYTES = 8192  # and at most this much of their text
ASK_TIMEOUT = 4.0  # seconds a node has to answer for itself over the cluster
STALL_LEAST = 1.0  # seconds: a stall of the node's loop at least this long is named
STATES = ("answered", "stalled", "hung", "dead", "unknown", "booting")
QUIET = ("answered", "booting")  # states the failure's message does not name (the report has them)
BOOTING = ("loading", "created", "scheduling")  # vast.ai's states of an instance on its way up
WHERE = "the report's instances[].log_tail"  # where the one-line failure points
# an instance's entry in a report of a run that did not fail (or failed before it was asked)
NO_ACCOUNT: dict[str, Any] = {"node_state": None, "node_words": "", "log_source": None, "log_tail": [], "stalls": []}


@dataclass
class Account:
    """One node's account: what it is called (:data:`STATES`), where its tail came from
    (``cluster``, ``vast.ai logs`` or None), the tail, its stalls, and the words that name it."""

    stage: int
    state: str
    source: str | None = None
    lines: list[str] = field(default_factory=list)
    stalls: list[dict[str, float]] = field(default_factory=list)
    words: str = ""
    shown: str | None = None  # vast.ai's state of its instance, where the account came from vast.ai

    def summary(self) -> dict[str, Any]:
        """The keys it adds to the report's ``instances`` entry."""
        return {
            "node_state": self.state,
            "node_words": self.words,
            "log_source": self.source,
            "log_tail": self.lines,
            "stalls": self.stalls,
        }


def capped(lines: Iterable[str], max_lines: int = TAIL_LINES, max_bytes: int = TAIL_BYTES) -> list[str]:
    """The newest lines that fit in ``max_lines`` and ``max_bytes`` (UTF-8, a newline each),
    oldest first; a single line over the cap keeps its end."""
    out: list[str] = []
    size = 0
    for line in reversed(list(lines)[-max_lines:] if max_lines else []):
        size += len(line.encode()) + 1
        if size > max_bytes:
            if not out and max_bytes > 1:
                out.append(line.encode()[-(max_bytes - 1) :].decode(errors="ignore"))
            break
        out.append(line)
    return out[::-1]


def stalled_words(name: str, stalls: list[dict[str, float]]) -> str | None:
    """``pp-stage-1 stalled for 4.2 s (its loop was starved)``, by its longest stall, or None
    when none reached :data:`STALL_LEAST`."""
    longest = max(stalls, key=lambda s: s["seconds"], default=None)
    if longest is None or longest["seconds"] < STALL_LEAST:
        return None
    more = f"; {len(stalls)} stalls in all" if len(stalls) > 1 else ""
    when = f"{longest['at']:.1f} s after it started"
    return f"{name} stalled for {longest['seconds']:.1f} s (its loop was starved), {when}{more}"


async def ask(seed: Node, inst: RentedInstance, redact: Redactor, timeout: float) -> Account | str:
    """The node's own account over the cluster, or why it gave none."""
    name = stage_name(inst.stage)
    try:
        reply = await seed.request(
            ActorAddress(inst.endpoint_id, STATUS_ACTOR), LogTailQuery(TAIL_LINES, TAIL_BYTES), timeout
        )
    except TimeoutError:
        return f"no answer over the cluster within {timeout:g} s"
    except (ConnectionError, OSError) as e:
        return f"no answer over the cluster ({type(e).__name__}: {redact.text(str(e))})"
    except RemoteError as e:  # it is there, but gives no account of its own (an older node)
        return Account(inst.stage, "answered", words=f"{name} answered, but with no log tail ({redact.text(str(e))})")
    if not isinstance(reply, LogTail):
        return Account(inst.stage, "answered", words=f"{name} answered {type(reply).__name__}, not its log tail")
    stalls = [{"at": round(s.at, 3), "seconds": round(s.seconds, 3)} for s in reply.stalls]
    words = stalled_words(name, stalls)
    dropped = f"; {reply.dropped} older lines dropped" if reply.dropped else ""
    return Account(
        inst.stage,
        "stalled" if words else "answered",
        "cluster",
        capped(redact.lines(reply.lines)),
        stalls,
        words or f"{name} answered, up {reply.uptime:.0f} s{dropped}",
    )


async def from_vast(rental: Rental, inst: RentedInstance, redact: Redactor, why: str) -> Account:
    """A node that gave no account: what vast.ai shows of its instance, and its log from vast.ai."""
    name = stage_name(inst.stage)
    state: str = "unknown"
    shown: str | None = None
    try:
        shown, msg = await rental.state_now(inst)
    except ProviderError as e:
        said = f"{name} is unknown: {why}, and vast.ai could not show its instance ({redact.text(str(e))})"
    else:
        if shown == "running" and "joined" not in inst.timeline:  # its node starting, or unable to join
            state, said = "booting", f"{name} is booting: {why}, while vast.ai shows its instance running"
        elif shown == "running":
            state, said = "hung", f"{name} is hung, or cut off: {why} while vast.ai shows its instance running"
        elif shown in (*DEAD_STATES, "missing"):
            shows = f"vast.ai shows its instance {shown} ({redact.text(msg) or 'no message'})"
            state, said = "dead", f"{name} is dead: {shows}"
        elif "joined" not in inst.timeline and shown in BOOTING:
            state, said = "booting", f"{name} is booting: {why}, and vast.ai shows its instance {shown}"
        else:
            said = f"{name} is unknown: {why}, and vast.ai shows its instance {shown}"
    lines, source, note = await vast_tail(rental, inst, redact)
    return Account(inst.stage, state, source, lines, [], said + note, shown)


async def vast_tail(rental: Rental, inst: RentedInstance, redact: Redactor) -> tuple[list[str], str | None, str]:
    """The instance's log tail from vast.ai's logs, redacted and capped: (lines, source, a note
    of why there are none)."""
    try:
        text = await rental.log_tail(inst, TAIL_LINES)
    except ProviderError as e:
        return [], None, f"; vast.ai's logs could not be read ({redact.text(str(e))})"
    return capped(redact.lines(text.splitlines())), "vast.ai logs", ""


async def gather(
    seed: Node | None, rental: Rental, secrets: Iterable[str | bytes | None], timeout: float
) -> dict[int, Account]:
    """Every rented instance's account, by stage, each asked at once; within ``timeout`` in all
    (an account not complete by then is ``unknown``, naming the deadline)."""
    redact = Redactor(secrets)
    ask_for = min(ASK_TIMEOUT, max(timeout / 2, 0.1))

    async def one(inst: RentedInstance) -> Account:
        try:
            return await account_of(inst)
        except Exception as e:  # a bug's, or an answer nobody foresaw: said as such, never as a timeout
            words = (
                f"{stage_name(inst.stage)} is unknown: its account failed ({type(e).__name__}: {redact.text(str(e))})"
            )
            log.warning("%s", words)
            return Account(inst.stage, "unknown", words=words)

    async def account_of(inst: RentedInstance) -> Account:
        why = "the orchestrator had no cluster"
        if "joined" not in inst.timeline:  # nothing to ask over the cluster: vast.ai's word alone
            why = "it never joined the cluster"
        elif seed is not None and inst.endpoint_id:
            got = await ask(seed, inst, redact, ask_for)
            if isinstance(got, Account):
                if got.source is None:  # it answered without its lines: vast.ai's are the next best
                    got.lines, got.source, note = await vast_tail(rental, inst, redact)
                    got.words += note
                return got
            why = got
        return await from_vast(rental, inst, redact, why)

    rented = [i for i in rental.current if i.id is not None]
    tasks = {i.stage: asyncio.ensure_future(one(i)) for i in rented}
    try:
        if tasks:
            await asyncio.wait(tasks.values(), timeout=max(timeout, 0.1))
    except BaseException:  # cancelled (a Ctrl-C, a timeout around us): no ask outlives the gathering
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        raise
    out: dict[int, Account] = {}
    for stage, task in tasks.items():
        if task.done() and not task.cancelled() and task.exception() is None:
            out[stage] = task.result()
            continue
        task.cancel()
        error = "" if not task.done() or task.cancelled() else f" ({type(task.exception()).__name__})"
        words = f"{stage_name(stage)} is unknown: its account was not complete within {timeout:.0f} s{error}"
        out[stage] = Account(stage, "unknown", words=words)
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    return out


def failure_words(accounts: dict[int, Account], said: str = "") -> str:
    """What the failure's message adds: every node not simply answering, in its own words, and
    where the tails are; "" when every node answered. A dead node whose instance's state the
    failure (``said``) already reports, from the same vast.ai record, is not named twice."""
    named = [a.words for _, a in sorted(accounts.items()) if a.state not in QUIET and not _told(a, said)]
    if not named:
        return f" (each node's log tail: {WHERE})" if any(a.state not in QUIET for a in accounts.values()) else ""
    return "; " + "; ".join(named) + f" (each node's log tail: {WHERE})"


def _told(account: Account, said: str) -> bool:
    """``said`` already names the node's stage and vast.ai's state of its instance."""
    if account.state != "dead" or not re.search(rf"\b{stage_name(account.stage)}\b", said):
        return False
    return account.shown is not None and f"vast.ai reports the instance {account.shown}" in said

"""Admitting endpoint ids to a running cluster, by the orchestrator's word alone.

Every node admits only the ids in its allowlist, fixed when it was created. When the harness
replaces an instance with a new one (a new key, so a new id), the nodes created before it do not
know the new id. The orchestrator, the seed, then signs an :class:`Admission` with its own key and
sends it to every member (``codec.Admit``); a node applies it only if the signature verifies
against the seed's id, which it was given at creation, and if its number is newer than the last
one it applied. A member's authenticated connection is not enough: a compromised stage could
otherwise admit whoever it likes.

An admission is cumulative: the latest carries every id admitted and revoked in this run so far,
so one message brings any node up to date, however many it missed.

    a = sign(seed_key, 1, admitted=[new_id], revoked=[old_id])
    verify(seed_id, a)  # AdmissionRefused, naming why, if it is not the seed's
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import iroh

from .codec import ActorAddress, Admit, MemberStatus, Message
from .errors import RemoteError
from .swim import MemberEvent, Membership

log = logging.getLogger(__name__)

# What is signed starts with this, so that the seed's signature over anything else (another
# message type, a later version of this one) can never be read as an admission.
DOMAIN = b"ppsmoke-admission-v1\0"
_U64 = struct.Struct(">Q")
_U32 = struct.Struct(">I")
_HEX = frozenset("0123456789abcdef")


class AdmissionRefused(ValueError):
    """An admission that a node does not apply; the message says why."""


@dataclass(frozen=True)
class Admission:
    """Every id the orchestrator admitted and revoked so far in this run, under ``seq`` (which
    grows with each new admission), and the seed's ed25519 signature over them. The ids are
    sorted and unique, and no id is in both lists: one admission has one encoding."""

    seq: int
    admitted: tuple[str, ...]
    revoked: tuple[str, ...]
    signature: bytes

    def __repr__(self) -> str:
        return f"Admission(seq={self.seq}, admitted={_short(self.admitted)}, revoked={_short(self.revoked)})"

    def message(self) -> Admit:
        return Admit(self.seq, self.admitted, self.revoked, self.signature)

    @classmethod
    def from_message(cls, msg: Admit) -> Admission:
        return cls(msg.seq, tuple(msg.admitted), tuple(msg.revoked), bytes(msg.signature))


def canonical_ids(ids: Iterable[str]) -> tuple[str, ...]:
    """Endpoint ids lower-cased, unique and sorted; ValueError names one that is not an id."""
    out = set()
    for i in ids:
        if not isinstance(i, str) or len(i) != 64 or not set(i.lower()) <= _HEX:
            raise ValueError(f"not an endpoint id (64 hex characters): {i!r}")
        out.add(i.lower())
    return tuple(sorted(out))


def signed_bytes(seq: int, admitted: Iterable[str], revoked: Iterable[str]) -> bytes:
    """What the seed signs: the domain, the number, then each list as a count and its raw 32-byte
    ids in order. Fixed widths, so no two admissions share an encoding."""
    parts = [DOMAIN, _U64.pack(seq)]
    for ids in (tuple(admitted), tuple(revoked)):
        parts.append(_U32.pack(len(ids)))
        parts.extend(bytes.fromhex(i) for i in ids)
    return b"".join(parts)


def sign(secret_key: bytes, seq: int, admitted: Iterable[str], revoked: Iterable[str]) -> Admission:
    """The admission numbered ``seq`` (from 1), signed with ``secret_key`` (the seed's)."""
    if not isinstance(seq, int) or not 1 <= seq < 1 << 64:
        raise ValueError(f"admission number must be an int in [1, 2**64), got {seq!r}")
    adm, rev = canonical_ids(admitted), canonical_ids(revoked)
    both = set(adm) & set(rev)
    if both:
        raise ValueError(f"ids both admitted and revoked: {_short(sorted(both))}")
    signature = iroh.SecretKey.from_bytes(secret_key).sign(signed_bytes(seq, adm, rev)).to_bytes()
    return Admission(seq, adm, rev, bytes(signature))


def verify(seed_id: str, a: Admission) -> None:
    """Raise :class:`AdmissionRefused`, naming why, unless ``a`` is canonical and signed by the
    key of ``seed_id``."""
    if not 1 <= a.seq < 1 << 64:
        raise AdmissionRefused(f"admission number {a.seq} is out of range")
    for name, ids in (("admitted", a.admitted), ("revoked", a.revoked)):
        try:
            canonical = canonical_ids(ids)
        except ValueError as e:
            raise AdmissionRefused(f"admission {a.seq}: {name}: {e}") from None
        if canonical != tuple(ids):
            raise AdmissionRefused(f"admission {a.seq}: its {name} ids are not sorted and unique")
    if set(a.admitted) & set(a.revoked):
        raise AdmissionRefused(f"admission {a.seq} both admits and revokes an id")
    try:
        key = iroh.EndpointId.from_string(seed_id)
    except iroh.IrohError:
        raise AdmissionRefused(f"the seed id {seed_id[:16]!r} is not an endpoint id") from None
    try:
        key.verify(signed_bytes(a.seq, a.admitted, a.revoked), iroh.Signature.from_bytes(a.signature))
    except iroh.IrohError:
        raise AdmissionRefused(
            f"admission {a.seq}: the signature does not verify against the seed {seed_id[:10]}: "
            "not signed by the orchestrator, or altered on the way"
        ) from None


def _short(ids: Iterable[str]) -> list[str]:
    return [i[:10] for i in ids]


class Allowlist(Protocol):
    allowed: set[str] | None

    def allow(self, peer_ids: Iterable[str]) -> None: ...
    def revoke(self, peer_id: str) -> None: ...


class Host(Protocol):
    """What admissions need of the node they run on (``runtime.node.Node`` is one)."""

    @property
    def id(self) -> str: ...
    @property
    def transport(self) -> Allowlist: ...
    @property
    def membership(self) -> Membership: ...
    def address(self, actor: str, node: str | None = None) -> ActorAddress: ...
    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None: ...
    async def request(
        self, to: ActorAddress, msg: Message, timeout: float | None = None, *, sender: str = ""
    ) -> Message: ...


class Admissions:
    """A node's admissions: the latest one applied here (on every node), and on the orchestrator
    its delivery to every member, with who acknowledged it.

    ``actor``: the actor that takes ``Admit`` on every node; ``deliver_for``: how long the
    orchestrator keeps offering an admission to a member that does not answer;
    ``request_timeout``: one offer's wait for its answer."""

    def __init__(self, node: Host, seed_id: str, actor: str, *, deliver_for: float, request_timeout: float) -> None:
        self.node = node
        self.seed_id = seed_id
        self.actor = actor
        self.deliver_for = deliver_for
        self.request_timeout = request_timeout
        self.latest: Admission | None = None
        self.acked: dict[str, int] = {}  # member -> the latest admission number it acknowledged
        self._last: dict[str, str] = {}  # member -> what its delivery last saw, for a timeout's message
        self._delivering: set[str] = set()
        self._publishing = False
        self._changed = asyncio.Event()

    # --- every node --------------------------------------------------------------------------

    def apply(self, a: Admission) -> bool:
        """Apply ``a`` if it is the seed's and newer than the last one applied here: admit its
        ids, revoke the others (never this node's or the seed's) and expel them from membership.
        True if it changed anything, False if it is the one already applied (an offer repeated
        because our answer was lost). :class:`AdmissionRefused` otherwise."""
        verify(self.seed_id, a)
        cur = self.latest
        if cur is not None and a.seq <= cur.seq:
            if a == cur:
                return False
            raise AdmissionRefused(f"admission {a.seq} is not newer than the one applied here ({cur.seq}): a replay")
        self.latest = a
        keep = {self.node.id, self.seed_id}
        allowed = self.node.transport.allowed
        added = [] if allowed is None else [i for i in a.admitted if i not in allowed]  # no allowlist: all were in
        self.node.transport.allow(a.admitted)
        for i in a.revoked:
            if i not in keep:
                self.node.transport.revoke(i)
                self.node.membership.expel(i)
        log.info(
            "admission %d applied: %d ids admitted (%d new here), %d revoked",
            a.seq,
            len(a.admitted),
            len(added),
            len(a.revoked),
        )
        if added and self.seed_id != self.node.id:
            # members we dropped while their ids were unknown to us: the seed's full state has them
            self.node.spawn(self._catch_up())
        self._changed.set()
        return True

    async def _catch_up(self) -> None:
        try:
            await self.node.membership.push_pull(self.seed_id, self.request_timeout)
        except (TimeoutError, ConnectionError, RemoteError) as e:
            log.info("push-pull with the seed after an admission failed: %s (the periodic one repairs it)", e)

    # --- the orchestrator --------------------------------------------------------------------

    def publish(self, a: Admission) -> None:
        """Apply ``a`` here, then offer it to every member not dead, and from now on to every
        member that joins (or comes back), until each acknowledges it or ``deliver_for`` ends."""
        self.apply(a)
        if not self._publishing:
            self._publishing = True
            self.node.membership.add_listener(self._on_member)
        for m in self.node.membership.alive():
            if m.id != self.node.id:
                self._offer(m.id)

    def _on_member(self, ev: MemberEvent) -> None:
        if ev.kind in ("joined", "alive") and ev.member.id != self.node.id:
            self._offer(ev.member.id)

    def _offer(self, member: str) -> None:
        if self.latest is None or self.acked.get(member, 0) >= self.latest.seq or member in self._delivering:
            return  # acknowledged, or a delivery is under way, which sends the latest each time
        self._delivering.add(member)
        self.node.spawn(self._deliver(member))

    async def _deliver(self, member: str) -> None:
        deadline = time.monotonic() + self.deliver_for
        delay = 0.1
        try:
            while (a := self.latest) is not None and self.acked.get(member, 0) < a.seq:
                m = self.node.membership.get(member)
                if m is None or m.status == MemberStatus.dead:
                    self._last[member] = "it is dead in this node's membership (offered again if it comes back)"
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning(
                        "member %s did not take admission %d within %.3g s: %s",
                        member[:10],
                        a.seq,
                        self.deliver_for,
                        self._last.get(member),
                    )
                    return
                try:
                    await self.node.request(
                        self.node.address(self.actor, member), a.message(), min(left, self.request_timeout)
                    )
                except RemoteError as e:
                    self._last[member] = f"refused: {e}"
                    if e.kind == AdmissionRefused.__name__:
                        log.warning("member %s refused admission %d: %s", member[:10], a.seq, e)
                        return
                except (TimeoutError, ConnectionError) as e:
                    self._last[member] = str(e)
                else:
                    self.acked[member] = max(self.acked.get(member, 0), a.seq)
                    self._last[member] = f"acknowledged admission {a.seq}"
                    self._changed.set()
                    continue
                await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 2.0)
        finally:
            self._delivering.discard(member)
            self._changed.set()

    async def acknowledged(self, member: str, timeout: float) -> None:
        """Wait until ``member`` has acknowledged the latest admission (at once if there is none,
        or for this node itself), or raise TimeoutError saying what its delivery last saw."""
        deadline = time.monotonic() + timeout
        while (a := self.latest) is not None and member != self.node.id and self.acked.get(member, 0) < a.seq:
            left = deadline - time.monotonic()
            if left <= 0:
                seen = self._last.get(member, "not offered yet: it has not been alive in this node's membership")
                raise TimeoutError(
                    f"member {member[:10]} did not acknowledge admission {a.seq} within {timeout:.3g} s; last: {seen}"
                )
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    def next(self, secret_key: bytes, admitted: Iterable[str], revoked: Iterable[str]) -> Admission:
        """The next cumulative admission: the latest's ids with ``admitted`` and ``revoked`` on
        top (an id named now moves to the list it is named in), numbered one more, signed."""
        adm, rev = set(canonical_ids(admitted)), set(canonical_ids(revoked))
        if adm & rev:
            raise ValueError(f"ids both admitted and revoked: {_short(sorted(adm & rev))}")
        if self.node.id in rev:
            raise ValueError("the seed cannot revoke its own id")
        prev = self.latest
        all_adm = (set(prev.admitted if prev else ()) - rev) | adm
        all_rev = (set(prev.revoked if prev else ()) - adm) | rev
        return sign(secret_key, (prev.seq if prev else 0) + 1, all_adm, all_rev)

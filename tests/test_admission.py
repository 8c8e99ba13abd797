"""Admissions: the orchestrator admits a new endpoint id (and revokes the one it replaces) over the
cluster, without a restart; a node applies only the seed's signature, and only a newer number.
The records and their signature alone, then real iroh nodes in one process on loopback."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

import iroh
import pytest

from pytest_ppsmoke.runtime import admission, codec
from pytest_ppsmoke.runtime.admission import Admission, AdmissionRefused, sign, verify
from pytest_ppsmoke.runtime.codec import ActorAddress, Echo, Envelope, MemberStatus
from pytest_ppsmoke.runtime.node import NODE_ACTOR, Node, NodeConfig, RemoteError
from pytest_ppsmoke.runtime.swimconfig import SwimConfig
from pytest_ppsmoke.runtime.transport import endpoint_id, new_secret_key

pytestmark = pytest.mark.local

WAIT = 30.0  # seconds: a generous deadline for anything the cluster must do; never asserted on
NAME = "pp-stage-1"

Start = Callable[..., Any]  # the ``nodes`` fixture: start(config, join=True) -> Node


def keys_by_id(n: int) -> list[bytes]:
    """``n`` secret keys, their ids in increasing order (the registry's winner is the smallest)."""
    return sorted((new_secret_key() for _ in range(n)), key=endpoint_id)


def config(
    key: bytes, allowed: Iterable[bytes], seed: Node | None = None, swim: SwimConfig | None = None
) -> NodeConfig:
    return NodeConfig(
        secret_key=key,
        allowed=frozenset(endpoint_id(k) for k in allowed),
        seed=seed.ticket() if seed is not None else None,
        admission_timeout=WAIT,
        swim=swim or SwimConfig.loopback(),
    )


def alive_in(node: Node, member: str) -> bool:
    m = node.membership.get(member)
    return m is not None and m.status == MemberStatus.alive


async def until_alive(node: Node, member: str) -> None:
    await node.membership.wait_until(lambda: alive_in(node, member), WAIT, f"{member[:10]} alive at {node}")


async def offer(sender: Node, to: Node, a: Admission) -> codec.Message:
    return await sender.request(sender.address(NODE_ACTOR, to.id), a.message(), timeout=WAIT)


class Named:
    """An actor that answers Echo: what a stage's name resolves to."""

    def on_echo(self, msg: Echo, ctx: object) -> Echo:
        return Echo(b"stage:" + msg.payload)


# --- the records -------------------------------------------------------------------------------


def test_a_signed_admission_verifies_against_the_seed_and_nothing_else() -> None:
    seed_key, other_key = new_secret_key(), new_secret_key()
    new, old = endpoint_id(new_secret_key()), endpoint_id(new_secret_key())
    a = sign(seed_key, 3, [new.upper(), new], [old])
    assert (a.seq, a.admitted, a.revoked) == (3, (new,), (old,))  # canonical: lower case, unique, sorted
    verify(endpoint_id(seed_key), a)
    with pytest.raises(AdmissionRefused, match="does not verify against the seed"):
        verify(endpoint_id(other_key), a)
    forged = sign(other_key, 3, [new], [old])
    with pytest.raises(AdmissionRefused, match="does not verify against the seed"):
        verify(endpoint_id(seed_key), forged)


def test_any_change_to_a_signed_admission_fails_verification() -> None:
    seed_key = new_secret_key()
    seed_id = endpoint_id(seed_key)
    ids = sorted(endpoint_id(new_secret_key()) for _ in range(3))
    a = sign(seed_key, 2, ids[:1], ids[1:2])
    for changed in (
        dataclasses.replace(a, admitted=tuple(sorted(ids[:1] + ids[2:]))),  # one more id admitted
        dataclasses.replace(a, admitted=ids[2:3]),  # another id instead
        dataclasses.replace(a, revoked=()),  # the revocation dropped
        dataclasses.replace(a, seq=3),  # renumbered
        dataclasses.replace(a, signature=a.signature[:-1] + bytes([a.signature[-1] ^ 1])),
    ):
        with pytest.raises(AdmissionRefused, match="does not verify"):
            verify(seed_id, changed)
    with pytest.raises(AdmissionRefused, match="not sorted and unique"):
        verify(seed_id, dataclasses.replace(a, admitted=(ids[0], ids[0])))
    with pytest.raises(AdmissionRefused, match="both admits and revokes"):
        verify(seed_id, dataclasses.replace(a, admitted=ids[1:2]))


def test_the_signature_covers_a_domain_so_a_signature_over_other_bytes_is_no_admission() -> None:
    """The seed's key signs nothing else today; if it ever does, that signature over the same
    numbers and ids without the domain still is no admission."""
    seed_key = new_secret_key()
    ids = [endpoint_id(new_secret_key())]
    payload = admission.signed_bytes(1, ids, [])
    assert payload.startswith(admission.DOMAIN)
    bare = iroh.SecretKey.from_bytes(seed_key).sign(payload[len(admission.DOMAIN) :]).to_bytes()
    with pytest.raises(AdmissionRefused, match="does not verify"):
        verify(endpoint_id(seed_key), Admission(1, tuple(ids), (), bytes(bare)))


def test_an_admission_crosses_the_wire_unchanged_and_shows_no_signature() -> None:
    seed_key = new_secret_key()
    a = sign(seed_key, 7, [endpoint_id(new_secret_key())], [endpoint_id(new_secret_key())])
    env = Envelope(NODE_ACTOR, "", 9, False)
    got_env, msg = codec.decode_frame(bytes(codec.encode_frame(env, a.message())))
    assert got_env == env and isinstance(msg, codec.Admit) and codec.MESSAGE_TYPES[24] is codec.Admit
    assert Admission.from_message(msg) == a
    verify(endpoint_id(seed_key), Admission.from_message(msg))
    assert a.signature.hex() not in repr(a) and seed_key.hex() not in repr(a)
    with pytest.raises(ValueError, match="not an endpoint id"):
        sign(seed_key, 1, ["nope"], [])
    with pytest.raises(ValueError, match="admission number"):
        sign(seed_key, 0, [], [])


# --- real nodes --------------------------------------------------------------------------------


async def test_a_new_id_admitted_by_the_seed_joins_takes_the_old_ones_name_and_is_reachable(
    nodes: Start, caplog: pytest.LogCaptureFixture
) -> None:
    """The replacement: the seed and A know the old B (which runs and holds the stage's name), not
    B2. The seed admits B2 and revokes B; B2 joins; A sees it, resolves the name to it, reaches
    it, and no longer hears B."""
    seed_key, a_key = new_secret_key(), new_secret_key()
    b_key, b2_key = keys_by_id(2)  # B's id sorts first: had B kept its claim, the name would stay B's
    old = [seed_key, a_key, b_key]
    seed = await nodes(config(seed_key, old))
    a = await nodes(config(a_key, old, seed))
    b = await nodes(config(b_key, old, seed))
    b.add_actor("stage", Named())
    b.register(NAME, "stage")
    assert await a.resolve(NAME, WAIT) == ActorAddress(b.id, "stage")
    assert await b.request(b.address(NODE_ACTOR, a.id), Echo(b"before"), timeout=WAIT) == Echo(b"before")

    with caplog.at_level(logging.DEBUG):
        adm = seed.admit([endpoint_id(b2_key)], [b.id])
        await seed.admission_acked(a.id, WAIT)
    assert (adm.seq, adm.admitted, adm.revoked) == (1, (endpoint_id(b2_key),), (b.id,))
    for n in (seed, a):
        assert n.transport.allowed is not None
        assert endpoint_id(b2_key) in n.transport.allowed and b.id not in n.transport.allowed
        assert n.membership.members[b.id].status == MemberStatus.dead
    assert NAME not in a.registry.names()  # B's claim vanished with it
    assert b.id not in seed.transport.peers() and b.id not in a.transport.peers()  # its connections closed
    with pytest.raises((ConnectionError, TimeoutError, RemoteError)):  # A drops what B sends
        await b.request(b.address(NODE_ACTOR, a.id), Echo(b"after"), timeout=3)

    b2 = await nodes(config(b2_key, [seed_key, a_key, b2_key], seed))
    b2.add_actor("stage", Named())
    b2.register(NAME, "stage")
    await until_alive(a, b2.id)
    assert await a.resolve(NAME, WAIT) == ActorAddress(b2.id, "stage")
    assert await a.request(a.address(NODE_ACTOR, b2.id), Echo(b"hi"), timeout=WAIT) == Echo(b"hi")
    assert await a.request(a.address("stage", b2.id), Echo(b"x"), timeout=WAIT) == Echo(b"stage:x")
    await seed.admission_acked(b2.id, WAIT)  # a member that joins later gets it too
    assert b2.admissions.latest == adm
    text = caplog.text
    assert all(k.hex() not in text for k in (seed_key, a_key, b_key, b2_key)), "a secret key was logged"


async def test_an_admission_signed_by_a_member_is_refused_and_changes_nothing(
    nodes: Start, caplog: pytest.LogCaptureFixture
) -> None:
    """A compromised stage holds a member's key and an authenticated connection: its admission,
    however well formed, is not the seed's."""
    keys = [new_secret_key() for _ in range(3)]
    seed = await nodes(config(keys[0], keys))
    a = await nodes(config(keys[1], keys, seed))
    c = await nodes(config(keys[2], keys, seed))
    await until_alive(a, c.id)
    intruder = endpoint_id(new_secret_key())
    before = {n.id: set(n.transport.allowed or ()) for n in (seed, a, c)}
    forged = sign(keys[1], 1000, [intruder], [c.id])  # A's key
    with caplog.at_level(logging.WARNING):
        for target in (c, seed):
            with pytest.raises(RemoteError, match="does not verify against the seed") as info:
                await offer(a, target, forged)
            assert info.value.kind == "AdmissionRefused"
    assert "AdmissionRefused" in caplog.text and keys[1].hex() not in caplog.text
    assert {n.id: set(n.transport.allowed or ()) for n in (seed, a, c)} == before
    assert c.admissions.latest is None and seed.admissions.latest is None
    assert alive_in(seed, c.id) and alive_in(a, c.id)
    with pytest.raises(ValueError, match="only the seed admits"):
        a.admit([intruder])
    # the seed's own first admission is still number 1, and C takes it
    seed.admit([intruder])
    await seed.admission_acked(c.id, WAIT)
    assert c.transport.allowed is not None and intruder in c.transport.allowed


async def test_an_older_admission_replayed_is_refused_and_undoes_nothing(nodes: Start) -> None:
    """The seed admits X (1), then revokes it (2). Admission 1 again, from the seed's own
    connection and signature, is a replay: refused, and X stays revoked. The latest again is
    only acknowledged (the seed repeats an offer whose answer was lost)."""
    keys = [new_secret_key() for _ in range(2)]
    seed = await nodes(config(keys[0], keys))
    a = await nodes(config(keys[1], keys, seed))
    x = endpoint_id(new_secret_key())
    first = seed.admit([x])
    await seed.admission_acked(a.id, WAIT)
    assert a.transport.allowed is not None and x in a.transport.allowed
    second = seed.admit(revoked=[x])
    assert (second.seq, second.admitted, second.revoked) == (2, (), (x,))
    await seed.admission_acked(a.id, WAIT)
    assert x not in a.transport.allowed
    with pytest.raises(RemoteError, match=r"admission 1 is not newer than the one applied here \(2\)") as info:
        await offer(seed, a, first)
    assert info.value.kind == "AdmissionRefused"
    assert x not in a.transport.allowed and a.admissions.latest == second
    assert await offer(seed, a, second) == codec.Ok()
    assert x not in a.transport.allowed and a.admissions.latest == second


async def test_an_admission_altered_on_the_way_is_refused(nodes: Start) -> None:
    keys = [new_secret_key() for _ in range(2)]
    seed = await nodes(config(keys[0], keys))
    a = await nodes(config(keys[1], keys, seed))
    meant, swapped = endpoint_id(new_secret_key()), endpoint_id(new_secret_key())
    good = admission.sign(seed.config.secret_key, 1, [meant], [])
    tampered = dataclasses.replace(good, admitted=(swapped,))
    with pytest.raises(RemoteError, match="does not verify against the seed") as info:
        await offer(seed, a, tampered)
    assert info.value.kind == "AdmissionRefused"
    assert a.transport.allowed is not None and swapped not in a.transport.allowed
    assert a.admissions.latest is None
    assert await offer(seed, a, good) == codec.Ok()  # the admission as signed goes through
    assert meant in a.transport.allowed and swapped not in a.transport.allowed


async def test_no_admission_revokes_the_seed_or_the_node_itself(nodes: Start) -> None:
    keys = [new_secret_key() for _ in range(2)]
    seed = await nodes(config(keys[0], keys))
    a = await nodes(config(keys[1], keys, seed))
    with pytest.raises(ValueError, match="cannot revoke its own id"):
        seed.admit(revoked=[seed.id])
    signed = sign(seed.config.secret_key, 1, [], [seed.id, a.id])  # the seed's key, so it verifies
    assert await offer(seed, a, signed) == codec.Ok()
    assert a.transport.allowed is not None and {seed.id, a.id} <= a.transport.allowed
    assert alive_in(a, seed.id)
    assert await a.request(a.address(NODE_ACTOR, seed.id), Echo(b"still"), timeout=WAIT) == Echo(b"still")


async def test_a_node_that_joins_after_the_admission_with_the_old_allowlist_is_brought_up_to_date(
    nodes: Start,
) -> None:
    """C was created before the replacement (its allowlist has B, not B2) and joins only after
    the admission: the seed hands it the latest admission as it joins, and C then allows B2,
    sees it alive and reaches it. The periodic push-pull is set beyond the test's deadline, so
    C learns B2 only by the admission's own paths: the seed's Admit, sent as C's join is
    merged, goes ahead of the join's answer on the same stream, and an admission of ids new to
    a member is followed by its push-pull with the seed."""
    swim = dataclasses.replace(SwimConfig.loopback(), sync_interval=10 * WAIT)
    seed_key, a_key, b_key, c_key, b2_key = (new_secret_key() for _ in range(5))
    old = [seed_key, a_key, b_key, c_key]
    seed = await nodes(config(seed_key, old, swim=swim))
    a = await nodes(config(a_key, old, seed, swim))
    b2_id = endpoint_id(b2_key)
    adm = seed.admit([b2_id], [endpoint_id(b_key)])
    await seed.admission_acked(a.id, WAIT)
    b2 = await nodes(config(b2_key, [seed_key, a_key, c_key, b2_key], seed, swim))
    await until_alive(a, b2.id)

    c = await nodes(config(c_key, old, seed, swim))
    await seed.admission_acked(c.id, WAIT)
    assert c.admissions.latest == adm
    assert c.transport.allowed is not None
    assert b2_id in c.transport.allowed and endpoint_id(b_key) not in c.transport.allowed
    await until_alive(c, b2.id)
    assert await c.request(c.address(NODE_ACTOR, b2.id), Echo(b"late"), timeout=WAIT) == Echo(b"late")
    await until_alive(b2, c.id)


async def test_waiting_for_an_acknowledgement_has_a_deadline_that_names_the_member(nodes: Start) -> None:
    keys = [new_secret_key() for _ in range(2)]
    seed = await nodes(config(keys[0], keys))
    await seed.admission_acked(endpoint_id(keys[1]), 0.1)  # no admission yet: nothing to wait for
    seed.admit([endpoint_id(new_secret_key())])
    await seed.admission_acked(seed.id, 0.1)  # applied here at once
    missing = endpoint_id(keys[1])
    with pytest.raises(TimeoutError, match=rf"member {missing[:10]} did not acknowledge admission 1 within"):
        await seed.admission_acked(missing, 0.2)

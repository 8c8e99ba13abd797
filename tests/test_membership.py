"""SWIM membership and names across real processes: a seed in the test, members as children."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import pytest_asyncio

from pytest_ppsmoke.runtime.codec import MembersQuery, MemberStatus, MembersView, Resolved, ResolveQuery
from pytest_ppsmoke.runtime.localproc import ChildProcess, ClusterKeys, EventKind, member_env, member_process
from pytest_ppsmoke.runtime.node import NODE_ACTOR, Node, NodeConfig, RemoteError
from pytest_ppsmoke.runtime.registry import NameNotFound
from pytest_ppsmoke.runtime.swim import MemberEvent
from pytest_ppsmoke.runtime.swimconfig import SwimConfig

pytestmark = pytest.mark.local

SUSPICION = 1.5
SWIM = SwimConfig(suspicion_timeout=SUSPICION)
SWIM_ENV = f"suspicion_timeout={SUSPICION}"
NAMES = [["pp-entry", "pp-stage-0"], ["pp-exit", "pp-stage-1"]]
ALL_NAMES = sorted(n for names in NAMES for n in names)


@dataclass
class Cluster:
    seed: Node
    members: list[ChildProcess]
    ids: list[str]  # members' endpoint ids, in order
    events: list[MemberEvent] = field(default_factory=list)

    def seen(self, kind: str, member: str) -> list[MemberEvent]:
        return [e for e in self.events if e.kind == kind and e.member.id == member]

    async def view_of(self, member_id: str) -> tuple[tuple[str, str], ...]:
        reply = await self.seed.request(self.seed.address(NODE_ACTOR, member_id), MembersQuery(), timeout=5)
        assert isinstance(reply, MembersView)
        return tuple(
            sorted((m.id, MemberStatus(m.status).name) for m in reply.members if m.status != MemberStatus.dead)
        )


async def start_cluster(swim: SwimConfig = SWIM, swim_env: str = SWIM_ENV) -> tuple[Cluster, ClusterKeys]:
    keys = ClusterKeys(3)
    seed = Node(NodeConfig(secret_key=keys.keys[0], allowed=frozenset(keys.ids), swim=swim))
    cluster = Cluster(seed, [], keys.ids[1:])
    await seed.start()
    seed.membership.add_listener(cluster.events.append)
    for i, names in enumerate(NAMES):
        env = member_env(keys.keys[i + 1], keys.ids, seed.ticket(), names, swim_env)
        cluster.members.append(member_process(f"member-{i}", env))
    return cluster, keys


async def boot(c: Cluster) -> None:
    for m in c.members:
        await m.start()
    for m in c.members:
        await m.wait_event(lambda e: e.kind is EventKind.READY, 30, "ready line")
    await c.seed.membership.wait_until(lambda: len(c.seed.membership.alive()) == 3, 10, "3 alive members")
    # a member registers its names once joined: they reach the seed with a later gossip
    await c.seed.membership.wait_until(
        lambda: sorted(c.seed.registry.names()) == ALL_NAMES, 10, f"the seed to know the names {ALL_NAMES}"
    )


async def shut(c: Cluster) -> None:
    for m in c.members:
        await m.stop()
    await c.seed.close()


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c, _ = await start_cluster()
    try:
        await boot(c)
        yield c
    finally:
        await shut(c)


async def test_seed_and_two_members_converge_to_the_same_view(cluster: Cluster) -> None:
    expected = tuple(sorted((i, "alive") for i in [cluster.seed.id, *cluster.ids]))
    await cluster.seed.membership.wait_until(lambda: cluster.seed.membership.view() == expected, 5, "all alive")
    for member_id in cluster.ids:
        deadline = time.monotonic() + 5
        while (view := await cluster.view_of(member_id)) != expected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # polling a remote view: no local event to wait on
        assert view == expected, f"{member_id[:10]} sees {view}"
    for i, m in enumerate(cluster.members):
        ready = m.find(lambda e: e.kind is EventKind.READY)
        assert ready is not None and ready["id"] == cluster.ids[i]


async def test_names_resolve_on_every_member(cluster: Cluster) -> None:
    entry, exit_ = cluster.ids
    want = {"pp-entry": entry, "pp-stage-0": entry, "pp-exit": exit_, "pp-stage-1": exit_}
    for name, owner in want.items():
        addr = await cluster.seed.resolve(name, timeout=5)
        assert (addr.node, addr.actor) == (owner, NODE_ACTOR)
        for asker in cluster.ids:  # each member resolves every name, its own and the other's
            reply = await cluster.seed.request(
                cluster.seed.address(NODE_ACTOR, asker), ResolveQuery(name, 5000), timeout=6
            )
            assert isinstance(reply, Resolved) and reply.address.node == owner


async def test_an_unknown_name_fails_at_its_deadline_naming_the_name(cluster: Cluster) -> None:
    # The names known are fixed before the deadline starts (boot waits until the seed knows them
    # all), so the message never depends on what gossip brought within it; the deadline is held from
    # below only, which a busy machine can only make later, never earlier.
    started = time.monotonic()
    with pytest.raises(NameNotFound, match=r"name 'pp-stage-7' did not resolve within 0.5 s; members asked: ") as info:
        await cluster.seed.resolve("pp-stage-7", timeout=0.5)
    assert time.monotonic() - started >= 0.5
    for i in cluster.ids:
        assert i[:10] in str(info.value)
    assert "names known: pp-entry, pp-exit, pp-stage-0, pp-stage-1" in str(info.value)
    with pytest.raises(RemoteError, match="NameNotFound: name 'nope' did not resolve"):
        await cluster.seed.request(cluster.seed.address(NODE_ACTOR, cluster.ids[0]), ResolveQuery("nope", 300), 5)


async def test_a_killed_member_is_declared_dead_and_its_names_vanish(cluster: Cluster) -> None:
    victim = cluster.ids[1]
    killed_at = time.monotonic()
    cluster.members[1].signal(signal.SIGKILL)
    bound = SWIM.detection_bound(3) + 2.0  # confirmed by member-0's own probe; slack for a busy CI box
    await cluster.seed.membership.wait_until(lambda: bool(cluster.seen("dead", victim)), bound, "the victim dead")
    dead = cluster.seen("dead", victim)[0]
    assert dead.at - killed_at <= bound
    assert cluster.seed.registry.lookup("pp-exit") is None
    assert cluster.seed.registry.lookup("pp-stage-1") is None
    assert cluster.seed.registry.lookup("pp-entry") is not None
    survivor = cluster.members[0]
    await survivor.wait_event(
        lambda e: e.kind is EventKind.DEAD and e["member"] == victim, bound, "dead event on member-0"
    )
    # no death before a suspicion ran its time: counted from the first suspicion anywhere, since
    # the seed may learn the death from member-0, whose suspicion began before the seed heard of it
    theirs = survivor.find(lambda e: e.kind is EventKind.SUSPECT and e["member"] == victim)
    first = min([cluster.seen("suspect", victim)[0].at, *([theirs["at"]] if theirs else [])])
    assert dead.at - first >= SUSPICION - 0.05, "declared dead before the suspicion time ran out"
    with pytest.raises(RemoteError, match="NameNotFound: name 'pp-exit'"):
        await cluster.seed.request(cluster.seed.address(NODE_ACTOR, cluster.ids[0]), ResolveQuery("pp-exit", 300), 5)
    assert await cluster.view_of(cluster.ids[0]) == tuple(
        sorted((i, "alive") for i in [cluster.seed.id, cluster.ids[0]])
    )


async def test_a_stopped_member_resumed_within_the_suspicion_time_refutes_and_its_suspicion_never_fires() -> None:
    suspicion = 4.0
    c, _ = await start_cluster(SwimConfig(suspicion_timeout=suspicion), f"suspicion_timeout={suspicion}")
    try:
        await boot(c)
        victim = c.ids[1]
        before = c.seed.membership.members[victim].incarnation
        # events from now on only: on a loaded machine the boot itself can see a suspicion refuted
        suspected, refuted = len(c.seen("suspect", victim)), len(c.seen("alive", victim))
        c.members[1].signal(signal.SIGSTOP)
        # continued as soon as a suspicion is seen: its timer runs from then, so the member has
        # the whole suspicion time to refute however long the probes took to suspect it (the
        # wait's deadline only bounds a machine too loaded to probe at all)
        await c.seed.membership.wait_until(
            lambda: len(c.seen("suspect", victim)) > suspected, 4 * suspicion, "suspicion"
        )
        c.members[1].signal(signal.SIGCONT)
        stopped = c.seen("suspect", victim)[suspected].member.incarnation
        await c.seed.membership.wait_until(lambda: len(c.seen("alive", victim)) > refuted, suspicion, "the refutation")
        assert c.seen("alive", victim)[refuted].member.incarnation > stopped >= before
        await asyncio.sleep(suspicion + 1.0)  # a confirmed suspicion's timer left running would fire by now
        # The refuted suspicion never fires. On 2 loaded cores the resumed process can be starved
        # long enough to be suspected again; a death then is the detector's verdict on the new
        # incarnation, after a suspicion of its own that ran its whole time.
        for dead in c.seen("dead", victim):
            assert dead.member.incarnation > stopped, "the refuted suspicion declared the member dead"
            again = [e for e in c.seen("suspect", victim) if e.member.incarnation == dead.member.incarnation]
            assert again and dead.at - again[0].at >= suspicion - 0.05, (dead, again)
        if not c.seen("dead", victim):  # as on an idle machine: it stays, and so do its names
            assert c.seed.membership.members[victim].status != MemberStatus.dead
            assert c.seed.registry.lookup("pp-exit") is not None
            assert c.members[0].find(lambda e: e.kind is EventKind.DEAD) is None
    finally:
        await shut(c)


async def test_a_process_whose_key_is_not_allowed_cannot_join() -> None:
    c, keys = await start_cluster()
    try:
        stranger_key = ClusterKeys(1)
        env = member_env(stranger_key.keys[0], [*keys.ids, *stranger_key.ids], c.seed.ticket(), ["pp-entry"], SWIM_ENV)
        env["PP_JOIN_TIMEOUT"] = "2"
        stranger = member_process("stranger", env)
        await stranger.start()
        status = await asyncio.wait_for(stranger.proc.wait(), 20)  # type: ignore[union-attr]
        await stranger.stop()
        assert status == 1
        assert "could not join through seed" in stranger.stderr_tail()
        assert c.seed.transport.stats.connections_refused >= 1
        assert stranger_key.ids[0] not in c.seed.membership.members
        assert c.seed.registry.lookup("pp-entry") is None
    finally:
        await c.seed.close()

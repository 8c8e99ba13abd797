"""A cluster node: transport, SWIM membership, the name registry and local actors.

An actor is any object with ``on_<message_type_in_snake_case>(msg, ctx)`` methods (sync or
async). What a handler returns answers a request; what it raises is sent back as an
:class:`~pytest_ppsmoke.runtime.codec.ErrorReply` and raised on the requesting side as :class:`RemoteError`.

    async with Node(NodeConfig.generate()) as node:
        node.add_actor("echo", EchoActor())
        node.register("pp-entry", "echo")
        addr = await node.resolve("pp-entry", timeout=5)
        reply = await node.request(addr, Echo(b"hi"), timeout=1)
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..nodeenv import DEFAULTS, NodeEnv
from . import codec
from .admission import Admission, Admissions
from .codec import (
    ActorAddress,
    Admit,
    Echo,
    Envelope,
    ErrorReply,
    MembersQuery,
    MemberState,
    MembersView,
    Message,
    Ok,
    Register,
    Resolved,
    ResolveQuery,
    UnknownMessageType,
)
from .errors import RemoteError
from .registry import Registry
from .resource import Resource
from .swim import SWIM_ACTOR, Membership
from .swimconfig import SwimConfig
from .transport import PeerAddr, Transport, TransportError, endpoint_id, new_secret_key

log = logging.getLogger(__name__)

NODE_ACTOR = "node"


@dataclass(frozen=True)
class Context:
    """Who sent the message being handled."""

    node: Node
    sender: ActorAddress
    corr: int


@dataclass
class NodeConfig:
    """Everything a node needs. The secret key never appears in a repr, log or report."""

    secret_key: bytes = field(repr=False)
    allowed: frozenset[str] | None = None
    seed: str | None = None
    local: bool = True
    bind_addr: str | None = None  # ip:port the endpoint binds (None: loopback when local, any address when not)
    relay: str | None = None  # internet mode: the relays (None: n0's; "off"; a URL)
    advertise: tuple[str, ...] = ()  # addresses it is reachable at that it cannot see (a NAT's forwarded port)
    # internet mode: the wait for a home relay before the first gossip (a relay that comes later is
    # announced by the address watch, within 2 s; where none can come, as here, the wait is all lost)
    online_timeout: float = 1.5
    swim: SwimConfig = field(default_factory=SwimConfig.loopback)
    join_timeout: float = DEFAULTS.join_timeout
    request_timeout: float = 10.0
    admission_timeout: float = 60.0  # how long the seed keeps offering an admission to a member that does not answer
    max_frame: int = codec.DEFAULT_MAX_FRAME

    @property
    def id(self) -> str:
        return endpoint_id(self.secret_key)

    @classmethod
    def generate(cls, **kw: Any) -> NodeConfig:
        return cls(secret_key=new_secret_key(), **kw)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NodeConfig:
        """The node's settings from its environment (``NodeEnv``: the key, the allowed ids, the
        seed, the network, SWIM overrides, the join deadline)."""
        raw = os.environ if env is None else env
        return cls.from_nodeenv(NodeEnv.from_env(raw), raw)

    @classmethod
    def from_nodeenv(cls, env: NodeEnv, raw: Mapping[str, str] | None = None) -> NodeConfig:
        """``raw``: the variables themselves, for the ones named after the port (``VAST_UDP_PORT_<n>``)."""
        swim = SwimConfig.loopback() if env.transport == "local" else SwimConfig.wan()
        if env.swim:
            swim = swim.with_overrides(env.swim)
        local = env.transport == "local"
        bind = env.bind or (None if local or not env.port else f"0.0.0.0:{env.port}")
        public = None if local else env.public_udp(raw)
        return cls(
            secret_key=env.require("node_key"),
            # wan: the seed dials this node once every instance runs, which a slower host may
            # delay by up to the boot window
            join_timeout=env.join_timeout + (0.0 if local else env.boot_window),
            allowed=frozenset(env.allowed_ids) if env.allowed_ids else None,
            seed=env.seed or None,
            local=local,
            bind_addr=bind,
            relay=env.relay or None,
            advertise=(public,) if public else (),
            swim=swim,
        )


class Node(Resource):
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.transport = Transport(
            config.secret_key,
            on_message=self._on_message,
            on_unknown=self._on_unknown,
            allowed=config.allowed,
            local=config.local,
            bind_addr=config.bind_addr,
            max_frame=config.max_frame,
            relay=config.relay,
            advertise=config.advertise,
        )
        self.id = self.transport.id
        self.actors: dict[str, object] = {}
        self._pending: dict[int, tuple[str, asyncio.Future[Message]]] = {}
        self._corr = itertools.count(1)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.membership: Membership
        self.registry: Registry
        self.seed: PeerAddr | None = PeerAddr.parse(config.seed) if config.seed else None

    def __repr__(self) -> str:
        return f"Node(id={self.id[:10]})"

    async def start(self, join: bool = True) -> None:
        """Bind, start SWIM, and (unless ``join`` is False) join through the seed."""
        await self.transport.start()
        if not self.config.local:  # a home relay, if one answers within the bound, is in the first gossip
            await self.transport.online(self.config.online_timeout)
        me = self.transport.addr()
        self.membership = Membership(self, self.config.swim, me.addrs, me.relay)
        self.registry = Registry(self.membership)
        self.actors[SWIM_ACTOR] = self.membership
        self.actors[NODE_ACTOR] = _NodeActor()
        self.admissions = Admissions(
            self,
            self.seed.id if self.seed is not None else self.id,  # the node without a seed is the seed
            NODE_ACTOR,
            deliver_for=self.config.admission_timeout,
            request_timeout=self.config.request_timeout,
        )
        self.membership.start()
        if not self.config.local:  # announce the addresses again, a new incarnation, as they change
            self.transport.watch_addr(lambda addr: self.membership.set_addrs(addr.addrs, addr.relay))
        if join:
            await self.join()

    async def join(self) -> None:
        """Join through ``config.seed`` (a no-op for the seed itself).

        A seed given with an address (a ticket) is dialled. A seed given by its id alone (on
        vast.ai) is the orchestrator, which may sit behind a NAT that nobody can dial: it dials
        every node itself, at the port vast.ai forwards or through a relay. So the node waits for
        the seed to reach it, then joins over the seed's own connection, and never dials it (an
        early dial by id would find the seed's path once its connection came in, and go through
        the hole that connection punched)."""
        if self.seed is None:
            return
        self.transport.learn(self.seed)
        deadline = time.monotonic() + self.config.join_timeout
        if not (self.seed.addrs or self.seed.relay):
            while not self.transport.reached_by(self.seed.id):
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"the seed {self.seed.id[:10]} did not reach this node within {self.config.join_timeout:.3g} "
                        "s: it dials every node (at the port vast.ai forwards, or through a relay)"
                    )
                await asyncio.sleep(0.05)
        await self.membership.join(self.seed.id, max(0.1, deadline - time.monotonic()))

    async def close(self, leave: bool = True) -> None:
        """Leave the cluster cleanly (members drop us at once), then stop everything. ``leave``
        False: the caller has left already (``membership.leave``), or nobody is left to tell, so
        no farewell waits for an answer that cannot come."""
        if hasattr(self, "membership"):
            await self.membership.stop()
            if leave:
                await self.membership.leave()
        for t in list(self._tasks):
            t.cancel()
        for _, fut in self._pending.values():
            if not fut.done():
                fut.set_exception(TransportError("node closed"))
                fut.exception()  # retrieved here; a waiter still sees it
        self._pending.clear()
        await self.transport.close()

    # --- identity ----------------------------------------------------------------------------

    def ticket(self) -> str:
        """What other nodes need to reach this one with no discovery (``NodeEnv.seed`` on loopback)."""
        return self.transport.ticket()

    def address(self, actor: str, node: str | None = None) -> ActorAddress:
        return ActorAddress(node or self.id, actor)

    def learn(self, m: MemberState) -> None:
        self.transport.learn(PeerAddr(m.id, m.addrs, m.relay))

    # --- admissions (the orchestrator's) ---------------------------------------------------

    def admit(self, admitted: Iterable[str] = (), revoked: Iterable[str] = ()) -> Admission:
        """Admit ``admitted`` and revoke ``revoked`` cluster-wide, without a restart: the next
        cumulative admission, signed with this node's key, applied here at once and offered to
        every member in the background (and to each member that joins later), until it answers
        or ``config.admission_timeout`` ends (:meth:`admission_acked` waits for one). Only the
        seed admits: the members verify the signature against the seed's id."""
        if self.seed is not None:
            raise ValueError(f"only the seed admits ids; this node joined through {self.seed.id[:10]}")
        a = self.admissions.next(self.config.secret_key, admitted, revoked)
        self.admissions.publish(a)
        return a

    async def admission_acked(self, member_id: str, timeout: float) -> None:
        """Wait until ``member_id`` has acknowledged the latest admission; TimeoutError says what
        its delivery last saw."""
        await self.admissions.acknowledged(member_id, timeout)

    # --- actors and names --------------------------------------------------------------------

    def add_actor(self, name: str, actor: object) -> ActorAddress:
        if name in self.actors:
            raise ValueError(f"actor {name!r} already exists on this node")
        self.actors[name] = actor
        return self.address(name)

    def register(self, name: str, actor: str) -> None:
        if actor not in self.actors:
            raise ValueError(f"cannot register {name!r}: no local actor {actor!r} (have {sorted(self.actors)})")
        self.registry.register(name, actor)

    async def resolve(self, name: str, timeout: float) -> ActorAddress:
        return await self.registry.resolve(name, timeout)

    # --- messaging ---------------------------------------------------------------------------

    async def send(self, to: ActorAddress, msg: Message, *, sender: str = "", timeout: float | None = None) -> None:
        """One-way message; returns once the frame is written (not once it is handled)."""
        await self._send(to, Envelope(to.actor, sender, 0, False), msg, timeout)

    def send_nowait(self, to: ActorAddress, msg: Message, timeout: float, sender: str = "") -> None:
        """Fire and forget; failures are logged at debug level."""

        async def go() -> None:
            try:
                await self.send(to, msg, sender=sender, timeout=timeout)
            except ConnectionError as e:
                log.debug("send of %s to %s failed: %s", type(msg).__name__, to, e)

        self.spawn(go())

    async def request(
        self, to: ActorAddress, msg: Message, timeout: float | None = None, *, sender: str = ""
    ) -> Message:
        """Send ``msg`` and wait for the reply, at most ``timeout`` seconds (TimeoutError names both)."""
        timeout = self.config.request_timeout if timeout is None else timeout
        corr = next(self._corr)
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[corr] = (to.node, fut)
        try:
            async with asyncio.timeout(timeout):
                await self._send(to, Envelope(to.actor, sender, corr, False), msg, timeout)
                return await fut
        except TimeoutError:
            raise TimeoutError(f"no reply from {to} to {type(msg).__name__} within {timeout:.3g} s") from None
        finally:
            self._pending.pop(corr, None)

    async def _send(self, to: ActorAddress, env: Envelope, msg: Message, timeout: float | None) -> None:
        if to.node == self.id:
            self._dispatch(self.id, env, msg)
            return
        frame = codec.encode_frame(env, msg)
        await self.transport.send_frame(to.node, frame, self.config.request_timeout if timeout is None else timeout)

    def frame_counts(self) -> dict[int, tuple[int, int]]:
        """Frames this node has sent and received over the wire so far, by message type code:
        ``{code: (sent, received)}``. A message to an actor on this node is no frame and is not
        counted."""
        sent, received = self.transport.stats.sent_by_type, self.transport.stats.received_by_type
        return {code: (sent[code], received[code]) for code in sent.keys() | received.keys()}

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` in the background; it is cancelled when the node closes."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- receiving ---------------------------------------------------------------------------

    def _on_message(self, peer: str, env: Envelope, msg: Message) -> None:
        self._dispatch(peer, env, msg)

    def _on_unknown(self, peer: str, err: UnknownMessageType) -> None:
        if err.envelope is not None and err.envelope.corr and not err.envelope.reply:
            self._reply(peer, err.envelope, ErrorReply("unknown_message", str(err)))

    def _dispatch(self, peer: str, env: Envelope, msg: Message) -> None:
        if env.reply:
            entry = self._pending.get(env.corr)
            if entry is None or entry[0] != peer or entry[1].done():
                late = getattr(self.actors.get(env.to_actor), "on_late_reply", None) if entry is None else None
                if late is not None and not isinstance(msg, ErrorReply):
                    # the requester gave up; an actor that asks for them still gets the news
                    late(msg, Context(self, ActorAddress(peer, env.from_actor), env.corr))
                    return
                log.debug("late or stray reply %s from %s", type(msg).__name__, peer[:10])
                return
            fut = entry[1]
            if isinstance(msg, ErrorReply):
                fut.set_exception(RemoteError(ActorAddress(peer, env.from_actor), msg.kind, msg.message))
            else:
                fut.set_result(msg)
            return
        actor = self.actors.get(env.to_actor)
        if actor is None:
            self._fail(peer, env, "unknown_actor", f"no actor {env.to_actor!r} on node {self.id[:10]}")
            return
        handler = getattr(actor, handler_name(type(msg)), None)
        if handler is None:
            self._fail(peer, env, "unhandled_message", f"actor {env.to_actor!r} does not handle {type(msg).__name__}")
            return
        ctx = Context(self, ActorAddress(peer, env.from_actor), env.corr)
        try:
            result = handler(msg, ctx)
        except Exception as e:
            self._fail(peer, env, type(e).__name__, str(e))
            return
        if inspect.isawaitable(result):
            self.spawn(self._finish(peer, env, result))
        elif env.corr:
            self._reply(peer, env, result if result is not None else Ok())

    async def _finish(self, peer: str, env: Envelope, pending: Any) -> None:
        try:
            result = await pending
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._fail(peer, env, type(e).__name__, str(e))
            return
        if env.corr:
            self._reply(peer, env, result if result is not None else Ok())

    def _fail(self, peer: str, env: Envelope, kind: str, message: str) -> None:
        log.warning("%s from %s to %r: %s", kind, peer[:10], env.to_actor, message)
        if env.corr:
            self._reply(peer, env, ErrorReply(kind, message))

    def _reply(self, peer: str, env: Envelope, msg: Message) -> None:
        reply = Envelope(env.from_actor, env.to_actor, env.corr, True)
        if peer == self.id:
            self._dispatch(peer, reply, msg)
            return
        try:
            frame = codec.encode_frame(reply, msg)
        except codec.FrameError as e:  # a handler returned something that cannot go on the wire
            log.error("actor %r returned a reply that cannot be encoded: %s", env.to_actor, e)
            frame = codec.encode_frame(reply, ErrorReply("bad_reply", f"the reply could not be encoded: {e}"))
        self.spawn(self._send_reply(peer, frame))

    async def _send_reply(self, peer: str, frame: bytearray) -> None:
        try:
            await self.transport.send_frame(peer, frame, self.config.request_timeout)
        except ConnectionError as e:
            log.debug("reply to %s failed: %s", peer[:10], e)


class _NodeActor:
    """What every node offers: its membership view, name resolution, echo, and the orchestrator's
    admissions."""

    def on_members_query(self, msg: MembersQuery, ctx: Context) -> MembersView:
        return MembersView(tuple(ctx.node.membership.members.values()))

    async def on_resolve_query(self, msg: ResolveQuery, ctx: Context) -> Resolved:
        # the asker chooses the wait, within this node's own request deadline
        return Resolved(await ctx.node.resolve(msg.name, min(msg.timeout_ms / 1000, ctx.node.config.request_timeout)))

    def on_register(self, msg: Register, ctx: Context) -> Ok:
        ctx.node.register(msg.name, msg.actor)
        return Ok()

    def on_echo(self, msg: Echo, ctx: Context) -> Echo:
        return msg

    def on_admit(self, msg: Admit, ctx: Context) -> Ok:
        # a refusal (AdmissionRefused) is raised: logged with its reason, answered as an error
        ctx.node.admissions.apply(Admission.from_message(msg))
        return Ok()


def handler_name(message_type: type) -> str:
    """The actor method that handles ``message_type``: ``on_`` and its name in snake case."""
    return "on_" + re.sub(r"(?<!^)(?=[A-Z])", "_", message_type.__name__).lower()

"""The node's environment: the one place that names its variables and their defaults.

A rented instance is configured by environment only (the create call's ``env``); so are the
nodes that ``LocalCluster`` and the emulator start, the bare members of the tests, and the
tinygrad worker a node starts. Every writer builds a :class:`NodeEnv` and calls ``to_env()``;
every reader calls ``NodeEnv.from_env()``::

    env = NodeEnv(stage=1, num_stages=2, seed=ticket, node_key=key).to_env()   # the orchestrator
    node = NodeEnv.from_env()                                                  # pp-gpu-node

``to_env()`` writes the fields that differ from their defaults; ``from_env()`` reads every
variable (an empty one counts as unset), checks it, and raises ValueError naming the variable
and the form it expects. The secret fields (``node_key``, ``container_api_key``) never appear in a
repr or an error message. The table of variables, with who sets each: ``docs/nodeenv.md``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import checks, failpoints
from .protocol import WIRE_DTYPES

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TRANSPORTS = ("local", "wan")
REFERENCES = ("beside", "after")
WORKER_ROLES = ("stage", "reference")
_HEX64 = re.compile(r"[0-9a-f]{64}")
# the longest value one variable carries: a create's env on vast.ai takes at most 256 characters a
# value (its ``x-input-validation``; tests/test_createlimits.py holds the two equal). A list that is
# longer (a cluster's endpoint ids: 65 characters each) continues in numbered variables (``spill``)
VALUE_MAX = 256


# --- the forms of the variables: checks.Check, as the settings table's options use them ---------


def _key_from_hex(raw: str) -> bytes:
    key = bytes.fromhex(raw)  # ValueError: not hex
    if len(key) != 32:
        raise ValueError(raw)
    return key


def _endpoint_ids(ids: tuple[str, ...]) -> bool:
    bad = next((i for i in ids if not _HEX64.fullmatch(i)), None)
    if bad is not None:
        raise checks.Invalid(f"entry {bad!r} is not an endpoint id (64 hex characters)")
    return True


def _failpoint_setting(text: str) -> bool:
    try:
        failpoints.parse(text)
    except ValueError as e:
        raise checks.Invalid(f"is not a failpoint setting: {e}") from None
    return True


TEXT = checks.text()
SECONDS = checks.numbers(above=0, expected="a positive number of seconds")
FLAG = checks.switch("1", "0")
KEY = checks.Check(
    "64 hex characters (a 32-byte key)",
    _key_from_hex,
    lambda key: len(key) == 32,
    types=(bytes,),
    show=bytes.hex,
    secret=True,
)
# what vast.ai's host agent sets: read stripped, as every string vast.ai serves is padded (a key
# with a newline would be refused by the API; an address with one, by iroh)
SECRET = checks.Check("a key", str.strip, secret=True)
AGENT_TEXT = checks.Check("text", str.strip)
IDS = checks.Check(
    "endpoint ids, comma-separated",
    lambda raw: tuple(i.lower() for i in checks.items(raw)),
    _endpoint_ids,
    types=(tuple,),
    show=",".join,
)
NAMES = checks.Check("names, comma-separated", checks.items, types=(tuple,), show=",".join)
FAILPOINTS = checks.Check("name[=value] items, ';'-separated", str, _failpoint_setting)

ORCHESTRATOR = "the orchestrator"
AGENT = "vast.ai's host agent; the emulator"


@dataclass(frozen=True)
class Var:
    """One variable of the contract: its name, its form, what it means and who sets it."""

    name: str
    form: checks.Check[Any]
    doc: str
    by: str
    spill: bool = False  # a list longer than VALUE_MAX continues in NAME_1, NAME_2, ... (split between items)

    def write(self, value: Any) -> dict[str, str]:
        """The variables that carry ``value``: its name alone, or, for a spilled list, its name and
        as many numbered ones as it takes, each at most :data:`VALUE_MAX` characters."""
        text = "" if value is None else self.form.show(value)
        if not self.spill or len(text) <= VALUE_MAX:
            return {self.name: text}
        chunks: list[list[str]] = [[]]
        for item in value:
            if len(item) > VALUE_MAX:
                raise ValueError(f"{self.name}: an item of {len(item)} characters is over {VALUE_MAX}")
            if chunks[-1] and len(self.form.show((*chunks[-1], item))) > VALUE_MAX:
                chunks.append([])
            chunks[-1].append(item)
        return {self.continued(n): self.form.show(tuple(c)) for n, c in enumerate(chunks)}

    def continued(self, n: int) -> str:
        """The variable of a spilled list's ``n``-th part: its own name for the first, then NAME_1, ..."""
        return f"{self.name}_{n}" if n else self.name

    def raw(self, env: Mapping[str, str]) -> str:
        """What ``env`` sets for it ("" for unset); a spilled list's parts joined, from its own
        variable through each numbered one up to the first that is unset."""
        text = env.get(self.name, "")
        if not self.spill or not text:
            return text
        parts, n = [text], 1
        while env.get(self.continued(n), ""):
            parts.append(env[self.continued(n)])
            n += 1
        return ",".join(parts)


def _var(
    default: Any, name: str, form: checks.Check[Any], doc: str, by: str = ORCHESTRATOR, *, spill: bool = False
) -> Any:
    return field(default=default, repr=not form.secret, metadata={"var": Var(name, form, doc, by, spill)})


@dataclass(frozen=True)
class NodeEnv:
    """Everything a node process reads from its environment; one field per variable."""

    # the pipeline
    stage: int = _var(0, "STAGE", checks.integers(0), "this node's stage, 0-based")
    num_stages: int = _var(2, "NUM_STAGES", checks.integers(2), "stages in the pipeline")
    seed: str = _var(
        "", "SEED_ADDR", TEXT, "the seed's endpoint id, or a ticket where there is no discovery (loopback)"
    )
    model: str = _var("smollm2:135m", "MODEL", TEXT, "a model name (the model table) or a GGUF path")
    # the cluster
    node_key: bytes = _var(b"", "PP_NODE_KEY", KEY, "this node's secret key, 64 hex; never logged or reported")
    allowed_ids: tuple[str, ...] = _var(
        (),
        "PP_ALLOWED_IDS",
        IDS,
        "the endpoint ids that may connect (empty: any); past 256 characters, continued in PP_ALLOWED_IDS_1, ...",
        spill=True,
    )
    transport: str = _var(
        "local",
        "PP_TRANSPORT",
        checks.choice(TRANSPORTS, expected="'local' or 'wan'"),
        "local: loopback, relays off; wan: discovery and relays",
        "the orchestrator; the image sets wan",
    )
    swim: str = _var("", "PP_SWIM", TEXT, "SWIM settings over the network's defaults, e.g. suspicion_timeout=5")
    bind: str = _var(
        "",
        "PP_BIND",
        TEXT,
        "the address the node's endpoint binds and advertises, ip:port (empty: 127.0.0.1:0 local, 0.0.0.0:0 wan)",
        "the emulator, for a node in an emulated network's namespace",
    )
    port: int = _var(
        0,
        "PP_PORT",
        checks.integers(0, "a UDP port (0: any)"),
        "wan: the UDP port the endpoint binds, the one its create asks vast.ai to forward (0: any; no direct path)",
    )
    relay: str = _var("", "PP_RELAY", TEXT, "wan: the relays (empty: n0's; off: none; or a dedicated relay's URL)")
    public_ipaddr: str = _var(
        "", "PUBLIC_IPADDR", AGENT_TEXT, "the instance's public address, in front of the forwarded ports", AGENT
    )
    join_timeout: float = _var(30.0, "PP_JOIN_TIMEOUT", SECONDS, "seconds to join through the seed")
    names: tuple[str, ...] = _var(
        (), "PP_NAMES", NAMES, "names a bare member registers (runtime/member.py)", "LocalCluster, tests"
    )
    # the stage and its worker
    wire_dtype: str = _var(
        "bf16", "PP_WIRE_DTYPE", checks.choice(WIRE_DTYPES, "wire dtype"), "hidden states on the wire"
    )
    max_context: int = _var(
        1024, "PP_MAX_CONTEXT", checks.integers(1), "the worker's KV cache, in positions", "the user"
    )
    jit: bool = _var(True, "PP_JIT", FLAG, "1: compiled decode (TinyJit); 0: the spec's uncompiled forward", "the user")
    weight_cache: str = _var(
        "",
        "PP_WEIGHT_CACHE",
        TEXT,
        "the directory of realized stage weights (empty: ~/.cache/ppsmoke/weights; off: no cache)",
        "the orchestrator (the weight_cache setting)",
    )
    program_cache: bool = _var(
        True,
        "PP_PROGRAM_CACHE",
        FLAG,
        "1: keep tinygrad's generated programs and schedules in its disk cache; 0: do not",
        "the orchestrator (the program_cache setting)",
    )
    reference: str = _var(
        "after",
        "PP_REFERENCE",
        checks.choice(REFERENCES, expected="'beside' or 'after'"),
        "stage 0's reference: beside: a worker of its own loads the whole model while the stage loads, and keeps it; "
        "after: the stage's worker loads it afresh after the request (one model in memory at a time until then)",
        "the orchestrator (the reference setting)",
    )
    worker_role: str = _var(
        "stage",
        "PP_WORKER_ROLE",
        checks.choice(WORKER_ROLES, expected="'stage' or 'reference'"),
        "what a worker runs: its node's stage, or the reference beside it",
        "the node, for its workers",
    )
    worker: str = _var(
        "", "PP_WORKER", TEXT, "the worker script (empty: the installed pp_tinygrad_worker.py)", "the user"
    )
    worker_ready_timeout: float = _var(
        240.0,
        "PP_WORKER_READY_TIMEOUT",
        SECONDS,
        "seconds for the worker's ready line; the orchestrator's load deadline",
    )
    # the node's own time-to-live
    ttl: float = _var(
        900.0, "PP_TTL", SECONDS, "seconds after which the node destroys its own instance, whatever happens"
    )
    orphan_grace: float = _var(60.0, "PP_ORPHAN_GRACE", SECONDS, "seconds the node outlives a lost orchestrator")
    boot_window: float = _var(
        180.0,
        "PP_BOOT_WINDOW",
        SECONDS,
        "seconds the orchestrator gives the slowest instance to run: until it first reaches this node, the node "
        "waits that long plus its orphan grace (wan: its join deadline too)",
    )
    container_id: int | None = _var(
        None, "CONTAINER_ID", checks.integers(0, "an instance id (an integer)"), "the instance this node runs on", AGENT
    )
    container_api_key: str = _var(
        "", "CONTAINER_API_KEY", SECRET, "a key that may destroy this instance only; never logged", AGENT
    )
    vast_url: str = _var(
        "", "VAST_URL", TEXT, "the REST API to destroy the instance through (empty: vast.ai's)", "the emulator"
    )
    # processes on this machine
    exit_on_stdin_eof: bool = _var(
        False, "PP_EXIT_ON_STDIN_EOF", FLAG, "1: stop when stdin ends (the parent died)", "LocalCluster, the emulator"
    )
    log_level: str = _var(
        "WARNING",
        "PP_LOG_LEVEL",
        checks.choice(LOG_LEVELS),
        "the level of the log on stderr",
        "the user",
    )
    failpoints: str = _var(
        "", failpoints.ENV, FAILPOINTS, "failpoints on in this node (docs/lifecycle.md)", "the emulator"
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            var: Var = f.metadata["var"]
            try:
                var.form.check(value)
            except checks.Invalid as e:
                raise ValueError(f"{var.name} {e}") from None
        if not self.stage < self.num_stages:
            raise ValueError(
                f"STAGE and NUM_STAGES: stage {self.stage} of {self.num_stages} is not a valid stage "
                "(expected 0 <= STAGE < NUM_STAGES)"
            )

    # --- reading and writing ------------------------------------------------------------------

    @staticmethod
    def var(name: str) -> str:
        """The variable that carries field ``name`` (for messages that tell the user what to set)."""
        return _VARS[name].name

    @classmethod
    def read(cls, env: Mapping[str, str], *names: str) -> dict[str, Any]:
        """The fields among ``names`` whose variable is set (non-empty) in ``env``, converted;
        ValueError naming the variable when one is not of its form."""
        out = {}
        for name in names:
            var = _VARS[name]
            raw = var.raw(env)
            if raw == "":
                continue
            try:
                out[name] = var.form.parse(raw)
            except checks.Invalid as e:
                raise ValueError(f"{var.name} {e}") from None
        return out

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, only: Iterable[str] | None = None) -> NodeEnv:
        """Read ``env`` (default: this process's environment); with ``only``, just those fields,
        the rest keep their defaults."""
        env = os.environ if env is None else env
        return cls(**cls.read(env, *(only if only is not None else _VARS)))

    def to_env(self) -> dict[str, str]:
        """The variables of every field that differs from its default (a spilled list's parts,
        :meth:`Var.write`)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                var: Var = f.metadata["var"]
                out.update(var.write(value))
        return out

    def public_udp(self, env: Mapping[str, str] | None = None) -> str | None:
        """``PUBLIC_IPADDR:VAST_UDP_PORT_<port>``: where vast.ai forwards the node's UDP port from
        (its host agent sets both when the create asked for the port); None where either is unset.
        Both are read stripped: vast.ai pads the strings it serves, and iroh refuses an address with
        a newline in it. ValueError names the variable when the port is not one."""
        env = os.environ if env is None else env
        name = f"VAST_UDP_PORT_{self.port}"
        raw, ip = env.get(name, "").strip(), self.public_ipaddr
        if not (self.port and ip and raw):
            return None
        try:
            public = checks.integer(raw, 1)
        except ValueError:
            raise ValueError(f"{name} must be a UDP port (1..65535), got {raw!r}") from None
        if public > 65535:
            raise ValueError(f"{name} must be a UDP port (1..65535), got {raw!r}")
        return f"{ip}:{public}"

    def require(self, name: str) -> Any:
        """The value of field ``name``; ValueError naming its variable when it is not set."""
        value = getattr(self, name)
        if value is None or value in ("", b"", ()):
            var = _VARS[name]
            raise ValueError(f"{var.name} is not set; expected {var.form.expected}")
        return value

    def secrets(self) -> list[str | bytes]:
        """The values of the secret fields that are set (the node's key, the instance's API key):
        what the node redacts from the lines it keeps of its own log."""
        found = (getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["var"].form.secret)
        return [v for v in found if v]

    def for_worker(self) -> NodeEnv:
        """What a node hands its tinygrad worker: the stage, the model and how to run it; never a
        key, except under the test failpoint ``node.log_secrets`` (which a real image never
        sets), whose point is that every process that writes the node's log writes its keys."""
        keep: tuple[str, ...] = (
            "stage",
            "num_stages",
            "model",
            "wire_dtype",
            "max_context",
            "jit",
            "weight_cache",
            "program_cache",
            "worker_role",
            "log_level",
            "failpoints",  # a worker's own points (node.compute_fault); a real image never sets them
        )
        if "node.log_secrets" in self.failpoints:
            keep += tuple(f.name for f in dataclasses.fields(self) if f.metadata["var"].form.secret)
        return NodeEnv(**{k: getattr(self, k) for k in keep})

    def replace(self, **changes: Any) -> NodeEnv:
        return dataclasses.replace(self, **changes)


_VARS: dict[str, Var] = {f.name: f.metadata["var"] for f in dataclasses.fields(NodeEnv)}
DEFAULTS = NodeEnv()  # what a node assumes for a variable that is not set


def variables() -> list[Var]:
    """Every variable of the contract, in field order (docs/nodeenv.md lists them)."""
    return list(_VARS.values())


def inherited(parent: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a node started on this machine keeps of its parent's environment: everything but the
    contract's variables (it gets those from its own NodeEnv only) and anything named PP_*,
    VAST_* or CONTAINER_* (so that neither a stale setting nor the user's vast.ai key leaks in)."""
    parent = os.environ if parent is None else parent
    return {k: v for k, v in parent.items() if k not in _NAMES and not k.startswith(("PP_", "VAST_", "CONTAINER_"))}


def process_env(node: NodeEnv, parent: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment of a node process started here: the parent's (as ``inherited``),
    then ``node``'s variables."""
    return {**inherited(parent), **node.to_env(), "PYTHONUNBUFFERED": "1"}


_NAMES = frozenset(v.name for v in _VARS.values())

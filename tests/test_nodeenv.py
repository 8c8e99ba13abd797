"""The node's environment: one contract, written and read by the same class."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pytest_ppsmoke import nodeenv, protocol
from pytest_ppsmoke.cloud.vastrecords import search_body
from pytest_ppsmoke.harness.runconfig import RunConfig
from pytest_ppsmoke.nodeenv import DEFAULTS, NodeEnv
from pytest_ppsmoke.runtime.cluster import LocalCluster

pytestmark = pytest.mark.local

KEY = bytes(range(32))
CONTAINER_KEY = "ck-NEVER-SHOW-ME"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "nodeenv.md"


def full() -> NodeEnv:
    """A value for every field, none of them the default."""
    return NodeEnv(
        stage=1,
        num_stages=3,
        seed="ab" * 32,
        model="llama3.2:1b",
        node_key=KEY,
        allowed_ids=("cd" * 32, "ef" * 32),
        transport="wan",
        swim="suspicion_timeout=5",
        bind="10.231.0.2:0",
        port=7000,
        relay="off",
        public_ipaddr="203.0.113.7",
        join_timeout=12.5,
        names=("pp-stage-1",),
        wire_dtype="f16",
        max_context=256,
        jit=False,
        weight_cache="off",
        program_cache=False,
        reference="beside",
        worker_role="reference",
        worker="/w.py",
        worker_ready_timeout=30,
        ttl=600,
        orphan_grace=5,
        boot_window=240,
        container_id=123,
        container_api_key=CONTAINER_KEY,
        vast_url="http://127.0.0.1:1",
        exit_on_stdin_eof=True,
        log_level="INFO",
        failpoints="node.no_names",
    )


def test_every_field_round_trips_and_defaults_write_nothing() -> None:
    env = full()
    written = env.to_env()
    assert len(written) == len(dataclasses.fields(NodeEnv)) and all(isinstance(v, str) for v in written.values())
    assert NodeEnv.from_env(written) == env
    assert NodeEnv().to_env() == {} and NodeEnv.from_env({}) == DEFAULTS
    assert NodeEnv.from_env({v.name: "" for v in nodeenv.variables()}) == DEFAULTS  # empty is unset
    assert NodeEnv.from_env(written, only=("stage", "ttl")) == NodeEnv(stage=1, ttl=600)


def test_secrets_never_show() -> None:
    env = full()
    assert KEY.hex() not in repr(env) and CONTAINER_KEY not in repr(env)
    bad = "zz" * 32
    with pytest.raises(ValueError, match=r"PP_NODE_KEY must be 64 hex characters \(a 32-byte key\), got 64") as e:
        NodeEnv.from_env({"PP_NODE_KEY": bad})
    assert bad not in str(e.value)
    with pytest.raises(ValueError, match="PP_NODE_KEY is not set; expected 64 hex characters"):
        NodeEnv().require("node_key")


def test_what_vast_ais_host_agent_sets_is_read_stripped() -> None:
    """vast.ai pads the strings it serves: the container's key and the public address are read
    without their padding (a key with a newline is refused by the API, an address by iroh)."""
    env = NodeEnv.from_env({"CONTAINER_API_KEY": f" {CONTAINER_KEY}\n", "PUBLIC_IPADDR": "203.0.113.7\n"})
    assert env.container_api_key == CONTAINER_KEY and env.public_ipaddr == "203.0.113.7"
    assert env.secrets() == [CONTAINER_KEY]
    assert NodeEnv.from_env({"CONTAINER_API_KEY": " \n"}).container_api_key == ""  # blank is unset
    env = NodeEnv.from_env({"PUBLIC_IPADDR": " 203.0.113.7 \n", "PP_PORT": "7000"})
    assert env.public_udp({"VAST_UDP_PORT_7000": " 41234\n"}) == "203.0.113.7:41234"


def test_a_long_id_list_spills_into_numbered_variables_of_at_most_256_characters() -> None:
    """A cluster of 8 stages and the orchestrator: nine endpoint ids, 584 characters as one list,
    travel in PP_ALLOWED_IDS, PP_ALLOWED_IDS_1 and PP_ALLOWED_IDS_2 (three ids each), every id
    whole, and read back as the same nine; a list that fits stays in one variable."""
    ids = tuple(f"{n:02x}" * 32 for n in range(9))
    env = NodeEnv(stage=7, num_stages=8, allowed_ids=ids).to_env()
    parts = [k for k in env if k.startswith("PP_ALLOWED_IDS")]
    assert parts == ["PP_ALLOWED_IDS", "PP_ALLOWED_IDS_1", "PP_ALLOWED_IDS_2"]
    assert all(len(v) <= nodeenv.VALUE_MAX for v in env.values())
    assert [len(env[k].split(",")) for k in parts] == [3, 3, 3]
    assert NodeEnv.from_env(env).allowed_ids == ids
    assert list(NodeEnv(allowed_ids=ids[:3]).to_env()) == ["PP_ALLOWED_IDS"]
    # read up to the first part unset: a later one alone is not read; none reaches a local node
    gap = {"PP_ALLOWED_IDS": env["PP_ALLOWED_IDS"], "PP_ALLOWED_IDS_2": env["PP_ALLOWED_IDS_2"]}
    assert NodeEnv.from_env(gap).allowed_ids == ids[:3]
    assert nodeenv.inherited(env) == {}


def test_the_secrets_are_the_secret_fields_that_are_set() -> None:
    """What a node redacts from its own log: every field whose form is secret, read off the table
    (a new secret variable joins without a hand list); unset ones are not secrets."""
    assert sorted(map(repr, full().secrets())) == sorted([repr(KEY), repr(CONTAINER_KEY)])
    assert NodeEnv(node_key=KEY).secrets() == [KEY]
    assert NodeEnv().secrets() == []


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"STAGE": "one"}, "STAGE must be an integer of at least 0, got 'one'"),
        ({"NUM_STAGES": "1"}, "NUM_STAGES must be an integer of at least 2, got '1'"),
        ({"STAGE": "2"}, "STAGE and NUM_STAGES: stage 2 of 2 is not a valid stage"),
        ({"PP_TRANSPORT": "lan"}, "PP_TRANSPORT must be 'local' or 'wan', got 'lan'"),
        ({"PP_ALLOWED_IDS": "xyz"}, "PP_ALLOWED_IDS entry 'xyz' is not an endpoint id (64 hex characters)"),
        ({"PP_JOIN_TIMEOUT": "soon"}, "PP_JOIN_TIMEOUT must be a positive number of seconds, got 'soon'"),
        ({"PP_TTL": "0"}, "PP_TTL must be a positive number of seconds, got '0'"),
        ({"PP_WIRE_DTYPE": "fp8"}, "PP_WIRE_DTYPE names an unknown wire dtype 'fp8'; expected one of bf16, f16, f32"),
        ({"PP_JIT": "yes"}, "PP_JIT must be 1 or 0, got 'yes'"),
        ({"CONTAINER_ID": "i-1"}, "CONTAINER_ID must be an instance id (an integer), got 'i-1'"),
        ({"PP_LOG_LEVEL": "loud"}, "PP_LOG_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'loud'"),
    ],
)
def test_a_bad_value_names_the_variable_and_the_form(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError) as e:
        NodeEnv.from_env(env)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_stages": 1}, "NUM_STAGES must be an integer of at least 2, got 1"),
        ({"ttl": True}, "PP_TTL must be a positive number of seconds, got True"),
        ({"ttl": float("nan")}, "PP_TTL must be a positive number of seconds, got nan"),
        ({"node_key": b"\x01"}, "PP_NODE_KEY must be 64 hex characters (a 32-byte key), got 2 characters"),
        ({"allowed_ids": ("xyz",)}, "PP_ALLOWED_IDS entry 'xyz' is not an endpoint id (64 hex characters)"),
        ({"wire_dtype": "fp8"}, "PP_WIRE_DTYPE names an unknown wire dtype 'fp8'; expected one of bf16, f16, f32"),
    ],
)
def test_a_bad_field_is_refused_in_the_same_words(fields: dict[str, object], message: str) -> None:
    """A value given as such (a writer's NodeEnv) is checked by the same check as its text."""
    with pytest.raises(ValueError) as e:
        NodeEnv(**fields)  # type: ignore[arg-type]
    assert str(e.value) == message


def test_the_settings_and_the_node_environment_check_in_one_language() -> None:
    """The settings table's options and NodeEnv's variables are checks.Check values: a value
    both take is refused in the same words, after each one's name."""
    from pytest_ppsmoke import checks
    from pytest_ppsmoke.harness.settings import OPTIONS

    options = {o.name: o for o in OPTIONS}
    variables = {f.name: f.metadata["var"] for f in dataclasses.fields(NodeEnv)}
    assert all(isinstance(o.check, checks.Check) for o in OPTIONS)
    assert all(isinstance(v.form, checks.Check) for v in variables.values())
    for name, text in [("num_stages", "1"), ("wire_dtype", "fp8")]:
        with pytest.raises(checks.Invalid) as setting:
            options[name].parse(text)
        with pytest.raises(checks.Invalid) as variable:
            variables[name].form.parse(text)
        assert str(setting.value) == str(variable.value), name
    assert options["wire_dtype"].parse(" F16 ") == variables["wire_dtype"].form.parse("f16") == "f16"


def test_a_child_inherits_no_node_variable_and_no_vast_key() -> None:
    parent = {"PATH": "/bin", "CUDA": "1", "PP_TTL": "5", "PP_OTHER": "x", "SEED_ADDR": "s", "VAST_API_KEY": "k"}
    assert nodeenv.inherited(parent) == {"PATH": "/bin", "CUDA": "1"}
    env = nodeenv.process_env(NodeEnv(stage=1), parent)
    assert env == {"PATH": "/bin", "CUDA": "1", "STAGE": "1", "PYTHONUNBUFFERED": "1"}


def test_one_default_per_variable_for_every_side() -> None:
    assert nodeenv.WIRE_DTYPES is protocol.WIRE_DTYPES
    rc = RunConfig()
    assert (rc.load_timeout, rc.node_ttl, rc.orphan_grace) == (
        DEFAULTS.worker_ready_timeout,
        DEFAULTS.ttl,
        DEFAULTS.orphan_grace,
    )
    assert (rc.num_stages, rc.model, rc.wire_dtype, rc.transport) == (2, DEFAULTS.model, "bf16", DEFAULTS.transport)
    assert LocalCluster().load_timeout == DEFAULTS.worker_ready_timeout


def test_the_lower_records_are_derived_from_the_settings_not_copied() -> None:
    """RunConfig from the settings by field name, with the same defaults as its own (and
    OfferQuery's); every node's NodeEnv from the RunConfig; RunConfig's defaults for what a node
    also reads are NodeEnv's (a node joins within the run's convergence deadline, not its own)."""
    from pytest_ppsmoke.harness.runconfig import NODE_FIELDS
    from pytest_ppsmoke.harness.settings import VASTAI_MODEL, Settings
    from pytest_ppsmoke.harness.setup import QUERY_FIELDS, RUN_FIELDS, run_config

    # on vast.ai's GPUs the reference loads beside stage 0 (auto), on this machine's CPU after
    # and its nodes write no weight cache: every instance is new
    vastai = RunConfig(model=VASTAI_MODEL, transport="wan", reference_load="beside", weight_cache="off")
    assert run_config(Settings.resolve({"api_key": "k"})) == vastai
    s = Settings.resolve({"mode": "local", "num_stages": 3, "node_ttl": 5.0, "polls": 7, "converge_timeout": 9.0})
    rc = run_config(s)
    assert (rc.num_stages, rc.node_ttl, rc.polls, rc.converge_timeout, rc.reference_load) == (3, 5.0, 7, 9.0, "after")
    assert run_config(Settings.resolve({"mode": "local", "gpus": "0"})).reference_load == "beside"
    assert (rc.weight_cache, run_config(Settings.resolve({"api_key": "k", "weight_cache": "/c"})).weight_cache) == (
        "",
        "/c",
    )
    assert run_config(Settings.resolve({"api_key": "k", "reference": False})).reference_load == "after"
    assert run_config(Settings.resolve({"mode": "local", "reference_load": "beside"})).node_env().reference == "beside"
    node = rc.node_env()
    assert (node.num_stages, node.ttl, node.join_timeout, node.transport) == (3, 5.0, 9.0, "local")
    rc = RunConfig()
    for name, var in NODE_FIELDS.items():
        if name != "converge_timeout":
            assert getattr(rc, name) == getattr(DEFAULTS, var), name
    # the renamed ones, through their one table each
    changed = {"gpu_ram": 40.0, "max_price": 1.5, "min_reliability": 0.9, "min_cuda": 12.1, "disk": 50.0}
    s = Settings.resolve({"api_key": "k", **changed})
    rc = run_config(s)
    assert {name: getattr(rc.query, f) for name, f in QUERY_FIELDS.items()} == changed
    assert {name: getattr(rc, f) for name, f in RUN_FIELDS.items()} == {"disk": 50.0}


def test_the_docs_list_every_variable_with_its_default() -> None:
    lines = [line.split("|") for line in DOCS.read_text().splitlines() if line.startswith("| `")]
    defaults = {cells[1].strip(" `"): cells[3].strip() for cells in lines}  # variable -> default column
    for f in dataclasses.fields(NodeEnv):
        var = f.metadata["var"]
        assert var.name in defaults, f"{var.name} is missing from docs/nodeenv.md"
        unset = f.default in (None, "", (), b"")
        want = "(unset" if unset else f"`{var.form.show(f.default)}`"
        assert defaults[var.name].startswith(want), (var.name, defaults[var.name], want)


def test_the_direct_port_and_the_relay_reach_the_node_and_the_public_side_is_advertised() -> None:
    """vastai mode: the run's port and relay travel in each node's environment, its offers must
    forward a port, and a node told its public side by vast.ai's host agent binds the port and
    advertises where vast.ai forwards it from; a local run asks for none."""
    from pytest_ppsmoke.runtime.node import NodeConfig

    config = RunConfig(transport="wan", port=7100, relay="https://relay.example.com", check_image=False)
    assert config.direct and search_body(config.query)["direct_port_count"] == {"gte": 1}
    env = {**config.node_env().replace(node_key=KEY).to_env(), "PUBLIC_IPADDR": "203.0.113.7"}
    assert (env["PP_PORT"], env["PP_RELAY"]) == ("7100", "https://relay.example.com")
    node = NodeConfig.from_env({**env, "VAST_UDP_PORT_7100": "41234"})
    assert (node.bind_addr, node.advertise, node.relay) == ("0.0.0.0:7100", ("203.0.113.7:41234",), env["PP_RELAY"])
    assert NodeConfig.from_env(env).advertise == ()  # no forwarded port in the environment: nothing to advertise
    # vast.ai's host agent pads what it sets, as vast.ai pads every string: iroh refuses "203.0.113.7\n:41234"
    padded = NodeConfig.from_env({**env, "PUBLIC_IPADDR": " 203.0.113.7\n", "VAST_UDP_PORT_7100": "41234\n"})
    assert padded.advertise == ("203.0.113.7:41234",)
    # wan: the seed dials this node once every instance runs, up to the boot window after it starts
    assert node.join_timeout == config.converge_timeout + config.boot_window == 120 + 180
    assert (
        NodeConfig.from_env(
            RunConfig(transport="local", check_image=False).node_env().replace(node_key=KEY).to_env()
        ).join_timeout
        == 120
    )
    with pytest.raises(ValueError, match="VAST_UDP_PORT_7100 must be a UDP port"):
        NodeConfig.from_env({**env, "VAST_UDP_PORT_7100": "70000"})
    local = RunConfig(transport="local", check_image=False)
    assert not local.direct and "direct_port_count" not in search_body(local.query)
    with pytest.raises(ValueError, match="port must be a UDP port"):
        RunConfig(transport="wan", port=70000, check_image=False)

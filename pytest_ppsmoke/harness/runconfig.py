"""The run's config: what a deployment needs, the rental's (``RentalConfig``) and the cluster's,
with the one table of names between it and a node's environment (:data:`NODE_FIELDS`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..cloud.rental import RentalConfig
from ..nodeenv import DEFAULTS, NodeEnv
from ..protocol import CONVERGE_TIMEOUT, DIRECT_PORT, RESOLVE_TIMEOUT
from ..runtime.swimconfig import SwimConfig

# RunConfig's fields that every node's NodeEnv carries, by the NodeEnv field each becomes: the one
# table of the names that differ between the run's config and a node's environment
NODE_FIELDS = {
    "num_stages": "num_stages",
    "model": "model",
    "wire_dtype": "wire_dtype",
    "weight_cache": "weight_cache",
    "program_cache": "program_cache",
    "transport": "transport",
    "converge_timeout": "join_timeout",  # a node joins within the run's convergence deadline
    "load_timeout": "worker_ready_timeout",
    "node_ttl": "ttl",
    "orphan_grace": "orphan_grace",
    "relay": "relay",
    "reference_load": "reference",
    "boot_window": "boot_window",
}


@dataclass
class RunConfig(RentalConfig):
    """What a deployment needs: the rental's (:class:`RentalConfig`) and the cluster's. The harness
    builds it from its settings (``setup.run_config``); a value that a node also reads takes
    ``NodeEnv``'s default, a deadline of the spec's ``protocol``'s."""

    wire_dtype: str = DEFAULTS.wire_dtype
    weight_cache: str = DEFAULTS.weight_cache  # the nodes' PP_WEIGHT_CACHE ("": their default directory)
    program_cache: bool = DEFAULTS.program_cache  # the nodes' PP_PROGRAM_CACHE
    reference_load: str = DEFAULTS.reference  # stage 0's PP_REFERENCE: its reference worker beside, or after
    converge_timeout: float = CONVERGE_TIMEOUT  # the spec's SWIM deadline
    load_timeout: float = DEFAULTS.worker_ready_timeout  # the workers' ready deadline
    resolve_timeout: float = RESOLVE_TIMEOUT  # the spec's name deadline
    node_ttl: float = DEFAULTS.ttl  # a node removes itself after this long, whatever happens
    orphan_grace: float = DEFAULTS.orphan_grace  # ... or once it has lost the orchestrator for this long
    extra_env: Mapping[str, str] = field(default_factory=dict)  # raw variables over each node's NodeEnv
    relay: str = ""  # wan: the relays (empty: n0's; "off"; a dedicated relay's URL), the seed's and the nodes'
    bind: str | None = None  # the seed's ip:port (None: loopback when local); an emulated network's host address
    rtt: float = 0.0  # the network's worst round trip, seconds (an emulated network's profile): SWIM's timeouts

    def node_env(self) -> NodeEnv:
        """The part of every node's ``NodeEnv`` that this config gives (:data:`NODE_FIELDS`), and
        the port it binds where its create asks vast.ai to forward one (none elsewhere: nodes that
        share a host's network, as the image's do here, must not all bind it)."""
        fields = {var: getattr(self, name) for name, var in NODE_FIELDS.items()}
        return NodeEnv(**fields, port=self.port if self.direct else 0)

    @property
    def swim(self) -> SwimConfig:
        """Loopback on shared cores; the WAN's; or, where the round trip is known to be more than
        a few milliseconds (an emulated network's profile), :func:`swim_for_rtt`."""
        if self.rtt >= 0.01:
            return swim_for_rtt(self.rtt)
        return SwimConfig.wan() if self.transport != "local" else SwimConfig.shared_cpu()


def swim_for_rtt(rtt: float) -> SwimConfig:
    """The WAN's timing with a probe timeout of at least three round trips of ``rtt`` seconds,
    and a probe period of at least two timeouts, each to a tenth of a millisecond: the node reads
    them back from ``PP_SWIM``, one create's env value, which vast.ai keeps under 256 characters
    (a float's noise digits, ``1.8740740200000001``, took it to 235)."""
    wan = SwimConfig.wan()
    timeout = round(max(wan.ping_timeout, 3 * rtt), 4)
    return dataclasses.replace(
        wan, ping_timeout=timeout, protocol_period=round(max(wan.protocol_period, 2 * timeout), 4)
    )


def port_advice(config: RunConfig) -> str:
    """How to ask for a forwarded port, as a failure to reach a node says it."""
    port = config.port or DIRECT_PORT
    return (
        f"ask for a forwarded UDP port ({config.names.setting('port')} {port}: '-p {port}:{port}/udp' in each "
        "create's env) "
        "on offers with direct_port_count >= 1"
    )

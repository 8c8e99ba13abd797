"""An emulated network on one machine: members in network namespaces behind a user-space delay switch.

    from pytest_ppsmoke.network import EmulatedNetwork, parse_network
    async with EmulatedNetwork(parse_network("wan")) as net:
        m = await net.add_member("1")
        argv = m.wrap(["python", "-m", ...])  # runs inside the member's namespace, at m.addr

docs/network.md describes the design, the profiles and the switch's measured cost.
"""

from .emulated import EmulatedNetwork, Member, NetworkError
from .netns import sweep, unavailable
from .profiles import PROFILES, LinkProfile, NetworkSpec, parse_network

__all__ = [
    "PROFILES",
    "EmulatedNetwork",
    "LinkProfile",
    "Member",
    "NetworkError",
    "NetworkSpec",
    "parse_network",
    "sweep",
    "unavailable",
]

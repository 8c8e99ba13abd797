"""Namespaces, TUN devices and addresses, through netlink (pyroute2); and the sweep.

Every name this package creates is ``pps<pid>-<tag>`` (at most 15 characters, a device name's
limit), where ``pid`` is the process that owns the network (the :class:`EmulatedNetwork`'s). A
namespace or device whose owner is no longer alive is left over from a killed run: :func:`sweep`
removes it, and never touches a live run's.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import re
import signal
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

NETNS_DIR = Path("/run/netns")
LOCK_PATH = Path("/run/pps-network.lock")  # serialises the choice of a free subnet between runs
SUBNET_PREFIX = "10.77"  # network k is 10.77.k.0/24: .1 is the host, members from .2
NAME = re.compile(r"^pps(\d+)-[a-z0-9]+$")
_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000
_CLONE_NEWNET = 0x40000000


_probe_lock = threading.Lock()
_probed_ok = False


def unavailable(create: bool = True) -> str | None:
    """Why this machine cannot make an emulated network (None: it can). ``create``: also make and
    remove a namespace, which forks a helper (pyroute2's ``netns.create``): not for a process with
    threads that hold locks (an iroh endpoint's); the switch probes for its owner. Thread-safe; a
    success is remembered for the process, a failure is probed again next time."""
    global _probed_ok
    if not create:
        return _basics()
    with _probe_lock:
        if _probed_ok:
            return None
        why = _probe()
        _probed_ok = why is None
        return why


def _probe() -> str | None:
    why = _basics()
    if why is not None:
        return why
    name = f"pps{os.getpid()}-probe"
    try:
        create_netns(name)
    except OSError as e:
        return f"cannot create a network namespace: {e}"
    finally:
        with contextlib.suppress(OSError):
            remove_netns(name)
    return None


def _basics() -> str | None:
    if os.geteuid() != 0:
        return f"network namespaces need root (CAP_NET_ADMIN); this process runs as uid {os.geteuid()}"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing: the kernel has no TUN support here"
    try:
        import pyroute2  # noqa: F401
    except ImportError:
        return "pyroute2 is not installed (pip install pyroute2)"
    return None


def owner_of(name: str) -> int | None:
    m = NAME.match(name)
    return int(m.group(1)) if m else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- namespaces ----------------------------------------------------------------------------------


def create_netns(name: str) -> None:
    from pyroute2 import netns

    netns.create(name)


def netns_names() -> list[str]:
    try:
        return sorted(p.name for p in NETNS_DIR.iterdir())
    except FileNotFoundError:
        return []


def _netns_inode(name: str) -> int | None:
    try:
        return os.stat(NETNS_DIR / name).st_ino
    except OSError:
        return None


def pids_in_netns(name: str) -> list[int]:
    """Processes whose network namespace is ``name`` (they keep it alive after it is unmounted)."""
    ino = _netns_inode(name)
    if ino is None:
        return []
    want = f"net:[{ino}]"
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry.name}/ns/net") == want:
                    found.append(int(entry.name))
    return found


def remove_netns(name: str) -> list[int]:
    """SIGKILL what still runs inside ``name`` and remove it; returns the pids killed. Idempotent."""
    from pyroute2 import netns

    killed = [p for p in pids_in_netns(name) if p != os.getpid()]
    for pid in killed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if killed:
        log.warning("network namespace %s still ran pids %s: killed", name, killed)
    if (NETNS_DIR / name).exists():
        netns.remove(name)
    return killed


def setns(name: str) -> None:
    """Move the calling thread (of a process about to exec) into namespace ``name``."""
    fd = os.open(NETNS_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns_fd(fd, name)
    finally:
        os.close(fd)


def setns_fd(fd: int, name: str = "") -> None:
    """Move the calling thread into the network namespace open at ``fd``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns into network namespace {name or fd!r}: {os.strerror(err)}")


_IROH_THREADS = ("tokio-rt-worker", "async-compat/to")  # the names iroh's runtime gives its threads


def iroh_threads() -> int:
    """How many threads of this process belong to iroh's runtime (0: it has not started here)."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            if Path(f"/proc/self/task/{tid}/comm").read_text().strip() in _IROH_THREADS:
                count += 1
    return count


# --- TUN devices and addresses --------------------------------------------------------------------


def open_tun(ifname: str) -> int:
    """A non-persistent TUN device (no packet-info header) in this namespace; it vanishes with the fd."""
    if len(ifname) > 15:
        raise ValueError(f"device name {ifname!r} is {len(ifname)} characters; the limit is 15")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", ifname.encode(), _IFF_TUN | _IFF_NO_PI))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _disable_ipv6(ifname: str) -> None:
    # no IPv6 link-local address, hence no router solicitations for the switch to drop
    with contextlib.suppress(OSError):
        Path(f"/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6").write_text("1")


def configure_root_tun(ifname: str, addr: str) -> None:
    """Give the root namespace's TUN ``addr``/24 and bring it up (the kernel adds the /24 route)."""
    from pyroute2 import IPRoute

    _disable_ipv6(ifname)
    with IPRoute() as ipr:
        idx = ipr.link_lookup(ifname=ifname)[0]
        ipr.addr("add", index=idx, address=addr, prefixlen=24)
        ipr.link("set", index=idx, state="up")


def move_and_configure_tun(ifname: str, ns: str, addr: str) -> None:
    """Move TUN ``ifname`` into namespace ``ns``; bring ``lo`` and it up with ``addr``/24 (its only route)."""
    from pyroute2 import IPRoute, NetNS

    with IPRoute() as ipr:
        idx = ipr.link_lookup(ifname=ifname)[0]
        ipr.link("set", index=idx, net_ns_fd=ns)
    with NetNS(ns) as nsr:
        lo = nsr.link_lookup(ifname="lo")[0]
        nsr.link("set", index=lo, state="up")
        idx = nsr.link_lookup(ifname=ifname)[0]
        nsr.addr("add", index=idx, address=addr, prefixlen=24)
        nsr.link("set", index=idx, state="up")


def root_links() -> list[str]:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        return [str(link.get_attr("IFLA_IFNAME")) for link in ipr.get_links()]


def delete_root_link(ifname: str) -> None:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        found = ipr.link_lookup(ifname=ifname)
        if found:
            with contextlib.suppress(Exception):
                ipr.link("del", index=found[0])


def used_subnets() -> set[int]:
    """The k of every 10.77.k.0/24 this namespace already has an address or a route in."""
    from pyroute2 import IPRoute

    used: set[int] = set()
    with IPRoute() as ipr:
        texts: list[Any] = [a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(family=2)]
        texts += [r.get_attr("RTA_DST") for r in ipr.get_routes(family=2)]
    for t in texts:
        if isinstance(t, str) and t.startswith(SUBNET_PREFIX + "."):
            used.add(int(t.split(".")[2]))
    return used


@contextlib.contextmanager
def subnet_lock() -> Iterator[None]:
    fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def pick_subnet(start: int) -> int:
    """A k in 0..255 with no 10.77.k.* address or route here yet (call it under :func:`subnet_lock`)."""
    used = used_subnets()
    for i in range(256):
        k = (start + i) % 256
        if k not in used:
            return k
    raise OSError(errno.EADDRINUSE, f"every {SUBNET_PREFIX}.k.0/24 (k in 0..255) is in use on this machine")


# --- the sweep ------------------------------------------------------------------------------------


def sweep() -> list[str]:
    """Remove the namespaces and root devices of runs whose owner is dead (SIGKILLing what still
    runs in those namespaces); returns the names removed. A live run's names are never touched."""
    removed = []
    for name in netns_names():
        pid = owner_of(name)
        if pid is not None and not pid_alive(pid):
            try:
                remove_netns(name)
                removed.append(name)
            except OSError as e:
                log.warning("sweep: cannot remove network namespace %s: %s", name, e)
    with contextlib.suppress(ImportError):
        for ifname in root_links():
            pid = owner_of(ifname)
            if pid is not None and not pid_alive(pid):
                delete_root_link(ifname)
                removed.append(ifname)
    return removed


# --- NAT: veth pairs, routes and iptables inside a namespace (the internet profiles) -----------------


def veth_between(a: str, ns_a: str | None, b: str, ns_b: str) -> None:
    """A veth pair: end ``a`` in namespace ``ns_a`` (None: this one), end ``b`` in ``ns_b``."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        ipr.link("add", ifname=a, kind="veth", peer=b)
        for end, ns in ((a, ns_a), (b, ns_b)):
            if ns is not None:
                ipr.link("set", index=ipr.link_lookup(ifname=end)[0], net_ns_fd=ns)


def address_in(ns: str, ifname: str, addr: str, prefixlen: int, gateway: str | None = None) -> None:
    """Give ``ifname`` in ``ns`` ``addr``/``prefixlen``, bring it and ``lo`` up, and with
    ``gateway`` make that the namespace's default route."""
    from pyroute2 import NetNS

    with NetNS(ns) as nsr:
        nsr.link("set", index=nsr.link_lookup(ifname="lo")[0], state="up")
        idx = nsr.link_lookup(ifname=ifname)[0]
        nsr.addr("add", index=idx, address=addr, prefixlen=prefixlen)
        nsr.link("set", index=idx, state="up")
        if gateway is not None:
            nsr.route("add", dst="default", gateway=gateway)


def firewall(ns: str, rules: str, forward: bool = True) -> None:
    """Load ``rules`` (iptables-restore's format) into namespace ``ns``, and with ``forward`` let it
    route (``net.ipv4.ip_forward``, which each namespace has of its own). The rules go with the
    namespace: nothing is ever added to this machine's own tables."""
    import shutil
    import subprocess

    if shutil.which("iptables-restore") is None:
        raise OSError("iptables-restore is not installed (apt-get install iptables): the internet profiles need it")
    script = "echo 1 > /proc/sys/net/ipv4/ip_forward && " if forward else ""
    script += "exec iptables-restore"
    done = subprocess.run(
        ["ip", "netns", "exec", ns, "sh", "-c", script], input=rules.encode(), capture_output=True, timeout=30
    )
    if done.returncode != 0:
        raise OSError(f"iptables in network namespace {ns}: {done.stderr.decode(errors='replace').strip()}")

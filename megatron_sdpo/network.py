"""The network interface the job's sockets use across nodes.

NCCL's bootstrap and gloo (the scoring group, vLLM's data-parallel lockstep, the CPU shim) open
TCP sockets on an interface they pick themselves; on a node with several (management Ethernet,
InfiniBand IPoIB, container bridges) the pick can be one the other node cannot reach, which shows
only as a hang until the collective timeout. A rank therefore names the interface its route to
MASTER_ADDR leaves by, unless the user named one (NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME): the
local address a UDP socket connected to MASTER_ADDR gets, and the interface that holds it. On
the first node MASTER_ADDR is its own address, and the interface holding it is the one the other
nodes reach, unless its name resolves to a loopback address there (/etc/hosts' 127.0.1.1): then
the route to another node of the job (SDPO_NODES, the sbatch body's node list) decides.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from collections.abc import MutableMapping

VARIABLES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
NODES_ENV = "SDPO_NODES"
_SIOCGIFADDR = 0x8915


def _address_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None  # no IPv4 address on it
    return socket.inet_ntoa(packed[20:24])


def _route(addr: str) -> tuple[str | None, str | None, str]:
    """(interface, source address, how) of this node's route to `addr`."""
    try:
        target = socket.gethostbyname(addr)
    except OSError as exc:
        return None, None, f"MASTER_ADDR {addr!r} does not resolve here ({exc.strerror or exc})"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target, 9))  # UDP: nothing is sent; the kernel picks the route and source
        except OSError as exc:
            return None, None, f"no route to {target} ({exc.strerror or exc})"
        source = s.getsockname()[0]
    for _, name in socket.if_nameindex():
        if _address_of(name) == source:
            return name, source, f"route to {addr} ({target}) from {source}"
    return None, source, f"no interface holds {source}, the route's source address to {target}"


def route_interface(master_addr: str) -> tuple[str | None, str]:
    """(interface, how it was found) of this node's route to `master_addr`; (None, why) when
    the address does not resolve or no interface holds the route's source address."""
    name, _, how = _route(master_addr)
    return name, how


def choose(env: MutableMapping[str, str] = os.environ) -> list[str]:
    """Set NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME from the route to MASTER_ADDR where the user
    set neither; one line per variable saying what it is and why (for the preflight and the log)."""
    master = env.get("MASTER_ADDR")
    given = {k: env[k] for k in VARIABLES if env.get(k)}
    if len(given) == len(VARIABLES):
        return [f"{k}={v} (given)" for k, v in given.items()]
    if not master:
        return [f"{k}={given.get(k, '(library default)')} (no MASTER_ADDR: a single-node launch)" for k in VARIABLES]
    name, source, how = _route(master)
    if name is not None and source is not None and source.startswith("127."):
        for peer in env.get(NODES_ENV, "").split():
            other, other_source, other_how = _route(peer)
            if other is not None and other_source is not None and not other_source.startswith("127."):
                name, how = other, f"{other_how}; {master} is a loopback address here"
                break
        else:
            name, how = None, f"{how}: a loopback route, and no node of {NODES_ENV} routes elsewhere"
    lines = []
    for k in VARIABLES:
        if k in given:
            lines.append(f"{k}={given[k]} (given)")
        elif name is None:
            lines.append(f"{k} unset: {how}; set it to the interface the nodes reach each other on")
        else:
            env[k] = name
            lines.append(f"{k}={name} ({how})")
    return lines

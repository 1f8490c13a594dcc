"""Network interfaces: which exist, which one is loopback, and what address each holds.

Every psrpc process listens: TensorPipe on the address of `TP_SOCKET_IFNAME` (else wherever the
host name resolves), the gloo group that init_rpc builds on `GLOO_SOCKET_IFNAME` (same rule), and
rank 0 hosts the rendezvous store. RPC unpickles what peers send, so these listeners must be only
where the run needs them (docs/security.md). psutil reads the interfaces (getifaddrs underneath):
the standard library cannot list their addresses.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Optional

import psutil

from psrpc.errors import ConfigError, PsrpcError

_IP_FAMILIES = (socket.AF_INET, socket.AF_INET6)


def interfaces() -> dict[str, list[str]]:
    """Interface name -> its IP addresses (IPv4 first), for every interface of this machine."""
    found = {}
    for name, addrs in psutil.net_if_addrs().items():
        ips = [a for a in addrs if a.family in _IP_FAMILIES]
        found[name] = [a.address.split("%")[0]  # drop an IPv6 zone ("fe80::1%eth0")
                       for a in sorted(ips, key=lambda a: a.family != socket.AF_INET)]
    return found


def check_interface(name: str, key: str) -> None:
    """ConfigError naming `key`, the value and the interfaces that exist, unless `name` exists."""
    known = interfaces()
    if name not in known:
        raise ConfigError(f"{key}={name!r}: no such network interface here; this machine has "
                          f"{', '.join(sorted(known))}")


def loopback_interface() -> str:
    """The interface that holds 127.0.0.1 (Linux: lo; macOS: lo0)."""
    for name, ips in interfaces().items():
        if any(ipaddress.ip_address(ip).is_loopback for ip in ips):
            return name
    raise PsrpcError("no loopback network interface (none holds 127.0.0.1): the local launcher "
                     "listens on loopback only")


def is_loopback_interface(name: str) -> bool:
    ips = interfaces().get(name, [])
    return bool(ips) and all(ipaddress.ip_address(ip).is_loopback for ip in ips)


def check_many_hosts(interface: Optional[str], master_addr: str, nodes: int) -> None:
    """Before any rendezvous wait, on a run over `nodes` > 1 hosts: the address this rank will
    listen on must be one the other hosts can reach, and the rendezvous host must have an
    address. Either mistake otherwise shows only as a rendezvous timeout (cluster.init_timeout_s)
    on some other host. With no interface named, TensorPipe listens where this host's name
    resolves: on Debian and Ubuntu that is 127.0.1.1 unless /etc/hosts says otherwise. A named
    interface is taken as meant (loopback too: several "hosts" on one machine)."""
    if nodes <= 1:
        return
    try:
        socket.getaddrinfo(master_addr, None)
    except OSError as e:
        raise ConfigError(f"the rendezvous host {master_addr!r} (MASTER_ADDR, or the first "
                          f"node SLURM lists) has no address here ({e.strerror or e}): name a "
                          "host every node can resolve, or its IP address") from None
    if interface is not None:
        return
    name = socket.gethostname()
    try:
        addr = socket.getaddrinfo(name, None)[0][4][0]
    except OSError:
        addr = None
    if addr is not None and not ipaddress.ip_address(addr).is_loopback:
        return
    where = f"resolves to {addr} (loopback)" if addr else "does not resolve"
    others = [f"{n} ({ips[0]})" for n, ips in sorted(interfaces().items())
              if ips and not all(ipaddress.ip_address(ip).is_loopback for ip in ips)]
    raise ConfigError(f"this run spans {nodes} hosts, but this host's name {name!r} {where}, "
                      f"so RPC would listen where no other host can reach it: set "
                      f"cluster.interface to this host's network interface"
                      + (f" ({', '.join(others)})" if others else ""))

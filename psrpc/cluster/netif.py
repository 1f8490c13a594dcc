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

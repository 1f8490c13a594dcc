"""What crossed between hosts, as the kernel counts it: per TCP connection of this process, the
payload bytes it sent (retransmissions included) and received (Linux's TCP_INFO of the socket,
read at the end of the run), and which library owns it: the rendezvous store (its port), gloo
(the sockets a process group opened: `mark_new`) or TensorPipe (the rest: RPC). The chief adds
up every rank's connections per pair of hosts (`by_host_pair`); each connection is counted once,
by whichever end measured it (a rank; the other end may be torchrun's agent, which hosts the
store there). Host-local paths (shared memory, the Unix-socket side channel and local all-reduce)
are not TCP and not counted here. Connections closed before the end (a membership epoch's
group, left for the next one) are gone from the count: it covers the groups alive at the end.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from typing import Optional

from psrpc.cluster import comm, store
from psrpc.errors import first_line

log = logging.getLogger(__name__)

_OWNERS: dict[int, str] = {}  # socket inode -> the library that opened it ("gloo")
# struct tcp_info (linux/tcp.h): offsets of the fields read here
_INFO_LEN = 232
_BYTES_ACKED, _BYTES_RECEIVED, _BYTES_SENT = 120, 128, 200


def _inodes() -> dict[int, int]:
    """This process's sockets: inode -> a file descriptor of it."""
    out = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # not Linux: nothing is counted
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(name)
    return out


def sockets() -> set[int]:
    """The inodes of this process's sockets now (before a library opens some: `mark_new`)."""
    return set(_inodes())


def mark_new(before: set[int], owner: str) -> None:
    """Every socket opened since `before` belongs to `owner` (a gloo process group, formed)."""
    for inode in set(_inodes()) - before:
        _OWNERS[inode] = owner


def _tcp(fd: int) -> Optional[tuple]:
    """(local address, local port, peer address, peer port, bytes sent, bytes received) of a
    connected TCP socket, else None."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
            return None
        local, peer = s.getsockname(), s.getpeername()
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _INFO_LEN)
    except OSError:  # a listener (no peer), or gone meanwhile
        return None
    finally:
        s.close()
    if len(info) >= _BYTES_SENT + 8:  # Linux 4.19 and later: retransmissions included
        sent = struct.unpack_from("Q", info, _BYTES_SENT)[0]
    elif len(info) >= _BYTES_RECEIVED + 8:
        sent = struct.unpack_from("Q", info, _BYTES_ACKED)[0]
    else:
        return None
    received = struct.unpack_from("Q", info, _BYTES_RECEIVED)[0]
    return local[0], local[1], peer[0], peer[1], sent, received


def connections() -> dict:
    """This rank's TCP connections now (an RPC the chief calls on every rank at the end): its
    host name and, per connection, [local address, local port, peer address, peer port, owner,
    bytes sent, bytes received]."""
    store_port = store.where().get("port")
    conns = []
    for inode, fd in _inodes().items():
        tcp = _tcp(fd)
        if tcp is None:
            continue
        la, lp, pa, pp, sent, received = tcp
        owner = ("store" if store_port in (lp, pp) else _OWNERS.get(inode, "tensorpipe"))
        conns.append([la, lp, pa, pp, owner, sent, received])
    return {"host": socket.gethostname(), "connections": conns}


def by_host_pair(ranks: dict[str, dict]) -> dict:
    """Every rank's `connections()` (by rank name) added up per pair of hosts: {"h1 -> h0":
    {"tensorpipe": bytes, "gloo": ..., "store": ..., "total": ...}}; a peer address no rank
    has is named by its address, a connection within a host counts for "h0 -> h0"."""
    host_of = {}  # address -> host name
    for info in ranks.values():
        for la, _, _, _, _, _, _ in info["connections"]:
            if not la.startswith("127."):
                host_of[la] = info["host"]
    seen: dict[tuple, tuple] = {}  # connection -> its first measured end (host, row)
    for info in ranks.values():
        for la, lp, pa, pp, owner, sent, received in info["connections"]:
            local = info["host"] if la.startswith("127.") else ""  # (each host's loopback)
            if (pa, pp, la, lp, local) not in seen:  # the other end's, where it measured too
                seen[(la, lp, pa, pp, local)] = (info["host"], owner, sent, received)
    pairs: dict[str, dict] = {}
    for (_, _, pa, _, _), (host, owner, sent, received) in seen.items():
        peer = host if pa.startswith("127.") else host_of.get(pa, pa)
        for src, dst, n in ((host, peer, sent), (peer, host, received)):
            row = pairs.setdefault(f"{src} -> {dst}", {"total": 0})
            row[owner] = row.get(owner, 0) + n
            row["total"] += n
    return dict(sorted(pairs.items()))


def host_traffic(topo, lost: list[int]) -> dict:
    """Called by the chief: each rank's TCP connections as its kernel counts them, every rank
    asked at once (a rank that does not answer within 5 s is left out, `lost` workers are not
    asked), summed per host pair: the summary's `host_traffic`."""
    names = [topo.name_of(r) for r in range(topo.world_size)]
    gone = {f"worker{w}" for w in lost}
    asked = {n: comm.call(n, connections, timeout_s=5) for n in names
             if n not in gone and n != topo.name}
    ranks = {topo.name: connections()}
    for name, fut in asked.items():
        try:
            ranks[name] = fut.wait()
        except Exception as e:
            log.warning("%s: no connection counts (%s); host_traffic leaves it out", name,
                        first_line(e))
    hosts: dict[str, list[str]] = {}
    for name, info in ranks.items():
        hosts.setdefault(info["host"], []).append(name)
    return {"hosts": hosts, "bytes": by_host_pair(ranks)}

"""The rendezvous store every rank of a run reaches (a c10d TCPStore): hosted by the local
launcher or torchrun's agent (else by rank 0), where init_rpc forms each group and where the
local launcher announces membership epochs. One client per process and address, kept across
epochs. init_rpc's waits on it go through `AbortableStore`, which gives up as soon as the group
it forms will never form (psrpc/cluster/membership.py).
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from psrpc.errors import PsrpcError, Retryable, first_line

WAIT_SLICE_S = 0.1  # a wait of init_rpc asks `abort` this often (the store wakes it at once)
# An elastic group's members have all arrived when init_rpc starts (membership._gather): what
# it waits for then besides the store (gloo connecting to each member, its collectives, torch's
# all-gather over RPC) takes milliseconds, unless a member died meanwhile. Those waits cannot be
# abandoned like the store's: they end after this long (at most a quarter of init_timeout_s, so
# that the ranks waiting at the next epoch see them come).
FORM_TIMEOUT_S = 10.0
# gloo's full-mesh connect retries: a member that dies while the mesh connects holds the others
# there this many times the group's timeout (measured: 25 s at 5 s, 10 s at 2 s, torch 2.14)
GLOO_CONNECT_TRIES = 5


def form_timeout_s(init_timeout_s: float) -> float:
    """How long the waits of an elastic group's forming that cannot be abandoned may take."""
    return min(FORM_TIMEOUT_S, init_timeout_s / 4)


def leaving_s(init_timeout_s: float) -> float:
    """The longest a rank may spend in a group that never forms before it can leave it (gloo's
    mesh connecting to a member that died)."""
    return GLOO_CONNECT_TRIES * form_timeout_s(init_timeout_s)


class GroupAbandoned(Retryable):
    """init_rpc gave up: the group it was forming will never form (a newer epoch replaced it)."""


class AbortableStore(dist.Store):
    """The store init_rpc forms its group through, with its blocking waits done here, in
    Python: every wait polls the store and gives up as soon as `abort()` says the group will
    never form. Otherwise a member that dies while the group forms (after it announced itself,
    before it connected) keeps the others in init_rpc until the store's timeout (its gloo group
    and TensorPipe agent wait for that member's keys, in C++, with no way out), although a new
    membership epoch was announced at once. Everything else is the wrapped store's.
    (A Python Store must outlive every C++ user of it: each one made is kept, see _MADE.)"""

    def __init__(self, inner, abort=None, limit_s: float = 0.0):
        super().__init__()
        self.inner, self.abort, self.limit_s = inner, abort, limit_s
        _MADE.append(self)

    def set(self, key, value):
        self.inner.set(key, value)

    def get(self, key):
        self.wait([key])
        return self.inner.get(key)

    def multi_get(self, keys):
        self.wait(keys)
        return self.inner.multi_get(keys)

    def multi_set(self, keys, values):
        self.inner.multi_set(keys, values)

    def add(self, key, value):
        return self.inner.add(key, value)

    def append(self, key, value):
        self.inner.append(key, value)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys):
        return self.inner.check(keys)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def clone(self):
        return AbortableStore(self.inner.clone(), self.abort, self.limit_s)

    def wait(self, keys, timeout=None):
        keys = list(keys)
        limit = self.limit_s  # init_timeout_s, whatever the caller asks: this wait gives up
        # at once when the group will never form; the others are bounded by FORM_TIMEOUT_S
        deadline = time.monotonic() + limit
        while not wait_for(self.inner, keys, WAIT_SLICE_S):
            if self.abort is not None and self.abort():
                raise GroupAbandoned("a newer membership epoch was announced while this group "
                                     "was forming")
            if limit > 0 and time.monotonic() >= deadline:
                raise dist.DistStoreError(f"wait timeout after {limit * 1000:.0f}ms, keys: "
                                          f"{keys}")


def wait_for(store, keys: list[str], timeout_s: float) -> bool:
    """Whether every key of `keys` is set within `timeout_s` (the store wakes the wait as soon
    as they are; its timeout is not an error here)."""
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except dist.DistStoreError:  # the timeout (a lost store is another error: it propagates)
        pass
    return bool(store.check(keys))  # and never on a wait's word alone


LINGER_S = 2.0  # a rank that hosts the store and fails: how long the others get to read why


def linger() -> None:
    """Before a rank that hosts the store leaves on an error (srun's task 0): the others, polling
    the store every 0.1 s, read the reason it wrote there (membership.failed_key) rather than
    finding the store gone."""
    if _WHERE.get("hosted"):
        time.sleep(LINGER_S)


_MADE: list = []


_STORES: dict = {}  # (host, port) -> this process's client (or server), kept across epochs
_WHERE: dict = {}  # the current store's host, port and whether this process hosts it


def where() -> dict:
    """The current store's host and port, and whether this process hosts it ({} before one)."""
    return dict(_WHERE)


def process_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta,
                   agent_store: bool):
    """The rendezvous store, made once per process and address: torchrun's agent or the local
    launcher hosts it (agent_store), else rank 0 does, on the address `host` resolves to."""
    key = (host, port)
    if key not in _STORES:
        if agent_store or rank != 0:
            _reachable(host, port, timeout.total_seconds())
            try:  # (connects at once now; `timeout` is also every later call's)
                _STORES[key] = dist.TCPStore(host, port, world_size, False, timeout)
            except dist.DistError as e:
                raise PsrpcError(f"the rendezvous store ({host}:{port}) did not answer within "
                                 f"{timeout.total_seconds():g} s (cluster.init_timeout_s): "
                                 f"{first_line(e)}") from None
        else:
            listener = _bind(host, port)
            _STORES[key] = dist.TCPStore(host, port, world_size, True, timeout,
                                         master_listen_fd=listener.detach())
        _STORES["current"] = _STORES[key]
        _WHERE.update(host=host, port=port, hosted=not agent_store and rank == 0)
    return _STORES[key]


def _reachable(host: str, port: int, timeout_s: float) -> None:
    """Wait, up to `timeout_s`, until the store's port takes a plain TCP connection (its host
    may still be starting it; one line when it never does, where c10d's own connect would
    print a multi-line report of each timed-out try: a store whose host is gone, a rank
    started again after the run ended)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(
                5.0, deadline - time.monotonic()))).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise PsrpcError(f"the rendezvous store ({host}:{port}) did not answer within "
                                 f"{timeout_s:g} s (cluster.init_timeout_s): {e}") from None
            time.sleep(0.2)


def client(timeout_s: float) -> Any:
    """A new connection to this process's store, whose every call gives up after `timeout_s`
    (a thread of its own that must not wait behind the process's client, or a rank that lost
    its connection to a partition). Where the store's port does not answer, an OSError, without
    c10d's multi-line report of each timed-out connect."""
    socket.create_connection((_WHERE["host"], _WHERE["port"]), timeout=timeout_s).close()
    return dist.TCPStore(_WHERE["host"], _WHERE["port"], None, False,
                         timedelta(seconds=timeout_s), wait_for_workers=False)


def renew(timeout_s: float) -> None:
    """This process's client, made again: after a partition its old connection may be reset,
    or hold a reply to a call that timed out (read as the next call's). Not where this process
    hosts the store."""
    if _WHERE.get("hosted", True):
        return
    fresh = client(timeout_s)
    _STORES[(_WHERE["host"], _WHERE["port"])] = _STORES["current"] = fresh


def host_store(host: str, port: int, timeout_s: float):
    """The local launcher's store (the ranks are its clients): it outlives every rank, so a
    rank started again finds it, and the launcher announces membership epochs in it."""
    listener = _bind(host, port)
    return dist.TCPStore(host, port, None, True, timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=listener.detach())


def store() -> Any:
    """This process's store (after `init` or `connect_store`)."""
    return _STORES["current"]


def abortable(abort, limit_s: float) -> dist.Store:
    """This process's store, whose waits give up once `abort()` says so (a newer membership
    epoch: the group being formed will never form), or after `limit_s`."""
    return AbortableStore(store(), abort, limit_s)


def connect_store(addr: str, port: int, rank: int, world_size: int, timeout_s: float,
                  agent_store: bool = False) -> Any:
    """This process's rendezvous store, before it joins a group (`init` uses the same one):
    where the local launcher announces membership epochs."""
    return process_store(addr, port, rank, world_size, timedelta(seconds=timeout_s),
                          agent_store)


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to the address `host` resolves to (127.0.0.1 for the local launcher):
    where every rank connects, and nowhere else."""
    sock = None
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        if sock is not None:
            sock.close()
        raise PsrpcError(f"MASTER_ADDR={host!r} MASTER_PORT={port}: the rendezvous store cannot "
                         f"listen there ({e.strerror or e}); MASTER_ADDR must be an address of "
                         "this machine that the other ranks reach") from None
    return sock

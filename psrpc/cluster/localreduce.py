"""An all-reduce among the processes of one host over Unix sockets, run by the calling thread:
the dense all-reduce of CPU workers that share a machine (update.dense=allreduce, `cluster.shm`
auto or on).

Why not gloo there: for one 22 KB bucket a step (DLRM's MLPs), gloo's two threads per process
(its run loop and its TCP loop) woke about 13 times a step, half the context switches of a whole
two-core cluster, and used 7 % of a core per worker. Here `allreduce` sends the buffer to every
peer as far as the sockets take it without blocking, and `wait` sends the rest while it reads
the peers' buffers (poll on both directions: two peers sending large buffers at once cannot
block each other), then adds them.

The sum: every process adds the W buffers in the PS's order (the binary tree over the ranks,
psrpc/optim/treesum.py), so every replica gets the same bits, the bits a PS would give (with
two, the bits gloo gives too: a + b = b + a).

Forming (`form`), through the store prefix of the membership epoch: each process publishes its
host and a listening address in Linux's abstract namespace. When the W are not all on one host,
`form` returns None everywhere (gloo then). Rank r connects to every lower rank and accepts the
higher ones; both ends check the peer's user id (SO_PEERCRED). A rank that cannot connect says
so in the store and every rank falls back to gloo: they all decide alike.

Failures: a dead peer's sockets are closed by the kernel (even on SIGKILL), so a wait ends at
once with an error naming that rank; a live peer that sends nothing ends it after the timeout.
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from psrpc.cluster.shm import close_socket, host_id, peer_uid
from psrpc.errors import PsrpcError
from psrpc.optim.treesum import Scratch, leaves, tree_sum

_HEAD = struct.Struct("<QQ")  # each buffer sent: the all-reduce's sequence number, its bytes
POLL_SLICE_S = 0.1  # how often forming looks at the store for a rank that gave up


class LocalReduceError(PsrpcError):
    """A peer of the all-reduce died, closed its end, sent nonsense or nothing in time."""


class LocalGroup:
    """A connected mesh of the W processes (`form` makes one): `allreduce([t])` sums `t` in place
    over the W, as a process group's does, its work done by `wait()`."""

    def __init__(self, rank: int, size: int, socks: dict[int, socket.socket],
                 timeout_s: float, abort=lambda: False):
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.abort = abort  # a newer membership epoch: a peer waits for it, not for this sum
        self.socks = socks  # peer rank -> socket (non-blocking)
        # peer rank -> [(all-reduce seq, bytes still to send)], in stream order
        self.outgoing: dict[int, list[tuple[int, memoryview]]] = {p: [] for p in socks}
        self.seq = 0
        self.waited = 0  # the last all-reduce completed (waits come in order)
        self._peer = {sock.fileno(): p for p, sock in socks.items()}  # poll's fd -> peer rank
        self._spare: dict[tuple, dict] = {}  # (numel, dtype) -> receive buffers by peer
        self.broken: Optional[LocalReduceError] = None  # every later call fails with it
        self._scratch = Scratch()  # the tree sum's buffers

    def allreduce(self, tensors: list[torch.Tensor]) -> "_Work":
        (t,) = tensors
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("the local all-reduce takes contiguous CPU tensors")
        self.seq += 1
        data = memoryview(t.numpy()).cast("B")
        for p in self.socks:
            self.outgoing[p] += [(self.seq, memoryview(_HEAD.pack(self.seq, data.nbytes))),
                                 (self.seq, data)]
        self._guard(self._send_some)
        return _Work(self, t, self.seq)

    @property
    def unfinished(self) -> bool:
        """Whether an all-reduce was started and not waited for."""
        return self.seq > self.waited

    def break_off(self, why: str) -> None:
        """Calls were dropped unfinished (a failed step): the streams are out of step, so every
        later call fails (a new membership epoch forms a new group)."""
        if self.broken is None:
            self.broken = LocalReduceError(f"dense all-reduce: {why}")

    def close(self) -> None:
        self.break_off("the group was closed")
        for s in self.socks.values():
            close_socket(s)
        self._spare, self.outgoing = {}, {p: [] for p in self.socks}

    def _guard(self, fn, *args) -> None:
        if self.broken is not None:
            raise self.broken
        try:
            fn(*args)
        except LocalReduceError as e:
            self.broken = e
            raise

    def _send_some(self) -> None:
        """Send what each socket takes now (`_exchange` polls for the rest)."""
        for p, queue in self.outgoing.items():
            while queue:
                seq, view = queue[0]
                try:
                    n = self.socks[p].send(view)
                except BlockingIOError:
                    break
                except OSError as e:
                    raise self._lost(p, e) from None
                if n == view.nbytes:
                    queue.pop(0)
                else:
                    queue[0] = (seq, view[n:])

    def _lost(self, p: int, why) -> LocalReduceError:
        return LocalReduceError(f"dense all-reduce: worker {p} is gone ({why}); the workers "
                                "form a new group in the next membership epoch")

    def _poll(self, poller, deadline: float, late: list[int]) -> list:
        """The next events (none yet: []), polled a slice at a time; raises once a membership
        epoch is announced (a peer left for it) or `deadline` has passed."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise LocalReduceError(
                f"dense all-reduce: worker(s) {late} did not complete it in "
                f"{self.timeout_s:g} s (the RPC timeout); a worker is stuck or gone")
        events = poller.poll(min(left, POLL_SLICE_S) * 1000)
        if not events and self.abort():
            raise LocalReduceError("dense all-reduce: a membership epoch was announced; the "
                                   "workers form a new group in it")
        return events

    def _exchange(self, t: torch.Tensor, seq: int) -> None:
        """Finish sending this all-reduce (later ones may wait: the peers read those in their
        later waits), read every peer's buffer of it, add them in the tree's order."""
        key = (t.numel(), t.dtype)
        bufs = self._spare.pop(key, None) or {p: torch.empty_like(t) for p in self.socks}
        want = {p: _Incoming(memoryview(bufs[p].numpy()).cast("B")) for p in self.socks}
        deadline = time.monotonic() + self.timeout_s
        poller = select.poll()
        while True:
            self._send_some()
            owed = {p for p, q in self.outgoing.items() if q and q[0][0] <= seq}
            if not want and not owed:
                break
            masks = {p: (select.POLLIN if p in want else 0)
                     | (select.POLLOUT if p in owed else 0) for p in self.socks}
            for p, m in masks.items():
                if m:
                    poller.register(self.socks[p], m)
                else:
                    try:
                        poller.unregister(self.socks[p])
                    except KeyError:
                        pass
            for fd, ev in self._poll(poller, deadline, sorted(want) or sorted(owed)):
                p = self._peer[fd]
                if ev & select.POLLIN and p in want:
                    if self._read(p, want[p], seq):
                        del want[p]
                elif ev & (select.POLLHUP | select.POLLERR):
                    raise self._lost(p, "its end closed")
        peers = [bufs[p] for p in sorted(bufs)]
        ordered = peers[:self.rank] + [t] + peers[self.rank:]
        if self.size == 2:  # a + b, the same bits on both (addition commutes)
            t.add_(ordered[1 - self.rank])
        else:  # the PS's order: the tree over the ranks (psrpc/optim/treesum.py)
            out = self._scratch.like(t)(-1)
            t.copy_(tree_sum(leaves(ordered), out, self._scratch.like(t)))
        self._spare[key] = bufs
        self.waited = seq

    def _read(self, p: int, got: "_Incoming", seq: int) -> bool:
        """Read what peer p has sent of all-reduce `seq` into `got`: True once complete."""
        head_done = got.head_bytes == len(got.head)
        view = got.body[got.body_bytes:] if head_done else memoryview(got.head)[got.head_bytes:]
        try:
            n = self.socks[p].recv_into(view)
        except BlockingIOError:
            return False
        except OSError as e:
            raise self._lost(p, e) from None
        if not n:
            raise self._lost(p, "its end closed")
        if head_done:
            got.body_bytes += n
        else:
            got.head_bytes += n
            if got.head_bytes == len(got.head):
                their_seq, nbytes = _HEAD.unpack(got.head)
                if their_seq != seq or nbytes != got.body.nbytes:
                    raise LocalReduceError(
                        f"dense all-reduce: worker {p} sent all-reduce {their_seq} of {nbytes} "
                        f"bytes where {seq} of {got.body.nbytes} was due: the workers' buckets "
                        "differ")
        return got.head_bytes == len(got.head) and got.body_bytes == got.body.nbytes


@dataclass
class _Incoming:
    """One peer's message of an all-reduce as it arrives: its header, then its body (read
    straight into the buffer it is added from)."""

    body: memoryview
    head: bytearray = field(default_factory=lambda: bytearray(_HEAD.size))
    head_bytes: int = 0  # of the header, read so far
    body_bytes: int = 0  # of the body, read so far


class _Work:
    def __init__(self, group: LocalGroup, t: torch.Tensor, seq: int):
        self.group, self.t, self.seq, self.done = group, t, seq, False

    def wait(self) -> bool:
        if not self.done:
            self.group._guard(self.group._exchange, self.t, self.seq)
            self.done = True
        return True


def form(store, rank: int, size: int, timeout_s: float,
         abort=lambda: False) -> Optional[LocalGroup]:
    """This process's LocalGroup over `store` (a prefix of the epoch's), or None everywhere when
    the W processes are not on one host or cannot all reach each other. Gives up (raises) after
    `timeout_s` in all (one deadline: each connect and each peer's hello waits only for the
    time left to it), or as soon as `abort()` says the group will never form (a newer epoch)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = f"\0psrpc-reduce-{os.getpid()}-{secrets.token_hex(8)}"
    server.bind(address)
    server.listen(size)
    socks: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout_s
    try:
        store.set(f"addr/{rank}", f"{host_id()}\n{address}")
        peers = [store.get(f"addr/{p}").decode().split("\n", 1) for p in range(size)]
        if len({h for h, _ in peers}) != 1:
            return None
        failed = None
        for p in range(rank):  # connect to every lower rank, say who this is
            left = _time_left(abort, deadline, rank, timeout_s)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.settimeout(left)
                s.connect(peers[p][1])
                _check_peer(s)
                s.sendall(struct.pack("<Q", rank))
                socks[p] = s
            except (OSError, LocalReduceError) as e:
                close_socket(s)
                failed = f"rank {rank} could not reach rank {p}: {e}"
                break
        if failed is not None:
            store.set("failed", failed)
            return None
        server.settimeout(POLL_SLICE_S)
        while len(socks) < size - 1:  # accept every higher rank
            if store.check(["failed"]):
                return None
            _time_left(abort, deadline, rank, timeout_s)
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            try:
                conn.settimeout(_time_left(abort, deadline, rank, timeout_s))
                _check_peer(conn)  # (another user's connection is dropped, not an error)
                (p,) = struct.unpack("<Q", _recv_exact(conn, 8))
            except (OSError, LocalReduceError):
                close_socket(conn)
                continue
            if not rank < p < size or p in socks:
                close_socket(conn)
                raise LocalReduceError(f"dense all-reduce: a connection claimed rank {p}")
            socks[p] = conn
        store.set(f"ok/{rank}", "1")
        oks = [f"ok/{p}" for p in range(size)]
        while not store.check(oks):  # every rank connected, or one gave up
            if store.check(["failed"]):
                return None
            _time_left(abort, deadline, rank, timeout_s)
            time.sleep(0.002)
        for s in socks.values():
            s.setblocking(False)
        group, socks = LocalGroup(rank, size, socks, timeout_s, abort), {}
        return group
    finally:
        for s in socks.values():
            close_socket(s)
        server.close()


def _time_left(abort, deadline: float, rank: int, timeout_s: float) -> float:
    """Seconds left until `deadline`; raises once it has passed or `abort()` says so."""
    if abort():
        raise LocalReduceError("dense all-reduce: a newer membership epoch was announced while "
                               "the group formed")
    left = deadline - time.monotonic()
    if left <= 0:
        raise LocalReduceError(f"dense all-reduce: rank {rank} timed out after {timeout_s:g} s "
                               "waiting for the other workers to connect")
    return left


def _check_peer(sock: socket.socket) -> None:
    pid, uid = peer_uid(sock)
    if uid != os.getuid():
        raise LocalReduceError(f"dense all-reduce: pid {pid} of user {uid} connected")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        k = sock.recv(n - len(buf))
        if not k:
            raise LocalReduceError("dense all-reduce: a peer closed while the group formed")
        buf += k
    return buf

"""update.host_push: the workers of one host add their dense gradients there and one of them
pushes the sum to each shard on another host and hands the reply to the others, as BytePS's
local reduce does. Where W workers of a host each pushed a shard's gradient and took its
parameters back over the network, one push and one reply cross it: 1/W of the bytes.

Blocks: the sum must be the PS's own (the binary tree over the workers' indices,
psrpc/optim/treesum.py), so a host sums only an aligned block [j·2^s, (j+1)·2^s) of indices
whose workers all run on it: the block is a subtree, its sum goes into the PS's tree in its
place, and the round's bits are those of every worker pushing its own. Under torchrun and srun
the lowest ranks share a host, so the workers of a host fill such blocks whenever their count
is a power of two; a worker in no block of two or more pushes as before. The block's first
worker leads it.

Per step and shard: each other worker of the block sends its gradient (in the wire dtype) and
its loss and batch size to the leader over a Unix socket; the leader adds them in the tree's
order in float32, leaves out any that is not finite (that worker is excused from the round, its
batch skipped, as when it pushes a non-finite gradient itself), pushes the sum in the wire dtype
with a HostSum naming the workers in it, and sends the shard's reply to the others. A wire dtype
other than float32 rounds the host's sum once more than the PS's sum of separate pushes would.

Which shards: with `auto`, those whose PS runs on another host; with `on` also those of a PS on
this host reached over TCP (cluster.shm=off); never one whose gradients go through shared
memory. The block is formed again in each membership epoch, through the epoch's store prefix.

Failures: a member that dies closes its socket and the leader goes on without it, naming it
(`HostPush._lose`): the block sums the others, the dead worker's leaf of the tree absent, and
the PS counts it lost after update.timeout_s as it does any worker that stops pushing. A worker
lost for good is out of every later epoch's blocks (`block_of`). A leader that dies closes its
sockets: its members' calls fail at once, naming it. A live worker that sends nothing fails the
block after twice the RPC timeout (the leader waits for its round). Every pending and later call
of a broken block fails with one line; the worker meets it as a failed RPC (a membership change,
or the error stands).
"""

from __future__ import annotations

import logging
import math
import queue
import select
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Optional

import torch
import torch.distributed as dist
from torch.futures import Future

from psrpc.cluster import comm, localreduce, membership, shm
from psrpc.cluster import store as store_mod
from psrpc.cluster.topology import in_lockstep
from psrpc.cluster.wire import HostSum, Reply
from psrpc.errors import PsrpcError, first_line
from psrpc.optim.treesum import Scratch, tree_sum

log = logging.getLogger(__name__)
_GRAD = struct.Struct("<qqdqq")  # member -> leader: shard, version, loss, samples, bytes
_REPLY = struct.Struct("<qq??dqq?q")  # leader -> member: shard, version, accepted, finished,
# loss (NaN: none), samples, stale_dropped, skipped, bytes (< 0: a message follows instead)
_FAILED, _BROKEN = -1, -2  # its bytes: the push failed (for this shard); the leader broke the block


class HostPushError(PsrpcError):
    """A worker of the block died, closed its end, sent nonsense or nothing in time."""


class PeerGone(HostPushError):
    """The socket to worker `worker` closed or failed: that worker is gone."""

    def __init__(self, worker: int, why: str):
        super().__init__(f"host push: worker{worker} is gone ({why})")
        self.worker = worker


def block_of(index: int, hosts: list[Optional[str]]) -> Optional[tuple[int, int, list[int]]]:
    """(first index, level, workers) of the largest aligned block of 2^level indices holding
    `index` whose workers (those below W = len(hosts)) all run on its host, with two or more
    of them; None when there is none. A worker whose host is None is gone for good: an absent
    leaf, in no block, which does not split one (the tree leaves it out)."""
    best, level = None, 1
    while (1 << (level - 1)) < len(hosts):
        first = (index >> level) << level
        members = [w for w in range(first, min(first + (1 << level), len(hosts)))
                   if hosts[w] is not None]
        if any(hosts[w] != hosts[index] for w in members):
            break
        if len(members) >= 2:
            best = (first, level, members)
        level += 1
    return best


def host_of_process() -> str:
    """This process's host (run on a PS through RPC)."""
    return shm.host_id()


class HostPush:
    """This worker's part in its host's block for one membership epoch (`form` makes it)."""

    def __init__(self, index: int, first: int, level: int, members: list[int],
                 socks: dict[int, socket.socket], shards: list[bool], numels: list[int],
                 wire_dtype: torch.dtype, timeout_s: float):
        self.index, self.first, self.level, self.members = index, first, level, members
        self.shards, self.numels, self.wire_dtype = shards, numels, wire_dtype
        self.timeout_s = timeout_s
        self.leader = index == first
        self.socks = {first + p: s for p, s in socks.items()}  # worker index -> socket
        for s in self.socks.values():
            s.setblocking(True)
            s.settimeout(2 * timeout_s)
        self.broken: Optional[HostPushError] = None
        self._pending: "queue.Queue" = queue.Queue()  # member: (shard, Future) in send order
        self._futures: list[Future] = []  # not yet resolved (failed together when broken)
        self._lock = threading.Lock()
        self._sending = threading.Lock()  # leader: held while a message goes to a member
        self._bufs: dict[tuple[int, int], torch.Tensor] = {}  # (worker, shard) -> receive buffer
        self._out: dict[int, torch.Tensor] = {}  # leader: shard -> float32 sum
        self._wire: dict[int, torch.Tensor] = {}  # leader: shard -> the sum in the wire dtype
        self._scratch = Scratch()
        self._send = ThreadPoolExecutor(1, thread_name_prefix="psrpc-hostpush-send")
        self._recv = ThreadPoolExecutor(1, thread_name_prefix="psrpc-hostpush-recv")
        if not self.leader:
            self._recv.submit(self._replies)

    def describe(self) -> str:
        return (f"workers {self.members[0]}-{self.members[-1]} push as one, led by "
                f"worker{self.first}")

    # -- a step --------------------------------------------------------------------------------
    def push(self, client, k: int, version: int, grad: torch.Tensor, loss: float,
             samples: int) -> Future:
        """Shard k's gradient of this worker into the block's push; the Future of its Reply."""
        fut: Future = Future()
        with self._lock:
            if self.broken is not None:
                fut.set_exception(self.broken)
                return fut
            self._futures.append(fut)
        if self.leader:
            self._recv.submit(self._guarded, self._gather, client, k, version, grad, loss,
                              samples, fut)
        else:
            self._pending.put((k, fut))
            self._send.submit(self._guarded, self._send_grad, k, version, grad, loss, samples)
        return fut

    def _send_grad(self, k: int, version: int, grad: torch.Tensor, loss: float,
                   samples: int) -> None:
        """Member: a gradient to the leader. A send that fails (the leader closed the socket)
        breaks nothing here: the reader, waiting for this push's reply, reads why from the
        same socket (the leader's farewell, or its closed end) and breaks the block with it."""
        data = _bytes(grad)
        sock = self.socks[self.first]
        try:
            sock.sendall(_GRAD.pack(k, version, loss, samples, data.nbytes))
            sock.sendall(data)
        except OSError:
            pass

    def _gather(self, client, k: int, version: int, grad: torch.Tensor, loss: float,
                samples: int, fut: Future) -> None:
        """Leader: read the block's gradients of shard k, add them, push the sum (the reply is
        handed on by `_hand_on`)."""
        given = {self.index: (grad, loss, samples)}
        for w in self.members[1:]:
            try:
                given[w] = self._receive(w, k, version)
            except PeerGone as e:  # the block goes on without it: its leaf of the tree absent
                self._lose(e)
        summed = [w for w in self.members if w in given and math.isfinite(given[w][1])]
        total, finite = self._sum(k, given, summed)
        if not finite:  # some gradient is not finite: which ones, and the others' sum (should
            # that overflow, the PS finds it not finite and excuses them all)
            summed = [w for w in summed if _finite(given[w][0])]
            total, _ = self._sum(k, given, summed)
        excused = tuple(w for w in given if w not in summed)
        if summed:
            mean_loss = sum(given[w][1] for w in summed) / len(summed)
        else:  # every gradient was non-finite: the PS excuses them all
            total, mean_loss = grad, float("nan")
        host = HostSum(self.level, tuple(summed), tuple(float(given[w][1]) for w in summed),
                       excused)
        rpc = client.push_one(k, version, total, mean_loss, sum(given[w][2] for w in summed),
                              host=host)
        self._send.submit(self._guarded, self._hand_on, k, rpc, fut, excused)

    def _receive(self, w: int, k: int, version: int) -> tuple:
        """Leader: worker w's (gradient of shard k, loss, samples) for step `version`."""
        k2, v2, loss, samples, nbytes = _GRAD.unpack(self._read(w, _GRAD.size))
        buf = self._buf(w, k)
        if (k2, v2, nbytes) != (k, version, buf.numel() * buf.element_size()):
            raise HostPushError(f"host push: worker{w} sent shard {k2} of step {v2} "
                                f"({nbytes} bytes) where shard {k} of step {version} was "
                                "due: the block's workers are out of step")
        self._read_into(w, _bytes(buf))
        return buf, loss, samples

    def _lose(self, gone: PeerGone) -> None:
        """Leader: a worker of the block is gone (its socket closed: it died). The others go
        on as a block without it, as the tree does with its leaf absent (the PS counts it lost
        after update.timeout_s, as any worker that stops pushing); it is never waited for or
        written to again. Where the launcher starts it again, the next membership epoch forms
        the block anew."""
        with self._lock:
            if gone.worker not in self.members:
                return
            self.members = [w for w in self.members if w != gone.worker]
        log.warning("%s; the block goes on without it: %s", gone, self.describe())

    def _sum(self, k: int, given: dict, workers: list[int]) -> tuple:
        """(The tree sum of `workers`' gradients of shard k in the wire dtype, whether it is
        finite). A finite sum has no NaN or Inf in any of its gradients: one check of the sum
        instead of one of each (one gradient alone is the PS's to check)."""
        if not workers:
            return None, True
        out = self._out.get(k)
        if out is None:
            out = self._out[k] = torch.empty(self.numels[k], dtype=torch.float32)
        total = tree_sum([(w, 0, given[w][0]) for w in workers], out, self._scratch.like(out))
        finite = len(workers) == 1 or _finite(total)
        if total.dtype != self.wire_dtype:
            wire = self._wire.get(k)
            if wire is None:
                wire = self._wire[k] = torch.empty(self.numels[k], dtype=self.wire_dtype)
            total = wire.copy_(total)
        return total, finite

    def _hand_on(self, k: int, rpc: Future, fut: Future, excused: tuple) -> None:
        """Leader: shard k's reply to every worker of the block, then to this one."""
        try:
            reply = rpc.wait()
        except Exception as e:  # the push failed: each worker of the block fails with it
            msg = first_line(e).encode()[:4096]
            for w in self.members[1:]:
                self._send_to(w, _REPLY.pack(k, 0, False, False, 0.0, 0, 0, False, _FAILED),
                              struct.pack("<q", len(msg)) + msg)
            self._resolve(fut, error=e)
            return
        data = _bytes(reply.params.contiguous())
        for w in self.members[1:]:
            mine = _own(reply, w in excused)
            self._send_to(w, _REPLY.pack(
                k, mine.version, mine.accepted, mine.finished,
                float("nan") if mine.loss is None else mine.loss, mine.samples,
                mine.stale_dropped, mine.skipped, data.nbytes), data)
        self._resolve(fut, _own(reply, self.index in excused))

    def _send_to(self, w: int, header: bytes, data) -> None:
        """Leader: a message to worker w; one that is gone leaves the block (`_lose`)."""
        try:
            with self._sending:
                self.socks[w].sendall(header)
                self.socks[w].sendall(data)
        except socket.timeout:  # alive, reading nothing: the block breaks (`_guarded`)
            raise
        except OSError as e:
            self._lose(PeerGone(w, first_line(e)))

    def _replies(self) -> None:
        """Member: each reply the leader hands on, in the order the pushes went out."""
        try:
            while True:
                k, fut = self._pending.get()
                if fut is None:
                    return
                (k2, version, accepted, finished, loss, samples, stale, skipped,
                 nbytes) = _REPLY.unpack(self._read(self.first, _REPLY.size))
                if nbytes == _BROKEN:
                    why = self._message().removeprefix("host push: ")
                    raise HostPushError(f"host push: worker{self.first}, the block's leader, "
                                        f"broke the block: {why}")
                if nbytes < 0:
                    self._resolve(fut, error=PsrpcError(f"host push: the push of worker"
                                                        f"{self.first} failed: "
                                                        f"{self._message()}"))
                    continue
                buf = self._buf(self.first, k2)
                if k2 != k or nbytes != buf.numel() * buf.element_size():
                    raise HostPushError(f"host push: worker{self.first} handed on shard {k2} "
                                        f"({nbytes} bytes) where shard {k}'s reply was due")
                self._read_into(self.first, _bytes(buf))
                self._resolve(fut, Reply(version, buf, accepted, finished,
                                         None if math.isnan(loss) else loss, samples, stale,
                                         skipped))
        except Exception as e:
            self._break(e)

    # -- plumbing ------------------------------------------------------------------------------
    def _message(self) -> str:
        """Member: the leader's message that follows a reply header with negative bytes."""
        (n,) = struct.unpack("<q", self._read(self.first, 8))
        return self._read(self.first, n).decode(errors="replace")

    def _buf(self, w: int, k: int) -> torch.Tensor:
        buf = self._bufs.get((w, k))
        if buf is None:
            buf = self._bufs[(w, k)] = torch.empty(self.numels[k], dtype=self.wire_dtype)
        return buf

    def _read(self, w: int, n: int) -> bytes:
        out = bytearray(n)
        self._read_into(w, memoryview(out))
        return bytes(out)

    def _read_into(self, w: int, view: memoryview) -> None:
        """Read `view` full from worker w; a wait gives up at once where a membership epoch was
        announced (the peer may have left for it: the block forms anew there)."""
        got, sock = 0, self.socks[w]
        deadline = time.monotonic() + 2 * self.timeout_s
        while got < view.nbytes:
            if not select.select([sock], [], [], localreduce.POLL_SLICE_S)[0]:
                if membership.changing():
                    raise HostPushError("host push: a membership epoch was announced; the "
                                        "block forms anew in it")
                if time.monotonic() > deadline:
                    raise HostPushError(f"host push: worker{w} sent nothing in "
                                        f"{2 * self.timeout_s:g} s (twice the RPC timeout)")
                continue
            try:
                n = sock.recv_into(view[got:])
            except OSError as e:
                raise PeerGone(w, str(e)) from None
            if not n:
                raise PeerGone(w, "its end closed")
            got += n

    def _resolve(self, fut: Future, value=None, error: Optional[BaseException] = None) -> None:
        with self._lock:
            if fut not in self._futures:
                return
            self._futures.remove(fut)
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)

    def _guarded(self, fn, *args) -> None:
        if self.broken is not None:
            return
        try:
            fn(*args)
        except Exception as e:
            self._break(e)

    def _break(self, e: Exception) -> None:
        """Every pending and later call fails with one line; the sockets close (the peers'
        calls fail at once)."""
        with self._lock:
            if self.broken is None:
                self.broken = e if isinstance(e, HostPushError) else HostPushError(
                    f"host push: {first_line(e)}")
            pending, self._futures = self._futures, []
        self._farewell()
        for s in self.socks.values():
            shm.close_socket(s)
        for fut in pending:
            fut.set_exception(self.broken)

    def _farewell(self) -> None:
        """Leader: tell each member why the block broke before its socket closes (reading only
        the closed end, it would name this live leader gone). Not while a reply is on its way
        (the send thread holds the sockets): those members read the closed end."""
        if not self.leader or not self._sending.acquire(blocking=False):
            return
        why = str(self.broken).encode()[:4096]
        notice = (_REPLY.pack(-1, 0, False, False, 0.0, 0, 0, False, _BROKEN)
                  + struct.pack("<q", len(why)) + why)
        try:
            for w in self.members[1:]:
                try:
                    self.socks[w].settimeout(1.0)
                    self.socks[w].sendall(notice)
                except OSError:  # gone too: it reads nothing
                    pass
        finally:
            self._sending.release()

    def close(self) -> None:
        self._break(HostPushError("host push: the block was closed (a new membership epoch)"))
        self._pending.put((None, None))
        self._send.shutdown(wait=False)
        self._recv.shutdown(wait=False)


def _finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in `t` (one float32 sum: they propagate into it)."""
    return bool(torch.isfinite(t.sum(dtype=torch.float32)))


def _bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, in place (numpy has no bfloat16: seen as bytes)."""
    return memoryview(t.view(torch.uint8).numpy())


def _own(reply: Reply, excused: bool) -> Reply:
    """A worker's view of the block's reply: an excused one's batch was skipped."""
    return replace(reply, accepted=False, skipped=True) if excused else reply


def form(cfg, index: int, workers: int, shards: list, shm_modes: list, numels: list[int],
         wire_dtype: torch.dtype) -> Optional[HostPush]:
    """This epoch's HostPush for worker `index` of `workers`, or None: host push off, no
    block of two or more on this host, or no shard it would push. Every worker of a block
    decides alike (the same hosts, the same plan)."""
    mode = cfg.update.host_push
    if mode == "off" or not in_lockstep(cfg) or cfg.update.dense != "ps" or workers < 2:
        return None
    timeout_s = comm.rpc_timeout_s(cfg)
    store = store_mod.abortable(membership.changing, timeout_s)
    prefix = membership.group_prefix("hostpush")
    here = shm.host_id()
    store.set(f"{prefix}host/{index}", here)
    block = block_of(index, _hosts(store, prefix, workers))
    if block is None:
        return None
    names = [comm.owner_name(h) for h in shards]
    owners = {name: comm.call_sync(name, host_of_process, timeout_s=timeout_s)
              for name in set(names)}
    which = [shm_modes[k] is None and (mode == "on" or owners[name] != here)
             for k, name in enumerate(names)]
    if not any(which):
        return None
    first, level, members = block
    group = localreduce.form(dist.PrefixStore(f"{prefix}block{first}/", store), index - first,
                             len(members), timeout_s, membership.changing)
    if group is None:  # a worker of the block could not reach another: each pushes its own
        log.warning("host push: the workers %d-%d could not connect; each pushes its own",
                    members[0], members[-1])
        return None
    socks, group.socks = group.socks, {}
    return HostPush(index, first, level, members, socks, which, numels, wire_dtype, timeout_s)


def _hosts(store, prefix: str, workers: int) -> list[Optional[str]]:
    """Each worker's host as it published it in this epoch; None for a worker gone for good
    (out of the epoch: it publishes nothing)."""
    gone = set(membership.gone(membership.current()))
    return [None if f"worker{w}" in gone else store.get(f"{prefix}host/{w}").decode()
            for w in range(workers)]


class Blocks:
    """A worker's block for the current membership epoch, formed on its first step (`form`)."""

    def __init__(self):
        self.block: Optional[HostPush] = None
        self.key: Optional[str] = None

    def current(self, cfg, index: int, workers: int, shards: list, flat, numels: list[int],
                stats) -> Optional[HostPush]:
        key = membership.group_prefix("hostpush")
        if key != self.key:
            self.close()
            self.key = key
            self.block = form(cfg, index, workers, shards, flat.shm, numels, flat.wire_dtype)
            if self.block is not None:
                stats.host_push = self.block.describe()
                log.info("worker%d: %s", index, stats.host_push)
        return self.block

    def close(self) -> None:
        if self.block is not None:
            self.block.close()
            self.block = None

"""A side channel for a worker's per-step table pushes to a PS on its own host: one Unix socket
per (worker, PS) pair instead of TensorPipe (`cluster.shm` auto or on).

A table push and its reply are a few tens of kilobytes. Over TensorPipe each wakes an event
loop and hands over to the RPC thread pool and back, on both sides: on 2 cores with two workers
and a PS that took about a third of a core. Here the worker writes the pickled calls to the
socket; the PS runs them as an RPC would (`_call_local`, the same objects and Futures) and
writes the results back when they complete; a thread of the worker completes its Futures.

What it keeps of RPC's guarantees:
- **Timeouts**: a call with no reply after `timeout_s` fails with a message naming the PS, as an
  RPC's would; a late reply is dropped.
- **A dead peer**: the kernel closes a dead process's socket, even on SIGKILL, so the other side
  reads end-of-file at once: a worker's calls in flight fail (and the worker rejoins as after any
  failed RPC), a PS's thread for a dead worker ends.
- **Membership epochs**: a worker asks the PS for its channel's address through RPC whenever it
  builds its table client, so a PS started again is reached at its new address.
- **Who may call**: the socket is in Linux's abstract namespace (no file to clean up, gone with
  the process), and the PS serves only connections from its own user id (SO_PEERCRED): a pickle
  is code, and TensorPipe's listener is the wider door (docs/security.md).

Tensors cross as NumPy arrays inside the pickle (bfloat16 and CUDA ones as pickle does them).
A message over 1 MB goes over TensorPipe (its cross-memory reads beat two socket copies there,
benchmarks.doorbell), as does every push where the socket cannot be reached (another host).
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import secrets
import select
import socket
import struct
import threading
import time
from dataclasses import fields, is_dataclass, replace
from typing import Optional

import torch
from torch.futures import Future

from psrpc.cluster import comm
from psrpc.cluster.shm import close_socket, host_id, peer_uid
from psrpc.errors import PsrpcError, first_line

log = logging.getLogger("psrpc")
_HEAD = struct.Struct("<QQ")  # a message: its pickle's length and its sequence number, then it
LARGE = 1 << 20  # bytes: a message past this goes over TensorPipe (see SideChannel.invoke_many)
MAX_MESSAGE = 1 << 31  # a length past this is a corrupt stream, not a message
POLL_S = 0.5  # how often a worker's reader looks for calls past their deadline


class _Array:
    """A CPU tensor crossing as a NumPy array (pickled into the message's own bytes)."""

    __slots__ = ("a",)

    def __init__(self, a):
        self.a = a

    def __reduce__(self):
        return (_Array, (self.a,))


def _walk(obj, leaf):
    """`obj` with `leaf(x)` in place of each x for which it is not None, through tuples, lists,
    dicts and dataclasses."""
    if (out := leaf(obj)) is not None:
        return out
    if isinstance(obj, (tuple, list)):
        return type(obj)(_walk(x, leaf) for x in obj)
    if isinstance(obj, dict):
        return {k: _walk(v, leaf) for k, v in obj.items()}
    if is_dataclass(obj) and not isinstance(obj, type):
        return replace(obj, **{f.name: _walk(getattr(obj, f.name), leaf) for f in fields(obj)})
    return obj


def _as_array(x):
    if isinstance(x, torch.Tensor):
        if x.device.type == "cpu" and x.dtype != torch.bfloat16 and not x.requires_grad:
            return _Array(x.numpy())
        return x
    return None


def pack(obj, size: Optional[list] = None):
    """`obj` with its CPU tensors as `_Array`s; `size[0]`, where given, gets the bytes of every
    tensor in it added."""
    def leaf(x):
        if size is not None and isinstance(x, torch.Tensor):
            size[0] += x.numel() * x.element_size()
        return _as_array(x)
    return _walk(obj, leaf)


def unpack(obj):
    """The inverse of `pack` (the tensors share the arrays' memory)."""
    return _walk(obj, lambda x: torch.from_numpy(x.a) if isinstance(x, _Array) else None)


def _send(sock: socket.socket, lock: threading.Lock, seq: int, body: bytes) -> None:
    with lock:
        sock.sendall(_HEAD.pack(len(body), seq) + body)


def _read(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError("the peer closed the channel")
        got += k
    return buf


def _receive(sock: socket.socket) -> tuple:
    """(sequence number, unpickled body) of the next message."""
    n, seq = _HEAD.unpack(_read(sock, _HEAD.size))
    if n > MAX_MESSAGE:
        raise EOFError(f"a message of {n} bytes: the stream is corrupt")
    return seq, pickle.loads(_read(sock, n))


# -- the PS's side -------------------------------------------------------------------------------
_address: Optional[str] = None
_listen_lock = threading.Lock()


def listen() -> tuple[str, str]:
    """(this process's channel address, its host): the listener starts on the first call. Run
    on the PS through RPC."""
    global _address
    with _listen_lock:
        if _address is None:
            name = f"\0psrpc-{os.getpid()}-{secrets.token_hex(8)}"
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(name)
            server.listen(64)
            threading.Thread(target=_accept, args=(server,), daemon=True,
                             name="psrpc-sidechannel").start()
            _address = name
    return _address, host_id()


_served: set[socket.socket] = set()  # the PS's connections to workers, open now
_served_lock = threading.Lock()


def _drop_all() -> None:
    """Leaving the RPC group closes every channel, as RPC's calls fail (the listener stays)."""
    for ch in list(_open.values()):  # first: its calls fail for this reason, not the EOF
        ch.close()
    with _served_lock:
        served = list(_served)
    for conn in served:
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


comm.on_leave(_drop_all)


def _accept(server: socket.socket) -> None:
    while True:
        try:
            conn, _ = server.accept()
            pid, uid = peer_uid(conn)
        except OSError as e:  # out of descriptors, a peer gone before its accept: go on
            log.warning("side channel: accept failed: %s", first_line(e))
            time.sleep(0.1)
            continue
        if uid != os.getuid():
            log.warning("side channel: refused a connection from pid %d of user %d", pid, uid)
            conn.close()
            continue
        with _served_lock:
            _served.add(conn)
        threading.Thread(target=_serve, args=(conn,), daemon=True,
                         name="psrpc-sidechannel-peer").start()


def _serve(conn: socket.socket) -> None:
    """One worker's messages, each call run as an RPC's (`comm._call_local`). A reply ready
    in this thread (the round this push closed, an async apply) goes out from here; one
    completed by another thread (another worker's push closing the round) goes through this
    connection's writer thread, so that thread never waits on this worker's socket."""
    lock, me = threading.Lock(), threading.get_ident()
    replies: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_write, args=(conn, lock, replies), daemon=True,
                     name="psrpc-sidechannel-writer").start()

    def done(seq, collected, futures):
        if threading.get_ident() == me:
            _reply(conn, lock, seq, collected, futures)
        else:
            replies.put((seq, collected, futures))

    try:
        while True:
            seq, calls = _receive(conn)
            futures = [comm._call_local(key, method, unpack(args)) for key, method, args in calls]
            torch.futures.collect_all(futures).then(
                lambda f, seq=seq, futures=futures: done(seq, f, futures))
    except Exception as e:  # (the end of the stream, or one that makes no sense: close it)
        if not isinstance(e, EOFError) or "closed" not in str(e):
            log.warning("side channel: a worker's connection ended: %s", first_line(e))
    finally:
        replies.put(None)
        with _served_lock:
            _served.discard(conn)
        close_socket(conn)


def _write(conn: socket.socket, lock: threading.Lock, replies: queue.SimpleQueue) -> None:
    while (item := replies.get()) is not None:
        _reply(conn, lock, *item)


def _reply(conn: socket.socket, lock: threading.Lock, seq: int, collected: Future,
           futures: list) -> None:
    """Send a message's results (`collected`: its calls' Futures collected), or the first
    error among them (as comm.invoke_many's, its own type kept): (True, results) or
    (False, error)."""
    try:
        collected.wait()
        out = (True, pack([f.value() for f in futures]))
    except Exception as e:
        out = (False, _portable(e))
    try:
        body = pickle.dumps(out, protocol=5)
    except Exception as e:  # a result that does not pickle: say so, never leave it unanswered
        body = pickle.dumps((False, PsrpcError(f"a reply did not pickle: {first_line(e)}")))
    try:
        _send(conn, lock, seq, body)
    except OSError:
        pass  # the worker is gone (its reader saw the end) or the connection was shut


def _portable(e: BaseException) -> BaseException:
    """`e` if it pickles and unpickles, else a PsrpcError with its message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return PsrpcError(f"{type(e).__name__}: {e}")


# -- a worker's side -----------------------------------------------------------------------------
class SideChannel:
    """A worker's connection to one PS: `invoke_many` as comm.invoke_many, over the socket.
    `messages`: how many went through it (not over TensorPipe)."""

    def __init__(self, owner: str, address: str, timeout_s: float):
        self.owner, self.address, self.timeout_s = owner, address, timeout_s
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(address)
        if peer_uid(self.sock)[1] != os.getuid():  # (a name in the abstract namespace is
            self.sock.close()                       # public: whoever holds it now)
            raise ConnectionRefusedError(f"{address[1:]} is held by another user")
        self.sock.settimeout(timeout_s)  # a PS stopped mid-message ends a send or a read too
        self.lock = threading.Lock()  # the state below (never held while the socket blocks)
        self.send_lock = threading.Lock()
        self.pending: dict[int, tuple[Future, float, float]] = {}  # seq -> (Future, deadline,
        self.seq, self.messages, self.closed = 0, 0, None  # its timeout); closed: why
        threading.Thread(target=self._read, daemon=True, name="psrpc-sidechannel").start()

    def invoke_many(self, calls: list, timeout_s: Optional[float] = None) -> Future:
        """Calls `(handle, method, args)` to objects of the PS: a Future of their results. A
        message over LARGE bytes goes over TensorPipe, whose cross-memory reads beat copying
        it through the socket."""
        assert all(h.owner == self.owner for h, _, _ in calls), "one owner per message"
        fut: Future = Future()
        timeout = self.timeout_s if timeout_s is None else timeout_s
        size = [0]
        packed = [(h.key, m, pack(a, size)) for h, m, a in calls]
        if size[0] > LARGE:  # (not pickled first to find out: a large shard's update, tens of MB)
            return comm.invoke_many(calls, timeout)
        body = pickle.dumps(packed, protocol=5)
        if len(body) > LARGE:
            return comm.invoke_many(calls, timeout)
        with self.lock:
            if self.closed is not None:
                fut.set_exception(PsrpcError(f"the side channel to {self.owner} is closed: "
                                             f"{self.closed}"))
                return fut
            self.seq += 1
            self.messages += 1
            seq = self.seq
            self.pending[seq] = (fut, time.monotonic() + timeout, timeout)
        try:
            _send(self.sock, self.send_lock, seq, body)
        except OSError as e:
            self._close(f"sending failed: {first_line(e)}")
        return fut

    def _read(self) -> None:
        why = "its reader stopped"
        try:
            poller = select.poll()  # (not select(): it fails on descriptors past 1023)
            poller.register(self.sock, select.POLLIN)
            while True:
                if not poller.poll(POLL_S * 1000):
                    self._expire()
                    continue
                seq, out = _receive(self.sock)
                with self.lock:
                    fut = self.pending.pop(seq, (None,))[0]
                if fut is not None:  # (None: it timed out before)
                    ok, value = out
                    if ok:
                        fut.set_result(unpack(value))
                    else:
                        fut.set_exception(value)
                self._expire()
        except Exception as e:  # the end of the stream, or one that makes no sense
            why = f"{self.owner} is gone ({first_line(e)})"
        finally:
            self._close(why)

    def _expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            late = [s for s, (_, t, _) in self.pending.items() if t < now]
            expired = [self.pending.pop(s) for s in late]
        for fut, _, timeout in expired:
            fut.set_exception(PsrpcError(f"no reply from {self.owner} within {timeout:g} s "
                                         "(side channel)"))

    def _close(self, why: str) -> None:
        with self.lock:
            if self.closed is None:
                self.closed = why
            futures, self.pending = [f for f, _, _ in self.pending.values()], {}
        for fut in futures:
            fut.set_exception(PsrpcError(f"the side channel to {self.owner} closed: {why}"))
        close_socket(self.sock)

    def close(self) -> None:
        self._close("closed by this worker (it left its RPC group)")


_open: dict[str, SideChannel] = {}  # owner -> this process's channel to it


def channels_to(shards: list, timeout_s: float) -> list[Optional[SideChannel]]:
    """Per shard (a comm.Handle), the channel to its PS, or None where there is none (another
    host; an RRef)."""
    by_owner: dict[str, Optional[SideChannel]] = {}
    out = []
    for h in shards:
        owner = getattr(h, "owner", None)
        if not isinstance(owner, str):  # (an RRef's owner is a method)
            out.append(None)
            continue
        if owner not in by_owner:
            by_owner[owner] = connect(owner, timeout_s)
        out.append(by_owner[owner])
    return out


def connect(owner: str, timeout_s: float) -> Optional[SideChannel]:
    """A channel to `owner` when it runs on this host and answers, else None (TensorPipe). The
    open one is kept while `owner` is the same process (the same address)."""
    try:
        address, host = comm.call_sync(owner, listen, timeout_s=timeout_s)
    except Exception as e:
        log.info("side channel to %s: not offered (%s); pushes go over TensorPipe", owner,
                 first_line(e))
        return None
    if host != host_id():
        return None
    old = _open.pop(owner, None)
    if old is not None and old.address == address and old.closed is None:
        _open[owner] = old
        return old
    if old is not None:
        old.close()
    try:
        _open[owner] = SideChannel(owner, address, timeout_s)
    except OSError as e:  # another network namespace, say
        log.info("side channel to %s: cannot connect (%s); pushes go over TensorPipe", owner,
                 first_line(e))
        return None
    return _open[owner]

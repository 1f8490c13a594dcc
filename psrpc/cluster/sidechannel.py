"""A side channel for a worker's per-step table pushes to a PS on its own host: one Unix socket
per (worker, PS) pair instead of TensorPipe (`cluster.shm` auto or on). A PS uses it the same
way for its shards' updates to their backups on another PS of its host.

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

A message may also carry calls with no reply (`SideChannel.send`, sequence number ONEWAY, or
LAZY where the receiver may leave it queued up to LAZY_S and read it with the next ones): a PS
sends a shard's update to its backup on the same host that way (psrpc/ps/replicas.py). Once sent, it
is in the receiver's socket, which the kernel keeps for the receiver even when the sender dies;
`settle` waits until the receiver has taken everything queued there.

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
import threading
import time
from typing import Optional

import torch
from torch.futures import Future

from psrpc.cluster import comm
from psrpc.cluster.frames import (HEAD, LAZY, ONEWAY, Large, dumps, portable, queued, read_exact,
                                  receive, send)
from psrpc.cluster.shm import close_socket, host_id, peer_uid
from psrpc.errors import PsrpcError, first_line

log = logging.getLogger("psrpc")
LARGE = 1 << 20  # bytes: a message past this goes over TensorPipe (see SideChannel.invoke_many)
POLL_S = 0.5  # how often a worker's reader looks for calls past their deadline
LAZY_S = 0.02  # how long a reader leaves lazy messages in its socket before it reads them
SNDBUF = 4 << 20  # bytes a sender may queue (as far as net.core.wmem_max allows)


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
            server.setblocking(False)  # (accepted only once select says one waits)
            _listening.append(server)
            threading.Thread(target=_accept, args=(server,), daemon=True,
                             name="psrpc-sidechannel").start()
            _address = name
    return _address, host_id()


_served: dict = {}  # the PS's connections (to workers, to other PS) open now -> their _Peer
_served_lock = threading.Lock()  # also held from a connection's accept to its _Peer
_listening: list = []  # the listener (settle asks it whether a connection waits to be accepted)


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
        select.select([server], [], [])
        with _served_lock:  # (settle sees the connection waiting, or served: never between)
            try:
                conn, _ = server.accept()
                conn.setblocking(True)
                pid, uid = peer_uid(conn)
            except BlockingIOError:  # (its peer gave up meanwhile)
                continue
            except OSError as e:  # out of descriptors, a peer gone before its accept: go on
                log.warning("side channel: accept failed: %s", first_line(e))
                time.sleep(0.1)
                continue
            if uid == os.getuid():
                _served[conn] = _Peer(conn)
        if uid != os.getuid():
            log.warning("side channel: refused a connection from pid %d of user %d", pid, uid)
            conn.close()
            continue
        threading.Thread(target=_serve, args=(conn,), daemon=True,
                         name="psrpc-sidechannel-peer").start()


class _Peer:
    """A connection served: its reader waits with nothing queued (`idle`), or the stream ended."""

    def __init__(self, conn: socket.socket):
        self.conn, self.idle, self.ended = conn, True, threading.Event()

    def settled(self) -> bool:
        """Every message it brought is taken: the stream ended, or nothing is queued on it and
        its reader waits for the next (a message's header read means idle no more)."""
        if self.ended.is_set():
            return True
        if not self.idle:
            return False
        try:
            waiting = queued(self.conn)
        except OSError:  # (closed meanwhile)
            return self.ended.is_set()
        return waiting == 0 and self.idle


def settle(timeout_s: float = 30.0) -> None:
    """Until every message with no reply (`SideChannel.send`) queued here has been taken: each
    connection's stream ended, or nothing is queued on it and its reader waits for the next. A
    promoted backup first reads what its dead primary left in the socket (every connection, not
    only the ones that brought it messages before: the first one may still be queued; and one
    still waiting to be accepted)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with _served_lock:
            peers = list(_served.values())
            waiting = bool(_listening) and bool(select.select(_listening, [], [], 0)[0])
        if not waiting and all(p.settled() for p in peers):
            return
        if time.monotonic() > deadline:
            raise PsrpcError(f"side channel: the messages queued here were not all taken "
                             f"within {timeout_s:g} s")
        time.sleep(0.001)


def _serve(conn: socket.socket) -> None:
    """One peer's messages, each call run as an RPC's (`comm._call_local`). A reply ready
    in this thread (the round this push closed, an async apply) goes out from here; one
    completed by another thread (another worker's push closing the round) goes through this
    connection's writer thread, so that thread never waits on this worker's socket. A message
    with no reply (sequence number 0, `SideChannel.send`) is run to its end before the next
    is read (a receiver that falls behind fills the socket and slows its sender); a call of it
    that fails closes the connection, so that its sender learns of it at its next send."""
    lock, me = threading.Lock(), threading.get_ident()
    replies: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_write, args=(conn, lock, replies), daemon=True,
                     name="psrpc-sidechannel-writer").start()
    with _served_lock:
        peer = _served.get(conn) or _Peer(conn)

    def done(seq, collected, futures):
        if threading.get_ident() == me:
            _reply(conn, lock, seq, collected, futures)
        else:
            replies.put((seq, collected, futures))

    try:
        while True:
            peer.idle = True
            head = read_exact(conn, HEAD.size)
            peer.idle = False
            seq, calls = receive(conn, head)
            futures = [comm._call_local(key, method, args) for key, method, args in calls]
            if seq in (ONEWAY, LAZY):
                for f in futures:
                    f.wait()  # (raises the call's error: the connection closes)
                if seq == LAZY and not queued(conn):
                    peer.idle = True  # (settled meanwhile, unless something is queued)
                    time.sleep(LAZY_S)  # the next ones are read together, no wake-up each
                continue
            torch.futures.collect_all(futures).then(
                lambda f, seq=seq, futures=futures: done(seq, f, futures))
    except Exception as e:  # (the end of the stream, or one that makes no sense: close it)
        if not isinstance(e, EOFError) or "closed" not in str(e):
            log.warning("side channel: a connection ended: %s", first_line(e))
    finally:
        replies.put(None)
        peer.ended.set()
        with _served_lock:
            _served.pop(conn, None)
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
        out = (True, [f.value() for f in futures])
    except Exception as e:
        out = (False, portable(e))
    try:
        body = dumps(out)
    except Exception as e:  # a result that does not pickle: say so, never leave it unanswered
        body = pickle.dumps((False, PsrpcError(f"a reply did not pickle: {first_line(e)}")))
    try:
        send(conn, lock, seq, body)
    except OSError:
        pass  # the worker is gone (its reader saw the end) or the connection was shut


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
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)  # (lazy messages
        # wait here while the PS reads others: a full buffer would make `send` wait)
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
        try:  # (a large shard's update, tens of MB: not pickled whole only to find out)
            body = dumps([(h.key, m, a) for h, m, a in calls], LARGE)
        except Large:
            return comm.invoke_many(calls, timeout)
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
            send(self.sock, self.send_lock, seq, body)
        except OSError as e:
            self._close(f"sending failed: {first_line(e)}")
        return fut

    def send(self, calls: list, lazy: bool = False) -> bool:
        """Calls `(handle, method, args)` with no reply, at any size: the PS runs them in order,
        answers nothing, and closes the channel where one fails. Once this returns (True) the
        message is in the PS's socket, which the kernel keeps for the PS even if this process
        dies at once (`settle` there waits until it is taken). `lazy`: the PS need not run
        them at once; it reads such messages every LAZY_S, several at a time, rather than
        waking for each (a message sent meanwhile, lazy or not, waits for that read). Raises
        PsrpcError where the channel is closed or the send fails."""
        assert all(h.owner == self.owner for h, _, _ in calls), "one owner per message"
        body = dumps([(h.key, m, a) for h, m, a in calls])
        with self.lock:
            closed = self.closed
            self.messages += closed is None
        if closed is not None:
            raise PsrpcError(f"the side channel to {self.owner} is closed: {closed}")
        try:
            send(self.sock, self.send_lock, LAZY if lazy else ONEWAY, body)
        except OSError as e:
            self._close(f"sending failed: {first_line(e)}")
            raise PsrpcError(f"the side channel to {self.owner}: sending failed: "
                             f"{first_line(e)}") from None
        return True

    def _read(self) -> None:
        why = "its reader stopped"
        try:
            poller = select.poll()  # (not select(): it fails on descriptors past 1023)
            poller.register(self.sock, select.POLLIN)
            while True:
                if not poller.poll(POLL_S * 1000):
                    self._expire()
                    continue
                seq, out = receive(self.sock)
                with self.lock:
                    fut = self.pending.pop(seq, (None,))[0]
                if fut is not None:  # (None: it timed out before)
                    ok, value = out
                    if ok:
                        fut.set_result(value)
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

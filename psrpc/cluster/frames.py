"""How the side channel (psrpc/cluster/sidechannel.py) frames its messages: a header (the pickle's
length and a sequence number, 0 for a message with no reply), then the pickle, in which every
CPU tensor crosses as a NumPy array (`dumps`)."""

from __future__ import annotations

import fcntl
import io
import pickle
import socket
import struct
import termios
import threading
from typing import Optional

import torch

from psrpc.errors import PsrpcError

HEAD = struct.Struct("<QQ")  # a message: its pickle's length and its sequence number, then it
ONEWAY, LAZY = 0, (1 << 64) - 1  # sequence numbers of messages with no reply (LAZY: it may
# wait in the socket a while before it is read)
MAX_MESSAGE = 1 << 31  # a length past this is a corrupt stream, not a message


def _tensor(a) -> torch.Tensor:
    return torch.from_numpy(a)


class Large(Exception):
    """A message whose tensors pass the limit `dumps` was given (their bytes so far: args[0])."""


class _Pickler(pickle.Pickler):
    """Pickles every CPU tensor as a NumPy array inside the message's own bytes (unpickled, a
    tensor sharing the array's memory); others (bfloat16, CUDA, needing grad) as pickle does
    them. The tensors' bytes are counted as they come: past `limit`, `Large` stops it."""

    def __init__(self, file, limit: Optional[int]):
        super().__init__(file, protocol=5)
        self.limit, self.tensor_bytes = limit, 0

    def reducer_override(self, obj):  # (never called for plain ints, floats, lists, dicts...)
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        self.tensor_bytes += obj.numel() * obj.element_size()
        if self.limit is not None and self.tensor_bytes > self.limit:
            raise Large(self.tensor_bytes)
        if obj.device.type == "cpu" and obj.dtype != torch.bfloat16 and not obj.requires_grad:
            return _tensor, (obj.numpy(),)
        return NotImplemented


def dumps(obj, limit: Optional[int] = None) -> bytes:
    """`obj` pickled for the channel (`pickle.loads` reads it); raises `Large` as soon as its
    tensors pass `limit` bytes, before the rest is pickled."""
    buf = io.BytesIO()
    _Pickler(buf, limit).dump(obj)
    return buf.getvalue()


def send(sock: socket.socket, lock: threading.Lock, seq: int, body: bytes) -> None:
    with lock:
        sock.sendall(HEAD.pack(len(body), seq) + body)


def read_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError("the peer closed the channel")
        got += k
    return buf


def receive(sock: socket.socket, head: Optional[bytes] = None) -> tuple:
    """(sequence number, unpickled body) of the next message (`head`: its header, read)."""
    n, seq = HEAD.unpack(head if head is not None else read_exact(sock, HEAD.size))
    if n > MAX_MESSAGE:
        raise EOFError(f"a message of {n} bytes: the stream is corrupt")
    return seq, pickle.loads(read_exact(sock, n))


def queued(conn: socket.socket) -> int:
    """Bytes waiting to be read on `conn`."""
    return struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def portable(e: BaseException) -> BaseException:
    """`e` if it pickles and unpickles, else a PsrpcError with its message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return PsrpcError(f"{type(e).__name__}: {e}")

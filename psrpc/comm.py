"""Every torch.distributed.rpc call psrpc makes goes through this module.

torch.distributed.rpc and TensorPipe are in maintenance mode (PyTorch's rpc.md): keeping the
transport behind these few verbs lets it change without touching the PS, the update rules or
the workers.
"""

from __future__ import annotations

import os
import socket
import warnings
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence
from urllib.parse import parse_qs, urlparse

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.futures import Future

from psrpc.errors import PsrpcError

# A function or method that returns a Future: the RPC thread is released while it waits
# (a worker parked at the sync barrier holds no thread).
async_execution = rpc.functions.async_execution
RRef = rpc.RRef

_SCHEME = "psrpc"

# TensorPipe's CPU channels (what carries tensors), in TensorPipe's own order of preference: cma
# (same host), mpt_uv (many TCP connections), basic. Only CPU tensors cross psrpc's RPCs; naming
# the channels leaves out the CUDA ones that TensorPipe otherwise adds where CUDA is visible, and
# whose cuda_ipc aborts the handshake between two hosts (PyTorch issue 95487).
CPU_CHANNELS = ("cma", "mpt_uv", "basic")


def channels() -> Optional[list[str]]:
    """TensorPipe's channels for init_rpc: the CPU ones where CUDA is visible; elsewhere None,
    TensorPipe's defaults as they have always been here."""
    return list(CPU_CHANNELS) if torch.cuda.is_available() else None


def _rendezvous(url: str, **kwargs):
    """init_rpc's rendezvous, as torch's tcp:// one but with our own timeout (init_rpc gives
    none, and a rank that never comes would otherwise keep the others waiting for torch's
    default of 30 minutes) and a store that listens on one address (torch's listens on every
    interface, and whoever reaches a psrpc listener can make every rank unpickle its bytes)."""
    parsed = urlparse(url)
    query = {k: v[0] for k, v in parse_qs(parsed.query).items()}
    rank, world_size = int(query["rank"]), int(query["world_size"])
    timeout = timedelta(seconds=float(query["timeout_s"]))
    if query["agent_store"] == "1" or rank != 0:  # torchrun's agent, or rank 0, hosts it
        store = dist.TCPStore(parsed.hostname, parsed.port, world_size, False, timeout)
    else:
        listener = _bind(parsed.hostname, parsed.port)
        store = dist.TCPStore(parsed.hostname, parsed.port, world_size, True, timeout,
                              master_listen_fd=listener.detach())
    # torchrun's agent store outlives a restart of the group: a fresh key space per attempt
    yield dist.PrefixStore(f"psrpc/attempt-{query['attempt']}", store), rank, world_size
    raise RuntimeError("psrpc's rendezvous runs once per init_rpc")  # as torch's tcp:// one


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


def init(name: str, rank: int, world_size: int, addr: str, port: int, *, rpc_timeout_s: float,
         init_timeout_s: float, threads: int, transports: Optional[Sequence[str]],
         attempt: int = 0, interface: Optional[str] = None, agent_store: bool = False) -> None:
    """Join the RPC group; rank and world size always explicit (a missing world_size silently
    switches torch to dynamic membership).

    `interface`: the network interface to listen on (None: wherever the host name resolves).
    `agent_store`: torchrun's agent hosts the store at addr:port; else rank 0 hosts it, on the
    address `addr` resolves to."""
    try:
        dist.register_rendezvous_handler(_SCHEME, _rendezvous)
    except RuntimeError:  # registered by an earlier init in this process
        pass
    if interface is not None:
        # Read when TensorPipe (its uv transport and multiplexed uv channel) and the gloo group
        # that init_rpc builds open their listeners, inside init_rpc.
        os.environ["TP_SOCKET_IFNAME"] = interface
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    host = f"[{addr}]" if ":" in addr else addr  # an IPv6 literal in a URL
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=threads,
        rpc_timeout=rpc_timeout_s,
        init_method=f"{_SCHEME}://{host}:{port}?timeout_s={init_timeout_s}&attempt={attempt}"
                    f"&agent_store={int(agent_store)}",
        _transports=list(transports) if transports else None,
        _channels=channels(),
    )
    with warnings.catch_warnings():
        # init_rpc builds its group through a deprecated private path; nothing for us to fix.
        warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)


def shutdown(graceful: bool, timeout_s: float = 30.0) -> None:
    """Leave the group. graceful waits for every peer (only when all are known alive: with a
    dead peer torch's graceful shutdown would wait forever: it has no timeout)."""
    try:
        rpc.shutdown(graceful=graceful, timeout=timeout_s)
    except Exception:
        # A peer that finished first closed its pipes while this one was still joining
        # ("Connection reset by peer"): harmless once everyone has agreed to stop. torch has
        # finalised the local agent in its own `finally` unless the wait itself failed.
        if rpc.api._is_current_rpc_agent_set():
            rpc.shutdown(graceful=False)


def remote(to: str, cls: Callable, args: tuple = (), timeout_s: Optional[float] = None) -> RRef:
    """Construct `cls(*args)` on process `to`; the object lives there, used through the RRef."""
    return rpc.remote(to, cls, args=args, timeout=_t(timeout_s))


def call(to: str, fn: Callable, args: tuple = (), timeout_s: Optional[float] = None) -> Future:
    """Run module-level `fn(*args)` on `to`; returns a Future of its result."""
    return rpc.rpc_async(to, fn, args=args, timeout=_t(timeout_s))


def call_sync(to: str, fn: Callable, args: tuple = (), timeout_s: Optional[float] = None) -> Any:
    return rpc.rpc_sync(to, fn, args=args, timeout=_t(timeout_s))


@async_execution
def _invoke_on_owner(rref: RRef, method: str, args: tuple) -> Future:
    result = getattr(rref.local_value(), method)(*args)
    # rpc_async hands back torch._C.Future, torch.futures.Future's base
    return result if isinstance(result, torch._C.Future) else completed(result)


def invoke(rref: RRef, method: str, *args, timeout_s: Optional[float] = None) -> Future:
    """Call `method(*args)` on the object behind `rref`, on its owner; returns a Future.

    Not `rref.rpc_async().method()`: that helper first fetches the RRef's type and sends the
    call from a callback thread, outside the caller's distributed autograd context, so the
    backward pass never reaches the callee (pipeline stages would get no gradients). One direct
    call, which also works for `async_execution` methods (their Future is passed through)."""
    return rpc.rpc_async(rref.owner(), _invoke_on_owner, args=(rref, method, args),
                         timeout=_t(timeout_s))


def owner_name(rref: RRef) -> str:
    return rref.owner_name()


def completed(value: Any) -> Future:
    """A Future that already holds `value` (the reply of a push answered at once)."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


def settled(result: Any) -> Future:
    """A Future that already holds `result`, or raises it when it is an exception."""
    return failed(result) if isinstance(result, BaseException) else completed(result)


def failed(error: BaseException) -> Future:
    """A Future that already holds `error` (a push refused before it touched anything)."""
    fut: Future = Future()
    fut.set_exception(error)
    return fut


def resolve_all(ready: Sequence[tuple[Future, Any]]) -> None:
    """Complete each Future with its result, or its error when the result is an exception.
    Called outside locks: completing a Future of an async_execution call sends its reply."""
    for fut, result in ready:
        if isinstance(result, BaseException):
            fut.set_exception(result)
        else:
            fut.set_result(result)


def wait_all(futures: Sequence[Future]) -> list:
    return torch.futures.wait_all(list(futures))


def _t(timeout_s: Optional[float]) -> float:
    # rpc's "use the default" sentinel; never 0, which now means "fail at once".
    return rpc.constants.UNSET_RPC_TIMEOUT if timeout_s is None else float(timeout_s)

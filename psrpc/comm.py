"""Every torch.distributed.rpc call psrpc makes goes through this module.

torch.distributed.rpc and TensorPipe are in maintenance mode (PyTorch's rpc.md): keeping the
transport behind these few verbs lets it change without touching the PS, the update rules or
the workers.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence
from urllib.parse import parse_qs, urlencode, urlparse, urlunparse

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.futures import Future

# A function or method that returns a Future: the RPC thread is released while it waits
# (a worker parked at the sync barrier holds no thread; DESIGN §8).
async_execution = rpc.functions.async_execution
RRef = rpc.RRef

_SCHEME = "psrpc"


def _rendezvous(url: str, **kwargs):
    """tcp:// rendezvous with our own timeout: init_rpc gives none, and a rank that never comes
    would otherwise keep the others waiting for torch's default of 30 minutes."""
    from torch.distributed.rendezvous import _tcp_rendezvous_handler

    parsed = urlparse(url)
    query = parse_qs(parsed.query)
    timeout = timedelta(seconds=float(query.pop("timeout_s")[0]))
    attempt = query.pop("attempt")[0]
    rest = urlencode(query, doseq=True)
    for store, rank, world_size in _tcp_rendezvous_handler(
            urlunparse(parsed._replace(scheme="tcp", query=rest)), timeout=timeout):
        # torchrun's agent store outlives a restart of the group: a fresh key space per attempt
        yield dist.PrefixStore(f"psrpc/attempt-{attempt}", store), rank, world_size


def init(name: str, rank: int, world_size: int, addr: str, port: int, *, rpc_timeout_s: float,
         init_timeout_s: float, threads: int, transports: Optional[Sequence[str]],
         attempt: int = 0) -> None:
    """Join the RPC group; rank and world size always explicit (a missing world_size silently
    switches torch to dynamic membership)."""
    try:
        dist.register_rendezvous_handler(_SCHEME, _rendezvous)
    except RuntimeError:  # registered by an earlier init in this process
        pass
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=threads,
        rpc_timeout=rpc_timeout_s,
        init_method=f"{_SCHEME}://{addr}:{port}?timeout_s={init_timeout_s}&attempt={attempt}",
        _transports=list(transports) if transports else None,
    )
    with warnings.catch_warnings():
        # init_rpc builds its group through a deprecated private path; nothing for us to fix.
        warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)


def shutdown(graceful: bool, timeout_s: float = 30.0) -> None:
    """Leave the group. graceful waits for every peer (only when all are known alive: with a
    dead peer torch would wait forever, DESIGN §8)."""
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
    # rpc's "use the default" sentinel; never 0, which now means "fail at once" (DESIGN §8).
    return rpc.constants.UNSET_RPC_TIMEOUT if timeout_s is None else float(timeout_s)

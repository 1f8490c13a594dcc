"""Every torch.distributed.rpc call psrpc makes goes through this module.

torch.distributed.rpc and TensorPipe are in maintenance mode (PyTorch's rpc.md): keeping the
transport behind these few verbs lets it change without touching the PS, the update rules or
the workers.
"""

from __future__ import annotations

import functools
import gc
import os
import threading
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence
from urllib.parse import parse_qs, urlparse

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.futures import Future

from psrpc import knobs
from psrpc.cluster import store
from psrpc.cluster.store import GroupAbandoned, AbortableStore, process_store, form_timeout_s
from psrpc.errors import PsrpcError, Retryable, first_line

# The RPC group this process is in: its generation goes up when it leaves (`_left`). A Future
# an RPC of a group returned is answered only while that group lasts: torch's agent sends the
# answer from the Future's callback, and once the agent is shut down (a membership epoch ends)
# that callback would use the freed agent (a segmentation fault, or a stray write into memory
# reused by a tensor). The lock makes leaving wait for an answer being sent.
_GROUP_LOCK = threading.RLock()  # (an answer can complete another, nested, in its thread)
_GROUP = [0]


def async_execution(fn: Callable) -> Callable:
    """A function or method that returns a Future: the RPC thread is released while it waits
    (a worker parked at the sync barrier holds no thread). Its answer goes out only while the
    group that asked lasts (`_GROUP`): one completed after this process left that group is
    dropped, as its asker is gone too."""

    @functools.wraps(fn)
    def answered_in_group(*args, **kwargs):
        return _in_group(fn(*args, **kwargs))
    return rpc.functions.async_execution(answered_in_group)


def _in_group(fut: Future) -> Future:
    group, out = _GROUP[0], Future()

    def answer(f: Future) -> None:
        with _GROUP_LOCK:
            if _GROUP[0] != group:
                return
            try:
                out.set_result(f.value())
            except Exception as e:
                out.set_exception(e)
    fut.add_done_callback(answer)
    return out
RRef = rpc.RRef

_SCHEME = "psrpc"

# TensorPipe's CPU channels (what carries tensors): cma (processes of one host: a cross-memory
# copy), mpt_uv (each tensor split over several TCP connections), basic (the pipe's own
# connection). Only CPU tensors cross psrpc's RPCs; naming the channels leaves out the CUDA ones
# that TensorPipe otherwise adds where CUDA is visible, and whose cuda_ipc aborts the handshake
# between two hosts (PyTorch issue 95487). psrpc's default (PSRPC_TP_CHANNELS unset: cma, basic)
# leaves out mpt_uv too: measured across two emulated hosts it cost DLRM 1.7x in samples/s (its
# lanes for every small message) and resnet18 12 % at 1 Gbit/s (concurrent pushes share the link
# where one after another lets the first round close sooner). The transports: uv only (TCP via
# libuv; TensorPipe's default list made an idle PS burn twice the CPU). psrpc/knobs.py.


def _rendezvous(url: str, **kwargs):
    """init_rpc's rendezvous, as torch's tcp:// one but with our own timeout (init_rpc gives
    none, and a rank that never comes would otherwise keep the others waiting for torch's
    default of 30 minutes) and a store that listens on one address (torch's listens on every
    interface, and whoever reaches a psrpc listener can make every rank unpickle its bytes)."""
    parsed = urlparse(url)
    query = {k: v[0] for k, v in parse_qs(parsed.query).items()}
    rank, world_size = int(query["rank"]), int(query["world_size"])
    timeout = timedelta(seconds=float(query["timeout_s"]))
    store = process_store(parsed.hostname, parsed.port, rank, world_size, timeout,
                           agent_store=query["agent_store"] == "1")
    # torchrun's agent store outlives a restart of the group, and the store outlives a
    # membership epoch: a fresh key space for each
    prefix = f"psrpc/attempt-{query['attempt']}/epoch-{query.get('epoch', '0')}"
    yield (AbortableStore(dist.PrefixStore(prefix, store), _ABORT[0], timeout.total_seconds()),
           rank, world_size)
    raise RuntimeError("psrpc's rendezvous runs once per init_rpc")  # as torch's tcp:// one


_ABORT: list = [None]  # init's `abort`, for the rendezvous of the init_rpc under way
class GroupFailed(Retryable):
    """init_rpc failed as an elastic group formed (a member died meanwhile, say)."""


def init(name: str, rank: int, world_size: int, addr: str, port: int, *, rpc_timeout_s: float,
         init_timeout_s: float, attempt: int = 0, interface: Optional[str] = None,
         agent_store: bool = False, epoch: int = 0, abort: Optional[Callable[[], bool]] = None) -> None:
    """Join the RPC group; rank and world size always explicit (a missing world_size silently
    switches torch to dynamic membership). `epoch`: the membership epoch, a static group of its
    own (torch cannot take a SIGKILLed member back into a group: every membership change is a
    new group of everyone, in a fresh key space of the same store).

    `abort()`: whether the group being formed never will (a newer epoch was announced): then
    init_rpc stops waiting at once and raises GroupAbandoned.

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
    # What init_rpc waits for besides the store (which waits init_timeout_s): an elastic
    # group's members are all there already, see FORM_TIMEOUT_S
    form_s = init_timeout_s if abort is None else form_timeout_s(init_timeout_s)
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=knobs.RPC_THREADS.get(),
        # torch's all-gather at the end of init_rpc waits this long (the calls' default after)
        rpc_timeout=rpc_timeout_s if abort is None else form_s,
        init_method=f"{_SCHEME}://{host}:{port}?timeout_s={init_timeout_s}&attempt={attempt}"
                    f"&agent_store={int(agent_store)}&epoch={epoch}",
        _transports=knobs.TRANSPORTS_KNOB.get(),
        _channels=knobs.CHANNELS_KNOB.get(),
    )
    _fresh_rpc_module_state()
    # init_rpc's gloo group waits torch's DEFAULT_PROCESS_GROUP_TIMEOUT (24 days) for its
    # connections and collectives: a member that dies as the group forms would hold the others
    # there for good. Read when the group is made (torch 2.4-2.14); ours is form_s.
    constants = rpc.constants
    default_pg_timeout = constants.DEFAULT_PROCESS_GROUP_TIMEOUT
    constants.DEFAULT_PROCESS_GROUP_TIMEOUT = timedelta(seconds=form_s)
    _ABORT[0] = abort
    failure = None
    try:
        with warnings.catch_warnings():
            # init_rpc builds its group through a deprecated private path; nothing to fix.
            warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
            rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    except Exception as e:
        if abort is None:
            raise
        failure = (type(e), first_line(e))
    finally:
        constants.DEFAULT_PROCESS_GROUP_TIMEOUT = default_pg_timeout
        _ABORT[0] = None
    if failure is not None:
        # The half-made group goes at once (its traceback held it): the members still waiting
        # in it see their connections close and give up too, instead of waiting form_s
        gc.collect()
        abandon()
        raise GroupAbandoned(failure[1]) if failure[0] is GroupAbandoned else GroupFailed(
            f"{failure[0].__name__}: {failure[1]}")
    if abort is not None:  # the calls' default, and the store's timeout (init_rpc set both)
        rpc._set_rpc_timeout(rpc_timeout_s)
        store.store().set_timeout(timedelta(seconds=rpc_timeout_s))


_on_leave: list[Callable[[], None]] = []  # run as this process leaves its group


def on_leave(hook: Callable[[], None]) -> None:
    """Run `hook` whenever this process leaves its RPC group (`shutdown`, `abandon`): what
    travels beside RPC (the side channel) ends with it, as RPC's own calls in flight do."""
    _on_leave.append(hook)


def _left() -> None:
    with _GROUP_LOCK:  # (after any answer being sent: none goes out from here on)
        _GROUP[0] += 1
    for hook in _on_leave:
        try:
            hook()
        except Exception as e:
            warnings.warn(f"leaving the RPC group: {first_line(e)}")


def abandon() -> None:
    """After a failed `init`: drop the agent it may have started (the group never formed)."""
    _left()
    try:
        if rpc.api._is_current_rpc_agent_set():
            rpc.shutdown(graceful=False)
    except Exception:
        pass


def _keep_autograd_id() -> None:
    """init_rpc first initialises this process's distributed autograd container with its rank,
    and refuses another rank later ("Container is already initialized with worker_id"). A rank
    does change: a worker lost for good leaves the epochs after it, whose groups number the
    ranks after it one lower (psrpc/cluster/membership.py). The container keeps its first id;
    only model parallel uses it, for context ids, which stay unique (ranks only go down, and a
    process started again takes a rank no live process had first). Patched once, at import:
    torch's own `torch.distributed.autograd._init`, which init_rpc looks up at each call."""
    first = dist_autograd._init
    if getattr(first, "keeps_first_id", False):
        return

    def init(worker_id: int) -> None:
        try:
            first(worker_id)
        except RuntimeError as e:
            if "already initialized" not in str(e):
                raise

    init.keeps_first_id = True
    dist_autograd._init = init


_keep_autograd_id()


def _fresh_rpc_module_state() -> None:
    """torch.distributed.rpc keeps per-process counters that every member of a group must
    agree on: init_rpc prefixes its store keys with how many times this process called it,
    and its internal all-gather numbers its rounds per process. A process that joins a later
    membership epoch fresh (a worker started again) has counted nothing while the others have:
    their keys would never meet and init_rpc would hang. The same count everywhere: zero (each
    epoch's keys are apart already, under our own prefix). These are torch's private module
    globals (torch 2.4-2.14); without them, only epoch 0 would work."""
    rpc._init_counter = 0
    api = rpc.api
    with api._all_gather_dict_lock:
        api._all_gather_sequence_id.clear()
        api._all_gather_sequence_id_to_states.clear()


def shutdown(graceful: bool, timeout_s: float = 30.0) -> None:
    """Leave the group. graceful waits for every peer (only when all are known alive: with a
    dead peer torch's graceful shutdown would wait forever: it has no timeout)."""
    _left()
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


@dataclass(frozen=True)
class Handle:
    """An object living in process `owner`, registered there under `key` (`register`): what
    the PS shards are reached through. Unlike an RRef it stays valid from one membership epoch
    to the next: torch's RRef machinery is bound to the first RPC agent of a process and fails
    in any later group (measured on torch 2.14: "tried to send() ... but RPC is no longer
    running"), while a name and a key mean the same in every group."""

    owner: str
    key: int


_LOCAL: dict[int, Any] = {}  # this process's objects reachable through a Handle


def register(key: int, obj: Any) -> None:
    _LOCAL[key] = obj


def registered() -> dict[int, Any]:
    return _LOCAL


def _call_local(key: int, method: str, args: tuple) -> Future:
    try:
        obj = _LOCAL[key]
    except KeyError:
        return failed(PsrpcError(f"no object {key} here (it was lost with an earlier process)"))
    try:
        return _as_future(getattr(obj, method)(*args))
    except Exception as e:  # its own Future fails: the other calls of a message still run
        return failed(e)


@async_execution
def _invoke_local(key: int, method: str, args: tuple) -> Future:
    return _call_local(key, method, args)


@async_execution
def _invoke_local_many(calls: list) -> Future:
    futures = [_call_local(key, method, args) for key, method, args in calls]
    return torch.futures.collect_all(futures).then(lambda f: [x.value() for x in f.value()])


@async_execution
def _invoke_on_owner(rref: RRef, method: str, args: tuple) -> Future:
    return _as_future(getattr(rref.local_value(), method)(*args))


def _as_future(result: Any) -> Future:
    # rpc_async hands back torch._C.Future, torch.futures.Future's base
    return result if isinstance(result, torch._C.Future) else completed(result)


def invoke(target, method: str, *args, timeout_s: Optional[float] = None) -> Future:
    """Call `method(*args)` on the object behind `target` (a Handle or an RRef), on its owner;
    returns a Future.

    Not `rref.rpc_async().method()`: that helper first fetches the RRef's type and sends the
    call from a callback thread, outside the caller's distributed autograd context, so the
    backward pass never reaches the callee (pipeline stages would get no gradients). One direct
    call, which also works for `async_execution` methods (their Future is passed through)."""
    if isinstance(target, Handle):
        return rpc.rpc_async(target.owner, _invoke_local, args=(target.key, method, args),
                             timeout=_t(timeout_s))
    return rpc.rpc_async(target.owner(), _invoke_on_owner, args=(target, method, args),
                         timeout=_t(timeout_s))


def invoke_many(calls: list, timeout_s: Optional[float] = None) -> Future:
    """Several calls `(handle, method, args)` to objects of one owner in one message (a step's
    pushes to the shards of one PS); a Future of their results in order, or of the first error
    among them."""
    owner = calls[0][0].owner
    assert all(h.owner == owner for h, _, _ in calls), "invoke_many: one owner per message"
    return rpc.rpc_async(owner, _invoke_local_many,
                         args=([(h.key, m, a) for h, m, a in calls],), timeout=_t(timeout_s))


def me() -> str:
    """This process's name in the current group."""
    return rpc.get_worker_info().name


def owner_name(target) -> str:
    return target.owner if isinstance(target, Handle) else target.owner_name()


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


def chain(future: Future, then: Callable[[Any, Future], None]) -> Future:
    """A Future that `then(value, out)` completes once `future` holds its value (an error of
    `future` goes to it as it is)."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            value = f.value()
        except BaseException as e:
            out.set_exception(e)
            return
        then(value, out)
    future.add_done_callback(done)
    return out


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


def rpc_timeout_s(cfg) -> float:
    """Per-call RPC timeout: above update.timeout_s, since calls wait at the barrier
    (PSRPC_RPC_TIMEOUT_S overrides it: psrpc/knobs.py)."""
    return knobs.rpc_timeout_s(cfg.update.timeout_s)

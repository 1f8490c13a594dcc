"""Membership epochs: a rank that died is started again and joins the running job.

torch.distributed.rpc cannot take a SIGKILLed member back into a group (a dead member stays
listed, a replacement with its name is refused). So, as torchelastic does one level down, every
membership change starts a new static group of everyone: the local launcher starts the lost rank
again, announces epoch e+1 in its store and sends SIGUSR1 to every other rank; each leaves its
group (`rpc.shutdown(graceful=False)`: the dead member cannot take part in a graceful one) and
joins epoch e+1's (`comm.init(epoch=e+1)`, a fresh key space of the same store). The processes
keep everything else in memory: the PS their shards (master copies, optimizer state, versions,
counters), the chief its session (hooks, metrics, saver). Shards are reached by (PS name, index)
(`comm.Handle`), which means the same in every group: the chief lines their versions up and
hands out the epoch's plan; nobody restores a checkpoint. A PS that was started again has lost its shards: then every shard rolls
back to the last committed checkpoint instead.

A rank notices the change at its next wait: the PS at once (it only serves), the workers when
an RPC of theirs fails because a peer left the old group, or at their next step.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Optional

from psrpc.cluster import comm

log = logging.getLogger("psrpc")

_CHANGE = threading.Event()  # SIGUSR1: the launcher announced a new epoch
_STATE: dict = {"epoch": 0, "join": None, "attempt": 0}


def epoch_key(attempt: int) -> str:
    """The store key of the latest epoch (set by the local launcher)."""
    return f"psrpc/attempt-{attempt}/epoch"


def event_key(attempt: int, epoch: int) -> str:
    """The store key that says what started epoch `epoch`: 'worker2 1733000000.123' (the
    rank started again and when its death was seen)."""
    return f"psrpc/attempt-{attempt}/epoch-{epoch}/why"


def setup(epoch: int, attempt: int, join) -> None:
    """In a rank: its first epoch, and `join(epoch)` that joins the group of an epoch."""
    _STATE.update(epoch=epoch, join=join, attempt=attempt)
    signal.signal(signal.SIGUSR1, lambda signum, frame: _CHANGE.set())


def wake_on_change(event: threading.Event) -> None:
    """Also set `event` when a change is announced (for a loop that waits on it)."""
    previous = signal.getsignal(signal.SIGUSR1)

    def handler(signum, frame):
        if callable(previous):
            previous(signum, frame)
        event.set()

    signal.signal(signal.SIGUSR1, handler)


def changing() -> bool:
    return _CHANGE.is_set()


def wait_change(timeout_s: float) -> bool:
    """Whether a change is announced within `timeout_s` (an RPC failing because a peer left the
    old group can come before the signal does): the signal, or the store's latest epoch. False
    at once where nobody announces epochs (torchrun restarts the whole group instead)."""
    if _CHANGE.is_set():
        return True
    key = epoch_key(_STATE["attempt"])
    try:
        if not comm.store().check([key]):
            return False
    except Exception:  # no store to ask
        return False
    deadline = time.monotonic() + timeout_s
    while not _CHANGE.wait(min(0.25, max(0.0, deadline - time.monotonic()))):
        try:
            if announced() > current():
                _CHANGE.set()
                break
        except Exception:  # the store went away with the launcher
            return False
        if time.monotonic() >= deadline:
            return False
    return True


def current() -> int:
    return _STATE["epoch"]


def announced() -> int:
    """The latest epoch the launcher announced."""
    return int(comm.store().get(epoch_key(_STATE["attempt"])))


def why(epoch: int) -> tuple[str, Optional[float]]:
    """(the rank started again, when its death was seen) for epoch `epoch`."""
    try:
        name, at = comm.store().get(event_key(_STATE["attempt"], epoch)).decode().split()
        return name, float(at)
    except Exception:  # an older or foreign store: the epoch still works without it
        return "?", None


def rejoin() -> int:
    """Leave this group and join the latest announced epoch's; returns that epoch."""
    _CHANGE.clear()  # a change announced from here on is seen at the next wait
    target = announced()
    t0 = time.monotonic()
    comm.shutdown(graceful=False)
    _STATE["join"](target)
    _STATE["epoch"] = target
    log.info("joined membership epoch %d in %.1f s", target, time.monotonic() - t0)
    return target

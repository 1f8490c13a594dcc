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

The store says everything; SIGUSR1 only wakes a rank up. A rank always joins the newest epoch
the store announces (a rank started for epoch e may find e+1 there: another rank died while it
started), and an epoch's group forms only once every rank has arrived at it (`_gather`): an
epoch that a newer one replaces before that is abandoned by everyone, so no two groups form.
Every wait of a join ends after cluster.init_timeout_s with a message naming who is missing.
When the chief ends training it marks the epoch key finished (`finish`): from then on the
launcher starts no lost rank again (`announce` fails), so no epoch starts that nobody joins.

Under torchrun and srun nobody outside the ranks keeps epochs (torchrun restarts the whole
group when a rank dies), but a rank can lose its connections and stay alive: a partition cut
its host off, then healed. The ranks open the attempt themselves and each one watches the
epoch key from a thread (`_watch`: the wake-up the launcher's signal gives elsewhere, across
hosts). A rank whose RPC failed with no change announced asks for one (`ask`): as soon as the
store answers again it announces the next epoch itself (one compare-and-set: two ranks asking
at once start one epoch) and every rank joins it, the PS with their shards, the chief with its
session, as when the launcher starts a worker again. What the cut-off rank computed meanwhile
is dropped: in the new epoch it starts from the current parameters, and no message of the old
group reaches the new one's (each epoch is a new TensorPipe group).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Callable, Optional

from psrpc.cluster import comm, store
from psrpc.errors import PsrpcError, first_line

log = logging.getLogger("psrpc")

_CHANGE = threading.Event()  # SIGUSR1: the launcher announced a new epoch
_STATE: dict = {"epoch": 0, "join": None, "attempt": 0, "rank": 0, "names": [],
                "timeout_s": 120.0, "elastic": False, "self_announce": False, "over": False}
_STOPPING = threading.Event()  # SIGTERM/SIGINT: a join in progress gives up (see `stop`)
FINISHED = "finished"  # the epoch key's value once the chief has ended training: "3 finished"
# A group that failed to form (a member died as it formed, its peers saw the connection go):
# how long to wait for the launcher to announce the next epoch (it polls every 50 ms)
CHANGE_GRACE_S = 10.0
POLL_S = 0.1  # how often a rank waiting at an epoch's gathering asks for a newer epoch (the
# store wakes it at once when the gathering ends)
WATCH_S = 0.25  # how often a rank reads the epoch key where the ranks announce epochs
STORE_CALL_S = 5.0  # a call of the watcher's, or of a rank asking for an epoch, gives up after


def epoch_key(attempt: int) -> str:
    """The store key of the latest epoch (set by the local launcher): "3", or "3 finished"
    once training is over (no epoch starts after that)."""
    return f"psrpc/attempt-{attempt}/epoch"


def _launcher_key(attempt: int) -> str:
    """Set by the local launcher: it announces the epochs (else the ranks do)."""
    return f"psrpc/attempt-{attempt}/launcher"


def _asked_key(attempt: int, epoch: int) -> str:
    """The ranks that asked for epoch `epoch` (cut off, alive all along): 'worker1,worker2,'."""
    return f"psrpc/attempt-{attempt}/epoch-{epoch}/asked"


def event_key(attempt: int, epoch: int) -> str:
    """The store key that says what started epoch `epoch`: 'worker2 1733000000.123' (the
    ranks started again, comma-separated, and when their deaths were seen)."""
    return f"psrpc/attempt-{attempt}/epoch-{epoch}/why"


def _gather_key(attempt: int, epoch: int, what) -> str:
    return f"psrpc/attempt-{attempt}/epoch-{epoch}/gather/{what}"


def _on_wakeup(signum, frame) -> None:
    _CHANGE.set()


def install_wakeup() -> None:
    """SIGUSR1 sets the change flag. The first thing a rank does (the forkserver it comes from
    ignores SIGUSR1 until then: psrpc/cluster/forkserver_preload.py); the store says which epoch."""
    signal.signal(signal.SIGUSR1, _on_wakeup)


def setup(epoch: int, attempt: int, join: Callable[..., None], rank: int = 0,
          names: Optional[list[str]] = None, timeout_s: float = 120.0) -> None:
    """In a rank: the epoch it was started for, `join(epoch, abort)` that joins the group of an
    epoch (giving up when `abort()` says a newer one replaced it), its rank, every rank's name
    (by rank) and how long a join may wait (cluster.init_timeout_s). Needs the process's store
    (`store.connect_store`) where the local launcher hosts epochs."""
    _STATE.update(epoch=epoch, join=join, attempt=attempt, rank=rank, names=list(names or []),
                  timeout_s=timeout_s, self_announce=False, over=False)
    try:
        s = store.store()
        if not s.check([_launcher_key(attempt)]):  # torchrun, srun: the ranks keep the epochs
            s.compare_set(epoch_key(attempt), "", "0")  # (the first one opens the attempt)
            _STATE["self_announce"] = True
        _STATE["elastic"] = bool(s.check([epoch_key(attempt)]))
    except Exception:  # no store yet, or a foreign one: nobody announces epochs
        _STATE["elastic"] = False
    if signal.getsignal(signal.SIGUSR1) is not _on_wakeup:
        install_wakeup()
    if _STATE["self_announce"]:
        threading.Thread(target=_watch, args=(attempt,), name="psrpc-epochs",
                         daemon=True).start()


def _watch(attempt: int) -> None:
    """Where the ranks announce epochs: wake this rank (SIGUSR1 to itself, the launcher's
    signal elsewhere) when an epoch newer than its own is announced. Its own connection to
    the store, with short calls: a partition must not hold the rank's own client, and a reset
    connection is made again."""
    woken, s = 0, None
    while True:
        time.sleep(WATCH_S)
        try:
            s = s or store.client(STORE_CALL_S)
            epoch, over = _parse(s.get(epoch_key(attempt)))
        except Exception:  # cut off, or the store gone with the run: try again
            s = None
            continue
        if epoch > max(current(), woken) and not over:
            woken = epoch
            os.kill(os.getpid(), signal.SIGUSR1)


def stop() -> None:
    """SIGTERM/SIGINT: a join under way gives up (the engine is stopping every rank: torchrun
    restarting the group waits 30 s for a rank that does not leave)."""
    _STOPPING.set()


def enter() -> int:
    """Join the group for the first time: the newest epoch where the launcher announces them
    (not necessarily the one this rank was started for), else the one it was started for."""
    if not _STATE["elastic"]:
        _STATE["join"](_STATE["epoch"])
        return _STATE["epoch"]
    _CHANGE.clear()  # the epoch is read below: an earlier wake-up is stale
    return _join_newest()


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
    if not _STATE["elastic"]:
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


def recover(timeout_s: float, may_ask: bool = True) -> bool:
    """An RPC of this rank failed: whether it is a membership change, to be joined. Where a
    launcher announces epochs: one announced within `timeout_s` (a peer left the old group).
    Where the ranks do (torchrun, srun): this rank asks for one (`ask`), unless `may_ask` is
    False (a failure no new epoch mends: the chief's start-up); then one announced already."""
    if not _STATE["self_announce"]:
        return wait_change(timeout_s)
    if may_ask:
        return ask()
    try:
        return _CHANGE.is_set() or announced() > current()
    except Exception:  # the store is out of reach: no epoch to join
        return False


def ask() -> bool:
    """Where the ranks announce epochs, after an RPC of this rank failed (its host cut off by a
    partition, say): announce the next epoch as soon as the store answers again, within
    cluster.init_timeout_s. True once an epoch newer than this rank's is announced (by it, or
    by another rank first); False when the store stays out of reach, or training has ended
    (then `ended()` says so)."""
    attempt, timeout_s = _STATE["attempt"], _STATE["timeout_s"]
    deadline = time.monotonic() + timeout_s
    waited = recorded = False
    s = None  # one connection while it answers, a new one after it failed
    while not _STOPPING.is_set():
        try:
            s = s or store.client(min(STORE_CALL_S, timeout_s))
            epoch, over = _parse(s.get(epoch_key(attempt)))
            if over:
                _STATE["over"] = True
                return False
            if not recorded and (waited or epoch <= current()):
                # cut off (not a call that failed as its peers left for an announced epoch):
                # in the epoch this rank will join (another cut-off rank's, if announced)
                s.append(_asked_key(attempt, max(epoch, current() + 1)), f"{_me()},")
                recorded = True
            if epoch <= current():
                announce(s, attempt, current() + 1, [_me()])
                continue  # read again: ours, or another rank's, or the chief ended training
            store.renew(_STATE["timeout_s"])  # the old connection may be broken
            if waited:
                log.warning("%s: the store answers again; joining membership epoch %d",
                            _me(), epoch)
            _CHANGE.set()
            return True
        except Exception as e:
            s = None
            if time.monotonic() >= deadline:
                log.error("%s: the rendezvous store did not answer within %g s "
                          "(cluster.init_timeout_s): %s", _me(), timeout_s, first_line(e))
                return False
            if not waited:
                log.warning("%s: cut off (the rendezvous store does not answer: %s); trying "
                            "again for up to %g s (cluster.init_timeout_s)", _me(),
                            first_line(e), timeout_s)
            waited = True
            time.sleep(0.5)
    return False


def group_prefix(what: str) -> str:
    """A store prefix for a process group formed in the current epoch (the dense all-reduce):
    every epoch's is new, so a group of a gone epoch never meets a newer one's keys."""
    return f"psrpc/attempt-{_STATE['attempt']}/epoch-{current()}/{what}/"


def _parse(value: bytes) -> tuple[int, bool]:
    parts = value.decode().split()
    return int(parts[0]), FINISHED in parts[1:]


def announced() -> int:
    """The latest epoch the launcher announced."""
    return _parse(store.store().get(epoch_key(_STATE["attempt"])))[0]


def why(epoch: int) -> tuple[str, Optional[float]]:
    """(the ranks started again, comma-separated; when their deaths were seen) for epoch
    `epoch`."""
    try:
        name, at = store.store().get(event_key(_STATE["attempt"], epoch)).decode().split()
        return name, float(at)
    except Exception:  # an older or foreign store: the epoch still works without it
        return "?", None


def cut_off(epoch: int) -> list[str]:
    """The ranks that asked for epoch `epoch` because they had lost their connections (none
    where the launcher announces epochs: it starts lost ranks again)."""
    try:
        s = store.store()
        key = _asked_key(_STATE["attempt"], epoch)
        return [n for n in s.get(key).decode().split(",") if n] if s.check([key]) else []
    except Exception:
        return []


def rejoin() -> Optional[int]:
    """Leave this group and join the newest announced epoch's; returns that epoch, or None when
    nothing newer than the current epoch was announced (a stale wake-up: nothing to do)."""
    _CHANGE.clear()  # a change announced from here on is seen at the next wait
    if not _STATE["elastic"] or announced() <= current():
        return None
    t0 = time.monotonic()
    comm.shutdown(graceful=False)
    target = _join_newest()
    log.info("joined membership epoch %d in %.1f s", target, time.monotonic() - t0)
    return target


def _me() -> str:
    names, rank = _STATE["names"], _STATE["rank"]
    return names[rank] if rank < len(names) else f"rank {rank}"


def _join_newest() -> int:
    """Join the newest epoch's group. An epoch that a newer one replaces before its group has
    formed is abandoned for that one; each epoch's gathering waits at most
    cluster.init_timeout_s, its group's forming less (comm.FORM_TIMEOUT_S)."""
    timeout_s = _STATE["timeout_s"]
    while True:
        target = announced()
        if not _gather(target, time.monotonic() + timeout_s):
            continue  # a newer epoch replaced it before everyone arrived
        try:  # given up at once when a newer epoch is announced while the group forms
            _STATE["join"](target, lambda: _STOPPING.is_set() or announced() > target)
        except Exception as e:
            comm.abandon()  # whatever init_rpc left half-made
            if _STOPPING.is_set():
                raise PsrpcError(f"{_me()}: stopped by a signal while joining membership "
                                 f"epoch {target}") from e
            if _newer_within(target, CHANGE_GRACE_S):  # a rank died while the group formed
                log.warning("membership epoch %d did not form (%s); joining epoch %d", target,
                            first_line(e), announced())
                continue
            raise PsrpcError(f"{_me()}: membership epoch {target}: the RPC group did not form "
                             f"and no newer epoch came within {CHANGE_GRACE_S:g} s: "
                             f"{first_line(e)}") from e
        _STATE["epoch"] = target
        return target


def _newer_within(epoch: int, timeout_s: float) -> bool:
    """Whether an epoch newer than `epoch` is announced within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while announced() <= epoch:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _gather(epoch: int, deadline: float) -> bool:
    """Arrive at `epoch` and wait for every rank there. True: everyone arrived, join its group;
    False: a newer epoch was announced first and this one is abandoned (by everyone: the
    decision is one compare-and-set in the store, so no rank joins an epoch others left).
    Raises when ranks are still missing at `deadline`."""
    s, attempt, rank = store.store(), _STATE["attempt"], _STATE["rank"]
    world = len(_STATE["names"])
    state = _gather_key(attempt, epoch, "state")
    s.set(_gather_key(attempt, epoch, rank), "1")
    if s.add(_gather_key(attempt, epoch, "count"), 1) >= world:
        s.compare_set(state, "", "go")  # the last to arrive (unless abandoned first)
    while True:
        if store.wait_for(s, [state], POLL_S):
            return s.get(state) == b"go"
        if _STOPPING.is_set():
            raise PsrpcError(f"{_me()}: stopped by a signal while joining membership epoch "
                             f"{epoch}")
        newer = announced() > epoch
        if newer or time.monotonic() >= deadline:
            if s.compare_set(state, "", "abandoned") == b"go":
                return True  # everyone arrived just before: this epoch's group forms
            if newer:
                return False
            missing = [name for r, name in enumerate(_STATE["names"])
                       if not s.check([_gather_key(attempt, epoch, r)])]
            raise PsrpcError(f"{_me()}: membership epoch {epoch}: {', '.join(missing)} did not "
                             f"join within {_STATE['timeout_s']:g} s (cluster.init_timeout_s)")


def finish() -> bool:
    """The chief, as training ends: from here on no epoch starts (the launcher starts no lost
    rank again). False when one was announced after this rank's epoch: the change is then
    pending (`changing()`), to be joined before training can end. True where nobody announces
    epochs."""
    if not _STATE["elastic"]:
        return True
    cur = str(current())
    done = f"{cur} {FINISHED}"
    if store.store().compare_set(epoch_key(_STATE["attempt"]), cur, done).decode() == done:
        return True
    _CHANGE.set()
    return False


# -- the launcher's side -----------------------------------------------------------------------
def open_attempt(store, attempt: int) -> None:
    """The launcher, before starting an attempt's ranks: epoch 0, announced by the launcher."""
    store.set(_launcher_key(attempt), "1")
    store.set(epoch_key(attempt), "0")


class TrainingOver(PsrpcError):
    """An RPC of this rank failed after the chief had ended training (the store says so): the
    run is over, this rank leaves without an error."""


def ended() -> bool:
    """In a rank: whether the chief has ended training (where the launcher keeps epochs)."""
    if not _STATE["elastic"]:
        return False
    if _STATE["over"]:
        return True
    try:
        return training_over(store.store(), _STATE["attempt"])
    except Exception:  # the store is gone with the launcher: the rank leaves anyway
        return False


def training_over(store, attempt: int) -> bool:
    return _parse(store.get(epoch_key(attempt)))[1]


def announce(store, attempt: int, epoch: int, names: list[str]) -> bool:
    """The launcher: epoch `epoch` (after `epoch - 1`) starts because `names` were started
    again. False, and nothing announced, when the chief has ended training meanwhile."""
    # What started the epoch, then the epoch itself: a rank reads them in that order.
    store.set(event_key(attempt, epoch), f"{','.join(names)} {time.time()}")
    return store.compare_set(epoch_key(attempt), str(epoch - 1), str(epoch)).decode() == str(epoch)

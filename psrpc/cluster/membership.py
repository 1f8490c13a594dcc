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
A worker lost for good (no restart left) is out of every later epoch: the launcher lists it
(`gone_key`) before it announces one, and that epoch's group is made of the others, numbered
again in rank order (`members`), so a PS started again later still finds a group to join.

Under torchrun and srun the ranks announce epochs themselves: psrpc/cluster/partitions.py.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from psrpc.cluster import comm, store
from psrpc.errors import PsrpcError, first_line

log = logging.getLogger("psrpc")

CHANGE = threading.Event()  # SIGUSR1: the launcher announced a new epoch


@dataclass
class RankState:
    """This rank's place in the membership, set by `setup` (partitions.py reads it too)."""

    epoch: int = 0                    # the membership epoch whose group this rank is in
    join: Optional[Callable[..., None]] = None  # joins an epoch's group (see `setup`)
    attempt: int = 0                  # the run's restart count (a fresh key space each)
    rank: int = 0                     # among every rank of the run
    names: list[str] = field(default_factory=list)  # every rank's name, by rank
    timeout_s: float = 120.0          # how long a join may wait (cluster.init_timeout_s)
    elastic: bool = False             # epochs are announced in the store
    self_announce: bool = False       # the ranks announce them (torchrun, srun), not a launcher
    over: bool = False                # the chief said training ended

    def become(self, other: "RankState") -> None:
        """Every field of `other` (one object, which partitions.py holds too)."""
        vars(self).update(vars(other))


STATE = RankState()
STOPPING = threading.Event()  # SIGTERM/SIGINT: a join in progress gives up (see `stop`)
FINISHED = "finished"  # the epoch key's value once the chief has ended training: "3 finished"
# A group that failed to form (a member died as it formed, its peers saw the connection go):
# how long to wait for the launcher to announce the next epoch (it polls every 50 ms)
CHANGE_GRACE_S = 10.0
POLL_S = 0.1  # how often a rank waiting at an epoch's gathering asks for a newer epoch (the
# store wakes it at once when the gathering ends)


def epoch_key(attempt: int) -> str:
    """The store key of the latest epoch (set by the local launcher): "3", or "3 finished"
    once training is over (no epoch starts after that)."""
    return f"psrpc/attempt-{attempt}/epoch"


def _launcher_key(attempt: int) -> str:
    """Set by the local launcher: it announces the epochs (else the ranks do)."""
    return f"psrpc/attempt-{attempt}/launcher"


def event_key(attempt: int, epoch: int) -> str:
    """The store key that says what started epoch `epoch`: 'worker2 1733000000.123' (the
    ranks started again, comma-separated, and when their deaths were seen)."""
    return f"psrpc/attempt-{attempt}/epoch-{epoch}/why"


def gone_key(attempt: int, epoch: int) -> str:
    """The store key of the ranks out of epoch `epoch` for good (set by the local launcher
    before it announces the epoch): 'worker2,worker3', workers lost with no restart left. No
    key: every rank is in it."""
    return f"psrpc/attempt-{attempt}/epoch-{epoch}/gone"


def failed_key(attempt: int) -> str:
    """Set when the attempt cannot go on (its chief was started again, a rank missing from an
    epoch past cluster.init_timeout_s where the ranks announce epochs): why, in one line."""
    return f"psrpc/attempt-{attempt}/failed"


def _raise_if_failed(s) -> None:
    """Stop with the line of a rank that marked this attempt failed (no epoch mends it)."""
    key = failed_key(STATE.attempt)
    if s.check([key]):
        raise PsrpcError(f"{me()}: {s.get(key).decode()}")


def gather_key(attempt: int, epoch: int, what) -> str:
    return f"psrpc/attempt-{attempt}/epoch-{epoch}/gather/{what}"


def _on_wakeup(signum, frame) -> None:
    CHANGE.set()


def install_wakeup() -> None:
    """SIGUSR1 sets the change flag. The first thing a rank does (the forkserver it comes from
    ignores SIGUSR1 until then: psrpc/cluster/forkserver_preload.py); the store says which epoch."""
    signal.signal(signal.SIGUSR1, _on_wakeup)


def setup(epoch: int, attempt: int, join: Callable[..., None], rank: int = 0,
          names: Optional[list[str]] = None, timeout_s: float = 120.0) -> None:
    """In a rank: the epoch it was started for, `join(epoch, abort, rank, world_size)` that
    joins the group of an epoch (giving up when `abort()` says a newer one replaced it) as
    member `rank` of `world_size` (`group_rank`: those gone for good are left out), its rank
    among every rank, every rank's name
    (by rank) and how long a join may wait (cluster.init_timeout_s). Needs the process's store
    (`store.connect_store`) where the local launcher hosts epochs."""
    STATE.become(RankState(epoch=epoch, join=join, attempt=attempt, rank=rank,
                           names=list(names or []), timeout_s=timeout_s))
    try:
        s = store.store()
        if not s.check([_launcher_key(attempt)]):  # torchrun, srun: the ranks keep the epochs
            s.compare_set(epoch_key(attempt), "", "0")  # (the first one opens the attempt)
            STATE.self_announce = True
        STATE.elastic = bool(s.check([epoch_key(attempt)]))
    except Exception:  # no store yet, or a foreign one: nobody announces epochs
        STATE.elastic = False
    if signal.getsignal(signal.SIGUSR1) is not _on_wakeup:
        install_wakeup()


def stop() -> None:
    """SIGTERM/SIGINT: a join under way gives up (the engine is stopping every rank: torchrun
    restarting the group waits 30 s for a rank that does not leave)."""
    STOPPING.set()


def enter() -> int:
    """Join the group for the first time: the newest epoch where the launcher announces them
    (not necessarily the one this rank was started for), else the one it was started for."""
    if not STATE.elastic:
        STATE.join(STATE.epoch)
        return STATE.epoch
    CHANGE.clear()  # the epoch is read below: an earlier wake-up is stale
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
    return CHANGE.is_set()


def wait_change(timeout_s: float) -> bool:
    """Whether a change is announced within `timeout_s` (an RPC failing because a peer left the
    old group can come before the signal does): the signal, or the store's latest epoch. False
    at once where nobody announces epochs (torchrun restarts the whole group instead). Where
    the ranks announce epochs, raises with the line of a rank that marked the attempt failed
    meanwhile (the chief started again, say: no epoch mends that)."""
    if CHANGE.is_set():
        return True
    if not STATE.elastic:
        return False
    deadline = time.monotonic() + timeout_s
    while not CHANGE.wait(min(0.25, max(0.0, deadline - time.monotonic()))):
        if STOPPING.is_set():  # the engine is stopping every rank: no change to wait for
            return False
        try:
            if announced() > current():
                CHANGE.set()
                break
            if STATE.self_announce:
                _raise_if_failed(store.store())
        except PsrpcError:
            raise
        except Exception:  # the store went away with the launcher
            return False
        if time.monotonic() >= deadline:
            return False
    return True


def current() -> int:
    return STATE.epoch


def group_prefix(what: str) -> str:
    """A store prefix for a process group formed in the current epoch (the dense all-reduce):
    every epoch's is new, so a group of a gone epoch never meets a newer one's keys."""
    return f"psrpc/attempt-{STATE.attempt}/epoch-{current()}/{what}/"


def run_prefix(what: str) -> str:
    """A store prefix for what holds through every epoch of this attempt (a backup's fence:
    psrpc/ps/replicas.py), and is gone with it (a restarted group starts from a checkpoint)."""
    return f"psrpc/attempt-{STATE.attempt}/{what}/"


def parse_epoch(value: bytes) -> tuple[int, bool]:
    parts = value.decode().split()
    return int(parts[0]), FINISHED in parts[1:]


def announced() -> int:
    """The latest epoch the launcher announced."""
    return parse_epoch(store.store().get(epoch_key(STATE.attempt)))[0]


def why(epoch: int) -> tuple[str, Optional[float]]:
    """(the ranks started again, comma-separated; when their deaths were seen) for epoch
    `epoch`."""
    try:
        name, at = store.store().get(event_key(STATE.attempt, epoch)).decode().rsplit(" ", 1)
        return name, float(at)
    except Exception:  # an older or foreign store: the epoch still works without it
        return "?", None


def rejoin() -> Optional[int]:
    """Leave this group and join the newest announced epoch's; returns that epoch, or None when
    nothing newer than the current epoch was announced (a stale wake-up: nothing to do)."""
    CHANGE.clear()  # a change announced from here on is seen at the next wait
    if not STATE.elastic or announced() <= current():
        return None
    t0 = time.monotonic()
    comm.shutdown(graceful=False)
    target = _join_newest()
    log.info("joined membership epoch %d in %.1f s", target, time.monotonic() - t0)
    return target


def me() -> str:
    """This rank's name (ps0, worker1, ...), for the lines it logs."""
    names, rank = STATE.names, STATE.rank
    return names[rank] if rank < len(names) else f"rank {rank}"


def _join_newest() -> int:
    """Join the newest epoch's group. An epoch that a newer one replaces before its group has
    formed is abandoned for that one; each epoch's gathering waits at most
    cluster.init_timeout_s (longer for a rank that may still be leaving an earlier epoch's
    group that did not form: `_leaving`), its group's forming less (store.form_timeout_s)."""
    timeout_s = STATE.timeout_s
    while True:
        target = announced()
        if not _gather(target, time.monotonic() + timeout_s):
            if announced() <= target:  # not replaced: given up by a rank that timed out
                _given_up(target)
            continue  # a newer epoch replaced it before everyone arrived
        try:  # given up at once when a newer epoch is announced while the group forms
            STATE.join(target, lambda: STOPPING.is_set() or announced() > target,
                           *group_rank(target))
            store.store().set(gather_key(STATE.attempt, target, f"formed/{STATE.rank}"),
                              "1")
        except Exception as e:
            comm.abandon()  # whatever init_rpc left half-made
            if STOPPING.is_set():
                raise PsrpcError(f"{me()}: stopped by a signal while joining membership "
                                 f"epoch {target}") from e
            if _newer_within(target, CHANGE_GRACE_S):  # a rank died while the group formed
                log.warning("membership epoch %d did not form (%s); joining epoch %d", target,
                            first_line(e), announced())
                continue
            raise PsrpcError(f"{me()}: membership epoch {target}: the RPC group did not form "
                             f"and no newer epoch came within {CHANGE_GRACE_S:g} s: "
                             f"{first_line(e)}") from e
        STATE.epoch = target
        return target


def _given_up(epoch: int) -> None:
    """`epoch` was given up with ranks missing, by a rank whose wait ended first: wait for a
    newer epoch (the local launcher's, once it has started the missing rank again), else stop
    with that rank's line (where the ranks announce epochs it is final, in failed_key)."""
    s = store.store()
    deadline = time.monotonic() + STATE.timeout_s
    while announced() <= epoch:
        _raise_if_failed(s)
        if time.monotonic() >= deadline:
            raise PsrpcError(f"{me()}: membership epoch {epoch} was given up with ranks "
                             f"missing, and no newer epoch came within {STATE.timeout_s:g} "
                             f"s (cluster.init_timeout_s)")
        time.sleep(POLL_S)


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
    s, attempt, rank = store.store(), STATE.attempt, STATE.rank
    ranks = members(epoch)
    state = gather_key(attempt, epoch, "state")
    s.set(gather_key(attempt, epoch, rank), "1")
    if s.add(gather_key(attempt, epoch, "count"), 1) >= len(ranks):
        s.compare_set(state, "", "go")  # the last to arrive (unless abandoned first)
    extended = None

    def missing() -> list[int]:
        return [r for r in ranks if not s.check([gather_key(attempt, epoch, r)])]

    while True:
        if store.wait_for(s, [state], POLL_S):
            return s.get(state) == b"go"
        if STOPPING.is_set():
            raise PsrpcError(f"{me()}: stopped by a signal while joining membership epoch "
                             f"{epoch}")
        _raise_if_failed(s)
        newer = announced() > epoch
        if not newer and time.monotonic() >= deadline and extended is None:
            if (leaving := _leaving(s, epoch, missing())) is not None:
                extended = leaving  # (see `_leaving`): once
                deadline = time.monotonic() + store.leaving_s(STATE.timeout_s)
                continue
        if newer or time.monotonic() >= deadline:
            if s.compare_set(state, "", "abandoned") == b"go":
                return True  # everyone arrived just before: this epoch's group forms
            if newer:
                return False
            names = ", ".join(STATE.names[r] for r in missing())
            why = (f"membership epoch {epoch}: {names} did not join within "
                   f"{STATE.timeout_s:g} s (cluster.init_timeout_s)")
            if extended is not None:
                why += (f" and {store.leaving_s(STATE.timeout_s):g} s more (what leaving "
                        f"epoch {extended}'s group, which did not form, may take)")
            if STATE.self_announce:  # final: no rank asks for another epoch (the first wins)
                why = s.compare_set(failed_key(attempt), "", why).decode() or why
            raise PsrpcError(f"{me()}: {why}")


def gone(epoch: int) -> list[str]:
    """The ranks out of epoch `epoch` for good (workers the local launcher lost with no restart
    left), by name; [] where nobody announces them (torchrun, srun, an older store)."""
    key = gone_key(STATE.attempt, epoch)
    try:
        s = store.store()
        return s.get(key).decode().split(",") if s.check([key]) else []
    except KeyError:  # (no store: no epochs either)
        return []


def members(epoch: int) -> list[int]:
    """The ranks of epoch `epoch`'s group: every rank but those gone for good."""
    out = set(gone(epoch))
    return [r for r, name in enumerate(STATE.names) if name not in out]


def group_rank(epoch: int) -> tuple[int, int]:
    """(this rank's place in epoch `epoch`'s group, the group's size): its RPC rank and world
    size there, the ranks of those gone for good left out. Raises for a rank that is itself
    listed gone (the launcher counted it lost: it has no place in any later epoch)."""
    ranks = members(epoch)
    if STATE.rank not in ranks:
        raise PsrpcError(f"{me()}: membership epoch {epoch} lists it as gone for good (lost "
                         f"with no restart left): it has no place in the group")
    return ranks.index(STATE.rank), len(ranks)


def _leaving(s, epoch: int, missing: list[int]) -> Optional[int]:
    """An earlier epoch that a missing rank may still be leaving: its gathering completed
    ("go") with that rank there, and the rank never said its group formed. Its forming can then
    hold the rank in gloo's mesh connect for longer than the waits that can be abandoned
    (`store.leaving_s`), though it is alive and on its way here. None: no such epoch."""
    attempt = STATE.attempt
    for e in range(epoch - 1, max(-1, epoch - 6), -1):
        state = gather_key(attempt, e, "state")
        if not s.check([state]) or s.get(state) != b"go":
            continue
        for r in missing:
            if s.check([gather_key(attempt, e, r)]) and \
                    not s.check([gather_key(attempt, e, f"formed/{r}")]):
                return e
        return None  # (the latest epoch whose group was meant to form)
    return None


def finish() -> bool:
    """The chief, as training ends: from here on no epoch starts (the launcher starts no lost
    rank again). False when one was announced after this rank's epoch: the change is then
    pending (`changing()`), to be joined before training can end. True where nobody announces
    epochs."""
    if not STATE.elastic:
        return True
    cur = str(current())
    done = f"{cur} {FINISHED}"
    if store.store().compare_set(epoch_key(STATE.attempt), cur, done).decode() == done:
        return True
    CHANGE.set()
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
    if not STATE.elastic:
        return False
    if STATE.over:
        return True
    try:
        return training_over(store.store(), STATE.attempt)
    except Exception:  # the store is gone with the launcher: the rank leaves anyway
        return False


def training_over(store, attempt: int) -> bool:
    return parse_epoch(store.get(epoch_key(attempt)))[1]


def announce(store, attempt: int, epoch: int, names: list[str], gone=()) -> bool:
    """The launcher: epoch `epoch` (after `epoch - 1`) starts because `names` were started
    again; `gone`: the workers lost for good, out of its group. False, and nothing announced,
    when the chief has ended training meanwhile."""
    # What started the epoch and who is out of it, then the epoch itself: a rank reads them in
    # that order.
    store.set(event_key(attempt, epoch), f"{','.join(names)} {time.time()}")
    if gone:
        store.set(gone_key(attempt, epoch), ",".join(gone))
    return store.compare_set(epoch_key(attempt), str(epoch - 1), str(epoch)).decode() == str(epoch)

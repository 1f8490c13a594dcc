"""Membership epochs where no launcher announces them (torchrun, srun): the ranks do.

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

from psrpc.cluster import membership, store
from psrpc.cluster.membership import (CHANGE, STATE, STOPPING, TrainingOver, gather_key,
                                      me, parse_epoch, announce, current, epoch_key)
from psrpc.errors import PsrpcError, first_line

log = logging.getLogger("psrpc")

WATCH_S = 0.25  # how often a rank reads the epoch key where the ranks announce epochs
STORE_CALL_S = 5.0  # a call of the watcher's, or of a rank asking for an epoch, gives up after


def _asked_key(attempt: int, epoch: int) -> str:
    """The ranks that asked for epoch `epoch` (cut off, alive all along): 'worker1,worker2,'."""
    return f"psrpc/attempt-{attempt}/epoch-{epoch}/asked"


def watch() -> None:
    """After membership.setup: where the ranks announce epochs, watch the epoch key."""
    if STATE.self_announce:
        threading.Thread(target=_watch, args=(STATE.attempt,), name="psrpc-epochs",
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
            epoch, over = parse_epoch(s.get(epoch_key(attempt)))
        except Exception:  # cut off, or the store gone with the run: try again
            s = None
            continue
        if epoch > max(current(), woken) and not over:
            woken = epoch
            os.kill(os.getpid(), signal.SIGUSR1)


def started_again(is_chief: bool) -> None:
    """Before a rank first joins, where the ranks announce epochs: whether an engine started it
    again into a running attempt (one rank at a time, as Kubernetes does with `restartPolicy:
    OnFailure`, or a supervisor with the same environment; torchrun restarts the whole group
    under a new attempt instead). Such a rank finds its own arrival, from its earlier life, at
    an epoch's gathering (the newest, or an earlier one where the others announced a newer one
    as they lost it); it announces the next epoch for itself, as the local launcher
    does for a rank it starts again, and every rank joins that one: a worker rejoins the live
    run, a PS that lost its shards makes every shard roll back to the last checkpoint. The
    chief's session (its hooks, metrics, saver) died with it: it stops with one line."""
    if not STATE.self_announce:
        return
    s, attempt = store.store(), STATE.attempt
    while True:
        epoch, over = parse_epoch(s.get(epoch_key(attempt)))
        if over:
            raise TrainingOver(f"{me()} was started again after training had ended: nothing "
                               "to rejoin")
        if not any(s.check([gather_key(attempt, e, STATE.rank)]) for e in range(epoch + 1)):
            return  # a first start: join as usual
        if is_chief:  # (the others, waiting for it at a gathering, stop at once with this)
            again = ("start the job again (it resumes from the last checkpoint in "
                     "checkpoint.dir)")
            s.set(membership.failed_key(attempt), f"the chief ({me()}) was lost and started "
                  f"again: the run cannot go on without its session; {again}")
            raise PsrpcError(
                f"{me()} (the chief) was started again while the other ranks of the run live: "
                f"its session is gone with its earlier life; stop every rank and {again}")
        if announce(s, attempt, epoch + 1, [me()]):
            log.warning("%s was started again into the running job: membership epoch %d",
                        me(), epoch + 1)
            return


def recover(timeout_s: float, may_ask: bool = True) -> bool:
    """An RPC of this rank failed: whether it is a membership change, to be joined: one
    announced within `timeout_s` (a peer left the old group). Where the ranks announce epochs
    (torchrun, srun) this rank asks for one instead (`ask`: it was cut off), unless `may_ask`
    is False (a failure no new epoch mends: the chief's start-up, the chief gone)."""
    if STATE.self_announce and may_ask:
        return ask()
    return membership.wait_change(timeout_s)


def chief_lost(grace_s: float) -> bool:
    """A PS's ping to the chief failed: whether it is a membership change, to be joined. Where
    the ranks announce epochs the chief may be cut off (it asks for an epoch once the store
    answers) or lost and being started again by its engine (it then marks the attempt failed:
    this raises with its line), and starting a process takes longer than `grace_s` on a busy
    host: wait cluster.init_timeout_s for either. Elsewhere the launcher announces within
    `grace_s` (it starts every rank again when the chief dies)."""
    if STATE.self_announce:
        return membership.wait_change(max(grace_s, STATE.timeout_s))
    return membership.wait_change(grace_s)


class _Final(Exception):
    """The attempt is marked failed in the store: asking for another epoch is pointless."""


def ask() -> bool:
    """Where the ranks announce epochs, after an RPC of this rank failed (its host cut off by a
    partition, say): announce the next epoch as soon as the store answers again, within
    cluster.init_timeout_s. True once an epoch newer than this rank's is announced (by it, or
    by another rank first); False when training has ended (then `ended()` says so). Raises
    when the store stays out of reach (its host lost, say)."""
    attempt, timeout_s = STATE.attempt, STATE.timeout_s
    deadline = time.monotonic() + timeout_s
    waited = recorded = False
    s = None  # one connection while it answers, a new one after it failed
    while not STOPPING.is_set():
        try:
            s = s or store.client(min(STORE_CALL_S, timeout_s))
            epoch, over = parse_epoch(s.get(epoch_key(attempt)))
            if over:
                STATE.over = True
                return False
            if s.check([membership.failed_key(attempt)]):  # no epoch mends it (a rank missing)
                raise _Final(f"{me()}: {s.get(membership.failed_key(attempt)).decode()}")
            if not recorded and (waited or epoch <= current()):
                # cut off (not a call that failed as its peers left for an announced epoch):
                # in the epoch this rank will join (another cut-off rank's, if announced)
                s.append(_asked_key(attempt, max(epoch, current() + 1)), f"{me()},")
                recorded = True
            if epoch <= current():
                announce(s, attempt, current() + 1, [me()])
                continue  # read again: ours, or another rank's, or the chief ended training
            store.renew(STATE.timeout_s)  # the old connection may be broken
            if waited:
                log.warning("%s: the store answers again; joining membership epoch %d",
                            me(), epoch)
            CHANGE.set()
            return True
        except _Final as e:
            raise PsrpcError(str(e)) from None
        except Exception as e:
            s = None
            if time.monotonic() >= deadline:  # its host lost, or cut off for good
                where = store.where()
                raise PsrpcError(
                    f"{me()}: cut off: the rendezvous store ({where.get('host')}:"
                    f"{where.get('port')}) did not answer within {timeout_s:g} s "
                    f"(cluster.init_timeout_s): {first_line(e)}") from e
            if not waited:
                log.warning("%s: cut off (the rendezvous store does not answer: %s); trying "
                            "again for up to %g s (cluster.init_timeout_s)", me(),
                            first_line(e), timeout_s)
            waited = True
            time.sleep(0.5)
    return False


def cut_off(epoch: int) -> list[str]:
    """The ranks that asked for epoch `epoch` because they had lost their connections (none
    where the launcher announces epochs: it starts lost ranks again)."""
    try:
        s = store.store()
        key = _asked_key(STATE.attempt, epoch)
        return [n for n in s.get(key).decode().split(",") if n] if s.check([key]) else []
    except Exception:
        return []


def over_while_cut_off() -> bool:
    """Whether `ask` found that training had ended while this rank was cut off."""
    return bool(STATE.over)


def _left_key(attempt: int, rank: int) -> str:
    return f"psrpc/attempt-{attempt}/left/{rank}"


DEPART_CALL_S = 5.0  # a rank's word that it leaves: given up after (the store may be gone)


def depart(wait_for_others: bool = True, failed: str = "") -> None:
    """A torchrun or srun rank, as it leaves (its work done, or `failed` with that line): say
    so in the store. A chief that failed marks the attempt failed with its line: the others,
    waiting for it (a PS pinging it, ranks at a gathering), stop at once with it. The rank that
    hosts the store (srun's task 0; torchrun's store is its agent's), its work done, then
    waits, up to cluster.init_timeout_s, for every other rank's word: a rank cut off until
    after training ended asks the store, once the network heals, whether it is over, and must
    find the answer there, not a closed port (it would stop with an error after
    init_timeout_s)."""
    if not STATE.self_announce:
        return
    attempt, rank = STATE.attempt, STATE.rank
    try:
        s = store.client(DEPART_CALL_S) if not store.where().get("hosted") else store.store()
        s.set(_left_key(attempt, rank), "1")
        if failed and me() == "worker0":
            s.compare_set(membership.failed_key(attempt), "", f"the chief failed: {failed}")
    except Exception:  # the store is gone (its host left first): nobody to tell
        return
    if not (wait_for_others and store.where().get("hosted")):
        return
    keys = {r: _left_key(attempt, r) for r in range(len(STATE.names)) if r != rank}
    t0, said = time.monotonic(), False
    while True:
        missing = [STATE.names[r] for r, k in keys.items() if not s.check([k])]
        waited = time.monotonic() - t0
        if not missing or waited >= STATE.timeout_s or STOPPING.is_set():
            break
        if waited > 2.0 and not said:  # (the others leave within a second of each other)
            log.warning("%s hosts the rendezvous store: waiting up to %g s "
                        "(cluster.init_timeout_s) for %s to learn that training ended (cut "
                        "off or lost)", me(), STATE.timeout_s, ", ".join(missing))
            said = True
        time.sleep(0.2)
    if missing:
        log.warning("%s: %s never came back; leaving", me(), ", ".join(missing))

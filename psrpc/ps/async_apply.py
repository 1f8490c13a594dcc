"""Asynchronous apply (`update=async`): every gradient is applied on arrival, under the shard's lock.

Staleness of a gradient = version when applied - version it was computed on; it is recorded per
applied push (max and mean reach the summary). `staleness_lr` divides the learning rate by
(staleness + 1). A non-finite gradient is rejected: the step passes on every shard with no update
(so that the worker moves on to another batch and every shard keeps the same version).

Unbounded (`max_staleness` null): each shard applies pushes in the order they arrive.

Bounded (`max_staleness = k`): the bound is enforced once, before a push touches any shard, by
the `StalenessClock` on the clock shard (global shard 0). A worker with a complete gradient asks
the clock for a ticket (`Shard.admit`): the clock holds it while admitting it would leave another
live worker more than k steps behind (a worker too far ahead waits), drops it if it is already
staler than k (a worker that was counted lost and came back), and otherwise gives it the next
ticket t. The worker then pushes every shard with t, and every shard applies ticket t as its
update t+1: all shards apply the same gradients in the same order, so their versions never drift
apart and the staleness of ticket t is exactly t - version on every shard. A clock wait longer
than `timeout_s` releases the push and counts the workers it waited for as lost; a ticket that
never reaches a shard (its worker died mid-push) is skipped after `timeout_s`.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from psrpc.cluster import comm
from psrpc.cluster.wire import Ticket
from psrpc.errors import PushRejected
from psrpc.ps.liveness import LiveSet, Watchdog, running_time

log = logging.getLogger(__name__)
CLOCK_SHARD = 0


@dataclass
class _Waiting:
    version: int
    seq: int
    worker: int = field(compare=False)
    future: torch.futures.Future = field(compare=False)
    since: float = field(compare=False)


class StalenessClock:
    """Admission for bounded staleness; lives on the clock shard, under its lock."""

    def __init__(self, shard, k: int, timeout_s: float, live: LiveSet):
        self.shard, self.k, self.timeout_s, self.live = shard, k, timeout_s, live
        self.issued = shard.version  # next ticket
        self.limit = shard.max_steps  # no ticket at or past it
        self.base = [shard.version] * live.num_workers  # version each worker computes on
        self.last = [-1] * live.num_workers  # each worker's last ticket
        self._waiting: list[_Waiting] = []
        self._seq = itertools.count()

    def admit(self, worker: int, version: int) -> torch.futures.Future:
        """Caller holds the lock; returns the Future of a Ticket and what became ready."""
        self.live.seen(worker)
        self.base[worker] = version
        fut: torch.futures.Future = torch.futures.Future()
        self._waiting.append(_Waiting(version, next(self._seq), worker, fut, running_time()))
        return fut

    def drain(self, overdue: bool = False) -> list:
        """Answer waiting workers, oldest version first (among equals, the one whose last
        ticket is oldest: a slow worker is not starved by fast ones), while the bound allows."""
        ready = []
        self._waiting.sort(key=lambda w: (w.version, self.last[w.worker], w.seq))
        while self._waiting:
            head = self._waiting[0]
            if self.issued >= self.limit:
                ready.append((self._waiting.pop(0).future, Ticket(None, finished=True)))
                continue
            t = self.issued
            if t - head.version > self.k:  # staler than k already: never applied
                self._waiting.pop(0)
                self.shard.stats.stale(head.worker)
                self.base[head.worker] = self.shard.version  # at least what it will pull
                ready.append((head.future, Ticket(None)))
                continue
            blockers = self._blockers(t, head.worker)
            if blockers:
                if not (overdue and running_time() - head.since > self.timeout_s):
                    break
                log.warning("%s: worker%d waited %.1f s (update.timeout_s) for %s to catch up "
                            "(update.max_staleness=%d); going on without them", self.shard.name,
                            head.worker, self.timeout_s,
                            ", ".join(f"worker{w}" for w in blockers), self.k)
                self.live.lose(blockers)
            self._waiting.pop(0)
            self.issued += 1
            self.base[head.worker] = t + 1  # its replies come after ticket t is applied
            self.last[head.worker] = t
            ready.append((head.future, Ticket(t)))
        return ready

    def _blockers(self, t: int, worker: int) -> list[int]:
        """Live workers still computing that ticket t would leave more than k behind."""
        waiting = {w.worker for w in self._waiting}
        return [u for u in sorted(self.live.alive)
                if u != worker and u not in waiting and t + 1 - self.base[u] > self.k]

    def restart(self) -> None:
        """From the shard's version, as at start: no ticket out, every worker on it."""
        self._waiting.clear()
        self.issued = self.shard.version
        self.base = [self.shard.version] * len(self.base)

    def freeze(self, target: int) -> int:
        """Issue no ticket at or past `target` (never below what is issued); returns the
        step every shard must reach: the tickets already issued."""
        self.limit = max(self.issued, min(self.limit, target))
        return self.issued


@dataclass
class _Held:
    worker: int
    version: int
    grad: Optional[torch.Tensor]
    loss: float
    samples: int
    future: torch.futures.Future
    since: float


class AsyncApplier:
    def __init__(self, shard, cfg, num_workers: int):
        self.shard = shard
        self.k = cfg.max_staleness
        self.staleness_lr = bool(cfg.staleness_lr)
        self.timeout_s = float(cfg.timeout_s)
        self.live = LiveSet(num_workers)
        self.ordered = self.k is not None  # pushes carry tickets and apply in ticket order
        self.clock = (StalenessClock(shard, self.k, self.timeout_s, self.live)
                      if self.ordered and shard.index == CLOCK_SHARD else None)
        self._held: dict[int, _Held] = {}  # ticket -> push waiting for its turn
        self._watchdog = (Watchdog(self._overdue, min(0.1, self.timeout_s / 10),
                                   f"{shard.name}-staleness") if self.ordered else None)

    def admit(self, worker: int, version: int) -> torch.futures.Future:
        if self.clock is None:
            return comm.failed(PushRejected(
                f"{self.shard.name}: admit is for the clock shard with update.max_staleness set"))
        with self.shard.lock:
            fut = self.clock.admit(worker, version)
            ready = self.clock.drain()
        comm.resolve_all(ready)
        return fut

    def push(self, worker: int, version: int, grad: Optional[torch.Tensor], loss: float,
             samples: int, ticket: Optional[int] = None):
        """`grad` None: the shard found the push non-finite. `ticket`: bounded mode only."""
        shard = self.shard
        with shard.lock:
            self.live.seen(worker)
            if not self.ordered:
                return comm.settled(self._apply(worker, version, grad, loss, samples))
            if ticket < shard.version:  # skipped after update.timeout_s: too late now
                shard.stats.stale(worker)
                return comm.completed(shard.reply(accepted=False))
            if ticket in self._held:
                return comm.failed(PushRejected(
                    f"{shard.name}: worker{worker} pushed ticket {ticket}, already pushed"))
            future: torch.futures.Future = torch.futures.Future()
            self._held[ticket] = _Held(worker, version, grad, loss, samples, future,
                                       running_time())
            ready = self._drain()
        comm.resolve_all(ready)
        return future

    def _apply(self, worker, version, grad, loss, samples):
        """One push now: apply it, or pass the step without an update (non-finite, or an
        error, which its waiter gets). Caller holds the lock; returns the Reply or the error."""
        shard = self.shard
        if shard.finished:
            return shard.reply(accepted=False)
        if grad is None:
            shard.count_nonfinite(worker, version)
            shard.advance()
            return shard.reply(accepted=False, skipped=True)
        staleness = shard.version - version
        if self.k is not None and staleness > self.k:  # only a malformed ticket gets here
            shard.stats.stale(worker)
            shard.advance()
            return shard.reply(accepted=False)
        try:
            shard.step_optimizer(grad, 1.0 / (staleness + 1) if self.staleness_lr else 1.0)
        except Exception as e:  # the step passes unapplied: every shard keeps the same version
            log.exception("%s: applying worker%d's gradient failed", shard.name, worker)
            shard.advance()
            return e
        shard.stats.applied(worker, int(samples), staleness)
        shard.record_loss(float(loss))
        shard.advance()
        return shard.reply(accepted=True, loss=shard.recent_loss)

    def _drain(self) -> list:
        """Apply held tickets in order while the next one is here; caller holds the lock."""
        ready = []
        while self.shard.version in self._held:
            h = self._held.pop(self.shard.version)
            ready.append((h.future, self._apply(h.worker, h.version, h.grad, h.loss,
                                                h.samples)))
        if self.shard.finished:  # tickets past the end (training was stopped early)
            ready += [(h.future, self.shard.reply(accepted=False)) for h in self._held.values()]
            self._held.clear()
        return ready

    def _overdue(self) -> None:
        """Watchdog: release clock waits past timeout_s; skip a ticket that never came."""
        shard = self.shard
        with shard.lock:
            ready = self.clock.drain(overdue=True) if self.clock is not None else []
            if self._held and shard.version not in self._held and not shard.finished:
                oldest = min(h.since for h in self._held.values())
                if running_time() - oldest > self.timeout_s:
                    log.warning("%s: ticket %d never arrived within %.1f s (update.timeout_s; "
                                "its worker died mid-push?); skipping it", shard.name,
                                shard.version, self.timeout_s)
                    shard.advance()
                    ready += self._drain()
        comm.resolve_all(ready)

    def new_epoch(self, replay: bool = False, gone: tuple = ()) -> None:
        """The old group's held pushes and clock waits are dropped (their workers push again);
        every worker is back but those `gone` for good. (`replay`: sync's; an async push is
        applied on arrival.)"""
        self.live.lost = set(gone)
        self._held.clear()
        if self.clock is not None:
            self.clock.restart()

    def caught_up(self) -> None:
        if self.clock is not None:
            self.clock.restart()

    def freeze(self, target: int) -> int:
        """Clock shard: stop issuing tickets; returns the step every shard must reach."""
        return self.clock.freeze(target) if self.clock is not None else target

    def release(self) -> list:
        """Training is over: answer every held push and clock wait without applying it."""
        done = [(h.future, self.shard.reply(accepted=False)) for h in self._held.values()]
        self._held.clear()
        if self.clock is not None:
            done += self.clock.drain()  # the limit is reached: every wait gets 'finished'
        return done

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.close()


"""Asynchronous apply (`update=async`): every gradient is applied on arrival, under the shard's lock.

Staleness of a gradient = version when applied - version it was computed on; it is recorded per
applied push (max and mean reach the summary). `staleness_lr` divides the learning rate by
(staleness + 1).

Bounded staleness (`max_staleness = k`) has two parts:
- no gradient staler than k is ever applied: it is dropped, counted and answered with fresh
  parameters (every shard enforces this);
- a worker too far ahead waits: on the clock shard (shard 0, whose version is the global step) a
  push is held while applying it would leave a worker that is still computing more than k steps
  behind. Held pushes go oldest first. Gating on one shard only keeps two shards from ever
  waiting on each other. A push held longer than `timeout_s` is released and the workers it
  waited for count as lost until they push again.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from psrpc import comm
from psrpc.liveness import LiveSet, Watchdog

log = logging.getLogger(__name__)
CLOCK_SHARD = 0


@dataclass(order=True)
class _Held:
    version: int
    seq: int
    worker: int = field(compare=False)
    grad: torch.Tensor = field(compare=False)
    loss: float = field(compare=False)
    samples: int = field(compare=False)
    future: torch.futures.Future = field(compare=False)
    since: float = field(compare=False)


class AsyncApplier:
    def __init__(self, shard, cfg, num_workers: int):
        self.shard = shard
        self.k = cfg.max_staleness
        self.staleness_lr = bool(cfg.staleness_lr)
        self.timeout_s = float(cfg.timeout_s)
        self.live = LiveSet(num_workers)
        self.base = [shard.version] * num_workers  # version each worker last received
        self.gate = self.k is not None and shard.index == CLOCK_SHARD
        self._held: list[_Held] = []
        self._seq = itertools.count()
        self._watchdog = (Watchdog(self._release_overdue, min(0.1, self.timeout_s / 10),
                                   f"{shard.name}-staleness-gate") if self.gate else None)

    def push(self, worker: int, version: int, grad: torch.Tensor, loss: float, samples: int):
        shard = self.shard
        with shard.lock:
            self.live.seen(worker)
            self.base[worker] = version
            if not self.gate:
                return comm.completed(self._apply_or_drop(worker, version, grad, loss, samples))
            future = torch.futures.Future()
            self._held.append(_Held(version, next(self._seq), worker, grad, loss, samples,
                                    future, time.monotonic()))
            ready = self._drain()
        for fut, reply in ready:
            fut.set_result(reply)
        return future

    def _apply_or_drop(self, worker, version, grad, loss, samples):
        """Apply one gradient now (or drop it if too stale); caller holds the lock."""
        shard = self.shard
        if shard.finished:
            return shard.reply(accepted=False)
        staleness = shard.version - version
        if self.k is not None and staleness > self.k:
            shard.stats.stale(worker)
            reply = shard.reply(accepted=False)
        else:
            shard.stats.applied(worker, int(samples), staleness)  # before a checkpoint in apply()
            shard.record_loss(float(loss))
            shard.apply(grad, 1.0 / (staleness + 1) if self.staleness_lr else 1.0)
            reply = shard.reply(accepted=True, loss=shard.recent_loss)
        self.base[worker] = reply.version
        return reply

    def _blockers(self, version: int) -> list[int]:
        """Live workers still computing that one more update would leave more than k behind."""
        held = {h.worker for h in self._held}
        return [w for w in sorted(self.live.alive)
                if w not in held and version + 1 - self.base[w] > self.k]

    def _drain(self, overdue: bool = False) -> list:
        """Apply held pushes, oldest first, while the bound allows; caller holds the lock."""
        ready = []
        self._held.sort()
        while self._held:
            head = self._held[0]
            too_stale = self.shard.version - head.version > self.k
            blockers = [] if self.shard.finished or too_stale else self._blockers(
                self.shard.version)
            if blockers:
                if not (overdue and time.monotonic() - head.since > self.timeout_s):
                    break
                log.warning("%s: worker%d's push waited %.1f s (update.timeout_s) for %s; "
                            "going on without them", self.shard.name, head.worker,
                            self.timeout_s, ", ".join(f"worker{w}" for w in blockers))
                self.live.lose(blockers)
            self._held.pop(0)
            ready.append((head.future, self._apply_or_drop(
                head.worker, head.version, head.grad, head.loss, head.samples)))
        return ready

    def _release_overdue(self) -> None:
        with self.shard.lock:
            ready = self._drain(overdue=True)
        for fut, reply in ready:
            fut.set_result(reply)

    def release(self) -> list:
        """Training is over: answer every held push without applying it."""
        done = [(h.future, self.shard.reply(accepted=False)) for h in self._held]
        self._held.clear()
        return done

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.close()

"""The barrier aggregator (`update=sync`): one optimizer step per round of gradients.

A push adds its gradient to the round's sum and gets the round's Future: the RPC thread is free
while the worker waits (`async_execution`). When `replicas_to_aggregate` gradients (default: every
live worker) are in, the sum is averaged, the optimizer steps once, the version goes up and every
waiter gets the same fresh parameters: large-batch SGD over the union of their batches.

A gradient computed on an older version is stale: dropped, counted, answered at once with the
current parameters (backup workers: with N < W the first N make the round). A round open longer
than `timeout_s` aggregates what it has; the missing workers count as lost and later rounds stop
waiting for them, until they push again.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Optional

import torch

from psrpc import comm
from psrpc.errors import PushRejected
from psrpc.liveness import LiveSet, Watchdog

log = logging.getLogger(__name__)


class SyncAggregator:
    def __init__(self, shard, cfg, num_workers: int):
        self.shard = shard
        self.num_workers = num_workers
        self.replicas_to_aggregate = cfg.replicas_to_aggregate or num_workers
        self.timeout_s = float(cfg.timeout_s)
        self.live = LiveSet(num_workers)
        shard.losses = deque(maxlen=1)  # recent_loss is the last round's mean
        self._sum = torch.zeros_like(shard.params)  # float32, the round's gradient sum
        self._new_round()
        self._watchdog = Watchdog(self._check_timeout, min(0.1, self.timeout_s / 10),
                                  f"{shard.name}-round-timeout")

    def _new_round(self) -> None:
        self._members: set[int] = set()
        self._first: Optional[torch.Tensor] = None  # a round's lone gradient, not yet summed
        self._losses: list[float] = []
        self._samples = 0
        self._opened: Optional[float] = None
        self._future = torch.futures.Future()

    def needed(self) -> int:
        """Gradients that close the round: N, or fewer when workers are lost."""
        return max(1, min(self.replicas_to_aggregate, len(self.live.alive)))

    def push(self, worker: int, version: int, grad: torch.Tensor, loss: float, samples: int):
        shard = self.shard
        with shard.lock:
            self.live.seen(worker)
            if version < shard.version:  # stale (also when training has just finished)
                shard.stats.stale(worker)
                return comm.completed(shard.reply(accepted=False))
            if shard.finished:
                return comm.completed(shard.reply(accepted=False))
            if worker in self._members:
                return comm.failed(PushRejected(
                    f"{shard.name}: worker{worker} pushed twice for step {version}"))
            # The first gradient of a round is kept as is (no pass over it); the second is added
            # to it into the float32 sum buffer, later ones in place (grad may be bf16 on the wire).
            if not self._members:
                self._first = grad
            elif self._first is not None:
                if grad.dtype == torch.float32:
                    torch.add(self._first, grad, out=self._sum)
                else:  # sum bf16/fp16 gradients in float32, not in their own precision
                    self._sum.copy_(self._first).add_(grad)
                self._first = None
            else:
                self._sum.add_(grad)
            self._members.add(worker)
            self._losses.append(float(loss))
            self._samples += int(samples)
            if self._opened is None:
                self._opened = time.monotonic()
            future = self._future
            done = self._close_round() if len(self._members) >= self.needed() else None
        if done is not None:
            done[0].set_result(done[1])  # outside the lock: completing sends every reply
        return future

    def _close_round(self):
        """Average, step, reply. Caller holds the lock; returns (future, reply) to complete."""
        shard = self.shard
        count = len(self._members)
        total = self._sum if self._first is None else self._first
        for w in self._members:  # counters first: a checkpoint taken in apply() includes them
            shard.stats.applied(w, 0)
        shard.stats.samples += self._samples
        loss = sum(self._losses) / count
        shard.record_loss(loss)
        shard.apply(total if count == 1 else total.div_(count))
        # Zero-copy when every worker is in the round: none can push again (and no update can
        # happen) before it has received this reply in full. With backups or lost workers a
        # faster worker could close the next round while a reply is still being written.
        everyone = count == self.num_workers and not self.live.lost
        reply = shard.reply(accepted=True, loss=loss, shared=everyone)
        future = self._future
        self._new_round()
        return future, reply

    def _check_timeout(self) -> None:
        shard, done = self.shard, None
        with shard.lock:
            if self._opened is not None and time.monotonic() - self._opened > self.timeout_s:
                missing = sorted(self.live.alive - self._members)
                log.warning("%s: round %d waited %.1f s (update.timeout_s) with %d of %d "
                            "gradients; going on without %s", shard.name, shard.version,
                            self.timeout_s, len(self._members), self.needed(),
                            ", ".join(f"worker{w}" for w in missing))
                self.live.lose(missing)
                done = self._close_round()
        if done is not None:
            done[0].set_result(done[1])

    def release(self) -> list:
        """Training is over: answer the open round's waiters (their gradients are discarded)."""
        if not self._members:
            return []
        done = [(self._future, self.shard.reply(accepted=False))]
        self._new_round()
        return done

    def close(self) -> None:
        self._watchdog.close()

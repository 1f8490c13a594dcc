"""The barrier aggregator (`update=sync`): one optimizer step per round of gradients.

A push adds its gradient to the round and gets the round's Future: the RPC thread is free while
the worker waits (`async_execution`). When `replicas_to_aggregate` gradients (default: every live
worker) are in, they are summed in the binary tree over the workers' indices (psrpc/optim/
treesum.py: a rerun gives the same bits whatever order they arrived in, and a host's sum of an
aligned block of workers, update.host_push, takes that block's place in the tree), averaged,
the optimizer steps once, the version goes up and every waiter gets the same fresh
parameters: large-batch SGD over the union of their batches.

A gradient computed on an older version is stale: dropped, counted, answered at once with the
current parameters (backup workers: with N < W the first N make the round). A non-finite gradient
is rejected: its worker is excused from the round (it waits for the round like the others and
moves on to the next batch: its batch is skipped); a round whose every gradient was rejected
advances the step without an update. A round open longer than `timeout_s` aggregates what it
has; the missing workers count as lost and later rounds stop waiting for them, until they push
again. A void push (shared memory, views: the worker's gradient was computed across an update of
a master copy it reads in place, psrpc/cluster/shm.py `writing`) is dropped, counted stale, and
its worker excused from the round. An error while closing a round goes to every waiter of that round; the next round starts
clean.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import replace
from typing import Optional

import torch

from psrpc.cluster import comm
from psrpc.cluster.wire import HostSum
from psrpc.errors import PushRejected
from psrpc.ps.liveness import LiveSet, Watchdog, running_time

log = logging.getLogger(__name__)


class SyncAggregator:
    takes_void = True  # a push may say its gradient is void (shm.VOID): excused, counted stale
    takes_host = True  # a push may carry a host's sum of several workers' (update.host_push)

    def __init__(self, shard, cfg, num_workers: int):
        self.shard = shard
        self.num_workers = num_workers
        self.replicas_to_aggregate = cfg.replicas_to_aggregate or num_workers
        self.timeout_s = float(cfg.timeout_s)
        self.live = LiveSet(num_workers)
        shard.losses = deque(maxlen=1)  # recent_loss is the last round's mean
        self._new_round()
        self._watchdog = Watchdog(self._check_timeout, min(0.1, self.timeout_s / 10),
                                  f"{shard.name}-round-timeout")

    def _new_round(self) -> None:
        # first worker of a push -> its gradient (as received), and the block it sums:
        # level 0 for one worker's, s for a host's sum of the 2^s workers from there on
        self._grads: dict[int, torch.Tensor] = {}
        self._levels: dict[int, int] = {}
        self._summed: set[int] = set()  # workers whose gradient is in `_grads`
        self._losses: dict[int, float] = {}
        # pushed a non-finite or a void gradient: in the round, no vote
        self._excused: set[int] = set()
        self._void = 0  # of them: void gradients (the rest non-finite)
        self._samples = 0
        self._opened: Optional[float] = None
        self._future = torch.futures.Future()

    @property
    def members(self) -> set[int]:
        return self._summed | self._excused

    def needed(self) -> int:
        """Pushes that close the round: N, or fewer when workers are lost."""
        return max(1, min(self.replicas_to_aggregate, len(self.live.alive)))

    def push(self, worker: int, version: int, grad: Optional[torch.Tensor], loss: float,
             samples: int, ticket=None, void: bool = False, host=None):
        """`grad` None: the shard found the push non-finite. `void`: the worker computed its
        gradient across an update of a master copy it reads in place (shared memory, views:
        a round closed without it); it is dropped and counted as stale, and the worker is
        excused from the round (no vote), as for a non-finite gradient. `host` (a HostSum,
        checked by the shard): `grad` is the sum of `host.workers`' gradients, the rest of
        the block excused; each of them is a member of the round."""
        shard = self.shard
        block = [worker] if host is None else sorted(set(host.workers) | set(host.excused))
        with shard.lock:
            for w in block:
                self.live.seen(w)
            if version < shard.version:  # stale (also when training has just finished)
                for w in block:
                    shard.stats.stale(w)
                return comm.completed(shard.reply(accepted=False))
            if shard.finished:
                return comm.completed(shard.reply(accepted=False))
            twice = [w for w in block if w in self.members]
            if twice:
                return comm.failed(PushRejected(
                    f"{shard.name}: worker{twice[0]} pushed twice for step {version}"))
            if void:
                shard.stats.stale(worker)
                self._excused.add(worker)
                self._void += 1
            elif grad is None or (host is not None and not host.workers):
                for w in block:
                    shard.count_nonfinite(w, version)
                    self._excused.add(w)
            else:
                self._grads[worker] = grad
                if host is None:
                    self._levels[worker] = 0
                    self._summed.add(worker)
                    self._losses[worker] = float(loss)
                else:
                    shard.stats.host_sums += 1
                    self._levels[worker] = host.level
                    self._summed.update(host.workers)
                    self._losses.update(zip(host.workers, map(float, host.losses)))
                    for w in host.excused:
                        shard.count_nonfinite(w, version)
                        self._excused.add(w)
                self._samples += int(samples)
            if self._opened is None:
                self._opened = running_time()
            future = self._future
            done = self._close_round() if len(self.members) >= self.needed() else None
        if done is not None:
            comm.resolve_all([done])
        if void:  # same round, same parameters; not a non-finite batch
            return future.then(lambda f: replace(f.value(), accepted=False))
        if grad is None:  # same round, same parameters; the reply says its batch was skipped
            return future.then(lambda f: replace(f.value(), accepted=False, skipped=True))
        return future

    def check_host(self, worker: int, grad, host) -> None:
        """A host's sum (update.host_push): a block of this shard's workers, led by the pushing
        worker; raises PushRejected otherwise (called before anything changes)."""
        name = self.shard.name
        if not isinstance(host, HostSum) or not isinstance(grad, torch.Tensor):
            raise PushRejected(f"{name}: worker{worker} pushed {host!r} with "
                               f"{type(grad).__name__}: expected a HostSum with a tensor")
        level, block = host.level, set(host.workers) | set(host.excused)
        end = worker + (1 << level) if type(level) is int and 1 <= level <= 30 else -1
        ok = (end > worker and worker % (1 << level) == 0 and worker in block
              and len(block) == len(host.workers) + len(host.excused)
              and all(type(w) is int and worker <= w < min(end, self.num_workers) for w in block)
              and list(host.workers) == sorted(host.workers)
              and len(host.losses) == len(host.workers)
              and all(type(x) in (int, float) for x in host.losses))
        if not ok:
            raise PushRejected(f"{name}: worker{worker} pushed a malformed host sum {host!r}: "
                               "expected the workers of the aligned block of 2^level starting "
                               "at the pusher, each once, a loss for each in the sum")

    def _close_round(self, absent: Optional[str] = None):
        """Sum in the tree order, average, step, reply. Caller holds the lock; returns
        (future, reply or exception) to complete outside the lock. `absent`: why the workers
        not in the round are missing (default: lost earlier, or backup workers)."""
        shard, future = self.shard, self._future
        workers = sorted(self._summed)
        self._count_missing(absent)
        try:
            if workers:
                loss = sum(self._losses[w] for w in workers) / len(workers)
                firsts = sorted(self._grads)  # the tree's leaves and host sums, in place
                grads = [self._grads[w] for w in firsts]
                if len(firsts) == len(workers):  # one gradient per worker (a table's too)
                    shard.step_optimizer(shard.average(grads, firsts))
                else:  # (only dense shards take host sums)
                    shard.step_optimizer(shard.average(
                        grads, firsts, [self._levels[w] for w in firsts], count=len(workers)))
                for w in workers:
                    shard.stats.applied(w, 0)
                shard.stats.samples += self._samples
                shard.record_loss(loss)
            else:  # every gradient of the round was rejected: the step passes, no update
                loss = None
            shard.advance()
            # Zero-copy when every worker is in the round: none can push again (and no update
            # can happen) before it has received this reply in full. With backups or lost
            # workers a faster worker could close the next round while a reply is still being
            # written.
            everyone = len(self.members) == self.num_workers and not self.live.lost
            reply = shard.reply(accepted=bool(workers), loss=loss, shared=everyone)
        except Exception as e:  # the round's waiters get the error; the next round starts clean
            log.exception("%s: closing round %d failed", shard.name, shard.version)
            reply = e
        self._new_round()
        return future, reply

    def _count_missing(self, absent: Optional[str]) -> None:
        """The round's gradients that will not be in its update, by why (ShardStats.short)."""
        stats = self.shard.stats
        stats.missed("void", self._void)
        stats.missed("rejected", len(self._excused) - self._void)
        why = absent or ("lost" if self.live.lost else "backup_workers")
        stats.missed(why, self.num_workers - len(self.members))

    def _check_timeout(self) -> None:
        shard, done = self.shard, None
        with shard.lock:
            waited = running_time() - self._opened if self._opened is not None else 0.0
            if waited > self.timeout_s:
                missing = sorted(self.live.alive - self.members)
                log.warning("%s: round %d waited %.2f s (update.timeout_s=%g) with %d of %d "
                            "gradients; going on without %s", shard.name, shard.version,
                            waited, self.timeout_s, len(self.members), self.needed(),
                            ", ".join(f"worker{w}" for w in missing))
                self.live.lose(missing)
                done = self._close_round("timeout")
        if done is not None:
            comm.resolve_all([done])

    def new_epoch(self, replay: bool = False, gone: tuple = ()) -> None:
        """The round's waiters belonged to the old group: close it with what it has, answering
        nobody; every worker is back (one was started again) but those `gone` for good, whom
        no round waits for. `replay`: drop it instead, every worker pushes the same gradient
        again (a PS failed over, cluster.ps_replicas)."""
        self.live.lost = set(gone)
        if replay:
            self._new_round()
        elif self.members:
            self._future = torch.futures.Future()  # no one waits on it any more
            self._close_round("epoch")

    def release(self) -> list:
        """Training is over: answer the open round's waiters (their gradients are discarded)."""
        if not self.members:
            return []
        done = [(self._future, self.shard.reply(accepted=False))]
        self._new_round()
        return done

    def close(self) -> None:
        self._watchdog.close()


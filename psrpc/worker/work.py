"""A data-parallel worker's computed step (`Work`), and what it does with one when a PS failed
over to a backup (`replay_step`, cluster.ps_replicas)."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Optional

import torch

from psrpc.cluster import comm
from psrpc.cluster.wire import Reply
from psrpc.sparse.rows import mean_rows
from psrpc.worker.cache import RowCache

log = logging.getLogger(__name__)


class Work:
    """A computed step, not yet pushed: its loss, the dense shards' push Futures (None: the
    staleness clock did not admit it), its table gradients and the rows asked ahead."""

    def __init__(self, versions: list[int], loss: float, futures: Optional[list],
                 ticket: Optional[int] = None, table_grads: Optional[dict] = None):
        self.versions, self.loss, self.futures = versions, loss, futures
        self.ticket, self.table_grads = ticket, table_grads or {}
        self.ahead: Optional[dict] = None
        self.table_versions: Optional[list[int]] = None  # the table shards' at its push
        self.finite = True


def mean_of_parts(parts: list[dict]) -> dict:
    """{table: (rows, mean gradient[, counts])} of the micro-batches' table gradients."""
    return {name: mean_rows([p[name] for p in parts], len(parts))[:-1] for name in parts[0]}


class Grad:
    """A tensor seen as a parameter whose .grad it is (for clip_grad_norm_)."""

    def __init__(self, grad: torch.Tensor):
        self.grad = grad


def replay_step(self, work: Optional["Work"], pulled: list[Reply]) -> Optional["Work"]:
    """`self`, a data-parallel Worker, after a PS failed over to a backup (the epoch's plan says `replay`, sync): the step
    `work` whose replies the old group lost, pushed again, unchanged, to every shard still
    at the version it was computed on (the others applied its round: their pulled
    parameters are that round's reply). Each shard's round then holds every worker's
    gradient, as without the failure: nothing is computed twice, no round goes short.
    None when there is nothing to push again."""
    if (work is None or work.futures is None or not self.plan.replay
            or self.allreduce is not None or work.versions[0] > pulled[0].version):
        return None
    behind = [k for k, r in enumerate(pulled) if r.version == work.versions[k]]
    tables_behind = work.table_versions is not None and any(
        v == w for v, w in zip(self.table_versions, work.table_versions))
    if not behind and not tables_behind:
        return None
    # The epoch's host-push blocks form first: a worker that computes the step afresh waits
    # there for every worker's host, this one too (it would otherwise hold that worker until
    # update.timeout_s closed the round without it)
    self.host.current(self.cfg, self.index, self.topo.replicas, self.client.shards, self.flat,
                      self.plan.layouts[0].shard_numel, self.stats)
    futures = [comm.completed(r) for r in pulled]
    for k in behind:
        futures[k] = self.client.push_one(k, work.versions[k], self.flat.grad_to_send(k),
                                          work.loss, self.batch, work.ticket)
    if self.rows is not None:  # the very messages the tables were sent (the cache's too)
        client = self.rows.client if isinstance(self.rows, RowCache) else self.rows
        ahead = [v > w for v, w in zip(self.table_versions, work.table_versions)]
        # A server that had applied the step answers it as stale, with the rows asked
        # ahead; its round took this push: accepted (a cache holding gradients would
        # otherwise take back what that push carried, and push it a second time)
        futures += [f.then(lambda f: replace(f.value(), accepted=True)) if was else f
                    for f, was in zip(client.push_again(), ahead)]
    log.warning("worker%d: pushing step %d again to %d of %d shards (their PS failed over "
                "before it was answered)", self.index, work.versions[0],
                len(behind) + int(tables_behind), len(pulled) + len(self.table_versions))
    replay = Work(work.versions, work.loss, futures, work.ticket, work.table_grads)
    replay.table_versions = work.table_versions  # (a second failover may replay it again)
    return replay

"""The data-parallel worker loop: the whole model, its slice of every global batch.

One step: take this replica's rows of the global batch of its data step; forward (under
autocast with train.amp) and backward on the worker's device (gradients land in flat per-shard
buffers); one `push_pull` per shard, all in flight at once (each as soon as backward completes
it); copy the returned parameters in.

The data step: in sync, the global step (shard 0's version), so a resumed or stale worker always
knows where it is and W workers of batch B see exactly what one worker of batch W·B sees (and
with train.accumulate=W, compute exactly what it computes). In
async, each worker walks the global batches at its own pace: its n-th push takes its slice of
global batch start/W + n (start: the step training resumed from), so its batches can be loaded
ahead and do not depend on timing; with one worker this is the global step again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable, Optional

import torch

from psrpc.cluster import comm, membership, sidechannel
from psrpc.cluster.topology import Topology
from psrpc.cluster.wire import WIRE_DTYPES, Reply
from psrpc.config import Config
from psrpc.errors import PsrpcError
from psrpc.factories import Data
from psrpc.optim.treesum import TreeAccumulator
from psrpc.sparse.tables import find_tables
from psrpc.worker import hostpush, rng
from psrpc.worker.allreduce import DenseAllReduce
from psrpc.worker.cache import RowCache
from psrpc.worker.client import ShardClient
from psrpc.worker.flat import FlatModel
from psrpc.worker.loader import split_batch
from psrpc.worker.plan import Plan
from psrpc.worker.replica import Replica, await_change, load_buffers, model_buffers
from psrpc.worker.rows import RowClient
from psrpc.worker.work import Grad, Work, mean_of_parts, replay_step


class Worker(Replica):
    """A data-parallel worker: the whole model, its slice of every global batch."""

    def __init__(self, cfg: Config, topo: Topology, plan: Plan, model=None,
                 dataset: Optional[Data] = None):
        super().__init__(cfg, topo, plan, dataset)
        self.index = topo.index
        self.model = (model or self.build_model(cfg, self.data)).to(self.device)
        load_buffers(self.model, plan.buffers)
        self.flat = FlatModel(self.model, plan.layouts[0], self.device,
                              WIRE_DTYPES[cfg.update.wire_dtype], plan.shm_for(0, self.index))
        self.client = ShardClient(plan.shards[0], self.index)
        # update.dense=allreduce: the dense replica is this worker's, averaged among the workers
        self.allreduce = (DenseAllReduce(
            cfg, self.index, topo.replicas, self.flat, plan.dense,
            nccl=self.device.type == "cuda"
            and topo.workers_on_this_node <= torch.cuda.device_count())
            if plan.dense is not None else None)
        # Embedding tables live on the PS: the model's look their rows up there.
        self.tables = find_tables(self.model)
        self.table_versions: list[int] = []
        self.rows = None
        # Pulls ahead of time: with a staleness bound of a step or more, dense all-reduce and
        # sync rounds, step t+1 is computed while step t's round is under way, on rows read
        # at t (see `run`). Buffers (BatchNorm) would take t+1's batch before the chief saves
        # step t+1's: such models, and micro-batches (train.accumulate), step one at a time.
        self.accumulate = cfg.train.accumulate
        self.host = hostpush.Blocks()  # update.host_push: this epoch's block on this host
        self._work: Optional[Work] = None  # the last step computed
        self._accumulator = TreeAccumulator()
        self.pipelined = bool(self.tables) and self.allreduce is not None and self.sync \
            and cfg.sparse.cache_staleness >= 1 and not model_buffers(self.model) \
            and self.accumulate == 1 and cfg.sparse.pull_ahead != "off"
        if cfg.sparse.pull_ahead == "on" and not self.pipelined:  # (the rest: validate.py)
            raise PsrpcError("sparse.pull_ahead=on: this model cannot pull ahead ("
                             + ("it has no embedding tables)" if not self.tables else
                                "its buffers (BatchNorm's) or train.accumulate make it step "
                                "one at a time)"))
        if self.tables:
            self.rows = self._row_client(plan)
            sp = cfg.sparse
            if sp.cache_rows > 0 and sp.cache_staleness > 0:
                self.rows = RowCache(self.rows, plan.table_specs, sp.cache_rows,
                                     sp.cache_staleness, self._table_clock, self._flush_all,
                                     self.stats, hold=sp.cache_writes == "hold")
            for t in self.tables:
                t.bind(self.rows)

    def _row_client(self, plan: Plan) -> RowClient:
        # a PS on this host takes the tables' pushes through a side channel (cluster.shm)
        channels = (None if self.cfg.cluster.shm == "off" else
                    sidechannel.channels_to(plan.table_shards, comm.rpc_timeout_s(self.cfg)))
        return RowClient(plan.table_shards, plan.table_specs, plan.partition, self.index,
                         stats=self.stats, lag=int(self.pipelined), channels=channels)

    def _table_clock(self) -> int:
        """The global step this worker's tables are at (the newest table shard's version)."""
        return max(self.table_versions, default=0)

    def _flush_all(self, step: int) -> bool:
        """Whether the push of `step` must carry every gradient the row cache holds: a
        checkpoint is taken after it, or training ends within a round of every worker."""
        every = self.cfg.checkpoint.every_steps if self.cfg.checkpoint.dir else 0
        return bool(every and (step + 1) % every == 0) or \
            step + self.topo.replicas >= self.cfg.train.steps

    def buffers(self) -> dict[str, torch.Tensor]:
        """This replica's buffers (BatchNorm statistics: not parameters, so not on the PS)."""
        return {n: b.detach().cpu().clone() for n, b in model_buffers(self.model).items()}

    def load(self, replies: list[Reply]) -> list[int]:
        if self.allreduce is not None:  # the clock's step: the replica is brought to it
            self.allreduce.catch_up(replies[0].version)
        else:
            for k, r in enumerate(replies):
                self.flat.load(k, r.params)
        if self.rows is not None:  # the table shards' versions (their rows are pulled per batch)
            self.table_versions = [r.version for r in self.rows.pull_versions()]
        return [r.version for r in replies]

    def receive(self, futures: list) -> list[Reply]:
        """Wait for each shard's reply and copy it in at once, while later ones still arrive;
        then the table shards' replies (after the dense ones in `futures`). With
        update.dense=allreduce the one dense reply is the clock's: the replica then applies
        the averaged gradient if its round was applied."""
        dense = len(self.client.shards)
        replies = []
        for k, fut in enumerate(futures[:dense]):
            (reply,) = self.client.wait([fut], first=k)
            if self.allreduce is None:
                self.flat.load(k, reply.params)
            replies.append(reply)
        if self.allreduce is not None:  # (pipelined: applied before its push, see `run`)
            self.allreduce.settle(replies[0].version, ahead=self.pipelined)
        if self.rows is not None:
            tables = comm.wait_all(futures[dense:])
            self.rows.receive(tables)
            self.table_versions = [r.version for r in tables]
            replies[0] = replace(replies[0], skipped=replies[0].skipped or any(
                r.skipped for r in tables))
        return replies

    def step(self, step: int, versions: list[int]) -> tuple[float, Optional[list]]:
        """Forward and backward on this worker's rows of global batch `step`, pushing each shard
        as soon as backward completes it. Returns the loss and the push Futures; None when the
        staleness clock did not admit the gradient (`self.finished` says whether training is
        over; otherwise it was too stale)."""
        work = self._work = self.compute(step, versions)
        return work.loss, (None if work.futures is None else self.push(work))

    def compute(self, step: int, versions: list[int]) -> "Work":
        """`step`'s forward and backward; the dense shards' pushes go out as backward fills
        them, the tables' and the clock's wait for `push`. With train.accumulate=k the batch
        goes through in k micro-batches, each as worker index·k+m of a cluster of W·k workers
        of batch B/k would take it (its rows, its random draws), and their gradients are
        averaged as a sync round averages W·k workers' (summed in its tree order, divided by k; the
        tables' by the PS's own function): one worker accumulating k micro-batches of B gives
        the bits of k workers of B."""
        x, y = self.batches.get(step)
        parts = self.accumulate
        self.flat.zero_grad()
        self.flat.ready()
        if self.allreduce is not None:
            self.allreduce.abandon()  # what a failed step left
        futures: list = [None] * len(versions)
        ticket, value = None, 0.0

        block = self.host.current(self.cfg, self.index, self.topo.replicas, self.client.shards,
                                  self.flat, self.plan.layouts[0].shard_numel, self.stats)

        def push(k: int) -> None:  # once shard k's gradient is on the host (at once on CPU)
            if self.allreduce is not None:  # (all-reduced among the workers instead)
                self.allreduce.start(k)
                return
            if block is not None and block.shards[k]:  # the host's workers push one sum
                self.flat.send(k, lambda g: futures.__setitem__(k, block.push(
                    self.client, k, versions[k], g, value, self.batch)))
                return
            self.flat.send(k, lambda g: futures.__setitem__(
                k, self.client.push_one(k, versions[k], g, value, self.batch, ticket)))

        # Every gradient is needed before the first push for a NaN injection, the clock's
        # ticket (bounded staleness), clipping by norm and the mean of micro-batches;
        # otherwise shards go out as backward fills them.
        nan = self.faults.nan_due(versions[0])  # fault.* count global steps
        clip = self.cfg.train.clip_grad_norm
        overlap = not (nan or self.bounded or clip or parts > 1)
        self.faults.before_backward(versions[0])
        losses, table_parts = [], []
        acc = self._accumulator if parts > 1 else None
        for m, (xm, ym) in enumerate(split_batch((x, y), parts) if parts > 1 else [(x, y)]):
            rng.seed_all(rng.step_seed(self.cfg.train.seed, self.replica * parts + m, step))
            loss = self.forward_loss(self.model, xm, ym)
            losses.append(loss.item())
            if overlap:
                value = losses[0]
                self.flat.arm(push)
            loss.backward()
            table_parts.append(self.table_gradients())
            if acc is not None:  # summed as a round sums workers: the tree (optim/treesum.py)
                acc.add(self.flat.all_grads())
                for g in self.flat.all_grads():
                    g.zero_()
        rest = self.flat.disarm() if overlap else list(range(len(self.flat.params)))
        value = sum(losses) / parts  # (as a round averages its workers' losses)
        table_grads = self._step_gradients(versions[0], acc, table_parts, nan)
        if self.bounded:
            # After a pull the shards' versions can differ (tickets still in flight): the
            # oldest one bounds this gradient's staleness on every shard.
            admitted = self.client.admit(self.clock, min(versions + self.table_versions))
            if admitted.seq is None:
                self.finished = admitted.finished
                return Work(versions, value, None)
            ticket = admitted.seq
        for k in rest:  # shards with unused parameters, or all of them (see above)
            push(k)
        self.flat.flush()
        work = Work(versions, value, futures, ticket, table_grads)
        work.ahead = self._rows_ahead(step, x) if self.rows is not None else None
        work.table_versions = list(self.table_versions) if self.rows is not None else None
        if self.allreduce is not None:
            work.finite = self.allreduce.finish(versions[0])
        return work

    def _step_gradients(self, step: int, acc, table_parts: list[dict], nan: bool) -> dict:
        """The step's gradients once backward is done, treated as train.* asks: the mean of
        the micro-batches (dense in place; the tables' returned), a NaN injected where
        fault.* says, clipped to train.clip_grad_norm (this worker's own norm: the round
        averages clipped gradients)."""
        parts, clip = len(table_parts), self.cfg.train.clip_grad_norm
        table_grads = table_parts[0] if parts == 1 else mean_of_parts(table_parts)
        if acc is not None:
            acc.total(self.flat.all_grads())
            for g in self.flat.all_grads():
                g.div_(parts)  # (as the PS's average and the all-reduce divide)
        if nan:
            self.faults.corrupt(step, self.flat.all_grads() + [g[1] for g in
                                                        table_grads.values()])
        if clip:
            torch.nn.utils.clip_grad_norm_(
                list(self.model.parameters()) + [Grad(g[1]) for g in table_grads.values()],
                clip)
        return table_grads

    def push(self, work: "Work") -> list:
        """The clock's and the tables' pushes of a computed step: every push Future."""
        futures, versions, value, ticket = work.futures, work.versions, work.loss, work.ticket
        if self.allreduce is not None:  # the clock shard counts the round; a non-finite
            # average (every worker has the same) is pushed as a non-finite loss: skipped
            if self.pipelined:  # the next step is computed before this round's reply
                self.allreduce.apply_pending()
            args = (self.index, versions[0], _EMPTY, value if work.finite else float("nan"),
                    self.batch, ticket)
            if self.rows is not None and self.plan.table_shards[0].owner == self.clock.owner:
                # in the same message as the push to the tables of the clock's PS
                futures = [self.rows.ride(0, self.clock, "push_pull", args)]
            else:
                futures = [self.client.push_one(0, *args[1:])]
        if self.rows is not None:  # every table shard, after backward has reached the tables
            # (void, as the dense shards', when computed across an update of a master copy)
            futures += self.rows.push_async(work.table_grads, self.table_versions, value,
                                            self.batch, ticket, void=not self.flat.intact(),
                                            ahead=work.ahead)
        return futures

    def _rows_ahead(self, step: int, x) -> Optional[dict]:
        """Sync: {table: rows} of the next step's batch, for the table shards to send back with
        this step's replies; None when the next batch is not known here (async takes whatever
        data step comes next, and the last step has none) or the tables were not given the
        batch's features as they are (a model that derives them: only its forward knows)."""
        nxt = step + 1 + int(self.pipelined)  # pipelined: the step after next (see `run`)
        if self.cfg.update.name != "sync" or nxt >= self.cfg.train.steps \
                or not all(t.fed is x for t in self.tables):
            return None
        nxt = self.batches.get(nxt)[0]
        rows = {}
        for t in self.tables:
            rows.update(t.rows_for(nxt))
        return rows

    def table_gradients(self) -> dict:
        """{table: (unique global rows, row gradients)} of the last backward."""
        grads = {}
        for t in self.tables:
            grads.update(t.take_gradients())
        return grads

    def rebind(self, plan: Plan) -> None:
        """A new membership epoch: the same shards (or, after a roll back, restored ones)
        through new references."""
        moved = [k for k, (a, b) in enumerate(zip(self.plan.shards[0], plan.shards[0])) if a != b]
        for k in moved:  # failed over to a backup (cluster.ps_replicas): no shared memory
            self.flat.unshare(k)
        self.plan = plan
        self.client = ShardClient(plan.shards[0], self.index)
        self.clock = plan.shards[0][0]
        if self.tables:
            client = self._row_client(plan)
            old = self.rows.client if isinstance(self.rows, RowCache) else self.rows
            client.last = getattr(old, "last", None)  # (what a replay pushes again)
            if isinstance(self.rows, RowCache):
                if plan.replay:  # a failover: every table holds what it held, nothing rolled
                    self.rows.rebind(client)  # back: the cache is as good as before
                else:  # held gradients and cached rows are dropped
                    self.rows.bind(client)
            else:
                self.rows = client
            for t in self.tables:
                t.bind(self.rows)
        if plan.rolled_back_to is not None:
            load_buffers(self.model, plan.buffers)
        if self.allreduce is not None and plan.dense is not None:
            self.allreduce.load(plan.dense)

    def rejoin(self) -> tuple[list[Reply], list[int]]:
        """Join the new membership epoch's group, take its plan, pull the parameters."""
        epoch = membership.rejoin()
        if epoch is not None:  # None: nothing newer after all (a stale wake-up)
            self.rebind(self.plan_source(epoch))
            self._data_step = None  # async: from the current version again
        replies = self.client.pull()
        return replies, self.load(replies)

    def resume(self, pushed: Optional["Work"]) -> tuple[list[Reply], list[int], Optional["Work"]]:
        """Where to go on from: the parameters (in the new epoch's group when one is
        announced), and the step `pushed` to push again when a failover lost its replies."""
        if membership.changing():
            replies, versions = self.rejoin()
            replay = replay_step(self, pushed, replies)
        else:
            replies = self.client.pull()
            versions = self.load(replies)
            replay = None
        if replay is None:
            replies, versions = self.level(replies, versions)
        return replies, versions, replay

    def level(self, replies: list[Reply], versions: list[int]) -> tuple[list[Reply], list[int]]:
        """In lockstep (sync, every replica in each round, dense on the PS) a step is computed
        on parameters of one version only. After a failover the shards a lost PS held can be
        a step behind the others until the other workers' replays close that step's round
        there; a worker with nothing to replay (started again: its push of that step is lost)
        pulls again until every shard, the tables too, is at one version (the round it cannot
        join closes after update.timeout_s without it, and the summary names that), instead
        of pushing a gradient of two versions into that round as if of one."""
        if self.allreduce is not None or not self.lockstep:
            return replies, versions
        deadline = time.monotonic() + self.cfg.update.timeout_s + LEVEL_GRACE_S
        while not _one_version(versions, self.table_versions) and time.monotonic() < deadline:
            time.sleep(LEVEL_POLL_S)
            replies = self.client.pull()
            versions = self.load(replies)
        if not _one_version(versions, self.table_versions):
            log.warning("worker%d: the shards stayed at versions %s (tables %s) for %g s; "
                        "going on", self.index, versions, self.table_versions,
                        self.cfg.update.timeout_s + LEVEL_GRACE_S)
        return replies, versions

    def run(self, after_step: Callable[[Reply, float, float], bool] = lambda *a: False) -> None:
        """Train until the shards say training is finished. `after_step` is the chief's hook;
        it returns True to end training at once. A membership change (a rank started again)
        is met at the next step, or by the RPC that the old group's end broke: the step is
        done again in the new epoch."""
        self.finished = False
        replies: Optional[list[Reply]] = None  # none yet: pull first
        ahead: Optional[Work] = None  # pipelined: the next step, computed during this one's
        # Until every shard is at its last step: with backup workers (or async) one shard can
        # finish a round before another, and a worker that stopped at the first one's end
        # could leave the others a step short with nobody pushing to them.
        pushed: Optional[Work] = None  # the step whose replies are awaited (a fail-over)
        while replies is None or not all(r.finished for r in replies):
            replay = None
            if replies is None or membership.changing():
                ahead = None
                try:  # (the first pull too: a rank can be started again before it)
                    replies, versions, replay = self.resume(pushed)
                except Exception as e:
                    await_change(e)  # returns once the change is announced: rejoin
                    continue
                pushed = None
                if replay is None:
                    continue
            ended = replies[0].finished  # the chief's hooks saw the last step already
            t0 = time.perf_counter()
            step = self.data_step(versions[0] if replay is None else replay.versions[0])
            try:
                if replay is not None:  # the step a lost PS left without its replies
                    loss, futures, pushed = replay.loss, replay.futures, replay
                elif ahead is not None and ahead.versions == versions:
                    # computed during the last round (the versions it foresaw)
                    loss, futures, pushed = ahead.loss, self.push(ahead), ahead
                else:  # (one foreseen wrong is computed again: `compute` drops its average)
                    loss, futures = self.step(step, versions)
                    pushed = self._work
                ahead = None
                if futures is None:  # not admitted: training is over, or pull fresher params
                    if self.finished:
                        break
                    replies = self.client.pull()
                    versions = self.load(replies)
                    continue
                t1 = time.perf_counter()
                if self.pipelined and step + 1 < self.cfg.train.steps and not ended:
                    # Step t+1 while step t's round is under way: its rows are the ones step
                    # t-1's reply brought (a step old, within the bound), its dense replica has
                    # step t's update (applied by `push`); it is pushed once t's reply is in.
                    ahead = self.compute(step + 1, [v + 1 for v in versions])
                    t1 = time.perf_counter()  # (from here: the wait for t's reply)
                replies = self.receive(futures)
                pushed = None
            except Exception as e:
                ahead = None
                await_change(e)
                continue
            self.next_data_step()
            t2 = time.perf_counter()
            versions = [r.version for r in replies]
            self.stats.pushes += 1
            self.stats.accepted += int(replies[0].accepted)
            self.stats.compute_s += t1 - t0
            self.stats.push_s += t2 - t1
            self.nonfinite.after_push(any(r.skipped for r in replies), step, loss)
            if not ended and after_step(replies[0], t2 - t1, loss):
                break
        if isinstance(self.rows, RowCache):  # what it still holds (an early stop) to the PS
            self.rows.hand_over()
        self.host.close()
        if self.allreduce is not None:
            self.stats.dense_digest = self.allreduce.digest()
            self.stats.dense_group = self.allreduce.kind()


_EMPTY = torch.zeros(0)  # the gradient pushed to the clock shard (update.dense=allreduce)
log = logging.getLogger(__name__)
LEVEL_POLL_S = 0.02  # `level`: how often a worker asks whether the shards are at one version
LEVEL_GRACE_S = 10.0  # ... and how long past update.timeout_s before it goes on regardless


def _one_version(dense: list[int], tables: list[int]) -> bool:
    return len(set(dense)) <= 1 and len(set(tables)) <= 1

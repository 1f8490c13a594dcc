"""The data-parallel worker loop, and the client that pushes to and pulls from every shard.

One step: take this replica's rows of the global batch of its data step; forward (under
autocast with train.amp) and backward on the worker's device (gradients land in flat per-shard
buffers); one `push_pull` per shard, all in flight at once (each as soon as backward completes
it); copy the returned parameters in.

The data step: in sync, the global step (shard 0's version), so a resumed or stale worker always
knows where it is and W workers of batch B see exactly what one worker of batch W·B sees. In
async, each worker walks the global batches at its own pace: its n-th push takes its slice of
global batch start/W + n (start: the step training resumed from), so its batches can be loaded
ahead and do not depend on timing; with one worker this is the global step again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

from psrpc.cluster import comm, membership
from psrpc import factories
from psrpc.cluster.wire import WIRE_DTYPES, Reply, Ticket
from psrpc.config import AMP_DTYPES, Config
from psrpc.data import GlobalBatches
from psrpc.errors import PsrpcError
from psrpc.factories import Data
from psrpc.faults import build_faults
from psrpc.flat import FlatModel
from psrpc.cluster.layout import Layout
from psrpc.loader import StepBatches
from psrpc.sparse.client import RowClient
from psrpc.sparse.tables import find_tables
from psrpc.cluster.topology import Topology

log = logging.getLogger(__name__)


@dataclass
class Plan:
    """What the chief hands every worker once the shards exist."""

    layouts: list[Layout]  # per pipeline stage (data parallel: one)
    shards: list[list]  # shards[s][k]: Handle of stage s's shard k (on ps{layouts[s].shard_ps[k]})
    cuts: list[int]  # index of each stage's first layer (data parallel: [0])
    restored_from_step: Optional[int] = None
    buffers: Optional[dict[str, torch.Tensor]] = None  # restored buffers, full-model names
    table_shards: list = field(default_factory=list)  # Handle of each PS's TableShard (ps{k})
    table_specs: list = field(default_factory=list)  # TableSpec of every embedding table
    partition: str = "mod"  # sparse.partition
    rolled_back_to: Optional[int] = None  # a new membership epoch that restored a checkpoint
    shared: list = field(default_factory=list)  # per dense shard: shared memory (bootstrap)

    def shm_for(self, stage: int, worker: int) -> list:
        """For FlatModel: per shard of `stage`, (mode, params segment, slot segment) when
        `worker` (its id in the shard's rounds) shares that shard's memory, else None."""
        from psrpc.cluster import shm

        first = sum(lay.num_shards for lay in self.layouts[:stage])
        out = []
        for k in range(self.layouts[stage].num_shards):
            entry = self.shared[first + k] if self.shared else None
            if entry is None or worker not in entry[2]:
                out.append(None)
                continue
            mode, run, _ = entry
            out.append((mode, shm.segment(run, first + k, "params"),
                        shm.segment(run, first + k, f"g{worker}")))
        return out

    @property
    def layout(self) -> Layout:
        """Every shard of every stage in one layout, stage by stage: final model, checkpoints."""
        return Layout.concat(self.layouts)

    @property
    def all_shards(self) -> list:
        """Every dense shard, stage by stage (what the layout describes)."""
        return [rref for stage in self.shards for rref in stage]

    @property
    def every_shard(self) -> list:
        """The dense shards, then the table shards: all that count global steps."""
        return self.all_shards + self.table_shards


@dataclass
class WorkerStats:
    pushes: int = 0
    accepted: int = 0
    push_s: float = 0.0  # time spent waiting for push_pull replies
    compute_s: float = 0.0


class ShardClient:
    """push / pull / push_pull against every shard of a stage, all RPCs in flight at once."""

    def __init__(self, shards: list, worker: int, timeout_s: Optional[float] = None):
        self.shards, self.worker, self.timeout_s = shards, worker, timeout_s

    def wait(self, futures, first: int = 0) -> list[Reply]:
        """The replies (of shards first, first+1, ...), or an error naming the PS that failed."""
        replies = []
        for k, fut in enumerate(futures, start=first):
            try:
                replies.append(fut.wait())
            except Exception as e:
                owner = comm.owner_name(self.shards[k])
                raise PsrpcError(f"worker{self.worker}: push_pull to {owner} failed: "
                                 f"{_first_line(e)}") from e
        return replies

    def push_one(self, shard: int, version: int, grad: torch.Tensor, loss: float,
                 samples: int, ticket: Optional[int] = None):
        """Push one shard now (while backward goes on); returns the Future of its Reply."""
        return comm.invoke(self.shards[shard], "push_pull", self.worker, version, grad, loss,
                           samples, ticket, timeout_s=self.timeout_s)

    def push_pull_async(self, versions: list[int], grads: list[torch.Tensor], loss: float,
                        samples: int, ticket: Optional[int] = None) -> list:
        return [self.push_one(k, v, g, loss, samples, ticket)
                for k, (v, g) in enumerate(zip(versions, grads))]

    def push_pull(self, versions: list[int], grads: list[torch.Tensor], loss: float,
                  samples: int, ticket: Optional[int] = None) -> list[Reply]:
        return self.wait(self.push_pull_async(versions, grads, loss, samples, ticket))

    def admit(self, clock, version: int) -> Ticket:
        """Bounded staleness: the clock shard's ticket for a gradient computed on `version`
        (waits while the bound holds this worker back)."""
        try:
            return comm.invoke(clock, "admit", self.worker, version,
                               timeout_s=self.timeout_s).wait()
        except Exception as e:
            raise PsrpcError(f"worker{self.worker}: admit at {comm.owner_name(clock)} failed: "
                             f"{_first_line(e)}") from e

    def pull(self) -> list[Reply]:
        return self.wait([comm.invoke(rref, "pull", timeout_s=self.timeout_s)
                          for rref in self.shards])


def model_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's persistent buffers (BatchNorm statistics: in its state_dict, not parameters,
    so on no shard), by name; a buffer registered persistent=False is not state."""
    params = {n for n, _ in module.named_parameters()}
    return {n: b for n, b in module.state_dict(keep_vars=True).items() if n not in params}


def load_buffers(module: torch.nn.Module, buffers: Optional[dict[str, torch.Tensor]]) -> None:
    """A restored checkpoint's buffers (BatchNorm statistics, saved from the chief's replica)
    into `module` (a whole model or a pipeline stage, named as in the whole model). Every
    replica loads the chief's, as DDP broadcasts rank 0's: they take no part in the gradients,
    only in evaluation and model.pt, which come from the chief."""
    if buffers is None:
        return
    with torch.no_grad():
        for name, buf in model_buffers(module).items():
            buf.copy_(buffers[name])


def pick_device(name: str, local_rank: int) -> torch.device:
    """train.device: auto -> cuda:{local_rank % n} when CUDA is present, else cpu."""
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise PsrpcError("train.device='cuda' but CUDA is not available here; use auto or cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


class NonfiniteGuard:
    """Fails the run after `patience` non-finite gradients in a row from this replica (the
    shards skip each one and count it, as TensorFlow's NanTensorHook with fail_on_nan_loss
    stops training); 0: never."""

    def __init__(self, replica: int, patience: int, wire_dtype: str):
        self.replica, self.patience, self.wire_dtype = replica, patience, wire_dtype
        self.in_a_row = 0

    def after_push(self, skipped: bool, step: int, loss: float) -> None:
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if self.patience and self.in_a_row >= self.patience:
            hint = (" (update.wire_dtype=float16 overflows past 65504: use bfloat16)"
                    if self.wire_dtype == "float16" else "")
            raise PsrpcError(
                f"worker{self.replica}: {self.in_a_row} non-finite gradients in a row (the last "
                f"at step {step}, loss {loss}); every one was skipped. Lower optim.lr or check "
                f"the data{hint}; train.nonfinite_patience={self.patience} sets how many in a "
                "row stop the run")


class Replica:
    """What every replica's training loop has: its data slice, loss, device and counters."""

    def __init__(self, cfg: Config, topo: Topology, plan: Plan, dataset: Optional[Data] = None):
        self.cfg, self.topo, self.plan = cfg, topo, plan
        self.replica = topo.replica_of(topo.index)
        self.device = pick_device(cfg.train.device, topo.local_rank)
        self.data = dataset or factories.load_data(cfg)
        self.loss_fn = factories.build_loss(cfg, self.data)
        self.batch = cfg.train.batch_size
        self.order = GlobalBatches(len(self.data.train), topo.replicas * self.batch,
                                   cfg.train.seed)
        self.batches = StepBatches(self.data.train, self.order, self.replica, self.batch,
                                   self.device, cfg.data.get("num_workers", 0), cfg.train.seed)
        self.autocast = AMP_DTYPES[cfg.train.amp]
        # fault.crash_* crash the first attempt (torchrun) and the first epoch only
        self.faults = build_faults(cfg.fault, "worker", topo.index,
                                   topo.restart_count + topo.epoch)
        self.stats = WorkerStats()
        self.plan_source: Optional[Callable[[int], Plan]] = None  # a new epoch's plan
        self.nonfinite = NonfiniteGuard(self.replica, cfg.train.nonfinite_patience,
                                        cfg.update.wire_dtype)
        # Bounded staleness: a gradient is pushed only once the clock shard admits it.
        self.bounded = cfg.update.name == "async" and cfg.update.max_staleness is not None
        self.clock = plan.shards[0][0]
        self.sync = cfg.update.name == "sync"
        self._data_step: Optional[int] = None

    @classmethod
    def build_model(cls, cfg: Config, data: Data):
        """The model this replica trains (the chief's copy, built after seeding, is the init)."""
        return factories.build_model(cfg, data)

    def data_step(self, version: int) -> int:
        """Which global batch to train on next (see the module docstring)."""
        if self.sync:
            return version
        if self._data_step is None:
            self._data_step = version // self.topo.replicas
        return self._data_step

    def next_data_step(self) -> None:
        """Async: this worker's batch was used (applied, or skipped as non-finite)."""
        if self._data_step is not None:
            self._data_step += 1

    def forward_loss(self, model, x, y) -> torch.Tensor:
        """The batch's loss, under autocast when train.amp asks for it."""
        with torch.autocast(self.device.type, dtype=getattr(torch, self.autocast or "float32"),
                            enabled=self.autocast is not None):
            return self.loss_fn(model(x), y)


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
        # Embedding tables live on the PS: the model's look their rows up there.
        self.tables = find_tables(self.model)
        self.rows = (RowClient(plan.table_shards, plan.table_specs, plan.partition, self.index)
                     if self.tables else None)
        for t in self.tables:
            t.bind(self.rows)
        self.table_versions: list[int] = []

    def buffers(self) -> dict[str, torch.Tensor]:
        """This replica's buffers (BatchNorm statistics: not parameters, so not on the PS)."""
        return {n: b.detach().cpu().clone() for n, b in model_buffers(self.model).items()}

    def load(self, replies: list[Reply]) -> list[int]:
        for k, r in enumerate(replies):
            self.flat.load(k, r.params)
        if self.rows is not None:  # the table shards' versions (their rows are pulled per batch)
            self.table_versions = [r.version for r in self.rows.pull_versions()]
        return [r.version for r in replies]

    def receive(self, futures: list) -> list[Reply]:
        """Wait for each shard's reply and copy it in at once, while later ones still arrive;
        then the table shards' replies (after the dense ones in `futures`)."""
        dense = len(self.flat.params)
        replies = []
        for k, fut in enumerate(futures[:dense]):
            (reply,) = self.client.wait([fut], first=k)
            self.flat.load(k, reply.params)
            replies.append(reply)
        if self.rows is not None:
            tables = comm.wait_all(futures[dense:])
            self.table_versions = [r.version for r in tables]
            replies[0] = replace(replies[0], skipped=replies[0].skipped or any(
                r.skipped for r in tables))
        return replies

    def step(self, step: int, versions: list[int]) -> tuple[float, Optional[list]]:
        """Forward and backward on this worker's rows of global batch `step`, pushing each shard
        as soon as backward completes it. Returns the loss and the push Futures; None when the
        staleness clock did not admit the gradient (`self.finished` says whether training is
        over; otherwise it was too stale)."""
        x, y = self.batches.get(step)
        self.flat.zero_grad()
        self.flat.ready()
        loss = self.forward_loss(self.model, x, y)
        value = loss.item()
        futures: list = [None] * len(versions)
        ticket = None

        def push(k: int) -> None:  # once shard k's gradient is on the host (at once on CPU)
            self.flat.send(k, lambda g: futures.__setitem__(
                k, self.client.push_one(k, versions[k], g, value, self.batch, ticket)))

        # Every gradient is needed before the first push for a NaN injection, the clock's
        # ticket (bounded staleness) and clipping by norm; otherwise shards go out as backward
        # fills them.
        nan = self.faults.nan_due(versions[0])  # fault.* count global steps
        clip = self.cfg.train.clip_grad_norm
        overlap = not (nan or self.bounded or clip)
        if overlap:
            self.flat.arm(push)
        self.faults.before_backward(versions[0])
        loss.backward()
        rest = self.flat.disarm() if overlap else list(range(len(versions)))
        table_grads = self.table_gradients()
        if nan:
            self.faults.corrupt(versions[0], self.flat.all_grads() + [g for _, g in
                                                               table_grads.values()])
        if clip:  # this worker's own gradient norm (the round averages clipped gradients)
            torch.nn.utils.clip_grad_norm_(
                list(self.model.parameters()) + [_Grad(g) for _, g in table_grads.values()],
                clip)
        if self.bounded:
            # After a pull the shards' versions can differ (tickets still in flight): the
            # oldest one bounds this gradient's staleness on every shard.
            admitted = self.client.admit(self.clock, min(versions + self.table_versions))
            if admitted.seq is None:
                self.finished = admitted.finished
                return value, None
            ticket = admitted.seq
        for k in rest:  # shards with unused parameters, or all of them (see above)
            push(k)
        self.flat.flush()
        if self.rows is not None:  # every table shard, after backward has reached the tables
            futures += self.rows.push_async(table_grads, self.table_versions, value, self.batch,
                                            ticket)
        return value, futures

    def table_gradients(self) -> dict:
        """{table: (unique global rows, row gradients)} of the last backward."""
        grads = {}
        for t in self.tables:
            grads.update(t.take_gradients())
        return grads

    def rebind(self, plan: Plan) -> None:
        """A new membership epoch: the same shards (or, after a roll back, restored ones)
        through new references."""
        self.plan = plan
        self.client = ShardClient(plan.shards[0], self.index)
        self.clock = plan.shards[0][0]
        if self.tables:
            self.rows = RowClient(plan.table_shards, plan.table_specs, plan.partition,
                                  self.index)
            for t in self.tables:
                t.bind(self.rows)
        if plan.rolled_back_to is not None:
            load_buffers(self.model, plan.buffers)

    def rejoin(self) -> tuple[list[Reply], list[int]]:
        """Join the new membership epoch's group, take its plan, pull the parameters."""
        epoch = membership.rejoin()
        self.rebind(self.plan_source(epoch))
        self._data_step = None  # async: from the current version again
        replies = self.client.pull()
        return replies, self.load(replies)

    def run(self, after_step: Callable[[Reply, float, float], bool] = lambda *a: False) -> None:
        """Train until the shards say training is finished. `after_step` is the chief's hook;
        it returns True to end training at once. A membership change (a rank started again)
        is met at the next step, or by the RPC that the old group's end broke: the step is
        done again in the new epoch."""
        self.finished = False
        replies: Optional[list[Reply]] = None  # none yet: pull first
        while replies is None or not replies[0].finished:
            if replies is None or membership.changing():
                try:  # (the first pull too: a rank can be started again before it)
                    if membership.changing():
                        replies, versions = self.rejoin()
                    else:
                        replies = self.client.pull()
                        versions = self.load(replies)
                except Exception as e:
                    _await_change(e)  # returns once the change is announced: rejoin
                continue
            t0 = time.perf_counter()
            step = self.data_step(versions[0])
            try:
                loss, futures = self.step(step, versions)
                t1 = time.perf_counter()
                if futures is None:  # not admitted: training is over, or pull fresher params
                    if self.finished:
                        break
                    replies = self.client.pull()
                    versions = self.load(replies)
                    continue
                replies = self.receive(futures)
            except Exception as e:
                _await_change(e)
                continue
            self.next_data_step()
            t2 = time.perf_counter()
            versions = [r.version for r in replies]
            self.stats.pushes += 1
            self.stats.accepted += int(replies[0].accepted)
            self.stats.compute_s += t1 - t0
            self.stats.push_s += t2 - t1
            self.nonfinite.after_push(any(r.skipped for r in replies), step, loss)
            if after_step(replies[0], t2 - t1, loss):
                break


MEMBERSHIP_GRACE_S = 10.0  # an RPC failed: how long to wait for the launcher's announcement


def _await_change(error: Exception) -> None:
    """An RPC failed: it is a membership change (a peer left the old group) when one is
    announced within MEMBERSHIP_GRACE_S; otherwise the error stands."""
    if not membership.wait_change(MEMBERSHIP_GRACE_S):
        raise error
    log.info("an RPC failed during a membership change (%s); joining the new group",
             _first_line(error))


class _Grad:
    """A tensor seen as a parameter whose .grad it is (for clip_grad_norm_)."""

    def __init__(self, grad: torch.Tensor):
        self.grad = grad


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

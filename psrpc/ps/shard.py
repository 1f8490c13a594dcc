"""A parameter-server shard: the flat master copy of its part of the model, its optimizer, its
version (= global steps applied), its checkpoints, and the counters the chief reports.

Created on its PS by the chief (`create`) and reached through a `comm.Handle` (its PS's name
and its global index), which outlives a membership epoch. `push_pull` checks a
push, then hands it to the update rule (`sync.SyncAggregator` or `async_apply.AsyncApplier`).
Every change to the master copy happens under `self.lock`: in-place tensor ops release the GIL,
so unlocked accumulation loses updates (docs/design.md, "RPC pitfalls").

Checkpoints are step-consistent by construction (`snapshots.ShardSnapshots`): a shard snapshots
itself under the lock right after the update that brings it to a checkpoint step.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

import torch

from psrpc.cluster import comm, shm
from psrpc.cluster.wire import WIRE_DTYPES, HostSum, Reply
from psrpc.errors import PushRejected
from psrpc.faults import NoFaults
from psrpc.optim.dense import build_optimizer, count_step, step_scaled
from psrpc.optim.schedule import lr_factor
from psrpc.optim.treesum import Scratch, tree_sum
from psrpc.ps.backup import Backlog, Replicated
from psrpc.ps.checks import PushChecks
from psrpc.ps.replicas import Journal
from psrpc.ps.snapshots import ShardSnapshots
from psrpc.ps.stats import ShardStats
from psrpc.ps.updates import build_updater

log = logging.getLogger(__name__)

_NO_PARAMS = torch.empty(0)


@dataclass
class ShardSpec:
    """Everything the chief sends to create a shard on its PS."""

    index: int
    params: torch.Tensor  # flat float32: the initial (or restored) master copy
    optim: Any  # the optim config
    update: Any  # the update config
    num_workers: int
    max_steps: int
    version: int = 0
    optim_state: Optional[dict] = None  # restored optimizer.state of the flat tensor (reshard)
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    faults: Any = field(default_factory=NoFaults)
    stats: Optional[dict] = None  # counters carried over a restore
    name: str = ""  # for messages: "ps1", or "ps1/stage2" in model-parallel mode
    shm: Optional[tuple] = None  # (mode, run, worker ids): shared memory with those workers


class Shard(Replicated, PushChecks):
    def __init__(self, spec: ShardSpec, backup: bool = False):
        self.index = spec.index  # global shard number (stage · P + k); 0 is the clock shard
        self.name = spec.name or f"ps{spec.index}"
        self.spec = spec  # what a backup of it is built from (cluster.ps_replicas)
        self.backup = backup  # a backup: it replays its primary's updates (psrpc/ps/replicas.py)
        self.journal: Optional[Journal] = None  # a primary with backups: where they are
        self.backlog: Optional[Backlog] = Backlog(self) if backup else None
        self.slots: dict[int, torch.Tensor] = {}  # worker -> its gradient slot (shm)
        self.shm_mode, self.seq = None, None  # seq: the master copy's write sequence (shm)
        self._init_state(spec)  # (a table shard's: no dense master copy, none of the above)
        self.optim_cfg = spec.optim  # the schedule: lr by global step
        self.total_steps = spec.max_steps
        self.wire_dtype = WIRE_DTYPES[spec.update.wire_dtype]
        self.num_workers = spec.num_workers
        self.max_steps = spec.max_steps
        self.version = spec.version
        self.faults = spec.faults
        self.lock = threading.Lock()
        self.stats = ShardStats(**spec.stats) if spec.stats else ShardStats()
        self.losses: deque = deque(maxlen=spec.num_workers)  # the last W applied losses
        self._settled: list[torch.futures.Future] = []  # who waits for the last step
        self.snapshots = ShardSnapshots(self.name, None if backup else spec.checkpoint_dir,
                                        spec.checkpoint_every, self._snapshot)
        self.updater = build_updater(self, spec.update, spec.num_workers)  # needs all above

    def _init_state(self, spec: ShardSpec) -> None:
        """The master copy and its optimizer (a dense shard: one flat tensor), in shared memory
        with the workers on this host (their gradient slots too) when `spec.shm` says so."""
        self.params = spec.params.to(torch.float32).contiguous()  # CPU, flat: the master copy
        if spec.shm is not None:
            self.shm_mode, run, ids = spec.shm
            master, self.seq = shm.attach_master(shm.segment(run, self.index, "params"),
                                                 self.params.numel())
            with shm.writing(self.seq):  # a roll back rewrites what workers may still read
                master.copy_(self.params)
            self.params = master
            self.slots = {w: shm.attach(shm.segment(run, self.index, f"g{w}"), master.numel())
                          for w in ids}
        self.optimizer = build_optimizer([self.params], spec.optim)
        if spec.optim_state is not None:  # through load_state_dict: it casts and places it
            restored = self.optimizer.state_dict()
            restored["state"] = {0: spec.optim_state} if spec.optim_state else {}
            self.optimizer.load_state_dict(restored)
        self.base_lr = [g["lr"] for g in self.optimizer.param_groups]
        self._sum: Optional[torch.Tensor] = None  # float32, a sync round's gradient sum
        self._scratch = Scratch()  # the tree sum's partial sums

    # -- the verbs (called through the Handle) ---------------------------------------------------
    @comm.async_execution
    def push_pull(self, worker: int, version: int, grad: torch.Tensor, loss: float,
                  samples: int, ticket: Optional[int] = None, host: Optional[HostSum] = None):
        """Push one gradient computed on `version`; the Future holds the Reply with fresh params.
        Every argument is checked before anything changes; a non-finite gradient (or loss) is
        handed on as None: the update rule skips it and counts it. `ticket`: from `admit`, with
        bounded staleness only. `host`: the gradient is the sum of a block of workers of one
        host (update.host_push, sync only)."""
        t0 = time.perf_counter()
        try:
            self._check(worker, version, grad, loss, samples, ticket)
            if host is not None:  # (a sync round's to check: only it takes them)
                getattr(self.updater, "check_host", _no_host_sums(self.name))(worker, grad, host)
        except PushRejected as e:
            return comm.failed(e)
        void = shm.is_marker(grad, shm.VOID)  # computed across an update: discarded (sync only)
        viewer = isinstance(grad, str) and self.shm_mode == "views" and worker in self.slots
        if shm.is_marker(grad, shm.SLOT):  # the gradient is in the worker's slot
            grad = self.slots[worker]
        try:
            finite = not void and math.isfinite(loss) and self._finite(grad)
            extra = {"void": True} if void else {"host": host} if host is not None else {}
            future = self.updater.push(worker, version, grad if finite else None, loss, samples,
                                       ticket, **extra)
            if self.journal is not None:  # answered once backed up (read at the reply)
                future = self.journal.gate(future)
            if viewer:  # it reads the master copy itself: no parameters in the reply
                return future.then(lambda f: replace(f.value(), params=_NO_PARAMS))
            return future
        finally:
            # unlocked: a rare lost increment between RPC threads only blurs a measurement
            self.stats.busy_s += time.perf_counter() - t0

    @comm.async_execution
    def admit(self, worker: int, version: int):
        """Bounded staleness, on the clock shard: the Future of a Ticket for a gradient that
        `worker` computed on `version` (it waits while the bound says so)."""
        try:
            self._check_worker_version(worker, version)
        except PushRejected as e:
            return comm.failed(e)
        admit = getattr(self.updater, "admit", None)
        if admit is None:
            return comm.failed(PushRejected(f"{self.name}: admit is for update=async with "
                                            "update.max_staleness set"))
        return admit(worker, version)

    def pull(self) -> Reply:
        with self.lock:
            return self.reply(accepted=False)

    def pull_full(self) -> tuple[int, torch.Tensor]:
        """The float32 master copy and its version (for the chief's final model)."""
        with self.lock:
            return self.version, self.params.detach().clone()

    @comm.async_execution
    def request_save(self, step: int):
        """Future of the file info once step `step` is saved (None if this shard never saves it)."""
        with self.lock:
            return self.snapshots.request(step, self.version, self.max_steps)

    def freeze(self, target: int) -> int:
        """End training at step `target` (the chief stops early): this shard applies updates
        until it reaches `target`, never past it, and stops at once if it is there already
        (answering every waiter). Returns the step it stops at: `target`, or its version if
        that is past `target`; on the clock shard of bounded staleness, the tickets already
        issued (every shard must reach them)."""
        with self.lock:
            target = self.updater.freeze(target) if hasattr(self.updater, "freeze") else target
            self.max_steps = max(self.version, min(self.max_steps, target))
            ready = self.updater.release() if self.finished else []
            if self.finished:
                self._answer_settled()
            self.snapshots.unreachable(self.max_steps)
        comm.resolve_all(ready)
        return self.max_steps

    @comm.async_execution
    def settle(self, wait_s: Optional[float] = None):
        """The Future of this shard's version once it is at its last step: with bounded
        staleness the chief can see 'finished' while tickets are still on their way to other
        shards (a ticket that never comes is skipped after update.timeout_s). `wait_s`: for a
        table shard (TableShard.settle)."""
        with self.lock:
            if self.finished:
                return comm.completed(self.version)
            fut = torch.futures.Future()
            self._settled.append(fut)
            return fut

    def _answer_settled(self) -> None:
        """Under the lock: the Futures complete later, from a thread of their own, since
        completing one sends its reply."""
        waiting, self._settled = self._settled, []
        for fut in waiting:
            threading.Thread(target=fut.set_result, args=(self.version,), daemon=True).start()

    def begin_epoch(self, replay: bool = False, gone: tuple = ()) -> int:
        """A new membership epoch: the old group's waiters are gone. A sync round that was
        open closes with what it has (as after update.timeout_s), or, with `replay` (a PS
        failed over to a backup: every worker pushes that step again), starts over; async
        held pushes and clock waits are dropped (their workers push again). The workers
        `gone` for good are not waited for. Returns the version."""
        with self.lock:
            self.updater.new_epoch(replay, gone)
            self._settled = []
            return self.version

    def catch_up(self, target: int) -> int:
        """Pass steps without an update up to `target` (every shard at one version when a new
        epoch starts: a push the old group lost may have reached some shards only), each one
        counted as the shards ahead counted it (`count_step`: Adam's bias correction)."""
        with self.lock:
            while self.version < min(target, self.max_steps):
                self.count_step()
                self.stats.missed("passed", self.num_workers)
                self.advance()
            if hasattr(self.updater, "caught_up"):
                self.updater.caught_up()
            return self.version

    def counters(self) -> dict:
        """Its counters as its checkpoint holds them (update.dense=allreduce: the chief's)."""
        with self.lock:
            return asdict(self.stats)

    def report(self) -> dict:
        with self.lock:
            s = self.stats
            return {"shard": self.index, "version": self.version,
                    "applied_pushes": s.applied_pushes, "samples": s.samples,
                    "stale_dropped": s.stale_dropped, "nan_rejected": s.nan_rejected,
                    "max_staleness": s.staleness_max,
                    "mean_staleness": s.staleness_sum / max(1, s.applied_pushes),
                    "per_worker_applied": dict(s.per_worker_applied),
                    "per_worker_stale": dict(s.per_worker_stale), "host_sums": s.host_sums,
                    "short": dict(s.short),
                    "loss": self.recent_loss, "busy_s": round(s.busy_s, 4),
                    "ps": self.name.split("/")[0],
                    "workers_lost": sorted(self.updater.live.lost),
                    **(self.journal.report() if self.journal is not None else {})}

    def close(self) -> None:
        self.updater.close()
        self.snapshots.close()
        if self.backlog is not None:
            self.backlog.close()

    # -- used by the update rules, under self.lock ------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.version >= self.max_steps

    def _finite(self, grad: torch.Tensor) -> bool:
        # One float32 sum: NaN and ±Inf propagate into it (a finite gradient overflowing
        # float32 in sum would be absurd); 20× cheaper than isfinite(grad).all()'s mask.
        return bool(torch.isfinite(grad.sum(dtype=torch.float32)))

    def average(self, grads: list[torch.Tensor], workers=None, levels=None,
                count: Optional[int] = None) -> torch.Tensor:
        """The mean of a sync round's gradients: summed in float32 as the binary tree over the
        workers' indices (psrpc/optim/treesum.py), divided by the workers counted. `levels[i]`:
        grads[i] is already the sum of the aligned block of 2^level workers starting at
        workers[i] (one push for a host's workers, update.host_push); `count`: how many
        workers' gradients the sums hold (default: one each)."""
        workers = list(range(len(grads))) if workers is None else list(workers)
        levels = [0] * len(grads) if levels is None else list(levels)
        count = len(grads) if count is None else count
        if self._sum is None:
            self._sum = torch.zeros_like(self.params)
        total = tree_sum(list(zip(workers, levels, grads)), self._sum,
                         self._scratch.like(self._sum))
        if count == 1:
            return total
        if total is not self._sum:  # one push holding several workers' sum: not divided in place
            total = self._sum.copy_(total)
        return total.div_(count)

    def step_optimizer(self, grad: torch.Tensor, lr_scale: float = 1.0) -> None:
        """One optimizer step on the master copy with this (already averaged) gradient, at the
        learning rate the schedule gives this step (times `lr_scale`: staleness_lr). The caller
        counts the push and then calls `advance()`."""
        if self.journal is not None:
            self.journal.record("step", grad, lr_scale)
        if not self.params.numel():  # the clock shard of update.dense=allreduce: nothing to
            return  # step (an optimizer step over no parameters still costs ~60 us of Python)
        scale = lr_scale * lr_factor(self.version, self.optim_cfg, self.total_steps)
        with shm.writing(self.seq):
            step_scaled(self.optimizer, self.params,
                        grad if grad.dtype == torch.float32 else grad.float(), self.base_lr, scale)

    def count_step(self) -> None:  # catch_up: a step the others applied passes here
        if self.journal is not None:
            self.journal.record("count")
        count_step(self.optimizer)

    def advance(self) -> None:
        """The global step passes (after an update, or with none: a skipped step). A checkpoint
        due at the new version is snapshotted now, counters included."""
        self.version += 1
        if self.journal is not None:  # to the backups before anything else can happen here
            self.journal.commit(self.version)
        self.faults.after_update(self.version)
        self.snapshots.after_update(self.version)
        if self.finished:
            self.snapshots.unreachable(self.max_steps)
            self._answer_settled()

    def count_nonfinite(self, worker: int, version: int) -> None:
        self.stats.nan_rejected += 1
        log.warning("%s: rejected a non-finite gradient from worker%d at step %d (its batch is "
                    "skipped)", self.name, worker, version)

    def record_loss(self, loss: float) -> None:
        self.losses.append(loss)

    @property
    def recent_loss(self) -> Optional[float]:
        """Mean loss of the last W applied gradients (sync: of the last round)."""
        return sum(self.losses) / len(self.losses) if self.losses else None

    def reply(self, accepted: bool, loss: Optional[float] = None, shared: bool = False,
              skipped: bool = False) -> Reply:
        """The reply carries a snapshot: it is serialised after the lock is released, while the
        next update may already be changing the master copy. `shared` sends the master copy
        itself, for a caller that knows no update can happen before every receiver has it."""
        if shared and self.wire_dtype == torch.float32:
            params = self.params.detach()
        else:
            params = self.params.detach().to(self.wire_dtype, copy=True)
        return Reply(self.version, params, accepted, self.finished,
                     self.recent_loss if loss is None else loss, self.stats.samples,
                     self.stats.stale_dropped, skipped)

    def _snapshot(self, step: int) -> dict:
        """What a checkpoint of this shard holds (copies: taken under the lock)."""
        return {"shard": self.index, "version": step, "params": self.params.detach().clone(),
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "stats": asdict(self.stats)}


def _no_host_sums(name: str):
    def refuse(worker, grad, host):
        raise PushRejected(f"{name}: worker{worker} pushed a host's sum, but only sync rounds "
                           "take one (update.host_push)")
    return refuse

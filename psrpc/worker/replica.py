"""What every replica's training loop has, data parallel or pipelined: its slice of the data, its
loss, device and counters, the non-finite guard, and how it meets a membership change."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from psrpc import factories
from psrpc.cluster import membership, partitions
from psrpc.cluster.topology import Topology, in_lockstep
from psrpc.config import Config
from psrpc.errors import PsrpcError, first_line
from psrpc.factories import Data
from psrpc.faults import build_faults
from psrpc.worker.batches import GlobalBatches
from psrpc.worker.loader import StepBatches
from psrpc.worker.plan import Plan

log = logging.getLogger(__name__)
AMP_DTYPES = {"none": None, "bf16": "bfloat16"}  # train.amp -> autocast dtype


@dataclass
class WorkerStats:
    pushes: int = 0
    accepted: int = 0
    push_s: float = 0.0  # time spent waiting for push_pull replies
    compute_s: float = 0.0
    rows_pulled: int = 0  # embedding rows read from the table shards
    rows_pushed: int = 0  # embedding rows whose gradients went to them
    sparse_bytes: int = 0  # both, in bytes (an int64 id and the row's float32 values each)
    cache_lookups: int = 0  # rows looked up in the hot-row cache (sparse.cache_rows)
    cache_hits: int = 0  # of those, served from it
    # sparse.cache_writes=hold: step gradients of rows (one per row and step) handed to the
    # cache; of those dropped (with a push the shards did not apply: its own step's, or all of a
    # non-finite one; or with the cache at a new membership epoch), still held when training
    # ended (handed over then), and held after the hand-over (0: none left behind)
    cache_grads: int = 0
    cache_grads_dropped: int = 0
    cache_grads_handed_over: int = 0
    cache_grads_held: int = 0
    table_rpcs: int = 0  # messages to the table shards (pulls and pushes)
    side_channel: int = 0  # of those, pushes through a side channel (a PS on this host)
    dense_digest: Optional[str] = None  # update.dense=allreduce: the replica's, at the end
    dense_group: Optional[str] = None  # and what averaged it (DenseAllReduce.kind)
    host_push: Optional[str] = None  # update.host_push: its block (hostpush.HostPush), if any


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
                                   cfg.train.seed, cfg.train.shuffle)
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
        self.lockstep = in_lockstep(cfg)  # (every replica in each round: shards never apart)
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


MEMBERSHIP_GRACE_S = 10.0  # an RPC failed: how long to wait for the launcher's announcement


def await_change(error: Exception, may_ask: bool = True) -> None:
    """An RPC failed: it is a membership change (a peer left the old group) when one is
    announced within MEMBERSHIP_GRACE_S, or, under torchrun and srun, when this rank could ask
    for one (it was cut off: partitions.ask; not with `may_ask` False: a failure no new
    epoch mends, such as the chief's start-up); otherwise the error stands. Once the chief has ended
    training (a worker stopped past the end, say, finds the PS gone) it is TrainingOver."""
    if membership.ended():
        raise membership.TrainingOver(f"training ended while this rank's RPC was under way "
                                      f"({first_line(error)})") from error
    if not partitions.recover(MEMBERSHIP_GRACE_S, may_ask):
        if partitions.over_while_cut_off():  # cut off until after the end: nothing to rejoin
            raise membership.TrainingOver(f"training ended while this rank was cut off "
                                          f"({first_line(error)})") from error
        raise error
    log.info("an RPC failed during a membership change (%s); joining the new group",
             first_line(error))

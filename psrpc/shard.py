"""A parameter-server shard: the flat master copy of its part of the model, its optimizer, its
version (= global steps applied), and the counters the chief reports.

Created on its PS by the chief with `comm.remote` and used through the RRef. `push_pull` checks a
push, then hands it to the update rule (`sync.SyncAggregator` or `async_apply.AsyncApplier`).
Every change to the master copy happens under `self.lock`: in-place tensor ops release the GIL,
so unlocked accumulation loses updates (DESIGN §8).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from psrpc import comm
from psrpc.errors import PushRejected
from psrpc.optim import build_optimizer

log = logging.getLogger(__name__)

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Reply:
    """What a push (or pull) gets back from one shard."""

    version: int  # global steps applied on this shard
    params: torch.Tensor  # flat, wire dtype, a snapshot (never the master copy itself)
    accepted: bool  # False: stale, rejected, or training already finished
    loss: Optional[float]  # sync: the round's mean loss; async: the applied push's loss
    samples: int  # samples whose gradients this shard has applied so far
    stale_dropped: int  # stale gradients dropped so far


@dataclass
class ShardStats:
    applied_pushes: int = 0  # gradients applied (sync: summed over rounds)
    samples: int = 0
    stale_dropped: int = 0
    nan_rejected: int = 0
    staleness_max: int = 0
    staleness_sum: int = 0
    per_worker_applied: dict = field(default_factory=dict)
    per_worker_stale: dict = field(default_factory=dict)

    def applied(self, worker: int, samples: int, staleness: int = 0) -> None:
        self.applied_pushes += 1
        self.samples += samples
        self.staleness_max = max(self.staleness_max, staleness)
        self.staleness_sum += staleness
        self.per_worker_applied[worker] = self.per_worker_applied.get(worker, 0) + 1

    def stale(self, worker: int) -> None:
        self.stale_dropped += 1
        self.per_worker_stale[worker] = self.per_worker_stale.get(worker, 0) + 1


class Shard:
    def __init__(self, index: int, params: torch.Tensor, optim_cfg, update_cfg,
                 num_workers: int, max_steps: int, version: int = 0,
                 optim_state: Optional[dict] = None):
        from psrpc.updates import build_updater  # sync/async registry

        self.index = index
        self.params = params.to(torch.float32).contiguous()  # CPU, flat: the master copy
        self.params.grad = torch.zeros_like(self.params)
        self.optimizer = build_optimizer([self.params], optim_cfg)
        if optim_state is not None:
            self.optimizer.load_state_dict(optim_state)
        self.base_lr = [g["lr"] for g in self.optimizer.param_groups]
        self.wire_dtype = WIRE_DTYPES[update_cfg.wire_dtype]
        self.num_workers = num_workers
        self.max_steps = max_steps
        self.version = version
        self.lock = threading.Lock()
        self.stats = ShardStats()
        self.losses: deque = deque(maxlen=num_workers)  # the last W applied losses
        self.updater = build_updater(self, update_cfg, num_workers)  # after everything above

    # -- the verbs (called through the RRef) -----------------------------------------------------
    @comm.async_execution
    def push_pull(self, worker: int, version: int, grad: torch.Tensor, loss: float,
                  samples: int):
        """Push one gradient computed on `version`; the Future holds the Reply with fresh params."""
        try:
            self._check(worker, version, grad)
        except PushRejected as e:
            return comm.failed(e)
        if not bool(torch.isfinite(grad).all()):
            with self.lock:
                self.stats.nan_rejected += 1
                log.warning("ps%d: rejected a non-finite gradient from worker%d at step %d",
                            self.index, worker, version)
                return comm.completed(self.reply(accepted=False))
        return self.updater.push(worker, version, grad, loss, samples)

    def pull(self) -> Reply:
        with self.lock:
            return self.reply(accepted=False)

    def pull_full(self) -> tuple[int, torch.Tensor]:
        """The float32 master copy and its version (for the chief's final model and checkpoints)."""
        with self.lock:
            return self.version, self.params.detach().clone()

    def report(self) -> dict:
        with self.lock:
            s = self.stats
            return {"shard": self.index, "version": self.version,
                    "applied_pushes": s.applied_pushes, "samples": s.samples,
                    "stale_dropped": s.stale_dropped, "nan_rejected": s.nan_rejected,
                    "max_staleness": s.staleness_max,
                    "mean_staleness": s.staleness_sum / max(1, s.applied_pushes),
                    "per_worker_applied": dict(s.per_worker_applied),
                    "per_worker_stale": dict(s.per_worker_stale),
                    "loss": self.recent_loss,
                    "workers_lost": sorted(self.updater.live.lost)}

    def close(self) -> None:
        self.updater.close()

    # -- used by the update rules, under self.lock ------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.version >= self.max_steps

    def apply(self, grad: torch.Tensor, lr_scale: float = 1.0) -> None:
        """One optimizer step on the master copy with this (already averaged) gradient."""
        self.params.grad.copy_(grad)
        if lr_scale != 1.0:
            for g, lr in zip(self.optimizer.param_groups, self.base_lr):
                g["lr"] = lr * lr_scale
        with torch.no_grad():
            self.optimizer.step()
        if lr_scale != 1.0:
            for g, lr in zip(self.optimizer.param_groups, self.base_lr):
                g["lr"] = lr
        self.version += 1

    def record_loss(self, loss: float) -> None:
        self.losses.append(loss)

    @property
    def recent_loss(self) -> Optional[float]:
        """Mean loss of the last W applied gradients (sync: of the last round)."""
        return sum(self.losses) / len(self.losses) if self.losses else None

    def reply(self, accepted: bool, loss: Optional[float] = None) -> Reply:
        # A snapshot: the reply is serialised after the lock is released, while the next
        # update may already be changing the master copy.
        params = self.params.detach().to(self.wire_dtype, copy=True)
        return Reply(self.version, params, accepted, self.recent_loss if loss is None else loss,
                     self.stats.samples, self.stats.stale_dropped)

    def _check(self, worker: int, version: int, grad) -> None:
        name = f"ps{self.index}"
        if not isinstance(worker, int) or not 0 <= worker < self.num_workers:
            raise PushRejected(f"{name}: push from unknown worker {worker!r} "
                               f"(workers are 0..{self.num_workers - 1})")
        if not isinstance(grad, torch.Tensor):
            raise PushRejected(f"{name}: worker{worker} pushed a {type(grad).__name__}, "
                               "expected a flat tensor")
        if grad.dim() != 1 or grad.numel() != self.params.numel():
            raise PushRejected(f"{name}: worker{worker} pushed shape {tuple(grad.shape)}, "
                               f"expected ({self.params.numel()},) (this shard's flat length)")
        if grad.dtype != self.wire_dtype:
            raise PushRejected(f"{name}: worker{worker} pushed dtype {grad.dtype}, expected "
                               f"{self.wire_dtype} (update.wire_dtype)")
        if not isinstance(version, int) or version > self.version:
            raise PushRejected(f"{name}: worker{worker} pushed a gradient for step {version!r}, "
                               f"but this shard is at step {self.version} (a step from the future)")

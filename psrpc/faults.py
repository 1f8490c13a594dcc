"""Fault injection (`fault.*`) for tests and demos; a null object when nothing is set.

- straggler: `fault.slow_worker` sleeps `fault.slow_s` before every push;
- crash: the process `fault.crash_role` / `fault.crash_index` kills itself with SIGKILL (no
  cleanup, as `kill -9` would) once the global step reaches `fault.crash_at_step`; only in the
  first attempt of a torchrun group, so a restarted group does not crash again. Where:
  `fault.crash_point` `after_update` (the default) or, for a PS with cluster.ps_replicas >= 2,
  `between_backups`: after sending an update to its first backup, before the next;
- NaN: `fault.nan_worker` pushes NaN gradients once, at `fault.nan_at_step`: its gradient
  buffers on the device are filled with NaN before anything is sent, so the NaN reaches the PS
  whatever the wire dtype and the device.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time

import torch

from psrpc.errors import require

log = logging.getLogger("psrpc")


class NoFaults:
    """The default: every hook does nothing."""

    def before_backward(self, step: int) -> None:
        """Straggler sleep, crash: once the batch's forward is done."""

    def nan_due(self, step: int) -> bool:
        return False

    def corrupt(self, step: int, grads: list[torch.Tensor]) -> None:
        pass

    def after_update(self, step: int) -> None:
        pass

    def between_backups(self, step: int) -> None:
        """A PS's journal, between its sends of one update to two backups."""


class Faults(NoFaults):
    def __init__(self, cfg, role: str, index: int, restart_count: int = 0):
        self.cfg, self.role, self.index = cfg, role, index
        self.may_crash = (restart_count == 0 and cfg.crash_role == role
                          and cfg.crash_index == index)
        self.nan_pending = role == "worker" and cfg.nan_worker == index

    def _crash_if_due(self, step: int, point: str = "after_update") -> None:
        if self.may_crash and step >= self.cfg.crash_at_step and point == self.cfg.crash_point:
            log.warning("fault.crash_*: killing %s%d at step %d", self.role, self.index, step)
            os.kill(os.getpid(), signal.SIGKILL)

    def before_backward(self, step: int) -> None:
        self._crash_if_due(step)
        if self.index == self.cfg.slow_worker and self.role == "worker":
            time.sleep(self.cfg.slow_s)  # a straggler: slow compute, as seen by everyone else

    def nan_due(self, step: int) -> bool:
        return self.nan_pending and step >= self.cfg.nan_at_step

    def corrupt(self, step: int, grads: list[torch.Tensor]) -> None:
        if self.nan_due(step):
            self.nan_pending = False
            log.warning("fault.nan_*: worker%d pushes NaN gradients at step %d", self.index, step)
            for g in grads:
                g.fill_(float("nan"))

    def after_update(self, step: int) -> None:
        self._crash_if_due(step)

    def between_backups(self, step: int) -> None:
        self._crash_if_due(step, "between_backups")


POINTS = ("after_update", "between_backups")  # fault.crash_point


def check_faults(cfg) -> None:
    """The fault.* keys, against the cluster and the run they would strike (a fault that could
    never happen is refused: a test or a demo relying on it would prove nothing)."""
    f, c, steps = cfg.fault, cfg.cluster, cfg.train.steps
    require(f.slow_worker is None or 0 <= f.slow_worker < c.num_workers, "fault.slow_worker",
            f.slow_worker, f"must be a worker index in 0..{c.num_workers - 1}, or null")
    require(math.isfinite(f.slow_s) and f.slow_s >= 0, "fault.slow_s", f.slow_s,
            "must be a finite number of seconds ≥ 0")
    require(f.crash_role in (None, "ps", "worker"), "fault.crash_role", f.crash_role,
            "must be ps, worker or null")
    if f.crash_role is not None:
        n = c.num_ps if f.crash_role == "ps" else c.num_workers
        require(0 <= f.crash_index < n, "fault.crash_index", f.crash_index,
                f"must be a {f.crash_role} index in 0..{n - 1}")
        require(0 <= f.crash_at_step < steps, "fault.crash_at_step", f.crash_at_step,
                f"must be a step in 0..{steps - 1} (train.steps={steps}), or it never happens")
    require(f.crash_point in POINTS, "fault.crash_point", f.crash_point,
            f"must be one of {', '.join(POINTS)}")
    require(f.crash_point == "after_update" or (f.crash_role == "ps" and c.ps_replicas >= 2),
            "fault.crash_point", f.crash_point, "between_backups needs fault.crash_role=ps and "
            "cluster.ps_replicas >= 2 (two backups to send an update to), or it never happens")
    require(f.nan_worker is None or 0 <= f.nan_worker < c.num_workers, "fault.nan_worker",
            f.nan_worker, f"must be a worker index in 0..{c.num_workers - 1}, or null")
    if f.nan_worker is not None:
        require(0 <= f.nan_at_step < steps, "fault.nan_at_step", f.nan_at_step,
                f"must be a step in 0..{steps - 1} (train.steps={steps}), or it never happens")


def build_faults(cfg, role: str, index: int, restart_count: int = 0) -> NoFaults:
    active = ((cfg.slow_worker is not None and cfg.slow_s > 0) or cfg.crash_role is not None
              or cfg.nan_worker is not None)
    return Faults(cfg, role, index, restart_count) if active else NoFaults()

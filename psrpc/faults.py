"""Fault injection (`fault.*`) for tests and demos; a null object when nothing is set.

- straggler: `fault.slow_worker` sleeps `fault.slow_s` before every push;
- crash: the process `fault.crash_role` / `fault.crash_index` kills itself with SIGKILL (no
  cleanup, as `kill -9` would) once the global step reaches `fault.crash_at_step`; only in the
  first attempt of a torchrun group, so a restarted group does not crash again;
- NaN: `fault.nan_worker` pushes NaN gradients once, at `fault.nan_at_step`: its gradient
  buffers on the device are filled with NaN before anything is sent, so the NaN reaches the PS
  whatever the wire dtype and the device.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import torch

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


class Faults(NoFaults):
    def __init__(self, cfg, role: str, index: int, restart_count: int = 0):
        self.cfg, self.role, self.index = cfg, role, index
        self.may_crash = (restart_count == 0 and cfg.crash_role == role
                          and cfg.crash_index == index)
        self.nan_pending = role == "worker" and cfg.nan_worker == index

    def _crash_if_due(self, step: int) -> None:
        if self.may_crash and step >= self.cfg.crash_at_step:
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


def build_faults(cfg, role: str, index: int, restart_count: int = 0) -> NoFaults:
    active = ((cfg.slow_worker is not None and cfg.slow_s > 0) or cfg.crash_role is not None
              or cfg.nan_worker is not None)
    return Faults(cfg, role, index, restart_count) if active else NoFaults()

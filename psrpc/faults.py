"""Fault injection (`fault.*`) for tests and demos; a null object when nothing is set."""

from __future__ import annotations

import time


class NoFaults:
    """The default: every hook does nothing."""

    def before_push(self, step: int) -> None:
        pass


class Faults(NoFaults):
    def __init__(self, cfg, role: str, index: int):
        self.cfg, self.role, self.index = cfg, role, index

    def before_push(self, step: int) -> None:
        if self.role == "worker" and self.index == self.cfg.slow_worker:
            time.sleep(self.cfg.slow_s)  # a straggler: slow compute, as seen by everyone else


def build_faults(cfg, role: str, index: int) -> NoFaults:
    active = cfg.slow_worker is not None and cfg.slow_s > 0
    return Faults(cfg, role, index) if active else NoFaults()

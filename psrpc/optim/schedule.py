"""Learning-rate schedules (`optim.schedule`), run on the PS: the learning rate of an update is a
function of the global step it makes, so every shard uses the same one, and a restored run
(which restores the step) continues the schedule exactly where it was.

    lr(t) = optim.lr × warmup(t) × decay(t),   t = the shard's version before the update

warmup(t) = min(1, (t + 1) / warmup_steps) (1 without warmup); decay: constant 1; step
gamma^⌊t / step_size⌋; cosine and linear go from 1 at the end of warmup to min_lr / lr at
train.steps.

torch.optim.lr_scheduler would need its own state saved and restored in step with the version;
this is the same arithmetic as its LinearLR/StepLR/CosineAnnealingLR, as a pure function.
"""

from __future__ import annotations

import math
from typing import Callable


def _constant(t: int, o, total: int) -> float:
    return 1.0


def _step(t: int, o, total: int) -> float:
    return o.gamma ** (t // o.step_size)


def _progress(t: int, o, total: int) -> float:
    span = max(1, total - o.warmup_steps)
    return min(1.0, max(0.0, (t - o.warmup_steps) / span))


def _cosine(t: int, o, total: int) -> float:
    floor = o.min_lr / o.lr if o.lr else 0.0
    return floor + (1 - floor) * (1 + math.cos(math.pi * _progress(t, o, total))) / 2


def _linear(t: int, o, total: int) -> float:
    floor = o.min_lr / o.lr if o.lr else 0.0
    return 1 - (1 - floor) * _progress(t, o, total)


SCHEDULES: dict[str, Callable[[int, object, int], float]] = {
    "constant": _constant, "step": _step, "cosine": _cosine, "linear": _linear}


def lr_factor(t: int, optim, total_steps: int) -> float:
    """The multiplier of optim.lr for the update made at global step t."""
    warm = min(1.0, (t + 1) / optim.warmup_steps) if optim.warmup_steps else 1.0
    return warm * SCHEDULES[optim.schedule](t, optim, total_steps)

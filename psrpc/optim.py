"""Optimizers run on the PS over one flat master tensor per shard (state lives there too).

torch.optim does the work: a shard is a single parameter tensor whose `.grad` is the round's
average. Every optimizer here is elementwise, so sharding never changes the result.
"""

from __future__ import annotations

from typing import Callable

import torch

OPTIMIZERS: dict[str, Callable] = {
    "sgd": lambda params, c: torch.optim.SGD(
        params, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay, nesterov=c.nesterov),
    "adam": lambda params, c: torch.optim.Adam(
        params, lr=c.lr, betas=tuple(c.betas), eps=c.eps, weight_decay=c.weight_decay),
}


def build_optimizer(params: list[torch.Tensor], cfg) -> torch.optim.Optimizer:
    try:
        make = OPTIMIZERS[cfg.name]
    except KeyError:
        raise ValueError(f"optim={cfg.name!r}: must be one of {sorted(OPTIMIZERS)}") from None
    return make(params, cfg)

"""Dense optimizers over one flat tensor: a shard's master copy on the PS, or a worker's
replica (update.dense=allreduce); their state lives with the tensor.

torch.optim does the work: a shard is a single parameter tensor whose `.grad` is the round's
average. Every optimizer here is elementwise, so sharding never changes the result.
"""

from __future__ import annotations

import dataclasses

import torch

# The schedule's fields are psrpc's (psrpc/optim/schedule.py); every other field of an
# optimizer's config is a keyword argument of its torch.optim class (psrpc/config.py).
SCHEDULE_FIELDS = ("name", "schedule", "warmup_steps", "step_size", "gamma", "min_lr")


def torch_arguments(cfg) -> dict:
    """The keyword arguments of `cfg`'s torch.optim class: its fields but the schedule's
    (lists as tuples, as torch takes betas)."""
    return {f.name: tuple(v) if isinstance(v := getattr(cfg, f.name), list) else v
            for f in dataclasses.fields(cfg) if f.name not in SCHEDULE_FIELDS}


def build_optimizer(params: list[torch.Tensor], cfg) -> torch.optim.Optimizer:
    """torch.optim.<cfg.torch_class> over `params`, with the fused CPU kernels when this torch
    has them: one pass over the shard instead of three (SGD with momentum 8 -> 5 ms, Adam
    63 -> 7 ms on 45 MB, one thread)."""
    make = getattr(torch.optim, type(cfg).torch_class)
    try:
        return make(params, **torch_arguments(cfg), fused=True)
    except (RuntimeError, TypeError, ValueError):  # an older torch: no fused CPU kernel
        return make(params, **torch_arguments(cfg))


def step_scaled(optimizer: torch.optim.Optimizer, param: torch.Tensor, grad: torch.Tensor,
                base_lr: list[float], scale: float) -> None:
    """One step of `optimizer` over its one tensor `param` with gradient `grad`, at `scale` ×
    each group's base learning rate (the schedule's factor); `.grad` and the rates are put back
    after. `.grad` points at `grad` instead of a copy (4 bytes a parameter)."""
    param.grad = grad
    try:
        for g, lr in zip(optimizer.param_groups, base_lr):
            g["lr"] = lr * scale
        with torch.no_grad():
            optimizer.step()
    finally:
        param.grad = None
        for g, lr in zip(optimizer.param_groups, base_lr):
            g["lr"] = lr


def count_step(optimizer: torch.optim.Optimizer) -> None:
    """A global step passes on this shard without an update while the other shards applied it
    (a membership change lines the shards up: `Shard.catch_up`): an optimizer that counts its
    steps (Adam's bias correction) counts this one too, so that every shard's count stays the
    one the others have, as with one optimizer over the whole model (and as a checkpoint
    re-split for another number of PS assumes). The moments are left as they are: that
    gradient is lost. A tensor with no state yet first gets the state its first step would
    make; an optimizer that counts no steps (SGD) is left alone."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p) or _fresh_state(optimizer, p)
            if "step" in state:  # (no empty entry made: a copy of the shard has none either)
                state["step"] += 1
                optimizer.state[p] = state


def _fresh_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """The state `optimizer` gives `p` before its first step, as torch builds it (a probe of
    the same class, stepped once on a zero gradient at lr 0, with its step count reset); {} for
    an optimizer that counts no steps."""
    probe = torch.zeros_like(p)
    tmp = type(optimizer)([probe], **{**optimizer.defaults, "lr": 0.0, "weight_decay": 0.0})
    probe.grad = torch.zeros_like(probe)
    tmp.step()
    state = tmp.state[probe]
    if "step" not in state:
        return {}
    state["step"] = state["step"] * 0 if torch.is_tensor(state["step"]) else 0
    return dict(state)

"""Build shards directly (no RPC) for unit tests of the update rules."""

import torch

from psrpc.config import AdamConfig, AsyncUpdateConfig, SGDConfig, SyncUpdateConfig
from psrpc.ps.shard import Shard, ShardSpec

CONSTANT = dict(schedule="constant", warmup_steps=0, step_size=1000, gamma=0.1, min_lr=0.0)


def sgd(lr=1.0, momentum=0.0, weight_decay=0.0, **schedule):
    return SGDConfig(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=False,
                     **{**CONSTANT, **schedule})


def adam(lr=0.01, **schedule):
    return AdamConfig(lr=lr, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0,
                      **{**CONSTANT, **schedule})


def sync(replicas=None, timeout_s=30.0, wire="float32"):
    return SyncUpdateConfig(replicas_to_aggregate=replicas, timeout_s=timeout_s, wire_dtype=wire)


def asynch(max_staleness=None, staleness_lr=False, timeout_s=30.0, wire="float32"):
    return AsyncUpdateConfig(max_staleness=max_staleness, staleness_lr=staleness_lr,
                             timeout_s=timeout_s, wire_dtype=wire)


def make_shard(update, optim=None, workers=2, n=4, steps=1000, start=None, **spec):
    params = torch.zeros(n) if start is None else start.clone()
    return Shard(ShardSpec(0, params, optim or sgd(), update, workers, steps, **spec))


def push(shard, worker, version, grad, loss=1.0, samples=1):
    """Call push_pull directly (what the RPC would run on the PS); returns its Future."""
    return shard.push_pull(worker, version, torch.as_tensor(grad, dtype=torch.float32), loss,
                           samples)


def admit(shard, worker, version):
    """Ask the staleness clock for a ticket (what `Shard.admit` runs on the PS); its Future."""
    return shard.admit(worker, version)


def push_ticket(shard, worker, version, grad, ticket, loss=1.0, samples=1):
    return shard.push_pull(worker, version, torch.as_tensor(grad, dtype=torch.float32), loss,
                           samples, ticket)

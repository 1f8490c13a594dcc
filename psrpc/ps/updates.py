"""The update rules a shard can run (`update=sync|async`): a registry, not an if."""

from __future__ import annotations

from psrpc.ps.async_apply import AsyncApplier
from psrpc.ps.sync import SyncAggregator

RULES = {"sync": SyncAggregator, "async": AsyncApplier}


def build_updater(shard, update_cfg, num_workers: int):
    try:
        rule = RULES[update_cfg.name]
    except KeyError:
        raise ValueError(f"update={update_cfg.name!r}: must be one of {sorted(RULES)}") from None
    return rule(shard, update_cfg, num_workers)

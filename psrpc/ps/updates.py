"""The update rules a shard can run (`update=sync|async`): a registry, not an if."""

from __future__ import annotations

from psrpc.errors import one_of
from psrpc.ps.async_apply import AsyncApplier
from psrpc.ps.sync import SyncAggregator

RULES = {"sync": SyncAggregator, "async": AsyncApplier}


def build_updater(shard, update_cfg, num_workers: int):
    rule = one_of(RULES, update_cfg.name, "update")
    return rule(shard, update_cfg, num_workers)

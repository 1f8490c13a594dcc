"""What the chief hands every worker once the shards exist (and again in each membership epoch):
the layouts, the shards' handles, the pipeline cuts, the restored state and the shared memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from psrpc.cluster import shm
from psrpc.cluster.layout import Layout


@dataclass
class DenseState:
    """The dense parameters held by the workers (update.dense=allreduce): per flat buffer of
    the layout, the parameters and their optimizer state (`optimizer.state[param]`'s form, {}
    before the first step), at global step `version`. From the chief: fresh, restored, or its
    replica's when a membership epoch starts."""

    version: int
    flats: list[torch.Tensor]
    states: list[dict]


@dataclass
class Plan:
    """What the chief hands every worker once the shards exist."""

    layouts: list[Layout]  # per pipeline stage (data parallel: one)
    shards: list[list]  # shards[s][k]: Handle of stage s's shard k (on ps{layouts[s].shard_ps[k]})
    cuts: list[int]  # index of each stage's first layer (data parallel: [0])
    restored_from_step: Optional[int] = None
    buffers: Optional[dict[str, torch.Tensor]] = None  # restored buffers, full-model names
    table_shards: list = field(default_factory=list)  # Handle of each PS's TableShard (ps{k})
    table_specs: list = field(default_factory=list)  # TableSpec of every embedding table
    partition: str = "mod"  # sparse.partition
    rolled_back_to: Optional[int] = None  # a new membership epoch that restored a checkpoint
    shared: list = field(default_factory=list)  # per dense shard: shared memory (bootstrap)
    # update.dense=allreduce: the dense state every worker starts the epoch from; the layouts
    # are then the workers' own buffers and shards[0] is one clock shard with no parameters
    dense: Optional[DenseState] = None
    # a PS failed over to a backup (cluster.ps_replicas, sync): each worker pushes the step
    # the old group left unanswered again to the shards still at its version
    replay: bool = False

    def shm_for(self, stage: int, worker: int) -> list:
        """For FlatModel: per shard of `stage`, (mode, params segment, slot segment) when
        `worker` (its id in the shard's rounds) shares that shard's memory, else None."""
        first = sum(lay.num_shards for lay in self.layouts[:stage])
        out = []
        for k in range(self.layouts[stage].num_shards):
            entry = self.shared[first + k] if self.shared else None
            if entry is None or worker not in entry[2]:
                out.append(None)
                continue
            mode, run, _ = entry
            out.append((mode, shm.segment(run, first + k, "params"),
                        shm.segment(run, first + k, f"g{worker}")))
        return out

    @property
    def layout(self) -> Layout:
        """Every shard of every stage in one layout, stage by stage: final model, checkpoints."""
        return Layout.concat(self.layouts)

    @property
    def all_shards(self) -> list:
        """Every dense shard, stage by stage (what the layout describes, except with
        update.dense=allreduce: the one clock shard)."""
        return [rref for stage in self.shards for rref in stage]

    @property
    def every_shard(self) -> list:
        """The dense shards, then the table shards: all that count global steps."""
        return self.all_shards + self.table_shards

"""A shard's counters: what the chief reports in summary.json and a checkpoint carries over."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ShardStats:
    applied_pushes: int = 0  # gradients applied (sync: summed over rounds)
    samples: int = 0
    stale_dropped: int = 0
    nan_rejected: int = 0
    staleness_max: int = 0
    staleness_sum: int = 0
    busy_s: float = 0.0  # time spent in push_pull handlers (the PS side of a round)
    host_sums: int = 0  # pushes that carried a host's sum of several workers' (update.host_push)
    per_worker_applied: dict = field(default_factory=dict)
    per_worker_stale: dict = field(default_factory=dict)
    # sync: gradients missing from the rounds this shard closed, by why (each a designed way
    # for a round to close short of every worker): "timeout" (update.timeout_s), "lost" (a
    # worker counted lost earlier), "backup_workers" (replicas_to_aggregate < W), "rejected"
    # (non-finite), "void" (computed across an update), "epoch" (a round the old group left),
    # "passed" (a step passed without an update to line the shards up: every worker's)
    short: dict = field(default_factory=dict)

    def missed(self, why: str, count: int) -> None:
        if count > 0:
            self.short[why] = self.short.get(why, 0) + count

    def applied(self, worker: int, samples: int, staleness: int = 0) -> None:
        self.applied_pushes += 1
        self.samples += samples
        self.staleness_max = max(self.staleness_max, staleness)
        self.staleness_sum += staleness
        self.per_worker_applied[worker] = self.per_worker_applied.get(worker, 0) + 1

    def stale(self, worker: int) -> None:
        self.stale_dropped += 1
        self.per_worker_stale[worker] = self.per_worker_stale.get(worker, 0) + 1

"""A worker's client of the dense shards: push / pull / push_pull against every shard of a stage,
all RPCs in flight at once, and `admit` at the staleness clock (bounded staleness)."""

from __future__ import annotations

from typing import Optional

import torch

from psrpc.cluster import comm
from psrpc.cluster.wire import Reply, Ticket
from psrpc.errors import PsrpcError, first_line


class ShardClient:
    """push / pull / push_pull against every shard of a stage, all RPCs in flight at once."""

    def __init__(self, shards: list, worker: int, timeout_s: Optional[float] = None):
        self.shards, self.worker, self.timeout_s = shards, worker, timeout_s

    def wait(self, futures, first: int = 0) -> list[Reply]:
        """The replies (of shards first, first+1, ...), or an error naming the PS that failed."""
        replies = []
        for k, fut in enumerate(futures, start=first):
            try:
                replies.append(fut.wait())
            except Exception as e:
                owner = comm.owner_name(self.shards[k])
                raise PsrpcError(f"worker{self.worker}: push_pull to {owner} failed: "
                                 f"{first_line(e)}") from e
        return replies

    def push_one(self, shard: int, version: int, grad: torch.Tensor, loss: float,
                 samples: int, ticket: Optional[int] = None, host=None):
        """Push one shard now (while backward goes on); returns the Future of its Reply.
        `host`: the gradient is a host's sum (a HostSum, update.host_push)."""
        extra = () if host is None else (host,)
        return comm.invoke(self.shards[shard], "push_pull", self.worker, version, grad, loss,
                           samples, ticket, *extra, timeout_s=self.timeout_s)

    def push_pull_async(self, versions: list[int], grads: list[torch.Tensor], loss: float,
                        samples: int, ticket: Optional[int] = None) -> list:
        return [self.push_one(k, v, g, loss, samples, ticket)
                for k, (v, g) in enumerate(zip(versions, grads))]

    def push_pull(self, versions: list[int], grads: list[torch.Tensor], loss: float,
                  samples: int, ticket: Optional[int] = None) -> list[Reply]:
        return self.wait(self.push_pull_async(versions, grads, loss, samples, ticket))

    def admit(self, clock, version: int) -> Ticket:
        """Bounded staleness: the clock shard's ticket for a gradient computed on `version`
        (waits while the bound holds this worker back)."""
        try:
            return comm.invoke(clock, "admit", self.worker, version,
                               timeout_s=self.timeout_s).wait()
        except Exception as e:
            raise PsrpcError(f"worker{self.worker}: admit at {comm.owner_name(clock)} failed: "
                             f"{first_line(e)}") from e

    def pull(self) -> list[Reply]:
        return self.wait([comm.invoke(rref, "pull", timeout_s=self.timeout_s)
                          for rref in self.shards])

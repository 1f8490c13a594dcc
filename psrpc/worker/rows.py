"""A worker's client of the table shards: pull the rows a batch needs, push their gradients.

Rows are asked of the servers that own them (the partition says which), one RPC per server
carrying every table, all in flight at once. A push goes to every server every step, with an
empty payload where the batch touched none of its rows: each table shard counts global steps
like the dense shards, so a sync round closes on all of them.
"""

from __future__ import annotations

from typing import Optional

import torch

from psrpc.cluster import comm, shm
from psrpc.errors import PsrpcError, first_line
from psrpc.sparse.rows import Partition, TableSpec


class RowClient:
    def __init__(self, shards: list, specs: list[TableSpec], partition: str, worker: int,
                 timeout_s: Optional[float] = None):
        self.shards, self.worker, self.timeout_s = shards, worker, timeout_s
        self.specs = {s.name: s for s in specs}
        self.partitions = {s.name: Partition(s.num_rows, len(shards), partition) for s in specs}

    def _split(self, rows: dict[str, torch.Tensor]) -> list[dict[str, tuple]]:
        """Per server: {table: (positions in rows[table], local rows)}."""
        per = [dict() for _ in self.shards]
        for name, r in rows.items():
            for k, (pos, local) in enumerate(self.partitions[name].split(r)):
                if pos.numel():
                    per[k][name] = (pos, local)
        return per

    def pull(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{table: unique global rows} -> {table: their current values, (U, dim)}."""
        per = self._split(rows)
        asked = [(k, comm.invoke(self.shards[k], "pull_rows",
                                 {n: local for n, (_, local) in parts.items()},
                                 timeout_s=self.timeout_s))
                 for k, parts in enumerate(per) if parts]
        out = {n: torch.empty(r.numel(), self.specs[n].dim) for n, r in rows.items()}
        for k, fut in asked:
            try:
                got = fut.wait()
            except Exception as e:
                raise PsrpcError(f"worker{self.worker}: pulling rows from "
                                 f"{comm.owner_name(self.shards[k])} failed: "
                                 f"{first_line(e)}") from e
            for name, (pos, _) in per[k].items():
                out[name][pos] = got[name]
        return out

    def pull_versions(self) -> list:
        """Every table shard's Reply (its version), as a first pull."""
        return comm.wait_all([comm.invoke(r, "pull", timeout_s=self.timeout_s)
                              for r in self.shards])

    def push_async(self, grads: dict[str, tuple[torch.Tensor, torch.Tensor]],
                   versions: list[int], loss: float, samples: int,
                   ticket: Optional[int] = None, void: bool = False) -> list:
        """{table: (unique global rows, (U, dim) gradients)} to every server: Futures of the
        Replies, in server order. `void`: the gradients were computed across an update
        (shm.VOID: each server discards them)."""
        per = self._split({n: r for n, (r, _) in grads.items()})
        return [comm.invoke(self.shards[k], "push_pull", self.worker, versions[k],
                            shm.VOID if void else
                            {n: (local, grads[n][1][pos]) for n, (pos, local) in parts.items()},
                            loss, samples, ticket, timeout_s=self.timeout_s)
                for k, parts in enumerate(per)]

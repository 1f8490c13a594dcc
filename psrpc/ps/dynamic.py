"""What a table shard (psrpc/ps/tables.py) does for its dynamic tables beyond a fixed table's
work: answer a synchronous round's lookups ahead in one batch, restore the tables from any number
of servers' checkpoints, record their rows and the process's memory over the run, and check a
push's counts. The tables themselves are psrpc/sparse/dynamic.py's `DynamicTables`."""

from __future__ import annotations

import resource

import psutil
import torch

from psrpc.errors import PsrpcError, PushRejected
from psrpc.sparse.dynamic import DynamicTables
from psrpc.sparse.optim import sparse_hyper
from psrpc.sparse.rows import TableSpec, table_seed


MAX_COUNT = 2**31 - 1  # a push's count for one id (the map keeps counts in int32)


class DynamicParts:
    """Mixed into TableShard: uses its lock, version, dynamic tables and partition."""

    def _ahead_rows(self, worker: int, ahead: dict) -> dict:
        """The rows `worker` asked ahead for, at this version: the first reply of a round
        looks up every waiting worker's rows in one batch, the others take theirs from it.
        Caller holds the lock."""
        done = self._looked_up.pop(worker, None)
        if done is not None and done[0] == self.version and done[1] is ahead:
            return done[2]  # looked up with another worker's, for this very request
        asks = dict(self._aheads)
        asks[worker] = ahead
        self._aheads.clear()
        fixed = {w: {n: r for n, r in a.items() if n not in self.dynamic} for w, a in asks.items()}
        found = self.dynamic.lookup_many({w: {n: r for n, r in a.items() if n in self.dynamic}
                                          for w, a in asks.items()})
        for w in asks:
            values = {**self._values(fixed[w]), **found[w]}
            if w == worker:
                mine = values
            else:
                self._looked_up[w] = (self.version, asks[w], values)
        return mine

    def _record(self, points: int) -> None:
        """Every total_steps / points steps: each dynamic table's rows, their bytes and the
        process's resident memory (the summary's shards[k].history)."""
        if self.version % max(1, self.total_steps // points) == 0:
            self.history.append({"step": self.version,
                                 "rows_live": {n: t.rows_live
                                               for n, t in self.dynamic.tables.items()},
                                 "table_bytes": self.dynamic.nbytes(),
                                 "rss_bytes": psutil.Process().memory_info().rss})

    def _restore_dynamic(self, files: list, restore: dict) -> None:
        """Each dynamic table's ids that this server owns now, from every old server's file
        (re-partitioned by id: any number of servers before and after). The counters of rows
        made and evicted are each server's own with the same servers, else all on ps0."""
        same = restore["num_ps"] == self.num_ps
        for name, table in self.dynamic.tables.items():
            saved = [f.get("dynamic", {}).get(name) for f in files]
            if any(s is None for s in saved):
                raise PsrpcError(f"checkpoint step-{restore['step']} has no dynamic table "
                                 f"{name!r}: it was made for another model (or with the table "
                                 "fixed: sparse.dynamic differs)")
            for f, state in zip(files, saved):
                self.dynamic.load(name, state, self.hashed.owner(state["ids"])[0] == self.ps)
                if (same and f.get("ps") == self.ps) or (not same and self.ps == 0):
                    table.rows_created += state["counters"]["rows_created"]
                    table.rows_evicted += state["counters"]["rows_evicted"]


def process_memory() -> dict:
    """This process's resident memory now and its peak (psutil; the peak from getrusage)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"rss_bytes": psutil.Process().memory_info().rss, "peak_rss_bytes": peak}


def dynamic_tables(tables: list[TableSpec], seed: int, sp, num_ps: int) -> DynamicTables:
    """A server's part of the dynamic tables: sparse.max_rows is a whole table's, so each of
    P servers keeps at most ceil(max_rows / P) rows of it."""
    cap = -(-sp.max_rows // num_ps) if getattr(sp, "max_rows", None) else None
    return DynamicTables(tables, {t.name: table_seed(seed, t.name) for t in tables},
                         sp.optimizer, sparse_hyper(sp),
                         admit_after=getattr(sp, "admit_after", 1),
                         evict=getattr(sp, "evict", "none"),
                         ttl_steps=getattr(sp, "ttl_steps", 0), max_rows=cap)


def check_counts(shard: str, worker: int, name: str, ids: torch.Tensor, counts) -> None:
    """A dynamic table's counts: int64, one per id, each in [1, MAX_COUNT] (how many times the
    batch named it)."""
    if not isinstance(counts, torch.Tensor) or counts.dtype != torch.int64 \
            or counts.shape != ids.shape or counts.layout != torch.strided \
            or counts.device.type != "cpu":
        shape = tuple(counts.shape) if isinstance(counts, torch.Tensor) else counts
        raise PushRejected(f"{shard}: worker{worker} pushed counts {shape} for {ids.numel()} "
                           f"ids of {name!r}; expected {ids.numel()} int64 counts")
    c = counts.numpy()
    low, high = (int(c.min()), int(c.max())) if c.shape[0] else (1, 1)
    if low < 1 or high > MAX_COUNT:
        raise PushRejected(f"{shard}: worker{worker} pushed a count of "
                           f"{low if low < 1 else high} for an id of {name!r}: counts are how "
                           f"many times the batch named each id, in [1, {MAX_COUNT}]")

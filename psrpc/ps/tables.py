"""The parameter server's part of every embedding table: `TableShard`, one per PS.

PS k holds the rows of every table that the partition gives it (`sparse.partition`: "mod",
row r on r % P; "div", contiguous ranges), created at start from `init_rows` (a function of the
table's seed and the row: the same values whatever the partition), and a row-sparse optimizer per
table (`sparse.optimizer`: sgd, row-wise adagrad, lazy adam) whose state is sharded like the
rows. A worker never allocates a table: it pulls the rows of its batch (`pull_rows`) and pushes
their gradients (`push_pull` with {table: (local rows, gradients)}).

It is a `Shard` in every other respect: the same version (one per global step, in step with the
dense shards), the same sync rounds and async rules (the aggregator sums the round's row
gradients in worker order and divides by the number of gradients, TensorFlow's
SparseConditionalAccumulator averaging: `mean_rows`, which a worker accumulating micro-batches
uses too), the same checks,
non-finite handling, freezing and step-consistent checkpoints. Every table is stepped once per
update even when the update touched none of its rows (LazyAdam's bias correction counts steps:
the result must not depend on how rows are spread over servers).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from psrpc.checkpoint import write_atomic
from psrpc.cluster import comm
from psrpc.cluster.wire import Reply
from psrpc.errors import PsrpcError, PushRejected
from psrpc.optim.schedule import lr_factor
from psrpc.ps.shard import Shard, ShardSpec
from psrpc.ps.stats import ShardStats
from psrpc.ps.dynamic import DynamicParts, check_counts, dynamic_tables, process_memory
from psrpc.ps.backup import ReplicatedRows
from psrpc.ps.handover import HandOver
from psrpc.sparse.export import TABLES_FORMAT, table_file, tables_meta
from psrpc.sparse.optim import build_sparse_optimizer, sparse_hyper
from psrpc.sparse.rows import (HashPartition, Partition, TableSpec, init_rows, mean_rows,
                               table_seed)

log = logging.getLogger(__name__)
_EMPTY = torch.empty(0)
HISTORY_POINTS = 50  # dynamic tables: rows and memory are recorded this many times a run


def tables_file(ps: int) -> str:
    return f"tables-{ps}.pt"


@dataclass
class TableShardSpec(ShardSpec):
    """A ShardSpec (params empty) plus what the tables need."""

    ps: int = 0
    num_ps: int = 1
    tables: list = field(default_factory=list)  # TableSpec of every table
    seed: int = 0  # train.seed: the tables' initial values
    sparse: object = None  # the sparse config: optimizer, lr, partition, ...
    restore: Optional[dict] = None  # {"paths": [old tables files], "partition", "num_ps"}
    hand_over: bool = False  # the workers' row caches hold gradients: wait for them at the end


class TableShard(ReplicatedRows, DynamicParts, Shard):
    def __init__(self, spec: TableShardSpec, backup: bool = False):
        self._restored_stats: Optional[dict] = None
        super().__init__(spec, backup)
        self.handover = HandOver(self, spec.hand_over, float(spec.update.timeout_s))
        if self._restored_stats is not None:  # this server's own counters, same partition
            self.stats = ShardStats(**self._restored_stats)

    def _init_state(self, spec: TableShardSpec) -> None:
        self.ps, self.num_ps, self.sparse = spec.ps, spec.num_ps, spec.sparse
        self.params = _EMPTY  # no dense master copy
        self.specs: dict[str, TableSpec] = {t.name: t for t in spec.tables}
        self.partitions = {n: Partition(t.num_rows, spec.num_ps, spec.sparse.partition)
                           for n, t in self.specs.items() if not t.dynamic}
        self.hashed = HashPartition(spec.num_ps)  # the dynamic tables' ids
        self.weights: dict[str, torch.Tensor] = {}
        self.row_optim = {}
        self.dynamic = dynamic_tables([t for t in spec.tables if t.dynamic], spec.seed,
                                      spec.sparse, spec.num_ps)
        self.history: list[dict] = []  # dynamic tables: their rows and memory over the run
        self._aheads: dict[int, dict] = {}  # worker -> the rows it asked ahead for (pending)
        self._looked_up: dict[int, tuple] = {}  # worker -> (version, the values looked up)
        for name, t in self.specs.items():
            if t.dynamic:
                continue
            rows = self.partitions[name].global_rows(self.ps)
            self.weights[name] = init_rows(rows, t.dim, table_seed(spec.seed, name),
                                           t.init_scale)
            self.row_optim[name] = build_sparse_optimizer(spec.sparse.optimizer,
                                                          self.weights[name],
                                                          **sparse_hyper(spec.sparse))
        if spec.restore is not None:
            self._restore(spec.restore)

    @property
    def numel(self) -> int:
        return (sum(w.numel() for w in self.weights.values())
                + sum(t.rows_live * t.dim for t in self.dynamic.tables.values()))

    def _values(self, requests: dict, worker: Optional[int] = None) -> dict:
        """{table: rows} -> {table: a copy of their values} (the dynamic tables' ids in one
        batch; those with no row: their initial values)."""
        out = {n: self.weights[n].index_select(0, r) for n, r in requests.items()
               if n not in self.dynamic}
        asked = {n: r for n, r in requests.items() if n in self.dynamic}
        if asked:
            out.update(self.dynamic.lookup(asked, worker))
        return out

    # -- the verbs ---------------------------------------------------------------------------------
    def pull_rows(self, requests: dict) -> dict:
        """{table: local rows} -> {table: their values, (U, dim) float32}: a copy, taken under
        the lock (the next update may change the rows while the reply is written)."""
        out = {}
        with self.lock:
            for name, rows in requests.items():
                self._check_rows(name, rows, "pulled")
            out = self._values(requests)
        return out

    @comm.async_execution
    def push_pull_rows(self, worker: int, version: int, payload, loss: float, samples: int,
                       ticket: Optional[int], ahead: dict):
        """push_pull, whose Reply also carries the values of `ahead` ({table: local rows}: the
        rows of the worker's next batch) as they are at the Reply's version: the next step's
        pull rides on this step's push, one message per server per step instead of two."""
        try:
            if not isinstance(ahead, dict):
                raise PushRejected(f"{self.name}: worker{worker} asked for rows ahead as "
                                   f"{type(ahead).__name__}, expected {{table: rows}}")
            for name, rows in ahead.items():
                self._check_rows(name, rows, "asked for", worker)
        except PushRejected as e:
            return comm.failed(e)
        if self.dynamic:  # the round's lookups ahead are answered together (_with_rows)
            with self.lock:
                self._aheads[worker] = ahead
        return self.push_pull(worker, version, payload, loss, samples, ticket).then(
            lambda f: self._with_rows(f, ahead, worker))

    def _with_rows(self, done: torch.futures.Future, ahead: dict, worker: int) -> Reply:
        """The reply with the rows asked ahead, read at its version (none if the shard has
        moved past it meanwhile: another round closed, with backup workers)."""
        with self.lock:
            if self._aheads.get(worker) is ahead:  # not answered with a round's batch: drop it
                del self._aheads[worker]
            reply = done.value()  # (a failed push raises here, its request already dropped)
            if self.version != reply.version:
                return reply
            if self.dynamic:
                return replace(reply, rows=self._ahead_rows(worker, ahead))
            return replace(reply, rows=self._values(ahead, worker))

    def take_held(self, worker: int, payload) -> int:
        """What a worker's row cache still held when training ended, {table: (local rows,
        sums)}: applied before the final checkpoint (psrpc/ps/handover.py)."""
        return self.handover.take(worker, payload)

    @comm.async_execution
    def settle(self, wait_s: Optional[float] = None):
        """Shard.settle, and the workers' held row gradients applied (at most `wait_s`
        waited for them; None: update.timeout_s)."""
        return self.handover.settle(Shard.settle(self), wait_s)

    def begin_epoch(self, replay: bool = False, gone: tuple = ()) -> int:
        """A new membership epoch: the old group's requests ahead, and rows looked up for
        them, are dropped with their rounds."""
        with self.lock:
            self._aheads.clear()
            self._looked_up.clear()
        return super().begin_epoch(replay, gone)

    def pull_full(self) -> tuple[int, torch.Tensor]:
        with self.lock:
            return self.version, _EMPTY

    def export(self, out_dir: str, export_id: Optional[str] = None) -> dict:
        """This server's rows of every table, with their global row ids, as
        `out_dir/tables/ps<k>.pt` (written here: a table too large to gather on the chief
        never crosses the network), tagged with `export_id` (the chief's, one per export).
        Returns what the chief's tables/index.json records of it. psrpc.sparse.load_tables
        reads them back."""
        # Training is over (the chief asks at the end): the rows no longer change, so they are
        # written as they are, straight into the file: no copy of a table in memory.
        state = {"format": TABLES_FORMAT, "export": export_id, "ps": self.ps,
                 "version": self.version, "partition": self.sparse.partition,
                 "num_ps": self.num_ps,
                 "tables": {n: {"rows": self.partitions[n].global_rows(self.ps), "weight": w,
                                "num_rows": self.specs[n].num_rows}
                            for n, w in self.weights.items()}}
        for n, t in self.dynamic.tables.items():  # rows by raw id, and how to make the others
            state["tables"][n] = {**self.dynamic.export(n), "dynamic": True,
                                  "num_rows": t.spec.num_rows,
                                  "seed": t.seed, "init_scale": t.spec.init_scale,
                                  "pooling": t.spec.pooling}
        folder = Path(out_dir) / "tables"
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / table_file(self.ps), state)
        return {"file": table_file(self.ps), "ps": self.ps, "num_ps": self.num_ps,
                "version": self.version, "partition": self.sparse.partition,
                "tables": tables_meta(state["tables"])}

    # -- what the update rules use -------------------------------------------------------------------
    def _check_payload(self, worker: int, payload) -> None:
        if not isinstance(payload, dict):
            raise PushRejected(f"{self.name}: worker{worker} pushed a {type(payload).__name__}, "
                               "expected {table: (rows, gradients)}")
        for name, item in payload.items():
            if name not in self.specs:
                raise PushRejected(f"{self.name}: worker{worker} pushed rows of unknown table "
                                   f"{name!r} (tables: {sorted(self.specs)})")
            size = 3 if name in self.dynamic else 2
            if not (isinstance(item, tuple) and len(item) == size):
                what = "(ids, gradients, counts)" if size == 3 else "(rows, gradients) pair"
                raise PushRejected(f"{self.name}: worker{worker} pushed {name!r}: expected a "
                                   f"{what}")
            rows, grads = item[:2]
            self._check_rows(name, rows, "pushed", worker)
            if size == 3:
                check_counts(self.name, worker, name, rows, item[2])
            dim = self.specs[name].dim
            if not isinstance(grads, torch.Tensor) or grads.dtype != torch.float32 \
                    or grads.shape != (rows.numel(), dim) or grads.device.type != "cpu" \
                    or grads.layout != torch.strided:
                shape = tuple(grads.shape) if isinstance(grads, torch.Tensor) else grads
                raise PushRejected(f"{self.name}: worker{worker} pushed gradients {shape} for "
                                   f"{rows.numel()} rows of {name!r}; expected a float32 CPU "
                                   f"tensor ({rows.numel()}, {dim})")
            ids = rows.numpy()  # (NumPy: a tenth of torch's fixed cost on a few hundred ids)
            if ids.shape[0] > 1 and not (ids[1:] > ids[:-1]).all():
                raise PushRejected(f"{self.name}: worker{worker} pushed rows of {name!r} that are "
                                   "not unique and ascending (coalesce duplicate ids first)")

    def _check_rows(self, name, rows, what: str, worker: Optional[int] = None) -> None:
        who = f"worker{worker} " if worker is not None else ""
        if name not in self.specs:
            raise PushRejected(f"{self.name}: {who}{what} rows of unknown table {name!r} "
                               f"(tables: {sorted(self.specs)})")
        if not isinstance(rows, torch.Tensor) or rows.dtype != torch.int64 or rows.dim() != 1 \
                or rows.layout != torch.strided or rows.device.type != "cpu":
            raise PushRejected(f"{self.name}: {who}{what} rows of {name!r} as "
                               f"{type(rows).__name__}; expected a 1-D int64 dense CPU tensor")
        if name in self.dynamic:
            # pushes only: a pull of ids this server does not own changes nothing (it reads
            # their initial values), and the owner's hash costs a tenth of a pull's work
            if what == "pushed" and rows.numel() \
                    and not (self.hashed.servers(rows.numpy()) == self.ps).all():
                raise PushRejected(f"{self.name}: {who}{what} ids of {name!r} that this server "
                                   f"(ps{self.ps} of {self.num_ps}) does not own: ids go to "
                                   "server hash(id) % num_ps")
            return
        held = self.weights[name].shape[0]
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= held):
            raise PushRejected(f"{self.name}: {who}{what} rows [{int(rows.min())}, "
                               f"{int(rows.max())}] of {name!r}; this server holds local rows "
                               f"[0, {held})")

    def _finite(self, payload: dict) -> bool:
        return all(bool(torch.isfinite(item[1].sum())) for item in payload.values())

    def average(self, payloads: list[dict], workers: Optional[list[int]] = None) -> dict:
        """A sync round's row gradients: every gradient's rows in worker order, duplicates
        summed (in that order: deterministic), divided by the number of gradients. A dynamic
        table's ids come with their positions in the id map when the workers' lookups ahead
        found them all (`workers`: whose payloads these are)."""
        out = {}
        for name in self.specs:
            parts = [p[name] for p in payloads if name in p]
            whose = [w for w, p in zip(workers or [], payloads) if name in p]
            if not parts:
                continue
            *mean, inverse = mean_rows(parts, len(payloads))
            out[name] = tuple(mean)
            if name in self.dynamic:  # (counts: summed, not averaged)
                unique = mean[0]
                known = [self.dynamic.positions(w, name, p[0]) for w, p in zip(whose, parts)]
                if whose and all(k is not None for k in known):
                    pos = np.empty(unique.numel(), dtype=np.int64)
                    pos[inverse.numpy()] = np.concatenate(known)
                    out[name] += (pos,)
        return out

    def step_optimizer(self, payload: dict, lr_scale: float = 1.0) -> None:
        if self.journal is not None:
            self.journal.record("step", payload, lr_scale)
        lr = self.sparse.lr * lr_scale * lr_factor(self.version, self.optim_cfg,
                                                   self.total_steps)
        empty = torch.empty(0, dtype=torch.int64)
        for name, opt in self.row_optim.items():  # every table, touched or not (see above)
            rows, grads = payload.get(name, (empty, _EMPTY.new_zeros(0, self.specs[name].dim)))
            opt.step(rows, grads, lr)
        if not self.dynamic:
            return
        self.dynamic.apply({n: p for n, p in payload.items() if n in self.dynamic},
                           self.version, lr)
        self._record(HISTORY_POINTS)

    def count_step(self) -> None:
        """A step with no rows: each table counts it (LazyAdam), as for a round that touched
        none of its rows."""
        self.step_optimizer({})

    def load_state(self, state: dict, seq: int) -> None:
        """A backup built from a copy of its primary (`_snapshot`'s form) after update `seq`."""
        with self.lock:
            for name, saved in state["tables"].items():
                self.weights[name].copy_(saved["weight"])
                self.row_optim[name].load_state_dict(saved["optimizer"])
            for name, saved in state["dynamic"].items():
                self.dynamic.load(name, saved, torch.ones(saved["ids"].shape[0], dtype=torch.bool))
                table = self.dynamic.tables[name]
                table.rows_created = saved["counters"]["rows_created"]
                table.rows_evicted = saved["counters"]["rows_evicted"]
            self._load_common(state, seq)

    def reply(self, accepted: bool, loss: Optional[float] = None, shared: bool = False,
              skipped: bool = False) -> Reply:
        """No parameters: a worker pulls the rows of its next batch itself."""
        return Reply(self.version, _EMPTY, accepted, self.finished,
                     self.recent_loss if loss is None else loss, self.stats.samples,
                     self.stats.stale_dropped, skipped)

    # -- checkpoints -----------------------------------------------------------------------------------
    def _snapshot(self, step: int) -> dict:
        return {"file": tables_file(self.ps), "shard": self.index, "version": step,
                "ps": self.ps, "partition": self.sparse.partition,
                "tables": {n: {"weight": w.clone(),
                               "optimizer": {k: v.clone() if torch.is_tensor(v) else v
                                             for k, v in self.row_optim[n].state_dict().items()}}
                           for n, w in self.weights.items()},
                "dynamic": {n: self.dynamic.state(n) for n in self.dynamic.tables},
                "num_ps": self.num_ps, "stats": asdict(self.stats)}

    def _restore(self, restore: dict) -> None:
        """Rows and row optimizer state from a checkpoint made with any number of servers and
        either partition: each old file is memory-mapped and only this server's rows are read."""
        old = {n: Partition(t.num_rows, restore["num_ps"], restore["partition"])
               for n, t in self.specs.items()}
        files = [torch.load(p, mmap=True, weights_only=True) for p in restore["paths"]]
        self._restore_dynamic(files, restore)
        for name, weight in self.weights.items():
            saved = [f["tables"].get(name) for f in files]
            if any(s is None for s in saved) or saved[0]["weight"].shape[1] != weight.shape[1]:
                raise PsrpcError(f"checkpoint step-{restore['step']} has no table {name!r} of "
                                 f"dim {weight.shape[1]}: it was made for another model")
            server, local = old[name].owner(self.partitions[name].global_rows(self.ps))
            opt = self.row_optim[name]
            state = opt.state_dict()
            for s, f in enumerate(saved):
                mask = server == s
                if not bool(mask.any()):
                    continue
                rows = local[mask]
                weight[mask] = f["weight"].index_select(0, rows)
                for key in opt.per_row_state:
                    state[key][mask] = f["optimizer"][key].index_select(0, rows)
            for key in opt.scalar_state:
                state[key] = saved[0]["optimizer"][key]
            opt.load_state_dict(state)
        same = restore["num_ps"] == self.num_ps and restore["partition"] == self.sparse.partition
        mine = [f for f in files if f.get("ps") == self.ps]
        if same and mine:
            self._restored_stats = dict(mine[0]["stats"])

    def report(self) -> dict:
        """The shard's report, with each table's rows (a fixed table: all of its rows here) and
        this process's memory: resident now and at its peak."""
        out = super().report()
        with self.lock:
            out["tables"] = {n: {"rows_live": w.shape[0], "rows_created": w.shape[0],
                                 "rows_evicted": 0, "bytes": w.nbytes}
                             for n, w in self.weights.items()}
            out["tables"].update({n: {"rows_live": t.rows_live, "rows_created": t.rows_created,
                                      "rows_evicted": t.rows_evicted, "bytes": t.nbytes()}
                                  for n, t in self.dynamic.tables.items()})
            out["tables_bytes"] = (sum(w.nbytes for w in self.weights.values())
                                   + self.dynamic.nbytes())  # the id map included
        out.update(process_memory(), history=list(self.history), **self.handover.report())
        return out

"""A worker's hot-row cache in front of the table shards (`sparse.cache_rows`,
`sparse.cache_staleness`), after HET (Miao et al., VLDB 2022): click logs are skewed, so a few
thousand rows serve most lookups, and each worker can keep them instead of pulling and pushing
them every step.

Each cached row carries two clocks, in global steps (the table shards' version):
- `pulled_at`: the step its value was read from the PS. A lookup at step t serves the cached
  value while t - pulled_at <= cache_staleness, and pulls the row again after that.
- `pending_since` (`sparse.cache_writes=hold`): the first step whose gradient for the row is
  held here. The worker sums the row's gradients and pushes the sum once t - pending_since
  reaches cache_staleness, when the row is evicted, before a checkpoint step and in the last
  steps of training; when training ends, every worker hands what it still holds (an early
  stop: a signal, a hook) to the table shards, which apply it before the final checkpoint. A
  push the shards do not apply gives back the sums it carried (psrpc/worker/cache_held.py). No
  gradient of a step the PS applied is dropped; each arrives at most cache_staleness steps
  late. A sync round averages over its workers, so a sum of s steps' gradients counts as those
  s would have; a stateful row optimizer (Adagrad, Adam) sees one larger step instead of s small
  ones, the approximation HET makes too.

Slots are direct-mapped (psrpc/worker/cache_slots.py): row r of a table can live in slot
r % cache_rows of that table only, so a lookup, a fill and an eviction are each one pass over
the batch's rows (compiled loops, psrpc/worker/cache_kernels.py), whatever the capacity, and the
tables of one dim share one set of arrays. A missed row takes its slot unless a row of this
lookup or of the one asked ahead holds it; the row it displaces leaves with its held gradient,
which goes out with the next push. The rows a push's reply brings ahead go into their slots as
the reply arrives (they count as pulled, not as hits). Lookups outside training (evaluation, no
autograd) read the PS. A membership epoch or a roll back of the PS drops the cache, values and
held gradients (counted in `cache_grads_dropped`, as a step in flight is lost); a worker that
joins again starts cold.

`sparse.cache_writes=through` (the default) caches reads only: every gradient goes to the PS
in its own step. On MovieLens 100K, where every row is hot, holding gradients costs AUC (row-wise
Adagrad sees one summed step instead of several) and write-through keeps the exact run's; on
skewed click logs holding halves the bytes at the exact AUC (benchmarks/README.md).

`cache_staleness=0` (the default) or `cache_rows=0` bypass the cache: every step pulls and
pushes every row it touches. That is bit for bit the exact run unless the worker pulls ahead
(`sparse.pull_ahead`: under `auto`, the default, a bound of 1 or more with update.dense=allreduce
in sync pulls ahead whatever cache_rows is; `off` never does).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import numpy as np
import torch

from psrpc.errors import first_line
from psrpc.sparse.rows import TableSpec
from psrpc.worker import cache_held as held
from psrpc.worker.cache_slots import SlotBatch, Slots  # noqa: F401 (Slots: tests)

log = logging.getLogger(__name__)


def holds_gradients(sparse) -> bool:
    """Whether the workers' row caches hold gradients (write-back) under this sparse config."""
    return sparse.cache_rows > 0 and sparse.cache_staleness > 0 and sparse.cache_writes == "hold"


class RowCache:
    """Stands where the RowClient stands (tables pull through it, the worker pushes through it)
    and forwards to it what the cache does not serve. `clock()`: the global step the worker is
    at (its table shards' version); `flush_all(step)`: whether the push of `step` must carry
    every held gradient (a checkpoint or the end of training comes next)."""

    def __init__(self, client, specs: list[TableSpec], capacity: int, staleness: int,
                 clock: Callable[[], int], flush_all: Callable[[int], bool], stats,
                 hold: bool = True):
        self.client, self.staleness, self.clock, self.flush_all = client, staleness, clock, \
            flush_all
        self.hold = hold  # False: write-through, every gradient pushed in its own step
        self.stats, self.capacity, self.specs = stats, capacity, list(specs)
        self.groups: list[Slots] = []
        self._evicted: list[tuple] = []
        self.bind(client)

    def bind(self, client) -> None:
        """A new membership epoch's RowClient: the cache starts again, empty (see above)."""
        # lag 1 when the client pulls ahead of time (RowClient.lag): a forward runs at step
        # clock() + 1, on values read at clock(), and the rows asked with a push are those of
        # the lookup two steps on
        self.client, self.lag = client, getattr(client, "lag", 0)
        self.stats.cache_grads_dropped += self.units_held()  # (dropped with the old epoch)
        dims: dict[int, list[TableSpec]] = {}
        for s in self.specs:
            dims.setdefault(s.dim, []).append(s)
        self.groups = [Slots(g, self.capacity) for g in dims.values()]
        self._step: dict[int, SlotBatch] = {}  # group -> the last training lookup
        self._coming: dict[int, tuple] = {}  # group -> (the rows asked ahead for, which asked)
        self._spill: dict[str, tuple] = {}  # rows pulled ahead that found no slot, values
        self._evicted = []  # (group, (tables, rows, sums, units)) to push next
        self._flight: Optional[held.Flight] = None  # what the last push carried (hold)

    def rebind(self, client) -> None:
        """A new membership epoch's RowClient after a failover (cluster.ps_replicas): every
        table shard holds what it held, so the cached rows and held gradients stay."""
        self.client = client

    def units_held(self) -> int:
        """Step gradients held here now (in the slots, or evicted and not yet pushed)."""
        return int(sum(g.units.sum() for g in self.groups)
                   + sum(p[3].sum() for _, p in self._evicted))

    def _by_group(self, rows: dict[str, torch.Tensor]) -> list[tuple[int, Slots, SlotBatch]]:
        out = []
        for k, g in enumerate(self.groups):
            if any(n in rows for n in g.names):
                out.append((k, g, g.place(rows)))
        return out

    # -- reads --------------------------------------------------------------------------------
    def pull(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{table: unique global rows} -> {table: (U, dim) values}, fresh within the bound."""
        if not torch.is_grad_enabled() or not self.capacity:  # evaluation: the PS's values
            return self.client.pull(rows)
        read = self.clock()  # the version values pulled now are (at least) at
        now = read + self.lag  # the step this lookup is for
        spill, self._spill = self._spill, {}
        looked, asked = [], {}
        for k, g, b in self._by_group(rows):
            # (a row waiting in the spill is not in its slot: a fill has not run since the
            # one that found its slot taken, so it is never fresh here but taken from there)
            cached, fresh, n_fresh, hits = g.lookup(b, now, self.staleness, clear=True)
            self._step[k] = b
            self.stats.cache_lookups += b.rows.size
            self.stats.cache_hits += hits  # (rows pulled ahead are pulled, not hits)
            if n_fresh == b.rows.size:  # (the steady state of pulling ahead)
                looked.append((k, g, b, cached, fresh, None))
                continue
            for i, part in enumerate(b.split(~fresh)):
                if part.any():
                    asked[b.names[i]] = torch.from_numpy(b.tensors[i].numpy()[part])
            looked.append((k, g, b, cached, fresh, np.flatnonzero(~fresh)))
        got = self._fetch(asked, spill)
        out = {}
        for k, g, b, cached, fresh, miss in looked:
            if miss is None:  # every row served from here
                values = g.values[b.slots]
            else:
                values = np.empty((b.rows.size, g.dim), dtype=np.float32)
                values[fresh] = g.values[b.slots[fresh]]
            if miss is not None and miss.size:
                v = np.concatenate([got[n] for n in b.names if n in got])
                values[miss] = v
                keep = np.concatenate([b.slots[cached], g.held_slots(
                    self._coming[k][0] if k in self._coming else None)])
                gone, _ = g.fill(b.rows[miss], b.slots[miss], v, read, keep)
                if gone[0].size:
                    self._evicted.append((k, gone))
            for name, part in zip(b.names, b.split(values)):
                out[name] = torch.from_numpy(part)
        return out

    def _fetch(self, asked: dict[str, torch.Tensor], spill: dict) -> dict[str, np.ndarray]:
        """{table: rows} -> {table: values}: what was pulled ahead without a slot, the rest
        pulled now."""
        got, need, into = {}, {}, {}  # into: where in got[table] the pulled rows go
        for name, r in asked.items():
            if name not in spill:
                need[name] = r
                continue
            at = _find(spill[name][0], r.numpy())
            got[name] = np.empty((r.numel(), spill[name][1].shape[1]), dtype=np.float32)
            got[name][at >= 0] = spill[name][1][at[at >= 0]]
            if (at < 0).any():
                need[name], into[name] = r[torch.from_numpy(at < 0)], at < 0
        for name, values in (self.client.pull(need) if need else {}).items():
            if name in into:
                got[name][into[name]] = values.numpy()
            else:
                got[name] = values.numpy()
        return got

    def pull_versions(self) -> list:
        return self.client.pull_versions()

    def receive(self, replies: list) -> None:
        """A push's replies: the rows asked ahead go into the cache at once, read at the
        replies' version (the lookup they are for then finds them fresh), keeping the slots of
        the rows the next push and the next lookup name."""
        self.client.receive(replies)
        flight, self._flight = self._flight, None
        if flight is not None and not all(r.accepted for r in replies):  # (hold)
            if any(r.skipped for r in replies):  # non-finite: dropped whole, as before
                self.stats.cache_grads_dropped += flight.units
            else:  # stale, or past the end: the sums of earlier steps wait for the next push
                refused = np.array([not r.accepted for r in replies], dtype=bool)
                self.stats.cache_grads_dropped += held.give_back(self, flight, refused)
        got = self.client.take_ahead() if self.capacity else None
        coming, self._coming = self._coming, {}
        if got is None:
            return
        at, (asked, values) = replies[0].version, got
        for k, (b, miss) in coming.items():  # the rows asked: those `miss` marks, in order
            names = [n for n in b.names if n in asked]
            if not names:
                continue
            g = self.groups[k]
            rows, slots = b.rows[miss], b.slots[miss]
            v = np.concatenate([values[n].numpy() for n in names])
            keep = np.concatenate([g.held_slots(b), g.held_slots(self._step.get(k))])
            gone, placed = g.fill(rows, slots, v, at, keep, ahead=True)
            if gone[0].size:
                self._evicted.append((k, gone))
            if placed.size < rows.size:  # no slot for some: they wait beside the cache
                left = np.ones(rows.size, dtype=bool)
                left[placed] = False
                ends = np.cumsum([asked[n].numel() for n in names]).tolist()
                for name, i, j in zip(names, [0] + ends[:-1], ends):
                    lf = left[i:j]
                    if lf.any():
                        self._spill[name] = (rows[i:j][lf], v[i:j][lf])

    def _misses(self, rows: dict[str, torch.Tensor], now: int) -> dict[str, torch.Tensor]:
        """{table: the rows of `rows` a lookup at step `now` cannot serve from here}."""
        out = {}
        for k, g, b in self._by_group(rows):
            fresh = g.lookup(b, now, self.staleness)[1]  # (asked ahead: not yet looked up)
            self._coming[k] = (b, ~fresh)
            for name, t, part in zip(b.names, b.tensors, b.split(~fresh)):
                if part.any():
                    out[name] = torch.from_numpy(t.numpy()[part])
        return out

    # -- writes -------------------------------------------------------------------------------
    def ride(self, k: int, target, method: str, args: tuple):
        """A call that goes with the next push to server k (RowClient.ride)."""
        return self.client.ride(k, target, method, args)

    def push_async(self, grads: dict[str, tuple[torch.Tensor, torch.Tensor]],
                   versions: list[int], loss: float, samples: int, ticket=None,
                   void: bool = False, ahead=None) -> list:
        """Holds the gradients of cached rows, pushes the rest and what is due."""
        if not self.capacity:
            return self.client.push_async(grads, versions, loss, samples, ticket, void=void,
                                          ahead=ahead)
        now = self.clock()
        # the rows of the lookup asked ahead ride on this push (see RowClient) when they are
        # not fresh here then: nothing but a lookup or a reply changes what is cached
        self._coming = {}
        ahead = self._misses(ahead, now + 1 + self.lag) if ahead else None
        step, self._step = self._step, {}
        self._flight = None
        if void:  # the PS discards this push: what is held stays held for the next one
            return self.client.push_async({}, versions, loss, samples, ticket, void=True,
                                          ahead=ahead)
        if not self.hold:  # write-through: the cache only serves reads
            return self.client.push_async(grads, versions, loss, samples, ticket, ahead=ahead)
        everything = self.flush_all(now)
        parts = self._take_evicted()
        flight = held.Flight()
        for k, g in enumerate(self.groups):
            b = step.get(k)
            mine = [n for n in g.names if n in grads]
            if b is None and mine or b is not None and (b.names != mine or any(
                    a is not grads[n][0] and not torch.equal(a, grads[n][0])
                    for n, a in zip(b.names, b.tensors))):
                raise RuntimeError(f"row cache: the gradients of tables {mine} are not for the "
                                   "rows of their last lookup")
            if b is not None:
                gn = np.concatenate([grads[n][1].numpy() for n in b.names])
                missed = g.hold(b, gn, now)
                self.stats.cache_grads += b.rows.size
                if missed.size:
                    parts.setdefault(k, []).append((g.table_of(b.slots[missed]), b.rows[missed],
                                                    gn[missed], np.ones(missed.size, np.int64)))
            parts.setdefault(k, []).append(g.take_due(now, self.staleness, everything))
            if b is not None:  # (what a give-back takes out again)
                flight.own[k] = (b, gn, missed, g.taken)
        out = self._payload(parts, flight)
        self._flight = flight
        return self.client.push_async(out, versions, loss, samples, ticket, ahead=ahead)

    def _take_evicted(self) -> dict[int, list]:
        parts: dict[int, list] = {}
        for k, gone in self._evicted:
            parts.setdefault(k, []).append(gone)
        self._evicted = []
        return parts

    def _payload(self, parts: dict[int, list], flight: held.Flight) -> dict:
        """{table: (rows, sums)} of the groups' pieces, merged (cache_held.merge)."""
        out = {}
        for k, pieces in parts.items():
            g = self.groups[k]
            tabs, rows, sums, units = flight.sent[k] = held.merge(pieces)
            ends = np.cumsum(np.bincount(tabs, minlength=len(g.names))).tolist()
            for name, i, j in zip(g.names, [0] + ends[:-1], ends):
                if j > i:
                    out[name] = (torch.from_numpy(rows[i:j]), torch.from_numpy(sums[i:j]))
        return out

    def hand_over(self) -> None:
        """Training is over: every gradient still held (an early stop leaves some) goes to the
        table shards, which apply it before the final checkpoint (TableShard.take_held). Each
        worker hands over, held gradients or none: the shards wait for every one."""
        if not (self.capacity and self.hold):
            return
        parts = self._take_evicted()
        for k, g in enumerate(self.groups):
            parts.setdefault(k, []).append(g.take_due(0, 0, everything=True))
        flight = held.Flight()
        out = self._payload(parts, flight)
        try:
            self.client.hand_over(out)
        except Exception as e:  # (the shards are gone: the summary shows what was held)
            log.warning("row cache: the gradients held at the end did not reach the table "
                        "shards: %s", first_line(e))
            self._evicted = [(k, p) for k, p in flight.sent.items()]
            self.stats.cache_grads_held = self.units_held()
            return
        self.stats.cache_grads_handed_over += flight.units
        self.stats.cache_grads_held = self.units_held()


def _find(sorted_rows: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Position of each of `rows` in `sorted_rows`, -1 where absent."""
    if not sorted_rows.size:
        return np.full(rows.size, -1, dtype=np.int64)
    at = np.minimum(np.searchsorted(sorted_rows, rows), sorted_rows.size - 1)
    return np.where(sorted_rows[at] == rows, at, -1)

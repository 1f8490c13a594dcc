"""A worker's hot-row cache in front of the table shards (`sparse.cache_rows`,
`sparse.cache_staleness`), after HET (Miao et al., VLDB 2022): click logs are skewed, so a few
thousand rows serve most lookups, and each worker can keep them instead of pulling and pushing
them every step.

Each cached row carries two clocks, in global steps (the table shards' version):
- `pulled_at`: the step its value was read from the PS. A lookup at step t serves the cached
  value while t - pulled_at <= cache_staleness, and pulls the row again after that.
- `pending_since`: the first step whose gradient for the row is held here. The worker sums the
  row's gradients locally and pushes the sum once t - pending_since reaches cache_staleness, when
  the row is evicted, before a checkpoint step and in the last steps of training: no gradient is
  dropped, it arrives at most cache_staleness steps late. The PS averages a sync round's
  gradients over the workers in it, so a sum of s steps' gradients counts as those s gradients
  would have; a stateful row optimizer (Adagrad, Adam) sees one larger step instead of s small
  ones, which is the approximation HET makes too.

Slots are direct-mapped, as a CPU cache's lines: row r of a table can live in slot r % cache_rows
of that table only, so a lookup, a fill and an eviction are each one pass over the batch's rows
(compiled loops, psrpc/worker/cache_kernels.py), whatever the capacity (no LRU order to keep,
no scan of the slots), and the tables of one dim share one set of arrays, so a step pays those
passes once, not per table. A missed row takes its slot unless a row of this lookup or of the
one asked ahead holds it; the row it displaces leaves with its held gradient, which goes out
with the next push. The rows a push's reply brings ahead go into their slots as the reply
arrives, so the lookup they are for finds them there (they count as pulled, not as hits).
Lookups outside training (evaluation, no autograd) bypass the cache and read the PS. A
membership epoch or a roll back of the PS drops the cache, values and held gradients (this
worker's last s steps of table gradients are then lost, as a step in flight is); a worker that
joins again starts cold.

`sparse.cache_writes=through` caches reads only: every gradient goes to the PS in its own step
(write-through). Measured on MovieLens 100K, where every row is hot: holding gradients costs
0.005 AUC even at a bound of one step (row-wise Adagrad sees one summed step instead of
several), write-through keeps the exact run's AUC; on skewed click logs holding halves the
bytes at the exact AUC.

`cache_staleness=0` (the default) or `cache_rows=0` bypass the cache altogether: every step
pulls and pushes every row it touches, bit for bit as without it.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from psrpc.sparse.rows import TableSpec


class _Slots:
    """The cache lines of the tables of one dim: table i owns slots [base_i, base_i + cap_i),
    row r of it sits in slot base_i + r % cap_i. NumPy arrays, worked on by the compiled loops
    of cache_kernels (a call costs a fraction of a torch operation's)."""

    def __init__(self, specs: list[TableSpec], capacity: int):
        from psrpc.worker import cache_kernels  # (Numba loads only where a cache is on)

        self.kernels = cache_kernels
        self.names = [s.name for s in specs]
        self.dim = specs[0].dim
        self.caps = np.array([max(1, min(capacity, s.num_rows)) for s in specs], dtype=np.int64)
        self.base = np.concatenate([[0], np.cumsum(self.caps)[:-1]]).astype(np.int64)
        total = int(self.caps.sum())
        self.row = np.full(total, -1, dtype=np.int64)  # slot -> the row in it (-1: free)
        self.values = np.zeros((total, self.dim), dtype=np.float32)
        self.pulled_at = np.zeros(total, dtype=np.int64)
        self.pending = np.zeros((total, self.dim), dtype=np.float32)
        self.pending_since = np.full(total, -1, dtype=np.int64)  # -1: nothing held
        self.ahead = np.zeros(total, dtype=bool)  # filled by a pull ahead, not looked up since
        self._mark = np.zeros(total, dtype=np.int8)  # scratch of a fill (kernels.fill)
        self.started: dict[int, list[np.ndarray]] = {}  # step -> slots that began holding
        self.geometry = {n: (int(c), int(b)) for n, c, b in zip(self.names, self.caps, self.base)}
        self._placed: list[_Batch] = []  # the last batches placed (this lookup, the next two)

    def place(self, rows: dict[str, torch.Tensor]) -> "_Batch":
        """The rows of some of these tables, concatenated in table order, with their slots
        (worked out once for the same row tensors: a push asks ahead for the very rows its
        lookup will name)."""
        names = [n for n in self.names if n in rows]
        tensors = [rows[n] for n in names]
        for b in self._placed:
            if b.names == names and all(a is t for a, t in zip(b.tensors, tensors)):
                return b
        parts = [t.numpy() for t in tensors]
        slots = []
        for n, p in zip(names, parts):
            cap, base = self.geometry[n]
            s = p % cap
            if base:
                s += base
            slots.append(s)
        b = _Batch(names, tensors, np.concatenate(parts) if len(parts) > 1 else parts[0],
                   np.concatenate(slots) if len(slots) > 1 else slots[0])
        self._placed = self._placed[-2:] + [b]
        return b

    def lookup(self, b: "_Batch", now: int, staleness: int, clear: bool = False) -> tuple:
        """(whether each row is in its slot, whether it is fresh at step `now`, how many are
        fresh, how many of those are hits); `clear`: for a forward (see kernels.look)."""
        cached = np.empty(b.rows.size, dtype=bool)
        fresh = np.empty(b.rows.size, dtype=bool)
        n, hits = self.kernels.look(self.row, self.pulled_at, self.ahead, b.slots, b.rows, now,
                                    staleness, clear, cached, fresh)
        return cached, fresh, n, hits

    def held_slots(self, b: Optional["_Batch"]) -> np.ndarray:
        """The slots the rows of `b` are in now."""
        if b is None:
            return np.zeros(0, dtype=np.int64)
        return b.slots[self.row[b.slots] == b.rows]

    def fill(self, rows: np.ndarray, slots: np.ndarray, values: np.ndarray, at: int,
             keep: np.ndarray, ahead: bool = False) -> tuple[tuple, np.ndarray]:
        """Put missed `rows` (read at step `at`) in their `slots`, except the slots in `keep`
        (held by rows still to be looked up or pushed) and a slot an earlier row takes. Returns
        (displaced rows that held gradients: (tables, rows, sums)) and the positions placed.
        `ahead`: pulled ahead of their lookup (not hits when it finds them)."""
        placed, s, old, sums = self.kernels.fill(
            self.row, self.values, self.pulled_at, self.pending, self.pending_since, self.ahead,
            self._mark, rows, slots, np.ascontiguousarray(values, dtype=np.float32), at, keep,
            ahead)
        return (self.table_of(s), old, sums), placed

    def table_of(self, slots: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.base, slots, side="right") - 1

    def hold(self, b: "_Batch", grads: np.ndarray, now: int) -> np.ndarray:
        """Add the gradients of the rows of `b` that are in their slots to their held sums;
        returns the positions of the others (pushed now)."""
        began, missed = self.kernels.hold(self.row, self.pending, self.pending_since, b.slots,
                                          b.rows, grads, now)
        if began.size:
            self.started.setdefault(now, []).append(began)
        return missed

    def take_due(self, now: int, staleness: int, everything: bool) -> tuple:
        """The held gradients due at `now` (held `staleness` steps, or all of them): (tables,
        rows, sums), cleared here."""
        if everything:
            slots = np.arange(self.row.size, dtype=np.int64)
            since = np.full(slots.size, -1, dtype=np.int64)
            self.started = {}
        else:
            parts, steps = [], []
            for step in [k for k in self.started if now - k >= staleness]:
                for p in self.started.pop(step):  # (not since re-filled, or taken)
                    parts.append(p)
                    steps.append(np.full(p.size, step, dtype=np.int64))
            if not parts:
                return (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64),
                        np.zeros((0, self.dim), dtype=np.float32))
            slots, since = np.concatenate(parts), np.concatenate(steps)
        s, rows, sums = self.kernels.take(self.row, self.pending, self.pending_since, slots,
                                          since)
        return self.table_of(s), rows, sums


class _Batch:
    """Some tables' rows, concatenated in table order, with their slots."""

    def __init__(self, names, tensors, rows, slots):
        self.names, self.tensors, self.rows, self.slots = names, tensors, rows, slots
        ends = np.cumsum([t.numel() for t in tensors]).tolist()
        self.bounds = list(zip([0] + ends[:-1], ends))

    def split(self, a: np.ndarray) -> list[np.ndarray]:
        """An array along the rows -> one piece per table (views)."""
        return [a[i:j] for i, j in self.bounds] if len(self.bounds) > 1 else [a]


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
        self.bind(client)

    def bind(self, client) -> None:
        """A new membership epoch's RowClient: the cache starts again, empty (see above)."""
        # lag 1 when the client pulls ahead of time (RowClient.lag): a forward runs at step
        # clock() + 1, on values read at clock(), and the rows asked with a push are those of
        # the lookup two steps on
        self.client, self.lag = client, getattr(client, "lag", 0)
        dims: dict[int, list[TableSpec]] = {}
        for s in self.specs:
            dims.setdefault(s.dim, []).append(s)
        self.groups = [_Slots(g, self.capacity) for g in dims.values()]
        self._step: dict[int, _Batch] = {}  # group -> the last training lookup
        self._coming: dict[int, tuple] = {}  # group -> (the rows asked ahead for, which asked)
        self._spill: dict[str, tuple] = {}  # rows pulled ahead that found no slot, values
        self._evicted: list[tuple] = []  # (group, (tables, rows, sums)) to push next

    def _by_group(self, rows: dict[str, torch.Tensor]) -> list[tuple[int, _Slots, _Batch]]:
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
        if void:  # the PS discards this push: what is held stays held for the next one
            return self.client.push_async({}, versions, loss, samples, ticket, void=True,
                                          ahead=ahead)
        if not self.hold:  # write-through: the cache only serves reads
            return self.client.push_async(grads, versions, loss, samples, ticket, ahead=ahead)
        everything = self.flush_all(now)
        parts: dict[int, list] = {}
        for k, gone in self._evicted:
            parts.setdefault(k, []).append(gone)
        self._evicted = []
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
                if missed.size:
                    parts.setdefault(k, []).append((g.table_of(b.slots[missed]),
                                                    b.rows[missed], gn[missed]))
            parts.setdefault(k, []).append(g.take_due(now, self.staleness, everything))
        out = {}
        for k, pieces in parts.items():
            g = self.groups[k]
            tabs, rows, sums = (np.concatenate([p[i] for p in pieces]) for i in range(3))
            order = np.lexsort((rows, tabs))  # by table, rows ascending in each
            rows, sums = rows[order], sums[order]
            ends = np.cumsum(np.bincount(tabs, minlength=len(g.names))).tolist()
            for name, i, j in zip(g.names, [0] + ends[:-1], ends):
                if j > i:
                    out[name] = (torch.from_numpy(rows[i:j]), torch.from_numpy(sums[i:j]))
        return self.client.push_async(out, versions, loss, samples, ticket, ahead=ahead)


def _find(sorted_rows: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Position of each of `rows` in `sorted_rows`, -1 where absent."""
    if not sorted_rows.size:
        return np.full(rows.size, -1, dtype=np.int64)
    at = np.minimum(np.searchsorted(sorted_rows, rows), sorted_rows.size - 1)
    return np.where(sorted_rows[at] == rows, at, -1)

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

Eviction is least recently used among the rows the current batch does not use, a sixteenth of
the slots at a time. Lookups outside
training (evaluation, no autograd) bypass the cache and read the PS. A membership epoch or a
roll back of the PS drops the cache, values and held gradients (this worker's last s steps of
table gradients are then lost, as a step in flight is); a worker that joins again starts cold.

`sparse.cache_writes=through` caches reads only: every gradient goes to the PS in its own step
(write-through). Measured on MovieLens 100K, where every row is hot: holding gradients costs
0.005 AUC even at a bound of one step (row-wise Adagrad sees one summed step instead of
several), write-through keeps the exact run's AUC; on skewed click logs holding halves the
bytes at the exact AUC.

`cache_staleness=0` (the default) or `cache_rows=0` bypass the cache altogether: every step
pulls and pushes every row it touches, bit for bit as without it.
"""

from __future__ import annotations

from typing import Callable

import torch

from psrpc.sparse.rows import TableSpec


DENSE_MAP_ROWS = 1 << 26  # tables up to 64M rows map rows to slots with a tensor (256 MB)


class _Table:
    """The cached rows of one table: `cap` slots."""

    def __init__(self, spec: TableSpec, cap: int):
        self.cap, self.dim = cap, spec.dim
        # global row -> slot (-1: not cached): a tensor indexed by row, 4 bytes a row of the
        # table (one lookup per batch instead of one dict access per row); a dict beyond
        # DENSE_MAP_ROWS rows
        self.slot = (torch.full((spec.num_rows,), -1, dtype=torch.int32)
                     if spec.num_rows <= DENSE_MAP_ROWS else {})
        self.row = torch.full((cap,), -1, dtype=torch.int64)  # slot -> global row (-1: free)
        self.values = torch.zeros(cap, spec.dim)
        self.pulled_at = torch.zeros(cap, dtype=torch.int64)
        self.pending = torch.zeros(cap, spec.dim)
        self.pending_since = torch.full((cap,), -1, dtype=torch.int64)  # -1: nothing held
        self.used = torch.full((cap,), -1, dtype=torch.int64)  # last lookup's tick (LRU)
        self.free = list(range(cap - 1, -1, -1))

    def slots_of(self, rows: torch.Tensor) -> torch.Tensor:
        if isinstance(self.slot, torch.Tensor):
            return self.slot[rows].to(torch.int64)
        get = self.slot.get
        return torch.tensor([get(r, -1) for r in rows.tolist()], dtype=torch.int64)

    def _map(self, rows: torch.Tensor, slots) -> None:
        """slot[rows] = slots (a tensor, or -1: forgotten)."""
        if isinstance(self.slot, torch.Tensor):
            self.slot[rows] = slots if isinstance(slots, int) else slots.to(torch.int32)
        elif isinstance(slots, int):
            for r in rows.tolist():
                del self.slot[r]
        else:
            self.slot.update(zip(rows.tolist(), slots.tolist()))

    def place(self, rows: torch.Tensor, tick: int) -> tuple[torch.Tensor, tuple]:
        """Slots for new `rows` (-1 where none is left: those rows pass uncached); evicts the
        least recently used rows not looked up at `tick`. Returns (slots, (evicted rows, their
        held gradients))."""
        n = rows.numel()
        need = n - len(self.free)
        ev_rows, ev_grads = torch.empty(0, dtype=torch.int64), torch.empty(0, self.dim)
        if need > 0:
            # a sixteenth of the slots at once: the scan for the least recently used is paid
            # once every many steps, not at every miss
            need = max(need, self.cap // 16)
            candidates = ((self.used < tick) & (self.row >= 0)).nonzero().squeeze(1)
            k = min(need, candidates.numel())
            if k:
                victims = candidates[torch.topk(self.used[candidates], k, largest=False).indices]
                held = victims[self.pending_since[victims] >= 0]
                ev_rows, ev_grads = self.row[held].clone(), self.pending[held].clone()
                self._map(self.row[victims], -1)
                self.pending[held] = 0
                self.pending_since[victims] = -1
                self.row[victims] = -1
                self.free.extend(victims.tolist())
        slots = torch.full((n,), -1, dtype=torch.int64)
        take = min(n, len(self.free))
        if take:
            got = [self.free.pop() for _ in range(take)]
            slots[:take] = torch.tensor(got, dtype=torch.int64)
            self._map(rows[:take], slots[:take])
            self.row[slots[:take]] = rows[:take]
        return slots, (ev_rows, ev_grads)

    def take_due(self, due: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The held gradients of the slots in `due` (their rows, their sums), cleared here."""
        rows, grads = self.row[due].clone(), self.pending[due].clone()
        self.pending[due] = 0
        self.pending_since[due] = -1
        return rows, grads


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
        self.stats = stats
        self.specs = {s.name: s for s in specs}
        self.tables = {s.name: _Table(s, min(capacity, s.num_rows)) for s in specs}
        self._tick = 0  # lookups so far (LRU order)
        self._step: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # last training lookup
        self._evicted: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def bind(self, client) -> None:
        """A new membership epoch's RowClient: the cache starts again, empty (see above)."""
        self.client = client
        self.tables = {n: _Table(self.specs[n], t.cap) for n, t in self.tables.items()}
        self._step, self._evicted = {}, {}

    # -- reads --------------------------------------------------------------------------------
    def pull(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{table: unique global rows} -> {table: (U, dim) values}, fresh within the bound."""
        if not torch.is_grad_enabled():  # evaluation: the PS's values, nothing cached
            return self.client.pull(rows)
        self._tick += 1
        now = self.clock()
        misses, slots = {}, {}
        for name, r in rows.items():
            t = self.tables[name]
            s, fresh = self._lookup(t, r, now)
            cached = s >= 0
            self.stats.cache_lookups += r.numel()
            self.stats.cache_hits += int(fresh.sum())
            slots[name] = s
            t.used[s[cached]] = self._tick  # this batch's rows are not evicted for its misses
            if not bool(fresh.all()):
                misses[name] = (~fresh).nonzero().squeeze(1)
        got = self.client.pull({n: rows[n][pos] for n, pos in misses.items()}) if misses else {}
        out = {}
        for name, r in rows.items():
            t, s = self.tables[name], slots[name]
            values = torch.empty(r.numel(), t.dim)
            hit = s >= 0
            if name in misses:
                pos = misses[name]
                new = pos[s[pos] < 0]  # not cached at all: a slot if one can be had
                if new.numel():
                    placed, evicted = t.place(r[new], self._tick)
                    s[new] = placed
                    if evicted[0].numel():
                        self._evicted.setdefault(name, []).append(evicted)
                values[pos] = got[name]
                into = s[pos]
                keep = into >= 0
                t.values[into[keep]] = got[name][keep]
                t.pulled_at[into[keep]] = now
                hit[pos] = False
            values[hit] = t.values[s[hit]]
            t.used[s[s >= 0]] = self._tick
            out[name] = values
            self._step[name] = (r, s)
        return out

    def pull_versions(self) -> list:
        return self.client.pull_versions()

    def receive(self, replies: list) -> None:
        self.client.receive(replies)

    def _misses(self, rows: dict[str, torch.Tensor], now: int) -> dict[str, torch.Tensor]:
        """{table: the rows of `rows` a lookup at step `now` cannot serve from here}."""
        out = {}
        for name, r in rows.items():
            fresh = self._lookup(self.tables[name], r, now)[1]
            if not bool(fresh.all()):
                out[name] = r[~fresh]
        return out

    def _lookup(self, t: _Table, rows: torch.Tensor, now: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots of `rows`, -1 where not cached; whether each is fresh at step `now`)."""
        s = t.slots_of(rows)
        cached = s >= 0
        fresh = cached.clone()
        fresh[cached] = now - t.pulled_at[s[cached]] <= self.staleness
        return s, fresh

    # -- writes -------------------------------------------------------------------------------
    def ride(self, k: int, target, method: str, args: tuple):
        """A call that goes with the next push to server k (RowClient.ride)."""
        return self.client.ride(k, target, method, args)

    def push_async(self, grads: dict[str, tuple[torch.Tensor, torch.Tensor]],
                   versions: list[int], loss: float, samples: int, ticket=None,
                   void: bool = False, ahead=None) -> list:
        """Holds the gradients of cached rows, pushes the rest and what is due."""
        now = self.clock()
        # the next lookup's misses ride on this push (see RowClient): the cache's state does
        # not change before it, so they are known now
        ahead = self._misses(ahead, now + 1) if ahead else None
        if void:  # the PS discards this push: what is held stays held for the next one
            self._step = {}
            return self.client.push_async({}, versions, loss, samples, ticket, void=True,
                                          ahead=ahead)
        if not self.hold:  # write-through: the cache only serves reads
            self._step = {}
            return self.client.push_async(grads, versions, loss, samples, ticket, ahead=ahead)
        everything = self.flush_all(now)
        out = {}
        for name, t in self.tables.items():
            parts = self._evicted.pop(name, [])
            if name in grads:
                rows, g = grads[name]
                seen, s = self._step.get(name, (None, None))
                if seen is None or not torch.equal(seen, rows):
                    raise RuntimeError(f"row cache: the gradients of table {name!r} are not "
                                       "for the rows of its last lookup")
                cached = s >= 0
                parts.append((rows[~cached], g[~cached]))
                held = s[cached]
                t.pending.index_add_(0, held, g[cached])
                fresh = t.pending_since[held] < 0
                t.pending_since[held[fresh]] = now
            held = (t.pending_since >= 0).nonzero().squeeze(1)
            due = held if everything else held[now - t.pending_since[held] >= self.staleness]
            if due.numel():
                parts.append(t.take_due(due))
            parts = [p for p in parts if p[0].numel()]
            if parts:
                rows = torch.cat([r for r, _ in parts])
                order = torch.argsort(rows)
                out[name] = (rows[order], torch.cat([g for _, g in parts])[order])
        self._step = {}
        return self.client.push_async(out, versions, loss, samples, ticket, ahead=ahead)

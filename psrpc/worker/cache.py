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

Slots are direct-mapped, as a CPU cache's lines: row r can live in slot r % cache_rows only, so
a lookup, a fill and an eviction are a few vectorised operations on the batch's rows, whatever
the capacity (no LRU order to keep, no scan of the slots). A missed row takes its slot unless a
row of the same batch holds it; the row it displaces leaves with its held gradient, which goes
out with the next push. Lookups outside training (evaluation, no autograd) bypass the cache and
read the PS. A membership epoch or a roll back of the PS drops the cache, values and held
gradients (this worker's last s steps of table gradients are then lost, as a step in flight is);
a worker that joins again starts cold.

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

import numpy as np
import torch

from psrpc.sparse.rows import TableSpec


class _Table:
    """The cached rows of one table: `cap` direct-mapped slots (row r in slot r % cap). NumPy
    arrays: a step makes some twenty small operations per table, and NumPy's cost per call is a
    fraction of torch's."""

    def __init__(self, spec: TableSpec, cap: int):
        self.cap, self.dim = cap, spec.dim
        self.row = np.full(cap, -1, dtype=np.int64)  # slot -> global row (-1: free)
        self.values = np.zeros((cap, spec.dim), dtype=np.float32)
        self.pulled_at = np.zeros(cap, dtype=np.int64)
        self.pending = np.zeros((cap, spec.dim), dtype=np.float32)
        self.pending_since = np.full(cap, -1, dtype=np.int64)  # -1: nothing held
        self.started: dict[int, list[np.ndarray]] = {}  # step -> slots that began holding
        self.ahead = np.zeros(cap, dtype=bool)  # filled by a pull ahead, not looked up since

    def lookup(self, rows: np.ndarray, now: int, staleness: int) -> tuple:
        """(slots of `rows`, whether each row is in its slot, whether it is fresh at `now`)."""
        if not self.cap:  # (a cache of no rows: everything passes through)
            none = np.zeros(rows.size, dtype=bool)
            return np.zeros(rows.size, dtype=np.int64), none, none
        s = rows % self.cap
        cached = self.row[s] == rows
        return s, cached, cached & (now - self.pulled_at[s] <= staleness)

    def fill(self, rows: np.ndarray, slots: np.ndarray, values: np.ndarray, at: int,
             batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Put missed `rows` (read at step `at`) in their `slots`, except where a row of `batch`
        (sorted) holds the slot, or an earlier row of `rows` takes it. Returns the displaced
        rows that held gradients, those gradients, and the positions in `rows` placed."""
        if not self.cap:
            return rows[:0], values[:0], np.zeros(0, dtype=np.int64)
        occupant = self.row[slots]
        mine = occupant == rows  # a stale row of its own: refreshed in place
        ok = mine | (occupant < 0)
        if batch.size:  # a slot another row of this batch holds stays its
            at_b = np.minimum(np.searchsorted(batch, occupant), batch.size - 1)
            ok |= batch[at_b] != occupant
        idx = np.flatnonzero(ok)
        _, first = np.unique(slots[idx], return_index=True)  # one row per slot: the first
        if first.size < idx.size:
            idx = idx[first]
        s, new = slots[idx], rows[idx]
        old = self.row[s]
        moved = old != new
        gone = moved & (old >= 0) & (self.pending_since[s] >= 0)
        out = (old[gone], self.pending[s[gone]], idx)
        sm = s[moved]
        self.pending[sm] = 0
        self.pending_since[sm] = -1
        self.row[s] = new
        self.values[s] = values[idx]
        self.pulled_at[s] = at
        self.ahead[s] = False
        return out

    def hold(self, slots: np.ndarray, grads: np.ndarray, now: int) -> None:
        """Add gradients to the held sums of `slots` (their rows are cached; no slot twice)."""
        self.pending[slots] += grads
        new = slots[self.pending_since[slots] < 0]
        if new.size:
            self.pending_since[new] = now
            self.started.setdefault(now, []).append(new)

    def take_due(self, now: int, staleness: int, everything: bool) -> tuple:
        """The held gradients due at `now` (held `staleness` steps, or all of them): their rows
        and sums, cleared here."""
        if everything:
            due = np.flatnonzero(self.pending_since >= 0)
            self.started = {}
        else:
            parts = []
            for step in [k for k in self.started if now - k >= staleness]:
                for slots in self.started.pop(step):  # (not since re-filled, or taken)
                    parts.append(slots[self.pending_since[slots] == step])
            due = np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
        rows, grads = self.row[due], self.pending[due]
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
        # 1 when the client pulls ahead of time (RowClient.lag): a forward runs at step
        # clock() + 1, on values read at clock(), and the rows asked with a push are those of
        # the lookup two steps on
        self.lag = getattr(client, "lag", 0)
        self.hold = hold  # False: write-through, every gradient pushed in its own step
        self.stats = stats
        self.specs = {s.name: s for s in specs}
        self.tables = {s.name: _Table(s, min(capacity, s.num_rows)) for s in specs}
        self._step: dict[str, tuple[torch.Tensor, np.ndarray]] = {}  # last training lookup
        self._coming: dict[str, np.ndarray] = {}  # the rows of the lookup asked ahead for
        self._spill: dict[str, tuple] = {}  # rows pulled ahead that found no slot, values
        self._evicted: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def bind(self, client) -> None:
        """A new membership epoch's RowClient: the cache starts again, empty (see above)."""
        self.client, self.lag = client, getattr(client, "lag", 0)
        self.tables = {n: _Table(self.specs[n], t.cap) for n, t in self.tables.items()}
        self._step, self._evicted, self._coming, self._spill = {}, {}, {}, {}

    # -- reads --------------------------------------------------------------------------------
    def pull(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{table: unique global rows} -> {table: (U, dim) values}, fresh within the bound."""
        if not torch.is_grad_enabled():  # evaluation: the PS's values, nothing cached
            return self.client.pull(rows)
        read = self.clock()  # the version values pulled now are (at least) at
        now = read + self.lag  # the step this lookup is for
        misses, looked = {}, {}
        spill, self._spill = self._spill, {}
        for name, r in rows.items():
            t = self.tables[name]
            s, _, fresh = t.lookup(r.numpy(), now, self.staleness)
            if name in spill:  # pulled ahead, but no slot could take them
                served = _find(spill[name][0], r.numpy()) >= 0
                fresh = fresh & ~served
            self.stats.cache_lookups += r.numel()
            if t.cap:  # (rows pulled ahead for this lookup were pulled: not hits)
                self.stats.cache_hits += int((fresh & ~t.ahead[s]).sum())
                t.ahead[s[fresh]] = False
            looked[name] = (s, fresh)
            if not fresh.all():
                misses[name] = np.flatnonzero(~fresh)
        asked = {n: rows[n][torch.from_numpy(pos)] for n, pos in misses.items()}
        got = {}
        for name in list(asked):
            if name in spill:  # served from what was pulled ahead, the rest pulled now
                at = _find(spill[name][0], asked[name].numpy())
                v = np.empty((at.size, self.tables[name].dim), dtype=np.float32)
                v[at >= 0] = spill[name][1][at[at >= 0]]
                got[name] = (v, at < 0)
                rest = asked[name][torch.from_numpy(at < 0)]
                if rest.numel():
                    asked[name] = rest
                else:
                    del asked[name]
        pulled = self.client.pull(asked) if asked else {}
        for name, g in pulled.items():
            if name in got:
                got[name][0][got[name][1]] = g.numpy()
            else:
                got[name] = (g.numpy(), None)
        got = {n: torch.from_numpy(v) for n, (v, _) in got.items()}
        out = {}
        for name, r in rows.items():
            t, (s, fresh) = self.tables[name], looked[name]
            values = np.empty((r.numel(), t.dim), dtype=np.float32)
            values[fresh] = t.values[s[fresh]]
            if name in misses:
                pos, v = misses[name], got[name].numpy()
                values[pos] = v
                rn = r.numpy()
                keep = np.union1d(rn, self._coming[name]) if name in self._coming else rn
                gone = t.fill(rn[pos], s[pos], v, read, keep)  # (the next lookup's rows stay)
                if gone[0].size:
                    self._evicted.setdefault(name, []).append(gone[:2])
            out[name] = torch.from_numpy(values)
            self._step[name] = (r, s)
        return out

    def pull_versions(self) -> list:
        return self.client.pull_versions()

    def receive(self, replies: list) -> None:
        """A push's replies: the rows asked ahead go into the cache at once, read at the
        replies' version (the lookup they are for then finds them fresh), keeping the slots of
        the rows the next push and the next lookup name."""
        self.client.receive(replies)
        got = self.client.take_ahead()
        coming, self._coming = self._coming, {}
        if got is None:
            return
        at = replies[0].version
        for name, r in got[0].items():
            keep = coming.get(name, np.zeros(0, dtype=np.int64))
            if name in self._step:
                keep = np.union1d(keep, self._step[name][0].numpy())
            t, rn, v = self.tables[name], r.numpy(), got[1][name].numpy()
            gone = t.fill(rn, rn % t.cap if t.cap else rn, v, at, keep)
            if gone[0].size:
                self._evicted.setdefault(name, []).append(gone[:2])
            t.ahead[rn[gone[2]] % t.cap if t.cap else gone[2]] = True
            if gone[2].size < rn.size:  # no slot for some: they wait beside the cache
                left = np.ones(rn.size, dtype=bool)
                left[gone[2]] = False
                self._spill[name] = (rn[left], v[left])

    def _misses(self, rows: dict[str, torch.Tensor], now: int) -> dict[str, torch.Tensor]:
        """{table: the rows of `rows` a lookup at step `now` cannot serve from here}."""
        out = {}
        for name, r in rows.items():
            fresh = self.tables[name].lookup(r.numpy(), now, self.staleness)[2]
            if not fresh.all():
                out[name] = r[torch.from_numpy(~fresh)]
        return out

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
        self._coming = {n: r.numpy() for n, r in ahead.items()} if ahead else {}
        ahead = self._misses(ahead, now + 1 + self.lag) if ahead else None
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
                rn, gn = rows.numpy(), g.numpy()
                cached = t.row[s] == rn if t.cap else np.zeros(rn.size, dtype=bool)
                if cached.all():
                    t.hold(s, gn, now)
                else:
                    parts.append((rn[~cached], gn[~cached]))
                    t.hold(s[cached], gn[cached], now)
            parts.append(t.take_due(now, self.staleness, everything))
            parts = [p for p in parts if p[0].size]
            if len(parts) > 1 or parts and np.any(parts[0][0][1:] <= parts[0][0][:-1]):
                rows = np.concatenate([r for r, _ in parts])
                order = np.argsort(rows, kind="stable")
                parts = [(rows[order], np.concatenate([g for _, g in parts])[order])]
            if parts:
                out[name] = (torch.from_numpy(parts[0][0]), torch.from_numpy(parts[0][1]))
        self._step = {}
        return self.client.push_async(out, versions, loss, samples, ticket, ahead=ahead)


def _find(sorted_rows: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Position of each of `rows` in `sorted_rows`, -1 where absent."""
    if not sorted_rows.size:
        return np.full(rows.size, -1, dtype=np.int64)
    at = np.minimum(np.searchsorted(sorted_rows, rows), sorted_rows.size - 1)
    return np.where(sorted_rows[at] == rows, at, -1)

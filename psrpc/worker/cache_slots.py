"""The hot-row cache's lines (psrpc/worker/cache.py says what the cache does): the slots of the
tables of one dim, direct-mapped, and a batch's rows with their slots."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from psrpc.sparse.rows import TableSpec
from psrpc.worker import cache_held as held


class Slots:
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
        self.units = np.zeros(total, dtype=np.int64)  # step gradients in the held sum
        self.taken = np.zeros(0, dtype=np.int64)  # the slots the last take_due emptied
        self.ahead = np.zeros(total, dtype=bool)  # filled by a pull ahead, not looked up since
        self._mark = np.zeros(total, dtype=np.int8)  # scratch of a fill (kernels.fill)
        self.started: dict[int, list[np.ndarray]] = {}  # step -> slots that began holding
        self.geometry = {n: (int(c), int(b)) for n, c, b in zip(self.names, self.caps, self.base)}
        self._placed: list[SlotBatch] = []  # the last batches placed (this lookup, the next two)

    def place(self, rows: dict[str, torch.Tensor]) -> "SlotBatch":
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
        b = SlotBatch(names, tensors, np.concatenate(parts) if len(parts) > 1 else parts[0],
                   np.concatenate(slots) if len(slots) > 1 else slots[0])
        self._placed = self._placed[-2:] + [b]
        return b

    def lookup(self, b: "SlotBatch", now: int, staleness: int, clear: bool = False) -> tuple:
        """(whether each row is in its slot, whether it is fresh at step `now`, how many are
        fresh, how many of those are hits); `clear`: for a forward (see kernels.look)."""
        cached = np.empty(b.rows.size, dtype=bool)
        fresh = np.empty(b.rows.size, dtype=bool)
        n, hits = self.kernels.look(self.row, self.pulled_at, self.ahead, b.slots, b.rows, now,
                                    staleness, clear, cached, fresh)
        return cached, fresh, n, hits

    def held_slots(self, b: Optional["SlotBatch"]) -> np.ndarray:
        """The slots the rows of `b` are in now."""
        if b is None:
            return np.zeros(0, dtype=np.int64)
        return b.slots[self.row[b.slots] == b.rows]

    def fill(self, rows: np.ndarray, slots: np.ndarray, values: np.ndarray, at: int,
             keep: np.ndarray, ahead: bool = False) -> tuple[tuple, np.ndarray]:
        """Put missed `rows` (read at step `at`) in their `slots`, except the slots in `keep`
        (held by rows still to be looked up or pushed) and a slot an earlier row takes. Returns
        (displaced rows that held gradients: (tables, rows, sums, units)) and the positions
        placed.
        `ahead`: pulled ahead of their lookup (not hits when it finds them)."""
        placed, s, old, sums, units = self.kernels.fill(
            self.row, self.values, self.pulled_at, self.pending, self.pending_since, self.units,
            self.ahead, self._mark, rows, slots, np.ascontiguousarray(values, dtype=np.float32),
            at, keep, ahead)
        return (self.table_of(s), old, sums, units), placed

    def table_of(self, slots: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.base, slots, side="right") - 1

    def hold(self, b: "SlotBatch", grads: np.ndarray, now: int) -> np.ndarray:
        """Add the gradients of the rows of `b` that are in their slots to their held sums;
        returns the positions of the others (pushed now)."""
        began, missed = self.kernels.hold(self.row, self.pending, self.pending_since,
                                          self.units, b.slots, b.rows, grads, now)
        if began.size:
            self.started.setdefault(now, []).append(began)
        return missed

    def take_due(self, now: int, staleness: int, everything: bool) -> tuple:
        """The held gradients due at `now` (held `staleness` steps, or all of them): (tables,
        rows, sums, units), cleared here; `taken`: their slots."""
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
                self.taken = np.zeros(0, dtype=np.int64)
                return held.empty(self.dim)
            slots, since = np.concatenate(parts), np.concatenate(steps)
        s, rows, sums, units = self.kernels.take(self.row, self.pending, self.pending_since,
                                                 self.units, slots, since)
        self.taken = s
        return self.table_of(s), rows, sums, units


class SlotBatch:
    """Some tables' rows, concatenated in table order, with their slots."""

    def __init__(self, names, tensors, rows, slots):
        self.names, self.tensors, self.rows, self.slots = names, tensors, rows, slots
        ends = np.cumsum([t.numel() for t in tensors]).tolist()
        self.bounds = list(zip([0] + ends[:-1], ends))

    def split(self, a: np.ndarray) -> list[np.ndarray]:
        """An array along the rows -> one piece per table (views)."""
        return [a[i:j] for i, j in self.bounds] if len(self.bounds) > 1 else [a]

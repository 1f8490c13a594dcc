"""The row cache's per-step work as compiled loops (Numba): a lookup, a fill, holding gradients
and taking the due ones each touch the batch's slots once, in one call, where NumPy made a dozen
passes and a dozen calls for each (measured in one process, 3 tables, 256 samples: the cache's
cost per step fell from 0.7 ms to 0.3 ms, the rest being Python). Compiled on first use (about
3 s) and kept on disk (Numba's cache), so a process after the first loads them at once.

The arrays are those of `Slots` in psrpc/worker/cache.py, which says what each holds.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_CACHE = True  # Numba's on-disk cache of the compiled code (beside this file, or its cache dir)


@njit(cache=_CACHE, nogil=True)
def look(row, pulled_at, ahead, slots, rows, now, staleness, clear, cached, fresh):
    """For each of `rows` in its slot: whether it is there (`cached`) and fresh at step `now`
    (`fresh`), written into the given bool arrays. `clear`: a lookup for a forward, whose fresh
    rows are then no longer "pulled ahead". Returns (how many fresh, how many of those are hits,
    i.e. were not pulled ahead)."""
    n_fresh = hits = 0
    for i in range(slots.size):
        s = slots[i]
        c = row[s] == rows[i]
        f = c and now - pulled_at[s] <= staleness
        cached[i] = c
        fresh[i] = f
        if f:
            n_fresh += 1
            if clear:
                if not ahead[s]:
                    hits += 1
                ahead[s] = False
    return n_fresh, hits


@njit(cache=_CACHE, nogil=True)
def fill(row, values, pulled_at, pending, pending_since, units, ahead, mark, rows, slots, vals,
         at, keep, set_ahead):
    """Put `rows` (values `vals`, read at step `at`) in their `slots`, except a slot in `keep`
    held by another row and a slot an earlier one of `rows` took. A row displaced with held
    gradients leaves with them. Returns (positions placed, displaced slots, their rows, their
    held sums, the step gradients in each); `mark` is scratch, all zero before and after."""
    n = slots.size
    for j in range(keep.size):
        mark[keep[j]] = 1
    placed = np.empty(n, np.int64)
    gone_slots = np.empty(n, np.int64)
    gone_rows = np.empty(n, np.int64)
    gone_sums = np.empty((n, values.shape[1]), np.float32)
    gone_units = np.empty(n, np.int64)
    n_placed = n_gone = 0
    for i in range(n):
        s, r = slots[i], rows[i]
        old = row[s]
        if mark[s] == 2 or (mark[s] == 1 and old != r):  # taken in this fill, or kept
            continue
        if old != r:
            if old >= 0 and pending_since[s] >= 0:
                gone_slots[n_gone] = s
                gone_rows[n_gone] = old
                gone_sums[n_gone] = pending[s]
                gone_units[n_gone] = units[s]
                n_gone += 1
            pending[s] = 0
            pending_since[s] = -1
            units[s] = 0
            row[s] = r
        values[s] = vals[i]
        pulled_at[s] = at
        ahead[s] = set_ahead
        mark[s] = 2
        placed[n_placed] = i
        n_placed += 1
    for j in range(keep.size):
        mark[keep[j]] = 0
    for j in range(n_placed):
        mark[slots[placed[j]]] = 0
    return (placed[:n_placed], gone_slots[:n_gone], gone_rows[:n_gone], gone_sums[:n_gone],
            gone_units[:n_gone])


@njit(cache=_CACHE, nogil=True)
def hold(row, pending, pending_since, units, slots, rows, grads, now):
    """Add the gradients of the rows that are in their slots to the slots' held sums (no slot
    twice), one unit each. Returns (the slots that began holding at `now`, the positions of the
    rows not in their slots)."""
    n = slots.size
    began = np.empty(n, np.int64)
    missed = np.empty(n, np.int64)
    n_began = n_missed = 0
    for i in range(n):
        s = slots[i]
        if row[s] != rows[i]:
            missed[n_missed] = i
            n_missed += 1
            continue
        for d in range(grads.shape[1]):  # (a loop: no temporary row)
            pending[s, d] += grads[i, d]
        units[s] += 1
        if pending_since[s] < 0:
            pending_since[s] = now
            began[n_began] = s
            n_began += 1
    return began[:n_began], missed[:n_missed]


@njit(cache=_CACHE, nogil=True)
def take(row, pending, pending_since, units, slots, since):
    """The slots of `slots` still holding since step `since[i]` (or, where since[i] < 0,
    holding at all): (those slots, their rows, their sums, their units), cleared here."""
    n = slots.size
    out_slots = np.empty(n, np.int64)
    out_rows = np.empty(n, np.int64)
    out_sums = np.empty((n, pending.shape[1]), np.float32)
    out_units = np.empty(n, np.int64)
    k = 0
    for i in range(n):
        s = slots[i]
        p = pending_since[s]
        if p < 0 or (since[i] >= 0 and p != since[i]):
            continue
        out_slots[k] = s
        out_rows[k] = row[s]
        out_sums[k] = pending[s]
        out_units[k] = units[s]
        pending[s] = 0
        pending_since[s] = -1
        units[s] = 0
        k += 1
    return out_slots[:k], out_rows[:k], out_sums[:k], out_units[:k]

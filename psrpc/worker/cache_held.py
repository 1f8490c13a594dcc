"""The row cache's held gradients on their way to the table shards (psrpc/worker/cache.py).

A piece is (tables, rows, sums, units) of one dim group: a table index and a global row per
entry, its gradient sum and how many step gradients the sum holds (its units). A push merges the
group's pieces (rows evicted with their held sums, the step's missed rows, the sums due) into
one sorted payload, a row named twice summed in the order the pieces came: the table shards
take unique, ascending rows.

A push the table shards do not apply (a push past the step training stopped at, a stale one)
gives the cache back what it carried from earlier steps: those sums go out with the next push,
or at the end with the hand-over; the step's own gradients are taken out of them and dropped,
as the step's dense gradient is. A non-finite push is dropped whole, as before.
"""

from __future__ import annotations

import numpy as np
import torch

_SHIFT = 40  # a (table, row) key: table << 40 | row (no table of the cache has 2^40 rows)


def empty(dim: int) -> tuple:
    return (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64),
            np.zeros((0, dim), dtype=np.float32), np.zeros(0, dtype=np.int64))


def merge(pieces: list[tuple]) -> tuple:
    """The pieces of one group as one, by table and ascending rows, duplicates summed in the
    order of `pieces` (a stable sort and a left-to-right sum: the same bits every run)."""
    tabs, rows, sums, units = (np.concatenate([p[i] for p in pieces]) for i in range(4))
    order = np.lexsort((rows, tabs))  # (stable)
    tabs, rows, sums, units = tabs[order], rows[order], sums[order], units[order]
    if rows.size > 1:
        dup = (tabs[1:] == tabs[:-1]) & (rows[1:] == rows[:-1])
        if dup.any():
            starts = np.flatnonzero(np.concatenate([[True], ~dup]))
            sums = np.add.reduceat(sums, starts, axis=0)
            units = np.add.reduceat(units, starts)
            tabs, rows = tabs[starts], rows[starts]
    return tabs, rows, sums, units


def key(tabs: np.ndarray, rows: np.ndarray) -> np.ndarray:
    return (tabs.astype(np.int64) << _SHIFT) | rows


class Flight:
    """What one push carried, per group: `sent` the merged piece; `own` (the batch, its
    gradients, the positions it missed, the slots whose sums were due): the batch's gradients
    went out where missed or due, and stayed held elsewhere."""

    def __init__(self):
        self.sent: dict[int, tuple] = {}
        self.own: dict[int, tuple] = {}

    @property
    def units(self) -> int:
        return int(sum(p[3].sum() for p in self.sent.values()))


def give_back(cache, flight: Flight, refused: np.ndarray) -> int:
    """`refused[k]`: table server k did not apply the push. The sums it carried for those
    servers' rows go back to `cache._evicted`, less the push's own step gradients, which are
    dropped (from the cache too, where they are held). Returns how many were dropped."""
    dropped = 0
    for k, (tabs, rows, sums, units) in flight.sent.items():
        g = cache.groups[k]
        back = refused[_servers(cache, g, tabs, rows)]
        sums, units = sums.copy(), units.copy()  # (the sent arrays may back a message)
        b, gn, missed, taken = flight.own.get(k, (None, None, None, None))
        if b is not None:
            mine_tabs, mine = g.table_of(b.slots), b.rows
            mine_back = refused[_servers(cache, g, mine_tabs, mine)]
            sent = np.isin(b.slots, taken)  # held, then due: in the payload
            sent[missed] = True
            at = np.searchsorted(key(tabs, rows), key(mine_tabs, mine))
            take = np.flatnonzero(sent & mine_back)  # in the payload: taken out of it
            sums[at[take]] -= gn[take]
            units[at[take]] -= 1
            dropped += take.size
            for i in np.flatnonzero(~sent & mine_back):  # still held: taken out where it is
                dropped += int(_unhold(cache, k, g, int(mine_tabs[i]), int(mine[i]),
                                       int(b.slots[i]), gn[i]))
        keep = back & (units > 0)
        if keep.any():
            cache._evicted.append((k, (tabs[keep], rows[keep], sums[keep], units[keep])))
    return dropped


def _servers(cache, g, tabs: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The table server of each (table, row) of group g."""
    parts = getattr(cache.client, "partitions", None)
    out = np.zeros(rows.size, dtype=np.int64)
    if not parts or rows.size == 0:
        return out
    for t, name in enumerate(g.names):
        m = tabs == t
        if m.any():
            out[m] = parts[name].owner(torch.from_numpy(rows[m]))[0].numpy()
    return out


def _unhold(cache, k: int, g, tab: int, row: int, slot: int, grad: np.ndarray) -> bool:
    """Take one step gradient of `row` out of its held sum: in its slot, or in a sum evicted
    since the push (a lookup in between). A sum left with no unit is cleared exactly."""
    if g.row[slot] == row and g.pending_since[slot] >= 0:
        g.units[slot] -= 1
        if g.units[slot] <= 0:
            g.units[slot], g.pending_since[slot] = 0, -1
            g.pending[slot] = 0
        else:
            g.pending[slot] -= grad
        return True
    for j, (kk, (tabs, rows, sums, units)) in enumerate(cache._evicted):
        if kk != k:
            continue
        hit = np.flatnonzero((tabs == tab) & (rows == row))
        if hit.size:
            i = int(hit[0])
            sums[i] -= grad
            units[i] -= 1
            if units[i] <= 0:
                keep = np.arange(rows.size) != i
                cache._evicted[j] = (kk, (tabs[keep], rows[keep], sums[keep], units[keep]))
            return True
    return False

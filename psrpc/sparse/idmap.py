"""A map from raw int64 ids to entries, for the parameter server's dynamic tables: an
open-addressing hash table with linear probing, held in torch tensors and worked on a whole
batch of ids at a time (one vectorised probe per round, rounds until every id has settled), so
a lookup of ten thousand ids costs a handful of tensor operations, not ten thousand dict calls.

Every position has a key, a state (empty, live, or gone: a tombstone left by `remove`, which
lookups probe past and inserts reuse) and the caller's columns (`columns={"count": int32}`):
tensors as long as the table, indexed by position, moved with their keys when the table is
rebuilt. The table is rebuilt (grown, or cleaned of tombstones) before an insert would take it
past `MAX_LOAD` of its positions in use, so probe chains stay short.
"""

from __future__ import annotations

import torch

from psrpc.sparse.rows import hash64

EMPTY, LIVE, GONE = 0, 1, 2
MAX_LOAD = 0.6  # live + gone positions, at most this share of the table
MIN_CAPACITY = 1024
SALT = 0x1DA9


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class IdMap:
    def __init__(self, columns: dict[str, torch.dtype], capacity: int = MIN_CAPACITY):
        self.dtypes = dict(columns)
        self._allocate(_pow2(max(capacity, MIN_CAPACITY)))

    def _allocate(self, capacity: int) -> None:
        self.capacity, self.mask = capacity, capacity - 1
        self.keys = torch.zeros(capacity, dtype=torch.int64)
        self.state = torch.zeros(capacity, dtype=torch.int8)
        self.columns = {k: torch.zeros(capacity, dtype=d) for k, d in self.dtypes.items()}
        self.size = 0  # live positions
        self.used = 0  # live or gone

    def __len__(self) -> int:
        return self.size

    def nbytes(self) -> int:
        return self.keys.nbytes + self.state.nbytes + sum(c.nbytes for c in self.columns.values())

    def _home(self, ids: torch.Tensor) -> torch.Tensor:
        return hash64(ids, SALT) & self.mask

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's position, -1 where the id is not in the map."""
        out = torch.full((ids.numel(),), -1, dtype=torch.int64)
        pos = self._home(ids)
        todo = torch.arange(ids.numel())
        while todo.numel():
            p = pos[todo]
            state = self.state[p]
            hit = (state == LIVE) & (self.keys[p] == ids[todo])
            out[todo[hit]] = p[hit]
            go_on = ~(hit | (state == EMPTY))
            todo, p = todo[go_on], p[go_on]
            pos[todo] = (p + 1) & self.mask
        return out

    def insert(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids that are not in the map (unique: the caller checked with `find`) -> their new
        positions; their columns are zero."""
        n = ids.numel()
        if not n:
            return torch.empty(0, dtype=torch.int64)
        if self.used + n > MAX_LOAD * self.capacity:
            self._rebuild(self.size + n)
        out = torch.empty(n, dtype=torch.int64)
        pos = self._home(ids)
        todo = torch.arange(n)
        placed = torch.zeros(n, dtype=torch.bool)
        while todo.numel():
            p = pos[todo]
            free = self.state[p] != LIVE
            cand, cand_p = todo[free], p[free]
            if cand.numel():
                # of the ids that reach one free position together, the first (lowest index)
                # takes it: deterministic, whatever the order the tensor ops run in
                where, inverse = torch.unique(cand_p, return_inverse=True)
                first = torch.full((where.numel(),), n, dtype=torch.int64)
                first.scatter_reduce_(0, inverse, cand, "amin")
                won = first[inverse] == cand
                idx, at = cand[won], cand_p[won]
                self.used += int((self.state[at] == EMPTY).sum())
                self.keys[at] = ids[idx]
                self.state[at] = LIVE
                for col in self.columns.values():
                    col[at] = 0
                out[idx] = at
                placed[idx] = True
            todo = todo[~placed[todo]]
            pos[todo] = (pos[todo] + 1) & self.mask  # its position is taken now: probe on
        self.size += n
        return out

    def remove(self, positions: torch.Tensor) -> None:
        """Live positions -> gone (their slots in every column are left as they are)."""
        self.state[positions] = GONE
        self.size -= positions.numel()

    def live(self) -> torch.Tensor:
        """Every live position, ascending."""
        return torch.nonzero(self.state == LIVE).squeeze(1)

    def _rebuild(self, need: int) -> None:
        """A table big enough for `need` live ids at two thirds of MAX_LOAD (so at least half as
        many inserts again before the next rebuild), without tombstones."""
        live = self.live()
        keys = self.keys[live]
        columns = {k: c[live] for k, c in self.columns.items()}
        self._allocate(_pow2(max(MIN_CAPACITY, int(need / (MAX_LOAD * 2 / 3)) + 1)))
        at = self.insert(keys)
        for k, c in columns.items():
            self.columns[k][at] = c

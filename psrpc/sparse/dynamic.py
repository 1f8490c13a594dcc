"""A dynamic table's rows on one parameter server: a row per raw id, made when the id is first
trained on, dropped when it goes cold. Pure table math, no RPC (psrpc/ps/tables.py serves it).

- **Ids to rows.** An `IdMap` from id to an entry: how often the id has been seen (`count`),
  the step it was last trained on (`last`), and its row in storage (`slot`, -1 while the id is
  still waiting for admission). Rows live in one storage tensor, the row optimizer's weight,
  grown in chunks; the slots of evicted rows go to a free list and are handed out first.
- **Initial values.** `init_ids(id)`: a hash of (table seed, id), the same on any server and at
  any time, so an id evicted and seen again starts over from the same values, and a lookup of
  an id with no row (evaluation, serving, an id not admitted yet) gives exactly that value.
- **Admission** (`admit_after=n`): an id gets a row once it has been seen n times in all
  (counted over samples, summed over workers); until then its gradients are dropped, as
  Monolith's and TFRA's frequency filters do. Counting is per id, exact: no sketch, whose
  collisions would make an id's fate depend on which other ids share its server.
- **Eviction**, after a round's update, never inside one: `ttl` drops every id (row or count)
  not trained on for `ttl_steps` steps (looked for every ttl_steps // 8 steps: an id goes
  between ttl_steps and 9/8 of it after its last training); `lfu` keeps at most `max_rows` rows on this server, and
  when a round takes it past that, drops the least often seen (then the least recently, then the
  smallest id) down to `max_rows - max_rows // 16`, so the sort is paid once every many rounds;
  waiting counts are capped the same way. Each such pass halves the counts of the rows it keeps
  (TinyLFU's aging): ids that were popular long ago give way to today's. With `ttl` and admission every decision depends on
  one id's own history, so 1, 2 or 3 servers give the same bits; `lfu` compares ids that share
  a server.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from psrpc.sparse.idmap import IdMap
from psrpc.sparse.optim import build_sparse_optimizer
from psrpc.sparse.rows import TableSpec, init_ids

EVICTIONS = ("none", "ttl", "lfu")
CHUNK_ROWS = 4096  # storage grows by at least this many rows (or half of what it holds)


class DynamicTable:
    def __init__(self, spec: TableSpec, seed: int, optimizer: str, hyper: dict,
                 admit_after: int = 1, evict: str = "none", ttl_steps: int = 0,
                 max_rows: Optional[int] = None):
        self.spec, self.seed, self.dim = spec, seed, spec.dim
        self.admit_after, self.evict, self.ttl_steps = max(1, admit_after), evict, ttl_steps
        self.max_rows = max_rows if evict == "lfu" else None
        # ttl: the scan for cold ids runs every ttl_steps // 8 steps (every step below 16)
        self.ttl_every = max(1, ttl_steps // 8)
        self.map = IdMap({"count": np.int32, "last": np.int32, "slot": np.int32})
        self.opt = build_sparse_optimizer(optimizer, torch.empty(0, spec.dim), **hyper)
        self.free = np.empty(0, dtype=np.int64)  # slots of evicted rows
        self.rows_live = self.rows_created = self.rows_evicted = 0

    @property
    def weight(self) -> torch.Tensor:
        return self.opt.weight

    def nbytes(self) -> int:
        state = sum(getattr(self.opt, k).nbytes for k in self.opt.per_row_state)
        return self.weight.nbytes + state + self.map.nbytes() + self.free.nbytes

    def initial(self, ids: torch.Tensor) -> torch.Tensor:
        return init_ids(ids, self.dim, self.seed, self.spec.init_scale)

    def _slots(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pos = self.map.find(ids)
        slot = self.map.columns["slot"][pos].astype(np.int64)  # (pos -1: any, masked next)
        slot[pos < 0] = -1
        return pos, slot

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """(U, dim) values of the ids: their rows, or their initial values where they have none
        (nothing is created)."""
        _, slot = self._slots(ids.numpy())
        have = slot >= 0
        if have.all():
            return self.weight.index_select(0, torch.from_numpy(slot))
        out = torch.empty(ids.numel(), self.dim)
        at = torch.from_numpy(np.flatnonzero(have))
        out.index_copy_(0, at, self.weight.index_select(0, torch.from_numpy(slot[have])))
        missing = torch.from_numpy(np.flatnonzero(~have))
        out.index_copy_(0, missing, self.initial(ids.index_select(0, missing)))
        return out

    def apply(self, ids: torch.Tensor, grads: torch.Tensor, counts: torch.Tensor, step: int,
              lr: float) -> None:
        """One update: unique ids, their (summed) gradients and how many samples saw them, at
        global step `step`. Counts and recency first, then admission, then the optimizer on the
        rows that exist; then eviction. Every table is applied once per round, touched or not."""
        if ids.numel():
            keys = ids.numpy()
            pos, slot = self._slots(keys)
            new = pos < 0
            if new.any():
                pos[new] = self.map.insert(keys[new])
                self.map.columns["slot"][pos[new]] = -1
            cols = self.map.columns
            count = np.minimum(cols["count"][pos] + counts.numpy(), 2**31 - 1)
            cols["count"][pos] = count
            cols["last"][pos] = step
            admit = np.flatnonzero((slot < 0) & (count >= self.admit_after))
            if admit.shape[0]:
                made = self._allocate(admit.shape[0])
                made_t = torch.from_numpy(made)
                self.weight.index_copy_(0, made_t, self.initial(
                    ids.index_select(0, torch.from_numpy(admit))))
                self.opt.reset_rows(made_t)
                cols["slot"][pos[admit]] = made
                slot[admit] = made
                self.rows_created += made.shape[0]
                self.rows_live += made.shape[0]
            have = np.flatnonzero(slot >= 0)
            order = np.argsort(slot[have], kind="stable")
            self.opt.step(torch.from_numpy(slot[have][order]),
                          grads.index_select(0, torch.from_numpy(have[order])), lr)
        else:
            self.opt.step(torch.empty(0, dtype=torch.int64), grads, lr)
        self._evict(step)

    def _allocate(self, n: int) -> np.ndarray:
        """n free slots: from the free list, then from storage grown in chunks (never past
        max_rows plus what one round brings, with lfu)."""
        take = min(n, self.free.shape[0])
        slots = self.free[self.free.shape[0] - take:]
        self.free = self.free[:self.free.shape[0] - take]
        missing = n - take
        if missing:
            held = self.weight.shape[0]
            target = held + max(missing, CHUNK_ROWS, held // 2)
            if self.max_rows is not None:
                target = max(min(target, self.max_rows), held + missing)
            self.opt.resize(target)
            grown = np.arange(held, target, dtype=np.int64)
            slots = np.concatenate([slots, grown[:missing]])
            self.free = np.concatenate([grown[missing:][::-1], self.free])
        return slots

    def _evict(self, step: int) -> None:
        cols = self.map.columns
        if self.evict == "ttl" and self.ttl_steps > 0 and len(self.map) \
                and step % self.ttl_every == 0:
            live = self.map.live()
            self._drop(live[(step - cols["last"][live].astype(np.int64)) >= self.ttl_steps])
        elif self.max_rows is not None and max(self.rows_live,
                                               len(self.map) - self.rows_live) > self.max_rows:
            live = self.map.live()
            slot = cols["slot"][live]
            rows, waiting = live[slot >= 0], live[slot < 0]
            if rows.shape[0] > self.max_rows:
                self._drop(self._coldest(rows, rows.shape[0] - self.max_rows +
                                         self.max_rows // 16))
                kept = self.map.live()  # the rows kept: their counts age
                kept = kept[cols["slot"][kept] >= 0]
                cols["count"][kept] >>= 1
            if waiting.shape[0] > self.max_rows:
                self._drop(self._coldest(waiting, waiting.shape[0] - self.max_rows +
                                         self.max_rows // 16))

    def _coldest(self, positions: np.ndarray, n: int) -> np.ndarray:
        """The n positions seen least often, then least recently, then with the smallest id."""
        cols = self.map.columns
        order = np.lexsort((self.map.keys[positions], cols["last"][positions],
                            cols["count"][positions]))  # the last key sorts first
        return positions[order[:n]]

    def _drop(self, positions: np.ndarray) -> None:
        if not positions.shape[0]:
            return
        slot = self.map.columns["slot"][positions].astype(np.int64)
        freed = slot[slot >= 0]
        self.free = np.concatenate([self.free, freed])
        self.rows_live -= freed.shape[0]
        self.rows_evicted += freed.shape[0]
        self.map.remove(positions)

    # -- checkpoints and export -----------------------------------------------------------------
    def _by_id(self) -> tuple[np.ndarray, np.ndarray]:
        """Every entry's position and id, by id ascending."""
        live = self.map.live()
        keys = self.map.keys[live]
        order = np.argsort(keys, kind="stable")
        return live[order], keys[order]

    def state(self) -> dict:
        """Everything the table holds, by id ascending (a copy): ids, their counts and last
        steps, which have rows; those rows' values and optimizer state; the counters."""
        live, ids = self._by_id()
        cols = self.map.columns
        slot = cols["slot"][live].astype(np.int64)
        has = slot >= 0
        rows = torch.from_numpy(slot[has])
        opt = self.opt.state_dict()
        return {"ids": torch.from_numpy(ids), "count": torch.from_numpy(cols["count"][live]),
                "last": torch.from_numpy(cols["last"][live]), "has_row": torch.from_numpy(has),
                "weight": self.weight.index_select(0, rows),
                "optimizer": {k: (v.index_select(0, rows) if k in self.opt.per_row_state else v)
                              for k, v in opt.items()},
                "counters": {"rows_created": self.rows_created,
                             "rows_evicted": self.rows_evicted}}

    def load(self, state: dict, take: torch.Tensor) -> None:
        """Add the entries `take` (a bool mask over state["ids"]) of a `state()` to this table
        (ids it does not hold yet): a checkpoint restored, with any number of servers."""
        take = take.numpy()
        ids = state["ids"].numpy()[take]
        if not ids.shape[0]:
            return
        pos = self.map.insert(ids)
        cols = self.map.columns
        cols["count"][pos] = state["count"].numpy()[take]
        cols["last"][pos] = state["last"].numpy()[take]
        has = state["has_row"].numpy()
        row_of = np.cumsum(has) - 1  # entry -> its row in state["weight"]
        mine = has[take]
        src = torch.from_numpy(row_of[take][mine])
        slots = self._allocate(int(mine.sum()))
        at = torch.from_numpy(slots)
        self.weight.index_copy_(0, at, state["weight"].index_select(0, src))
        for k in self.opt.per_row_state:
            getattr(self.opt, k).index_copy_(0, at, state["optimizer"][k].index_select(0, src))
        for k in self.opt.scalar_state:
            setattr(self.opt, k, type(getattr(self.opt, k))(state["optimizer"][k]))
        slot = np.full(ids.shape[0], -1, dtype=np.int32)
        slot[mine] = slots
        cols["slot"][pos] = slot
        self.rows_live += slots.shape[0]

    def export(self) -> dict:
        """The rows, by id: {"ids", "weight"} (ids with no row are left out: they read as their
        initial values)."""
        live, ids = self._by_id()
        slot = self.map.columns["slot"][live].astype(np.int64)
        has = slot >= 0
        return {"ids": torch.from_numpy(ids[has]),
                "weight": self.weight.index_select(0, torch.from_numpy(slot[has]))}

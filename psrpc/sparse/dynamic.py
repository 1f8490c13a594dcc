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
  not trained on for `ttl_steps` steps; `lfu` keeps at most `max_rows` rows on this server, and
  when a round takes it past that, drops the least often seen (then the least recently, then the
  smallest id) down to `max_rows - max_rows // 16`, so the sort is paid once every many rounds;
  waiting counts are capped the same way. Each such pass halves the counts of the rows it keeps
  (TinyLFU's aging): ids that were popular long ago give way to today's. With `ttl` and admission every decision depends on
  one id's own history, so 1, 2 or 3 servers give the same bits; `lfu` compares ids that share
  a server.
"""

from __future__ import annotations

from typing import Optional

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
        self.map = IdMap({"count": torch.int32, "last": torch.int32, "slot": torch.int32})
        self.opt = build_sparse_optimizer(optimizer, torch.empty(0, spec.dim), **hyper)
        self.free = torch.empty(0, dtype=torch.int64)  # slots of evicted rows
        self.rows_live = self.rows_created = self.rows_evicted = 0

    @property
    def weight(self) -> torch.Tensor:
        return self.opt.weight

    def nbytes(self) -> int:
        state = sum(getattr(self.opt, k).nbytes for k in self.opt.per_row_state)
        return self.weight.nbytes + state + self.map.nbytes() + self.free.nbytes

    def initial(self, ids: torch.Tensor) -> torch.Tensor:
        return init_ids(ids, self.dim, self.seed, self.spec.init_scale)

    def _slots(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = self.map.find(ids)
        slot = self.map.columns["slot"][pos.clamp(min=0)].long()
        slot[pos < 0] = -1
        return pos, slot

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """(U, dim) values of the ids: their rows, or their initial values where they have none
        (nothing is created)."""
        _, slot = self._slots(ids)
        have = slot >= 0
        if bool(have.all()):
            return self.weight.index_select(0, slot)
        out = torch.empty(ids.numel(), self.dim)
        out[have] = self.weight.index_select(0, slot[have])
        out[~have] = self.initial(ids[~have])
        return out

    def apply(self, ids: torch.Tensor, grads: torch.Tensor, counts: torch.Tensor, step: int,
              lr: float) -> None:
        """One update: unique ids, their (summed) gradients and how many samples saw them, at
        global step `step`. Counts and recency first, then admission, then the optimizer on the
        rows that exist; then eviction. Every table is applied once per round, touched or not."""
        if ids.numel():
            pos, slot = self._slots(ids)
            new = pos < 0
            if bool(new.any()):
                pos[new] = self.map.insert(ids[new])
                self.map.columns["slot"][pos[new]] = -1
            cols = self.map.columns
            count = cols["count"][pos].long() + counts
            cols["count"][pos] = count.clamp_(max=2**31 - 1).int()
            cols["last"][pos] = step
            admit = (slot < 0) & (count >= self.admit_after)
            if bool(admit.any()):
                made = self._allocate(int(admit.sum()))
                self.weight[made] = self.initial(ids[admit])
                self.opt.reset_rows(made)
                cols["slot"][pos[admit]] = made.int()
                slot[admit] = made
                self.rows_created += made.numel()
                self.rows_live += made.numel()
            have = slot >= 0
            rows, order = slot[have].sort()
            self.opt.step(rows, grads[have][order], lr)
        else:
            self.opt.step(torch.empty(0, dtype=torch.int64), grads, lr)
        self._evict(step)

    def _allocate(self, n: int) -> torch.Tensor:
        """n free slots: from the free list, then from storage grown in chunks (never past
        max_rows plus what one round brings, with lfu)."""
        take = min(n, self.free.numel())
        slots = self.free[self.free.numel() - take:]
        self.free = self.free[:self.free.numel() - take]
        missing = n - take
        if missing:
            held = self.weight.shape[0]
            target = held + max(missing, CHUNK_ROWS, held // 2)
            if self.max_rows is not None:
                target = max(min(target, self.max_rows), held + missing)
            self.opt.resize(target)
            grown = torch.arange(held, target, dtype=torch.int64)
            slots = torch.cat([slots, grown[:missing]])
            self.free = torch.cat([grown[missing:].flip(0), self.free])
        return slots

    def _evict(self, step: int) -> None:
        if self.evict == "ttl" and self.ttl_steps > 0 and len(self.map):
            live = self.map.live()
            cold = live[(step - self.map.columns["last"][live].long()) >= self.ttl_steps]
            self._drop(cold)
        elif self.max_rows is not None and len(self.map) > self.max_rows:
            live = self.map.live()
            slot = self.map.columns["slot"][live]
            rows, waiting = live[slot >= 0], live[slot < 0]
            if rows.numel() > self.max_rows:
                self._drop(self._coldest(rows, rows.numel() - self.max_rows +
                                         self.max_rows // 16))
                kept = self.map.live()  # the rows kept: their counts age
                kept = kept[self.map.columns["slot"][kept] >= 0]
                self.map.columns["count"][kept] >>= 1
            if waiting.numel() > self.max_rows:
                self._drop(self._coldest(waiting, waiting.numel() - self.max_rows +
                                         self.max_rows // 16))

    def _coldest(self, positions: torch.Tensor, n: int) -> torch.Tensor:
        """The n positions seen least often, then least recently, then with the smallest id."""
        positions = positions[torch.argsort(self.map.keys[positions], stable=True)]
        cols = self.map.columns
        key = cols["count"][positions].long() << 32 | cols["last"][positions].long()
        return positions[torch.argsort(key, stable=True)[:n]]

    def _drop(self, positions: torch.Tensor) -> None:
        if not positions.numel():
            return
        slot = self.map.columns["slot"][positions].long()
        freed = slot[slot >= 0]
        self.free = torch.cat([self.free, freed])
        self.rows_live -= freed.numel()
        self.rows_evicted += freed.numel()
        self.map.remove(positions)

    # -- checkpoints and export -----------------------------------------------------------------
    def state(self) -> dict:
        """Everything the table holds, by id ascending (a copy): ids, their counts and last
        steps, which have rows; those rows' values and optimizer state; the counters."""
        live = self.map.live()
        ids, order = self.map.keys[live].sort()
        live = live[order]
        cols = self.map.columns
        slot = cols["slot"][live].long()
        has = slot >= 0
        rows = slot[has]
        opt = self.opt.state_dict()
        return {"ids": ids, "count": cols["count"][live].clone(), "last": cols["last"][live].clone(),
                "has_row": has, "weight": self.weight.index_select(0, rows),
                "optimizer": {k: (v.index_select(0, rows) if k in self.opt.per_row_state else v)
                              for k, v in opt.items()},
                "counters": {"rows_created": self.rows_created,
                             "rows_evicted": self.rows_evicted}}

    def load(self, state: dict, take: torch.Tensor) -> None:
        """Add the entries `take` (a bool mask over state["ids"]) of a `state()` to this table
        (ids it does not hold yet): a checkpoint restored, with any number of servers."""
        ids = state["ids"][take]
        if not ids.numel():
            return
        pos = self.map.insert(ids)
        cols = self.map.columns
        cols["count"][pos] = state["count"][take]
        cols["last"][pos] = state["last"][take]
        has = state["has_row"]
        row_of = torch.cumsum(has.long(), 0) - 1  # entry -> its row in state["weight"]
        mine = has[take]
        src = row_of[take][mine]
        slots = self._allocate(int(mine.sum()))
        self.weight[slots] = state["weight"].index_select(0, src)
        for k in self.opt.per_row_state:
            getattr(self.opt, k)[slots] = state["optimizer"][k].index_select(0, src)
        for k in self.opt.scalar_state:
            setattr(self.opt, k, type(getattr(self.opt, k))(state["optimizer"][k]))
        slot = torch.full((ids.numel(),), -1, dtype=torch.int32)
        slot[mine] = slots.int()
        cols["slot"][pos] = slot
        self.rows_live += slots.numel()

    def export(self) -> dict:
        """The rows, by id: {"ids", "weight"} (ids with no row are left out: they read as their
        initial values)."""
        live = self.map.live()
        slot = self.map.columns["slot"][live].long()
        has = slot >= 0
        ids, order = self.map.keys[live][has].sort()
        return {"ids": ids, "weight": self.weight.index_select(0, slot[has][order])}

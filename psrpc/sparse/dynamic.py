"""Dynamic tables' rows on one parameter server: a row per raw id, made when the id is first
trained on, dropped when it goes cold. Pure table math, no RPC (psrpc/ps/tables.py serves it).

- **Ids to rows.** One `IdMap` for every dynamic table of the server, from (table, id) to an
  entry, so that a step's lookups and updates of all tables are one batch of array operations:
  how often the id has been named (`count`), the step it was last trained on (`last`), and its
  row in storage (`slot`, -1 while the id is still waiting for admission). Each table's rows live
  in one storage tensor, its row optimizer's weight, grown in chunks; the slots of evicted rows
  go to a free list and are handed out first.
- **Initial values.** `init_ids(id)`: a hash of (table seed, id), the same on any server and at
  any time, so an id evicted and seen again starts over from the same values, and a lookup of
  an id with no row (evaluation, serving, an id not admitted yet) gives exactly that value.
- **Admission** (`admit_after=n`): an id gets a row once batches have named it n times in all
  (summed over workers); until then its gradients are dropped, as Monolith's and TFRA's
  frequency filters do. Counting is per id, exact: no sketch, whose collisions would make an
  id's fate depend on which other ids share its server.
- **Eviction**, after a round's update, never inside one: `ttl` drops every id (row or count)
  not trained on for `ttl_steps` steps (looked for every ttl_steps // 8 steps: an id goes
  between ttl_steps and 9/8 of it after its last training); `lfu` keeps at most `max_rows` rows
  of a table on this server, and when a round takes it past that, drops the least often named
  (then the least recently, then the smallest id) down to `max_rows - max_rows // 4`, so the
  pass is paid once every many rounds; waiting counts are capped the same way. Each such pass
  halves the counts of the rows it keeps (TinyLFU's aging): ids that were popular long ago give
  way to today's. With `ttl` and admission every decision depends on one id's own history, so
  1, 2 or 3 servers give the same bits; `lfu` compares ids that share a server.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from psrpc.sparse.idmap import LIVE, IdMap
from psrpc.sparse.optim import build_sparse_optimizer
from psrpc.sparse.rows import TableSpec, init_ids, init_ids_np, seed_offset

EVICTIONS = ("none", "ttl", "lfu")
CHUNK_ROWS = 4096  # storage grows by at least this many rows (or half of what it holds)
LOW_WATER = 4  # lfu: a pass evicts down to max_rows - max_rows // LOW_WATER


COLUMNS = {"count": np.int32, "last": np.int32, "slot": np.int32}


class TableRows:
    """One dynamic table's storage on this server: its row optimizer (whose weight is the rows),
    the free slots, and its counters."""

    def __init__(self, spec: TableSpec, seed: int, tag: int, optimizer: str, hyper: dict,
                 max_rows: Optional[int]):
        self.spec, self.seed, self.tag, self.dim = spec, seed, tag, spec.dim
        self.max_rows = max_rows
        self.opt = build_sparse_optimizer(optimizer, torch.empty(0, spec.dim), **hyper)
        self.opt.checked = False  # its rows are this table's own slots: unique, in range
        self.free = np.empty(0, dtype=np.int64)  # slots of evicted rows
        self.entries = 0  # ids in the map: with a row, or waiting for one
        self.rows_live = self.rows_created = self.rows_evicted = 0

    @property
    def weight(self) -> torch.Tensor:
        return self.opt.weight

    def initial(self, ids: torch.Tensor) -> torch.Tensor:
        return init_ids(ids, self.dim, self.seed, self.spec.init_scale)

    def values(self, slot: np.ndarray, initial: torch.Tensor) -> torch.Tensor:
        """(U, dim): the rows at `slot`; where slot is -1, the next of `initial`'s rows."""
        have = slot >= 0
        if have.all():
            return self.weight.index_select(0, torch.from_numpy(slot))
        out = torch.empty(slot.shape[0], self.dim)
        at = torch.from_numpy(np.flatnonzero(have))
        out.index_copy_(0, at, self.weight.index_select(0, torch.from_numpy(slot[have])))
        out.index_copy_(0, torch.from_numpy(np.flatnonzero(~have)), initial)
        return out

    def allocate(self, n: int) -> np.ndarray:
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

    def nbytes(self) -> int:
        state = sum(getattr(self.opt, k).nbytes for k in self.opt.per_row_state)
        return self.weight.nbytes + state + self.free.nbytes


class DynamicTables:
    """Every dynamic table of one server, under one admission and eviction policy."""

    def __init__(self, specs: list[TableSpec], seeds: dict[str, int], optimizer: str,
                 hyper: dict, admit_after: int = 1, evict: str = "none", ttl_steps: int = 0,
                 max_rows: Optional[int] = None):
        if evict not in EVICTIONS:
            raise ValueError(f"evict={evict!r}: must be one of {list(EVICTIONS)}")
        if evict == "lfu" and not max_rows:
            raise ValueError("evict='lfu' needs max_rows (the most rows a table keeps here)")
        self.admit_after, self.evict, self.ttl_steps = max(1, admit_after), evict, ttl_steps
        cap = max_rows if evict == "lfu" else None
        # ttl: the scan for cold ids runs every ttl_steps // 8 steps (every step below 16)
        self.ttl_every = max(1, ttl_steps // 8)
        self.map = IdMap(COLUMNS)
        self.tables = {s.name: TableRows(s, seeds[s.name], tag, optimizer, hyper, cap)
                       for tag, s in enumerate(specs)}
        self._by_tag = list(self.tables.values())
        # per tag, what the initialiser needs: the seed's offset and scale / 2^23
        self._offsets = np.array([seed_offset(t.seed) for t in self._by_tag], dtype=np.uint64)
        self._factors = np.array([t.spec.init_scale / (1 << 23) for t in self._by_tag],
                                 dtype=np.float32)
        self._dims = {t.dim for t in self._by_tag}
        # per worker, the positions its last lookup found, at the map's generation then: the ids
        # a worker asks ahead for are the ids it pushes next (sync), which need not be found again
        self._asked: dict[int, tuple[int, dict]] = {}

    def _initial(self, ids: np.ndarray, tags: np.ndarray) -> list[torch.Tensor]:
        """Initial values of ids of several tables, computed in one batch when the tables have
        one dim: one (n_t, dim) tensor per table, in tag order."""
        counts = np.bincount(tags, minlength=len(self._by_tag))
        if len(self._dims) == 1:
            dim = next(iter(self._dims))
            order = np.argsort(tags, kind="stable")  # by table, each table's ids as they came
            ids, tags = ids[order], tags[order]
            block = init_ids_np(ids, dim, self._offsets[tags], self._factors[tags])
            return list(block.split(counts.tolist()))
        return [t.initial(torch.from_numpy(ids[tags == t.tag])) for t in self._by_tag]

    def __getitem__(self, name: str) -> TableRows:
        return self.tables[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tables

    def __len__(self) -> int:
        return len(self.tables)

    def nbytes(self) -> int:
        return self.map.nbytes() + sum(t.nbytes() for t in self.tables.values())

    def _keys(self, items: list) -> tuple[np.ndarray, np.ndarray]:
        """[(table, ids), ...] -> the ids end to end, and each one's table tag."""
        ids = np.concatenate([i.numpy() for _, i in items])
        tags = np.concatenate([np.full(i.numel(), self.tables[n].tag, dtype=np.int16)
                               for n, i in items])
        return ids, tags

    def _slots(self, pos: np.ndarray) -> np.ndarray:
        slot = self.map.columns["slot"][pos].astype(np.int64)  # (pos -1: any; masked next)
        slot[pos < 0] = -1
        return slot

    def lookup(self, requests: dict[str, torch.Tensor],
               worker: Optional[int] = None) -> dict[str, torch.Tensor]:
        """{table: ids} -> {table: (U, dim) values}: their rows, or their initial values where
        they have none (nothing is created). With `worker`, the positions found are kept for
        `positions` (what that worker will push next)."""
        return self.lookup_many({worker: requests})[worker]

    def lookup_many(self, asks: dict) -> dict:
        """`lookup` of several workers' requests in one batch: {worker: {table: ids}} ->
        {worker: {table: values}} (a synchronous round answers every worker at once)."""
        segments = [(w, n, ids) for w, req in asks.items() for n, ids in req.items()]
        if not segments:
            return {w: {} for w in asks}
        ids, tags = self._keys([(n, i) for _, n, i in segments])
        pos = self.map.find(ids, tags)
        slot = self._slots(pos)
        missing = slot < 0
        initial = self._initial(ids[missing], tags[missing]) if missing.any() else None
        cursor = [0] * len(self._by_tag)  # how far into each table's block of initial values
        out, found, start = {w: {} for w in asks}, {w: {} for w in asks}, 0
        for w, name, req in segments:
            n, table = req.numel(), self.tables[name]
            part = slot[start:start + n]
            found[w][name] = (req, pos[start:start + n])
            k, at = int((part < 0).sum()), cursor[table.tag]
            cursor[table.tag] += k
            out[w][name] = table.values(part, initial[table.tag][at:at + k] if k else None)
            start += n
        for w in asks:
            if w is not None:
                self._asked[w] = (self.map.generation, found[w])
        return out

    def positions(self, worker: int, name: str, ids: torch.Tensor) -> Optional[np.ndarray]:
        """Where `worker`'s last lookup found these ids of table `name` (-1: absent), if the
        map has not changed since and they are the ids it looked up; else None."""
        generation, found = self._asked.get(worker, (None, {}))
        got = found.get(name)
        if generation != self.map.generation or got is None or not torch.equal(got[0], ids):
            return None
        return got[1]

    def apply(self, payload: dict, step: int, lr: float) -> None:
        """One update of every table: {table: (unique ids, their summed gradients, how many
        times the batches named each[, their `positions`])} at global step `step` (a table not
        in it is stepped with no rows).
        Counts and recency first, then admission, then each table's optimizer on the rows that
        exist; then eviction."""
        given = {n: p for n, p in payload.items() if p[0].numel()}
        if given:
            names = list(given)
            ids, tags = self._keys([(n, given[n][0]) for n in names])
            known = [given[n][3] if len(given[n]) > 3 else None for n in names]
            known = np.concatenate(known) if all(k is not None for k in known) else None
            pos, new = self.map.find_or_insert(ids, tags, known)
            if new.shape[0]:
                self.map.columns["slot"][pos[new]] = -1
                for tag, n in enumerate(np.bincount(tags[new], minlength=len(self._by_tag))):
                    self._by_tag[tag].entries += int(n)
            slot = self._slots(pos)
            cols = self.map.columns
            counts = np.concatenate([given[n][2].numpy() for n in names])
            count = np.minimum(cols["count"][pos] + counts, 2**31 - 1)
            cols["count"][pos] = count
            cols["last"][pos] = step
            admit = (slot < 0) & (count >= self.admit_after)
            initial = self._initial(ids[admit], tags[admit]) if admit.any() else None
            start = 0
            for name in names:
                n, table = given[name][0].numel(), self.tables[name]
                part = slice(start, start + n)
                self._step(table, given[name], pos[part], slot[part], admit[part],
                           initial[table.tag] if initial is not None else None, lr)
                start += n
        for name, table in self.tables.items():
            if name not in given:
                table.opt.step(torch.empty(0, dtype=torch.int64),
                               torch.empty(0, table.dim), lr)
        self._evict(step)

    def _step(self, table: TableRows, item: tuple, pos: np.ndarray, slot: np.ndarray,
              admit: np.ndarray, initial: Optional[torch.Tensor], lr: float) -> None:
        """One table: its admitted ids get rows (`initial`, fresh optimizer state), then its
        optimizer steps on every id that has a row."""
        grads = item[1]
        admit = np.flatnonzero(admit)
        if admit.shape[0]:
            made = table.allocate(admit.shape[0])
            made_t = torch.from_numpy(made)
            table.weight.index_copy_(0, made_t, initial)
            table.opt.reset_rows(made_t)
            self.map.columns["slot"][pos[admit]] = made
            slot[admit] = made
            table.rows_created += made.shape[0]
            table.rows_live += made.shape[0]
        have = np.flatnonzero(slot >= 0)
        order = np.argsort(slot[have], kind="stable")
        table.opt.step(torch.from_numpy(slot[have][order]),
                       grads.index_select(0, torch.from_numpy(have[order])), lr)

    # -- eviction ------------------------------------------------------------------------------
    def _evict(self, step: int) -> None:
        cols = self.map.columns
        if self.evict == "ttl" and self.ttl_steps > 0 and len(self.map) \
                and step % self.ttl_every == 0:
            live = self.map.live()
            self._drop(live[(step - cols["last"][live].astype(np.int64)) >= self.ttl_steps])
        elif self.evict == "lfu":
            due = [t for t in self._by_tag
                   if max(t.rows_live, t.entries - t.rows_live) > t.max_rows]
            if due:  # one scan of the map for every table due
                live = self.map.live()
                tags, slot = self.map.tags[live], cols["slot"][live]
                for table in due:
                    mine = tags == table.tag
                    self._lfu(table, live[mine & (slot >= 0)], live[mine & (slot < 0)])

    def _lfu(self, table: TableRows, rows: np.ndarray, waiting: np.ndarray) -> None:
        """A table's entries over its cap: the coldest rows out, the kept rows' counts halved;
        the same for the ids still waiting for a row."""
        cols, cap = self.map.columns, table.max_rows
        if rows.shape[0] > cap:
            self._drop(self._coldest(rows, rows.shape[0] - cap + cap // LOW_WATER))
            kept = rows[self.map.state[rows] == LIVE]  # the rows kept: their counts age
            cols["count"][kept] >>= 1
        if waiting.shape[0] > cap:
            self._drop(self._coldest(waiting, waiting.shape[0] - cap + cap // LOW_WATER))

    def _coldest(self, positions: np.ndarray, n: int) -> np.ndarray:
        """The n positions seen least often, then least recently, then with the smallest id:
        a partition on (count, last), O(len), and a sort of the ties at the boundary only."""
        cols = self.map.columns
        key = cols["count"][positions].astype(np.int64) << 32 | cols["last"][positions]
        kth = np.partition(key, n - 1)[n - 1]
        below = positions[key < kth]
        tied = positions[key == kth]
        tied = tied[np.argsort(self.map.keys[tied], kind="stable")[:n - below.shape[0]]]
        return np.concatenate([below, tied])

    def _drop(self, positions: np.ndarray) -> None:
        """Entries out of the map; the slots of those with rows back to their tables."""
        if not positions.shape[0]:
            return
        tags = self.map.tags[positions]
        slot = self.map.columns["slot"][positions].astype(np.int64)
        for table in self._by_tag:
            mine = tags == table.tag
            if not mine.any():
                continue
            freed = slot[mine & (slot >= 0)]
            table.free = np.concatenate([table.free, freed])
            table.entries -= int(mine.sum())
            table.rows_live -= freed.shape[0]
            table.rows_evicted += freed.shape[0]
        self.map.remove(positions)

    # -- checkpoints and export ------------------------------------------------------------------
    def _by_id(self, table: TableRows) -> tuple[np.ndarray, np.ndarray]:
        """A table's entries: positions and ids, by id ascending."""
        live = self.map.live()
        live = live[self.map.tags[live] == table.tag]
        keys = self.map.keys[live]
        order = np.argsort(keys, kind="stable")
        return live[order], keys[order]

    def state(self, name: str) -> dict:
        """Everything a table holds, by id ascending (a copy): ids, their counts and last
        steps, which have rows; those rows' values and optimizer state; the counters."""
        table = self.tables[name]
        live, ids = self._by_id(table)
        cols = self.map.columns
        slot = cols["slot"][live].astype(np.int64)
        has = slot >= 0
        rows = torch.from_numpy(slot[has])
        opt = table.opt.state_dict()
        return {"ids": torch.from_numpy(ids), "count": torch.from_numpy(cols["count"][live]),
                "last": torch.from_numpy(cols["last"][live]), "has_row": torch.from_numpy(has),
                "weight": table.weight.index_select(0, rows),
                "optimizer": {k: (v.index_select(0, rows) if k in table.opt.per_row_state
                                  else v) for k, v in opt.items()},
                "counters": {"rows_created": table.rows_created,
                             "rows_evicted": table.rows_evicted}}

    def load(self, name: str, state: dict, take: torch.Tensor) -> None:
        """Add the entries `take` (a bool mask over state["ids"]) of a `state()` to a table
        (ids it does not hold yet): a checkpoint restored, with any number of servers."""
        table = self.tables[name]
        self.set_scalars(name, state["optimizer"])  # (a server given none of its ids too)
        take = take.numpy()
        ids = state["ids"].numpy()[take]
        if not ids.shape[0]:
            return
        pos = self.map.insert(ids, np.full(ids.shape[0], table.tag, dtype=np.int16))
        cols = self.map.columns
        cols["count"][pos] = state["count"].numpy()[take]
        cols["last"][pos] = state["last"].numpy()[take]
        has = state["has_row"].numpy()
        row_of = np.cumsum(has) - 1  # entry -> its row in state["weight"]
        mine = has[take]
        src = torch.from_numpy(row_of[take][mine])
        slots = table.allocate(int(mine.sum()))
        at = torch.from_numpy(slots)
        table.weight.index_copy_(0, at, state["weight"].index_select(0, src))
        for k in table.opt.per_row_state:
            getattr(table.opt, k).index_copy_(0, at,
                                              state["optimizer"][k].index_select(0, src))
        slot = np.full(ids.shape[0], -1, dtype=np.int32)
        slot[mine] = slots
        cols["slot"][pos] = slot
        table.rows_live += slots.shape[0]
        table.entries += ids.shape[0]

    def set_scalars(self, name: str, optimizer_state: dict) -> None:
        """A table's optimizer scalars (lazy Adam's step count) from a `state()`."""
        opt = self.tables[name].opt
        for k in opt.scalar_state:
            setattr(opt, k, type(getattr(opt, k))(optimizer_state[k]))

    def export(self, name: str) -> dict:
        """A table's rows, by id: {"ids", "weight"} (ids with no row are left out: they read
        as their initial values)."""
        table = self.tables[name]
        live, ids = self._by_id(table)
        slot = self.map.columns["slot"][live].astype(np.int64)
        has = slot >= 0
        return {"ids": torch.from_numpy(ids[has]),
                "weight": table.weight.index_select(0, torch.from_numpy(slot[has]))}

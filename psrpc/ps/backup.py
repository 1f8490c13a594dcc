"""What a shard does as a backup, or to make one (cluster.ps_replicas; psrpc/ps/replicas.py has
the replication itself): `Replicated`, mixed into every Shard, `ReplicatedRows`, into a table
shard, and the backup's `Backlog`."""

from __future__ import annotations

import logging
import math
import threading
from typing import Optional

import torch

from psrpc.cluster import shm, sidechannel
from psrpc.errors import PsrpcError
from psrpc.ps import ring
from psrpc.ps.replicas import Journal, Update, digest_of, fence_copy, replayed, unfence
from psrpc.ps.snapshots import ShardSnapshots

log = logging.getLogger(__name__)


class Backlog:
    """On a backup: its primary's updates, taken as soon as they are held here (acknowledged,
    over TensorPipe: the primary's reply then waits for a message, not for the backup's
    optimizer step) and applied in their order: by the thread that took them where none is
    applying and it may (a side channel's reader), else by a thread of its own. At most WINDOW
    updates are held unapplied: past that, `take`'s Future waits, and with it the acknowledgement or
    the side channel's reader (a backup that falls behind slows its primary, not its
    memory)."""

    WINDOW = 4

    def __init__(self, shard):
        self.shard = shard
        self.applied = 0  # the seq of the last update applied
        self.base = 0  # the seq it was copied at (0: built from the spec, as its primary was)
        self._origins: list[tuple[int, str]] = []  # (first seq, the primary that sent it on)
        self._held: dict[int, Update] = {}
        self._waiting: list[tuple[int, torch.futures.Future]] = []
        self._cv = threading.Condition()
        self._closed = False
        self._busy = False  # a thread is applying updates
        self._thread: Optional[threading.Thread] = None

    def take(self, updates: list, inline: bool = True) -> torch.futures.Future:
        """Hold `updates`; `inline`: the next in order is applied in this thread where none is
        applying (a side channel's reader, which runs a message to its end before reading on: no
        thread woken per update). The Future completes once at most WINDOW are unapplied."""
        fut = torch.futures.Future()
        with self._cv:
            clash = next(filter(None, map(self._clash, updates)), None)
            if clash is not None:  # (never held: the primary gives this copy up)
                log.error("%s", clash)
                fut.set_exception(PsrpcError(clash))
                return fut
            for u in updates:
                if u.seq > self.applied:
                    self._held[u.seq] = u
            inline = not self._busy and self.applied + 1 in self._held and inline
            if inline:
                self._busy = True
            due = max((u.seq for u in updates), default=0) - self.WINDOW
            wait = due > self.applied  # (then completed by whoever applies up to `due`)
            if wait:
                self._waiting.append((due, fut))
            if self._thread is None and not inline:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"psrpc-backup-{self.shard.index}")
                self._thread.start()
            self._cv.notify_all()
        if inline:
            self._apply_held()
        if not wait:
            fut.set_result(True)
        return fut

    def _clash(self, u: Update) -> Optional[str]:
        """Under the lock: why `u` must be refused (its number held or applied already, from
        another primary: two histories of one shard), or None."""
        held = self._held.get(u.seq)
        if held is not None:
            other = held.origin
        elif u.seq <= self.applied:
            other = next((o for first, o in reversed(self._origins) if first <= u.seq), None)
        else:
            return None
        if other is None or other == u.origin:  # (older than its copy; sent again)
            return None
        return (f"{self.shard.name}: refused update {u.seq} from primary {u.origin}: this backup "
                f"has update {u.seq} from primary {other} (two histories of one shard)")

    def _apply_held(self) -> None:
        """Apply the updates held in order from the next (`_busy` set by the caller)."""
        while True:
            with self._cv:
                u = None if self._closed else self._held.pop(self.applied + 1, None)
                if u is None:
                    self._busy = False
                    self._cv.notify_all()
                    return
            self.shard.apply_update(u)
            with self._cv:
                self.applied = u.seq
                if not self._origins or self._origins[-1][1] != u.origin:
                    self._origins.append((u.seq, u.origin))
                ready = [f for t, f in self._waiting if t <= u.seq]
                self._waiting = [(t, f) for t, f in self._waiting if t > u.seq]
            for f in ready:
                f.set_result(True)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (self._busy or self.applied + 1 not in self._held):
                    self._cv.wait()
                if self._closed:
                    return
                self._busy = True
            self._apply_held()

    def drain(self, timeout_s: float = 60.0) -> None:
        """Until every update held in order is applied (a promotion, a digest)."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._closed or (
                    not self._busy and self.applied + 1 not in self._held), timeout_s):
                raise PsrpcError(f"{self.shard.name}: its backup did not apply the updates it "
                                 f"holds within {timeout_s:g} s")

    def close(self) -> None:
        with self._cv:
            self._closed = True
            waiting, self._waiting = self._waiting, []
            self._cv.notify_all()
        for _, f in waiting:
            f.set_result(True)



class Replicated:
    """Mixed into Shard: uses its lock, version, stats, losses, snapshots and spec."""

    def digest(self) -> str:
        """A digest of its state (what a checkpoint of it holds but the counters): a backup's
        equals its primary's."""
        if self.backlog is not None:
            sidechannel.settle()  # (updates still in its socket)
            self.backlog.drain()
        with self.lock:
            state = self._snapshot(self.version)
        state.pop("stats")  # (a stale push after the last update counts on the primary only)
        return digest_of(state)

    def stats_dict(self) -> dict:
        """A copy of the counters (scalars and two dicts of them: no deep copy needed)."""
        out = dict(vars(self.stats))
        out.update(per_worker_applied=dict(out["per_worker_applied"]),
                   per_worker_stale=dict(out["per_worker_stale"]), short=dict(out["short"]))
        return out

    def replicate_to(self, backups: list[str], channels: Optional[dict] = None) -> None:
        """A primary: send every update from now on to the backups on these PS (through
        `channels`, {PS: side channel}, where given)."""
        with self.lock:
            j = self._journal()
            backups = [b for b in backups if b not in j.copying and b not in j.dropped]
            for b in set(backups) - set(j.live):
                j.name(b)
            j.live = backups
            j.channels.update(channels or {})

    def _journal(self) -> Journal:
        """Under the lock: this primary's Journal, made on first use (an update to a backup
        being copied may wait for the copy: as long as a round's wait plus a minute, as the
        workers' calls default to)."""
        if self.journal is None:
            self.journal = Journal(self, [], float(self.spec.update.timeout_s) + 60.0)
        return self.journal

    def replay(self, updates: list, inline: bool = True) -> torch.futures.Future:
        """A backup: its primary's updates, acknowledged once held here (Backlog). Over
        TensorPipe (`inline` False) the acknowledgement does not wait for the optimizer step."""
        return self.backlog.take(updates, inline)

    COPY_NUMEL = 1 << 16  # a dense shard up to this size sends its values (`replica_ops`)

    def replica_ops(self, ops: list) -> list:
        """Under the lock, once `ops` are applied: what a backup gets to reach the same state.
        A small dense shard's new values and optimizer state, copied there (a few copies, where
        running the optimizer costs a fraction of a millisecond of Python on both PS, and the
        bytes hardly count); a larger one's averaged gradients, for the same optimizer steps
        (3x fewer bytes with Adam; the arithmetic is then what costs, either way)."""
        if not ops or not self.copies_values():
            return replayed(ops)
        state = self.optimizer.state.get(self.params, {})
        return [("values", self.params.detach().clone(),
                 {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()})]

    def copies_values(self) -> bool:
        """Whether its backups copy what an update changed (else they replay the update)."""
        return self.params.numel() <= self.COPY_NUMEL

    def sends_oneway(self) -> bool:
        """Whether its updates go to a backup on this host through the side channel with no
        reply: a small shard's values (under a megabyte), or a large one's gradients where it
        shares memory with workers (the gradient in a ring, psrpc/ps/ring.py). Else over
        TensorPipe (tens of MB: TensorPipe copies them once, the socket thrice)."""
        return self.copies_values() or self.ring_run() is not None

    def ring_run(self) -> Optional[str]:
        """The run whose shared memory a ring to a backup here would be made in, if any."""
        return self.spec.shm[1] if self.spec.shm is not None else None

    def load_values(self, op: tuple) -> None:
        """A backup: the values `replica_ops` sent."""
        _, params, state = op
        with shm.writing(self.seq):
            self.params.copy_(params)
        if not state:  # (no step yet, or no parameters: the clock shard of update.dense=
            return  # allreduce; an entry made here would differ from the primary's state)
        mine = self.optimizer.state[self.params]
        for k, v in state.items():
            held = mine.get(k)
            if torch.is_tensor(v) and torch.is_tensor(held) and held.shape == v.shape \
                    and held.dtype == v.dtype:
                held.copy_(v)
            else:
                mine[k] = v.clone() if torch.is_tensor(v) else v

    def apply_update(self, u) -> None:
        """A backup: one of its primary's updates (replicas.Update), in its order."""
        with self.lock:
            for op in u.ops:
                if op[0] == "step":
                    self.step_optimizer(ring.read(op[1]) if isinstance(op[1], ring.InRing)
                                        else op[1], op[2])
                elif op[0] == "count":
                    self.count_step()
                else:
                    self.load_values(op)
            self.version, self.max_steps = u.version, u.max_steps
            self.stats = type(self.stats)(**u.stats)
            self.losses.clear()
            self.losses.extend(u.losses)
        ring.applied(u.ops, u.seq)

    def load_state(self, state: dict, seq: int) -> None:
        """A backup built from a copy of its primary (`_snapshot`'s form) after update `seq`."""
        with self.lock:
            with shm.writing(self.seq):
                self.params.copy_(state["params"])
            self.optimizer.load_state_dict(state["optimizer"])
            self._load_common(state, seq)

    def _load_common(self, state: dict, seq: int) -> None:
        self.version = state["version"]
        self.backlog.applied = self.backlog.base = seq
        self.stats = type(self.stats)(**state["stats"])
        self.max_steps = state.get("max_steps", self.max_steps)
        self.losses.clear()
        self.losses.extend(state.get("losses", []))

    def start_copy(self, ps: str) -> tuple:
        """A primary: (spec, state, seq) for a new backup on `ps`, taken under the lock; from
        now on every update goes to `ps` too (not waited for until `copy_done`). The copy is
        fenced until then: replies do not wait for it, so it may lack what workers saw."""
        with self.lock:
            j = self._journal()
            state = self._snapshot(self.version)
            state.update(max_steps=self.max_steps, losses=list(self.losses))
            for names in (j.live, j.copying):
                if ps in names:
                    names.remove(ps)
            j.copying.append(ps)
            j.dropped.discard(ps)
            j.name(ps)
            fence_copy(self.index, ps, j.seq)
            return self.spec, state, j.seq

    def copy_done(self, ps: str, seq: int, channels: Optional[dict] = None) -> None:
        """The backup on `ps` (copied at update `seq`) is built: replies wait for it from the
        next update on, and once it holds every update sent during the copy its fence is
        lifted (not waited for here: an RPC thread held would be one fewer for the pushes;
        a copy that missed one of them was given up, and stays fenced)."""
        with self.lock:
            j = self.journal
            if ps not in j.copying:
                return
            j.copying.remove(ps)
            j.live.append(ps)
            j.channels.update(channels or {})
            sent = j.sent_to_copy.pop(ps, [])

        def lift(held) -> None:  # (each Future True once the copy holds its update)
            if all(f.value() for f in held.value()):
                unfence(self.index, ps, seq)
        torch.futures.collect_all(sent).then(lift)

    def copy_failed(self, ps: str) -> None:
        with self.lock:
            self.journal.sent_to_copy.pop(ps, None)
            if ps in self.journal.copying:
                self.journal.copying.remove(ps)

    def become_primary(self, name: str) -> None:
        """A backup whose primary was lost: it serves the shard from now on, writes its
        checkpoints and, once the chief names them, replicates to new backups."""
        self.backlog.drain()
        self.backlog.close()
        ring.forget(self.index)
        with self.lock:
            self.backup, self.name = False, name
            self.snapshots = ShardSnapshots(name, self.spec.checkpoint_dir,
                                            self.spec.checkpoint_every, self._snapshot)
            self._journal().seq, self.backlog = self.backlog.applied, None


class ReplicatedRows:
    """Mixed into TableShard before Shard: a fixed table's backups copy the rows an update
    changed (uses its weights, row optimizers and dynamic tables)."""

    def replica_ops(self, ops: list) -> list:
        """Under the lock, once `ops` are applied: the rows they changed in each table, with
        their optimizer state, and every table's step counters, for a backup to copy (the same
        bytes as the row gradients with a row-wise optimizer, and no optimizer run there). With
        dynamic tables (an id map, admissions, evictions to follow): the ops, replayed."""
        if not ops or not self.copies_values():
            return replayed(ops)
        touched: dict[str, list] = {}
        for op in ops:
            if op[0] == "step":
                for name, item in op[1].items():
                    touched.setdefault(name, []).append(item[0])
        rows, copied = {}, []  # copied: (table, state name or None for the weight, tensor)
        for name, opt in self.row_optim.items():
            parts = touched.get(name) or [torch.empty(0, dtype=torch.int64)]
            # one step's rows are unique and ascending already; several steps' need merging
            rows[name] = parts[0] if len(parts) == 1 else torch.unique(torch.cat(parts))
            copied += [(name, None, self.weights[name])] + [
                (name, k, getattr(opt, k)) for k in opt.per_row_state]
        # Packed: the rows' values in one tensor per dtype, whatever the tables and states (a
        # message's cost is mostly per tensor pickled, not per byte)
        layout, at = [], {}  # layout: (table, state, dtype, offset, shape); at: dtype -> size
        for name, key, t in copied:
            shape = (rows[name].numel(),) + tuple(t.shape[1:])
            layout.append((name, key, t.dtype, at.get(t.dtype, 0), shape))
            at[t.dtype] = at.get(t.dtype, 0) + math.prod(shape)
        packed = {dt: torch.empty(n, dtype=dt) for dt, n in at.items()}
        for (name, _, t), (_, _, dt, offset, shape) in zip(copied, layout):
            torch.index_select(t, 0, rows[name],
                               out=packed[dt][offset:offset + math.prod(shape)].view(shape))
        scalars = {name: {k: getattr(opt, k) for k in opt.scalar_state}
                   for name, opt in self.row_optim.items()}
        return [("rows", list(rows), [r.numel() for r in rows.values()],
                 torch.cat(list(rows.values())), packed, layout, scalars)]

    def copies_values(self) -> bool:
        return not self.dynamic

    def sends_oneway(self) -> bool:
        return True  # (a round's rows: the socket's, at any batch size)

    def ring_run(self) -> Optional[str]:
        return None

    def load_values(self, op: tuple) -> None:
        """A backup: the rows `replica_ops` sent."""
        _, names, counts, ids, packed, layout, scalars = op
        rows = dict(zip(names, ids.split(counts)))
        for name, key, dtype, at, shape in layout:
            into = self.weights[name] if key is None else getattr(self.row_optim[name], key)
            into.index_copy_(0, rows[name], packed[dtype][at:at + math.prod(shape)].view(shape))
        for name, values in scalars.items():
            for k, v in values.items():
                setattr(self.row_optim[name], k, v)

"""A worker's client of the table shards: pull the rows a batch needs, push their gradients.

Rows are asked of the servers that own them (the partition says which), one RPC per server
carrying every table, all in flight at once. A push goes to every server every step, with an
empty payload where the batch touched none of its rows: each table shard counts global steps
like the dense shards, so a sync round closes on all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from psrpc.cluster import comm, shm
from psrpc.errors import PsrpcError, first_line
from psrpc.sparse.rows import TableSpec, partition_of


@dataclass
class RowPush:
    """One push_async's arguments, kept to push the very same message again (a replay after a
    failover)."""

    grads: dict[str, tuple[torch.Tensor, torch.Tensor]]
    versions: list[int]
    loss: float
    samples: int
    ticket: Optional[int]
    void: bool
    ahead: Optional[dict[str, torch.Tensor]]


class RowClient:
    def __init__(self, shards: list, specs: list[TableSpec], partition: str, worker: int,
                 timeout_s: Optional[float] = None, stats=None, lag: int = 0,
                 channels: Optional[list] = None):
        self.shards, self.worker, self.timeout_s = shards, worker, timeout_s
        self.last: Optional[RowPush] = None  # the last push_async's (what a replay pushes again)
        # per server: the side channel its pushes take (a PS on this host), or None: TensorPipe
        self.channels = channels or [None] * len(shards)
        # lag 1: the rows asked with a push are those of the batch after next, and the ones
        # its reply brings wait through the next step's forward (pulls ahead of time, `run` in
        # psrpc/worker/data_parallel.py)
        self.lag = lag
        self.stats = stats  # WorkerStats: rows and bytes on the wire
        self.specs = {s.name: s for s in specs}
        self.partitions = {s.name: partition_of(s, len(shards), partition) for s in specs}
        self._asked: Optional[tuple] = None  # the rows asked ahead with the last push
        self._ahead: Optional[tuple] = None  # ({table: rows}, {table: values}) they brought
        self._riders: dict[int, tuple] = {}  # server -> a call to send with its next push

    def _split(self, rows: dict[str, torch.Tensor]) -> list[dict[str, tuple]]:
        """Per server: {table: (positions in rows[table], local rows)}; positions None: all
        of them, in order (one server holds every row, at its global index)."""
        one = len(self.shards) == 1  # (no gather or scatter by positions then)
        per = [dict() for _ in self.shards]
        for name, r in rows.items():
            for k, (pos, local) in enumerate(self.partitions[name].split(r)):
                if pos.numel():
                    per[k][name] = (None if one else pos, local)
        return per

    def pull(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{table: unique global rows} -> {table: their current values, (U, dim)}: the values
        the last push's replies brought when they are these rows, else asked for now."""
        if self._ahead is not None:
            want, values = self._ahead
            if want.keys() == rows.keys() and all(torch.equal(want[n], r)
                                                  for n, r in rows.items()):
                self._ahead = None
                return values
        per = self._split(rows)
        asked = [(k, comm.invoke(self.shards[k], "pull_rows",
                                 {n: local for n, (_, local) in parts.items()},
                                 timeout_s=self.timeout_s))
                 for k, parts in enumerate(per) if parts]
        if torch.is_grad_enabled():  # training's traffic (an evaluation's lookups are apart)
            self._count("pulled", rows.items())
            if self.stats is not None:
                self.stats.table_rpcs += len(asked)
        out = {n: torch.empty(r.numel(), self.specs[n].dim) for n, r in rows.items()}
        for k, fut in asked:
            try:
                got = fut.wait()
            except Exception as e:
                raise PsrpcError(f"worker{self.worker}: pulling rows from "
                                 f"{comm.owner_name(self.shards[k])} failed: "
                                 f"{first_line(e)}") from e
            for name, (pos, _) in per[k].items():
                if pos is None:
                    out[name] = got[name]
                else:
                    out[name][pos] = got[name]
        return out

    def pull_versions(self) -> list:
        """Every table shard's Reply (its version), as a first pull."""
        return comm.wait_all([comm.invoke(r, "pull", timeout_s=self.timeout_s)
                              for r in self.shards])

    def push_again(self) -> list:
        """The last push_async's message, again (Futures of the Replies, in server order)."""
        p = self.last
        return self.push_async(p.grads, p.versions, p.loss, p.samples, p.ticket, p.void, p.ahead)

    def push_async(self, grads: dict[str, tuple[torch.Tensor, torch.Tensor]],
                   versions: list[int], loss: float, samples: int,
                   ticket: Optional[int] = None, void: bool = False,
                   ahead: Optional[dict[str, torch.Tensor]] = None) -> list:
        """{table: (unique global rows, (U, dim) gradients)} to every server: Futures of the
        Replies, in server order. `void`: the gradients were computed across an update
        (shm.VOID: each server discards them). `ahead`: {table: unique global rows} of the next
        batch, whose values the replies bring (`receive`), for the next `pull`."""
        self.last = RowPush(grads, versions, loss, samples, ticket, void, ahead)
        per = self._split({n: g[0] for n, g in grads.items()})
        if not void:
            self._count("pushed", ((n, g[0]) for n, g in grads.items()))
        if self.stats is not None:
            self.stats.table_rpcs += len(per)
        split = self._split(ahead) if ahead else None
        self._asked = (ahead, split) if split else None
        if not self.lag:  # (with lag 1 the last reply's rows are for the step after this one)
            self._ahead = None
        futures = []
        riders, self._riders = self._riders, {}
        for k, parts in enumerate(per):
            payload = (shm.VOID if void else  # (a dynamic table's counts too)
                       {n: (local, *(g if pos is None else g[pos] for g in grads[n][1:]))
                        for n, (pos, local) in parts.items()})
            args = (self.worker, versions[k], payload, loss, samples, ticket)
            if split is None:
                call = (self.shards[k], "push_pull", args)
            else:
                asked = {n: local for n, (_, local) in split[k].items()}
                call = (self.shards[k], "push_pull_rows", args + (asked,))
            calls = [riders[k][:3], call] if k in riders else [call]
            if (channel := self.channels[k]) is not None:
                before = channel.messages
                sent = channel.invoke_many(calls, self.timeout_s)
                if self.stats is not None:  # (not a large message: that went over TensorPipe)
                    self.stats.side_channel += channel.messages - before
            elif k in riders:
                sent = comm.invoke_many(calls, self.timeout_s)
            else:  # (one call: no list around its result)
                futures.append(comm.invoke(call[0], call[1], *call[2], timeout_s=self.timeout_s))
                continue
            futures.append(_results(sent, riders[k][3] if k in riders else None))
        return futures

    def hand_over(self, grads: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """{table: (unique global rows, sums)} a row cache still held when training ended, to
        every server (empty where none of its rows: each waits for every worker's); returns
        once each has taken them (TableShard.take_held)."""
        per = self._split({n: g[0] for n, g in grads.items()})
        self._count("pushed", ((n, g[0]) for n, g in grads.items()))
        futures = [comm.invoke(self.shards[k], "take_held", self.worker,
                               {n: (local, grads[n][1] if pos is None else grads[n][1][pos])
                                for n, (pos, local) in parts.items()},
                               timeout_s=self.timeout_s) for k, parts in enumerate(per)]
        for k, fut in enumerate(futures):
            try:
                fut.wait()
            except Exception as e:
                raise PsrpcError(f"worker{self.worker}: handing the held row gradients to "
                                 f"{comm.owner_name(self.shards[k])} failed: "
                                 f"{first_line(e)}") from e

    def ride(self, k: int, target, method: str, args: tuple) -> torch.futures.Future:
        """A call to another object of server k's PS (the clock shard) that goes in the same
        message as the next push to server k; the Future of its result."""
        rider = torch.futures.Future()
        self._riders[k] = (target, method, args, rider)
        return rider

    def receive(self, replies: list) -> None:
        """The push's Replies: the rows asked ahead, when every server brought them at one
        version (with backup workers a server can have moved on: then the next pull asks)."""
        asked, self._asked = self._asked, None
        if asked is None or any(r.rows is None for r in replies) \
                or len({r.version for r in replies}) != 1:
            return
        rows, split = asked
        if len(replies) == 1:  # every row from the one server, in order
            values = dict(replies[0].rows)
            values.update({n: torch.empty(0, self.specs[n].dim) for n in rows
                           if n not in values})
        else:
            values = {n: torch.empty(r.numel(), self.specs[n].dim) for n, r in rows.items()}
            for k, reply in enumerate(replies):
                for name, (pos, _) in split[k].items():
                    values[name][pos] = reply.rows[name]
        self._count("pulled", rows.items())
        self._ahead = (rows, values)

    def take_ahead(self) -> Optional[tuple]:
        """The rows the last reply brought ahead and their values (a row cache takes them at
        once), or None."""
        got, self._ahead = self._ahead, None
        return got

    def _count(self, what: str, rows) -> None:
        """Rows pulled or pushed, and their bytes: an int64 id and dim float32 values each."""
        if self.stats is None:
            return
        n = b = 0
        for name, r in rows:
            n += r.numel()
            b += r.numel() * (8 + 4 * self.specs[name].dim)
        setattr(self.stats, f"rows_{what}", getattr(self.stats, f"rows_{what}") + n)
        self.stats.sparse_bytes += b


def _results(sent: torch.futures.Future, rider: Optional[torch.futures.Future]):
    """The Future of a message's last result; the rider's result (the first), when there is
    one, completes its own Future."""
    def split(f):
        try:
            results = f.wait()
        except Exception as e:
            if rider is not None:
                rider.set_exception(e)
            raise
        if rider is not None:
            rider.set_result(results[0])
        return results[-1]

    return sent.then(split)

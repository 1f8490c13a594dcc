"""Shard replicas (`cluster.ps_replicas=k`): every shard also lives on k further PS, as backups
kept bit for bit equal to it, so a lost PS loses nothing.

Replication happens after aggregation, as in the OSDI 2014 parameter server: the primary sends
each applied update (a sync round's averaged gradient, an async push as it was applied, a step
passed without an update) to its backups, in its own order, not each worker's push; a backup
applies the same optimizer step at the same version, so its state equals the primary's. A push
is answered only once every live backup holds the update it brought (`Journal.gate`): whatever
a worker has seen, a backup holds. A backup on the primary's host holds it once it is in the
backup's socket (the side channel's messages with no reply: the kernel keeps them for the
backup when the primary dies, and a promotion reads them first); one elsewhere, once it
acknowledged the update over TensorPipe.

On the primary (`Journal`, under the shard's lock): `record` notes each optimizer step or
counted step, `commit` sends the update when the version moves. On a backup's PS (`apply`,
`Backlog`): an update is acknowledged once held, and applied in the primary's order, by the side
channel's reader that brought it or by a thread of the backup (several RPC threads may deliver
them out of order; one that comes early waits for its predecessors); a promotion first applies
every update held. A backup that is being created while training goes
on (a PS that came back, `copy_to`) gets the primary's state at some version and, meanwhile, the
updates after it, which wait until it exists: the pre-copy, then what changed during it.

When the primary's PS dies, the chief promotes a backup in the next membership epoch
(`promote`): the plan points the shard's Handle at it, nothing is rolled back (docs/replicas.md).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from psrpc.cluster import comm, sidechannel
from psrpc.errors import PsrpcError, first_line
from psrpc.ps.ring import Ring, ringed

log = logging.getLogger(__name__)

BACKUP = 1 << 24  # a backup of shard g is registered under BACKUP + g on its PS


def backup_key(index: int) -> int:
    return BACKUP + index


@dataclass
class Update:
    """One applied update, as a backup replays it: the operations that brought the primary to
    `version` (("step", payload, lr_scale) or ("count",); from `version - 1`, or at `version`
    for the row gradients the workers' caches hand over at the end), or what they changed, to
    be copied (a small dense shard's values and optimizer state, a fixed table's rows: see
    `replica_ops`), and the counters, recent losses and last step the primary had after it."""

    index: int
    seq: int  # the primary's count of updates sent: a backup applies them in this order
    version: int
    ops: list
    stats: dict
    losses: list
    max_steps: int


def replayed(ops: list) -> list:
    """The ops themselves, for a backup to run the same optimizer steps."""
    return [(op[0], _portable(op[1]), op[2]) if op[0] == "step" else op for op in ops]


def _portable(payload: Any) -> Any:
    """What a backup needs of an update's payload: a dynamic table's positions in the primary's
    id map (a 4th item) mean nothing in another map, which finds them itself."""
    if isinstance(payload, dict):
        return {n: tuple(p[:3]) if len(p) > 3 else p for n, p in payload.items()}
    return payload


def _cloned(x: Any) -> Any:
    """`x` with a copy of every tensor in it (through dataclasses, dicts, lists, tuples)."""
    if torch.is_tensor(x):
        return x.clone()
    if isinstance(x, Update):
        return Update(x.index, x.seq, x.version, _cloned(x.ops), x.stats, x.losses, x.max_steps)
    if isinstance(x, dict):
        return {k: _cloned(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_cloned(v) for v in x)
    return x


class Journal:
    """On a primary: where its backups are and which of their acknowledgements a reply waits
    for. Every method but `gate` runs under the shard's lock."""

    def __init__(self, shard, backups: list[str], timeout_s: float):
        self.shard, self.timeout_s = shard, timeout_s
        self.live: list[str] = list(backups)  # PS names whose backup is in step
        self.copying: list[str] = []  # being created from a copy: not waited for yet
        self._ops: list = []
        self._acks: dict[int, torch.futures.Future] = {}  # version -> all live backups have it
        self.seq = 0  # updates sent (a backup built from a copy starts at the copy's)
        self.channels: dict = {}  # PS name -> side channel (psrpc/cluster/sidechannel.py)
        self.rings: dict[str, Optional[Ring]] = {}  # PS name -> ring (psrpc/ps/ring.py)
        self.in_rings = 0  # updates whose gradient went through a ring
        self.tokens: dict[str, int] = {}  # PS name -> which backup there (see `name`)
        self.dropped: set[str] = set()  # PS whose backup missed an update: only a new copy
        # there is one again (it would wait for that update for ever)

    @property
    def targets(self) -> list[str]:
        return self.live + self.copying

    def record(self, *op) -> None:
        self._ops.append(op)

    def commit(self, version: int) -> None:
        """The version has just moved to `version`: send what brought it there to every
        backup. A backup that does not answer is given up (a warning; the next membership
        epoch replaces it): training never waits for a dead one."""
        ops, self._ops = self._ops, []
        if not self.targets:
            self.seq += 1  # (counted all the same: a copy taken now starts from here)
            return
        shard = self.shard
        self.seq += 1
        update = Update(shard.index, self.seq, version, shard.replica_ops(ops),
                        shard.stats_dict(), list(shard.losses), shard.max_steps)
        waited, held = [], None
        for ps in self.targets:
            token = self.tokens.get(ps, 0)
            channel = self.channels.get(ps) if ps in self.live else None
            if channel is not None and shard.sends_oneway():  # a PS on this host: its Unix
                # socket, and held there once sent (SideChannel.send): no reply. A large
                # shard's gradient waits in a ring (psrpc/ps/ring.py), the message naming it.
                try:
                    sent = update if shard.copies_values() else replace(
                        update, ops=ringed(self._ring(ps), update.seq, update.ops))
                    self.in_rings += sent.ops is not update.ops
                    channel.send([(comm.Handle(ps, backup_key(shard.index)), "replay",
                                   ([sent],))], lazy=shard.copies_values())
                except PsrpcError as e:
                    self._answered(comm.failed(e), ps, token)
                continue
            if ps in self.live:  # (a large dense shard's too, where it has no ring: TensorPipe's
                # one copy beats the socket's for tens of MB)
                fut = comm.call(ps, apply, (update,), timeout_s=self.timeout_s)
            else:  # a copy's reply is not waited for: TensorPipe would read the gradient
                held = held or _cloned(update)  # after the worker wrote its next into it
                fut = comm.call(ps, apply, (held, True), timeout_s=self.timeout_s)
            fut.add_done_callback(lambda f, ps=ps, token=token: self._answered(f, ps, token))
            if ps in self.live:
                waited.append(fut)
        if waited:
            ack = torch.futures.collect_all(waited)
            self._acks[version] = ack
            ack.add_done_callback(lambda _, v=version: self._acks.pop(v, None))

    def name(self, ps: str) -> None:
        """`ps` holds a new backup from now on (a copy, a new epoch's): an error of an update
        sent to the one before does not give this one up, and it gets a ring of its own."""
        self.tokens[ps] = self.tokens.get(ps, 0) + 1
        self._drop_ring(ps)

    def _ring(self, ps: str) -> Optional[Ring]:
        """The ring to the backup on `ps` (this host), made on first use; None where the shard
        has none (its gradients then go in the messages)."""
        if ps not in self.rings:
            run = self.shard.ring_run()
            try:
                self.rings[ps] = None if run is None else Ring(run, self.shard.index,
                                                               self.shard.params.numel())
            except (PsrpcError, OSError) as e:
                log.warning("%s: no shared memory for its updates to %s (%s); they go through "
                            "the side channel's socket", self.shard.name, ps, first_line(e))
                self.rings[ps] = None
        return self.rings[ps]

    def _drop_ring(self, ps: str) -> None:
        ring = self.rings.pop(ps, None)
        if ring is not None:
            ring.close()

    def _answered(self, fut: torch.futures.Future, ps: str, token: int) -> None:
        try:
            fut.value()
        except Exception as e:  # on a thread of its own: a send that fails at once completes
            threading.Thread(target=self._give_up, args=(ps, e, token),  # this Future under
                             daemon=True).start()  # the shard's lock, in `commit`

    def _give_up(self, ps: str, e: Exception, token: int) -> None:
        with self.shard.lock:
            if self.tokens.get(ps, 0) != token:  # (an earlier backup there: this one is new)
                return
            gone = ps in self.targets
            for names in (self.live, self.copying):
                if ps in names:
                    names.remove(ps)
            self.dropped.add(ps)
            self.channels.pop(ps, None)
            self._drop_ring(ps)
        if gone:
            log.warning("%s: its backup on %s did not take an update (%s); going on without "
                        "it", self.shard.name, ps, first_line(e))

    def acked(self) -> bool:
        """Whether an update may wait for a backup's acknowledgement: one elsewhere, one being
        copied (it may join before this round ends), or a large shard with no ring (its
        gradients go over TensorPipe). Else a backup holds an update once it is sent, before
        any reply."""
        return bool(self.copying) or not self.shard.sends_oneway() or any(
            ps not in self.channels for ps in self.live)

    def gate(self, future: torch.futures.Future) -> torch.futures.Future:
        """The Future of a push's reply, completed once every live backup holds the version
        it carries."""
        if not self.acked():
            return future

        def replied(reply, out):
            with self.shard.lock:
                ack = self._acks.get(getattr(reply, "version", None))
            if ack is None:
                out.set_result(reply)
            else:
                ack.add_done_callback(lambda _: out.set_result(reply))
        return comm.chain(future, replied)

    def report(self) -> dict:
        return {"backups": list(self.live), "backups_copying": list(self.copying),
                "replicated": self.seq, "replicated_in_rings": self.in_rings,
                "replicated_as": "values" if self.shard.copies_values() else "updates"}


# -- on a backup's PS ------------------------------------------------------------------------------
_LOCK = threading.Lock()
_EARLY: dict[int, dict[int, tuple[Update, torch.futures.Future]]] = {}  # before the backup exists


@comm.async_execution
def apply(update: Update, copying: bool = False) -> torch.futures.Future:
    """An update of shard `update.index` for its backup here; the Future completes once the
    backup holds it (Backlog: applied in order by its own thread). `copying`: the backup is being created
    from a copy (service.copy_to): an update that comes first waits for it."""
    with _LOCK:
        backup = comm.registered().get(backup_key(update.index))
        if backup is None and not copying:  # (this PS was started again: it holds none)
            return comm.failed(PsrpcError(f"no backup of shard {update.index} here"))
        if backup is None:
            fut = torch.futures.Future()
            _EARLY.setdefault(update.index, {})[update.seq] = (update, fut)
            return fut
    return backup.replay([update], inline=False)


def register_backup(backup) -> None:
    """A backup just built here (psrpc/ps/service.py `create_backup`) takes its place, then
    the updates that came while it was being built."""
    with _LOCK:
        comm.register(backup_key(backup.index), backup)
        early = _EARLY.pop(backup.index, {})
    if early:
        done = backup.replay([u for u, _ in early.values()])
        for _, fut in early.values():
            done.add_done_callback(lambda _, fut=fut: fut.set_result(True))


def local_backups() -> list[int]:
    """The indices of the shards this PS holds a backup of."""
    return sorted(k - BACKUP for k in comm.registered() if k >= BACKUP)


def promote(index: int) -> int:
    """The primary of shard `index` is lost: this PS's backup becomes it (the plan's Handle
    points here from this epoch on). Returns its version."""
    sidechannel.settle()  # what the dead primary left in the socket
    with _LOCK:
        backup = comm.registered().pop(backup_key(index), None)
        if backup is None:
            raise PsrpcError(f"no backup of shard {index} here to promote")
        comm.register(index, backup)
    backup.become_primary(f"{comm.me()}/{backup.name.split('/', 1)[-1]}")
    return backup.version


def set_backups(index: int, backups: list[str], side: bool = False) -> None:
    """The primary of shard `index` (here) replicates to these PS from its next update;
    `side`: through the side channel to those on this host (cluster.shm is not off)."""
    comm.registered()[index].replicate_to(backups, channels(backups) if side else {})


def live_backups(index: int) -> list[str]:
    """The PS whose backup of shard `index` (its primary here) takes every update: in step,
    or being copied."""
    journal = comm.registered()[index].journal
    return [] if journal is None else journal.targets


def channels(names: list[str], timeout_s: float = 30.0) -> dict:
    """The side channels to those of these PS that run on this host (the others: none)."""
    out = {n: sidechannel.connect(n, timeout_s) for n in names}
    return {n: c for n, c in out.items() if c is not None}


def digests() -> dict[int, tuple[str, str]]:
    """Per shard held here: ("primary" or "backup", a digest of its state)."""
    out = {}
    for key, shard in list(comm.registered().items()):
        out[key % BACKUP] = ("backup" if key >= BACKUP else "primary", shard.digest())
    return out


def digest_of(state: Any) -> str:
    """A digest of a checkpoint-form state: every tensor's bytes and every other value."""
    h = hashlib.sha256()

    def walk(x):
        if torch.is_tensor(x):
            h.update(str((x.dtype, tuple(x.shape))).encode())
            h.update(x.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                     if x.numel() else b"")  # (0-dim too: Adam's step count)
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(str(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())
    walk(state)
    return h.hexdigest()


def drop_backups() -> None:
    """Forget the backups held here (a roll back builds new shards everywhere)."""
    with _LOCK:
        for key in [k for k in comm.registered() if k >= BACKUP]:
            comm.registered().pop(key).close()
        _EARLY.clear()


def placement(num_ps: int, replicas: int, hosts: list[str]) -> list[list[int]]:
    """For each PS p, the k PS holding backups of its shards: those on other hosts first (a
    host lost takes its PS, and their backups elsewhere survive), in ring order from p, the
    i-th PS of a host starting at the i-th of them (the backups spread over the others); then
    the next PS of its own host."""
    out = []
    for p in range(num_ps):
        ring = [(p + d) % num_ps for d in range(1, num_ps)]
        others = [q for q in ring if hosts[q] != hosts[p]]
        local = [q for q in range(num_ps) if hosts[q] == hosts[p]].index(p)
        if others:
            turn = local % len(others)
            others = others[turn:] + others[:turn]
        out.append((others + [q for q in ring if hosts[q] == hosts[p]])[:replicas])
    return out

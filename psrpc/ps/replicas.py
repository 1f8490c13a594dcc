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
import secrets
import threading
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from psrpc.cluster import comm, membership, sidechannel, store
from psrpc.errors import PsrpcError, first_line
from psrpc.ps import ring
from psrpc.ps.ring import Ring, ringed

log = logging.getLogger(__name__)

BACKUP = 1 << 24  # a backup of shard g is registered under BACKUP + g on its PS
# How long a primary waits for a backup to take an update (its acknowledgement over TensorPipe,
# a send into its socket) before giving it up: well under the workers' RPC timeout
# (update.timeout_s + 60 s), so that a hung backup is given up, not the workers' calls. Slow is
# not dead: a backup that only lags slows its primary down for up to this long.
ACK_TIMEOUT_S = 10.0


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
    origin: str = ""  # which primary sent it (a Journal's token): a backup refuses an update
    # whose number it already applied from another


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
        return replace(x, ops=_cloned(x.ops))
    if isinstance(x, dict):
        return {k: _cloned(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_cloned(v) for v in x)
    return x


class Journal:
    """On a primary: where its backups are and which of their acknowledgements a reply waits
    for. Every method but `gate` runs under the shard's lock."""

    def __init__(self, shard, backups: list[str], copy_timeout_s: float):
        self.shard, self.copy_timeout_s = shard, copy_timeout_s
        self.origin = secrets.token_hex(6)  # this primary's name on its updates
        self.live: list[str] = list(backups)  # PS names whose backup is in step
        self.copying: list[str] = []  # being created from a copy: not waited for yet
        self._ops: list = []
        self._acks: dict[int, torch.futures.Future] = {}  # version -> all live backups have it
        self._acks_lock = threading.Lock()  # (their callbacks may run under the shard's lock)
        self.seq = 0  # updates sent (a backup built from a copy starts at the copy's)
        self.channels: dict = {}  # PS name -> side channel (psrpc/cluster/sidechannel.py)
        self.rings: dict[str, Optional[Ring]] = {}  # PS name -> ring (psrpc/ps/ring.py)
        self.in_rings = 0  # updates whose gradient went through a ring
        self.tokens: dict[str, int] = {}  # PS name -> which backup there (see `name`)
        self.sent_to_copy: dict[str, list] = {}  # PS name -> its copy's updates, not waited
        # for (each Future True once it holds it): `copy_done` waits for them
        self.dropped: set[str] = set()  # PS whose backup missed an update: only a new copy
        # there is one again (it would wait for that update for ever). The copy there knows it
        # too, through its fence (`fence`), which outlives this primary.

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
                        shard.stats_dict(), list(shard.losses), shard.max_steps, self.origin)
        waited, held = [], None
        for n, ps in enumerate(self.targets):
            if n:  # (fault.crash_point=between_backups: this PS dies here)
                shard.faults.between_backups(version)
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
                    self._taken(comm.failed(e), ps, token, update.seq)
                continue
            if ps in self.live:  # (a large dense shard's too, where it has no ring: TensorPipe's
                # one copy beats the socket's for tens of MB)
                fut = comm.call(ps, apply, (update,), timeout_s=ACK_TIMEOUT_S)
            else:  # a copy's reply is not waited for: TensorPipe would read the gradient
                held = held or _cloned(update)  # after the worker wrote its next into it
                fut = comm.call(ps, apply, (held, True), timeout_s=self.copy_timeout_s)
            # (then: the fence is written before the acknowledgement a reply waits for completes)
            fut = fut.then(lambda f, ps=ps, token=token, seq=update.seq:
                           self._taken(f, ps, token, seq))
            (waited if ps in self.live else self.sent_to_copy.setdefault(ps, [])).append(fut)
        if waited:  # (a hand-over's update comes at an unchanged version: a reply carrying
            # that version waits for both)
            with self._acks_lock:
                pending = self._acks.get(version)
                ack = torch.futures.collect_all(waited + ([pending] if pending is not None else []))
                self._acks[version] = ack
            ack.add_done_callback(lambda _, v=version, a=ack: self._pop_ack(v, a))

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

    def _taken(self, fut: torch.futures.Future, ps: str, token: int, seq: int) -> bool:
        """A backup's answer to update `seq`: whether it took it. When it did not: its fence
        first (before any reply carrying that update goes out), then it is given up."""
        try:
            fut.value()
            return True
        except Exception as e:
            error = e
        if self.tokens.get(ps, 0) == token:
            fence(self.shard.index, ps, seq)
        # on a thread of its own: a send that fails at once completes this Future under the
        # shard's lock, in `commit`
        threading.Thread(target=self._give_up, args=(ps, error, token), daemon=True).start()
        return False

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
            self.sent_to_copy.pop(ps, None)
            self._drop_ring(ps)
        if gone:
            log.warning("%s: its backup on %s did not take an update (%s); going on without "
                        "it (fenced: never promoted; the next membership epoch replaces it)",
                        self.shard.name, ps, first_line(e))

    def _pop_ack(self, version: int, ack: torch.futures.Future) -> None:
        with self._acks_lock:
            if self._acks.get(version) is ack:
                del self._acks[version]

    def gate(self, future: torch.futures.Future) -> torch.futures.Future:
        """The Future of a push's reply, completed once every live backup holds the version
        it carries. Which backups those are is read when the reply is ready, not when the
        push came: a copy may join in between (the round then closes with it live), and a
        reply must not reach a worker before that backup has its update."""

        def replied(reply, out):
            with self._acks_lock:
                ack = self._acks.get(getattr(reply, "version", None))
            if ack is None:  # (none waited for: no backup, or updates sent one-way, held
                out.set_result(reply)  # once sent)
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


# -- fences: a given-up copy knows it ------------------------------------------------------------
def _fence_key(index: int, ps: str) -> str:
    return membership.run_prefix("fence") + f"{index}/{ps}"


def fence(index: int, ps: str, seq: int, why: str = "") -> None:
    """The primary of shard `index` gave up its backup on `ps`, which does not hold update
    `seq`: recorded in the run's store, which outlives the primary (its own record, the
    Journal's `dropped`, dies with it), before any reply carrying that update goes out. Only
    a copy made after that update clears it (`fenced`)."""
    try:
        store.store().set(_fence_key(index, ps), f"{why}{seq}")
    except Exception as e:  # (no store: no membership epochs either, so no promotion)
        log.warning("shard %d: could not record that its backup on %s lacks update %d (%s)",
                    index, ps, seq, first_line(e))


COPYING = "copying "  # a fence's value while its copy is made: "copying <update>"


def fence_copy(index: int, ps: str, seq: int) -> None:
    """A copy of shard `index` on `ps` is being made at update `seq`: fenced until it holds the
    updates sent meanwhile (`unfence`), as it may lack what workers saw."""
    fence(index, ps, seq + 1, COPYING)


def unfence(index: int, ps: str, seq: int) -> None:
    """The copy of shard `index` on `ps` made at update `seq` is in step with its primary:
    its copy fence is lifted, but never a fence its primary wrote since (an update it missed
    already: compare-and-set)."""
    try:
        store.store().compare_set(_fence_key(index, ps), f"{COPYING}{seq + 1}", str(seq))
    except Exception as e:  # (no store: no membership epochs either, so no promotion)
        log.warning("shard %d: could not record that its backup on %s is in step (%s)",
                    index, ps, first_line(e))


UNKNOWN = -1  # `fenced`: whether the copy is fresh could not be told (never promoted then)


def fenced(index: int, ps: str, base: int) -> Optional[int]:
    """The update that the backup of shard `index` on `ps`, copied at update `base` (0: from
    the start), lacks because its primary gave it up; None where it was never given up;
    UNKNOWN where the store does not answer."""
    try:
        s = store.store()
        key = _fence_key(index, ps)
        seq = int(s.get(key).decode().removeprefix(COPYING)) if s.check([key]) else None
    except Exception as e:
        log.warning("shard %d: its fence could not be read (%s)", index, first_line(e))
        return UNKNOWN
    return seq if seq is not None and base < seq else None


def clear_fences(indices: list[int], names: list[str]) -> None:
    """Every shard rolls back: its updates are numbered from 0 again, its old fences mean
    nothing (run on the chief)."""
    s = store.store()
    for index in indices:
        for ps in names:
            s.delete_key(_fence_key(index, ps))


def standings() -> dict[int, dict]:
    """Per backup held here, once it applied everything its primary left in its socket: what
    the chief weighs to pick one for a promotion: `seq` (the last update it applied: the most
    advanced copy has the highest), `version`, and `fenced` (the update it lacks because its
    primary gave it up, or None; UNKNOWN where its socket or backlog would not settle)."""
    try:
        sidechannel.settle()
        unsettled = False
    except PsrpcError as e:
        log.warning("%s: %s; its backups are not candidates", comm.me(), first_line(e))
        unsettled = True
    out = {}
    for key, backup in list(comm.registered().items()):
        if key < BACKUP:
            continue
        out[key - BACKUP] = _standing(key - BACKUP, backup, unsettled)
    return out


def _standing(index: int, backup, unsettled: bool) -> dict:
    try:
        backup.backlog.drain()
    except PsrpcError as e:
        log.warning("%s", first_line(e))
        unsettled = True
    fence_at = UNKNOWN if unsettled else fenced(index, comm.me(), backup.backlog.base)
    return {"seq": backup.backlog.applied, "version": backup.version, "fenced": fence_at}


def drop_backup(index: int) -> bool:
    """Forget this PS's backup of shard `index` (given up, or behind the one promoted; a new
    copy replaces it) and the updates held for one being copied. Returns whether it held one."""
    with _LOCK:
        backup = comm.registered().pop(backup_key(index), None)
        early = _EARLY.pop(index, {})
    for _, fut in early.values():
        fut.set_exception(PsrpcError(f"the backup of shard {index} here was dropped"))
    if backup is not None:
        backup.close()
        ring.unmap(index)
    return backup is not None


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


def channels(names: list[str], timeout_s: float = ACK_TIMEOUT_S) -> dict:
    """The side channels to those of these PS that run on this host (the others: none); a
    send that cannot go into a backup's socket within `timeout_s` gives that backup up."""
    out = {n: sidechannel.connect(n, timeout_s) for n in names}
    return {n: c for n, c in out.items() if c is not None}


def digests() -> dict[int, tuple[str, str]]:
    """Per shard held here: ("primary", "backup" or "given_up": a backup its primary gave up,
    known stale; a digest of its state)."""
    out = {}
    for key, shard in list(comm.registered().items()):
        role = "primary" if key < BACKUP else "backup"
        if role == "backup" and fenced(key - BACKUP, comm.me(), shard.backlog.base) is not None:
            role = "given_up"
        out[key % BACKUP] = (role, shard.digest())
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
        early = [fut for held in _EARLY.values() for _, fut in held.values()]
        _EARLY.clear()
    for fut in early:
        fut.set_exception(PsrpcError("the backups here were dropped (a roll back)"))


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

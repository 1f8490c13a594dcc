"""What a parameter server serves over RPC besides its shards' own methods: the chief calls
these on each PS to create its shards (`create_shard`), to find out what it holds after a
membership change (`local_shards`, `drop_shards`), and to set up shared memory with the workers
on its host (`create_segments`, which also cleans up after dead runs).
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from pathlib import Path
from typing import Optional

from psrpc.cluster import comm, shm
from psrpc.errors import PsrpcError, first_line
from psrpc.faults import NoFaults
from psrpc.ps import replicas, ring
from psrpc.ps.shard import Shard, ShardSpec
from psrpc.ps.tables import TableShard, TableShardSpec

# Which shard a spec builds (a registry, not an if): the most specific spec type first.
SHARD_TYPES = ((TableShardSpec, TableShard), (ShardSpec, Shard))


def build_shard(spec: ShardSpec, backup: bool = False) -> Shard:
    """The shard `spec` describes (a backup: it replays its primary's updates)."""
    cls = next(cls for kind, cls in SHARD_TYPES if isinstance(spec, kind))
    return cls(spec, backup)


def create_shard(spec: ShardSpec) -> int:
    """Build the shard `spec` describes on this PS and register it under its index; returns
    the index (the key of its comm.Handle)."""
    shard = build_shard(spec)
    comm.register(shard.index, shard)
    return shard.index


def create_backup(spec: ShardSpec, state: Optional[dict] = None, seq: int = 0) -> int:
    """Build a backup of the shard `spec` describes on this PS (cluster.ps_replicas,
    psrpc/ps/replicas.py): from the spec itself (every copy starts equal), or from its
    primary's `state` (its checkpoint form) after the primary's update `seq`; then the updates
    that came meanwhile. Returns the version it holds."""
    spec = replace(spec, shm=None, faults=NoFaults())
    if state is not None and getattr(spec, "restore", None) is not None:
        spec = replace(spec, restore=None)  # (the copy holds the rows: no checkpoint read)
    backup = build_shard(spec, backup=True)
    if state is not None:
        backup.load_state(state, seq)
    replicas.register_backup(backup)
    return backup.version


def copy_to(index: int, ps: str, timeout_s: float, side: bool = False) -> int:
    """Bring a new backup of shard `index` (its primary here) up on `ps` while training goes
    on: the state now, taken under the lock, and from then on every update (not waited for
    until the backup exists). Returns the version copied."""
    shard = comm.registered()[index]
    # a copy given up there before (fenced) goes first: the updates sent from now on are the
    # new copy's
    comm.call_sync(ps, replicas.drop_backup, (index,), timeout_s=timeout_s)
    spec, state, seq = shard.start_copy(ps)
    try:
        comm.call_sync(ps, create_backup, (spec, state, seq), timeout_s=timeout_s)
    except Exception as e:
        shard.copy_failed(ps)
        raise PsrpcError(f"{shard.name}: copying it to {ps} failed: {first_line(e)}") from e
    shard.copy_done(ps, seq, replicas.channels([ps]) if side else {})
    return state["version"]


_SEGMENTS: list[str] = []  # the shared-memory segments this PS created


def create_segments(run: str, ps: str, segments: list[tuple[str, int]]):
    """Called by the chief on a PS: create its shards' shared-memory segments (name, elements)
    of run `run`, after removing those of dead runs on this host; returns the nonce written in
    each, which the workers check before using them, or why this host's shared memory cannot
    be used (a str). This PS marks the run alive on its host while it lives and removes the
    segments when it leaves (psrpc/cluster/shm.py)."""
    if (why := shm.problem()) is not None:
        return why
    shm.remove_stale()
    shm.hold(run, ps)
    nonce = secrets.token_bytes(shm.NONCE_BYTES)
    for name, numel in segments:
        shm.create(name, numel, nonce)
        _SEGMENTS.append(name)
    return nonce


def remove_segments() -> None:
    """This PS's segments and lock, when it leaves (the workers are gone or leaving: a mapped
    segment stays mapped)."""
    for name in _SEGMENTS:
        shm.unlink(name)
    _SEGMENTS.clear()
    ring.remove_made()
    shm.release(remove_files=True)


def local_shards() -> list[int]:
    """The indices of the shards this PS serves (a PS started again holds none; backups
    aside, psrpc/ps/replicas.py)."""
    return sorted(k for k in comm.registered() if k < replicas.BACKUP)


def drop_shards() -> None:
    """Forget this PS's shards and backups (every shard rolls back to a checkpoint: new ones
    replace them)."""
    replicas.drop_backups()
    for shard in comm.registered().values():
        shard.close()
    comm.registered().clear()


def sees(folder: str, name: str, nonce: str) -> bool:
    """Called by the chief: whether file `name` in `folder` (as this PS resolves it) holds
    `nonce`, i.e. this PS and the chief share the folder (psrpc/session/folders.py)."""
    try:
        return (Path(folder) / name).read_text() == nonce
    except OSError:
        return False


def reset() -> None:
    """Called by the chief when its start-up failed half-way (a rank died meanwhile): forget the
    shards and segments that start made, before it makes them again."""
    drop_shards()
    remove_segments()

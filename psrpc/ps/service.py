"""What a parameter server serves over RPC besides its shards' own methods: the chief calls
these on each PS to create its shards (`create_shard`), to find out what it holds after a
membership change (`local_shards`, `drop_shards`), and to set up shared memory with the workers
on its host (`create_segments`, which also cleans up after dead runs).
"""

from __future__ import annotations

import secrets
from pathlib import Path

from psrpc.cluster import comm, shm
from psrpc.ps.shard import Shard, ShardSpec
from psrpc.ps.tables import TableShard, TableShardSpec

# Which shard a spec builds (a registry, not an if): the most specific spec type first.
SHARD_TYPES = ((TableShardSpec, TableShard), (ShardSpec, Shard))


def create_shard(spec: ShardSpec) -> int:
    """Build the shard `spec` describes on this PS and register it under its index; returns
    the index (the key of its comm.Handle)."""
    cls = next(cls for kind, cls in SHARD_TYPES if isinstance(spec, kind))
    shard = cls(spec)
    comm.register(shard.index, shard)
    return shard.index


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
    shm.release(remove_files=True)


def local_shards() -> list[int]:
    """The indices of the shards this PS holds (a PS started again holds none)."""
    return sorted(comm.registered())


def drop_shards() -> None:
    """Forget this PS's shards (every shard rolls back to a checkpoint: new ones replace them)."""
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

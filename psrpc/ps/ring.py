"""A large dense shard's updates to a backup on the same host, through shared memory
(cluster.ps_replicas with cluster.shm not off).

A sync round's averaged gradient for resnet18's shard is tens of MB. Over TensorPipe it is
written into a socket, read out of it into a fresh buffer and acknowledged, and the workers'
reply waits for that acknowledgement. Here the primary copies it into a slot of a ring it shares
with the backup (one segment of this user's shared memory per primary and backup) and sends,
through the side channel, only the update with the slot named in place of the gradient: a
message with no reply, held by the backup once it is in its socket. The backup's optimizer step
reads the slot in place, then writes the update's sequence number into the ring's head. The
primary writes a slot again only once the head says the backup applied the update that used
it; where it has not (a backup SLOTS updates behind), the gradient goes in the message itself.

A primary killed after the send leaves the segment behind (a file: the backup maps it) with
every slot the socket names intact, so the backup applies them when it is promoted. The segment
is created as every psrpc segment is (psrpc/cluster/shm.py: exclusively, 0600, checked when
mapped), and removed by the PS that made it when it leaves, or with the run's files.
"""

from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from psrpc.cluster import shm

log = logging.getLogger(__name__)

SLOTS = 2  # in sync the backup applies a round's update a whole step before its slot is due
HEAD = 16  # float32 elements before the slots: the seq the backup applied last (an int64)

_LOCK = threading.Lock()
_MADE: list[str] = []  # the rings this PS created (removed when it leaves)
_MAPPED: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # rings read here, as a backup


@dataclass(frozen=True)
class InRing:
    """What an update carries in place of a gradient: it is in slot `slot` of ring `name`."""

    name: str
    slot: int
    numel: int


def _map(name: str, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the slots, SLOTS x numel float32; the head, one int64) of ring `name`."""
    whole = shm.attach(name, HEAD + SLOTS * numel)
    return whole[HEAD:].view(SLOTS, numel), whole[:2].view(torch.int64)


class Ring:
    """On a primary: its ring to one backup on this host."""

    def __init__(self, run: str, index: int, numel: int):
        self.name = shm.segment(run, index, f"ring{secrets.token_hex(4)}")
        shm.create(self.name, HEAD + SLOTS * numel, b"")
        with _LOCK:
            _MADE.append(self.name)
        self.slots, self.head = _map(self.name, numel)
        self.used = [0] * SLOTS  # the seq of the update each slot holds (0: none yet)

    def put(self, seq: int, grad: torch.Tensor) -> Optional[InRing]:
        """Update `seq`'s gradient, copied into its slot; None where that slot is still to be
        applied, or the gradient is not one float32 value per element (it then goes in the
        message)."""
        slot = seq % SLOTS
        numel = self.slots.shape[1]
        if (grad.dtype != torch.float32 or grad.numel() != numel or grad.device.type != "cpu"
                or int(self.head.item()) < self.used[slot]):
            return None
        self.slots[slot].copy_(grad.reshape(-1))
        self.used[slot] = seq
        return InRing(self.name, slot, numel)

    def close(self) -> None:
        with _LOCK:
            if self.name in _MADE:
                _MADE.remove(self.name)
        shm.unlink(self.name)


def ringed(ring: Optional[Ring], seq: int, ops: list) -> list:
    """An update's ops with its one optimizer step's gradient left in `ring` (the ops as they
    are where there is no ring, no single step or no free slot)."""
    steps = [i for i, op in enumerate(ops) if op[0] == "step"]
    if ring is None or len(steps) != 1 or not torch.is_tensor(ops[steps[0]][1]):
        return ops
    i = steps[0]
    ref = ring.put(seq, ops[i][1])
    return ops if ref is None else [*ops[:i], (ops[i][0], ref, *ops[i][2:]), *ops[i + 1:]]


def read(ref: InRing) -> torch.Tensor:
    """On a backup: the gradient `ref` names, in place."""
    with _LOCK:
        mapped = _MAPPED.get(ref.name)
        if mapped is None:
            mapped = _MAPPED[ref.name] = _map(ref.name, ref.numel)
    return mapped[0][ref.slot]


def applied(ops: list, seq: int) -> None:
    """On a backup, once update `seq` is applied: the slots it named may be written again."""
    for op in ops:
        if len(op) > 1 and isinstance(op[1], InRing):
            _MAPPED[op[1].name][1].fill_(seq)


def unmap(index: int) -> None:
    """On a PS whose backup of shard `index` is dropped: the rings it read, unmapped (its
    primary, alive, removes them)."""
    with _LOCK:
        for name in [n for n in _MAPPED if f"-s{index}-ring" in n]:
            del _MAPPED[name]


def forget(index: int) -> None:
    """On a promoted backup of shard `index`: the rings of its dead primary, unmapped and
    removed."""
    with _LOCK:
        names = [n for n in _MAPPED if f"-s{index}-ring" in n]
        for name in names:
            del _MAPPED[name]
    for name in names:
        shm.unlink(name)


def remove_made() -> None:
    """The rings this PS made, when it leaves."""
    with _LOCK:
        names, _MADE[:] = list(_MADE), []
    for name in names:
        shm.unlink(name)

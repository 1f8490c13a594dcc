"""What crosses the wire between a worker and a shard, both ways: the types both sides agree on.

A push carries (worker, version, gradient in the wire dtype, loss, samples, ticket[, host sum]);
a shard answers with a `Reply`; the staleness clock answers `admit` with a `Ticket`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

WIRE_DTYPE_NAMES = ("float32", "bfloat16", "float16")  # update.wire_dtype
WIRE_DTYPES = {name: getattr(torch, name) for name in WIRE_DTYPE_NAMES}


@dataclass
class Reply:
    """What a push (or pull) gets back from one shard."""

    version: int  # global steps applied on this shard
    params: torch.Tensor  # flat, wire dtype: a snapshot, or the master copy itself when no
    # update can happen before every receiver has it (see Shard.reply); empty in the replies
    # pipeline stages send their leader
    accepted: bool  # False: stale, rejected, or training already finished
    finished: bool  # no more updates will be applied: the worker stops
    loss: Optional[float]  # sync: the last round's mean loss; async: mean of the last W applied
    samples: int  # samples whose gradients this shard has applied so far
    stale_dropped: int  # stale gradients dropped so far
    skipped: bool = False  # this push's gradient was non-finite: not applied, its batch skipped
    rows: Optional[dict] = None  # a table shard's push_pull_rows: {table: values of the rows
    # asked for, at `version`}; None when not asked, or when the shard had moved on


@dataclass(frozen=True)
class Ticket:
    """The clock's answer to `admit`."""

    seq: Optional[int]  # the push becomes update seq+1 on every shard; None: not admitted
    finished: bool = False  # training is over: stop
    # seq None and not finished: the gradient is staler than k; pull fresh parameters


@dataclass(frozen=True)
class HostSum:
    """A push carrying the sum of several workers' gradients, added on their host
    (update.host_push): the pushing worker leads the aligned block of 2^level workers starting
    at its index. `workers`: those whose gradient is in the sum, in order, with their
    `losses`; `excused`: those of the block whose gradient was not finite (their batch is
    skipped, as a non-finite push's)."""

    level: int
    workers: tuple
    losses: tuple
    excused: tuple = ()

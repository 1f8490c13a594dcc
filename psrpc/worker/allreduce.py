"""update.dense=allreduce: the dense parameters live on the workers, as in DDP, and only the
embedding tables live on the PS (as HET and PERSIA train: the PS never touches a dense weight).

Every worker holds the whole dense replica in FlatModel's flat buffers. A step: backward fills
each buffer's gradient; each is all-reduced (summed) over a process group of the W workers as
soon as it is complete, then divided by W (the PS's average: the sum of two is the same in
either order, so W=2 gives the bits a PS gives). The worker then pushes an empty gradient and
its loss to the clock shard, which keeps the global step, the barrier, and every counter and
hook that hangs on them. Once the clock's reply says the round was applied, each worker steps
its own optimizer (the PS's, by the same learning-rate schedule): every replica stays
identical, and W workers of batch B still make the updates of one worker accumulating W
micro-batches of B.

A membership epoch forms a new process group (the old one's members are gone); the chief hands
every worker the dense state of its replica with the epoch's plan, brought to the step the
shards were lined up at: the gradient of a round the clock closed but whose reply was lost is
applied (every worker averaged it), a step passed without an update is counted (Adam's bias
correction, as on a PS). A PS rolled back hands out the checkpoint's dense state instead.

The process group is NCCL for CUDA workers with a GPU each; for CPU workers all on one host
psrpc's own sum over Unix sockets (psrpc/cluster/localreduce.py: no threads of its own, where
gloo's two woke a dozen times a step), unless cluster.shm=off; gloo over TCP otherwise (workers
on several hosts, CUDA workers sharing a GPU), formed through the run's store under a prefix of the
epoch (giving up when a newer epoch is announced), with the RPC timeout as its timeout: a worker
that dies mid all-reduce ends its peers' wait with an error (its sockets close), then a new
epoch.
"""

from __future__ import annotations

import hashlib
import logging
import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from psrpc.cluster import comm, localreduce, membership, netstat
from psrpc.cluster import store as store_mod
from psrpc.optim import build_optimizer, count_step, lr_factor, step_scaled
from psrpc.worker.flat import FlatModel
from psrpc.worker.plan import DenseState

log = logging.getLogger(__name__)
_GROUPS: list = []  # every group made, kept: destroying one a dead peer left can block


class DenseAllReduce:
    def __init__(self, cfg, rank: int, size: int, flat: FlatModel, state: DenseState,
                 nccl: bool = False):
        self.flat, self.rank, self.size, self.nccl = flat, rank, size, nccl
        self.index, self.workers = rank, size  # this worker's, and every worker (rank and size
        # are its place in, and the size of, the current epoch's group: the workers not gone)
        # CPU workers all on one host sum over Unix sockets instead of gloo (cluster.shm)
        self.local = not nccl and cfg.cluster.shm != "off" and flat.params[0].device.type == "cpu"
        self.optim_cfg, self.total_steps = cfg.optim, cfg.train.steps
        # a peer that died ends the wait at once (its sockets close); this bounds the rest,
        # a chief busy evaluating included, as long as an RPC to the PS may take
        self.timeout = timedelta(seconds=comm.rpc_timeout_s(cfg))
        self.optimizers = [build_optimizer([p], cfg.optim) for p in flat.params]
        self.base_lr = [[g["lr"] for g in o.param_groups] for o in self.optimizers]
        self._group = None
        self._group_key: Optional[str] = None
        self._works: list = []
        self._ready: set[int] = set()  # buffers whose gradient is complete, not yet launched
        self._next = 0  # the next buffer to all-reduce: every worker launches them in order
        self.pending: Optional[int] = None  # the step whose averaged gradient awaits the clock
        self._undo: Optional[tuple] = None  # (step, version, params, states) before apply_pending
        self.load(state)

    # -- the state -----------------------------------------------------------------------------
    def load(self, state: DenseState) -> None:
        """Take `state` (parameters and optimizer state) as this replica's."""
        with torch.no_grad():
            for p, flat in zip(self.flat.params, state.flats):
                p.copy_(flat)
        for opt, st in zip(self.optimizers, state.states):
            loaded = opt.state_dict()
            loaded["state"] = {0: st} if st else {}
            opt.load_state_dict(loaded)  # casts and places it; {} clears it
        self.version, self.pending, self._undo = state.version, None, None

    def params(self) -> list[torch.Tensor]:
        """CPU copies of the replica's flat parameters (model.pt, an evaluation)."""
        return [p.detach().to("cpu", copy=True) for p in self.flat.params]

    def state(self) -> DenseState:
        """A CPU copy of this replica's dense state (for a checkpoint, a new epoch)."""
        flats = self.params()
        states = []
        for opt in self.optimizers:
            st = opt.state_dict()["state"].get(0, {})
            states.append({k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v
                           for k, v in st.items()})
        return DenseState(self.version, flats, states)

    def digest(self) -> str:
        """A hash of the replica's parameters: every worker's is the same at the end."""
        h = hashlib.sha1()
        for p in self.flat.params:
            h.update(p.detach().cpu().numpy().tobytes())
        return h.hexdigest()[:16]

    def kind(self) -> str:
        """What averages the replicas: "sockets" (the workers of one host, psrpc's own), "gloo",
        "nccl", or "none" (one worker, or no step yet)."""
        if self._group is None:
            return "none"
        if isinstance(self._group, localreduce.LocalGroup):
            return "sockets"
        return "nccl" if self.nccl else "gloo"

    def catch_up(self, target: int) -> None:
        """Bring the replica to global step `target` (where the clock is): a round it averaged
        whose reply was lost is applied once the clock has passed it; further steps passed
        without an update are counted as the shards count them."""
        self._confirm(target)
        if target < self.version:
            raise RuntimeError(f"the dense replica is at step {self.version}, past the clock's "
                               f"{target}: replicas would differ")
        if self.pending is not None and self.pending == self.version < target:
            self.apply(self.version)
        while self.version < target:
            for opt in self.optimizers:
                count_step(opt)
            self.version += 1
        self.pending = None

    # -- one step ------------------------------------------------------------------------------
    def group(self):
        """This epoch's process group over the W workers (formed on first use)."""
        key = membership.group_prefix("dense")
        if self._group is None or self._group_key != key:
            if self._group is not None:
                _retire(self._group)
            # forming gives up as soon as a newer epoch is announced (a member will not come)
            prefix = dist.PrefixStore(key, store_mod.abortable(membership.changing,
                                                               self.timeout.total_seconds()))
            if self._group_key == key:  # a form of this epoch failed: its keys are used
                raise localreduce.LocalReduceError(
                    "dense all-reduce: the group of this membership epoch could not be formed; "
                    "the workers form one in the next epoch")
            self._group, self._group_key = None, key
            self.rank, self.size = self._members()
            if self.local:  # None when the workers are not all on one host: gloo then
                self._group = localreduce.form(prefix, self.rank, self.size,
                                               self.timeout.total_seconds(), membership.changing)
            if self._group is None:
                self._group = _make_group(prefix, self.rank, self.size, self.timeout,
                                          self.nccl)
                _GROUPS.append(self._group)  # (gloo's: see _GROUPS)
        return self._group

    def _members(self) -> tuple[int, int]:
        """(this worker's rank, the group's size) in this epoch: without the workers lost for
        good (their gradients no longer in the average: the summary names them)."""
        gone = {n for n in membership.gone(membership.current())}
        members = [w for w in range(self.workers) if f"worker{w}" not in gone]
        return members.index(self.index), len(members)

    def start(self, k: int) -> None:
        """Buffer k's gradient is complete: its all-reduce starts (backward goes on) once
        every buffer before it has started: collectives must pair up in the same order on
        every worker, whatever order backward completes them in (unused parameters, a worker
        that waits for its whole gradient first)."""
        if self.size == 1:
            return
        self._ready.add(k)
        while self._next in self._ready:
            self._ready.discard(self._next)
            self._works.append(self.group().allreduce([self.flat.grads[self._next]]))
            self._next += 1

    def finish(self, version: int) -> bool:
        """Wait for every all-reduce; average. Returns whether the average is finite (a
        non-finite one is skipped by every worker alike)."""
        for k in range(self._next, len(self.flat.grads)):  # (every buffer was started)
            self.start(k)
        works, self._works, self._next = self._works, [], 0
        for w in works:
            w.wait()
        finite = True
        for g in self.flat.grads:
            if self.size > 1:
                g.div_(self.size)
            finite = finite and bool(torch.isfinite(g.sum(dtype=torch.float32)))
        self.pending = version if finite else None
        return finite

    def abandon(self) -> None:
        """Before a step: drop what a failed one left (a membership change), or the average
        of a step computed ahead for a version the clock's reply did not confirm."""
        if isinstance(self._group, localreduce.LocalGroup) and self._group.unfinished:
            # (gloo's collectives pair up again by themselves; these streams are out of step)
            self._group.break_off("a step was abandoned with its all-reduce unfinished")
        self._works, self._ready, self._next, self.pending = [], set(), 0, None

    def settle(self, version: int, ahead: bool = False) -> None:
        """The clock's reply for the pending step says it is at `version`: once its round has
        closed, with or without this worker's push, every worker applies the average it
        took part in (a non-finite one is skipped by all: the step passes with no update).
        `ahead`: the step was applied before its push (`apply_pending`) and the one pending
        now is the next step's, computed while this reply was on its way: it stays."""
        if ahead:
            self._confirm(version)
            self.version = max(self.version, version)
            return
        if self.pending is not None and version > self.pending:
            self.apply(self.pending)
        self.version = max(self.version, version)
        self.pending = None

    def apply_pending(self) -> None:
        """Apply the averaged gradient now, before the clock has closed its round (the next
        step is computed on it meanwhile): every worker averaged it, so every worker applies
        it. A non-finite one passes the step without an update. What it changed is kept until
        the clock's reply: a round that does not close (the chief froze the shards, a worker
        died before its push) is undone (`settle`, `catch_up`)."""
        self._undo = None
        if self.pending is not None:
            states = [{k: v.clone() if torch.is_tensor(v) else v
                       for k, v in opt.state[p].items()}
                      for opt, p in zip(self.optimizers, self.flat.params)]
            self._undo = (self.pending, self.version,
                          [p.detach().clone() for p in self.flat.params], states)
            self.apply(self.pending)
        self.pending = None

    def _confirm(self, clock: int) -> None:
        """The clock is at step `clock`: a step `apply_pending` applied whose round it has not
        passed (a freeze, a worker that died before its push) is undone: parameters,
        optimizer state, version."""
        undo, self._undo = self._undo, None
        if undo is None or clock > undo[0]:
            return
        _, self.version, params, states = undo
        with torch.no_grad():
            for p, saved in zip(self.flat.params, params):
                p.copy_(saved)
        for opt, p, saved in zip(self.optimizers, self.flat.params, states):
            state = opt.state[p]
            state.clear()
            state.update(saved)

    def apply(self, step: int) -> None:
        """One optimizer step with the averaged gradient at step `step`'s learning rate."""
        scale = lr_factor(step, self.optim_cfg, self.total_steps)
        for p, g, opt, base in zip(self.flat.params, self.flat.grads, self.optimizers,
                                   self.base_lr):
            step_scaled(opt, p, g, base, scale)
        self.version = step + 1


def _make_group(store, rank: int, size: int, timeout: timedelta, nccl: bool):
    """NCCL (CUDA workers, a GPU each) or gloo (CPU workers, or CUDA workers sharing a GPU,
    which NCCL refuses: gloo all-reduces CUDA tensors too) over `store`, made directly: the
    RPC agent is this process's default group, and a process group per membership epoch is
    needed. NCCL in blocking-wait mode: a collective a dead peer never completes raises in
    `wait` after the timeout (the membership change follows), instead of hanging the stream
    and aborting the process."""
    before = netstat.sockets()  # what the group opens is counted as its traffic
    if nccl:
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, size, opts)
    else:
        group = dist.ProcessGroupGloo(store, rank, size, timeout)  # connects every pair
    netstat.mark_new(before, "nccl" if nccl else "gloo")
    return group


def _retire(group) -> None:
    """A gone epoch's group: NCCL's is aborted (its communicators would otherwise hold a
    collective a dead peer never joins); gloo's is kept (destroying one whose peer died can
    block)."""
    if isinstance(group, localreduce.LocalGroup):
        group.close()
        return
    abort = getattr(group, "abort", None) if isinstance(group, getattr(
        dist, "ProcessGroupNCCL", ())) else None
    if abort is not None:
        try:
            abort()
        except Exception as e:  # the group is gone either way
            log.warning("aborting the old all-reduce group failed: %s", e)

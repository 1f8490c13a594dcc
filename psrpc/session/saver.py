"""The chief's checkpoint saver hook: every `checkpoint.every_steps` global steps (the shards save
those by themselves), every `checkpoint.every_s` seconds (the chief asks for a step a little
ahead), and at the end. Once every shard has written step N, the chief writes the buffers of its
replica at step N (BatchNorm statistics: model state that no shard holds), then N's manifest: the
commit point. Files are written by one background thread, in order, off the training path.

Buffers of step N are taken on the training thread when the chief first reaches step N (in
`after_step`): in sync training that is after its forward of batch N-1 and before that of batch
N, exactly the state a run restored from step N starts with. In async training the chief may
see the step jump past N; it then takes its buffers at the first step it sees at or past N.

A membership change (a rank started again) ends the RPC group while a step may be asked: the
old group's answers fail, and the step is asked again through the new epoch's shards (`rebind`):
the same shards lined up, which answer what they saved, or shards rolled back to an older
committed step, which save it when they reach it again (`rollback`: its buffers are taken
again too). A step asked is committed, or said not to be; never dropped in silence.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future as PyFuture
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as PyTimeout
from typing import Callable, Optional

from psrpc import checkpoint
from psrpc.cluster import comm
from psrpc.cluster.comm import rpc_timeout_s
from psrpc.errors import first_line, network_failure
from psrpc.session.hooks import Hook, StepInfo

log = logging.getLogger("psrpc")


class _Ask:
    """One asked step on its way to a manifest: the shards' answers (asked again in each new
    membership epoch) and the chief's buffers (taken again after a roll back)."""

    def __init__(self, step: int, futures: list, buffers: PyFuture, epoch: int):
        self.step, self.futures, self.buffers, self.epoch = step, futures, buffers, epoch


class CheckpointSaver(Hook):
    def __init__(self, cfg, plan, start_step: int, margin: int,
                 buffers: Callable[[], dict] = dict, wait_s: float = 60.0,
                 dense: Optional[Callable] = None):
        ck = cfg.checkpoint
        self.root, self.every_steps, self.every_s, self.keep = ck.dir, ck.every_steps, ck.every_s, ck.keep
        # update.dense=allreduce: `dense()` is the chief's replica's DenseState; the chief
        # writes the dense files, the PS only the tables (its clock shard holds no parameters)
        self.replica_dense = dense
        self.layout = plan.layout
        self.shards = self._savers(plan)
        self.dense = len(self.shards) - len(plan.table_shards)  # then one table shard per PS
        self.tables = ({"specs": [{"name": t.name, "num_rows": t.num_rows, "dim": t.dim}
                                  for t in plan.table_specs],
                        "partition": plan.partition, "num_ps": len(plan.table_shards)}
                       if plan.table_shards else None)
        self.start = start_step  # 0, or the step this run restored from
        # Steps known to load: the one restored (it just did) and those this saver commits.
        # A committed step from elsewhere is checked before it counts toward checkpoint.keep.
        self.good = {start_step} if start_step else set()
        self.errors: dict[int, str] = {}  # step -> why it could not be written
        self.margin = margin  # steps ahead a time-based save is asked for
        self.extra = {"model": cfg.model["_target_"], "optim": cfg.optim.name,
                      "update": cfg.update.name, "num_workers": cfg.cluster.num_workers}
        self._next = (start_step // self.every_steps + 1) * self.every_steps if self.every_steps else None
        self._last_time = time.monotonic()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="chief-manifest")
        self._asked: dict[int, PyFuture] = {}
        self._pending: dict[int, _Ask] = {}  # asked steps not yet committed (or given up)
        self._epoch = 0  # membership epochs seen: a new one asks pending steps again
        self._closing = False  # final(): no new epoch will ask again
        self._cv = threading.Condition()  # guards the three above and each _Ask's fields
        self.buffers = buffers  # () -> the chief's replica's buffers, CPU copies
        self._buffers: dict[int, PyFuture] = {}  # asked step -> its buffers, until reached
        # How long a manifest waits for the chief to reach its step once the shards have saved
        # it: about one chief step normally; the bound keeps a failed chief from hanging here.
        self.wait_s = wait_s

    def after_step(self, info: StepInfo) -> None:
        while self._next is not None and info.step >= self._next:
            self.save(self._next)
            self._next += self.every_steps
        if self.every_s and time.monotonic() - self._last_time >= self.every_s:
            self._last_time = time.monotonic()
            # Never past the next every_steps save: steps are asked (and committed, and older
            # uncommitted ones pruned) in increasing order.
            ahead = info.step + self.margin
            self.save(ahead if self._next is None else min(ahead, self._next))
        self._capture(info.step)

    def rebind(self, plan) -> None:
        """A new membership epoch: the same shards (or restored ones) through new references.
        Every step still on its way is asked again through them: the old group's answers are
        lost with it."""
        self.shards = self._savers(plan)
        with self._cv:
            self._epoch += 1
            for ask in self._pending.values():
                ask.futures, ask.epoch = self._request(ask.step), self._epoch
            self._cv.notify_all()

    def rollback(self, step: int) -> None:
        """Every shard is back at `step`: steps past it are asked (and saved) again; one still
        on its way (asked again by `rebind`) waits for the chief's buffers of that step anew."""
        self.start = step
        self._next = (step // self.every_steps + 1) * self.every_steps if self.every_steps else None
        with self._cv:
            pending = {s: a for s, a in self._pending.items() if s > step}
            for s in [s for s in self._asked if s > step and s not in pending]:
                del self._asked[s]  # made (or not) of shards that are gone: ask again
            for s in [s for s in self._buffers if s > step]:
                self._buffers.pop(s).set_result(None)
            self._epoch += 1  # a commit under way with the old buffers starts over
            for s, ask in pending.items():  # the chief reaches s again
                ask.buffers = self._buffers[s] = PyFuture()
                ask.epoch = self._epoch
            self._cv.notify_all()

    def _savers(self, plan) -> list:
        """The shards that write their own files: all, or the tables only (dense on workers)."""
        self.clock = plan.all_shards[0] if self.replica_dense else None
        return plan.table_shards if self.replica_dense else plan.all_shards + plan.table_shards

    def _request(self, step: int) -> list:
        return [comm.invoke(r, "request_save", step) for r in self.shards]

    def capture(self, step: int) -> None:
        """The chief's replica is at `step` outside a step (a membership epoch caught it up)."""
        self._capture(step)

    def _capture(self, step: int) -> None:
        """Buffers for every asked step the chief has reached (one copy shared by all). Runs
        on the training thread only, as everything that touches `_buffers` does."""
        due = [s for s in self._buffers if s <= step]
        if due:
            try:
                state = (self.buffers(), self._dense_at(step))
            except Exception as e:  # the clock's PS lost as it answers: a membership epoch
                if not network_failure(e):  # comes; these steps are not committed, the next is
                    raise
                log.warning("checkpoint steps %s skipped: the clock's counters did not come "
                            "(%s)", due, first_line(e))
                state = None
            for s in due:
                self._buffers.pop(s).set_result(
                    state if s == step or self.replica_dense is None else None)

    def _dense_at(self, step: int) -> Optional[tuple]:
        """With update.dense=allreduce: the chief's replica and the clock's counters at `step`
        (sync with every worker: the clock cannot pass a step without the chief's next push)."""
        if self.replica_dense is None:
            return None
        return self.replica_dense(), comm.invoke(self.clock, "counters").wait()

    def save(self, step: int) -> PyFuture:
        """Ask every shard for step `step`; the manifest follows once all have written it."""
        if step not in self._asked:
            if checkpoint.is_committed(self.root, step):
                self._asked[step] = self._keep_committed(step)
            else:
                self._buffers[step] = PyFuture()
                with self._cv:
                    ask = self._pending[step] = _Ask(step, self._request(step),
                                                     self._buffers[step], self._epoch)
                self._asked[step] = self._pool.submit(self._commit, ask)
        return self._asked[step]

    def _keep_committed(self, step: int) -> PyFuture:
        """A committed step is never rewritten (a crash halfway would leave it half old, half
        new): the step this run restored from is already what it would save; any other is an
        earlier run's that the restore skipped, left alone for whoever wants to look at it."""
        folder = checkpoint.step_dir(self.root, step)
        if step == self.start:
            log.info("checkpoint step %d: this run started from %s; kept as it is", step, folder)
        else:
            log.warning("checkpoint step %d not made: %s already holds a committed checkpoint "
                        "(from an earlier run); committed steps are never overwritten",
                        step, folder)
        done: PyFuture = PyFuture()
        done.set_result(False)
        return done

    def _commit(self, ask: _Ask) -> bool:
        try:
            while True:
                infos, epoch = self._answers(ask)
                if infos is None:
                    return False
                done = self._write(ask.step, infos, ask)
                with self._cv:
                    if done or ask.epoch == epoch:  # else asked again meanwhile: start over
                        return done
        finally:
            with self._cv:
                self._pending.pop(ask.step, None)

    def _answers(self, ask: _Ask) -> tuple[Optional[list], int]:
        """Every shard's file info for the step, and the epoch it was asked in; after a
        membership change, the new epoch's (the old group's answers fail when it ends). None:
        the group ended and no new epoch asked again within wait_s (or training is over)."""
        while True:
            with self._cv:
                futures, epoch = ask.futures, ask.epoch
            try:
                return [f.wait() for f in futures], epoch
            except Exception as e:  # the group ended (a rank joined again) while it waited
                with self._cv:
                    again = self._cv.wait_for(lambda: ask.epoch != epoch or self._closing,
                                              timeout=self.wait_s) and ask.epoch != epoch
                if not again:
                    log.warning("checkpoint step %d not made (%s); keeping the last one",
                                ask.step, first_line(e))
                    return None, epoch
                log.info("checkpoint step %d: asked again after a membership change", ask.step)

    def _write(self, step: int, infos: list, ask: _Ask) -> bool:
        """The buffers and the manifest of `step` once every shard saved it."""
        failed = [info["error"] for info in infos if info is not None and "error" in info]
        if failed:  # a write failed (a full disk, a lost mount): said, and said again at the end
            self.errors[step] = "; ".join(failed)
            log.warning("checkpoint step %d not made: %s; keeping the last one", step,
                        self.errors[step])
            return False
        missing = [f"ps{self.layout.shard_ps[k]}/shard{k}" if k < self.dense  # not always ps{k}
                   else f"ps{k - self.dense}/tables" for k, info in enumerate(infos) if info is None]
        if missing:
            log.info("checkpoint step %d not made (%s did not save it); keeping the last one",
                     step, ", ".join(missing))
            return False
        with self._cv:
            buffers, epoch = ask.buffers, ask.epoch
        try:
            state = buffers.result(timeout=self.wait_s)
        except PyTimeout:
            state = None
        with self._cv:
            if ask.epoch != epoch:  # rolled back meanwhile: these answers are of gone shards
                return False
        if state is None:
            log.warning("checkpoint step %d not made: the chief did not reach it within %.0f s "
                        "to add its buffers; keeping the last one", step, self.wait_s)
            return False
        buffers, dense = state
        if dense is not None and dense[0].version != step:  # cannot happen in sync: said if so
            log.warning("checkpoint step %d not made: the chief's replica was at step %d",
                        step, dense[0].version)
            return False
        try:
            dense_files = (infos[:self.dense] if dense is None
                           else _save_dense(self.root, step, *dense))
            entry = checkpoint.save_buffers(self.root, step, buffers)
            tables = ({**self.tables, "files": infos[self.dense:]}
                      if self.tables is not None else None)
            checkpoint.write_manifest(self.root, step, self.layout, dense_files,
                                      self.extra, entry, tables)
        except checkpoint.StepCommitted as e:
            log.warning("checkpoint step %d not made: %s", step, e)
            return False
        except OSError as e:
            self.errors[step] = f"the chief: {e.strerror} ({e.filename})"
            log.warning("checkpoint step %d not made: %s", step, self.errors[step])
            return False
        self.good.add(step)
        checkpoint.prune(self.root, self.keep, step, self.good)
        log.info("checkpoint step %d saved in %s", step, checkpoint.step_dir(self.root, step))
        return True

    def final(self, step: int) -> Optional[str]:
        """The last checkpoint, at the step training ended on; waits for every manifest.
        Returns why it could not be written (None: written, or nothing to write)."""
        self.save(step)
        self._capture(step)
        with self._cv:  # no new epoch will ask again a step whose answers were lost
            self._closing = True
            self._cv.notify_all()
        for fut in self._buffers.values():  # asked past the end: the shards answer None too
            fut.set_result(None)
        self._buffers.clear()
        for fut in list(self._asked.values()):
            fut.result()
        self._pool.shutdown(wait=True)
        return self.errors.get(step)


def _save_dense(root, step: int, dense, counters: dict) -> list[dict]:
    """The dense files of `step` from the chief's replica, as a PS writes a shard's: the clock
    shard's counters go with the first (what a restore carries over)."""
    return [checkpoint.save_shard(root, {
        "shard": k, "version": step, "params": flat,
        "optimizer": {"state": {0: st} if st else {}, "param_groups": []},
        "stats": counters if k == 0 else {}}) for k, (flat, st) in enumerate(zip(dense.flats,
                                                                             dense.states))]


def build_saver(cfg, plan, start_step: int, buffers: Callable[[], dict],
                dense: Optional[Callable] = None) -> Optional[CheckpointSaver]:
    if not cfg.checkpoint.dir:
        return None
    margin = 1 if cfg.update.name == "sync" else 2 * cfg.cluster.num_workers
    saver = CheckpointSaver(cfg, plan, start_step, margin, buffers, rpc_timeout_s(cfg), dense)
    # Before the first save: a committed step that no longer loads (restore skipped it) is set
    # aside now, so that it neither blocks a save of its step nor counts toward keep.
    checkpoint.prune(saver.root, saver.keep, start_step, saver.good)
    return saver

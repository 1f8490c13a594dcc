"""The chief's checkpoint saver hook: every `checkpoint.every_steps` global steps (the shards save
those by themselves), every `checkpoint.every_s` seconds (the chief asks for a step a little
ahead), and at the end. Once every shard has written step N, the chief writes N's manifest: the
commit point. Manifests are written by one background thread, in order, off the training path.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future as PyFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from psrpc import checkpoint, comm
from psrpc.hooks import Hook, StepInfo

log = logging.getLogger("psrpc")


class CheckpointSaver(Hook):
    def __init__(self, cfg, plan, start_step: int, margin: int):
        ck = cfg.checkpoint
        self.root, self.every_steps, self.every_s, self.keep = ck.dir, ck.every_steps, ck.every_s, ck.keep
        self.shards, self.layout = plan.all_shards, plan.layout
        self.margin = margin  # steps ahead a time-based save is asked for
        self.extra = {"model": cfg.model.name, "optim": cfg.optim.name,
                      "update": cfg.update.name, "num_workers": cfg.cluster.num_workers}
        self._next = (start_step // self.every_steps + 1) * self.every_steps if self.every_steps else None
        self._last_time = time.monotonic()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="chief-manifest")
        self._asked: dict[int, PyFuture] = {}

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

    def save(self, step: int) -> PyFuture:
        """Ask every shard for step `step`; the manifest follows once all have written it."""
        if step not in self._asked:
            futures = [comm.invoke(r, "request_save", step) for r in self.shards]
            self._asked[step] = self._pool.submit(self._commit, step, futures)
        return self._asked[step]

    def _commit(self, step: int, futures) -> bool:
        infos = [f.wait() for f in futures]
        missing = [f"ps{self.layout.shard_ps[k]}/shard{k}"  # shard k is not always on ps{k}
                   for k, info in enumerate(infos) if info is None]
        if missing:
            log.info("checkpoint step %d not made (%s did not save it); keeping the last one",
                     step, ", ".join(missing))
            return False
        checkpoint.write_manifest(self.root, step, self.layout, infos, self.extra)
        checkpoint.prune(self.root, self.keep, step)
        log.info("checkpoint step %d saved in %s", step, checkpoint.step_dir(self.root, step))
        return True

    def final(self, step: int) -> None:
        """The last checkpoint, at the step training ended on; waits for every manifest."""
        self.save(step)
        for fut in list(self._asked.values()):
            fut.result()
        self._pool.shutdown(wait=True)


def build_saver(cfg, plan, start_step: int) -> Optional[CheckpointSaver]:
    if not cfg.checkpoint.dir:
        return None
    margin = 1 if cfg.update.name == "sync" else 2 * cfg.cluster.num_workers
    return CheckpointSaver(cfg, plan, start_step, margin)

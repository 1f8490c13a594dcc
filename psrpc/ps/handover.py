"""The row gradients the workers' hot-row caches still hold when training ends
(`sparse.cache_writes=hold`, psrpc/worker/cache.py), on a table shard.

Each worker hands its held sums to every table shard after its last step (an empty payload when
it holds none: the last steps before the end flush the caches, an early stop does not). The
chief settles every shard before the final checkpoint; a table shard's settle waits, besides
its last step, until every worker still in the run has handed over (or `wait_s` passes: a
worker gone since is named in a warning), then applies them all as one update that moves no
step: in sync, the sums of every worker, in worker order, averaged as a round averages
(divided by the gradients a round takes); in async, each worker's as its own update, as its
pushes are. The final checkpoint, model.pt and the exported tables then hold them. Nothing
held, nothing applied: a run that ends at train.steps keeps its bits.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import torch

from psrpc.cluster import comm
from psrpc.errors import PushRejected

log = logging.getLogger(__name__)


class HandOver:
    def __init__(self, shard, expected: bool, wait_s: float):
        self.shard, self.expected, self.wait_s = shard, expected, wait_s
        self.given: dict[int, list[dict]] = {}  # worker -> its payloads (usually one)
        self.applied: Optional[dict[int, int]] = None  # worker -> rows applied, once done
        self.missing: list[int] = []  # workers that had not handed over by then
        self._changed = threading.Condition(shard.lock)

    def take(self, worker: int, payload) -> int:
        """A worker's held sums ({table: (local rows, sums)}); returns how many rows."""
        shard = self.shard
        with shard.lock:
            if type(worker) is not int or not 0 <= worker < shard.num_workers:
                raise PushRejected(f"{shard.name}: held gradients from unknown worker "
                                   f"{worker!r}")
            shard._check_payload(worker, payload)
            if self.applied is not None:
                log.warning("%s: worker%d handed over held gradients after they were applied: "
                            "dropped", shard.name, worker)
                return 0
            self.given.setdefault(worker, []).append(payload)
            self._changed.notify_all()
        return sum(int(item[0].numel()) for item in payload.values())

    def settle(self, at_end: torch.futures.Future, wait_s: Optional[float]):
        """The Future of the version once the shard is at its last step and the held gradients
        are applied."""
        if not self.expected:
            return at_end
        def then(version, out):
            threading.Thread(target=self._apply_when_given, args=(out, version, wait_s),
                             name=f"{self.shard.name}-handover", daemon=True).start()
        return comm.chain(at_end, then)

    def _apply_when_given(self, out: torch.futures.Future, version: int,
                          wait_s: Optional[float]) -> None:
        shard = self.shard
        deadline = time.monotonic() + (self.wait_s if wait_s is None else wait_s)
        try:
            with shard.lock:
                self._changed.wait_for(lambda: self.applied is not None or not self._waiting(),
                                       timeout=max(0.0, deadline - time.monotonic()))
                if self.applied is None:
                    self.missing = sorted(self._waiting())
                    if self.missing:
                        log.warning("%s: no held row gradients from %s by the end: the final "
                                    "checkpoint goes without them", shard.name,
                                    ", ".join(f"worker{w}" for w in self.missing))
                    self._apply()
                version = shard.version
        except Exception as e:
            log.exception("%s: applying the held row gradients failed", shard.name)
            out.set_exception(e)
            return
        out.set_result(version)

    def _waiting(self) -> set[int]:
        return self.shard.updater.live.alive - set(self.given)

    def _apply(self) -> None:
        """Under the lock: every payload, in worker order (see the module's docstring)."""
        shard = self.shard
        workers = sorted(self.given)
        self.applied = {w: sum(int(i[0].numel()) for p in self.given[w] for i in p.values())
                        for w in workers}
        payloads = [p for w in workers for p in self.given[w] if p]
        if not payloads:
            return
        if not all(shard._finite(p) for p in payloads):
            log.warning("%s: non-finite held row gradients at the end: not applied", shard.name)
            return
        if hasattr(shard.updater, "needed"):  # sync: as a round of `needed` gradients
            update = shard.average(payloads)
            n = shard.updater.needed()
            if n != len(payloads):
                update = {k: (v[0], v[1] * (len(payloads) / n)) for k, v in update.items()}
            shard.step_optimizer(update)
        else:  # async: each as a push of its own
            for p in payloads:
                shard.step_optimizer(shard.average([p]))
        if shard.journal is not None:  # to the backups too (at the same version)
            shard.journal.commit(shard.version)

    def report(self) -> dict:
        """Rows applied per worker (None: not yet), and who never handed over."""
        if not self.expected:
            return {}
        return {"handed_over": self.applied, "hand_over_missing": self.missing}

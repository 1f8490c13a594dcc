"""The chief (worker0), as TensorFlow's MonitoredTrainingSession: the session loop. It starts
the cluster (`bootstrap`: fresh or restored), trains as a worker, runs the hooks, collects the
workers at the end, commits the final checkpoint, writes the run's outputs (`outputs`) and stops
every process.

Other ranks reach the chief through three module-level functions (RPC calls module functions by
reference): `get_plan` (async: answered once the shards exist), `report_done` and `ping`.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from psrpc import comm, outputs
from psrpc.bootstrap import bootstrap
from psrpc.config import Config
from psrpc.errors import PsrpcError
from psrpc.hooks import Hooks, RunContext, StepInfo, Throughput, default_hooks
from psrpc.saver import build_saver
from psrpc.shard import Reply
from psrpc.topology import Topology
from psrpc.worker import Plan, Worker

log = logging.getLogger("psrpc")

_PLAN = torch.futures.Future()  # completed by the chief with the Plan (or its error)
_DONE: dict[int, dict] = {}  # worker index -> its stats, as workers finish
_DONE_LOCK = threading.Condition()
_STOP_REQUESTED = threading.Event()  # SIGTERM/SIGINT on the chief: end at the next step


@comm.async_execution
def get_plan() -> torch.futures.Future:
    return _PLAN


def report_done(worker: int, stats: dict) -> None:
    with _DONE_LOCK:
        _DONE[worker] = stats
        _DONE_LOCK.notify_all()


def ping() -> bool:
    return True


def stop_at_next_step() -> None:
    """Stop training at the next step, with a final checkpoint (the signal handler calls it)."""
    _STOP_REQUESTED.set()


class Chief:
    def __init__(self, cfg: Config, topo: Topology, out_dir: Path, worker_cls=Worker):
        self.cfg, self.topo, self.out_dir = cfg, topo, Path(out_dir)
        self.worker_cls = worker_cls
        self.throughput = Throughput(cfg.train.warmup_steps)
        self.hooks: Optional[Hooks] = None
        self.plan: Optional[Plan] = None
        self.lost: list[int] = []  # workers that never reported done
        self.stopped_early = False
        self.saver = None

    def initialise(self):
        """Create the shards (fresh or restored) and hand the plan to the workers."""
        try:
            self.plan, model, dataset = bootstrap(self.cfg, self.topo, self.worker_cls)
        except Exception as e:
            _PLAN.set_exception(PsrpcError(f"the chief failed to initialise: {e}"))
            raise
        _PLAN.set_result(self.plan)
        return model, dataset

    # -- train ---------------------------------------------------------------------------------
    def after_step(self, reply: Reply, push_s: float, local_loss: float) -> bool:
        """The worker loop's callback; returns True to end training."""
        info = StepInfo(reply.version, reply.loss, reply.samples, reply.stale_dropped,
                        push_s * 1e3, local_loss=local_loss)
        self.throughput.after_step(info)
        self.hooks.after_step(info)
        if (info.stop or _STOP_REQUESTED.is_set()) and not reply.finished:
            self.stop_early()
            return True
        return False

    def stop_early(self) -> None:
        """Freeze every shard where it is; workers get 'finished' at their next push."""
        self.stopped_early = True
        versions = comm.wait_all([comm.invoke(r, "freeze") for r in self.plan.all_shards])
        log.warning("stopping at step %d (asked to stop)%s", versions[0],
                    "" if len(set(versions)) == 1 else f"; shards stopped at {versions}")

    def run(self) -> dict:
        t_start = time.perf_counter()
        model, dataset = self.initialise()
        worker = self.worker_cls(self.cfg, self.topo, self.plan, model=model, dataset=dataset)
        evaluate = outputs.Evaluator(worker, self.cfg.train.eval_batch_size)
        start = self.plan.restored_from_step or 0
        self.saver = build_saver(self.cfg, self.plan, start, worker.buffers)
        extra = [self.saver] if self.saver else []
        extra += [_instantiate(h) for h in self.cfg.hooks]
        self.hooks = Hooks(default_hooks(self.out_dir, self.cfg) + extra)
        self.hooks.begin(RunContext(start, self.cfg.train.steps, self.out_dir,
                                    lambda: evaluate(outputs.gather(self.plan, worker))))
        t_train = time.perf_counter()
        worker.run(self.after_step)
        wall_s = time.perf_counter() - t_train
        self.lost = self.collect_workers()
        summary = self.finish(worker, evaluate, wall_s, time.perf_counter() - t_start)
        self.hooks.end(summary)
        return summary

    def collect_workers(self) -> list[int]:
        """Wait for every other replica leader's done report; the silent ones count as lost."""
        others = set(range(self.topo.stages, self.topo.num_workers, self.topo.stages))
        deadline = time.monotonic() + self.cfg.update.timeout_s
        with _DONE_LOCK:
            while not others <= set(_DONE) and time.monotonic() < deadline:
                _DONE_LOCK.wait(timeout=max(0.0, deadline - time.monotonic()))
            lost = sorted(others - set(_DONE))
        if lost:
            log.warning("no done report from %s within %.0f s (update.timeout_s): counted lost",
                        ", ".join(f"worker{w}" for w in lost), self.cfg.update.timeout_s)
        return lost

    # -- end -----------------------------------------------------------------------------------
    def finish(self, worker: Worker, evaluate, wall_s: float, total_s: float) -> dict:
        """Final checkpoint first (a signal gives little time), then model.pt and the summary;
        the final evaluation is skipped when a signal stopped the run."""
        reports = comm.wait_all([comm.invoke(r, "report") for r in self.plan.all_shards])
        if self.saver is not None:
            self.saver.final(reports[0]["version"])
        state = outputs.gather(self.plan, worker)
        signalled = _STOP_REQUESTED.is_set()
        accuracy = None if signalled else evaluate(state)
        summary = outputs.make_summary(
            self.cfg, self.topo, self.plan, reports, wall_s=wall_s, total_s=total_s,
            samples_per_s=self.throughput.samples_per_s(), accuracy=accuracy, lost=self.lost,
            stopped_early=self.stopped_early,
            workers={0: vars(worker.stats), **{w: s for w, s in _DONE.items()}})
        outputs.write_outputs(self.out_dir, state, summary)
        outputs.log_done(summary, self.out_dir)
        return summary


def _instantiate(spec):
    from hydra.utils import instantiate

    return instantiate(spec)

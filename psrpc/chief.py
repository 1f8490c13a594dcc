"""The chief (worker0), as TensorFlow's MonitoredTrainingSession: initialises the cluster (or
restores it from the newest checkpoint), trains as a worker, runs the hooks, collects the workers
at the end, writes the run's outputs and stops every process.

Other ranks reach the chief through three module-level functions (RPC calls module functions by
reference): `get_plan` (async: answered once the shards exist), `report_done` and `ping`.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from psrpc import checkpoint, comm
from psrpc.config import Config
from psrpc.data import load_dataset
from psrpc.errors import PsrpcError
from psrpc.faults import build_faults
from psrpc.hooks import Hooks, RunContext, StepInfo, Throughput, default_hooks
from psrpc.layout import Layout
from psrpc.pipeline import cut_points, stage_shapes
from psrpc.saver import build_saver
from psrpc.shard import Reply, Shard, ShardSpec
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


def request_stop() -> None:
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
        self._eval_model = None

    # -- start ---------------------------------------------------------------------------------
    def initialise(self):
        """Build the model (seeded) or restore the newest checkpoint, create the shards on the
        PS (per pipeline stage in model-parallel mode), hand the plan to the workers."""
        cfg = self.cfg
        try:
            torch.manual_seed(cfg.train.seed)
            dataset = load_dataset(cfg.data, cfg.train.seed)
            model = self.worker_cls.build_model(cfg, dataset)
            cuts, layouts = self._plan_layouts(model)
            layout = Layout.concat(layouts)
            restored = checkpoint.find_latest(cfg.checkpoint.dir)
            flats, states = self._initial_state(model, layout, restored)
            shards = self._create_shards(layouts, layout, flats, states, restored)
            self.plan = Plan(layouts, shards, cuts, restored.step if restored else None)
        except Exception as e:
            _PLAN.set_exception(PsrpcError(f"the chief failed to initialise: {e}"))
            raise
        _PLAN.set_result(self.plan)
        log.info("%d parameters in %d shard(s) of %s elements; %d workers%s, update=%s",
                 sum(layout.shard_numel), layout.num_shards,
                 "/".join(str(n) for n in layout.shard_numel), self.topo.num_workers,
                 f" ({self.topo.replicas} replicas × {len(cuts)} stages, cuts {cuts})"
                 if len(cuts) > 1 else "", cfg.update.name)
        return model, dataset

    def _plan_layouts(self, model) -> tuple[list[int], list[Layout]]:
        """Where every parameter goes: one layout per pipeline stage (data parallel: one)."""
        cfg = self.cfg
        if cfg.parallel.name == "data":
            cuts, shapes = [0], [{n: tuple(p.shape) for n, p in model.named_parameters()}]
        else:
            cuts = cut_points(model, cfg.parallel.stages, cfg.parallel.split)
            shapes = stage_shapes(model, cuts)
        return cuts, [Layout.plan(sh, self.topo.num_ps, cfg.cluster.max_shard_bytes,
                                  cfg.cluster.bucket_bytes) for sh in shapes]

    def _initial_state(self, model, layout: Layout, restored: Optional[checkpoint.Restored]):
        """Flat parameters and optimizer state per shard: the fresh model's, or the checkpoint's
        re-split for this layout."""
        if restored is None:
            named = {n: p.detach() for n, p in model.named_parameters()}
            return layout.split(named), [None] * layout.num_shards
        self._check_restorable(restored)
        flats, states = checkpoint.reshard(restored, layout)
        log.info("restored step %d from %s (%d shard(s) -> %d)", restored.step,
                 checkpoint.step_dir(self.cfg.checkpoint.dir, restored.step),
                 restored.layout.num_shards, layout.num_shards)
        return flats, states

    def _create_shards(self, layouts, layout, flats, states, restored) -> list[list]:
        """One Shard per (stage, bucket) on its PS, via rpc.remote; RRefs grouped by stage."""
        cfg, topo = self.cfg, self.topo
        version = restored.step if restored else 0
        stats = _stats_for(restored)
        stage_of = [s for s, lay in enumerate(layouts) for _ in range(lay.num_shards)]
        shards = []
        for g, k in enumerate(layout.shard_ps):  # shard g lives on ps{k}
            name = f"ps{k}/shard{g}" + (f"/stage{stage_of[g]}" if len(layouts) > 1 else "")
            spec = ShardSpec(g, flats[g], cfg.optim, cfg.update, topo.replicas, cfg.train.steps,
                             version, states[g], cfg.checkpoint.dir, cfg.checkpoint.every_steps,
                             build_faults(cfg.fault, "ps", k, topo.restart_count), stats, name)
            shards.append(comm.remote(topo.ps_names[k], Shard, args=(spec,)))
        comm.wait_all([comm.invoke(r, "report") for r in shards])  # a constructor's error
        return [[r for r, s in zip(shards, stage_of) if s == stage] for stage in range(len(layouts))]

    def _check_restorable(self, restored: checkpoint.Restored) -> None:
        saved_optim = restored.manifest.get("optim")
        if saved_optim != self.cfg.optim.name:
            raise PsrpcError(
                f"checkpoint.dir={self.cfg.checkpoint.dir}: step-{restored.step} was saved with "
                f"optim={saved_optim}, this run uses optim={self.cfg.optim.name}; use another "
                "checkpoint.dir or the same optimizer")

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
        start = self.plan.restored_from_step or 0
        saver = build_saver(self.cfg, self.plan, start)
        extra = [saver] if saver else []
        extra += [_instantiate(h) for h in self.cfg.hooks]
        self.hooks = Hooks(default_hooks(self.out_dir, self.cfg) + extra)
        self.hooks.begin(RunContext(start, self.cfg.train.steps, self.out_dir,
                                    lambda: self.evaluate(worker, self.gather(worker))))
        t_train = time.perf_counter()
        worker.run(self.after_step)
        wall_s = time.perf_counter() - t_train
        self.lost = self.collect_workers()
        summary = self.finish(worker, wall_s, self.lost, time.perf_counter() - t_start)
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
    def gather(self, worker: Worker) -> dict:
        """The full model's state_dict: parameters from the shards, buffers (BatchNorm
        statistics) from the chief's replica (its stages, in model parallel); CPU tensors."""
        flats = [f[1] for f in comm.wait_all([comm.invoke(r, "pull_full")
                                             for r in self.plan.all_shards])]
        state = self.plan.layout.join(flats)
        state.update(worker.buffers())
        return state

    def finish(self, worker: Worker, wall_s: float, lost: list[int], total_s: float) -> dict:
        plan, cfg = self.plan, self.cfg
        state = self.gather(worker)
        reports = comm.wait_all([comm.invoke(r, "report") for r in plan.all_shards])
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(state, self.out_dir / "model.pt")
        accuracy = self.evaluate(worker, state)
        r0 = reports[0]
        summary = {
            "update": cfg.update.name, "parallel": cfg.parallel.name,
            "num_ps": self.topo.num_ps, "num_workers": self.topo.num_workers,
            "steps": r0["version"], "samples": r0["samples"],
            "wall_s": round(wall_s, 3), "total_s": round(total_s, 3),
            "samples_per_s": _round(self.throughput.samples_per_s()),
            "final_loss": _round(r0["loss"], 6),
            "test_accuracy": _round(accuracy, 6),
            "stale_dropped": r0["stale_dropped"],
            "nan_rejected": sum(r["nan_rejected"] for r in reports),
            "max_staleness": max(r["max_staleness"] for r in reports),
            "mean_staleness": _round(r0["mean_staleness"], 4),
            "workers_lost": len(lost),
            "restored_from_step": plan.restored_from_step,
            "stopped_early": self.stopped_early,
            "shards": reports,
            "workers": {0: vars(worker.stats), **{w: s for w, s in _DONE.items()}},
        }
        with open(self.out_dir / "summary.json", "w") as f:
            json.dump(summary, f, indent=2)
        acc = f"{accuracy:.4f}" if accuracy is not None else "n/a"
        log.info("done: %d steps, %d samples in %.1f s (%s samples/s), loss %s, test accuracy %s; "
                 "outputs in %s", summary["steps"], summary["samples"], wall_s,
                 summary["samples_per_s"], summary["final_loss"], acc, self.out_dir)
        return summary

    def evaluate(self, worker: Worker, state: dict) -> Optional[float]:
        """Test accuracy of `state` (None when the data has no test split), on a copy of the
        chief's model so its training replica is left alone."""
        test = worker.data.test
        if test is None:
            return None
        if self._eval_model is None:
            self._eval_model = copy.deepcopy(worker.model)
        model = self._eval_model
        model.load_state_dict(state)  # copies onto the model's device
        model.eval()
        correct, bs = 0, self.cfg.train.eval_batch_size
        with torch.no_grad():
            for i in range(0, len(test), bs):
                x, y = test.x[i:i + bs].to(worker.device), test.y[i:i + bs].to(worker.device)
                correct += int((model(x).argmax(1) == y).sum())
        return correct / len(test)


def _stats_for(restored: Optional[checkpoint.Restored]) -> Optional[dict]:
    """Counters carried over a restore: shard 0's (every shard sees every push)."""
    return dict(restored.shards[0]["stats"]) if restored and "stats" in restored.shards[0] else None


def _instantiate(spec):
    from hydra.utils import instantiate

    return instantiate(spec)


def _round(x, nd: int = 2):
    return None if x is None else round(float(x), nd)

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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch
from hydra.utils import instantiate

from psrpc import checkpoint
from psrpc.cluster import comm, membership, netstat, partitions
from psrpc.cluster.topology import Topology, in_lockstep
from psrpc.cluster.wire import Reply
from psrpc.config import Config
from psrpc.errors import PsrpcError, first_line, network_failure
from psrpc.ps import service
from psrpc.session import failover, outputs
from psrpc.cluster.layout import Layout
from psrpc.session.bootstrap import (bootstrap, create_shards, create_table_shards, initial_state,
                                     split_dense)
from psrpc.session.hooks import (BestModel, Evaluate, Hooks, RunContext, StepInfo, Throughput,
                                 default_hooks)
from psrpc.session.saver import build_saver
from psrpc.worker.data_parallel import Worker
from psrpc.worker.plan import Plan
from psrpc.worker.replica import await_change

log = logging.getLogger("psrpc")

_PLANS: dict[int, torch.futures.Future] = {}  # membership epoch -> its Plan (or the error)
# After SIGTERM, how long the chief waits for the others to end their step, and a PS or worker
# for the chief's stop while it still trains (psrpc/process.py).
STOP_WAIT_S = 8.0
_PLANS_LOCK = threading.Lock()
_DONE: dict[int, dict] = {}  # worker index -> its stats, as workers finish
_DONE_LOCK = threading.Condition()
_STOP_REQUESTED = threading.Event()  # SIGTERM/SIGINT on the chief: end at the next step
_FINISHING = threading.Event()  # training is over: final checkpoint and outputs under way


def _plan_future(epoch: int) -> torch.futures.Future:
    with _PLANS_LOCK:
        return _PLANS.setdefault(epoch, torch.futures.Future())


@comm.async_execution
def get_plan(epoch: int = 0) -> torch.futures.Future:
    """The plan of membership epoch `epoch`, once the chief has made it."""
    return _plan_future(epoch)


def report_done(worker: int, stats: dict) -> None:
    with _DONE_LOCK:
        _DONE[worker] = stats
        _DONE_LOCK.notify_all()


def ping() -> str:
    """'training', or 'finishing' once training is over and the chief is writing the final
    checkpoint and outputs (the other ranks must stay until it is done)."""
    return "finishing" if _FINISHING.is_set() else "training"


def stop_at_next_step() -> None:
    """Stop training at the next step, with a final checkpoint (the signal handler calls it)."""
    _STOP_REQUESTED.set()


def _gone_workers(topo: Topology, epoch: int) -> tuple[int, ...]:
    """The data-parallel workers out of epoch `epoch` for good, by index (no round waits for
    them)."""
    if topo.stages != 1:
        return ()
    return tuple(topo.worker_names.index(n) for n in membership.gone(epoch)
                 if n in topo.worker_names)


@dataclass
class EpochCause:
    """Why a membership epoch began: the ranks started again or cut off, and since when."""

    who: str                  # their names, comma-separated (or why nobody)
    cut_off: list[str]        # those cut off by a partition, not started again
    seen_at: Optional[float]  # when the first of them was seen gone (time.time())


@dataclass
class EpochOutcome:
    """What the start of an epoch did to the shards: the plan it hands out, and how."""

    plan: Plan
    rolled_back_to: Optional[int] = None  # the checkpoint step every shard rolled back to
    failovers: list[dict] = field(default_factory=list)  # shards now on a former backup


class Chief:
    def __init__(self, cfg: Config, topo: Topology, out_dir: Path, replica_cls=Worker):
        self.cfg, self.topo, self.out_dir = cfg, topo, Path(out_dir)
        self.replica_cls = replica_cls
        self.throughput = Throughput(cfg.train.untimed_steps)
        self.hooks: Optional[Hooks] = None
        self.plan: Optional[Plan] = None
        self.lost: list[int] = []  # workers that never reported done
        self.stopped_early = False
        self.saver = None
        self.final_checkpoint_error: Optional[str] = None
        self.epochs: list[dict] = []  # membership epochs after the first
        self.first_epoch = 0  # the one it joined at start
        self.worker = None  # the chief's own replica (run)

    def initialise(self):
        """Create the shards (fresh or restored) and hand the plan to the workers."""
        while True:
            try:
                self.plan, model, dataset = bootstrap(self.cfg, self.topo,
                                                      self.replica_cls.build_model, self.out_dir)
                break
            except Exception as e:
                try:  # a rank died while the shards were made: a membership change, not fatal
                    await_change(e, may_ask=False)  # (a bad folder, say, is no partition)
                except Exception:
                    failed = PsrpcError(f"the chief failed to initialise: {first_line(e)}")
                    _plan_future(membership.current()).set_exception(failed)
                    if network_failure(e):
                        raise failed from e
                    raise
            log.warning("a rank was lost while the chief initialised; initialising again in "
                        "the new membership epoch")
            membership.rejoin()
            # what the failed start made on the PS (shards, shared-memory segments) goes first
            comm.wait_all([comm.call(n, service.reset) for n in self.topo.ps_names])
        # the epoch the chief joined: not always the one it was started for
        _plan_future(membership.current()).set_result(self.plan)
        return model, dataset

    # -- membership epochs ---------------------------------------------------------------------
    def begin_epoch(self, epoch: int) -> Plan:
        """A rank was started again and every rank has joined epoch `epoch`'s group: line the
        shards' versions up (the PS kept them, and their Handles still reach them), or, when a
        PS was started again and lost its shards, roll every shard back to the last committed
        checkpoint; then hand out the epoch's plan. Returns it."""
        t0 = time.monotonic()
        cause = self._epoch_cause(epoch)
        held = comm.wait_all([comm.call(n, service.local_shards) for n in self.topo.ps_names])
        found = {index for part in held for index in part}
        failovers = []
        if self.cfg.cluster.ps_replicas:  # (also drops the copies given up meanwhile)
            self.plan, failovers = failover.fail_over(self.cfg, self.topo, self.plan, found)
        alive = found | {f["shard"] for f in failovers} == {h.key for h in self.plan.every_shard}
        outcome = (EpochOutcome(self._line_up(epoch, failovers), None, failovers) if alive
                   else EpochOutcome(*self._roll_back(epoch, cause.who)))
        self.plan = outcome.plan
        if self.saver is not None:
            self.saver.rebind(outcome.plan)
        if outcome.rolled_back_to is not None:
            self.hooks.rollback(outcome.rolled_back_to)
        self._record_epoch(epoch, cause, outcome, t0)
        if self.cfg.cluster.ps_replicas:  # new backups where copies were lost, in the background
            failover.restore_backups(self.cfg, self.topo, self.plan)
        _plan_future(epoch).set_result(outcome.plan)
        return outcome.plan

    def _epoch_cause(self, epoch: int) -> "EpochCause":
        """Every epoch since the last one the chief was in (a newer one can replace an epoch
        before its group forms: the ranks of both were started again): who, and since when."""
        last = self.epochs[-1]["epoch"] if self.epochs else self.first_epoch
        events = [membership.why(e) for e in range(last + 1, epoch + 1)]
        cut_off = [n for e in range(last + 1, epoch + 1) for n in partitions.cut_off(e)]
        who = ",".join(dict.fromkeys([n for names, _ in events for n in names.split(",") if n]
                                     + cut_off)) or "nobody (a worker lost for good left)"
        seen_at = min((at for _, at in events if at), default=None)
        return EpochCause(who, sorted(set(cut_off)), seen_at)

    def _line_up(self, epoch: int, failovers: list[dict]) -> Plan:
        """Every shard is alive (kept, or failed over): bring them to one version, replaying
        the step a lost PS left unanswered in sync."""
        shards = self.plan.every_shard
        if self.cfg.cluster.ps_replicas:  # no update goes to a copy now gone
            failover.name_backups(self.cfg, self.topo, self.plan)
        lost_round = bool(failovers) and self.cfg.update.name == "sync"
        replay = lost_round and self.cfg.update.dense != "allreduce"  # (not replayed there)
        gone = _gone_workers(self.topo, epoch)
        versions = comm.wait_all([comm.invoke(r, "begin_epoch", replay, gone) for r in shards])
        target = max(versions)
        if lost_round and not replay and len(set(versions)) > 1:
            log.warning("update.dense=allreduce: the step the lost PS left unanswered is "
                        "not pushed again; shards at step %d pass it without its update "
                        "(the result differs from an uninterrupted run's)", min(versions))
        if not replay:  # (a replayed step brings the shards behind to the others)
            comm.wait_all([comm.invoke(r, "catch_up", target) for r in shards])
        plan = replace(self.plan, rolled_back_to=None, replay=replay)
        dense = getattr(self.worker, "allreduce", None)
        if dense is None:
            return plan
        dense.catch_up(target)  # every worker takes the chief's replica, at the target
        plan = replace(plan, dense=dense.state())
        if self.saver is not None:  # a checkpoint step the catch-up reached
            self.saver.capture(target)
        return plan

    def _record_epoch(self, epoch: int, cause: "EpochCause", outcome: "EpochOutcome",
                      t0: float) -> None:
        """summary.json's epochs[] entry, and the line that says it."""
        pause = time.time() - cause.seen_at if cause.seen_at else time.monotonic() - t0
        clock = comm.invoke(outcome.plan.all_shards[0], "report").wait()
        step = clock["version"]
        self.epochs.append({"epoch": epoch, "started_again": cause.who, "at_step": step,
                            "cut_off": cause.cut_off,
                            "pause_s": round(pause, 3), "rolled_back_to": outcome.rolled_back_to,
                            "failovers": outcome.failovers,
                            "applied_before": clock["per_worker_applied"]})
        log.warning("membership epoch %d: %s joined again at step %d%s; the cluster paused "
                    "%.1f s", epoch, cause.who, step,
                    failover.what_moved(outcome.rolled_back_to, outcome.failovers), pause)

    def _roll_back(self, epoch: int, who: str):
        """Every shard from the last committed checkpoint (a PS lost its shards)."""
        restored = checkpoint.find_latest(self.cfg.checkpoint.dir)
        if restored is None:
            error = PsrpcError(f"{who} was started again but its shards are gone and "
                               f"checkpoint.dir={self.cfg.checkpoint.dir} holds no checkpoint "
                               "to roll the others back to: set checkpoint.dir and "
                               "checkpoint.every_steps to recover a lost PS")
            _plan_future(epoch).set_exception(error)
            raise error
        comm.wait_all([comm.call(n, service.drop_shards) for n in self.topo.ps_names])
        failover.forget_fences(self.cfg, self.topo, self.plan)
        model, layout = self.worker_model, self.plan.layout
        flats, states = initial_state(self.cfg, model, layout, restored)
        on_ps, flats, states, dense = split_dense(self.cfg, self.plan.layouts, flats, states,
                                                  restored)
        topo = replace(self.topo, epoch=epoch)  # fault.crash_* crash the first epoch only
        shards = create_shards(self.cfg, topo, on_ps, flats, states, restored, self.plan.shared)
        tables = (create_table_shards(self.cfg, topo, self.plan.table_specs,
                                      Layout.concat(on_ps).num_shards, restored)
                  if self.plan.table_specs else [])
        return replace(self.plan, shards=shards, table_shards=tables, buffers=restored.buffers,
                       rolled_back_to=restored.step, dense=dense), restored.step

    # -- train ---------------------------------------------------------------------------------
    def after_step(self, reply: Reply, push_s: float, local_loss: float) -> bool:
        """The worker loop's callback; returns True to end training at once."""
        info = StepInfo(reply.version, reply.loss, reply.samples, reply.stale_dropped,
                        push_s * 1e3, local_loss=local_loss,
                        epoch=reply.samples / self.train_size)
        self.throughput.after_step(info)
        self.hooks.after_step(info)
        if (info.stop or _STOP_REQUESTED.is_set()) and not (reply.finished or self.stopped_early):
            return self.stop_early(reply.version)
        return False

    def stop_early(self, step: int) -> bool:
        """End training at one step on every shard. Each shard applies updates up to a target
        and no further; the workers (the chief too) go on until their replies say finished.
        When the chief is in every round (sync, no backup or lost worker), no shard can move
        without its next push: the target is where they are, and the chief stops at once.
        Otherwise shards may be a few steps apart or moving: the target leaves room for that.
        Returns True when the chief's loop should end now."""
        self.stopped_early = True
        shards = self.plan.every_shard
        reports = comm.wait_all([comm.invoke(r, "report") for r in shards])
        exact = in_lockstep(self.cfg) and not any(r["workers_lost"] for r in reports)
        margin = 0 if exact else 2 * self.topo.replicas
        target = max(r["version"] for r in reports) + margin
        # the clock shard first: with bounded staleness its issued tickets set the step
        target = comm.invoke(shards[0], "freeze", target).wait()
        ends = [target] + comm.wait_all([comm.invoke(r, "freeze", target) for r in shards[1:]])
        log.warning("stopping at step %d (asked to stop)%s", target,
                    "" if len(set(ends)) == 1 else f"; shards stop at {ends}")
        # With dense all-reduce the others are already in the next step's all-reduce: the chief
        # takes part in it too, and the frozen shards answer everyone 'finished'.
        return exact and step >= target and self.cfg.update.dense != "allreduce"

    def run(self) -> dict:
        t_start = time.perf_counter()
        model, dataset = self.initialise()
        self.first_epoch = membership.current()
        worker = self.replica_cls(self.cfg, self.topo, self.plan, model=model, dataset=dataset)
        worker.plan_source = self.begin_epoch  # the chief makes each epoch's plan itself
        self.worker = worker
        self.worker_model = worker.model
        self.train_size = len(worker.data.train)
        evaluate = outputs.Evaluator(worker, self.cfg)
        start = self.plan.restored_from_step or 0
        dense = getattr(worker, "allreduce", None)
        self.saver = build_saver(self.cfg, self.plan, start, worker.buffers,
                                 dense.state if dense is not None else None)
        ck = self.cfg.checkpoint
        self.best = (BestModel(Path(ck.dir) / "best", evaluate.key, evaluate.higher_is_better)
                     if ck.best and ck.dir else None)

        def evaluate_now():
            state = outputs.gather(self.plan, worker)
            return evaluate(state), state

        hooks = default_hooks(self.out_dir, self.cfg)
        if self.cfg.train.eval_every:
            hooks.append(Evaluate(self.cfg.train.eval_every, evaluate_now, hooks[0], self.best))
        hooks += [self.saver] if self.saver else []
        hooks += [instantiate(h) for h in self.cfg.hooks]
        self.hooks = Hooks(hooks)
        self.hooks.begin(RunContext(start, self.cfg.train.steps, self.out_dir,
                                    lambda: evaluate_now()[0],
                                    lambda: worker.build_model(self.cfg, worker.data)))
        t_train = time.perf_counter()
        while True:
            worker.run(self.after_step)
            # From here on the launcher starts no lost rank again; unless it just announced an
            # epoch: join it (the rank started again needs its plan, and a PS started again
            # rolls every shard back: then training goes on)
            if membership.finish():
                break
            log.warning("a rank was started again as training ended; joining its epoch")
        wall_s = time.perf_counter() - t_train
        _FINISHING.set()
        self.final_checkpoint()  # first: a signal gives little time, and it needs no one else
        self.lost = self.collect_workers()
        summary = self.finish(worker, evaluate, wall_s, time.perf_counter() - t_start)
        self.hooks.end(summary)
        return summary

    def collect_workers(self) -> list[int]:
        """Wait for every other replica leader's done report; the silent ones count as lost.
        After a signal the launcher gives little time: a leader whose process is gone (it
        does not answer a ping) is lost at once instead of waited for until update.timeout_s,
        and STOP_WAIT_S bounds the wait for the others, which only have to end their step."""
        others = set(range(self.topo.stages, self.topo.num_workers, self.topo.stages))
        wait_s, why = self.cfg.update.timeout_s, "update.timeout_s"
        if _STOP_REQUESTED.is_set() and STOP_WAIT_S < wait_s:
            wait_s, why = STOP_WAIT_S, "after the signal"
        deadline = time.monotonic() + wait_s
        gone: set[int] = set()
        while True:
            with _DONE_LOCK:
                waiting = others - set(_DONE) - gone
                if not waiting or time.monotonic() >= deadline:
                    break
                _DONE_LOCK.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            if _STOP_REQUESTED.is_set():
                gone |= {w for w in waiting - set(_DONE) if not self._answers(w)}
        lost = sorted(others - set(_DONE))
        if lost:
            log.warning("no done report from %s%s: counted lost",
                        ", ".join(f"worker{w}" for w in lost),
                        " (its process is gone)" if lost == sorted(gone)
                        else f" within {wait_s:.0f} s ({why})")
        return lost

    def _answers(self, worker: int) -> bool:
        """Whether worker `worker`'s process still answers RPC (any function would do: a
        dead process fails the call at once, a busy one answers from its RPC threads)."""
        try:
            comm.call_sync(self.topo.worker_names[worker], ping, timeout_s=1.0)
            return True
        except Exception:
            return False

    # -- end -----------------------------------------------------------------------------------
    def final_checkpoint(self) -> None:
        """The checkpoint of the step training ended on. The shards no longer change (finished
        or frozen), so it is taken before waiting for the other workers' reports: a lost worker
        would hold it back by update.timeout_s, longer than a launcher's grace after a signal."""
        # Every shard at its last step first (tickets may still be in flight to some)
        steps = self._settle()
        if len(set(steps)) > 1:
            log.warning("shards ended at different steps: %s", steps)
        if self.saver is not None:
            why = self.saver.final(steps[0])
            if why is not None:  # the run ends with its outputs, and then with this error
                newest = next((s for s, f in checkpoint.steps_on_disk(self.cfg.checkpoint.dir)
                               if (f / checkpoint.MANIFEST).exists()), None)
                self.final_checkpoint_error = (
                    f"the final checkpoint (step {steps[0]}) was not written: {why}; "
                    f"checkpoint.dir={self.cfg.checkpoint.dir} holds "
                    + (f"step {newest}, the newest committed" if newest is not None
                       else "no committed checkpoint")
                    + f"; model.pt and summary.json are in {self.out_dir}")

    def _settle(self) -> list[int]:
        """Every shard's last step, once it is there; an error naming the shards that are not
        there within update.timeout_s + 5 s (every worker has stopped pushing by then)."""
        shards = self.plan.every_shard
        timeout = self.cfg.update.timeout_s + 5  # a ticket that never comes is skipped by then
        # the table shards wait for the workers' held row gradients (psrpc/ps/handover.py);
        # after a signal only as long as for the workers' done reports
        wait_s = min(STOP_WAIT_S, self.cfg.update.timeout_s) if _STOP_REQUESTED.is_set() \
            else self.cfg.update.timeout_s
        futures = [comm.invoke(r, "settle", wait_s, timeout_s=timeout + wait_s) for r in shards]
        steps, behind = [], []
        for r, fut in zip(shards, futures):
            try:
                steps.append(fut.wait())
            except Exception as e:
                steps.append(None)
                behind.append(f"{comm.owner_name(r)} ({first_line(e)})")
        if behind:
            raise PsrpcError(f"training ended but {', '.join(behind)} did not reach its last "
                             f"step within {timeout:g} s (update.timeout_s + 5)")
        return steps

    def finish(self, worker: Worker, evaluate, wall_s: float, total_s: float) -> dict:
        """model.pt and the summary, after the final checkpoint; the final evaluation is
        skipped when a signal stopped the run."""
        reports = comm.wait_all([comm.invoke(r, "report") for r in self.plan.every_shard])
        state = outputs.gather(self.plan, worker)
        signalled = _STOP_REQUESTED.is_set()
        tests = (None if signalled else evaluate(state)) or evaluate.empty()
        if self.best is not None:
            self.best.consider(reports[0]["version"], tests, state)
        hidden = outputs.hidden_auc(None if signalled else worker.data.test)
        traffic = netstat.host_traffic(self.topo, self.lost)
        summary = outputs.make_summary(
            self.cfg, self.topo, self.plan, reports, wall_s=wall_s, total_s=total_s,
            samples_per_s=self.throughput.samples_per_s(), tests={**tests, **hidden},
            lost=self.lost, stopped_early=self.stopped_early, epochs=self.epochs,
            final_checkpoint_error=self.final_checkpoint_error, traffic=traffic,
            workers={0: vars(worker.stats), **{w: s for w, s in _DONE.items()}})
        summary.update(failover.compare_replicas(self.cfg, self.topo))
        outputs.write_outputs(self.out_dir, state, summary)
        if self.plan.table_shards:  # each PS writes its rows itself (tables/ps<k>.pt), the
            shards = self.plan.table_shards  # chief the index of them last
            outputs.export_tables(self.out_dir, len(shards), lambda export_id: comm.wait_all(
                [comm.invoke(t, "export", str(self.out_dir), export_id) for t in shards]))
        outputs.log_done(summary, self.out_dir)
        return summary

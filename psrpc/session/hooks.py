"""Hooks on the chief: the users' extension point, as TensorFlow's SessionRunHook.

A hook sees the run begin, every global step the chief observes, and the end. Built in: MetricsLog
(progress line, metrics.jsonl, TensorBoard scalars when installed), Throughput,
StopAtStep, and the checkpoint saver (psrpc/session/saver.py). Add your own from the command line:
`python -m psrpc 'hooks=[{_target_: psrpc.hooks.StopAtStep, last_step: 100}]'`.


    class MyHook(psrpc.hooks.Hook):
        def after_step(self, info: StepInfo) -> None: ...   # info.step, .loss, .samples, ...
        def end(self, summary: dict) -> None: ...

`after_step` runs on the chief's training thread: keep it cheap. Set `info.stop = True` to end
training early (the chief stops the cluster cleanly). `begin(run)` receives a RunContext whose
`evaluate()` gives the test metrics of the current master weights ({"test_accuracy": ...}) and
`make_model()` a fresh model as the config builds it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from psrpc.checkpoint import write_atomic

log = logging.getLogger("psrpc")


@dataclass
class StepInfo:
    step: int  # global step after this update (shard 0's version)
    loss: Optional[float]  # sync: the round's mean loss; async: mean of the last W applied
    samples: int  # samples whose gradients were applied so far
    stale_dropped: int
    push_ms: float  # the chief's wait for this step's push_pull replies
    local_loss: Optional[float] = None  # the chief's own batch loss this step
    epoch: float = 0.0  # passes over the training set so far (samples / its size)
    time: float = field(default_factory=time.perf_counter)
    stop: bool = False  # a hook sets it to end training


@dataclass
class RunContext:
    """What a hook can use: where training starts and ends, where outputs go, and the model."""

    start_step: int  # > 0 after a restore
    total_steps: int
    out_dir: Path
    evaluate: Callable[[], Optional[dict]]  # test metrics of the current master weights
    make_model: Callable[[], object]  # a fresh model as this config builds it (e.g. to load
    # model.pt into at the end)


class Hook:
    def begin(self, run: RunContext) -> None:
        """Training starts."""

    def after_step(self, info: StepInfo) -> None:
        pass

    def rollback(self, step: int) -> None:
        """Every shard went back to the checkpoint of `step` (a PS was lost and started
        again): the next steps are `step + 1`, ... again."""

    def end(self, summary: dict) -> None:
        pass


class Hooks(Hook):
    """Several hooks called in order."""

    def __init__(self, hooks: list[Hook]):
        self.hooks = hooks

    def begin(self, run: RunContext) -> None:
        for h in self.hooks:
            h.begin(run)

    def after_step(self, info: StepInfo) -> None:
        for h in self.hooks:
            h.after_step(info)

    def rollback(self, step: int) -> None:
        for h in self.hooks:
            h.rollback(step)

    def end(self, summary: dict) -> None:
        for h in self.hooks:
            h.end(summary)


class Throughput(Hook):
    """Steady-state samples/s: from the end of step `warmup_steps` to the last step."""

    def __init__(self, warmup_steps: int):
        self.warmup = warmup_steps
        self.first: Optional[StepInfo] = None
        self.start: Optional[StepInfo] = None
        self.last: Optional[StepInfo] = None

    def after_step(self, info: StepInfo) -> None:
        self.first = self.first or info
        if self.start is None and info.step >= self.warmup:
            self.start = info
        self.last = info

    def samples_per_s(self) -> Optional[float]:
        start = self.start if self.start is not self.last else self.first
        if start is None or self.last is None or self.last.time <= start.time:
            return None
        return (self.last.samples - start.samples) / (self.last.time - start.time)


class MetricsLog(Hook):
    """Every `log_every` global steps (and at the last): one console line, one metrics.jsonl
    record, and the same scalars for TensorBoard under out_dir/tensorboard when installed."""

    def __init__(self, out_dir: Path, log_every: int):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.log_every = log_every
        self._file = None
        self._tb = None
        self._window: list[StepInfo] = []
        self._last: Optional[StepInfo] = None
        self._next = log_every
        self._total = 0

    def begin(self, run: RunContext) -> None:
        self._total = run.total_steps
        start_step = run.start_step
        self._next = (start_step // self.log_every + 1) * self.log_every
        self._file = open(self.out_dir / "metrics.jsonl", "a", buffering=1)  # a restart appends
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional
            return
        self._tb = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=start_step + 1)

    def after_step(self, info: StepInfo) -> None:
        self._window.append(info)
        if info.step < self._next and info.step < self._total:
            return
        prev = self._last or self._window[0]
        dt = info.time - prev.time
        record = {"step": info.step, "loss": info.loss, "samples": info.samples,
                  "samples_per_s": round((info.samples - prev.samples) / dt, 2) if dt > 0 else 0.0,
                  "steps_per_s": round((info.step - prev.step) / dt, 3) if dt > 0 else 0.0,
                  "push_ms": round(sum(w.push_ms for w in self._window) / len(self._window), 3),
                  "stale_dropped": info.stale_dropped, "epoch": round(info.epoch, 4)}
        self.record(record)
        loss = f"{info.loss:.4f}" if info.loss is not None else "   n/a"
        log.info("step %5d/%d | epoch %6.2f | loss %s | %8.1f samples/s | push %6.1f ms | "
                 "stale %d", info.step, self._total, info.epoch, loss, record["samples_per_s"],
                 record["push_ms"], info.stale_dropped)
        self._window, self._last = [], info
        self._next = (info.step // self.log_every + 1) * self.log_every

    def rollback(self, step: int) -> None:
        self._window, self._last = [], None
        self._next = (step // self.log_every + 1) * self.log_every

    def record(self, record: dict) -> None:
        """One metrics.jsonl line ({"step": ..., scalars}), the scalars also to TensorBoard."""
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])

    def end(self, summary: dict) -> None:
        if self._file:
            self._file.close()
        if self._tb is not None:
            for key in [k for k in summary if k.startswith("test_")] + ["samples_per_s",
                                                                         "final_loss"]:
                if isinstance(summary.get(key), (int, float)):
                    self._tb.add_scalar(f"summary/{key}", summary[key], summary["steps"])
            self._tb.close()


class Evaluate(Hook):
    """Every `every` global steps: the test metric of the current master weights (gathered from
    the shards) into metrics.jsonl, TensorBoard and the log, and to `best` (BestModel)."""

    def __init__(self, every: int, evaluate: Callable[[], tuple], log_to: MetricsLog,
                 best: Optional["BestModel"] = None):
        self.every, self.evaluate, self.log_to, self.best = every, evaluate, log_to, best
        self._next = every

    def begin(self, run: RunContext) -> None:
        self._next = (run.start_step // self.every + 1) * self.every

    def rollback(self, step: int) -> None:
        self._next = (step // self.every + 1) * self.every

    def after_step(self, info: StepInfo) -> None:
        if info.step < self._next:
            return
        self._next = (info.step // self.every + 1) * self.every
        results, state = self.evaluate()
        if results is None:
            return
        self.log_to.record({"step": info.step, **results})
        log.info("step %5d | %s", info.step,
                 " | ".join(f"{k} {v:.4f}" for k, v in results.items() if v is not None))
        if self.best is not None:
            self.best.consider(info.step, results, state)


class BestModel:
    """The model with the best test metric so far, in `folder` (model.pt and best.json), apart
    from the rolling checkpoints; a restarted run keeps competing with the one on disk."""

    def __init__(self, folder: Path, key: str, higher_is_better: bool):
        self.folder, self.key, self.higher = Path(folder), key, higher_is_better
        self.value: Optional[float] = None
        try:
            self.value = json.loads((self.folder / "best.json").read_text())["value"]
        except (OSError, ValueError, KeyError, TypeError):
            pass

    def consider(self, step: int, results: dict, state: dict) -> bool:
        value = results.get(self.key)
        if value is None or not math.isfinite(value):
            return False
        if self.value is not None and (value <= self.value if self.higher else
                                       value >= self.value):
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        write_atomic(self.folder / "model.pt", state)
        write_atomic(self.folder / "best.json", json.dumps(
            {"step": step, "metric": self.key, "value": value, **results}, indent=1).encode())
        self.value = value
        log.info("best %s so far (%.4f at step %d): saved in %s", self.key, value, step,
                 self.folder)
        return True


class StopAtStep(Hook):
    """End training once the global step reaches `last_step` (before train.steps)."""

    def __init__(self, last_step: int):
        self.last_step = last_step

    def after_step(self, info: StepInfo) -> None:
        if info.step >= self.last_step:
            info.stop = True


def default_hooks(out_dir: Path, cfg) -> list[Hook]:
    """What every run gets: progress line, metrics.jsonl and TensorBoard. (Non-finite
    gradients are skipped by the shards and stop the run after train.nonfinite_patience in a
    row: psrpc.worker.data_parallel.NonfiniteGuard.)"""
    return [MetricsLog(out_dir, cfg.train.log_every)]

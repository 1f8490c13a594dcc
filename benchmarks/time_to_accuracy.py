"""Time to accuracy on real MNIST (cnn): training wall time (evaluations included) until the test
accuracy of the master weights reaches `target`, for psrpc sync, async, sync with a backup worker
and DDP (gloo), without and with worker 0 slowed by `slow` step times.

    python -m benchmarks.time_to_accuracy [target=0.97 slow=[0,2]]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, bench_config, header, psrpc_config, run_psrpc, write_results
from benchmarks.peers import ddp
from psrpc.hooks import Hook, RunContext, StepInfo


class AccuracyProbe(Hook):
    """Chief hook: every `every` global steps, evaluate the master weights; stop training once
    `target` is reached; write tta.json into the run's out_dir. The clock runs on during the
    evaluation, as DDP's does (there the other ranks wait for rank 0; here sync workers wait at
    the barrier and async ones keep training: that is what async buys)."""

    def __init__(self, every: int, target: float):
        self.every, self.target = every, target
        self.reached, self.evals = None, []

    def begin(self, run: RunContext) -> None:
        self.run, self.next, self.t0 = run, self.every, time.perf_counter()

    def after_step(self, info: StepInfo) -> None:
        if info.step < self.next:
            return
        self.next = (info.step // self.every + 1) * self.every
        acc = self.run.evaluate()
        self.evals.append({"step": info.step, "samples": info.samples,
                           "trained_s": round(time.perf_counter() - self.t0, 3),
                           "accuracy": acc})
        if acc >= self.target and self.reached is None:
            self.reached = dict(self.evals[-1])
            info.stop = True

    def end(self, summary: dict) -> None:
        (Path(self.run.out_dir) / "tta.json").write_text(json.dumps(
            {"reached": self.reached, "evals": self.evals}, indent=1))


MODES = {"psrpc_sync": ["update=sync"], "psrpc_async": ["update=async"],
         "psrpc_backup": ["update=sync", "update.replicas_to_aggregate=1"]}


def main(argv: list[str]) -> None:
    b = bench_config("time_to_accuracy", argv)
    meta = header()
    root = (ROOT / b.data_root).resolve()
    epoch_steps = 60000 // (b.workers * b.batch_size)
    base = ["data=mnist", f"data.root={root}", "model=cnn", f"cluster.num_workers={b.workers}",
            f"train.batch_size={b.batch_size}", "train.untimed_steps=0", "train.log_every=100"]
    cfg = psrpc_config(base + [f"train.steps={epoch_steps // 4}", "train.untimed_steps=10"])
    step_s = b.workers * b.batch_size / ddp(cfg)["samples_per_s"]
    print(f"one DDP step without a straggler: {step_s * 1e3:.1f} ms", flush=True)
    rows = []
    for slow in b.slow:
        for system in b.systems:
            lr = b.lr[system]
            if system == "ddp":
                cfg = psrpc_config(base + [f"optim.lr={lr}",
                                           f"train.steps={epoch_steps * b.max_epochs}"])
                r = ddp(cfg, slow_s=slow * step_s, slow_rank=0, eval_every=b.eval_every,
                        target=b.target)
                row = {"steps": r["steps"], "trained_s": r["wall_s"] if r["reached"] else None}
            else:
                # async, and sync aggregating 1 of W: a global step is one push of B samples
                per = 1 if system == "psrpc_sync" else b.workers
                fault = ["fault.slow_worker=0", f"fault.slow_s={slow * step_s}"] if slow else []
                hook = (f"hooks=[{{_target_: benchmarks.time_to_accuracy.AccuracyProbe, "
                        f"every: {b.eval_every * per}, target: {b.target}}}]")
                s = run_psrpc(base + MODES[system] + fault + [
                    f"optim.lr={lr}", f"train.steps={epoch_steps * b.max_epochs * per}", hook,
                    "update.timeout_s=600"], extra_files=["tta.json"])
                reached = s["tta.json"]["reached"]
                row = {"steps": reached["step"] if reached else s["steps"],
                       "trained_s": reached["trained_s"] if reached else None}
            row = {"slow_steps": slow, "system": system, "lr": lr, **row,
                   "trained_s": round(row["trained_s"], 2) if row["trained_s"] else None}
            rows.append(row)
            print(row, flush=True)
    for r in rows:
        ref = next((x for x in rows if x["system"] == "ddp" and x["slow_steps"] == r["slow_steps"]),
                   None)
        r["speedup_vs_ddp"] = (round(ref["trained_s"] / r["trained_s"], 3)
                               if r["trained_s"] and ref and ref["trained_s"] else None)
    write_results(ROOT / b.out, meta, rows,
                  ["slow_steps", "system", "lr", "steps", "trained_s", "speedup_vs_ddp"],
                  f"Time to {b.target:.0%} test accuracy on MNIST (cnn, W={b.workers}, "
                  f"B={b.batch_size})", plot,
                  notes=f"trained_s: training wall time (evaluations included) until an evaluation "
                        f"(every {b.eval_every} rounds of {b.workers}×{b.batch_size} samples) first reached {b.target}; empty: "
                        f"not reached within {b.max_epochs} epochs. One DDP step = "
                        f"{step_s * 1e3:.1f} ms; the straggler sleeps slow_steps of them.")


def plot(plt, rows):
    fig, ax = plt.subplots(figsize=(7, 3.8))
    slows = list(dict.fromkeys(r["slow_steps"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    width = 0.8 / len(systems)
    for i, s in enumerate(systems):
        ys = [next((r["trained_s"] or 0 for r in rows if r["system"] == s and
                    r["slow_steps"] == sl), 0) for sl in slows]
        ax.bar([x + i * width for x in range(len(slows))], ys, width, label=s)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(slows))],
                  [f"straggler {sl} steps" if sl else "no straggler" for sl in slows])
    ax.set_ylabel("seconds to target accuracy")
    ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    main(sys.argv[1:])

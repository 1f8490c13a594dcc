"""Stragglers: worker 0 sleeps `slow` step times every step. Sync waits for it; sync with a
backup worker (replicas_to_aggregate = W - 1) and async do not; bounded async waits a little;
DDP (gloo) waits. Steady-state samples/s (samples whose gradients were applied) and the ratio to
DDP under the same straggler.

    python -m benchmarks.stragglers [slow=[0,1,2] workers=2]
"""

from __future__ import annotations

import statistics
import sys

from benchmarks.common import ROOT, bench_config, header, psrpc_config, run_psrpc, write_results
from benchmarks.peers import ddp

MODES = {
    "psrpc_sync": lambda b: ["update=sync"],
    "psrpc_backup": lambda b: ["update=sync", f"update.replicas_to_aggregate={b.workers - 1}"],
    "psrpc_async": lambda b: ["update=async"],
    "psrpc_bounded": lambda b: ["update=async", f"update.max_staleness={b.max_staleness}"],
}


def base(b) -> list[str]:
    shape = ",".join(str(x) for x in b.image_shape)
    return [f"model={b.model}", f"data.image_shape=[{shape}]", f"cluster.num_workers={b.workers}",
            f"train.batch_size={b.batch_size}", "data.size=8192", "data.test_size=0",
            f"train.steps={b.steps}", f"train.untimed_steps={b.warmup}",
            f"train.log_every={b.steps}"]


def measure(b, system: str, slow_s: float) -> float:
    if system == "ddp":
        return ddp(psrpc_config(base(b)), slow_s=slow_s, slow_rank=0)["samples_per_s"]
    tcp = system.endswith("_tcp")  # the same mode with cluster.shm=off
    system = system[:-len("_tcp")] if tcp else system
    per_push = system in ("psrpc_async", "psrpc_bounded")  # a global step is one push
    steps = b.steps * (b.workers if per_push else 1)
    warm = b.warmup * (b.workers if per_push else 1)
    fault = ["fault.slow_worker=0", f"fault.slow_s={slow_s}"] if slow_s else []
    return run_psrpc(base(b) + MODES[system](b) + fault + list(b.psrpc) + [
        "cluster.shm=off" if tcp else "cluster.shm=on",
        f"train.steps={steps}", f"train.untimed_steps={warm}", f"train.log_every={steps}",
        "update.timeout_s=600"])["samples_per_s"]


def main(argv: list[str]) -> None:
    b = bench_config("stragglers", argv)
    meta = header()
    step_s = b.workers * b.batch_size / ddp(psrpc_config(base(b)))["samples_per_s"]
    print(f"one DDP step without a straggler: {step_s * 1e3:.1f} ms", flush=True)
    rows = []
    for slow in b.slow:
        runs: dict[str, list[float]] = {s: [] for s in b.systems}
        for _ in range(b.repeats):
            for system in b.systems:
                runs[system].append(measure(b, system, slow * step_s))
                print(f"slow={slow} {system:14s} {runs[system][-1]:9.1f} samples/s", flush=True)
        cell = {s: statistics.median(v) for s, v in runs.items()}
        for system, value in cell.items():
            rows.append({"slow_steps": slow, "slow_s": round(slow * step_s, 4), "system": system,
                         "samples_per_s": round(value, 1),
                         "vs_ddp": round(value / cell["ddp"], 3) if "ddp" in cell else None})
    write_results(ROOT / b.out, meta, rows, ["slow_steps", "slow_s", "system", "samples_per_s",
                                             "vs_ddp"],
                  f"Stragglers: {b.model}, W={b.workers}, worker 0 slowed", plot,
                  notes=f"One step time = {step_s * 1e3:.1f} ms (DDP, no straggler). "
                        "samples/s counts samples whose gradients were applied.")


def plot(plt, rows):
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for system in dict.fromkeys(r["system"] for r in rows):
        pts = [(r["slow_steps"], r["samples_per_s"]) for r in rows if r["system"] == system]
        ax.plot(*zip(*pts), "o-", label=system)
    ax.set_xlabel("worker 0 slowed by (step times)")
    ax.set_ylabel("samples/s applied")
    ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    main(sys.argv[1:])

"""Shard replicas (`cluster.ps_replicas`): what a backup of every shard costs in steady state,
0 vs 1 side by side in one invocation (interleaved repeats, medians of samples/s), and what a
PS killed with SIGKILL costs with one: the cluster's pause (from the launcher seeing the death to
the new plan), the steps redone (none: nothing rolled back) and whether the backups agree.

    python -m benchmarks.replicas [repeats=3 'workloads=[resnet18]']
"""

from __future__ import annotations

import statistics
import sys

from benchmarks.common import ROOT, bench_config, header, run_psrpc, write_results


def main(argv: list[str]) -> None:
    b = bench_config("replicas", argv)
    meta = header()
    cluster = [f"cluster.num_ps={b.num_ps}", f"cluster.num_workers={b.workers}"]
    rows = []
    for workload in b.workloads:
        runs: dict[int, list[float]] = {k: [] for k in b.replicas}
        for _ in range(b.repeats):  # interleaved: every setting sees the same machine
            for k in b.replicas:
                s = run_psrpc(list(b[workload]) + cluster + [f"cluster.ps_replicas={k}"])
                runs[k].append(s["samples_per_s"])
                print(f"{workload:9s} ps_replicas={k} {runs[k][-1]:9.1f} samples/s", flush=True)
        base = statistics.median(runs[b.replicas[0]])
        for k in b.replicas:
            med = statistics.median(runs[k])
            # each repeat's runs follow each other: their ratio sees the same machine
            paired = statistics.median(a / x for a, x in zip(runs[b.replicas[0]], runs[k]))
            rows.append({"what": f"{workload}, ps_replicas={k}", "samples_per_s": round(med, 1),
                         "step_time_vs_0": round(base / med, 3),
                         "paired_vs_0": round(paired, 3), "pause_s": None,
                         "redone_steps": None, "backups_agree": None,
                         "runs": " ".join(f"{x:.0f}" for x in runs[k])})
    for mode in b.kills:
        s = run_psrpc(["model=mlp", f"update={mode}", f"train.steps={b.kill_steps}",
                       "cluster.ps_replicas=1", "fault.crash_role=ps", "fault.crash_index=1",
                       f"fault.crash_at_step={b.kill_at_step}"] + cluster)
        (epoch,) = s["epochs"]
        rows.append({"what": f"mlp {mode}, ps1 killed at step {b.kill_at_step}",
                     "samples_per_s": round(s["samples_per_s"], 1), "step_time_vs_0": None,
                     "paired_vs_0": None, "runs": None,
                     "pause_s": epoch["pause_s"],
                     "redone_steps": 0 if epoch["rolled_back_to"] is None
                     else epoch["at_step"] - epoch["rolled_back_to"],
                     "backups_agree": s["replicas"]["agree"]})
        print(rows[-1], flush=True)
    write_results(ROOT / b.out, meta, rows,
                  ["what", "samples_per_s", "step_time_vs_0", "paired_vs_0", "pause_s",
                   "redone_steps", "backups_agree", "runs"],
                  f"Shard replicas: cost and failover ({b.num_ps} PS, {b.workers} workers, "
                  "one host)", plot,
                  notes=f"samples_per_s: median of {b.repeats} interleaved runs; step_time_vs_0: "
                        "the step time against ps_replicas=0 (1.0 = free), from the medians; "
                        "paired_vs_0: the median of each repeat's ratio (its two runs one "
                        "after the other); runs: samples/s of each run, in order.")


def plot(plt, rows):
    cost = [r for r in rows if r["step_time_vs_0"] is not None]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar([r["what"] for r in cost], [r["step_time_vs_0"] for r in cost])
    ax.axhline(1.15, color="gray", linestyle="--", linewidth=1)
    ax.set_ylabel("step time vs ps_replicas=0")
    ax.tick_params(axis="x", labelrotation=20, labelsize=7)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main(sys.argv[1:])

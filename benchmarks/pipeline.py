"""Pipelining: what micro-batches buy in model-parallel mode (2 stages on 2 workers, fill-drain
schedule). Throughput for each micro-batch count, and the speedup over 1 (no pipelining).

    python -m benchmarks.pipeline [model=resnet18 microbatches=[1,4]]
"""

from __future__ import annotations

import statistics
import sys

from benchmarks.common import ROOT, bench_config, header, run_psrpc, write_results


def main(argv: list[str]) -> None:
    b = bench_config("pipeline", argv)
    meta = header()
    shape = ",".join(str(x) for x in b.image_shape)
    runs: dict[int, list[float]] = {m: [] for m in b.microbatches}
    for _ in range(b.repeats):  # interleaved: every count sees the same machine
        for m in b.microbatches:
            s = run_psrpc([f"model={b.model}", f"data.image_shape=[{shape}]", "parallel=model",
                           f"parallel.stages={b.stages}", f"parallel.microbatches={m}",
                           f"cluster.num_workers={b.workers}", f"train.batch_size={b.batch_size}",
                           f"train.steps={b.steps}", f"train.untimed_steps={b.warmup}",
                           f"train.log_every={b.steps}", "data.size=8192", "data.test_size=0"]
                          + list(b.psrpc))
            runs[m].append(s["samples_per_s"])
            print(f"micro-batches {m}: {runs[m][-1]:.1f} samples/s", flush=True)
    base = statistics.median(runs[b.microbatches[0]])
    rows = [{"microbatches": m, "samples_per_s": round(statistics.median(v), 1),
             "speedup": round(statistics.median(v) / base, 3)} for m, v in runs.items()]
    write_results(ROOT / b.out, meta, rows, ["microbatches", "samples_per_s", "speedup"],
                  f"Pipelining: {b.model}, {b.stages} stages, batch {b.batch_size} per replica",
                  plot)


def plot(plt, rows):
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([r["microbatches"] for r in rows], [r["samples_per_s"] for r in rows], "o-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches per step")
    ax.set_ylabel("samples/s")
    return fig


if __name__ == "__main__":
    main(sys.argv[1:])

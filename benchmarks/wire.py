"""What crosses the wire (update.wire_dtype): float32 vs bfloat16 vs float16. Throughput on the
communication-bound model (runs interleaved, median of `repeats`), and real-MNIST test accuracy
after one epoch (cnn, sync). The master copy and the optimizer stay float32 on the PS.

    python -m benchmarks.wire [wire_dtypes=[float32,bfloat16] repeats=3]
"""

from __future__ import annotations

import statistics
import sys

from benchmarks.common import ROOT, bench_config, header, run_psrpc, write_results


def main(argv: list[str]) -> None:
    b = bench_config("wire", argv)
    meta = header()
    shape = ",".join(str(x) for x in b.image_shape)
    rates: dict[str, list[float]] = {w: [] for w in b.wire_dtypes}
    for _ in range(b.repeats):
        for wire in b.wire_dtypes:
            s = run_psrpc([f"model={b.throughput_model}", f"data.image_shape=[{shape}]",
                           f"cluster.num_workers={b.workers}", f"train.batch_size={b.batch_size}",
                           f"train.steps={b.steps}", f"train.untimed_steps={b.warmup}",
                           f"train.log_every={b.steps}", "data.size=8192", "data.test_size=0",
                           f"update.wire_dtype={wire}"])
            rates[wire].append(s["samples_per_s"])
            print(f"{wire}: {rates[wire][-1]:.1f} samples/s", flush=True)
    rows = []
    root = (ROOT / b.data_root).resolve()
    steps = 60000 // (b.workers * b.mnist_batch_size) + 1
    for wire in b.wire_dtypes:
        s = run_psrpc(["data=mnist", f"data.root={root}", "model=cnn",
                       f"cluster.num_workers={b.workers}", f"train.batch_size={b.mnist_batch_size}",
                       f"train.steps={steps}", "train.log_every=200", f"update.wire_dtype={wire}"])
        rows.append({"wire": wire, "samples_per_s": round(statistics.median(rates[wire]), 1),
                     "mnist_accuracy": s["test_accuracy"]})
        print(rows[-1], flush=True)
    ref = rows[0]
    for r in rows:
        r["speedup"] = round(r["samples_per_s"] / ref["samples_per_s"], 3)
        r["accuracy_delta_points"] = round(100 * (r["mnist_accuracy"] - ref["mnist_accuracy"]), 2)
    write_results(ROOT / b.out, meta, rows,
                  ["wire", "samples_per_s", "speedup", "mnist_accuracy", "accuracy_delta_points"],
                  f"Wire dtype: {b.throughput_model} throughput (W={b.workers}, sync) and MNIST "
                  f"accuracy after one epoch (cnn)", plot,
                  notes=f"samples_per_s: median of {b.repeats} interleaved runs.")


def plot(plt, rows):
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.4))
    a1.bar([r["wire"] for r in rows], [r["samples_per_s"] for r in rows])
    a1.set_ylabel("samples/s")
    a2.bar([r["wire"] for r in rows], [100 * r["mnist_accuracy"] for r in rows])
    a2.set_ylim(95, 100)
    a2.set_ylabel("MNIST test accuracy (%)")
    return fig


if __name__ == "__main__":
    main(sys.argv[1:])

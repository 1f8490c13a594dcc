"""Is loading the bottleneck? The CIFAR-10-style example (a user CNN, every sample augmented by
the dataset: random crop and flip) trained with the batches built in the worker
(`data.num_workers=0`) and by DataLoader processes (`data.num_workers=2`), side by side,
interleaved; samples/s and the ratio.

    python -m benchmarks.loader [loader_workers=[0,2] repeats=3]
"""

from __future__ import annotations

import statistics
import sys

from benchmarks.common import ROOT, bench_config, header, run_psrpc, write_results


def main(argv: list[str]) -> None:
    b = bench_config("loader", argv)
    meta = header()
    base = ["+experiment=cifar_cnn", f"hydra.searchpath=[file://{ROOT / 'examples' / 'conf'}]",
            f"cluster.num_workers={b.workers}", f"train.batch_size={b.batch_size}",
            f"train.steps={b.steps}", f"train.untimed_steps={b.warmup}",
            f"train.log_every={b.steps}", f"data.size={b.size}", "data.test_size=0",
            "train.device=cpu"]
    runs: dict[int, list[float]] = {n: [] for n in b.loader_workers}
    for _ in range(b.repeats):  # interleaved: both see the same machine
        for n in b.loader_workers:
            runs[n].append(run_psrpc(base + [f"data.num_workers={n}"])["samples_per_s"])
    first = statistics.median(runs[b.loader_workers[0]])
    rows = []
    for n in b.loader_workers:
        rate = statistics.median(runs[n])
        rows.append({"data_num_workers": n, "samples_per_s": round(rate, 1),
                     "vs_in_worker": round(rate / first, 3),
                     "runs": " ".join(f"{r:.0f}" for r in runs[n])})
        print(rows[-1], flush=True)
    write_results(ROOT / b.out, meta, rows,
                  ["data_num_workers", "samples_per_s", "vs_in_worker", "runs"],
                  f"Loading: CIFAR-10-style augmented data, cifar_cnn, W={b.workers}, "
                  f"B={b.batch_size}", notes=(
                      "data.num_workers=0: each worker builds its batches itself (the dataset's "
                      "per-sample augmentation included); n > 0: n DataLoader processes per "
                      "worker prepare them ahead. Medians of interleaved runs."))


if __name__ == "__main__":
    main(sys.argv[1:])

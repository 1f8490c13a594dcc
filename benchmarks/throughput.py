"""Throughput: psrpc (sync, async; shared memory with the PS, and `_tcp`: cluster.shm=off) vs
torch DDP over gloo vs single-process training, same model, batch, data and threads, in one
invocation; reports samples/s and the ratios.

    python -m benchmarks.throughput [models=[resnet18] workers=[2] repeats=3]
"""

from __future__ import annotations

import statistics
import sys

from benchmarks.common import ROOT, bench_config, header, psrpc_config, run_psrpc, write_results
from benchmarks.peers import ddp, single_process


def common_overrides(b, model: str, workers: int) -> list[str]:
    shape = ",".join(str(x) for x in b.image_shape)
    return [f"model={model}", f"data.image_shape=[{shape}]", f"cluster.num_workers={workers}",
            f"train.batch_size={b.batch_size}", f"train.steps={b.steps[model]}",
            f"train.untimed_steps={b.warmup[model]}", f"train.log_every={b.steps[model]}",
            "data.size=8192", "data.test_size=0"]


def measure(system: str, overrides: list[str], extra: list[str]) -> float:
    if system.startswith("psrpc_"):
        update, _, transport = system[len("psrpc_"):].partition("_")
        shm = ["cluster.shm=off"] if transport == "tcp" else ["cluster.shm=on"]
        return run_psrpc(overrides + [f"update={update}"] + shm + extra)["samples_per_s"]
    cfg = psrpc_config(overrides)
    if system == "ddp":
        return ddp(cfg)["samples_per_s"]
    if system == "single":  # one process, the whole global batch
        cfg.train.batch_size *= cfg.cluster.num_workers
        cfg.cluster.num_workers = 1
        return single_process(cfg)["samples_per_s"]
    raise ValueError(f"unknown system {system!r}")


def main(argv: list[str]) -> None:
    b = bench_config("throughput", argv)
    meta = header()
    rows = []
    for model in b.models:
        for w in b.workers:
            runs: dict[str, list[float]] = {s: [] for s in b.systems}
            for _ in range(b.repeats):  # systems interleaved: they see the same machine
                for system in b.systems:
                    runs[system].append(measure(system, common_overrides(b, model, w),
                                                list(b.psrpc)))
                    print(f"{model:9s} W={w} {system:12s} {runs[system][-1]:9.1f} samples/s",
                          flush=True)
            cell = {s: statistics.median(v) for s, v in runs.items()}
            for system, value in cell.items():
                rows.append({"model": model, "workers": w, "system": system,
                             "samples_per_s": round(value, 1),
                             "vs_ddp": round(value / cell["ddp"], 3) if "ddp" in cell else None,
                             "vs_single": round(value / cell["single"], 3)
                             if "single" in cell else None})
    write_results(ROOT / b.out, meta, rows,
                  ["model", "workers", "system", "samples_per_s", "vs_ddp", "vs_single"],
                  "Throughput: psrpc vs DDP (gloo) vs single process", plot)


def plot(plt, rows):
    models = sorted({r["model"] for r in rows}, key=[r["model"] for r in rows].index)
    systems = sorted({r["system"] for r in rows}, key=[r["system"] for r in rows].index)
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        ws = sorted({r["workers"] for r in rows if r["model"] == model})
        width = 0.8 / len(systems)
        for i, s in enumerate(systems):
            ys = [next((r["samples_per_s"] for r in rows if r["model"] == model
                        and r["workers"] == w and r["system"] == s), 0) for w in ws]
            ax.bar([x + i * width for x in range(len(ws))], ys, width, label=s)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(ws))], [f"W={w}" for w in ws])
        ax.set_title(model)
        ax.set_ylabel("samples/s")
    axes[0][0].legend(fontsize=8)
    return fig


if __name__ == "__main__":
    main(sys.argv[1:])

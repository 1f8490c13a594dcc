"""push_pull microbenchmark: effective GB/s (bytes there and back / round-trip time) of one psrpc
push_pull round (gradient in, SGD on the PS, fresh parameters out) vs (a) a raw rpc_sync of a
tensor of the same bytes there and back between the same two processes, and (b) an in-process
copy of the same bytes (the ceiling).

    python -m benchmarks.pushpull [sizes_mb=[1,10,45] rounds=30]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch import nn

from benchmarks.common import ROOT, bench_config, header, run_psrpc, write_results
from psrpc import comm
from psrpc.worker import Worker


def echo(t: torch.Tensor) -> torch.Tensor:
    return t


class PushPullProbe(Worker):
    """A worker whose model is one C·H·W × classes tensor (the probed size, set through
    data.image_shape: processes come from a forkserver, so class attributes set here would not
    reach them); times train.steps push_pulls, then as many raw RPCs, after warmup_steps each."""

    @classmethod
    def build_model(cls, cfg, dataset):
        c, h, w = dataset.image_shape
        return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, dataset.num_classes, bias=False))

    def run(self, after_step=lambda *a: False) -> None:
        replies = self.client.pull()
        versions = self.load(replies)
        grads = [torch.zeros_like(g).to(self.flat.wire_dtype) for g in self.flat.grads]
        warmup, total = self.cfg.train.warmup_steps, self.cfg.train.steps
        # Alternate the two, so that both see the same machine (this one is noisy).
        times, raw, t = [], [], torch.cat(grads)
        for i in range(total):
            t0 = time.perf_counter()
            replies = self.receive(self.client.push_pull_async(versions, grads, 0.0, 1))
            versions = [r.version for r in replies]
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            comm.call_sync("ps0", echo, (t,))
            raw.append(time.perf_counter() - t0)
        self.stats.push_s = statistics.median(times[warmup:])
        self.stats.compute_s = statistics.median(raw[warmup:])
        self.stats.pushes = len(times)
        after_step(replies[0], 0.0, 0.0)


def copy_seconds(numel: int, rounds: int) -> float:
    src, dst = torch.randn(numel), torch.empty(numel)
    dst.copy_(src)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        dst.copy_(src)
        src.copy_(dst)  # there and back
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str]) -> None:
    b = bench_config("pushpull", argv)
    meta = header()
    rows = []
    for size in b.sizes_mb:
        for wire in b.wire_dtypes:
            width = int(size * 2**20 / 4 / 8)  # × 8 classes = the probed number of floats
            s = run_psrpc(["cluster.num_workers=1", f"cluster.bucket_bytes={b.bucket_bytes}",
                           "optim.momentum=0.9",
                           f"update.wire_dtype={wire}", f"train.steps={b.warmup + b.rounds}",
                           f"train.warmup_steps={b.warmup}", f"data.image_shape=[1,1,{width}]",
                           "data.num_classes=8", "data.size=2", "data.test_size=0",
                           "train.log_every=1000000"] + list(b.psrpc), worker_cls=PushPullProbe)
            w = s["workers"]["0"]
            nbytes = size * 2**20
            wire_bytes = nbytes // (1 if wire == "float32" else 2)
            pp_s, raw_s = w["push_s"], w["compute_s"]
            cp_s = copy_seconds(int(nbytes / 4), b.rounds)
            row = {"size_mb": size, "wire": wire,
                   "push_pull_ms": round(pp_s * 1e3, 2), "raw_rpc_ms": round(raw_s * 1e3, 2),
                   "copy_ms": round(cp_s * 1e3, 2),
                   "push_pull_gbps": round(2 * wire_bytes / pp_s / 1e9, 3),
                   "raw_rpc_gbps": round(2 * wire_bytes / raw_s / 1e9, 3),
                   "copy_gbps": round(2 * nbytes / cp_s / 1e9, 3)}
            row["push_pull_vs_raw"] = round(row["push_pull_gbps"] / row["raw_rpc_gbps"], 3)
            rows.append(row)
            print(row, flush=True)
    write_results(ROOT / b.out, meta, rows,
                  ["size_mb", "wire", "push_pull_ms", "raw_rpc_ms", "copy_ms", "push_pull_gbps",
                   "raw_rpc_gbps", "copy_gbps", "push_pull_vs_raw"],
                  "push_pull microbenchmark (effective GB/s, both directions counted)", plot,
                  notes="push_pull: gradient to the PS, SGD with momentum there, fresh parameters "
                        "back. raw: `rpc_sync` echoing a tensor of the same bytes between the "
                        "same two processes. copy: in-process `copy_` there and back.")


def plot(plt, rows):
    fig, ax = plt.subplots(figsize=(6, 3.6))
    sizes = [r["size_mb"] for r in rows if r["wire"] == rows[0]["wire"]]
    for key, label in [("push_pull_gbps", "psrpc push_pull"), ("raw_rpc_gbps", "raw rpc_sync"),
                       ("copy_gbps", "in-process copy")]:
        ax.plot(sizes, [r[key] for r in rows if r["wire"] == rows[0]["wire"]], "o-", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("MB of parameters")
    ax.set_ylabel("effective GB/s")
    ax.legend()
    return fig


if __name__ == "__main__":
    main(sys.argv[1:])

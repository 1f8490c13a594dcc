"""push_pull microbenchmark: one psrpc push_pull round (the gradient into the worker's push
buffer, to the PS, SGD with momentum there, fresh parameters into the model), with the PS on the
same host through shared memory (`shm`) and over TCP (`tcp`), against (a) the same work done in
one process (the gradient copied into a buffer, the same SGD-with-momentum step, the parameters
copied back), (b) a raw rpc_sync of a tensor of the same bytes there and back between the same
two processes, and (c) an in-process copy of the same bytes there and back.

    python -m benchmarks.pushpull [sizes_mb=[1,10,45] rounds=30]
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time

import torch
from torch import nn

from benchmarks.common import ROOT, bench_config, header, run_psrpc, write_results
from psrpc.cluster import comm
from psrpc.worker.data_parallel import Worker


def echo(t: torch.Tensor) -> torch.Tensor:
    return t


class PushPullProbe(Worker):
    """A worker whose model is one C·H·W × classes tensor (the probed size, set through
    data.image_shape: processes come from a forkserver, so class attributes set here would not
    reach them); times train.steps push_pulls, then as many raw RPCs, after warmup_steps each."""

    @classmethod
    def build_model(cls, cfg, dataset):
        c, h, w = dataset.info["image_shape"]
        return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, dataset.info["num_classes"],
                                                     bias=False))

    def run(self, after_step=lambda *a: False) -> None:
        replies = self.client.pull()
        versions = self.load(replies)
        # The gradient a backward would leave, written where backward writes it: the worker's
        # push buffer (its slot in shared memory when the PS is on this host).
        produced = [torch.randn(g.numel()) * 1e-3 for g in self.flat.grads]
        warmup, total = self.cfg.train.untimed_steps, self.cfg.train.steps
        # Alternate the two, so that both see the same machine (this one is noisy).
        times, raw, t = [], [], torch.cat(produced)
        for i in range(total):
            t0 = time.perf_counter()
            for g, src in zip(self.flat.grads, produced):
                g.copy_(src)
            futures = [self.client.push_one(k, v, self.flat.grad_to_send(k), 0.0, 1)
                       for k, v in enumerate(versions)]
            replies = self.receive(futures)
            versions = [r.version for r in replies]
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            comm.call_sync("ps0", echo, (t,))
            raw.append(time.perf_counter() - t0)
        self.stats.push_s = statistics.median(times[warmup:])
        self.stats.compute_s = statistics.median(raw[warmup:])
        self.stats.pushes = len(times)
        after_step(replies[0], 0.0, 0.0)


def in_process_seconds(numel: int, rounds: int, threads: int) -> float:
    """The same work in one process: the gradient copied into a buffer, SGD with momentum (the
    fused kernel, as on the PS), the parameters copied back into the model's buffer; on
    `threads` threads, as many as the PS's optimizer gets (cluster.ps_threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _in_process(numel, rounds)
    finally:
        torch.set_num_threads(before)


def _in_process(numel: int, rounds: int) -> float:
    from psrpc.config import SGDConfig
    from psrpc.optim.dense import build_optimizer

    params, model = torch.randn(numel), torch.empty(numel)
    produced, buf = torch.randn(numel) * 1e-3, torch.empty(numel)
    opt = build_optimizer([params], SGDConfig(lr=0.05, momentum=0.9))
    times = []
    for _ in range(rounds + 1):
        t0 = time.perf_counter()
        buf.copy_(produced)
        params.grad = buf
        with torch.no_grad():
            opt.step()
        params.grad = None
        model.copy_(params)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


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
    for threads, size, transport, wire in itertools.product(b.threads, b.sizes_mb, b.transports,
                                                            b.wire_dtypes):
        width = int(size * 2**20 / 4 / 8)  # × 8 classes = the probed number of floats
        s = run_psrpc(["cluster.num_workers=1", f"cluster.bucket_bytes={b.bucket_bytes}",
                       "optim.momentum=0.9", "cluster.shm=" + ("on" if transport == "shm"
                                                               else "off"),
                       f"update.wire_dtype={wire}", f"train.steps={b.warmup + b.rounds}",
                       f"train.untimed_steps={b.warmup}", f"data.image_shape=[1,1,{width}]",
                       "data.num_classes=8", "data.size=2", "data.test_size=0",
                       "train.log_every=1000000", f"cluster.ps_threads={threads}"]
                      + list(b.psrpc), replica_cls=PushPullProbe)
        w = s["workers"]["0"]
        nbytes = size * 2**20
        wire_bytes = nbytes // (1 if wire == "float32" else 2)
        pp_s, raw_s = w["push_s"], w["compute_s"]
        cp_s = copy_seconds(int(nbytes / 4), b.rounds)
        ip_s = in_process_seconds(int(nbytes / 4), b.rounds, threads)
        row = {"threads": threads, "size_mb": size, "transport": transport, "wire": wire,
               "push_pull_ms": round(pp_s * 1e3, 2), "in_process_ms": round(ip_s * 1e3, 2),
               "push_pull_vs_in_process": round(pp_s / ip_s, 2),
               "raw_rpc_ms": round(raw_s * 1e3, 2), "copy_ms": round(cp_s * 1e3, 2),
               "push_pull_gbps": round(2 * wire_bytes / pp_s / 1e9, 3),
               "raw_rpc_gbps": round(2 * wire_bytes / raw_s / 1e9, 3),
               "copy_gbps": round(2 * nbytes / cp_s / 1e9, 3)}
        row["push_pull_vs_raw"] = round(row["push_pull_gbps"] / row["raw_rpc_gbps"], 3)
        rows.append(row)
        print(row, flush=True)
    write_results(ROOT / b.out, meta, rows,
                  ["threads", "size_mb", "transport", "wire", "push_pull_ms", "in_process_ms",
                   "push_pull_vs_in_process", "raw_rpc_ms", "copy_ms", "push_pull_gbps",
                   "raw_rpc_gbps", "push_pull_vs_raw"],
                  "push_pull microbenchmark", plot,
                  notes="push_pull: the gradient into the worker's push buffer, to the PS, SGD "
                        "with momentum there, fresh parameters into the model (shm: the PS on "
                        "this host through shared memory; tcp: cluster.shm=off). in_process: the "
                        "same copy, step and copy back in one process, on as many threads as the PS "
                        "(threads = cluster.ps_threads). raw: `rpc_sync` echoing a "
                        "tensor of the same bytes between the same two processes. copy: "
                        "in-process `copy_` there and back. GB/s: bytes there and back / time.")


def plot(plt, rows):
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    first = [r for r in rows if r["wire"] == rows[0]["wire"]]
    for threads in dict.fromkeys(r["threads"] for r in first):
        mine = [r for r in first if r["threads"] == threads]
        for transport in dict.fromkeys(r["transport"] for r in mine):
            rs = [r for r in mine if r["transport"] == transport]
            ax.plot([r["size_mb"] for r in rs], [r["push_pull_ms"] for r in rs], "o-",
                    label=f"push_pull, {transport}, {threads} thread(s)")
        rs = [r for r in mine if r["transport"] == mine[0]["transport"]]
        ax.plot([r["size_mb"] for r in rs], [r["in_process_ms"] for r in rs], "s--",
                label=f"same work in one process, {threads} thread(s)")
    rs = [r for r in first if r["threads"] == first[0]["threads"]
          and r["transport"] == first[0]["transport"]]
    ax.plot([r["size_mb"] for r in rs], [r["raw_rpc_ms"] for r in rs], "x:",
            label="raw rpc_sync, same bytes")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("MB of parameters")
    ax.set_ylabel("ms per round")
    ax.legend(fontsize=7)
    return fig


if __name__ == "__main__":
    main(sys.argv[1:])

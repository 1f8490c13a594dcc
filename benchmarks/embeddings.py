"""Embedding tables of 100k to 10M rows: psrpc (tables row-sharded on the PS; a worker pulls the
rows of its batch and pushes their gradients) against DDP over gloo holding the whole table on
every worker, with dense embedding gradients (all-reduced whole) and with `sparse=True` ones
(gloo all-gathers their indices and values). The same DLRM, data (synthetic Zipf click logs),
batch and threads; steady-state samples/s, and psrpc's ratio to the best DDP variant.

    python -m benchmarks.embeddings [rows=[100000,1000000,10000000] systems=[psrpc,ddp_sparse]]

Optimizers: the MLPs with Adam; the tables with row-wise Adagrad on the PS (psrpc), torch's
Adagrad (dense, or on the sparse gradient) in DDP.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from benchmarks.common import ROOT, bench_config, header, psrpc_config, run_psrpc, write_results


def overrides(b, rows: int, steps: int) -> list[str]:
    cards = ",".join(str(n) for n in [rows, *b.other_tables])
    return ["+experiment=clicks_dlrm", f"data.cardinalities=[{cards}]",
            f"data.num_dense={b.num_dense}", f"model.dim={b.dim}",
            f"model.bottom=[64,{b.dim}]", f"cluster.num_workers={b.workers}",
            f"cluster.num_ps={b.num_ps}", f"train.batch_size={b.batch_size}",
            f"train.steps={steps}", f"train.warmup_steps={b.warmup}", f"train.log_every={steps}",
            "data.test_samples=2048", "train.eval_every=0"]


def _ddp_rank(rank: int, world: int, port: int, cfg, sparse: bool, threads: int, out) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.peers import _setup, train_timed

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    data, model, loss_fn, batches = _setup(cfg, world, rank)
    for bag in model.tables.bags.values():
        bag.sparse = sparse  # nn.EmbeddingBag reads it in forward
    model = DDP(model)
    tables = [p for n, p in model.named_parameters() if ".tables." in n]
    dense = [p for n, p in model.named_parameters() if ".tables." not in n]
    opts = [torch.optim.Adam(dense, lr=cfg.optim.lr),
            torch.optim.Adagrad(tables, lr=cfg.sparse.lr, eps=cfg.sparse.eps)]
    steps, warm = cfg.train.steps, cfg.train.warmup_steps
    _, elapsed = train_timed(model, loss_fn, batches, opts, steps, warm)
    if rank == 0:
        out.put({"samples_per_s": (steps - warm) * world * cfg.train.batch_size / elapsed})
    dist.barrier()
    dist.destroy_process_group()


def ddp(cfg, sparse: bool) -> dict:
    from benchmarks.peers import run_ranks

    world = cfg.cluster.num_workers
    threads = max(1, (os.cpu_count() or 1) // world)
    return run_ranks(_ddp_rank, world, cfg, sparse, threads)


def main(argv: list[str]) -> None:
    b = bench_config("embeddings", argv)
    if min(b.steps, b.dense_steps) <= b.warmup:
        sys.exit(f"embeddings: steps={b.steps} and dense_steps={b.dense_steps} must both exceed "
                 f"warmup={b.warmup} (the steps after the warm-up are the ones timed)")
    meta = header()
    rows = []
    for n in b.rows:
        rates = {}
        for system in b.systems:
            steps = b.dense_steps if system == "ddp_dense" else b.steps
            ov = overrides(b, n, steps)
            t0 = time.perf_counter()
            if system == "psrpc":
                rate = run_psrpc(ov)["samples_per_s"]
            else:
                rate = ddp(psrpc_config(ov), sparse=system == "ddp_sparse")["samples_per_s"]
            rates[system] = rate
            rows.append({"rows": n, "system": system, "samples_per_s": round(rate, 1),
                         "run_s": round(time.perf_counter() - t0, 1)})
            print(rows[-1], flush=True)
        ddps = [v for k, v in rates.items() if k.startswith("ddp")]
        if "psrpc" in rates and ddps:
            for r in rows[-len(rates):]:
                r["psrpc_vs_best_ddp"] = round(rates["psrpc"] / max(ddps), 2)
    write_results(ROOT / b.out, meta, rows,
                  ["rows", "system", "samples_per_s", "psrpc_vs_best_ddp", "run_s"],
                  f"Embedding tables: DLRM, dim {b.dim}, W={b.workers}, {b.num_ps} PS, B={b.batch_size}",
                  plot, notes="run_s: the whole run, start-up and table initialisation included.")


def plot(plt, rows):
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for system in dict.fromkeys(r["system"] for r in rows):
        rs = [r for r in rows if r["system"] == system]
        ax.plot([r["rows"] for r in rs], [r["samples_per_s"] for r in rs], "o-", label=system)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("rows of the big table")
    ax.set_ylabel("samples/s (W=2)")
    ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    main(sys.argv[1:])

"""Embedding tables of 100k to 10M rows: psrpc (tables row-sharded on the PS; a worker pulls the
rows of its batch and pushes their gradients) against its peers, all with the same DLRM, data
(synthetic Zipf click logs, the same global batches), batch per worker and threads per worker:

- single: the whole model in one process, batch W × B, every core: the limit the distributed
  systems are measured against;
- ddp_sparse, ddp_dense: DDP over gloo holding the whole table on every worker, with
  `sparse=True` embedding gradients (gloo all-gathers their indices and values) or dense ones
  (all-reduced whole);
- psrpc_cache: psrpc with the workers' hot-row cache (`cache.rows` rows per table,
  `cache.staleness` steps); psrpc_allreduce: the dense part replicated on the workers and
  averaged by a gloo all-reduce, only the tables on the PS (`update.dense=allreduce`);
  psrpc_cache_allreduce: both; psrpc_allreduce_1ps: dense all-reduce with every table on one
  PS (one process fewer sharing the cores); psrpc_ahead_allreduce_1ps: that with a staleness
  bound of one step and no cache rows (each step computed while the last one's round is under
  way, its rows pulled ahead); psrpc_cache_allreduce_1ps: that with the cache as well;
- torchrec: TorchRec's DistributedModelParallel over gloo: the big table sharded row-wise over
  the W ranks, each small one whole on one rank (table-wise), lookups through all-to-alls, the
  tables updated inside backward by FBGEMM's fused kernel; the MLPs in DDP.

    python -m benchmarks.embeddings [rows=[100000,1000000,10000000] systems=[psrpc,torchrec]
                                     repeats=3]

Steady-state samples/s (the steps after the warm-up), the median of `repeats` runs with the
systems interleaved, and psrpc's ratios (with and without the cache) to torchrec, ddp_sparse
and single. Optimizers: the MLPs
with Adam; the tables with row-wise Adagrad in psrpc (on the PS) and TorchRec (FBGEMM's exact
row-wise Adagrad, the same update), torch's Adagrad in single and DDP (sparse, or dense).
"""

from __future__ import annotations

import importlib
import os
import statistics
import sys
import time
import warnings

import torch
from torch import nn

from benchmarks.common import ROOT, bench_config, header, psrpc_config, run_psrpc, write_results
from psrpc.sparse.tables import bag_inputs

TORCHREC_INSTALL = ("pip install fbgemm-gpu-cpu==1.9.0 tensordict pyre-extensions && "
                    "pip install --no-deps torchrec==1.9.2")  # torchrec names the CUDA fbgemm-gpu
SYSTEMS = ("single", "psrpc", "psrpc_cache", "psrpc_allreduce", "psrpc_cache_allreduce",
           "psrpc_allreduce_1ps", "psrpc_ahead_allreduce_1ps", "psrpc_cache_allreduce_1ps",
           "psrpc_cache_allreduce_1ps_tcp", "ddp_sparse", "ddp_dense", "torchrec")
RATIOS = ("torchrec", "ddp_sparse", "single")  # psrpc_vs_<system> columns


def overrides(b, rows: int, steps: int) -> list[str]:
    cards = ",".join(str(n) for n in [rows, *b.other_tables])
    return ["+experiment=clicks_dlrm", f"data.cardinalities=[{cards}]",
            f"data.num_dense={b.num_dense}", f"model.dim={b.dim}",
            f"model.bottom=[64,{b.dim}]", f"cluster.num_workers={b.workers}",
            f"cluster.num_ps={b.num_ps}", f"train.batch_size={b.batch_size}",
            f"train.steps={steps}", f"train.untimed_steps={b.warmup}", f"train.log_every={steps}",
            "data.test_samples=2048", "train.eval_every=0"]


def _local_rank(rank: int, world: int, port: int, cfg, sparse: bool, threads: int, out) -> None:
    """A process holding the whole model: one of DDP's ranks, or with world=1 the single one."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.peers import _setup, init_gloo, train_and_report

    torch.set_num_threads(threads)
    init_gloo(rank, world, port)
    data, model, loss_fn, batches = _setup(cfg, world, rank)
    for bag in model.tables.bags.values():
        bag.sparse = sparse  # nn.EmbeddingBag reads it in forward
    tables = list(model.tables.parameters())
    dense = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
    opts = [torch.optim.Adam(dense, lr=cfg.optim.lr),
            torch.optim.Adagrad(tables, lr=cfg.sparse.lr, eps=cfg.sparse.eps)]
    train_and_report(DDP(model) if world > 1 else model, loss_fn, batches, opts, cfg, rank,
                     world, out)


def ddp(cfg, sparse: bool) -> dict:
    from benchmarks.peers import run_ranks

    world = cfg.cluster.num_workers
    threads = max(1, (os.cpu_count() or 1) // world)
    return run_ranks(_local_rank, world, cfg, sparse, threads)


def single(cfg) -> dict:
    """The whole model in one process: the global batch (W × B, the same samples), every core,
    the tables' gradients sparse."""
    from benchmarks.peers import run_ranks

    cfg.train.batch_size *= cfg.cluster.num_workers
    cfg.cluster.num_workers = 1
    return run_ranks(_local_rank, 1, cfg, True, os.cpu_count() or 1)


class TorchRecTables(nn.Module):
    """psrpc's tables (the same names, rows, dim and pooling) as a TorchRec
    EmbeddingBagCollection, in the place of the model's EmbeddingTables: forward(features) ->
    {name: (B, dim)}. Built on the meta device: DistributedModelParallel allocates each rank's
    shards only."""

    def __init__(self, specs):
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

        super().__init__()
        self.specs = list(specs)
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=s.name, embedding_dim=s.dim,
                                       num_embeddings=s.num_rows, feature_names=[s.name],
                                       pooling=PoolingType[s.pooling.upper()])
                    for s in self.specs], device=torch.device("meta"))

    def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        values, lengths = [], []
        for s in self.specs:
            flat, offsets = bag_inputs(features[s.name])  # psrpc's padding and hashing rules
            values.append(s.rows(flat))
            lengths.append(torch.diff(offsets, append=offsets.new_tensor([flat.numel()])))
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=[s.name for s in self.specs],
                                                  values=torch.cat(values),
                                                  lengths=torch.cat(lengths))
        return self.ebc(kjt).to_dict()


def _torchrec_rank(rank: int, world: int, port: int, cfg, threads: int, out) -> None:
    """One rank of TorchRec's DistributedModelParallel: psrpc's model (its MLPs, seeded the same)
    with TorchRecTables for tables. TorchRec's planner places no row-wise table on CPU, so the
    plan is written by hand: the big (first) table row-wise, table k of the others whole on rank
    k % world."""
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import (construct_module_sharding_plan, row_wise,
                                                    table_wise)
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from benchmarks.peers import _setup, init_gloo, train_and_report

    warnings.filterwarnings("ignore", category=FutureWarning)  # TorchRec's deprecated torch calls
    torch.set_num_threads(threads)
    init_gloo(rank, world, port, always=True)  # (DistributedModelParallel needs a group)
    data, model, loss_fn, batches = _setup(cfg, world, rank, own_tables=False)
    model.tables = TorchRecTables(model.tables.specs)
    # the tables' optimizer, fused into backward (FBGEMM's EXACT_ROWWISE_ADAGRAD): the plan then
    # gives them the fused kernel, not the dense one whose gradients no optimizer would take
    _apply_optimizer_in_backward(RowWiseAdagrad, model.tables.parameters(),
                                 {"lr": cfg.sparse.lr, "eps": cfg.sparse.eps})
    big, *small = model.tables.specs
    per_table = {big.name: row_wise(),
                 **{s.name: table_wise(rank=k % world) for k, s in enumerate(small, 1)}}
    sharder = EmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(model.tables.ebc, per_table, sharder=sharder,
                                          local_size=world, world_size=world, device_type="cpu")
    model = DistributedModelParallel(model, device=torch.device("cpu"),
                                     plan=ShardingPlan({"tables.ebc": plan}), sharders=[sharder])
    dense = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    opt = torch.optim.Adam(dense, lr=cfg.optim.lr)
    train_and_report(model, loss_fn, batches, [opt], cfg, rank, world, out)


def torchrec_missing() -> str:
    """Why TorchRec cannot run here ('' when it can)."""
    try:
        for name in ("fbgemm_gpu", "torchrec"):
            importlib.import_module(name)
    except (ImportError, OSError) as e:  # OSError: fbgemm's native library failed to load
        return str(e)
    return ""


def torchrec(cfg) -> dict:
    from benchmarks.peers import run_ranks

    world = cfg.cluster.num_workers
    threads = max(1, (os.cpu_count() or 1) // world)
    return run_ranks(_torchrec_rank, world, cfg, threads)


def measure(system: str, ov: list[str], cache, psrpc_ov=()) -> float:
    if system.startswith("psrpc"):  # _cache: the workers' hot-row cache on; _allreduce: the
        # dense part averaged among the workers, only the tables on the PS
        ov = ov + list(psrpc_ov)
        if "_cache" in system:
            ov = ov + [f"sparse.cache_rows={cache.rows}", f"sparse.cache_staleness={cache.staleness}",
                       f"sparse.cache_writes={cache.writes}"]
        if "_ahead" in system:  # no cache, a bound of one step: the next rows pulled ahead
            ov = ov + ["sparse.cache_staleness=1"]
        if "_allreduce" in system:
            ov = ov + ["update.dense=allreduce"]
        if "_1ps" in system:  # the tables on one PS: one process fewer on the cores
            ov = ov + ["cluster.num_ps=1"]
        if system.endswith("_tcp"):  # table pushes over TensorPipe, not the side channel
            ov = ov + ["cluster.shm=off"]
        return run_psrpc(ov)["samples_per_s"]
    cfg = psrpc_config(ov)
    if system == "single":
        return single(cfg)["samples_per_s"]
    if system == "torchrec":
        return torchrec(cfg)["samples_per_s"]
    return ddp(cfg, sparse=system == "ddp_sparse")["samples_per_s"]


def main(argv: list[str]) -> None:
    b = bench_config("embeddings", argv)
    if min(b.steps, b.dense_steps) <= b.warmup:
        sys.exit(f"embeddings: steps={b.steps} and dense_steps={b.dense_steps} must both exceed "
                 f"warmup={b.warmup} (the steps after the warm-up are the ones timed)")
    order = list(dict.fromkeys(b.systems))
    unknown = [s for s in order if s not in SYSTEMS]
    if unknown:
        sys.exit(f"embeddings: unknown systems {unknown}: choose among {list(SYSTEMS)}")
    meta = header()
    skipped = set()
    if "torchrec" in order and (why := torchrec_missing()):
        print(f"# torchrec skipped ({why}); to run it: {TORCHREC_INSTALL}", flush=True)
        skipped.add("torchrec")
    systems = [s for s in order if s not in skipped]
    rows = []
    for n in b.rows:
        runs: dict[str, list[float]] = {s: [] for s in systems}
        run_s: dict[str, list[float]] = {s: [] for s in systems}
        failed: dict[str, int] = {}
        for _ in range(b.repeats):  # systems interleaved: they see the same machine
            for system in systems:
                t0 = time.perf_counter()
                try:
                    runs[system].append(measure(system, overrides(
                        b, n, b.dense_steps if system == "ddp_dense" else b.steps), b.cache,
                        b.psrpc))
                except Exception as e:  # a peer that crashes (DDP's gloo once segfaulted at
                    # 10M rows) is said and counted; the other runs go on
                    failed[system] = failed.get(system, 0) + 1
                    print(f"rows={n} {system:10s} failed: {str(e).splitlines()[0][:200]}",
                          flush=True)
                    continue
                run_s[system].append(time.perf_counter() - t0)
                print(f"rows={n} {system:10s} {runs[system][-1]:9.1f} samples/s "
                      f"({run_s[system][-1]:.1f} s)", flush=True)
        cell = {s: statistics.median(v) for s, v in runs.items() if v}
        for system in order:
            if system not in cell:
                rows.append({"rows": n, "system": system,
                             "note": "skipped: torchrec not installed" if system == "torchrec"
                             and system not in failed else "every run failed"})
                continue
            row = {"rows": n, "system": system, "samples_per_s": round(cell[system], 1),
                   "runs": " ".join(f"{r:.0f}" for r in runs[system]),
                   "run_s": round(statistics.median(run_s[system]), 1)}
            if system in failed:
                row["note"] = f"{failed[system]} run(s) failed"
            if system.startswith("psrpc"):
                row.update({f"psrpc_vs_{s}": round(cell[system] / cell[s], 2)
                            for s in RATIOS if s in cell})
            rows.append(row)
    columns = ["rows", "system", "samples_per_s", *(f"psrpc_vs_{s}" for s in RATIOS), "runs",
               "run_s", "note"]
    write_results(ROOT / b.out, meta, rows,
                  [c for c in columns if any(c in r for r in rows)],
                  f"Embedding tables: DLRM, dim {b.dim}, W={b.workers}, {b.num_ps} PS, "
                  f"B={b.batch_size}", plot,
                  notes=(f"samples_per_s: the median of runs ({b.repeats} a system, the systems "
                         "interleaved); single: one process, batch W × B, every core. run_s: the "
                         "whole run, start-up and table initialisation included."))


def plot(plt, rows):
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for system in dict.fromkeys(r["system"] for r in rows if "samples_per_s" in r):
        rs = [r for r in rows if r["system"] == system]
        ax.plot([r["rows"] for r in rs], [r["samples_per_s"] for r in rs], "o-", label=system)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("rows of the big table")
    ax.set_ylabel("samples/s")
    ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    main(sys.argv[1:])

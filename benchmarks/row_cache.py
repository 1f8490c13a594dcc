"""The workers' hot-row cache (`sparse.cache_rows`, `sparse.cache_staleness`) against the exact
run (no cache), side by side on the same data, model and seeds: embedding bytes on the wire per
worker step (rows pulled and pushed), the cache's hit rate, messages to the table shards per
step, the test AUC and samples/s. Two datasets: synthetic Zipf click logs (zipf_alpha 1.05, a
1M-row table beside two small ones) and MovieLens 100K, where the one-hot logistic regression on
the same features and split is the reference to stay above.

    python -m benchmarks.row_cache [cache_rows=20000 'staleness=[2,8]' 'datasets=[movielens]'
                                    seed=1]
"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.common import ROOT, bench_config, header, run_psrpc, write_results


def _clicks(b) -> list[str]:
    c = b.clicks
    cards = ",".join(str(n) for n in c.cardinalities)
    return ["+experiment=clicks_dlrm", f"data.cardinalities=[{cards}]", "data.zipf_alpha=1.05",
            f"model.dim={c.dim}", f"model.bottom=[64,{c.dim}]", f"train.steps={c.steps}",
            f"train.batch_size={c.batch_size}", f"train.log_every={c.steps}",
            "train.eval_every=0"]


def _movielens(root: Path) -> list[str]:
    return ["+experiment=movielens_dlrm", f"data.root={root}", "train.eval_every=0"]


def main(argv: list[str]) -> None:
    b = bench_config("row_cache", argv)
    meta = header()
    datasets = {"clicks": _clicks(b)} if "clicks" in b.datasets else {}
    root = Path(b.movielens) if b.movielens and "movielens" in b.datasets else None
    if root is not None and not root.is_absolute():
        root = (ROOT / root).resolve()
    if root is not None and (root / "ml-100k.inter").is_file():
        datasets["movielens"] = _movielens(root)
    elif root is not None:
        print(f"row_cache: {b.movielens} holds no ml-100k.inter: MovieLens skipped", flush=True)
    rows = []
    for (name, base), dense in [(d, m) for d in datasets.items() for m in b.dense]:
        common = base + [f"cluster.num_workers={b.workers}", f"cluster.num_ps={b.num_ps}",
                         f"update.dense={dense}", f"train.seed={b.seed}"]
        exact = None
        for s, writes in [(0, None)] + [(s, w) for s in b.staleness for w in b.writes]:
            cache = ([f"sparse.cache_rows={b.cache_rows}", f"sparse.cache_staleness={s}",
                      f"sparse.cache_writes={writes}"] if s else [])
            summary = run_psrpc(common + cache)
            row = {"data": name, "dense": dense, "staleness": s, "writes": writes or "",
                   "cache_rows": b.cache_rows if s else 0,
                   "test_auc": round(summary["test_auc"], 4),
                   "cache_hit_rate": summary["cache_hit_rate"],
                   "sparse_bytes_per_step": summary["sparse_bytes_per_step"],
                   "table_rpcs_per_step": summary["table_rpcs_per_step"],
                   "samples_per_s": summary["samples_per_s"]}
            if exact is None:
                exact = row
            row["bytes_vs_exact"] = round(row["sparse_bytes_per_step"]
                                          / exact["sparse_bytes_per_step"], 3)
            row["auc_minus_exact"] = round(row["test_auc"] - exact["test_auc"], 4)
            rows.append(row)
            print(row, flush=True)
        if name == "movielens" and dense == b.dense[-1]:
            from psrpc.recsys.data import movielens
            from psrpc.recsys.reference import logistic_regression_auc

            data = movielens(str(root))
            lr = logistic_regression_auc(data["train"], data["test"], tables=data["tables"],
                                         num_dense=data["num_dense"])
            rows.append({"data": name, "staleness": "logistic regression",
                         "test_auc": round(lr, 4)})
            print(rows[-1], flush=True)
    write_results(ROOT / b.out, meta, rows,
                  ["data", "dense", "staleness", "writes", "cache_rows", "test_auc", "auc_minus_exact",
                   "cache_hit_rate", "sparse_bytes_per_step", "bytes_vs_exact",
                   "table_rpcs_per_step", "samples_per_s"],
                  f"Hot-row cache: W={b.workers}, {b.num_ps} PS, {b.cache_rows} rows per table "
                  "per worker", plot,
                  notes="staleness 0: the exact run (no cache). sparse_bytes_per_step: embedding "
                        "rows pulled and pushed per worker step, 8 + 4·dim bytes each. dense "
                        "allreduce: update.dense=allreduce, where a staleness of 1 or more also "
                        "pulls ahead (each step computed while the last one's round runs).")


def plot(plt, rows):
    fig, (a, c) = plt.subplots(1, 2, figsize=(9, 3.6))
    runs = [r for r in rows if "bytes_vs_exact" in r]
    for name, dense in dict.fromkeys((r["data"], r["dense"]) for r in runs):
        for writes in dict.fromkeys(r["writes"] for r in runs if r.get("writes")):
            rs = [r for r in runs if r["data"] == name and r["dense"] == dense
                  and r["writes"] in ("", writes)]  # the exact run starts every line
            label = f"{name}, dense {dense}, writes={writes}"
            a.plot([r["staleness"] for r in rs], [r["bytes_vs_exact"] for r in rs], "o-",
                   label=label)
            c.plot([r["staleness"] for r in rs], [r["test_auc"] for r in rs], "o-", label=label)
    a.set_xlabel("sparse.cache_staleness")
    a.set_ylabel("embedding bytes per step / exact")
    c.set_xlabel("sparse.cache_staleness")
    c.set_ylabel("test AUC")
    a.legend(fontsize=8)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main(sys.argv[1:])

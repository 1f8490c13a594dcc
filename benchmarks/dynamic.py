"""Dynamic tables against hashed tables of the same memory, on click logs whose catalogue drifts
(`data=clicks data.raw_ids=true`: raw ids from a 2^40 space, new items arriving at the head of
a Zipf ranking and cooling down). Systems, side by side on the same data, model and seeds:

- `dynamic`: `sparse.dynamic=true`, a row per id, admitted after `admit_after` sightings, at most
  `max_rows` rows per table (`sparse.evict=lfu`);
- `hashed_xK`: every raw id hashed into K × max_rows rows (`sparse.hash_size`), K in `hashed`.

Reported: test AUC and its gap to the hidden model's (the labels' own logits: the ceiling),
the distinct ids the run saw per table against the cap, the most rows any table held, the PS's
peak resident memory, and steady-state samples/s (median of `repeats` interleaved runs) with the
dynamic table's ratio to the hashed table of the same rows. The plot: test AUC per system, and
the dynamic tables' live rows and PS memory over the run.

    python -m benchmarks.dynamic [max_rows=18000 repeats=2]
"""

from __future__ import annotations

import statistics
import sys

from benchmarks.common import ROOT, bench_config, header, run_psrpc, write_results


def _data(b) -> list[str]:
    samples = b.steps * b.workers * b.batch_size
    return ["model=dlrm", "data=clicks", "loss=bce", "metric=auc", "data.raw_ids=true",
            f"data.distinct_ids={b.distinct_ids}", f"data.drift={b.drift}",
            f"data.cardinalities=[{','.join(['1'] * b.features)}]",
            f"data.num_dense={b.num_dense}", f"data.num_samples={samples}",
            f"data.test_samples={b.test_samples}", f"model.dim={b.dim}",
            f"model.bottom=[64,{b.dim}]", f"train.steps={b.steps}",
            f"train.batch_size={b.batch_size}", f"train.log_every={max(1, b.steps // 4)}",
            "train.eval_every=0", "train.shuffle=false", f"cluster.num_workers={b.workers}",
            f"cluster.num_ps={b.num_ps}", *b.psrpc]


def systems(b) -> dict[str, list[str]]:
    out = {"dynamic": ["sparse.dynamic=true", f"sparse.admit_after={b.admit_after}",
                       f"sparse.evict={b.evict}", f"sparse.max_rows={b.max_rows}",
                       f"sparse.ttl_steps={b.ttl_steps}"]}
    for k in b.hashed:
        out[f"hashed_x{k}"] = [f"sparse.hash_size={k * b.max_rows}"]
    return out


def distinct_ids(b) -> int:
    """The most distinct ids any table sees in the run's training data."""
    import torch

    from psrpc.recsys.synthetic import clicks

    d = clicks(b.steps * b.workers * b.batch_size, 0, [1] * b.features, num_dense=0,
               raw_ids=True, distinct_ids=b.distinct_ids, drift=b.drift)
    seen = [set() for _ in range(b.features)]
    for start in range(0, len(d["train"]), 65536):
        x, _ = d["train"].batch(torch.arange(start, min(start + 65536, len(d["train"]))))
        for k in range(b.features):
            seen[k].update(x[f"cat_{k}"].unique().tolist())
    return max(len(s) for s in seen)


def main(argv: list[str]) -> None:
    b = bench_config("dynamic", argv)
    meta = header()
    seen = distinct_ids(b)
    print(f"dynamic: each table sees up to {seen} distinct ids ({seen / b.max_rows:.1f}x "
          f"max_rows={b.max_rows})", flush=True)
    runs: dict[str, list[dict]] = {s: [] for s in systems(b)}
    for _ in range(b.repeats):  # interleaved: every system sees the same machine
        for name, overrides in systems(b).items():
            summary = run_psrpc(_data(b) + overrides)
            runs[name].append(summary)
            print(name, {k: summary.get(k) for k in ("samples_per_s", "test_auc", "hidden_auc",
                                                     "tables")}, flush=True)
    rows = []
    for name, summaries in runs.items():
        s = summaries[0]
        history = sh_history(s, 0)
        most = max((max(h["rows_live"].values()) for h in history), default=None)
        rows.append({
            "system": name,
            "rows_per_table": (b.max_rows if name == "dynamic"
                               else int(name.split("_x")[1]) * b.max_rows),
            "test_auc": round(statistics.median(r["test_auc"] for r in summaries), 4),
            "hidden_auc": s["hidden_auc"],
            "gap_to_hidden": round(s["hidden_auc"] - statistics.median(
                r["test_auc"] for r in summaries), 4),
            "distinct_ids_seen": seen,
            "max_rows_live": (most if name == "dynamic"
                              else max(t["rows_live"] for t in s["tables"].values())),
            "rows_created": sum(t["rows_created"] for t in s["tables"].values()),
            "rows_evicted": sum(t["rows_evicted"] for t in s["tables"].values()),
            "ps_peak_rss_mb": round(max(m["peak_rss_bytes"] for m in s["ps_memory"]) / 2**20, 1),
            "ps_table_mb": round(max(m["table_bytes"] for m in s["ps_memory"]) / 2**20, 2),
            "samples_per_s": round(statistics.median(r["samples_per_s"] for r in summaries)),
            "history": [{"step": h["step"], "rows_live": max(h["rows_live"].values()),
                         "rss_mb": round(h["rss_bytes"] / 2**20, 1),
                         "table_mb": round(h["table_bytes"] / 2**20, 2)}
                        for h in history],
        })
    same = next((r for r in rows if r["system"] == "hashed_x1"), None)
    for r in rows:
        if same is not None:
            r["speed_vs_hashed_x1"] = round(r["samples_per_s"] / same["samples_per_s"], 3)
        print({k: v for k, v in r.items() if k != "history"}, flush=True)
    write_results(ROOT / b.out, meta, rows,
                  ["system", "rows_per_table", "test_auc", "hidden_auc", "gap_to_hidden",
                   "distinct_ids_seen", "max_rows_live", "rows_created", "rows_evicted",
                   "ps_peak_rss_mb", "ps_table_mb", "samples_per_s", "speed_vs_hashed_x1"],
                  f"Dynamic tables against hashed tables: {b.features} features, "
                  f"{b.distinct_ids} live ids each, drift {b.drift}, W={b.workers}, "
                  f"{b.num_ps} PS, {b.steps} steps", plot,
                  notes=(f"dynamic: sparse.dynamic=true, admit_after={b.admit_after}, "
                         f"evict={b.evict}, max_rows={b.max_rows} rows per table over every "
                         "PS; hashed_xK: raw ids hashed into K × max_rows rows. max_rows_live: "
                         "the most rows one table held at any recorded step (summed over PS); "
                         "ps_table_mb: one PS's tables (rows, optimizer state, id map); "
                         "samples_per_s: steady state, median of interleaved runs."))


def sh_history(summary: dict, ps: int) -> list[dict]:
    """PS `ps`'s recorded rows and memory, with every table's rows summed over the PS at the
    same step (each PS records at the same steps)."""
    shards = [sh for sh in summary["shards"] if sh.get("history")]
    if not shards:
        return []
    out = []
    for i, h in enumerate(shards[ps]["history"]):
        rows = {n: sum(sh["history"][i]["rows_live"][n] for sh in shards
                       if i < len(sh["history"])) for n in h["rows_live"]}
        out.append({**h, "rows_live": rows})
    return out


def plot(plt, rows):
    fig, (a, c) = plt.subplots(1, 2, figsize=(10, 3.8))
    names = [r["system"] for r in rows]
    a.bar(names, [r["test_auc"] for r in rows], color="tab:blue")
    a.axhline(rows[0]["hidden_auc"], color="k", ls="--", label="hidden model")
    low = min(r["test_auc"] for r in rows)
    a.set_ylim(low - 0.02, rows[0]["hidden_auc"] + 0.01)
    a.set_ylabel("test AUC")
    a.legend(fontsize=8)
    dyn = next(r for r in rows if r["system"] == "dynamic")
    steps = [h["step"] for h in dyn["history"]]
    c.plot(steps, [h["rows_live"] for h in dyn["history"]], "o-", ms=3,
           label="rows of the largest table")
    c.axhline(dyn["rows_per_table"], color="tab:red", ls=":", label="sparse.max_rows")
    c.set_xlabel("step")
    c.set_ylabel("rows")
    m = c.twinx()
    m.plot(steps, [h["rss_mb"] for h in dyn["history"]], "s-", ms=3, color="tab:green",
           label="ps0 resident MB")
    m.set_ylabel("ps0 resident memory (MB)")
    c.legend(loc="lower right", fontsize=8)
    m.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main(sys.argv[1:])

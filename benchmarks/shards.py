"""Shards: the same model on 1, 2 and 4 parameter servers. Reports samples/s and the time a round
spends on the PS side: per PS, the time its push_pull handlers ran (checks, sums, optimizer,
replies) divided by the rounds; the slowest PS bounds a sync round.

    python -m benchmarks.shards [num_ps=[1,2,4] bucket_bytes=[0,8388608]]
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict

from benchmarks.common import ROOT, bench_config, header, run_psrpc, write_results


def main(argv: list[str]) -> None:
    b = bench_config("shards", argv)
    meta = header()
    shape = ",".join(str(x) for x in b.image_shape)
    rows = []
    for bucket in b.bucket_bytes:
        for ps in b.num_ps:
            runs = []
            for _ in range(b.repeats):
                s = run_psrpc([f"model={b.model}", f"data.image_shape=[{shape}]",
                               f"cluster.num_workers={b.workers}", f"cluster.num_ps={ps}",
                               f"cluster.bucket_bytes={bucket}", f"train.batch_size={b.batch_size}",
                               f"train.steps={b.steps}", f"train.untimed_steps={b.warmup}",
                               f"train.log_every={b.steps}", "data.size=8192", "data.test_size=0"]
                              + list(b.psrpc))
                busy = defaultdict(float)
                for shard in s["shards"]:
                    busy[shard["ps"]] += shard["busy_s"]
                runs.append((s["samples_per_s"], max(busy.values()) / s["steps"],
                             sum(busy.values()) / s["steps"], len(s["shards"])))
            rate, worst, total, shards = (statistics.median(x) for x in zip(*runs))
            rows.append({"bucket_bytes": bucket, "num_ps": ps, "shards": int(shards),
                         "samples_per_s": round(rate, 1),
                         "ps_ms_per_round_slowest": round(worst * 1e3, 2),
                         "ps_ms_per_round_all": round(total * 1e3, 2)})
            print(rows[-1], flush=True)
    write_results(ROOT / b.out, meta, rows,
                  ["bucket_bytes", "num_ps", "shards", "samples_per_s",
                   "ps_ms_per_round_slowest", "ps_ms_per_round_all"],
                  f"Shards: {b.model}, W={b.workers}, sync", plot,
                  notes="ps_ms_per_round: time in push_pull handlers per round (the slowest PS, "
                        "and all PS together); transfer time is not included.")


def plot(plt, rows):
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    for bucket in dict.fromkeys(r["bucket_bytes"] for r in rows):
        rs = [r for r in rows if r["bucket_bytes"] == bucket]
        label = "one shard per PS" if bucket == 0 else f"{bucket >> 20} MiB buckets"
        a1.plot([r["num_ps"] for r in rs], [r["samples_per_s"] for r in rs], "o-", label=label)
        a2.plot([r["num_ps"] for r in rs], [r["ps_ms_per_round_slowest"] for r in rs], "o-",
                label=label)
    a1.set_xlabel("parameter servers")
    a1.set_ylabel("samples/s")
    a2.set_xlabel("parameter servers")
    a2.set_ylabel("PS time per round, slowest PS (ms)")
    a1.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    main(sys.argv[1:])

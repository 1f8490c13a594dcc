"""Where a psrpc step goes, from the run's own counters: per step of worker 0, the time from
the batch to the last push (forward, backward and the pushes issued during it), the time it
then waits for the replies, and the CPU time the PS spends in its handlers per round (summing
slots, the finiteness check, the optimizer). With a single process doing the whole step on the
same cores, as the reference.

    python -m benchmarks.step_profile [cases=...]
"""

from __future__ import annotations

import sys

from benchmarks.common import ROOT, bench_config, header, run_psrpc, write_results
from benchmarks.throughput import measure


def overrides(b, case) -> list[str]:
    shape = ",".join(str(x) for x in b.image_shape)
    return [f"model={case.model}", f"data.image_shape=[{shape}]",
            f"cluster.num_workers={case.workers}", f"train.batch_size={b.batch_size}",
            f"train.steps={case.steps}", "train.untimed_steps=5", f"train.log_every={case.steps}",
            "data.size=8192", "data.test_size=0", "update=sync"]


def main(argv: list[str]) -> None:
    b = bench_config("step_profile", argv)
    meta = header()
    rows = []
    for case in b.cases:
        base = overrides(b, case)
        s = run_psrpc(base + list(case.psrpc))
        w = s["workers"]["0"]
        busy = sum(sh["busy_s"] for sh in s["shards"])
        ref = measure("single", base, [])
        row = {"model": case.model, "workers": case.workers,
               "psrpc": " ".join(case.psrpc) or "defaults",
               "samples_per_s": s["samples_per_s"], "single_samples_per_s": ref,
               "step_ms": round(1e3 * (w["compute_s"] + w["push_s"]) / w["pushes"], 2),
               "to_last_push_ms": round(1e3 * w["compute_s"] / w["pushes"], 2),
               "reply_wait_ms": round(1e3 * w["push_s"] / w["pushes"], 2),
               "ps_busy_ms_per_round": round(1e3 * busy / s["steps"], 2),
               "single_step_ms": round(1e3 * b.batch_size * case.workers / ref, 2)}
        rows.append(row)
        print(row, flush=True)
    write_results(ROOT / b.out, meta, rows,
                  ["model", "workers", "psrpc", "samples_per_s", "step_ms", "to_last_push_ms",
                   "reply_wait_ms", "ps_busy_ms_per_round", "single_samples_per_s",
                   "single_step_ms"],
                  "Where a synchronous step goes", notes=(
                      "step_ms = to_last_push_ms (batch, forward, backward with the pushes it "
                      "issues) + reply_wait_ms (after the last push); ps_busy_ms_per_round: CPU "
                      "time in the PS's push handlers per round, all shards, on the same 2 cores "
                      "as the workers. single: one process, the whole batch (workers × batch "
                      "size), optimizer included."))


if __name__ == "__main__":
    main(sys.argv[1:])

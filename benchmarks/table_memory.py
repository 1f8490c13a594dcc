"""A table that does not fit a worker: DLRM on synthetic click logs whose big table has
`rows` × `dim` float32 (20M × 64 = 5.1 GB) across the PS. Every process of the run is found by
its name (psrpc-ps0, psrpc-worker1, ...) and its resident memory sampled while it trains; the
table reports each one's peak (VmHWM at its last sample) next to the table's size.

    python -m benchmarks.table_memory [rows=20000000 dim=64 num_ps=2]
"""

from __future__ import annotations

import sys
import threading
import time

import psutil

from benchmarks.common import ROOT, bench_config, header, run_psrpc, write_results


def sample(peaks: dict, stop: threading.Event, every_s: float) -> None:
    """{process name: peak resident bytes} of every psrpc-* process, until `stop`."""
    while not stop.wait(every_s):
        for p in psutil.process_iter(["name"]):
            name = p.info["name"] or ""
            if not name.startswith("psrpc-"):
                continue
            try:
                with open(f"/proc/{p.pid}/status") as f:
                    hwm = next(int(line.split()[1]) * 1024 for line in f
                               if line.startswith("VmHWM"))
            except (OSError, StopIteration):
                continue
            peaks[name] = max(peaks.get(name, 0), hwm)


def main(argv: list[str]) -> None:
    b = bench_config("table_memory", argv)
    meta = header()
    peaks: dict[str, int] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=sample, args=(peaks, stop, b.sample_every_s), daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    s = run_psrpc(["+experiment=clicks_dlrm", f"data.cardinalities=[{b.rows},1000,1000]",
                   f"model.dim={b.dim}", f"model.bottom=[64,{b.dim}]",
                   f"cluster.num_ps={b.num_ps}", f"cluster.num_workers={b.workers}",
                   f"train.batch_size={b.batch_size}", f"train.steps={b.steps}",
                   f"train.log_every={max(1, b.steps // 4)}", "data.test_samples=4096",
                   "train.eval_every=0", *b.psrpc])
    stop.set()
    watcher.join()
    table_gb = b.rows * b.dim * 4 / 1e9
    rows = [{"process": name, "peak_rss_gb": round(v / 1e9, 3),
             "table_gb": round(table_gb, 2)} for name, v in sorted(peaks.items())]
    for r in rows:
        print(r, flush=True)
    notes = (f"{b.rows:,} rows × {b.dim} float32 = {table_gb:.2f} GB in the big table, on "
             f"{b.num_ps} PS; {s['steps']} steps at {s['samples_per_s']} samples/s, test AUC "
             f"{s.get('test_auc')}, {time.perf_counter() - t0:.0f} s in all (table "
             "initialisation included). Peak: VmHWM of each process. psrpc options: "
             f"{' '.join(b.psrpc) or 'defaults'}.")
    write_results(ROOT / b.out, meta, rows, ["process", "peak_rss_gb", "table_gb"],
                  f"Memory with a {table_gb:.1f} GB table", notes=notes)


if __name__ == "__main__":
    main(sys.argv[1:])

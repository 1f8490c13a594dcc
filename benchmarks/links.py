"""psrpc and its peers across emulated hosts at a shaped bandwidth (benchmarks/hosts.py: each
host its own network, PIDs, /dev/shm; tc tbf on both ends of each link): samples/s and the
bytes each step puts on the chief's host's interface, as the kernel counted them.

    python -m benchmarks.links                                  # DLRM, 2 hosts, 0.1/1/10 Gbit/s
    python -m benchmarks.links workload=resnet18 rates=[1000]
    python -m benchmarks.links hosts=3 rates=[1000]

Every system runs under torchrun, one agent per host (c10d on h0, ranks on eth1), the lowest
ranks on h0:
- dlrm (the 1M-row table of benchmarks.embeddings, B per worker, W = workers): psrpc with ps0
  and worker0 on h0 and one worker on each other host; `psrpc` (dense on the PS), `_cache`
  (the workers' hot-row cache; `_cache_hold`: write-back), `_allreduce` (dense all-reduce,
  tables on the PS), `_ahead` (a staleness bound of one step, rows pulled ahead, no cache
  rows); DDP `sparse=True` and TorchRec row-wise (where installed) with one rank per host;
- resnet18 (`workers_per_host` workers a host): psrpc sync with ps0 on h0, float32 and
  `update.wire_dtype=bfloat16`, the workers of each other host pushing one sum
  (update.host_push=auto; `psrpc_own_pushes`: each its own; `_spread`: a PS on every host,
  cluster.ps_placement=spread); DDP over gloo, and with its fp16 compression hook.

Steady state: samples/s after the warm-up, and the chief's host's eth1 bytes per step over the
same steps (with 2 hosts what h0 sends is what h1 receives: both hosts' counts). The median of
`repeats` runs, the systems interleaved, a fresh set of hosts for each run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import hosts as emulated
from benchmarks.common import ROOT, bench_config, header, write_results
from benchmarks.embeddings import TORCHREC_INSTALL, torchrec_missing

PEERS = ("ddp_sparse", "torchrec", "ddp", "ddp_fp16")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in (
        "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "eth1"}


def torchrun(h, procs: list[int], module_args: list[str], cwd: Path, timeout_s: float) -> str:
    """A torchrun agent on each host (procs[k] ranks on host k, c10d on h0) running
    `python -m <module_args>`; raises with the end of the logs if one fails."""
    logs = [open(cwd / f"h{k}.err", "w") for k in range(len(procs))]
    agents = [h.popen(k, [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(procs)}",
        f"--nproc-per-node={n}", "--rdzv-backend=c10d", "--rdzv-endpoint=h0:29400",
        "--rdzv-id=links", f"--local-addr={h.addr(k)}", "-m", *module_args],
        cwd=cwd, env=_env(), stdout=subprocess.DEVNULL, stderr=logs[k])
        for k, n in enumerate(procs)]
    deadline = time.monotonic() + timeout_s
    while any(a.poll() is None for a in agents) and time.monotonic() < deadline:
        time.sleep(0.5)
    for f in logs:
        f.close()
    text = "".join((cwd / f"h{k}.err").read_text(errors="replace") for k in range(len(procs)))
    if any(a.poll() != 0 for a in agents):
        for a in agents:
            a.kill()
        raise RuntimeError(f"exit {[a.poll() for a in agents]}: {text[-1500:]}")
    return text


def workload(b, name: str) -> tuple[list[str], list[int], list[int]]:
    """(psrpc overrides, ranks per host for psrpc, ranks per host for the peers)."""
    n = b.hosts
    if name == "dlrm":
        d = b.dlrm
        cards = ",".join(str(r) for r in [d.rows, *d.other_tables])
        ov = ["+experiment=clicks_dlrm", f"data.cardinalities=[{cards}]", f"model.dim={d.dim}",
              f"model.bottom=[64,{d.dim}]", f"cluster.num_workers={n}", "cluster.num_ps=1",
              f"train.batch_size={d.batch_size}", "data.test_samples=2048", "train.eval_every=0"]
        return ov, [2] + [1] * (n - 1), [1] * n
    r = b.resnet18
    w = r.workers_per_host
    ov = ["model=resnet18", "data.image_shape=[3,32,32]", "data.size=8192", "data.test_size=0",
          f"cluster.num_workers={w * n}", "cluster.num_ps=1", f"train.batch_size={r.batch_size}"]
    return ov, [w + 1] + [w] * (n - 1), [w] * n


SYSTEM_OVERRIDES = {
    "psrpc": [], "psrpc_bf16": ["update.wire_dtype=bfloat16"],
    "psrpc_cache": ["CACHE"], "psrpc_cache_hold": ["CACHE_HOLD"],
    # bfloat16 on the wire for the dense part (its pushes and pulls), with and without the
    # write-back cache: on a thin link the dense bytes are what the cache cannot cut
    "psrpc_bf16_cache_hold": ["update.wire_dtype=bfloat16", "CACHE_HOLD"],
    "psrpc_allreduce": ["update.dense=allreduce"],
    "psrpc_own_pushes": ["update.host_push=off"],  # each worker of a host pushes its own
    # a PS on every host (cluster.ps_placement=spread): each link carries a share of the PS's
    "psrpc_spread": ["SPREAD"], "psrpc_bf16_spread": ["SPREAD", "update.wire_dtype=bfloat16"],
    # the same with a backup of every shard on the other host's PS (cluster.ps_replicas)
    "psrpc_spread_replicas": ["SPREAD", "cluster.ps_replicas=1"],
    "psrpc_allreduce_cache": ["update.dense=allreduce", "CACHE"],
    # the best one-host configuration (benchmarks.embeddings): each step computed while the
    # last one's round is under way, its rows pulled ahead, no cache rows
    "psrpc_ahead_allreduce": ["update.dense=allreduce", "sparse.cache_staleness=1"],
}


def run_one(b, system: str, ov: list[str], procs: list[int], peer_procs: list[int],
            rate: float, cores: int) -> dict:
    steps = b.steps[b.workload]
    warm = b.warmup[b.workload]
    # every worker of every system: the same torch threads (the cores over the workers)
    threads = max(1, cores // sum(peer_procs))
    ov = ov + [f"train.steps={steps}", f"train.untimed_steps={warm}",
               f"train.log_every={steps}", "train.device=cpu"]
    with tempfile.TemporaryDirectory(prefix="psrpc-links-") as tmp, \
            emulated.Hosts(b.hosts, rate_mbit=rate) as h:
        cwd = Path(tmp)
        t0 = time.perf_counter()
        if system.startswith("psrpc"):
            extra = []
            if "SPREAD" in SYSTEM_OVERRIDES[system]:  # one PS more on every host but the first
                ov = [o for o in ov if not o.startswith("cluster.num_ps=")] + [
                    f"cluster.num_ps={b.hosts}", "cluster.ps_placement=spread"]
                procs = [procs[0]] * b.hosts
            for o in SYSTEM_OVERRIDES[system]:
                if o == "SPREAD":
                    continue
                extra += ([f"sparse.cache_rows={b.cache.rows}",
                           f"sparse.cache_staleness={b.cache.staleness}",
                           "sparse.cache_writes=" + ("hold" if o == "CACHE_HOLD" else
                                                     b.cache.writes)]
                          if o.startswith("CACHE") else [o])
            hook = ("hooks=[{_target_: benchmarks.link_peer.LinkBytes, from_step: "
                    f"{warm}}}]")
            torchrun(h, procs, ["psrpc", *ov, *extra, *b.psrpc, hook, "cluster.interface=eth1",
                                f"cluster.worker_threads={threads}", f"out_dir={cwd / 'out'}"],
                     cwd, b.timeout_s)
            summary = json.loads((cwd / "out" / "summary.json").read_text())
            got = {"samples_per_s": summary["samples_per_s"],
                   **json.loads((cwd / "out" / "link_bytes.json").read_text())}
        else:
            torchrun(h, peer_procs, ["benchmarks.link_peer", system, str(cwd / "peer.json"),
                                     str(threads), *ov], cwd, b.timeout_s)
            got = json.loads((cwd / "peer.json").read_text())
        got["run_s"] = time.perf_counter() - t0
    return got


def main(argv: list[str]) -> None:
    b = bench_config("links", argv)
    if (why := emulated.missing()) is not None:
        sys.exit(f"benchmarks.links: {why}")
    systems = list(b.systems[b.workload])
    if "torchrec" in systems and (why := torchrec_missing()):
        print(f"# torchrec skipped ({why}); to run it: {TORCHREC_INSTALL}", flush=True)
        systems.remove("torchrec")
    ov, procs, peer_procs = workload(b, b.workload)
    cores = os.cpu_count() or 1
    meta = header()
    rows = []
    for rate in b.rates:
        runs: dict[str, list[dict]] = {s: [] for s in systems}
        for _ in range(b.repeats):  # interleaved: every system sees the same machine
            for system in systems:
                try:
                    got = run_one(b, system, ov, procs, peer_procs, rate, cores)
                except Exception as e:
                    print(f"{rate} Mbit/s {system}: failed: {str(e)[-600:]}", flush=True)
                    continue
                runs[system].append(got)
                print(f"{rate:>6} Mbit/s {system:22s} {got['samples_per_s']:9.1f} samples/s "
                      f"tx {got['tx_per_step'] / 1e3:9.1f} KB/step rx "
                      f"{got['rx_per_step'] / 1e3:9.1f} KB/step ({got['run_s']:.0f} s)",
                      flush=True)
        med = {s: {k: statistics.median(r[k] for r in v) for k in v[0]}
               for s, v in runs.items() if v}
        for system in systems:
            if system not in med:
                rows.append({"mbit": rate, "system": system, "note": "every run failed"})
                continue
            m = med[system]
            row = {"mbit": rate, "system": system, "samples_per_s": round(m["samples_per_s"], 1),
                   "tx_kb_per_step": round(m["tx_per_step"] / 1e3, 1),
                   "rx_kb_per_step": round(m["rx_per_step"] / 1e3, 1),
                   "runs": " ".join(f"{r['samples_per_s']:.0f}" for r in runs[system])}
            if system.startswith("psrpc"):
                row.update({f"vs_{p}": round(m["samples_per_s"] / med[p]["samples_per_s"], 2)
                            for p in PEERS if p in med})
            rows.append(row)
    columns = ["mbit", "system", "samples_per_s", *(f"vs_{p}" for p in PEERS),
               "tx_kb_per_step", "rx_kb_per_step", "runs", "note"]
    write_results(ROOT / b.out, meta, rows, [c for c in columns if any(c in r for r in rows)],
                  f"{b.workload} over {b.hosts} emulated hosts at shaped bandwidth", plot,
                  notes=(f"samples_per_s: median of {b.repeats} interleaved runs; tx/rx: the "
                         "chief's host's eth1 bytes per timed step (kernel counters)."))


def plot(plt, rows):
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for system in dict.fromkeys(r["system"] for r in rows if "samples_per_s" in r):
        rs = [r for r in rows if r["system"] == system and "samples_per_s" in r]
        ax.plot([r["mbit"] for r in rs], [r["samples_per_s"] for r in rs], "o-", label=system)
    ax.set_xscale("log")
    ax.set_xlabel("link bandwidth, Mbit/s each way")
    ax.set_ylabel("samples/s")
    ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    main(sys.argv[1:])

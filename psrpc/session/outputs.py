"""The run's outputs, written by the chief: `model.pt` (the full state_dict gathered from the
shards, plus the buffers of the chief's replica), the final evaluation, `summary.json`, and
`tables/index.json`, naming the files of the tables' export (each PS writes its own)."""

from __future__ import annotations

import copy
import json
import logging
import uuid
from pathlib import Path
from typing import Callable, Optional

import torch

from psrpc import factories
from psrpc.checkpoint import write_atomic
from psrpc.cluster import comm
from psrpc.metrics import AUCLogLoss
from psrpc.sparse.export import INDEX, make_index, table_files
from psrpc.worker.loader import fetch, to_device

log = logging.getLogger("psrpc")


def gather(plan, worker) -> dict:
    """The full model's state_dict: parameters from the shards, buffers (BatchNorm statistics)
    from the chief's replica (its stages, in model parallel); CPU tensors."""
    dense = getattr(worker, "allreduce", None)
    if dense is not None:  # update.dense=allreduce: the chief's replica holds them
        flats = dense.params()
    else:
        flats = [f[1] for f in comm.wait_all([comm.invoke(r, "pull_full")
                                               for r in plan.all_shards])]
    state = plan.layout.join(flats)
    state.update(worker.buffers())
    return state


class Evaluator:
    """The test metric (`metric=`) of a state_dict, on a copy of the chief's model (its
    training replica is left alone). Returns {"test_<name>": value, ...}, None without a test
    split."""

    def __init__(self, worker, cfg):
        self.worker, self.batch_size, self.seed = worker, cfg.train.eval_batch_size, cfg.train.seed
        self.metric = factories.build_metric(cfg, worker.data)
        self.name = factories.metric_name(self.metric)
        self.key = f"test_{self.name}"  # the one `checkpoint.best` ranks by
        self.higher_is_better = bool(getattr(self.metric, "higher_is_better", True))
        self._model = None

    def empty(self) -> dict:
        return {self.key: None}

    def __call__(self, state: dict) -> Optional[dict]:
        worker = self.worker
        test = worker.data.test
        if test is None:
            return None
        if self._model is None:
            self._model = copy.deepcopy(worker.model)
        model = self._model
        model.load_state_dict(state)  # copies onto the model's device
        model.eval()
        self.metric.reset()
        with torch.no_grad():
            for i in range(0, len(test), self.batch_size):
                idx = torch.arange(i, min(i + self.batch_size, len(test)))
                x, y = to_device(fetch(test, idx, self.seed), worker.device)
                self.metric.update(model(x), y)
        value = self.metric.compute()
        if isinstance(value, dict):
            return {f"test_{k}": _round(v, 6) for k, v in value.items()}
        return {self.key: _round(value, 6)}


def hidden_auc(test, chunk: int = 8192) -> dict:
    """{"hidden_auc": the test AUC of the model that made the labels} for a test split with a
    `logits(indices)` method (synthetic data, `ClickLogs`): the ceiling any model can reach;
    null otherwise. Labels from `test.batch(indices)`, `chunk` samples at a time."""
    if test is None or not callable(getattr(test, "logits", None)):
        return {"hidden_auc": None}
    metric = AUCLogLoss()
    for i in range(0, len(test), chunk):
        idx = torch.arange(i, min(i + chunk, len(test)))
        metric.update(test.logits(idx), test.batch(idx)[1])
    return {"hidden_auc": _round(metric.compute()["auc"], 6)}


def write_outputs(out_dir: Path, state: dict, summary: dict) -> None:
    # an index of an earlier run's tables must not stand beside this run's model.pt: it goes
    # first, and export_tables writes this run's once its tables are written
    (out_dir / "tables" / INDEX).unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(state, out_dir / "model.pt")
    with open(out_dir / "summary.json", "w") as f:
        json.dump(summary, f, indent=2)


def export_tables(out_dir: Path, num_ps: int, export: Callable[[str], list]) -> dict:
    """Every PS's rows into out_dir/tables/ as one export: the index and ps<k>.pt files an
    earlier run left in this folder are removed, `export(export_id)` has every PS write its
    ps<k>.pt tagged with a new export id (and returns what each wrote: TableShard.export), and
    tables/index.json, naming the files, num_ps, the step and the export id, is written last.
    A PS on another host without shared storage writes its file there; the chief's folder then
    holds the index, which load_tables reads the files against once they are copied beside it."""
    folder = out_dir / "tables"
    (folder / INDEX).unlink(missing_ok=True)
    for stale in table_files(folder):
        stale.unlink(missing_ok=True)
    export_id = uuid.uuid4().hex
    index = make_index(export_id, num_ps, export(export_id))
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / INDEX, json.dumps(index, indent=1).encode())
    return index


def make_summary(cfg, topo, plan, reports: list[dict], *, wall_s: float, total_s: float,
                 samples_per_s, tests: dict, lost: list[int], stopped_early: bool,
                 workers: dict, epochs: list = (),
                 final_checkpoint_error: Optional[str] = None,
                 traffic: Optional[dict] = None) -> dict:
    r0 = reports[0]
    return {
        "update": cfg.update.name, "parallel": cfg.parallel.name,
        "num_ps": topo.num_ps, "num_workers": topo.num_workers,
        "steps": r0["version"], "samples": r0["samples"],
        "wall_s": round(wall_s, 3), "total_s": round(total_s, 3),
        "samples_per_s": _round(samples_per_s),
        "final_loss": _round(r0["loss"], 6),
        **tests,  # test_<metric>: null without a test split (or when a signal stopped the run)
        "stale_dropped": r0["stale_dropped"],
        "nan_rejected": max(r["nan_rejected"] for r in reports),  # pushes, not shards
        "max_staleness": max(r["max_staleness"] for r in reports),
        "mean_staleness": _round(r0["mean_staleness"], 4),
        "workers_lost": len(lost),
        "restored_from_step": plan.restored_from_step,
        "workers_rejoined": sum(n.startswith("worker") for e in epochs
                                for n in e["started_again"].split(",")),
        "epochs": list(epochs),  # membership epochs: who joined again, when, the pause
        "stopped_early": stopped_early,
        "final_checkpoint_error": final_checkpoint_error,  # null: written (or none asked)
        # why the result is not, by design, an uninterrupted run's of this config ([]: it is)
        "inexact": inexact(cfg, topo, reports, lost),
        **_table_traffic(plan, workers),
        **_dense_replicas(cfg, workers),
        "host_push": sorted({w["host_push"] for w in workers.values() if w.get("host_push")}),
        **_tables(reports),
        # TCP bytes between hosts as the kernel counted them, per pair and library
        "host_traffic": traffic,
        "shards": reports,
        "workers": workers,
    }


SHORT_BECAUSE = {  # a shard's `short` counters (psrpc/ps/stats.py): why a sync round lacked some
    "timeout": "rounds closed after update.timeout_s without a worker's gradient",
    "lost": "rounds closed without workers counted lost",
    "backup_workers": "update.replicas_to_aggregate < W: a round takes the gradients that "
                      "come first",
    "rejected": "non-finite gradients rejected",
    "void": "gradients computed across an update of a master copy read in place, dropped",
    "epoch": "rounds left open by a membership epoch's old group, closed with what they had",
    "passed": "steps passed without an update to line the shards up (a failover under "
              "update.dense=allreduce, a push the old group lost)",
}


def inexact(cfg, topo, reports: list[dict], lost: list[int]) -> list[str]:
    """update=sync: the reasons this run's result differs from an uninterrupted run's of the
    same config by design ([] where it should be that run's bit for bit, as after a failover
    with replicas, a roll back or a restart from a checkpoint): workers lost for good, and each
    cause the shards counted for a round without every worker's gradient. Gradients missing
    that no counter explains are named as such: no design accounts for them. [] in async (no
    run is exact there)."""
    if cfg.update.name != "sync":
        return []
    W = topo.num_workers
    reasons = ["workers lost for good: " + ", ".join(f"worker{w}" for w in lost)] if lost else []
    causes: dict[str, int] = {}
    unexplained = 0
    for r in reports:
        missing = W * r["version"] - sum(r["per_worker_applied"].values())
        for why, n in r.get("short", {}).items():
            causes[why] = causes.get(why, 0) + n
        unexplained += max(0, missing - sum(r.get("short", {}).values()))
    reasons += [f"{SHORT_BECAUSE.get(why, why)} ({n} gradients)" for why, n in sorted(causes.items())]
    if unexplained:
        reasons.append(f"UNEXPLAINED: {unexplained} gradients missing from sync rounds that no "
                       "counter accounts for")
    return reasons


def _table_traffic(plan, workers: dict) -> dict:
    """Embedding traffic per worker step (rows pulled and pushed, in bytes; messages to the
    table shards, and the share of them that went through a side channel) and the share of row
    lookups the workers' hot-row caches served (null without a cache); with held gradients
    (sparse.cache_writes=hold), the row gradients still held in a worker after the hand-over
    at the end (0: none left behind) and those handed over then."""
    if not plan.table_specs:
        return {}
    total = {k: sum(w.get(k, 0) for w in workers.values())
             for k in ("pushes", "sparse_bytes", "cache_lookups", "cache_hits", "table_rpcs",
                       "side_channel", "cache_grads", "cache_grads_held",
                       "cache_grads_handed_over")}
    steps = max(1, total["pushes"])
    return {"sparse_bytes_per_step": _round(total["sparse_bytes"] / steps, 1),
            "table_rpcs_per_step": _round(total["table_rpcs"] / steps, 2),
            "side_channel_share": _round(total["side_channel"] / max(1, total["table_rpcs"]), 2),
            "cache_hit_rate": (_round(total["cache_hits"] / total["cache_lookups"], 4)
                               if total["cache_lookups"] else None),
            "cache_grads_held_at_end": (total["cache_grads_held"] if total["cache_grads"]
                                        else None),
            "cache_grads_handed_over": total["cache_grads_handed_over"]}


def _tables(reports: list[dict]) -> dict:
    """Per table, its rows over every PS: live now, ever made, evicted (a fixed table: made once,
    never evicted); per PS, the memory of its process and of its tables."""
    parts = [r for r in reports if "tables" in r]
    if not parts:
        return {}
    tables: dict = {}
    for r in parts:
        for name, t in r["tables"].items():
            mine = tables.setdefault(name, {"rows_live": 0, "rows_created": 0,
                                            "rows_evicted": 0})
            for k in mine:
                mine[k] += t[k]
    return {"tables": tables,
            "ps_memory": [{"ps": r["ps"], "rss_bytes": r["rss_bytes"],
                           "peak_rss_bytes": r["peak_rss_bytes"],
                           "table_bytes": r["tables_bytes"]}
                          for r in parts]}


def _dense_replicas(cfg, workers: dict) -> dict:
    """update.dense=allreduce: whether every worker that reported ended with the same dense
    replica (the hash of its parameters)."""
    if cfg.update.dense != "allreduce":
        return {"dense": "ps"}
    digests = {w["dense_digest"] for w in workers.values() if w.get("dense_digest")}
    kinds = sorted({w["dense_group"] for w in workers.values() if w.get("dense_group")})
    return {"dense": "allreduce", "dense_replicas_identical": len(digests) == 1,
            "dense_group": "/".join(kinds)}


def log_done(summary: dict, out_dir: Path) -> None:
    tests = ", ".join(f"{k.replace('test_', 'test ')} " + (f"{v:.4f}" if v is not None else "n/a")
                      for k, v in summary.items() if k.startswith("test_"))
    log.info("done: %d steps, %d samples in %.1f s (%s samples/s), loss %s, %s; outputs in %s",
             summary["steps"], summary["samples"], summary["wall_s"], summary["samples_per_s"],
             summary["final_loss"], tests, out_dir)


def _round(x, nd: int = 2):
    return None if x is None else round(float(x), nd)

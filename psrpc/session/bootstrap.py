"""The chief's start-up: the model's first state (fresh and seeded, or the newest checkpoint
re-split for this layout), and the shards created on the PS with it.

`bootstrap` returns the Plan every worker receives: the layouts, the shards' Handles, the pipeline
cuts and the step training resumes from.
"""

from __future__ import annotations

import logging
import platform
from dataclasses import fields
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from psrpc import checkpoint
from psrpc.cluster import comm, shm
from psrpc.cluster.layout import Layout
from psrpc.cluster.topology import Topology
from psrpc.config import Config
from psrpc.errors import PsrpcError
from psrpc.factories import Data, load_data
from psrpc.faults import build_faults
from psrpc.models.stages import model_cuts, stage_shapes
from psrpc.ps import replicas, service
from psrpc.ps.shard import ShardSpec
from psrpc.ps.stats import ShardStats
from psrpc.ps.tables import TableShardSpec
from psrpc.session.folders import check_shared
from psrpc.sparse.tables import find_tables
from psrpc.worker.cache import holds_gradients
from psrpc.worker.plan import DenseState, Plan
from psrpc.worker.replica import model_buffers

log = logging.getLogger("psrpc")


def bootstrap(cfg: Config, topo: Topology, build_model: Callable[[Config, Data], nn.Module],
              out_dir: Optional[Path] = None):
    """Build the model (seeded) or restore the newest checkpoint, create the shards on the PS
    (per pipeline stage in model-parallel mode). Returns (plan, model, dataset)."""
    torch.manual_seed(cfg.train.seed)
    dataset = load_data(cfg)
    model = build_model(cfg, dataset)
    check_shared(cfg, topo, out_dir, bool(find_tables(model)))  # before anything is restored
    cuts, layouts = plan_layouts(cfg, topo, model)
    layout = Layout.concat(layouts)
    restored = checkpoint.find_latest(cfg.checkpoint.dir)
    flats, states = initial_state(cfg, model, layout, restored)
    buffers = restored_buffers(cfg, model, restored)
    on_ps, flats, states, dense = split_dense(cfg, layouts, flats, states, restored)
    shared = plan_shm(cfg, topo, layouts) if dense is None else []
    shards = create_shards(cfg, topo, on_ps, flats, states, restored, shared)
    specs = [spec for t in find_tables(model) for spec in t.specs]
    tables = (create_table_shards(cfg, topo, specs, Layout.concat(on_ps).num_shards, restored)
              if specs else [])
    plan = Plan(layouts, shards, cuts, restored.step if restored else None, buffers, tables,
                specs, cfg.sparse.partition, shared=shared, dense=dense)
    if specs:
        fixed = [t for t in specs if not t.dynamic]
        grown = (f"; {len(specs) - len(fixed)} dynamic (rows made per id, admitted after "
                 f"{cfg.sparse.admit_after}, evict={cfg.sparse.evict})"
                 if len(fixed) < len(specs) else "")
        log.info("%d embedding table(s), %d fixed rows × %s in all%s, on %d PS (%s partition, "
                 "%s)", len(specs), sum(t.num_rows for t in fixed),
                 "/".join(str(t.dim) for t in specs), grown, topo.num_ps, cfg.sparse.partition,
                 cfg.sparse.optimizer)
    log.info("%d parameters in %d %s of %s elements; %d workers%s, update=%s",
             sum(p.numel for p in layout.pieces), layout.num_shards,
             "shard(s)" if dense is None else "bucket(s) on the workers (update.dense=allreduce)",
             "/".join(str(n) for n in layout.shard_numel), topo.num_workers,
             f" ({topo.replicas} replicas × {len(cuts)} stages, cuts {cuts})"
             if len(cuts) > 1 else "", cfg.update.name)
    return plan, model, dataset


def plan_layouts(cfg: Config, topo: Topology, model) -> tuple[list[int], list[Layout]]:
    """Where every parameter goes: one layout per pipeline stage (data parallel: one). With
    update.dense=allreduce it is the workers' own buffers: buckets, no tensor cut in pieces."""
    if cfg.parallel.name == "data":
        cuts, shapes = [0], [{n: tuple(p.shape) for n, p in model.named_parameters()}]
    else:
        cuts = model_cuts(model, cfg.parallel)
        shapes = stage_shapes(model, cuts)
    if cfg.update.dense == "allreduce":
        return cuts, [Layout.plan(sh, 1, 2 ** 62, cfg.cluster.bucket_bytes) for sh in shapes]
    return cuts, [Layout.plan(sh, topo.num_ps, cfg.cluster.max_shard_bytes,
                              cfg.cluster.bucket_bytes) for sh in shapes]


CLOCK = Layout({}, (), (0,), (0,))
"""update.dense=allreduce: what the PS holds of the dense model, one shard with no parameters
on ps0: the global step, the barrier and the counters (the clock shard)."""


def split_dense(cfg: Config, layouts: list[Layout], flats: list, states: list,
                restored: Optional[checkpoint.Restored]):
    """(the layouts the PS holds, their flats, their states, the workers' DenseState or None):
    everything on the PS with update.dense=ps; with allreduce the clock shard on the PS and
    the dense state for the workers."""
    if cfg.update.dense != "allreduce":
        return layouts, flats, states, None
    dense = DenseState(restored.step if restored else 0, flats,
                       [st or {} for st in states])
    return [CLOCK], [torch.zeros(0)], [None], dense


def initial_state(cfg: Config, model, layout: Layout,
                  restored: Optional[checkpoint.Restored]):
    """Flat parameters and optimizer state per shard: the fresh model's, or the checkpoint's
    re-split for this layout."""
    if restored is None:
        named = {n: p.detach() for n, p in model.named_parameters()}
        return layout.split(named), [None] * layout.num_shards
    saved_optim = restored.manifest.get("optim")
    if saved_optim != cfg.optim.name:
        raise PsrpcError(
            f"checkpoint.dir={cfg.checkpoint.dir}: step-{restored.step} was saved with "
            f"optim={saved_optim}, this run uses optim={cfg.optim.name}; use another "
            "checkpoint.dir or the same optimizer")
    flats, states = checkpoint.reshard(restored, layout)
    log.info("restored step %d from %s (%d shard(s) -> %d)", restored.step,
             checkpoint.step_dir(cfg.checkpoint.dir, restored.step),
             restored.layout.num_shards, layout.num_shards)
    return flats, states


def restored_buffers(cfg: Config, model, restored: Optional[checkpoint.Restored]):
    """The checkpoint's buffers (BatchNorm statistics), checked against the model's; None when
    fresh, or when the checkpoint predates saved buffers (they then start over, with a warning)."""
    if restored is None:
        return None
    own = model_buffers(model)
    if restored.buffers is None:
        if own:
            log.warning("checkpoint step-%d holds no buffers (saved by an older psrpc): the "
                        "model's %d buffers (BatchNorm statistics) start from their initial "
                        "values", restored.step, len(own))
        return None
    saved = restored.buffers
    diff = sorted(set(own) ^ set(saved)) or [
        n for n in own if own[n].shape != saved[n].shape or own[n].dtype != saved[n].dtype]
    if diff:
        raise PsrpcError(f"checkpoint.dir={cfg.checkpoint.dir}: step-{restored.step} was made "
                         f"for another model (buffers differ: {diff[:3]}); use another "
                         "checkpoint.dir")
    return saved


def create_shards(cfg: Config, topo: Topology, layouts: list[Layout], flats, states,
                  restored: Optional[checkpoint.Restored], shared: list) -> list[list]:
    """One Shard per (stage, bucket) on its PS; Handles grouped by stage. `shared[g]`: shard
    g's shared memory (see plan_shm), or None."""
    layout = Layout.concat(layouts)
    version = restored.step if restored else 0
    stats = _shard_stats(restored, layout)
    stage_of = [s for s, lay in enumerate(layouts) for _ in range(lay.num_shards)]
    specs = []
    for g, k in enumerate(layout.shard_ps):  # shard g lives on ps{k}
        name = f"ps{k}/shard{g}" + (f"/stage{stage_of[g]}" if len(layouts) > 1 else "")
        spec = ShardSpec(g, flats[g], cfg.optim, cfg.update, topo.replicas, cfg.train.steps,
                         version, states[g],
                         None if layouts == [CLOCK] else cfg.checkpoint.dir,  # (the chief's)
                         cfg.checkpoint.every_steps,
                         build_faults(cfg.fault, "ps", k, topo.restart_count + topo.epoch),
                         stats[g], name, shared[g] if shared else None)
        specs.append((topo.ps_names[k], spec))
    shards = _create(specs, cfg.cluster.init_timeout_s, backup_map(cfg, topo),
                     cfg.cluster.shm != "off")
    return [[r for r, s in zip(shards, stage_of) if s == stage] for stage in range(len(layouts))]


def plan_shm(cfg: Config, topo: Topology, layouts: list[Layout]) -> list:
    """Per dense shard: (mode, run, ids of the workers on its PS's host) when some worker
    shares its PS's host (psrpc/cluster/shm.py), else None; each PS creates its shards' segments, before
    the shards and workers map them. A worker's id in a shard's rounds is its index in data
    parallel, its replica in model parallel (one stage worker per replica pushes a shard)."""
    layout = Layout.concat(layouts)
    hosts = dict(zip(topo.ps_names + topo.worker_names, comm.wait_all(
        [comm.call(n, shm.host_id) for n in topo.ps_names + topo.worker_names])))
    machines = dict(zip(topo.ps_names, comm.wait_all(
        [comm.call(n, platform.machine) for n in topo.ps_names])))
    run = topo.shm_run or shm.new_run()
    stage_of = [s for s, lay in enumerate(layouts) for _ in range(lay.num_shards)]
    shared, segments = [], {}
    for g, (k, numel) in enumerate(zip(layout.shard_ps, layout.shard_numel)):
        ids = [r for r in range(topo.replicas)
               if hosts[topo.stage_workers(r)[stage_of[g]]] == hosts[topo.ps_names[k]]]
        mode = shm.mode(cfg, bool(ids), machines[topo.ps_names[k]])
        if mode is None:
            shared.append(None)
            continue
        segments.setdefault(topo.ps_names[k], []).extend(
            [(shm.segment(run, g, "params"), shm.master_numel(numel))]
            + [(shm.segment(run, g, f"g{w}"), numel) for w in ids])
        shared.append((mode, run, ids))
    # On the PS's host (which may not be the chief's): the PS removes them when it leaves.
    nonces = dict(zip(segments, comm.wait_all(
        [comm.call(ps, service.create_segments, (run, ps, segs)) for ps, segs in segments.items()])))
    for ps, nonce in nonces.items():
        if isinstance(nonce, str):  # why this PS cannot share memory (its host's /dev/shm)
            if cfg.cluster.shm == "on":
                raise PsrpcError(f"cluster.shm=on but {ps} cannot share memory: {nonce}")
            log.warning("%s uses TCP: %s", ps, nonce)
            shared = [None if x and topo.ps_names[layout.shard_ps[g]] == ps else x
                      for g, x in enumerate(shared)]
    shared = _verified(cfg, topo, layouts, shared, nonces)
    if any(shared):
        log.info("shared memory with the PS on the same host: %d of %d shards (%s)",
                 sum(1 for x in shared if x), len(shared), next(x for x in shared if x)[0])
    elif cfg.cluster.shm == "on":
        raise PsrpcError("cluster.shm=on but no worker shares a host with a parameter server: "
                         "use cluster.shm=auto or off")
    return shared


def _verified(cfg: Config, topo: Topology, layouts: list[Layout], shared: list,
              nonces: dict) -> list:
    """`shared` without the workers that do not see their PS's segments (another /dev/shm, a
    file that is not the PS's): they use TCP, said in the log; with cluster.shm=on the run
    stops instead, naming the worker and the reason."""
    layout = Layout.concat(layouts)
    stage_of = [s for s, lay in enumerate(layouts) for _ in range(lay.num_shards)]
    asks: dict[str, list] = {}  # worker name -> [(segment, numel, nonce, shard, id)]
    for g, entry in enumerate(shared):
        if entry is None:
            continue
        mode, run, ids = entry
        ps, numel = topo.ps_names[layout.shard_ps[g]], layout.shard_numel[g]
        for w in ids:
            names = [shm.segment(run, g, f"g{w}")] + ([shm.segment(run, g, "params")]
                                                      if mode == "views" else [])
            asks.setdefault(topo.stage_workers(w)[stage_of[g]], []).extend(
                (n, numel, nonces[ps], g, w, run) for n in names)
    problems = dict(zip(asks, comm.wait_all([
        comm.call(name, shm.check_all, ([a[:3] for a in items], items[0][5], name))
        for name, items in asks.items()])))
    bad = {(a[3], a[4]) for name, items in asks.items() if problems[name] for a in items}
    for name, why in problems.items():
        if why is None:
            continue
        if cfg.cluster.shm == "on":
            raise PsrpcError(f"cluster.shm=on but {name} cannot use its PS's shared memory: "
                             f"{why}")
        log.warning("%s uses TCP: it cannot use its PS's shared memory (%s)", name, why)
    out = []
    for g, entry in enumerate(shared):
        if entry is None:
            out.append(None)
            continue
        mode, run, ids = entry
        kept = [w for w in ids if (g, w) not in bad]
        out.append((mode, run, kept) if kept else None)
    return out


def create_table_shards(cfg: Config, topo: Topology, specs: list, first: int,
                        restored: Optional[checkpoint.Restored]) -> list:
    """One TableShard per PS (global shard number first + k), holding its rows of every table;
    restored from the checkpoint's table files by each PS itself (they can be large)."""
    restore = None
    if restored is not None:
        saved = restored.tables
        if saved is None or saved["specs"] != [_spec_dict(t) for t in specs]:
            raise PsrpcError(f"checkpoint.dir={cfg.checkpoint.dir}: step-{restored.step} was made "
                             f"for other embedding tables ({saved and saved['specs']}); use "
                             "another checkpoint.dir")
        restore = {"paths": saved["paths"], "partition": saved["partition"],
                   "num_ps": saved["num_ps"], "step": restored.step}
    built = []
    for k in range(topo.num_ps):
        spec = TableShardSpec(
            first + k, torch.empty(0), cfg.optim, cfg.update, topo.replicas, cfg.train.steps,
            restored.step if restored else 0, None, cfg.checkpoint.dir,
            cfg.checkpoint.every_steps, build_faults(cfg.fault, "ps", k, topo.restart_count + topo.epoch),
            None, f"ps{k}/tables", ps=k, num_ps=topo.num_ps, tables=specs, seed=cfg.train.seed,
            sparse=cfg.sparse, restore=restore,
            hand_over=cfg.parallel.name == "data" and holds_gradients(cfg.sparse))
        built.append((topo.ps_names[k], spec))
    return _create(built, cfg.cluster.init_timeout_s, backup_map(cfg, topo),
                   cfg.cluster.shm != "off")


def backup_map(cfg: Config, topo: Topology) -> dict[str, list[str]]:
    """cluster.ps_replicas: per PS, the PS that hold backups of its shards (on other hosts
    first); {} without replicas."""
    if not cfg.cluster.ps_replicas:
        return {}
    hosts = comm.wait_all([comm.call(n, shm.host_id) for n in topo.ps_names])
    chosen = replicas.placement(topo.num_ps, cfg.cluster.ps_replicas, hosts)
    return {topo.ps_names[p]: [topo.ps_names[q] for q in qs] for p, qs in enumerate(chosen)}


def _create(specs: list[tuple[str, object]], timeout_s: float,
            backups: Optional[dict[str, list[str]]] = None, side: bool = False) -> list:
    """Build every (PS, spec) shard at once, and its backups (cluster.ps_replicas: each from
    the same spec, so every copy starts equal; `side`: replicated through the side channel on
    one host); their Handles (a constructor's error raises).
    Part of the start, so within cluster.init_timeout_s, not rpc_timeout_s (a PS restoring a
    large table, or still starting on a busy host, may take longer than a step's call)."""
    timeout_s = max(timeout_s, 1.0)
    comm.wait_all([comm.call(ps, service.create_shard, (spec,), timeout_s) for ps, spec in specs]
                  + [comm.call(b, service.create_backup, (spec,), timeout_s)
                     for ps, spec in specs for b in (backups or {}).get(ps, [])])
    if backups:
        comm.wait_all([comm.call(ps, replicas.set_backups, (spec.index, backups[ps], side),
                                 timeout_s) for ps, spec in specs])
    return [comm.Handle(ps, spec.index) for ps, spec in specs]


def _spec_dict(t) -> dict:
    return {"name": t.name, "num_rows": t.num_rows, "dim": t.dim}


def _shard_stats(restored: Optional[checkpoint.Restored], layout: Layout) -> list:
    """Counters each shard carries over a restore (None: from zero); only ShardStats' fields."""
    if restored is None:
        return [None] * layout.num_shards
    known = {f.name for f in fields(ShardStats)}
    return [None if s is None else {k: v for k, v in s.items() if k in known}
            for s in checkpoint.shard_stats(restored, layout)]

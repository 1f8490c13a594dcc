"""The chief's part of shard replicas (cluster.ps_replicas, docs/replicas.md): in a membership
epoch, promote the backups of a lost PS's shards (`fail_over`), point every primary at the
backups that exist (`name_backups`), copy new ones where copies were lost (`restore_backups`,
while training goes on), and at the end say whether every backup equals its primary."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from psrpc.cluster import comm
from psrpc.cluster.topology import Topology
from psrpc.config import Config
from psrpc.errors import first_line
from psrpc.ps import replicas, service
from psrpc.session.bootstrap import backup_map
from psrpc.worker.plan import Plan

log = logging.getLogger(__name__)


def _copied(fut: torch.futures.Future, handle, ps: str) -> None:
    try:
        version = fut.value()
    except Exception as e:
        log.warning("shard %d: no new backup on %s (%s)", handle.key, ps, first_line(e))
        return
    log.info("shard %d: a new backup on %s, copied at step %d", handle.key, ps, version)


def fail_over(cfg: Config, topo: Topology, plan: Plan, found: set[int]) -> tuple[Plan, list]:
    """cluster.ps_replicas: each shard whose primary is gone is served from now on by a
    backup (promoted on its PS; the plan's Handle points there). Returns the plan and what
    moved, or [] (nothing promoted) when some lost shard has no copy left: then every shard
    rolls back, as without replicas."""
    names = topo.ps_names
    held = dict(zip(names, comm.wait_all([comm.call(n, replicas.local_backups)
                                          for n in names])))
    lost = [h for h in plan.every_shard if h.key not in found]
    where = {h.key: next((n for n in names if h.key in held[n]), None) for h in lost}
    if any(n is None for n in where.values()):
        gone = sorted(k for k, n in where.items() if n is None)
        log.warning("shards %s lost every copy (their primary and cluster.ps_replicas=%d "
                    "backups): rolling every shard back to the last checkpoint", gone,
                    cfg.cluster.ps_replicas)
        return plan, []
    versions = comm.wait_all([comm.call(where[h.key], replicas.promote, (h.key,))
                              for h in lost])
    moved = {h.key: comm.Handle(where[h.key], h.key) for h in lost}
    plan = replace(
        plan, shards=[[moved.get(h.key, h) for h in stage] for stage in plan.shards],
        table_shards=[moved.get(h.key, h) for h in plan.table_shards],
        # (a worker started later takes no shared memory with a backup: it has none)
        shared=[None if g in moved else x for g, x in enumerate(plan.shared)])
    return plan, [{"shard": h.key, "from": h.owner, "to": where[h.key], "version": v}
                  for h, v in zip(lost, versions)]


def _held_backups(topo: Topology) -> dict[str, list[int]]:
    names = topo.ps_names
    return dict(zip(names, comm.wait_all([comm.call(n, replicas.local_backups)
                                          for n in names])))


def name_backups(cfg: Config, topo: Topology, plan: Plan) -> None:
    """Each primary replicates to the backups that exist now (not to a PS that died)."""
    held = _held_backups(topo)
    side = cfg.cluster.shm != "off"
    comm.wait_all([comm.call(h.owner, replicas.set_backups,
                             (h.key, [n for n, keys in held.items() if h.key in keys], side))
                   for h in plan.every_shard])


def restore_backups(cfg: Config, topo: Topology, plan: Plan) -> None:
    """Every shard with fewer than cluster.ps_replicas backups in step gets new ones, copied
    from its primary while training goes on (a PS that came back holds none; a backup that
    missed an update is replaced): on the PS the placement names, else any other PS."""
    names = topo.ps_names
    live = comm.wait_all([comm.call(h.owner, replicas.live_backups, (h.key,))
                          for h in plan.every_shard])
    wanted = backup_map(cfg, topo)
    copies = []
    for h, have in zip(plan.every_shard, live):
        home = names[_home(plan, h)]
        order = wanted.get(home, []) + [n for n in names if n not in wanted.get(home, [])]
        free = [n for n in order if n != h.owner and n not in have]
        for ps in free[:max(0, cfg.cluster.ps_replicas - len(have))]:
            copies.append((h, ps))
    if not copies:
        return
    timeout = cfg.cluster.init_timeout_s
    log.info("copying %d shards to new backups while training goes on", len(copies))
    for h, ps in copies:
        fut = comm.call(h.owner, service.copy_to,
                        (h.key, ps, timeout, cfg.cluster.shm != "off"), timeout)
        fut.add_done_callback(lambda f, h=h, ps=ps: _copied(f, h, ps))


def what_moved(rolled_back, failovers: list[dict]) -> str:
    """What an epoch did to the shards, for the chief's line."""
    if rolled_back is not None:
        return f" (every shard rolled back to step {rolled_back})"
    moved = sorted({f"{f['from']} -> {f['to']}" for f in failovers})
    return (f" ({len(failovers)} shards failed over to their backups: {', '.join(moved)}; "
            "nothing rolled back)" if failovers else "")


def compare_replicas(cfg: Config, topo: Topology) -> dict:
    """With cluster.ps_replicas, the summary's `replicas`: whether every backup holds its
    primary's state bit for bit (a digest of each copy's checkpoint form but the counters:
    rows, optimizer state, version), and where the copies are; {} without."""
    if not cfg.cluster.ps_replicas:
        return {}
    names = topo.ps_names
    found = comm.wait_all([comm.call(n, replicas.digests) for n in names])
    copies: dict[int, dict] = {}
    for name, held in zip(names, found):
        for index, (role, digest) in held.items():
            copies.setdefault(index, {"primary": None, "backups": {}})
            if role == "primary":
                copies[index]["primary"] = (name, digest)
            else:
                copies[index]["backups"][name] = digest
    agree = all(c["primary"] is not None and c["backups"] and all(
        d == c["primary"][1] for d in c["backups"].values()) for c in copies.values())
    return {"replicas": {"agree": agree, "copies": {
        k: {"primary": c["primary"][0] if c["primary"] else None,
            "backups": sorted(c["backups"])} for k, c in sorted(copies.items())}}}


def _home(plan: Plan, handle) -> int:
    """The PS a shard was placed on at the start (its primary unless it failed over)."""
    layout = plan.layout
    if handle in plan.table_shards:
        return plan.table_shards.index(handle)
    return layout.shard_ps[handle.key] if handle.key < len(layout.shard_ps) else 0

"""The chief's part of shard replicas (cluster.ps_replicas, docs/replicas.md): in a membership
epoch, promote the backups of a lost PS's shards (`fail_over`), point every primary at the
backups that exist (`name_backups`), copy new ones where copies were lost (`restore_backups`,
while training goes on), and at the end say whether every backup equals its primary."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Optional

import torch

from psrpc.cluster import comm
from psrpc.cluster.topology import Topology, in_lockstep
from psrpc.config import Config
from psrpc.errors import first_line
from psrpc.ps import replicas, service
from psrpc.session.bootstrap import backup_map
from psrpc.worker.plan import Plan

log = logging.getLogger(__name__)
DIGEST_TIMEOUT_S = 30.0  # the end's comparison of every copy: settled sockets, drained backlogs


def _copied(fut: torch.futures.Future, handle, ps: str) -> None:
    try:
        version = fut.value()
    except Exception as e:
        log.warning("shard %d: no new backup on %s (%s)", handle.key, ps, first_line(e))
        return
    log.info("shard %d: a new backup on %s, copied at step %d", handle.key, ps, version)


def fail_over(cfg: Config, topo: Topology, plan: Plan, found: set[int]) -> tuple[Plan, list]:
    """cluster.ps_replicas, in every membership epoch: each shard whose primary is gone is
    served from now on by its most advanced copy that was never given up (promoted on its PS;
    the plan's Handle points there), and every copy given up or behind the one promoted is
    dropped (a new one replaces it). Returns the plan and what moved, or [] (nothing promoted)
    when some lost shard has no such copy, or (lockstep sync) only one more than a step behind
    the cluster: then every shard rolls back, as without replicas, with a line saying why."""
    names = topo.ps_names
    held = dict(zip(names, comm.wait_all([comm.call(n, replicas.standings) for n in names])))
    lost = [h for h in plan.every_shard if h.key not in found]
    chosen = {h.key: _most_advanced(held, h.key) for h in lost}
    why = _no_promotion(cfg, topo, plan, found, held, chosen)
    _drop(held, chosen)
    if why is not None:
        log.warning("%s: rolling every shard back to the last checkpoint", why)
        return plan, []
    if not lost:
        return plan, []
    versions = comm.wait_all([comm.call(chosen[h.key], replicas.promote, (h.key,))
                              for h in lost])
    moved = {h.key: comm.Handle(chosen[h.key], h.key) for h in lost}
    plan = replace(
        plan, shards=[[moved.get(h.key, h) for h in stage] for stage in plan.shards],
        table_shards=[moved.get(h.key, h) for h in plan.table_shards],
        # (a worker started later takes no shared memory with a backup: it has none)
        shared=[None if g in moved else x for g, x in enumerate(plan.shared)])
    return plan, [{"shard": h.key, "from": h.owner, "to": chosen[h.key], "version": v}
                  for h, v in zip(lost, versions)]


def _most_advanced(held: dict[str, dict], index: int) -> Optional[str]:
    """The PS whose copy of shard `index` has applied the most updates among those never given
    up (ties: the first by name), or None."""
    best, most = None, -1
    for name, copies in held.items():
        c = copies.get(index)
        if c is not None and c["fenced"] is None and c["seq"] > most:
            best, most = name, c["seq"]
    return best


def _no_promotion(cfg: Config, topo: Topology, plan: Plan, found: set[int], held: dict,
                  chosen: dict[int, Optional[str]]) -> Optional[str]:
    """Why the lost shards cannot fail over (a line), or None."""
    none = sorted(k for k, n in chosen.items() if n is None)
    if none:
        given_up = {k: [f"{n} (lacks update {c[k]['fenced']})" for n, c in held.items()
                        if k in c and c[k]["fenced"] is not None] for k in none}
        return ("shards %s lost every copy (their primary and cluster.ps_replicas=%d backups)%s"
                % (none, cfg.cluster.ps_replicas, "".join(
                    f"; shard {k}'s copies on {', '.join(v)} were given up by its primary"
                    for k, v in given_up.items() if v)))
    if not in_lockstep(cfg) or not chosen:  # (shards one step apart at most)
        return None
    alive = [h for h in plan.every_shard if h.key in found]
    steps = [r["version"] for r in comm.wait_all([comm.invoke(h, "report") for h in alive])]
    steps += [held[n][k]["version"] for k, n in chosen.items()]
    behind = {k: held[n][k]["version"] for k, n in chosen.items()
              if held[n][k]["version"] < max(steps) - 1}
    if behind:  # (a sync step lost with a PS is pushed again: one behind is lined up)
        return (f"the most advanced copies of shards {sorted(behind)} are at steps "
                f"{[behind[k] for k in sorted(behind)]}, behind the cluster's step {max(steps)}")
    return None


def _drop(held: dict[str, dict], chosen: dict[int, Optional[str]]) -> None:
    """Drop every copy given up by its primary (fenced), and every copy of a lost shard
    behind the one promoted: none of them is a backup any more, a new copy replaces it."""
    drops = []
    for name, copies in held.items():
        for k, c in copies.items():
            best = chosen.get(k)
            behind = best is not None and c["seq"] < held[best][k]["seq"]
            if c["fenced"] is not None or behind:
                log.warning("shard %d: its copy on %s is dropped (%s)", k, name,
                            f"given up by its primary: it lacks update {c['fenced']}"
                            if c["fenced"] is not None else
                            f"at update {c['seq']}, behind {best}'s {held[best][k]['seq']}")
                drops.append(comm.call(name, replicas.drop_backup, (k,)))
    comm.wait_all(drops)


def forget_fences(cfg: Config, topo: Topology, plan: Plan) -> None:
    """Every shard rolls back: the fences of the copies before mean nothing to the new ones."""
    if cfg.cluster.ps_replicas:
        replicas.clear_fences([h.key for h in plan.every_shard], topo.ps_names)


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
    try:  # a diagnostic: a backup wedged after the last step costs no output
        found = comm.wait_all([comm.call(n, replicas.digests, timeout_s=DIGEST_TIMEOUT_S)
                               for n in names])
    except Exception as e:
        why = f"the copies' digests did not come: {first_line(e)}"
        log.warning("replicas: %s", why)
        return {"replicas": {"agree": None, "why": why}}
    copies: dict[int, dict] = {}
    for name, held in zip(names, found):
        for index, (role, digest) in held.items():
            c = copies.setdefault(index, {"primary": None, "backups": {}, "given_up": []})
            if role == "primary":
                c["primary"] = (name, digest)
            elif role == "given_up":  # (known stale: replaced in the next membership epoch)
                c["given_up"].append(name)
            else:
                c["backups"][name] = digest
    agree = all(c["primary"] is not None and (c["backups"] or c["given_up"]) and all(
        d == c["primary"][1] for d in c["backups"].values()) for c in copies.values())
    return {"replicas": {"agree": agree, "copies": {
        k: {"primary": c["primary"][0] if c["primary"] else None,
            "backups": sorted(c["backups"]), "given_up": sorted(c["given_up"]),
            "differ": sorted(n for n, d in c["backups"].items()
                             if c["primary"] is None or d != c["primary"][1])}
        for k, c in sorted(copies.items())}}}


def _home(plan: Plan, handle) -> int:
    """The PS a shard was placed on at the start (its primary unless it failed over)."""
    layout = plan.layout
    if handle in plan.table_shards:
        return plan.table_shards.index(handle)
    return layout.shard_ps[handle.key] if handle.key < len(layout.shard_ps) else 0

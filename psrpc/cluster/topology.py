"""The one object that maps ranks to roles: who is a PS, a worker, the chief, a pipeline stage.

Ranks [0, P) are parameter servers ps0..ps{P-1}; ranks [P, P+W) are workers
worker0..worker{W-1}; worker0 is the chief. Under torchrun and srun the launcher's ranks fill
node after node, so the PS run on the first node(s); with cluster.ps_placement=spread the first
rank of node k is ps{k} instead (k < P) and the others are the workers in the launcher's order
(`spread_rank`): each node's link then carries a share of the PS traffic. In model-parallel
mode worker i is stage i % S of pipeline replica i // S. What the launcher says about this
process (its rank, the store's address) is read by psrpc/cluster/launchers.py, for
`Topology.from_env` alone.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

from psrpc.cluster.launchers import interface_for, launched
from psrpc.errors import ConfigError


@dataclass(frozen=True)
class Topology:
    num_ps: int
    num_workers: int
    rank: Optional[int] = None
    """This process's rank; None in the local launcher's parent (which has no role)."""
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    restart_count: int = 0
    """torchrun's TORCHELASTIC_RESTART_COUNT: 0 in the first attempt of the group."""
    stages: int = 1
    """Pipeline stages per replica (model parallel); 1 in data-parallel mode."""
    interface: Optional[str] = None
    """Network interface this rank's RPC listens on; None: wherever the host name resolves."""
    agent_store: bool = False
    """torchrun's agent, or the local launcher, hosts the rendezvous store at
    MASTER_ADDR:MASTER_PORT (no rank does)."""
    epoch: int = 0
    """Membership epoch: a new static RPC group each time a lost rank is started again (the
    local launcher's workers rejoining, a PS recovering); 0 at start."""
    submitit: bool = False
    """Started by Hydra's submitit launcher: this process runs its rank of one job of a sweep."""
    shm_run: Optional[str] = None
    """The local launcher's name for this run's shared-memory segments (it removes them)."""
    nodes: int = 1
    """Hosts the launcher spans (torchrun's --nnodes, srun's nodes)."""
    node_workers: Optional[int] = None
    """Workers on this process's node, where the ranks of a node are not consecutive ones
    (cluster.ps_placement=spread); None: counted from the ranks."""

    @property
    def world_size(self) -> int:
        return self.num_ps + self.num_workers

    @classmethod
    def from_config(cls, cfg, env: Optional[Mapping[str, str]] = None) -> "Topology":
        """`from_env` with the cluster's sizes, stages and interface from a Config."""
        return cls.from_env(cfg.cluster.num_ps, cfg.cluster.num_workers, pipeline_stages(cfg),
                            cfg.cluster.interface, env, cfg.cluster.ps_placement)

    @classmethod
    def from_env(cls, num_ps: int, num_workers: int, stages: int = 1,
                 interface: Optional[str] = None,
                 env: Optional[Mapping[str, str]] = None,
                 placement: str = "first") -> "Topology":
        """This process's rank, from whoever started it (torchrun, srun, submitit: the module
        docstring); without one this is the local launcher's parent (whose ranks listen on
        loopback whatever the environment says, see `launch`).

        The interface to listen on is `interface` (cluster.interface), else the one that
        TP_SOCKET_IFNAME or GLOO_SOCKET_IFNAME names, else the launcher's default (loopback for
        submitit_local, whose tasks all run on this machine; else wherever the host name
        resolves)."""
        env = os.environ if env is None else env
        base = dict(num_ps=num_ps, num_workers=num_workers, stages=stages)
        started = launched(env)
        if started is None:
            port = env.get("MASTER_PORT")
            return cls(**base, master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                       master_port=int(port) if port else 0)
        if started.world_size != num_ps + num_workers:
            raise ConfigError(
                f"{started.world_key}={started.world_size} but cluster.num_ps={num_ps} + "
                f"cluster.num_workers={num_workers} = {num_ps + num_workers}: launch exactly "
                f"P + W processes ({started.how} = {num_ps + num_workers}), or change "
                f"cluster.num_ps / cluster.num_workers")
        rank, node_workers = started.rank, None
        if placement == "spread":
            rank, node_workers = spread_rank(started, num_ps)
        return cls(**base, rank=rank, master_addr=started.find_master_addr(),
                   node_workers=node_workers, nodes=started.nodes,
                   master_port=started.master_port, local_rank=started.local_rank,
                   local_world_size=started.local_world_size,
                   restart_count=started.restart_count,
                   interface=interface_for(interface, env) or started.default_interface,
                   agent_store=started.agent_store, submitit=started.submitit)

    def with_rank(self, rank: int, epoch: int = 0) -> "Topology":
        """This topology as seen by one process the local launcher starts (one node; the
        launcher hosts the store), joining at membership epoch `epoch`."""
        return Topology(self.num_ps, self.num_workers, rank, self.master_addr, self.master_port,
                        rank, self.world_size, stages=self.stages, interface=self.interface,
                        agent_store=True, epoch=epoch, shm_run=self.shm_run)

    # -- questions the rest of psrpc asks -----------------------------------------------------
    def role_of(self, rank: int) -> tuple[str, int]:
        """("ps", k) or ("worker", i)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1}")
        return ("ps", rank) if rank < self.num_ps else ("worker", rank - self.num_ps)

    def name_of(self, rank: int) -> str:
        role, index = self.role_of(rank)
        return f"{role}{index}"

    @property
    def name(self) -> str:
        return "launcher" if self.rank is None else self.name_of(self.rank)

    @property
    def role(self) -> str:
        return self.role_of(self.rank)[0]

    @property
    def index(self) -> int:
        """k for ps{k}, i for worker{i}."""
        return self.role_of(self.rank)[1]

    @property
    def is_chief(self) -> bool:
        return self.rank == self.num_ps

    @property
    def ps_names(self) -> list[str]:
        return [f"ps{k}" for k in range(self.num_ps)]

    @property
    def worker_names(self) -> list[str]:
        return [f"worker{i}" for i in range(self.num_workers)]

    @property
    def chief_name(self) -> str:
        return "worker0"

    def rank_of(self, name: str) -> int:
        m = re.fullmatch(r"(ps|worker)(\d+)", name)
        if m is None:
            raise ValueError(f"{name!r} is not a rank name (ps<k> or worker<i>)")
        index = int(m.group(2))
        return index if m.group(1) == "ps" else self.num_ps + index

    def shard_of(self, name: str) -> int:
        """The shard index that PS `name` holds (ps{k} holds shard k)."""
        role, index = self.role_of(self.rank_of(name))
        if role != "ps":
            raise ValueError(f"{name} is a worker, it holds no shard")
        return index

    # -- model parallel: worker i is stage i % S of replica i // S ------------------------------
    @property
    def replicas(self) -> int:
        return self.num_workers // self.stages

    def replica_of(self, worker: int) -> int:
        return worker // self.stages

    def stage_of(self, worker: int) -> int:
        return worker % self.stages

    @property
    def is_leader(self) -> bool:
        """Stage 0 of its replica: feeds the pipeline (every worker, in data-parallel mode)."""
        return self.role == "worker" and self.stage_of(self.index) == 0

    def stage_workers(self, replica: int) -> list[str]:
        """Worker names holding stages 0..S-1 of `replica`."""
        return [f"worker{replica * self.stages + s}" for s in range(self.stages)]

    def local_rank_of(self, rank: int) -> int:
        """A peer's LOCAL_RANK (torchrun gives every node the same number of processes)."""
        return rank % self.local_world_size

    @property
    def workers_on_this_node(self) -> int:
        """Workers sharing this node's cores (for the default thread count)."""
        if self.node_workers is not None:
            return max(1, self.node_workers)
        first = self.rank - self.local_rank
        last = first + self.local_world_size
        return max(1, sum(1 for r in range(first, last) if r >= self.num_ps))


def spread_rank(started, num_ps: int) -> tuple[int, int]:
    """cluster.ps_placement=spread: (psrpc's rank for the launcher's `started.rank`, the workers
    on its node). The first rank of node k < P is ps{k}; every other rank is a worker, numbered
    in the launcher's order. Needs as many nodes as PS."""
    if started.nodes < num_ps:
        raise ConfigError(f"cluster.ps_placement='spread': {started.nodes} node(s) for "
                          f"cluster.num_ps={num_ps}: it puts one PS on each of the first nodes; "
                          "use at most one PS per node, or cluster.ps_placement=first")
    has_ps = started.node < num_ps
    if has_ps and started.local_rank == 0:
        return started.node, started.local_world_size - 1
    before = min(started.node, num_ps) + int(has_ps)  # PS ranks the launcher numbered lower
    return num_ps + started.rank - before, started.local_world_size - int(has_ps)


def pipeline_stages(cfg) -> int:
    """Pipeline stages per replica: parallel.stages in model-parallel mode, else 1."""
    return cfg.parallel.stages if cfg.parallel.name == "model" else 1


def replicas(cfg) -> int:
    """Data-parallel replicas: W in data-parallel mode, W / stages in model-parallel mode."""
    return cfg.cluster.num_workers // pipeline_stages(cfg)


def in_lockstep(cfg) -> bool:
    """Sync with every replica in each round (no backup workers): no shard can pass a step
    without every replica's push, so the shards are never more than a step apart."""
    return cfg.update.name == "sync" and cfg.update.replicas_to_aggregate in (None, replicas(cfg))

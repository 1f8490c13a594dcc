"""Who started this process, read from its environment (the first reader that applies):
- torchrun, or anything that sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT;
- srun, also inside a SLURM job that Hydra's submitit launcher submitted (SLURM_PROCID, ...);
- Hydra's submitit_local launcher (SUBMITIT_LOCAL_GLOBALID, ...: submitit's own variables);
- nothing: this is the local launcher's parent, which starts every rank itself. A SLURM job step
  (or submitit_local job) of one task is this case too: its one task runs the local launcher.

Only `Topology.from_env` (psrpc/cluster/topology.py) and the entry point's run directory read
these; nothing else in psrpc reads the launch environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from psrpc.cluster import netif, slurm
from psrpc.errors import ConfigError, PsrpcError

# Where a user names the interface RPC listens on, besides cluster.interface: TensorPipe's and
# gloo's own variables (init_rpc builds a gloo group too; both listen).
INTERFACE_ENV = ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


@dataclass(frozen=True)
class Launched:
    """What the launcher that started this process says about it."""

    rank: int
    world_size: int
    world_key: str
    """The variable that holds the world size (named in the error when it is not P + W)."""
    how: str
    """How to start P + W processes with this launcher (said in that error)."""
    find_master_addr: Callable[[], str]
    """Where rank 0 (or torchrun's agent) hosts the rendezvous store; a call, as reading a
    SLURM node list may run scontrol (only from_env needs it)."""
    master_port: int
    local_rank: int = 0
    local_world_size: int = 1
    node: int = 0
    """This process's node (torchrun's GROUP_RANK, srun's SLURM_NODEID); ranks are numbered
    node after node."""
    nodes: int = 1
    restart_count: int = 0
    agent_store: bool = False
    submitit: bool = False
    default_interface: Optional[str] = None
    run_id: Optional[str] = None
    """A name every rank of this run shares (its output directory); None: none is shared."""


def launched(env: Optional[Mapping[str, str]] = None) -> Optional[Launched]:
    """This process's rank as its launcher gives it; None in the local launcher's parent."""
    env = os.environ if env is None else env
    for reader in _READERS:
        started = reader(env)
        if started is not None:
            return started
    return None


def shared_run_id(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """`torchrun/<run id>` or `slurm/<job id>.<step id>`: the output directory every rank of one
    run agrees on (each rank resolves Hydra's ${now} on its own); None where there is none."""
    try:
        started = launched(env)
    except PsrpcError:  # from_env reports it, in one line, once Hydra has started
        return None
    return started.run_id if started else None


def launched_rank(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """This process's rank, or None in the local launcher's parent (which has none)."""
    try:
        started = launched(env)
    except PsrpcError:
        return None
    return started.rank if started else None


def _torchrun(env: Mapping[str, str]) -> Optional[Launched]:
    """torchrun's variables, or RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set by hand."""
    if "RANK" not in env:
        return None
    world = _int(env, "WORLD_SIZE", 0)
    run_id = env.get("TORCHELASTIC_RUN_ID")
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    return Launched(
        rank=_int(env, "RANK"), world_size=world, world_key="WORLD_SIZE",
        how="torchrun --nproc-per-node × --nnodes", find_master_addr=lambda: addr,
        master_port=_int(env, "MASTER_PORT", 0), local_rank=_int(env, "LOCAL_RANK", 0),
        local_world_size=_int(env, "LOCAL_WORLD_SIZE", world),
        node=_int(env, "GROUP_RANK", 0), nodes=_int(env, "GROUP_WORLD_SIZE", 1),
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        run_id=f"torchrun/{run_id}" if run_id and run_id != "none" else None)


def _slurm(env: Mapping[str, str]) -> Optional[Launched]:
    """A task that srun started: one rank per task of the job step."""
    if "SLURM_PROCID" not in env:
        return None
    world = _int(env, "SLURM_NTASKS", 1)
    if world == 1:  # a step of one task (sbatch's own script, srun -n1): the local launcher
        return None
    job = env.get("SLURM_JOB_ID")
    if env.get("MASTER_PORT"):
        port = _int(env, "MASTER_PORT")
    elif job:
        port = slurm.port_for_job(_int(env, "SLURM_JOB_ID"))
    else:
        raise ConfigError("SLURM_PROCID is set but neither MASTER_PORT nor SLURM_JOB_ID: set "
                          "MASTER_PORT to a free port on the first node of the step")
    step = env.get("SLURM_STEP_ID")
    node = _int(env, "SLURM_NODEID", 0)
    return Launched(
        rank=_int(env, "SLURM_PROCID"), world_size=world, world_key="SLURM_NTASKS",
        how="srun --ntasks, or hydra.launcher.nodes × hydra.launcher.tasks_per_node",
        find_master_addr=lambda: env.get("MASTER_ADDR") or _first_node(env),
        master_port=port, local_rank=_int(env, "SLURM_LOCALID", 0),
        local_world_size=_tasks_on_node(env, node), node=node,
        nodes=_int(env, "SLURM_STEP_NUM_NODES", 0) or _int(env, "SLURM_NNODES", 0)
        or _nodes(env),
        restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
        submitit=env.get("SUBMITIT_EXECUTOR") == "slurm",
        run_id=(f"slurm/{job}" + (f".{step}" if step else "")) if job else None)


def _submitit_local(env: Mapping[str, str]) -> Optional[Launched]:
    """A task of a job that Hydra's submitit_local launcher started: submitit runs every task
    of a job on this machine and names them with its own variables (no SLURM_*)."""
    if env.get("SUBMITIT_EXECUTOR") != "local" or "SUBMITIT_LOCAL_GLOBALID" not in env:
        return None
    world = _int(env, "SUBMITIT_LOCAL_NTASKS", 1)
    if world == 1:
        return None
    if env.get("MASTER_PORT"):
        port = _int(env, "MASTER_PORT")
    else:  # the job id is the pid of submitit's controller of this job's tasks
        port = slurm.port_for_job(_int(env, "SUBMITIT_LOCAL_JOB_ID"))
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    rank = _int(env, "SUBMITIT_LOCAL_GLOBALID")
    return Launched(
        rank=rank, world_size=world, world_key="SUBMITIT_LOCAL_NTASKS",
        how="hydra.launcher.tasks_per_node", find_master_addr=lambda: addr, master_port=port,
        local_rank=_int(env, "SUBMITIT_LOCAL_LOCALID", rank), local_world_size=world,
        submitit=True, default_interface=netif.loopback_interface())


_READERS = (_torchrun, _slurm, _submitit_local)


def _int(env: Mapping[str, str], key: str, default: Optional[int] = None) -> int:
    value = env.get(key)
    if value is None or value == "":
        if default is None:
            raise ConfigError(f"{key} is not set; the launcher that started this process sets it")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r}: not an integer") from None


_NODELIST_KEYS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
_TASKS_PER_NODE_KEYS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


def _first_node(env: Mapping[str, str]) -> str:
    """The first node of the job step, where task 0 runs (SLURM's default block distribution;
    with another one, MASTER_ADDR names task 0's node)."""
    key = next((k for k in _NODELIST_KEYS if env.get(k)), None)
    if key is None:
        raise ConfigError(f"SLURM_PROCID is set but none of {', '.join(_NODELIST_KEYS)} is: set "
                          "MASTER_ADDR to the address of the node that runs task 0")
    try:
        return slurm.first_host(env[key])
    except ValueError as e:
        raise ConfigError(f"{key}={env[key]!r}: {e}; set MASTER_ADDR to the address of the node "
                          "that runs task 0") from None


def _tasks_on_node(env: Mapping[str, str], node: int) -> int:
    """SLURM_NTASKS_PER_NODE (set with --ntasks-per-node), else this node's entry of
    SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE; 1 without any."""
    if env.get("SLURM_NTASKS_PER_NODE"):
        return _int(env, "SLURM_NTASKS_PER_NODE")
    key = next((k for k in _TASKS_PER_NODE_KEYS if env.get(k)), None)
    if key is None:
        return 1
    try:
        counts = slurm.tasks_per_node(env[key])
    except ValueError as e:
        raise ConfigError(f"{key}={env[key]!r}: {e}") from None
    if not 0 <= node < len(counts):
        raise ConfigError(f"SLURM_NODEID={node} but {key}={env[key]!r} lists {len(counts)} nodes")
    return counts[node]


def _nodes(env: Mapping[str, str]) -> int:
    """The step's nodes, from its tasks per node (1 where nothing says)."""
    key = next((k for k in _TASKS_PER_NODE_KEYS if env.get(k)), None)
    try:
        return len(slurm.tasks_per_node(env[key])) if key else 1
    except ValueError as e:
        raise ConfigError(f"{key}={env[key]!r}: {e}") from None


def interface_for(configured: Optional[str], env: Mapping[str, str]) -> Optional[str]:
    """The one interface a rank listens on: cluster.interface or the environment's, checked to
    exist. psrpc points TensorPipe and gloo at it, so names that disagree are an error."""
    named = {"cluster.interface": [configured]} if configured is not None else {}
    named.update({key: [n for n in env[key].split(",") if n]  # gloo takes a list
                  for key in INTERFACE_ENV if env.get(key)})
    for key, names in named.items():
        for n in names:
            netif.check_interface(n, key)
    if len({tuple(names) for names in named.values()}) > 1:
        said = ", ".join(f"{k}={','.join(v)!r}" for k, v in named.items())
        raise ConfigError(f"{said}: name one interface (RPC listens through TensorPipe and "
                          "gloo; psrpc points both at it)")
    return next(iter(named.values()))[0] if named else None



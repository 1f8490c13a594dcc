"""The one object mapping ranks to roles."""

import pytest

from psrpc.cluster import netif
from psrpc.cluster.launchers import launched_rank, shared_run_id
from psrpc.cluster.topology import Topology
from psrpc.errors import ConfigError


def test_ranks_to_roles():
    t = Topology(2, 3)
    assert [t.name_of(r) for r in range(5)] == ["ps0", "ps1", "worker0", "worker1", "worker2"]
    assert t.role_of(3) == ("worker", 1) and t.rank_of("worker2") == 4 and t.shard_of("ps1") == 1
    assert t.ps_names == ["ps0", "ps1"] and t.chief_name == "worker0"
    assert t.with_rank(2).is_chief and not t.with_rank(3).is_chief


def test_from_env_reads_torchrun_variables():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29555", "TORCHELASTIC_RUN_ID": "x"}
    t = Topology.from_env(1, 3, env=env)
    assert (t.rank, t.name, t.master_addr, t.master_port) == (3, "worker2", "10.0.0.1", 29555)
    assert t.restart_count == 0 and t.workers_on_this_node == 2
    assert shared_run_id(env) == "torchrun/x" and launched_rank(env) == 3
    assert Topology.from_env(1, 3, env={}).rank is None  # no RANK: the local launcher's parent
    assert shared_run_id({}) is None and launched_rank({}) is None


def test_world_size_mismatch_names_every_number():
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=3 but cluster.num_ps=1 \+ "
                                          r"cluster.num_workers=3 = 4"):
        Topology.from_env(1, 3, env={"RANK": "0", "WORLD_SIZE": "3"})


# What srun gives task 3 of a 4-task step over two nodes (2 tasks each), job 123456 step 0
SRUN_ENV = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
            "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "node[07-08]",
            "SLURM_NODELIST": "node[07-08]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}


def test_from_env_reads_srun_variables():
    t = Topology.from_env(1, 3, env=SRUN_ENV)
    assert (t.rank, t.name, t.local_rank, t.local_world_size) == (3, "worker2", 1, 2)
    # task 0 runs on the first node of the step; the port follows from the job id
    assert (t.master_addr, t.master_port) == ("node07", 15000 + 123456 % 10000)
    assert not t.agent_store and not t.submitit and t.interface is None and t.restart_count == 0
    assert shared_run_id(SRUN_ENV) == "slurm/123456.0" and launched_rank(SRUN_ENV) == 3
    mine = Topology.from_env(1, 3, env={**SRUN_ENV, "MASTER_ADDR": "10.1.2.3",
                                        "MASTER_PORT": "2345", "SLURM_RESTART_COUNT": "2",
                                        "SUBMITIT_EXECUTOR": "slurm"})
    assert (mine.master_addr, mine.master_port, mine.restart_count) == ("10.1.2.3", 2345, 2)
    assert mine.submitit  # a task of a job that Hydra's submitit launcher submitted
    uneven = {**SRUN_ENV, "SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_PROCID": "0",
              "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    assert Topology.from_env(1, 3, env=uneven).local_world_size == 3
    per_node = {**uneven, "SLURM_NTASKS_PER_NODE": "2"}  # --ntasks-per-node wins
    assert Topology.from_env(1, 3, env=per_node).local_world_size == 2


def _torchrun_env(rank: int, per_node: list[int]) -> dict:
    """torchrun's variables for global `rank` of nodes holding `per_node` ranks each."""
    node = next(n for n in range(len(per_node)) if rank < sum(per_node[:n + 1]))
    return {"RANK": str(rank), "WORLD_SIZE": str(sum(per_node)), "GROUP_RANK": str(node),
            "GROUP_WORLD_SIZE": str(len(per_node)), "LOCAL_WORLD_SIZE": str(per_node[node]),
            "LOCAL_RANK": str(rank - sum(per_node[:node]))}


@pytest.mark.parametrize("per_node, ps, names", [
    ([3, 3, 3], 3, ["ps0", "worker0", "worker1", "ps1", "worker2", "worker3", "ps2", "worker4",
                    "worker5"]),
    ([3, 2], 2, ["ps0", "worker0", "worker1", "ps1", "worker2"]),
    ([2, 2, 2], 2, ["ps0", "worker0", "ps1", "worker1", "worker2", "worker3"]),
    ([1, 2], 1, ["ps0", "worker0", "worker1"]),  # one PS: the same as first
])
def test_spread_puts_the_first_rank_of_each_node_to_work_as_a_ps(per_node, ps, names):
    world = sum(per_node)
    topos = [Topology.from_env(ps, world - ps, env=_torchrun_env(r, per_node), placement="spread")
             for r in range(world)]
    assert [t.name for t in topos] == names
    assert sorted(t.rank for t in topos) == list(range(world))  # every rank once
    for t, r in zip(topos, range(world)):
        node = int(_torchrun_env(r, per_node)["GROUP_RANK"])
        assert t.workers_on_this_node == max(1, per_node[node] - int(node < ps))


def test_spread_with_more_ps_than_nodes_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"cluster.ps_placement='spread': 2 node\(s\) for "
                                          r"cluster.num_ps=3"):
        Topology.from_env(3, 3, env=_torchrun_env(0, [3, 3]), placement="spread")
    srun = {**SRUN_ENV, "SLURM_STEP_TASKS_PER_NODE": "1(x4)", "SLURM_NODEID": "3",
            "SLURM_LOCALID": "0"}
    t = Topology.from_env(2, 2, env=srun, placement="spread")  # 4 nodes from tasks per node
    assert t.name == "worker1"


def test_one_slurm_task_runs_the_local_launcher_and_torchrun_comes_first():
    for one in ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "5"},  # srun -n1
                {"SLURM_PROCID": "0", "SLURM_JOB_ID": "5"}):                   # sbatch's script
        assert Topology.from_env(1, 3, env=one).rank is None and shared_run_id(one) is None
    # torchrun under srun (one agent per node): torchrun's variables name the rank
    both = {**SRUN_ENV, "RANK": "1", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "r"}
    assert Topology.from_env(1, 3, env=both).rank == 1 and shared_run_id(both) == "torchrun/r"


@pytest.mark.parametrize("change, message", [
    ({"SLURM_NTASKS": "3"}, r"SLURM_NTASKS=3 but cluster.num_ps=1 \+ cluster.num_workers=3 = 4: "
                            r"launch exactly P \+ W processes \(srun --ntasks, or "
                            r"hydra.launcher.nodes × hydra.launcher.tasks_per_node = 4\)"),
    ({"SLURM_PROCID": "x"}, r"SLURM_PROCID='x': not an integer"),
    ({"SLURM_STEP_NODELIST": None, "SLURM_NODELIST": None},
     r"none of SLURM_STEP_NODELIST, SLURM_NODELIST, SLURM_JOB_NODELIST is: set MASTER_ADDR"),
    ({"SLURM_STEP_NODELIST": "node[07"}, r"SLURM_STEP_NODELIST='node\[07': cannot read node list"),
    ({"SLURM_JOB_ID": None}, r"neither MASTER_PORT nor SLURM_JOB_ID: set MASTER_PORT"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(y2)"}, r"SLURM_STEP_TASKS_PER_NODE='2\(y2\)': cannot read"),
    ({"SLURM_STEP_TASKS_PER_NODE": "4"}, r"SLURM_NODEID=1 but SLURM_STEP_TASKS_PER_NODE='4' lists "
                                         r"1 nodes"),
])
def test_slurm_errors_name_the_variable(change, message):
    env = {k: v for k, v in {**SRUN_ENV, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        Topology.from_env(1, 3, env=env)


def test_from_env_reads_submitit_local_variables():
    """Hydra's submitit_local runs a job's tasks on this machine, named by submitit's own
    variables: every listener on loopback unless an interface is named."""
    env = {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_GLOBALID": "1",
           "SUBMITIT_LOCAL_LOCALID": "1", "SUBMITIT_LOCAL_NTASKS": "3",
           "SUBMITIT_LOCAL_JOB_ID": "4321"}
    t = Topology.from_env(1, 2, env=env)
    assert (t.rank, t.master_addr, t.master_port) == (1, "127.0.0.1", 15000 + 4321)
    assert t.submitit and t.interface == netif.loopback_interface() and shared_run_id(env) is None
    with pytest.raises(ConfigError, match=r"SUBMITIT_LOCAL_NTASKS=3 but cluster.num_ps=1 \+ "
                                          r"cluster.num_workers=1 = 2: .*tasks_per_node = 2"):
        Topology.from_env(1, 1, env=env)
    assert Topology.from_env(1, 2, env={**env, "SUBMITIT_LOCAL_NTASKS": "1"}).rank is None


def test_a_rendezvous_host_without_an_address_stops_a_many_host_start_naming_it():
    """On more than one host, a rendezvous host name that does not resolve is said at once
    (otherwise: a rendezvous timeout); on one host nothing is checked."""
    from psrpc.cluster import netif
    from psrpc.errors import ConfigError
    with pytest.raises(ConfigError, match=r"'nosuchhost\.invalid' \(MASTER_ADDR"):
        netif.check_many_hosts(netif.loopback_interface(), "nosuchhost.invalid", 2)
    netif.check_many_hosts(None, "nosuchhost.invalid", 1)

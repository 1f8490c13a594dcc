"""The one object mapping ranks to roles."""

import pytest

from psrpc.errors import ConfigError
from psrpc.topology import Topology


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
    assert Topology.from_env(1, 3, env={}).rank is None  # no RANK: the local launcher's parent


def test_world_size_mismatch_names_every_number():
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=3 but cluster.num_ps=1 \+ "
                                          r"cluster.num_workers=3 = 4"):
        Topology.from_env(1, 3, env={"RANK": "0", "WORLD_SIZE": "3"})

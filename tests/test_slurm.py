"""SLURM's compressed node and task lists, read without SLURM."""

import pytest

from psrpc.cluster import slurm


@pytest.mark.parametrize("nodelist, hosts", [
    ("node07", ["node07"]),
    ("a,b-2", ["a", "b-2"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
    ("tux[1-2]-ib", ["tux1-ib", "tux2-ib"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert slurm.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["", "node[07", "node]", "n[a-b]", "x,,y", "n[1-2"])
def test_unreadable_nodelist_is_a_value_error(nodelist):
    with pytest.raises(ValueError, match="cannot read"):
        slurm.expand_nodelist(nodelist)


def test_first_host_without_scontrol(monkeypatch):
    monkeypatch.setattr(slurm.shutil, "which", lambda name: None)
    slurm.first_host.cache_clear()
    assert slurm.first_host("gpu[003-004],cpu1") == "gpu003"


def test_tasks_per_node_and_port():
    assert slurm.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError, match=r"2\(x3\),1"):
        slurm.tasks_per_node("2x3")
    assert slurm.port_for_job(123456) == 18456 and slurm.port_for_job(9999) == 24999

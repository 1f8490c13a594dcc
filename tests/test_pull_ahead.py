"""Pulls ahead of time (`sparse.pull_ahead=auto`, the default: `sparse.cache_staleness` >= 1
with update.dense=allreduce, sync; `off` never, `on` or an error): a
worker computes step t+1 while step t's round is under way, on table rows one step old, and
pushes it once t's reply is in. The dense replica stays exact (each step's average is applied
before the next forward), so with frozen tables (sparse.lr=0) the run is the exact run bit for
bit, checkpoints and resumes included; with learning tables it makes one table message per step
and learns as the exact run does, a worker killed mid-run rejoins."""

import pytest

from tests.conftest import run_cluster
from tests.test_sparse_cluster import CLICKS, _assert_equal, _run

pytestmark = pytest.mark.timeout(300)
MODE = ["update.dense=allreduce", "cluster.num_workers=2", "cluster.num_ps=1",
        "train.batch_size=32", "optim=adam"]
AHEAD = ["sparse.cache_staleness=1"]
FROZEN = ["sparse.lr=0.0"]  # the rows never change: a step's lag cannot show


def test_with_frozen_tables_pulling_ahead_changes_no_bit_and_a_resume_is_exact(tmp_path):
    exact = _run(tmp_path / "exact", MODE + FROZEN)
    ahead = _run(tmp_path / "ahead", MODE + FROZEN + AHEAD)
    _assert_equal(ahead, exact)  # dense replica, rows and Adagrad's state: the same bits
    assert ahead[0]["dense_replicas_identical"] and ahead[0]["steps"] == 20
    # the chief saves step 10's dense replica before it applies step 10's average, though
    # step 10's forward and backward are done by then
    ck = tmp_path / "ck"
    first = _run(tmp_path / "first", MODE + FROZEN + AHEAD + [
        f"checkpoint.dir={ck}", "hooks=[{_target_: psrpc.hooks.StopAtStep, last_step: 10}]"])
    assert first[0]["steps"] == 10 and (ck / "step-10" / "shard-0.pt").exists()
    second = _run(tmp_path / "second", MODE + FROZEN + AHEAD + [f"checkpoint.dir={ck}"])
    assert second[0]["restored_from_step"] == 10 and second[0]["steps"] == 20
    _assert_equal(second, exact)


def test_with_pulling_ahead_off_a_bound_and_no_cache_rows_is_the_exact_run_bit_for_bit(
        tmp_path):
    """sparse.pull_ahead=off: a bound of one step with dense all-reduce (which pulls ahead
    under `auto`, the test below) and cache_rows=0 caches nothing and computes nothing ahead:
    learning tables, dense replica and every row's Adagrad state have the exact run's bits."""
    mode = MODE + ["train.steps=30"]
    exact = _run(tmp_path / "exact", mode)
    off = _run(tmp_path / "off", mode + AHEAD + ["sparse.cache_rows=0", "sparse.pull_ahead=off"])
    _assert_equal(off, exact)
    assert off[0]["test_auc"] == exact[0]["test_auc"]
    assert off[0]["table_rpcs_per_step"] == exact[0]["table_rpcs_per_step"]


def test_pulling_ahead_sends_one_table_message_a_step_and_learns_as_the_exact_run(tmp_path):
    mode = MODE + ["train.steps=60", "train.log_every=30"]
    exact = _run(tmp_path / "exact", mode)
    ahead = _run(tmp_path / "ahead", mode + AHEAD)
    summary = ahead[0]
    assert summary["steps"] == 60 and all(s["version"] == 60 for s in summary["shards"])
    assert summary["dense_replicas_identical"]
    # a pull before the first step and one for the second (computed before the first reply);
    # then each step's rows came with the reply of the step before last
    assert summary["table_rpcs_per_step"] == round(1 + 2 / 60, 2)  # (the summary rounds)
    assert summary["sparse_bytes_per_step"] == exact[0]["sparse_bytes_per_step"]
    assert abs(summary["test_auc"] - exact[0]["test_auc"]) < 0.01
    assert summary["test_auc"] != exact[0]["test_auc"]  # the rows did lag: not the exact run


def test_the_row_cache_pulling_ahead_halves_the_table_traffic(tmp_path):
    mode = MODE + ["train.steps=40", "cluster.num_ps=2"]
    exact = _run(tmp_path / "exact", mode)
    cached = _run(tmp_path / "cached", mode + ["sparse.cache_rows=400",
                                               "sparse.cache_staleness=8",
                                               "sparse.cache_writes=hold"])
    summary = cached[0]
    assert summary["steps"] == 40 and all(s["version"] == 40 for s in summary["shards"])
    assert summary["cache_hit_rate"] > 0.5 and summary["dense_replicas_identical"]
    assert summary["sparse_bytes_per_step"] <= 0.5 * exact[0]["sparse_bytes_per_step"]
    assert abs(summary["test_auc"] - exact[0]["test_auc"]) < 0.05


def test_a_worker_killed_while_pulling_ahead_rejoins(tmp_path):
    summary, _ = run_cluster(tmp_path, CLICKS + MODE + AHEAD + [
        "cluster.num_workers=3", "train.steps=60", "fault.crash_role=worker",
        "fault.crash_index=2", "fault.crash_at_step=20"], fast=False)
    assert summary["steps"] == 60 and summary["workers_rejoined"] == 1
    assert summary["workers_lost"] == 0 and summary["dense_replicas_identical"]
    assert int(summary["shards"][0]["per_worker_applied"]["2"]) > 20

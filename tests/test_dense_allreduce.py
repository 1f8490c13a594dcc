"""update.dense=allreduce over real clusters: the dense parameters replicated on the workers and
averaged among the workers beside the RPC agent (over Unix sockets on one host, else gloo), only the tables on the PS. The contracts
of the PS path hold bit for bit: the same bits as the PS gives, whatever the number of PS; W
workers of batch B equal one accumulating W micro-batches of B; a resumed run equals an uninterrupted one (into
another number of PS too); a killed worker rejoins with the replicas still identical."""

import shutil

import pytest

from tests.conftest import assert_equal_model, run_cluster
from tests.test_sparse_cluster import CLICKS, _assert_equal, _run

pytestmark = pytest.mark.timeout(300)
ALLREDUCE = ["update.dense=allreduce"]


@pytest.fixture(scope="module")
def ps_w2(tmp_path_factory):
    """The PS path: sync, 2 PS, W=2 × batch 32, Adam on the dense part."""
    return _run(tmp_path_factory.mktemp("ps"), ["cluster.num_workers=2", "cluster.num_ps=2",
                                                "train.batch_size=32", "optim=adam"])


@pytest.mark.parametrize("shm,group", [("auto", "sockets"), ("off", "gloo")])
def test_allreduce_gives_the_bits_of_the_ps(tmp_path, ps_w2, shm, group):
    """Over psrpc's own all-reduce among the workers of one host, and over gloo."""
    run = _run(tmp_path, ALLREDUCE + ["cluster.num_workers=2", "cluster.num_ps=2",
                                      "train.batch_size=32", "optim=adam", f"cluster.shm={shm}"])
    summary = run[0]
    assert summary["dense"] == "allreduce" and summary["dense_replicas_identical"]
    assert summary["dense_group"] == group
    assert summary["samples"] == ps_w2[0]["samples"] == 20 * 64
    assert summary["shards"][0]["per_worker_applied"] == {"0": 20, "1": 20}
    _assert_equal(run, ps_w2)  # dense and tables, bit for bit


@pytest.mark.parametrize("ps", [1, 3])
def test_allreduce_w1_accumulating_two_micro_batches_equals_w2_whatever_the_number_of_ps(
        tmp_path, ps_w2, ps):
    run = _run(tmp_path, ALLREDUCE + ["cluster.num_workers=1", f"cluster.num_ps={ps}",
                                      "train.batch_size=64", "train.accumulate=2", "optim=adam"])
    _assert_equal(run, ps_w2)  # bit for bit


def test_allreduce_resumed_equals_uninterrupted_into_another_number_of_ps(tmp_path, ps_w2):
    """The chief writes the dense files (parameters, Adam's moments and step) step-consistent
    with the tables' files; a restore re-splits them like any checkpoint."""
    mode = ALLREDUCE + ["cluster.num_workers=2", "train.batch_size=32", "optim=adam"]
    ck = tmp_path / "ck"
    first = _run(tmp_path / "first", mode + [
        "cluster.num_ps=2", f"checkpoint.dir={ck}",
        "hooks=[{_target_: psrpc.hooks.StopAtStep, last_step: 10}]"])[0]
    # stopped early: every worker ends at step 10 together (none waits in an all-reduce)
    assert first["steps"] == 10 and first["workers_lost"] == 0
    assert first["dense_replicas_identical"] and len(first["workers"]) == 2
    assert (ck / "step-10" / "shard-0.pt").exists() and (ck / "step-10" / "tables-1.pt").exists()
    second = _run(tmp_path / "second", mode + ["cluster.num_ps=3", f"checkpoint.dir={ck}"])
    assert second[0]["restored_from_step"] == 10 and second[0]["steps"] == 20
    _assert_equal(second, ps_w2)
    # and a PS-path run restores the all-reduce run's checkpoint (the same files)
    shutil.copytree(ck, tmp_path / "ck_ps")
    (tmp_path / "ck_ps" / "step-20").exists() and shutil.rmtree(tmp_path / "ck_ps" / "step-20")
    third = _run(tmp_path / "third", ["cluster.num_workers=2", "train.batch_size=32",
                                      "optim=adam", "cluster.num_ps=2",
                                      f"checkpoint.dir={tmp_path / 'ck_ps'}"])
    assert third[0]["restored_from_step"] == 10
    _assert_equal(third, ps_w2)


def test_a_non_finite_gradient_is_skipped_by_every_replica(tmp_path):
    """Worker 1's gradient is NaN at step 5 (it waits for its whole gradient first, the other
    all-reduces bucket by bucket as backward goes): the average is non-finite on every worker,
    the clock skips the round, no replica applies it."""
    summary, _ = run_cluster(tmp_path, ALLREDUCE + [
        "train.steps=30", "cluster.bucket_bytes=65536", "fault.nan_worker=1",
        "fault.nan_at_step=5"])
    assert summary["steps"] == 30 and summary["nan_rejected"] >= 1
    assert summary["workers_lost"] == 0 and summary["dense_replicas_identical"]


def test_buckets_are_all_reduced_in_index_order_whatever_order_backward_completes_them():
    """Collectives pair up by order: a bucket completed early waits for those before it."""
    from types import SimpleNamespace

    import torch

    from psrpc.worker.allreduce import DenseAllReduce

    launched = []
    ar = DenseAllReduce.__new__(DenseAllReduce)
    ar.size, ar.flat = 2, SimpleNamespace(grads=[torch.full((2,), float(k)) for k in range(4)])
    ar.group = lambda: SimpleNamespace(allreduce=lambda ts: launched.append(int(ts[0][0])))
    ar._works, ar._group = [], None
    ar.abandon()
    for k in (2, 0, 3):
        ar.start(k)
    assert launched == [0]
    ar.start(1)
    assert launched == [0, 1, 2, 3]


def test_a_killed_worker_rejoins_and_the_replicas_stay_identical(tmp_path):
    """The process group is formed again in the new epoch; the worker started again takes the
    chief's replica with the epoch's plan."""
    summary, _ = run_cluster(tmp_path, ALLREDUCE + [
        "cluster.num_workers=3", "train.steps=80", "optim=adam",
        "fault.crash_role=worker", "fault.crash_index=2", "fault.crash_at_step=20"])
    assert summary["steps"] == 80 and summary["workers_rejoined"] == 1
    assert summary["workers_lost"] == 0 and summary["dense_replicas_identical"]
    assert int(summary["shards"][0]["per_worker_applied"]["2"]) > 20


def test_a_killed_ps_rolls_the_replicas_back_with_the_tables(tmp_path):
    """The PS holding the clock shard dies: every shard and every replica go back to the last
    committed step, and the run equals one restored from that checkpoint."""
    mode = ALLREDUCE + [o for o in CLICKS if not o.startswith("train.steps")] + ["cluster.num_ps=2", "cluster.num_workers=2",
                                      "train.steps=40", "train.batch_size=32",
                                      "checkpoint.every_steps=10", "checkpoint.keep=100",
                                      "update.timeout_s=30"]
    ck = tmp_path / "ck"
    summary, state = run_cluster(tmp_path / "killed", mode + [
        f"checkpoint.dir={ck}", "fault.crash_role=ps", "fault.crash_index=0",
        "fault.crash_at_step=25"], fast=False)
    (epoch,) = summary["epochs"]
    back = epoch["rolled_back_to"]  # step 20 unless its commit had not landed 5 steps later
    assert epoch["started_again"] == "ps0" and back in (10, 20)
    assert summary["steps"] == 40 and summary["dense_replicas_identical"]
    shutil.copytree(ck / f"step-{back}", tmp_path / "from" / f"step-{back}")
    restored = run_cluster(tmp_path / "restored", mode + [f"checkpoint.dir={tmp_path / 'from'}"],
                           fast=False)
    assert restored[0]["restored_from_step"] == back
    assert_equal_model(state, restored[1])


@pytest.mark.parametrize("restore_by", ["settle", "catch_up"])
def test_a_step_applied_ahead_of_a_round_that_does_not_close_is_undone(restore_by):
    """Pulling ahead applies a step's average before the clock's reply: when the reply (or a
    new epoch's line-up) says the round did not close, parameters, Adam's moments and step
    count and the version are as before it, bit for bit; when it closed, the update stays."""
    from types import SimpleNamespace

    import torch

    from psrpc.config import AdamConfig
    from psrpc.worker.allreduce import DenseAllReduce
    from psrpc.worker.plan import DenseState

    params = [torch.randn(5), torch.randn(3)]
    cfg = SimpleNamespace(optim=AdamConfig(lr=0.1),
                          train=SimpleNamespace(steps=100), cluster=SimpleNamespace(
                              init_timeout_s=30, shm="auto"),
                          update=SimpleNamespace(timeout_s=30))
    flat = SimpleNamespace(params=params, grads=[torch.randn(5), torch.randn(3)])
    ar = DenseAllReduce(cfg, 0, 1, flat, DenseState(0, [p.clone() for p in params], [{}, {}]))
    for step in range(3):  # some state first: moments and a step count
        ar.pending = step
        ar.apply_pending()
        ar.settle(step + 1, ahead=True)
    before = ar.state()
    ar.pending = 3
    ar.apply_pending()
    assert ar.version == 4 and not torch.equal(params[0], before.flats[0])
    if restore_by == "settle":
        ar.settle(3, ahead=True)  # the clock did not move: the round did not close
    else:
        ar.catch_up(3)  # a new epoch lines the shards up at step 3
    after = ar.state()
    assert after.version == 3
    for a, b in zip(after.flats, before.flats):
        assert torch.equal(a, b)
    for a, b in zip(after.states, before.states):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ar.pending = 3  # and a round that closes keeps its update
    ar.apply_pending()
    ar.settle(4, ahead=True)
    assert ar.version == 4 and not torch.equal(params[0], before.flats[0])

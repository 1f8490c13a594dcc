"""Dynamic tables over real RPC (model=dlrm on synthetic click logs, every table dynamic): the
exactness contracts hold with admission and eviction on, checkpoints restore into another
number of PS, and the exported tables serve the test set without the PS."""

import shutil

import pytest
import torch

from psrpc.sparse import DynamicBag, load_tables
from tests.conftest import compose, run_cluster
from tests.test_sparse_cluster import CLICKS

pytestmark = pytest.mark.timeout(300)
DYNAMIC = CLICKS + ["sparse.dynamic=true", "sparse.admit_after=2"]
TTL = ["sparse.evict=ttl", "sparse.ttl_steps=5"]
LFU = ["sparse.evict=lfu", "sparse.max_rows=80"]
W1 = ["cluster.num_workers=1", "train.batch_size=64"]
W2 = ["cluster.num_workers=2", "train.batch_size=32"]
W1_ACC = W1 + ["train.accumulate=2"]  # W2's micro-batches, one after another


def _run(tmp_path, overrides):
    summary, state = run_cluster(tmp_path, DYNAMIC + overrides, fast=False)
    return summary, state, load_tables(tmp_path)


def _assert_equal(a, b):
    """Bit for bit: the dense parameters, and the same ids with the same rows."""
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k
    assert a[2].keys() == b[2].keys()
    for name, bag in a[2].items():
        assert isinstance(bag, DynamicBag)
        assert torch.equal(bag.ids, b[2][name].ids), name
        assert torch.equal(bag.weight, b[2][name].weight), name


@pytest.fixture(scope="module")
def ttl_reference(tmp_path_factory):
    """Sync, 1 PS, W=1 × batch 64, admission after 2 sightings, ttl eviction."""
    return _run(tmp_path_factory.mktemp("ttl"), TTL + W1)


def test_tables_grow_and_shrink_and_the_summary_counts_their_rows(ttl_reference):
    summary = ttl_reference[0]
    for name, t in summary["tables"].items():
        assert t["rows_created"] > t["rows_live"] > 0 and t["rows_evicted"] > 0, name
        assert t["rows_live"] == t["rows_created"] - t["rows_evicted"]
        assert t["rows_live"] == ttl_reference[2][name].ids.numel()
    assert all(m["peak_rss_bytes"] > 0 for m in summary["ps_memory"])


@pytest.mark.parametrize("num_ps", [2, 3])
def test_number_of_ps_changes_no_bit_with_admission_and_ttl(tmp_path, ttl_reference, num_ps):
    run = _run(tmp_path, TTL + W1 + [f"cluster.num_ps={num_ps}"])
    _assert_equal(run, ttl_reference)
    assert run[0]["tables"] == ttl_reference[0]["tables"]  # rows made and evicted: the same


def test_sync_w2_equals_w1_accumulating_two_micro_batches_with_admission_and_ttl(tmp_path):
    run = _run(tmp_path, TTL + W2)
    _assert_equal(run, _run(tmp_path / "acc", TTL + W1_ACC))  # bit for bit
    # the exported model serves the test set without the PS: the same AUC as the chief's
    # evaluation through the PS (ids with no row read as their initial values both ways)
    from psrpc import factories
    from psrpc.metrics import AUCLogLoss as AUC
    from psrpc.sparse import load_model

    cfg = compose(DYNAMIC + TTL + W2, check=False)
    data = factories.load_data(cfg)
    model = load_model(factories.build_model(cfg, data, remote_tables=False), str(tmp_path))
    metric = AUC()
    with torch.no_grad():
        for start in range(0, len(data.test), 256):
            x, y = data.test.batch(torch.arange(start, min(start + 256, len(data.test))))
            metric.update(model(x), y)
    assert abs(metric.compute()["auc"] - run[0]["test_auc"]) < 1e-5


def test_sync_w2_equals_w1_accumulating_two_micro_batches_with_lfu_at_a_row_cap(tmp_path):
    one = _run(tmp_path / "w1", LFU + W1_ACC)
    two = _run(tmp_path / "w2", LFU + W2)
    _assert_equal(two, one)  # bit for bit
    tables = one[0]["tables"]  # cat_0 and cat_1 see more ids than the cap; cat_2 has 64
    assert tables["cat_0"]["rows_evicted"] > 0 and tables["cat_1"]["rows_evicted"] > 0
    assert all(t["rows_live"] <= 80 for t in tables.values())


def test_resumed_equals_uninterrupted_into_another_number_of_ps(tmp_path, ttl_reference):
    """Ids, rows, row optimizer state, counts and last steps are checkpointed at one step and
    re-split by id for another number of PS."""
    ck = tmp_path / "ck"
    _run(tmp_path / "first", TTL + W1 + ["cluster.num_ps=2", f"checkpoint.dir={ck}",
                                         "hooks=[{_target_: psrpc.hooks.StopAtStep, "
                                         "last_step: 10}]"])
    assert (ck / "step-10" / "tables-1.pt").exists()
    for ps in (2, 3):
        shutil.copytree(ck, tmp_path / f"ck{ps}")
        second = _run(tmp_path / f"second{ps}", TTL + W1 + [
            f"cluster.num_ps={ps}", f"checkpoint.dir={tmp_path / f'ck{ps}'}"])
        assert second[0]["restored_from_step"] == 10 and second[0]["steps"] == 20
        _assert_equal(second, ttl_reference)
        assert second[0]["tables"] == ttl_reference[0]["tables"]


def test_async_with_dynamic_tables_runs_to_the_end_under_the_cap(tmp_path):
    summary, _, tables = _run(tmp_path, LFU + ["update=async", "cluster.num_workers=2",
                                               "cluster.num_ps=2", "train.batch_size=32"])
    assert summary["steps"] == 20 and all(s["version"] == 20 for s in summary["shards"])
    assert all(t["rows_live"] <= 80 for t in summary["tables"].values())
    assert all(torch.isfinite(bag.weight).all() for bag in tables.values())

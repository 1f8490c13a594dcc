"""A table shard, called directly (no RPC): sparse sync rounds and async applies touch only the
pushed rows and their optimizer state, duplicates are coalesced, a bad push changes nothing."""

import copy
from types import SimpleNamespace as NS

import pytest
import torch

from psrpc.errors import PushRejected
from psrpc.ps.tables import TableShard, TableShardSpec
from psrpc.sparse.rows import Partition, TableSpec
from tests.unit_helpers import asynch, sgd, sync

SPECS = [TableSpec("user", 10, 4), TableSpec("item", 7, 4, pooling="mean")]


def sparse(optimizer="adagrad", lr=0.5, partition="mod"):
    return NS(optimizer=optimizer, lr=lr, eps=1e-8, weight_decay=0.0, betas=[0.9, 0.999],
              partition=partition)


def table_shard(update, optimizer="adagrad", workers=2, ps=0, num_ps=1, lr=0.5):
    return TableShard(TableShardSpec(0, torch.empty(0), sgd(lr=1.0), update, workers, 1000,
                                     ps=ps, num_ps=num_ps, tables=SPECS, seed=0,
                                     sparse=sparse(optimizer, lr)))


def rows(*r):
    return torch.tensor(r, dtype=torch.int64)


def push(shard, worker, version, payload, loss=1.0):
    return shard.push_pull(worker, version, payload, loss, 1)


def _state(shard):
    return (copy.deepcopy(shard.weights),
            {n: copy.deepcopy(o.state_dict()) for n, o in shard.row_optim.items()},
            shard.version, copy.deepcopy(shard.stats))


def _same(a, b):
    assert all(torch.equal(a[0][n], b[0][n]) for n in a[0])
    for n in a[1]:
        for k, v in a[1][n].items():
            assert torch.equal(v, b[1][n][k]) if torch.is_tensor(v) else v == b[1][n][k]
    assert a[2:] == b[2:]


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_sync_round_averages_rows_over_the_rounds_gradients_and_touches_only_them(optimizer):
    """TensorFlow's SparseConditionalAccumulator: a row's gradient is the sum over the round's
    pushes divided by their number (a push without the row counts as zero), so that W workers
    of batch B equal one of W·B; the row optimizer then updates only those rows."""
    shard = table_shard(sync(), optimizer)
    before = _state(shard)
    g0 = {"user": (rows(1, 3), torch.full((2, 4), 2.0))}
    g1 = {"user": (rows(3, 5), torch.full((2, 4), 4.0)), "item": (rows(6), torch.ones(1, 4))}
    f0, f1 = push(shard, 0, 0, g0), push(shard, 1, 0, g1)
    assert f1.wait().version == f0.wait().version == 1
    # the reference: the same averaged rows through the same optimizer, in one process
    ref = table_shard(sync(), optimizer, workers=1)
    ref.step_optimizer({"user": (rows(1, 3, 5), torch.tensor([[1.0] * 4, [3.0] * 4, [2.0] * 4])),
                        "item": (rows(6), torch.full((1, 4), 0.5))})
    for name in ("user", "item"):
        assert torch.equal(shard.weights[name], ref.weights[name])
        touched = {"user": [1, 3, 5], "item": [6]}[name]
        untouched = [r for r in range(shard.weights[name].shape[0]) if r not in touched]
        assert torch.equal(shard.weights[name][untouched], before[0][name][untouched])
        assert not torch.equal(shard.weights[name][touched], before[0][name][touched])
        for key in shard.row_optim[name].per_row_state:  # per-row state: only touched rows
            state = shard.row_optim[name].state_dict()[key]
            assert torch.equal(state[untouched], before[1][name][key][untouched])


def test_a_workers_duplicate_ids_arrive_coalesced_and_rounds_add_in_worker_order():
    """The worker pushes unique rows (EmbeddingTables' leaves are per unique row); across the
    round the same row from several workers is summed, in worker order whatever the arrival."""
    results = []
    for order in [(0, 1, 2), (2, 0, 1)]:
        shard = table_shard(sync(), "sgd", workers=3, lr=1.0)
        grads = {0: torch.full((1, 4), 1e8), 1: torch.full((1, 4), 1.0),
                 2: torch.full((1, 4), -1e8)}
        fs = [push(shard, w, 0, {"user": (rows(2), grads[w])}) for w in order]
        [f.wait() for f in fs]
        results.append(shard.weights["user"].clone())
    assert torch.equal(results[0], results[1])


def test_async_applies_rows_on_arrival():
    shard = table_shard(asynch(), "sgd", lr=1.0)
    start = shard.weights["user"].clone()
    r = push(shard, 0, 0, {"user": (rows(4), torch.ones(1, 4))}).wait()
    assert r.accepted and r.version == 1 and r.params.numel() == 0  # rows are pulled, not sent
    assert torch.allclose(shard.weights["user"][4], start[4] - 1)
    assert torch.equal(shard.weights["user"][:4], start[:4])


def test_pull_rows_returns_copies_of_the_asked_rows():
    shard = table_shard(sync())
    got = shard.pull_rows({"user": rows(0, 9), "item": rows(3)})
    assert torch.equal(got["user"], shard.weights["user"][[0, 9]])
    got["user"].add_(1)
    assert not torch.equal(got["user"], shard.weights["user"][[0, 9]])
    with pytest.raises(PushRejected, match=r"pulled rows \[0, 10\] of 'user'; this server holds "
                                           r"local rows \[0, 10\)"):
        shard.pull_rows({"user": rows(0, 10)})


def test_rows_start_the_same_whatever_the_partition():
    """Initial values come from (table, row): 1 server or 3, mod or div, the same table."""
    one = table_shard(sync()).weights["user"]
    for strategy in ("mod", "div"):
        part = Partition(10, 3, strategy)
        whole = torch.empty(10, 4)
        for k in range(3):
            s = TableShard(TableShardSpec(0, torch.empty(0), sgd(), sync(), 1, 10, ps=k, num_ps=3,
                                          tables=SPECS, seed=0,
                                          sparse=sparse(partition=strategy)))
            whole[part.global_rows(k)] = s.weights["user"]
        assert torch.equal(whole, one)


@pytest.mark.parametrize("payload, match", [
    ({"user": (rows(10), torch.ones(1, 4))}, r"rows \[10, 10\] of 'user'; this server holds "
                                             r"local rows \[0, 10\)"),
    ({"user": (rows(-1), torch.ones(1, 4))}, r"rows \[-1, -1\]"),
    ({"user": (rows(1, 2), torch.ones(3, 4))}, r"gradients \(3, 4\) for 2 rows of 'user'"),
    ({"user": (rows(1), torch.ones(1, 5))}, r"gradients \(1, 5\) for 1 rows"),
    ({"user": (rows(1), torch.ones(1, 4, dtype=torch.float64))}, r"expected a float32 CPU"),
    ({"user": (rows(2, 2), torch.ones(2, 4))}, r"not unique and ascending"),
    ({"user": (rows(3, 1), torch.ones(2, 4))}, r"not unique and ascending"),
    ({"user": ([1], torch.ones(1, 4))}, r"rows of 'user' as list; expected a 1-D int64"),
    ({"movie": (rows(1), torch.ones(1, 4))}, r"unknown table 'movie'"),
    ({"user": rows(1)}, r"expected a \(rows, gradients\) pair"),
    (torch.ones(4), r"pushed a Tensor, expected \{table: \(rows, gradients\)\}"),
])
def test_malformed_sparse_push_rejected_and_nothing_changed(payload, match):
    shard = table_shard(sync())
    push(shard, 0, 0, {"user": (rows(1), torch.ones(1, 4))})  # worker0 waits in the round
    before = _state(shard)
    with pytest.raises(PushRejected, match=match):
        push(shard, 1, 0, payload).wait()
    _same(_state(shard), before)
    assert set(shard.updater._grads) == {0}
    shard.close()


def test_non_finite_rows_are_skipped_not_applied():
    shard = table_shard(sync(), workers=1)
    before = _state(shard)
    r = push(shard, 0, 0, {"user": (rows(1), torch.tensor([[1.0, float("nan"), 1.0, 1.0]]))})
    r = r.wait()
    assert r.skipped and r.version == 1 and shard.stats.nan_rejected == 1
    assert all(torch.equal(shard.weights[n], before[0][n]) for n in before[0])


def test_catch_up_counts_the_passed_steps_in_every_tables_lazy_adam():
    """A table shard that passes steps to line up with the others (a membership change)
    counts them as steps with no rows: LazyAdam's bias correction stays alike on every shard;
    no row changes."""
    shard = table_shard(sync(), optimizer="adam", workers=1)
    before = _state(shard)
    shard.begin_epoch()
    assert shard.catch_up(2) == 2
    assert [o.step_count for o in shard.row_optim.values()] == [2, 2]
    assert all(torch.equal(before[0][n], w) for n, w in shard.weights.items())
    shard.close()


def test_push_with_rows_ahead_replies_with_their_values_after_the_round():
    """The next batch's rows ride on the push: the reply carries them as a pull would read them
    once the round has closed (the updated values), for each worker its own rows."""
    shard = table_shard(sync())
    g = {"user": (rows(1), torch.ones(1, 4))}
    f0 = shard.push_pull_rows(0, 0, g, 1.0, 1, None, {"user": rows(1, 2)})
    assert not f0.done()  # the round waits for worker1
    f1 = shard.push_pull_rows(1, 0, g, 1.0, 1, None, {"item": rows(0)})
    r0, r1 = f0.wait(), f1.wait()
    assert r0.version == r1.version == 1
    after = shard.pull_rows({"user": rows(1, 2), "item": rows(0)})
    assert torch.equal(r0.rows["user"], after["user"]) and list(r0.rows) == ["user"]
    assert torch.equal(r1.rows["item"], after["item"]) and list(r1.rows) == ["item"]


@pytest.mark.parametrize("ahead,match", [
    ({"nope": rows(1)}, "unknown table"),
    ({"user": rows(10)}, r"rows \[10, 10\]"),
    ({"user": torch.tensor([1.0])}, "1-D int64"),
    ([rows(1)], "expected {table: rows}"),
])
def test_malformed_rows_ahead_are_refused_and_nothing_changes(ahead, match):
    shard = table_shard(sync(), workers=1)
    before = _state(shard)
    with pytest.raises(PushRejected, match=match):
        shard.push_pull_rows(0, 0, {"user": (rows(1), torch.ones(1, 4))}, 1.0, 1, None,
                             ahead).wait()
    _same(before, _state(shard))

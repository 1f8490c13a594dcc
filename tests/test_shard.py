"""A shard's checks on what it is sent, called directly (no RPC): bad input never touches it,
a non-finite gradient is skipped (never spins), an error inside an update wedges nothing."""

import copy

import pytest
import torch

from psrpc.errors import PushRejected
from tests.unit_helpers import adam, admit, asynch, make_shard, push, push_ticket, sync


def _state(shard):
    """Everything a push could change: master copy, optimizer state, version, round, counters."""
    u = shard.updater
    round_ = (dict(u._grads), set(u._excused), u._samples) if hasattr(u, "_grads") else (
        dict(u._held),)
    return (shard.params.clone(), repr(shard.optimizer.state_dict()), shard.version,
            round_, copy.deepcopy(shard.stats))


def _same(a, b):
    assert torch.equal(a[0], b[0]) and a[1:3] == b[1:3]
    assert a[3].keys() == b[3].keys() if isinstance(a[3], dict) else True
    assert [len(x) if hasattr(x, "__len__") else x for x in a[3]] == [
        len(x) if hasattr(x, "__len__") else x for x in b[3]]
    assert a[4] == b[4]


GOOD = dict(worker=0, version=0, grad=torch.ones(4), loss=1.0, samples=1, ticket=None)


@pytest.mark.parametrize("update", ["sync", "async"])
@pytest.mark.parametrize("bad, match", [
    (dict(worker=5), r"unknown worker 5 \(workers are 0\.\.1\)"),
    (dict(worker=-1), r"unknown worker -1"),
    (dict(worker="0"), r"unknown worker '0'"),
    (dict(worker=True), r"unknown worker True"),
    (dict(version=7), r"step 7, but this shard is at step [12] \(a step from the future\)"),
    (dict(version=-1), r"step -1; a step is an int >= 0"),
    (dict(version=0.0), r"step 0.0; a step is an int >= 0"),
    (dict(version=None), r"step None; a step is an int >= 0"),
    (dict(grad=torch.zeros(3)), r"shape \(3,\), expected \(4,\)"),
    (dict(grad=torch.zeros(2, 2)), r"shape \(2, 2\), expected \(4,\)"),
    (dict(grad=torch.zeros(4, dtype=torch.float64)), r"dtype torch.float64, expected torch.float32"),
    (dict(grad=[0.0] * 4), r"pushed a list, expected a flat tensor"),
    (dict(grad=torch.zeros(4).to_sparse()), r"expected a dense CPU tensor"),
    (dict(loss="abc"), r"pushed loss 'abc', expected a number"),
    (dict(loss=None), r"pushed loss None, expected a number"),
    (dict(samples=-1), r"samples=-1, expected an int >= 0"),
    (dict(samples=2.5), r"samples=2.5, expected an int >= 0"),
    (dict(ticket=0), r"ticket 0, but this shard takes no tickets"),
])
def test_malformed_push_rejected_with_clear_error_and_nothing_changed(update, bad, match):
    """Every argument is checked before any state changes (a non-numeric loss used to raise
    after the gradient was already in the round)."""
    shard = make_shard(sync() if update == "sync" else asynch(), adam(), workers=2)
    push(shard, 0, 0, [1.0] * 4)  # a real round/optimizer state to protect
    if update == "sync":
        push(shard, 1, 0, [1.0] * 4).wait()
        push(shard, 1, 1, [2.0] * 4)  # worker1 waits in round 1
    else:
        push(shard, 1, 0, [2.0] * 4).wait()
    before = _state(shard)
    args = {**GOOD, "version": 1, **bad}
    with pytest.raises(PushRejected, match=match):
        shard.push_pull(*args.values()).wait()
    _same(_state(shard), before)
    shard.close()


def test_bounded_push_without_ticket_rejected():
    shard = make_shard(asynch(max_staleness=1), workers=2)
    with pytest.raises(PushRejected, match=r"ticket None: with update.max_staleness set"):
        push(shard, 0, 0, [1.0] * 4).wait()
    with pytest.raises(PushRejected, match=r"unknown worker 9"):
        admit(shard, 9, 0).wait()
    assert shard.version == 0
    shard.close()


@pytest.mark.parametrize("update", ["sync", "async"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_gradient_skipped_counted_and_the_step_moves_on(update, value):
    """W=1: the rejected batch is skipped (the step passes with no update), so the worker
    computes the next batch instead of pushing the same non-finite gradient forever."""
    shard = make_shard(sync() if update == "sync" else asynch(), adam(), workers=1)
    before = shard.params.clone()
    r = push(shard, 0, 0, [1.0, value, 1.0, 1.0]).wait()
    assert not r.accepted and r.skipped and r.version == 1 and shard.stats.nan_rejected == 1
    assert torch.equal(shard.params, before) and shard.optimizer.state_dict()["state"] == {}
    assert shard.stats.applied_pushes == 0 and shard.stats.samples == 0
    r = push(shard, 0, 1, [1.0] * 4).wait()  # the next batch goes through
    assert r.accepted and not r.skipped and r.version == 2
    shard.close()


def test_non_finite_loss_with_finite_gradient_is_skipped():
    shard = make_shard(sync(), workers=1)
    r = push(shard, 0, 0, [1.0] * 4, loss=float("nan")).wait()
    assert r.skipped and shard.stats.nan_rejected == 1 and torch.equal(shard.params,
                                                                       torch.zeros(4))


def test_sync_round_with_a_non_finite_gradient_averages_the_others():
    shard = make_shard(sync(), workers=3)
    f = [push(shard, 0, 0, [3.0] * 4), push(shard, 1, 0, [float("nan")] * 4, loss=9.0),
         push(shard, 2, 0, [1.0] * 4, loss=3.0)]
    r0, r1, r2 = [x.wait() for x in f]
    assert r0.accepted and r2.accepted and not r1.accepted and r1.skipped and not r0.skipped
    assert r0.version == r1.version == 1 and r0.loss == 2.0  # mean of the finite ones (1, 3)
    torch.testing.assert_close(shard.params, torch.full((4,), -2.0))  # lr 1, mean(3, 1)
    assert shard.stats.samples == 2 and shard.stats.per_worker_applied == {0: 1, 2: 1}


def test_error_while_closing_a_round_reaches_every_waiter_and_the_next_round_works(
        monkeypatch):
    shard = make_shard(sync(), workers=2)
    monkeypatch.setattr(shard.optimizer, "step", lambda: 1 / 0)
    f0, f1 = push(shard, 0, 0, [1.0] * 4), push(shard, 1, 0, [1.0] * 4)
    for f in (f0, f1):
        with pytest.raises(ZeroDivisionError):
            f.wait()
    assert shard.version == 0 and shard.updater.members == set() and torch.equal(
        shard.params, torch.zeros(4))
    assert shard.stats.applied_pushes == 0 and shard.stats.samples == 0
    monkeypatch.undo()
    r = [push(shard, w, 0, [1.0] * 4) for w in (0, 1)]
    assert all(x.wait().accepted for x in r) and shard.version == 1


def test_error_while_applying_a_ticket_skips_it_and_later_tickets_still_apply(monkeypatch):
    shard = make_shard(asynch(max_staleness=2), workers=2)
    t0, t1 = admit(shard, 0, 0).wait().seq, admit(shard, 1, 0).wait().seq
    later = push_ticket(shard, 1, 0, [1.0] * 4, t1)  # held for ticket 0
    step, calls = shard.optimizer.step, []
    monkeypatch.setattr(shard.optimizer, "step", lambda: step() if calls.append(1) or
                        len(calls) > 1 else 1 / 0)  # the first step fails, the next works
    first = push_ticket(shard, 0, 0, [1.0] * 4, t0)
    with pytest.raises(ZeroDivisionError):
        first.wait()
    r = later.wait()
    assert r.accepted and r.version == 2 and shard.stats.applied_pushes == 1
    shard.close()


def test_pull_is_a_snapshot_not_the_master_copy():
    shard = make_shard(sync(), workers=1)
    r = shard.pull()
    r.params.add_(1.0)
    assert torch.equal(shard.params, torch.zeros(4))

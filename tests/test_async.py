"""Asynchronous apply and bounded staleness, called directly (no RPC)."""

import torch

from tests.unit_helpers import asynch, make_shard, push, sgd


def test_applies_each_gradient_on_arrival_and_records_staleness():
    shard = make_shard(asynch(), sgd(lr=1.0), workers=2)
    r0 = push(shard, 0, 0, [1.0] * 4).wait()
    r1 = push(shard, 1, 0, [2.0] * 4).wait()  # computed on 0, applied at 1: staleness 1
    assert (r0.version, r1.version) == (1, 2) and r0.accepted and r1.accepted
    torch.testing.assert_close(shard.params, torch.full((4,), -3.0))
    assert shard.stats.staleness_max == 1 and shard.stats.staleness_sum == 1


def test_staleness_lr_divides_learning_rate():
    shard = make_shard(asynch(staleness_lr=True), sgd(lr=1.0), workers=2)
    push(shard, 0, 0, [1.0] * 4).wait()
    push(shard, 1, 0, [2.0] * 4).wait()  # staleness 1: lr / 2
    torch.testing.assert_close(shard.params, torch.full((4,), -2.0))
    assert shard.optimizer.param_groups[0]["lr"] == 1.0  # restored after the step


def test_bounded_staleness_holds_the_worker_too_far_ahead():
    shard = make_shard(asynch(max_staleness=1), sgd(lr=1.0), workers=2)
    assert push(shard, 0, 0, [1.0] * 4).wait().version == 1  # worker1 now 1 behind: ok
    held = push(shard, 0, 1, [1.0] * 4)
    assert not held.done()  # applying it would leave worker1 (on version 0) 2 behind
    r1 = push(shard, 1, 0, [1.0] * 4).wait()  # worker1 catches up (staleness 1 <= 1)
    assert r1.accepted and r1.version == 2
    assert held.done() and held.wait().version == 3
    assert shard.stats.staleness_max <= 1


def test_gradient_staler_than_bound_is_dropped_never_applied():
    shard = make_shard(asynch(max_staleness=0), sgd(lr=1.0), workers=2)
    f0 = push(shard, 0, 0, [1.0] * 4)  # held: worker1 computes on 0 too
    assert not f0.done()
    r1 = push(shard, 1, 0, [5.0] * 4).wait()
    r0 = f0.wait()
    # oldest first, ties in arrival order: worker0 applied, then worker1 is 1 step stale
    assert r0.accepted and not r1.accepted and shard.stats.stale_dropped == 1
    assert shard.stats.staleness_max == 0
    torch.testing.assert_close(shard.params, torch.full((4,), -1.0))


def test_held_push_released_after_timeout_and_laggard_counted_lost():
    shard = make_shard(asynch(max_staleness=0, timeout_s=0.3), sgd(lr=1.0), workers=2)
    r = push(shard, 0, 0, [1.0] * 4).wait()  # worker1 never pushes
    assert r.accepted and shard.updater.live.lost == {1}
    assert push(shard, 0, 1, [1.0] * 4).done()  # no longer waits for worker1
    shard.close()


def test_async_unbounded_never_waits():
    shard = make_shard(asynch(), workers=3)
    for i in range(10):
        assert push(shard, 0, i, [0.0] * 4).done()

"""Asynchronous apply and bounded staleness, called directly (no RPC)."""

import time

import torch

from tests.unit_helpers import admit, asynch, make_shard, push, push_ticket, sgd


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


def test_clock_holds_the_worker_too_far_ahead():
    shard = make_shard(asynch(max_staleness=1), sgd(lr=1.0), workers=2)
    assert admit(shard, 0, 0).wait().seq == 0  # worker1 (on 0) would be 1 behind: ok
    assert push_ticket(shard, 0, 0, [1.0] * 4, 0).wait().version == 1
    held = admit(shard, 0, 1)
    assert not held.done()  # ticket 1 would leave worker1 (on version 0) 2 behind
    t1 = admit(shard, 1, 0).wait()  # worker1 catches up (staleness 1 <= 1) ...
    assert t1.seq == 1 and held.done() and held.wait().seq == 2  # ... and releases worker0
    assert push_ticket(shard, 1, 0, [1.0] * 4, 1).wait().version == 2
    assert push_ticket(shard, 0, 1, [1.0] * 4, 2).wait().version == 3
    assert shard.stats.staleness_max == 1


def test_every_shard_applies_the_same_tickets_in_the_same_order():
    """The defect: only shard 0 held pushes back, other shards applied them as they came (one
    ended at version 3, another at 2). Tickets arriving out of order now wait for their turn."""
    clock = make_shard(asynch(max_staleness=1), sgd(lr=1.0), workers=2)
    other = make_shard(asynch(max_staleness=1), sgd(lr=1.0), workers=2)
    other.index = 1
    t0, t1 = admit(clock, 0, 0).wait().seq, admit(clock, 1, 0).wait().seq
    assert (t0, t1) == (0, 1)
    late = [push_ticket(s, 1, 0, [10.0] * 4, t1) for s in (clock, other)]  # arrives first
    assert not any(f.done() for f in late)
    for s in (clock, other):
        assert push_ticket(s, 0, 0, [1.0] * 4, t0).wait().version == 1
    assert [f.wait().version for f in late] == [2, 2]
    for s in (clock, other):
        assert s.version == 2 and s.stats.staleness_max == 1 and s.stats.staleness_sum == 1
        torch.testing.assert_close(s.params, torch.full((4,), -11.0))
    for s in (clock, other):
        s.close()


def test_gradient_staler_than_bound_is_never_admitted():
    shard = make_shard(asynch(max_staleness=0), sgd(lr=1.0), workers=2)
    f0 = admit(shard, 0, 0)  # held: worker1 computes on 0 too
    assert not f0.done()
    f1 = admit(shard, 1, 0)
    # oldest first, ties in arrival order: worker0 gets ticket 0, worker1 would be 1 stale
    assert f0.wait().seq == 0 and f1.wait().seq is None and not f1.wait().finished
    assert shard.stats.stale_dropped == 1 and shard.version == 0  # nothing reached the shard


def test_held_admission_released_after_timeout_and_laggard_counted_lost():
    shard = make_shard(asynch(max_staleness=0, timeout_s=0.3), sgd(lr=1.0), workers=2)
    t0 = time.monotonic()
    assert admit(shard, 0, 0).wait().seq == 0  # worker1 never pushes
    assert time.monotonic() - t0 >= 0.3 and shard.updater.live.lost == {1}
    assert admit(shard, 0, 1).done()  # no longer waits for worker1
    shard.close()


def test_ticket_that_never_arrives_is_skipped_after_timeout():
    shard = make_shard(asynch(max_staleness=2, timeout_s=0.3), sgd(lr=1.0), workers=2)
    assert admit(shard, 0, 0).wait().seq == 0  # worker0 dies before pushing ticket 0
    assert admit(shard, 1, 0).wait().seq == 1
    r = push_ticket(shard, 1, 0, [1.0] * 4, 1).wait()  # waits for ticket 0, then goes on
    assert r.accepted and r.version == 2 and shard.stats.applied_pushes == 1
    assert not push_ticket(shard, 0, 0, [1.0] * 4, 0).wait().accepted  # too late now
    shard.close()


def test_freeze_stops_the_clock_and_answers_waiters_finished():
    shard = make_shard(asynch(max_staleness=0), sgd(lr=1.0), workers=2)
    held = admit(shard, 0, 0)
    assert shard.freeze(0) == 0 and held.wait().finished
    assert admit(shard, 1, 0).wait().finished


def test_async_unbounded_never_waits():
    shard = make_shard(asynch(), workers=3)
    for i in range(10):
        assert push(shard, 0, i, [0.0] * 4).done()

"""The barrier aggregator, called directly (no RPC)."""

import time

import pytest
import torch

from tests.unit_helpers import adam, make_shard, push, sgd, sync


def test_round_averages_and_steps_once():
    shard = make_shard(sync(), sgd(lr=1.0), workers=2)
    f0 = push(shard, 0, 0, [1.0, 2.0, 3.0, 4.0], loss=2.0)
    assert not f0.done()  # waits at the barrier for worker1
    f1 = push(shard, 1, 0, [3.0, 2.0, 1.0, 0.0], loss=4.0)
    r0, r1 = f0.wait(), f1.wait()
    assert r0 is r1  # one reply shared by every waiter of the round
    assert r0.version == 1 and r0.accepted and r0.loss == 3.0
    torch.testing.assert_close(r0.params, -torch.tensor([2.0, 2.0, 2.0, 2.0]))
    assert shard.stats.applied_pushes == 2


def test_stale_gradient_dropped_counted_and_answered_at_once():
    shard = make_shard(sync(), workers=2)
    push(shard, 0, 0, [1.0] * 4)
    push(shard, 1, 0, [1.0] * 4).wait()
    before = shard.params.clone()
    r = push(shard, 1, 0, [100.0] * 4).wait()  # computed on version 0, shard is at 1
    assert not r.accepted and r.version == 1
    assert shard.stats.stale_dropped == 1
    torch.testing.assert_close(shard.params, before)  # never touched the master copy


def test_backup_workers_first_n_make_the_round():
    shard = make_shard(sync(replicas=2), sgd(lr=1.0), workers=3)
    f0 = push(shard, 0, 0, [2.0] * 4)
    f2 = push(shard, 2, 0, [4.0] * 4)
    assert f0.done() and f2.done() and f0.wait().version == 1
    late = push(shard, 1, 0, [100.0] * 4).wait()
    assert not late.accepted and shard.stats.per_worker_stale == {1: 1}
    torch.testing.assert_close(shard.params, torch.full((4,), -3.0))


def test_round_times_out_with_what_it_has_and_stops_waiting_for_the_lost():
    shard = make_shard(sync(timeout_s=0.3), sgd(lr=1.0), workers=2)
    t0 = time.monotonic()
    r = push(shard, 0, 0, [2.0] * 4).wait()
    assert 0.3 <= time.monotonic() - t0 < 5
    assert r.accepted and r.version == 1
    torch.testing.assert_close(r.params, torch.full((4,), -2.0))  # averaged over 1
    assert shard.updater.live.lost == {1}
    assert push(shard, 0, 1, [1.0] * 4).done()  # next round: worker1 no longer awaited
    # worker1 comes back: stale once, then awaited again
    assert not push(shard, 1, 0, [1.0] * 4).wait().accepted
    assert shard.updater.live.lost == set()
    assert not push(shard, 0, 2, [1.0] * 4).done()
    shard.close()


def test_optimizer_state_lives_on_the_shard():
    shard = make_shard(sync(), sgd(lr=0.1, momentum=0.9), workers=1)
    for v in range(3):
        push(shard, 0, v, [1.0] * 4).wait()
    buf = shard.optimizer.state[shard.params]["momentum_buffer"]
    torch.testing.assert_close(buf, torch.full((4,), 1 + 0.9 + 0.81))
    # params: -0.1 * (1 + 1.9 + 2.71)
    torch.testing.assert_close(shard.params, torch.full((4,), -0.561))


def test_bf16_wire_sums_in_float32():
    shard = make_shard(sync(wire="bfloat16"), sgd(lr=1.0), workers=2)
    g = torch.full((4,), 1.0, dtype=torch.bfloat16)
    f = shard.push_pull(0, 0, g, 1.0, 1)
    shard.push_pull(1, 0, g * 3, 1.0, 1)
    r = f.wait()
    assert r.params.dtype == torch.bfloat16 and shard.params.dtype == torch.float32
    torch.testing.assert_close(shard.params, torch.full((4,), -2.0))


def test_no_update_past_train_steps():
    shard = make_shard(sync(), sgd(lr=1.0), workers=1, steps=2)
    for v in range(2):
        push(shard, 0, v, [1.0] * 4).wait()
    r = push(shard, 0, 2, [1.0] * 4).wait()
    assert not r.accepted and r.version == 2


def test_round_sums_in_worker_order_whatever_the_arrival_order():
    """Reruns are bit-identical: float addition is not associative ((a + b) + c != (a + c) + b
    for these), so summing in arrival order made two identical runs differ."""
    grads = {0: [1e8, 1.0, 3.0, 0.1], 1: [1.0, 1e8, 0.1, 3.0], 2: [-1e8, -1e8, 0.3, 0.7]}
    losses = {0: 0.1, 1: 0.2, 2: 0.3}
    results = []
    for order in [(0, 1, 2), (2, 1, 0), (1, 2, 0)]:
        shard = make_shard(sync(), sgd(lr=1.0), workers=3)
        futures = [push(shard, w, 0, grads[w], loss=losses[w]) for w in order]
        r = futures[0].wait()
        results.append((shard.params.clone(), r.loss))
        shard.close()
    assert all(torch.equal(p, results[0][0]) and l == results[0][1] for p, l in results)
    # the check can fail: arrival order really changes these sums
    a, b, c = (torch.tensor(grads[w]) for w in (0, 1, 2))
    assert not torch.equal((a + b) + c, (c + b) + a)


@pytest.mark.parametrize("rounds_before", [0, 2])
def test_catch_up_counts_the_passed_steps_as_the_optimizers_steps(rounds_before):
    """A membership change lines shards up: a push that reached shard A only leaves shard B a
    step behind, and B passes it without an update (catch_up). Adam's step count (its bias
    correction) must stay the same on every shard, as with one optimizer over the whole model
    (a checkpoint re-split for another number of PS takes shard 0's count for all): B counts
    the step that A applied; its moments are untouched (that gradient is lost)."""
    a, b = (make_shard(sync(), adam(lr=0.1), workers=1) for _ in range(2))
    for v in range(rounds_before):
        for s in (a, b):
            push(s, 0, v, [1.0, 2.0, 3.0, 4.0]).wait()
    moments = {k: t.clone() for k, t in b.optimizer.state[b.params].items() if k != "step"}
    push(a, 0, rounds_before, [1.0] * 4).wait()  # the worker died before pushing b
    versions = [s.begin_epoch() for s in (a, b)]
    assert [s.catch_up(max(versions)) for s in (a, b)] == [rounds_before + 1] * 2
    state = b.optimizer.state[b.params]
    assert int(state["step"]) == int(a.optimizer.state[a.params]["step"]) == rounds_before + 1
    for k, t in moments.items():
        assert torch.equal(state[k], t)  # no gradient was made up
    if not rounds_before:  # the state a first step makes: zero moments
        assert torch.equal(state["exp_avg"], torch.zeros(4))
        assert torch.equal(state["exp_avg_sq"], torch.zeros(4))
    for s in (a, b):  # the next round: both at the same step count
        push(s, 0, rounds_before + 1, [1.0] * 4).wait()
    assert int(b.optimizer.state[b.params]["step"]) == int(a.optimizer.state[a.params]["step"])
    for s in (a, b):
        s.close()


def test_catch_up_leaves_sgd_state_alone():
    """SGD counts no steps: a shard that catches up before its first update keeps no state
    (its first real step builds the momentum buffer from that gradient, as it always does)."""
    a, b = (make_shard(sync(), sgd(lr=0.1, momentum=0.9), workers=1) for _ in range(2))
    push(a, 0, 0, [1.0] * 4).wait()
    for s in (a, b):
        s.begin_epoch()
        s.catch_up(1)
    assert b.version == 1 and not b.optimizer.state[b.params]
    for s in (a, b):
        s.close()

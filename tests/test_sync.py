"""The barrier aggregator, called directly (no RPC)."""

import time

import torch

from tests.unit_helpers import make_shard, push, sgd, sync


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

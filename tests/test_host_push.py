"""One push per host (update.host_push) and the order every sum follows (psrpc/optim/treesum.py):
the tree's parts summed apart give the tree's bits; a shard takes a host's sum in the block's
place and checks it; a local cluster whose four workers push one sum equals four pushes and one
worker accumulating four micro-batches, bit for bit. (Across emulated hosts:
tests/test_hosts.py.)"""

import re
import socket

import pytest
import torch

from psrpc.cluster.wire import HostSum
from psrpc.errors import ConfigError, PushRejected
from psrpc.optim.treesum import Scratch, TreeAccumulator, leaves, tree_sum
from psrpc.worker.hostpush import HostPush, HostPushError, block_of
from tests.conftest import assert_equal_model, assert_same_model, compose, run_cluster
from tests.unit_helpers import make_shard, push, sync

pytestmark = pytest.mark.timeout(300)


def _reference(xs: list, lo: int = 0, size: int = 0):
    """The tree by its definition: halves of the perfect binary tree, empty halves left out."""
    if not size:
        size = 1
        while size < len(xs):
            size *= 2
    part = [x for i, x in enumerate(xs) if lo <= i < lo + size and x is not None]
    if len(part) <= 1:
        return part[0] if part else None
    a, b = _reference(xs, lo, size // 2), _reference(xs, lo + size // 2, size // 2)
    return a if b is None else b if a is None else a + b


def _gradients(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)  # magnitudes far apart: every order rounds its way
    return [torch.randn(257, generator=g) * 10.0 ** torch.randint(-6, 6, (257,), generator=g)
            for _ in range(n)]


def _sum(items, like):
    out = torch.empty_like(like)
    return tree_sum(items, out, Scratch().like(out)).clone()


@pytest.mark.parametrize("n", range(1, 10))
def test_the_tree_is_its_definition_and_two_or_three_add_left_to_right(n):
    xs = _gradients(n)
    got = _sum(leaves(xs), xs[0])
    assert torch.equal(got, _reference(xs))
    if n <= 3:
        left_to_right = xs[0].clone()
        for x in xs[1:]:
            left_to_right += x
        assert torch.equal(got, left_to_right)
    if n == 4:  # (g0 + g1) + (g2 + g3) is another number than ((g0 + g1) + g2) + g3
        assert not torch.equal(got, ((xs[0] + xs[1]) + xs[2]) + xs[3])


@pytest.mark.parametrize("n", [4, 6, 7, 8])
def test_an_aligned_blocks_sum_in_its_place_gives_the_same_bits(n):
    xs = _gradients(n)
    whole = _sum(leaves(xs), xs[0])
    for level in (1, 2):
        for first in range(0, n, 1 << level):
            block = list(range(first, min(first + (1 << level), n)))
            if len(block) < 2:
                continue
            part = _sum(leaves([xs[i] for i in block]), xs[0])  # (added apart, as a host does)
            items = [(i, 0, x) for i, x in enumerate(xs) if i < first] + [(first, level, part)] \
                + [(i, 0, x) for i, x in enumerate(xs) if i > block[-1]]
            assert torch.equal(_sum(items, xs[0]), whole), (first, level)


def test_missing_leaves_are_left_out_and_low_precision_adds_in_float32():
    xs = _gradients(7)
    some = [x if i in (0, 2, 3, 6) else None for i, x in enumerate(xs)]
    items = [(i, 0, x) for i, x in enumerate(some) if x is not None]
    assert torch.equal(_sum(items, xs[0]), _reference(some))
    halves = [x.bfloat16() for x in xs[:2]]
    assert torch.equal(_sum(leaves(halves), xs[0]), halves[0].float() + halves[1].float())


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_accumulating_one_at_a_time_is_the_tree(n):
    xs = _gradients(n)
    acc = TreeAccumulator()
    for x in xs:
        acc.add([x])
    out = [torch.empty_like(xs[0])]
    acc.total(out)
    assert torch.equal(out[0], _sum(leaves(xs), xs[0]))


@pytest.mark.parametrize("hosts, index, block", [
    (["a", "a", "b", "b"], 2, (2, 1, [2, 3])),
    (["a", "a", "b", "b"], 0, (0, 1, [0, 1])),
    (["a", "a", "a", "a"], 3, (0, 2, [0, 1, 2, 3])),
    (["a", "b", "b"], 1, None),  # 1-2 is no aligned block: each pushes its own
    (["a", "b", "b"], 2, None),
    (["a", "a", "a"], 2, (0, 2, [0, 1, 2])),  # (index 3 does not exist)
    (["a", "a", "b", "b", "b", "b"], 5, (4, 2, [4, 5])),  # 2-5 is not aligned; 4-7 has 4-5
    (["a", None, "a", "a"], 0, (0, 2, [0, 2, 3])),  # worker1 gone for good: an absent leaf
    (["a", "a", "a", None], 2, (0, 2, [0, 1, 2])),
    (["a", None], 0, None),  # alone: no block
])
def test_a_block_is_the_largest_aligned_one_on_the_host(hosts, index, block):
    assert block_of(index, hosts) == block


def _shard(workers=4):
    shard = make_shard(sync(), workers=workers)
    return shard


def test_a_shard_takes_a_host_sum_in_the_blocks_place():
    """Workers 0 and 1 push apart, 2 and 3 as one host sum: the round is the tree's mean, every
    worker counted, the host's losses in the round's loss."""
    xs = [torch.tensor([1.0, 2.0, 3.0, 4.0]) * (i + 1) for i in range(4)]
    shard = _shard()
    futs = [push(shard, 0, 0, xs[0]), push(shard, 1, 0, xs[1], loss=3.0),
            shard.push_pull(2, 0, xs[2] + xs[3], 5.0, 2, None,
                            HostSum(1, (2, 3), (5.0, 7.0)))]
    replies = [f.wait() for f in futs]
    assert all(r.accepted for r in replies) and replies[0].loss == (1 + 3 + 5 + 7) / 4
    expected = -((xs[0] + xs[1]) + (xs[2] + xs[3])) / 4  # sgd, lr 1
    assert torch.equal(shard.params, expected)
    s = shard.stats
    assert s.host_sums == 1 and s.samples == 4 and s.per_worker_applied == {w: 1 for w in range(4)}
    shard.close()


def test_a_host_sum_with_an_excused_worker_counts_it_non_finite():
    shard = _shard()
    futs = [push(shard, 0, 0, [1.0] * 4), push(shard, 1, 0, [3.0] * 4),
            shard.push_pull(2, 0, torch.full((4,), 2.0), 1.0, 1, None,
                            HostSum(1, (2,), (1.0,), (3,)))]
    assert all(f.wait().version == 1 for f in futs)
    assert shard.stats.nan_rejected == 1 and 3 not in shard.stats.per_worker_applied
    torch.testing.assert_close(shard.params, torch.full((4,), -2.0))  # mean(1, 3, 2)
    shard.close()


@pytest.mark.parametrize("host, match", [
    (HostSum(1, (1, 2), (1.0, 1.0)), r"malformed host sum"),  # 1-2 is not a block
    (HostSum(1, (2, 3), (1.0,)), r"malformed host sum"),  # a loss missing
    (HostSum(2, (2, 3), (1.0, 1.0)), r"malformed host sum"),  # 2 does not start a block of 4
    (HostSum(1, (3, 2), (1.0, 1.0)), r"malformed host sum"),  # out of order
    (HostSum(1, (2, 4), (1.0, 1.0)), r"malformed host sum"),  # no worker 4
    ("2,3", r"expected a HostSum with a tensor"),
])
def test_a_malformed_host_sum_is_refused_and_changes_nothing(host, match):
    shard = _shard()
    first = push(shard, 0, 0, [1.0] * 4)  # a round under way, to protect
    with pytest.raises(PushRejected, match=match):
        shard.push_pull(2, 0, torch.ones(4), 1.0, 2, None, host).wait()
    assert shard.updater.members == {0} and shard.stats.host_sums == 0
    assert not first.done()
    shard.close()


def test_host_push_on_where_it_cannot_be_is_refused_naming_the_key():
    for extra, why in [(["update=async"], "needs update=sync"),
                       (["update.replicas_to_aggregate=1"], "backup workers"),
                       (["update.dense=allreduce"], "update.dense=ps")]:
        with pytest.raises(ConfigError, match=rf"update.host_push='on': .*{why}"):
            compose(["cluster.num_workers=2", "update.host_push=on", *extra])
    with pytest.raises(ConfigError, match=r"update.host_push='always'"):
        compose(["update.host_push=always"])


def test_four_workers_pushing_one_sum_equal_four_pushes_and_accumulation(tmp_path):
    """One host, the PS over TCP (cluster.shm=off) and update.host_push=on: workers 0-3 form
    one block and worker0 pushes their sum, 20 rounds of one push each. The model equals
    every worker pushing its own and one worker accumulating 4 micro-batches, bit for bit."""
    base = ["cluster.num_workers=4", "train.batch_size=8", "cluster.shm=off"]
    one, state = run_cluster(tmp_path / "on", base + ["update.host_push=on"])
    assert one["host_push"] == ["workers 0-3 push as one, led by worker0"]
    (shard,) = one["shards"]
    assert shard["host_sums"] == 20 and shard["per_worker_applied"] == {str(w): 20 for w in
                                                                        range(4)}
    each, state_each = run_cluster(tmp_path / "off", base + ["update.host_push=off"])
    assert each["host_push"] == [] and each["shards"][0]["host_sums"] == 0
    acc = run_cluster(tmp_path / "acc", ["cluster.num_workers=1", "train.batch_size=32",
                                         "train.accumulate=4"])
    assert_equal_model(state, state_each)
    assert_equal_model(state, acc[1])
    assert one["final_loss"] == each["final_loss"] == acc[0]["final_loss"]


def test_a_non_finite_gradient_in_a_block_skips_only_its_workers_batch(tmp_path):
    """worker2's gradient is NaN at step 5: the block's leader leaves it out of the sum and the
    PS excuses worker2 alone, as when worker2 pushes it itself: the same model either way."""
    base = ["cluster.num_workers=4", "train.batch_size=8", "cluster.shm=off",
            "fault.nan_worker=2", "fault.nan_at_step=5"]
    one, state = run_cluster(tmp_path / "on", base + ["update.host_push=on"])
    each, state_each = run_cluster(tmp_path / "off", base + ["update.host_push=off"])
    assert one["shards"][0]["nan_rejected"] == each["shards"][0]["nan_rejected"] == 1
    assert one["shards"][0]["host_sums"] == 20
    assert_equal_model(state, state_each)


def test_bfloat16_host_sums_differ_from_separate_pushes_only_by_one_rounding(tmp_path):
    """update.wire_dtype=bfloat16: the block's sum goes out in bfloat16, one rounding more than
    the PS's float32 sum of separate bfloat16 pushes: close to them, not the same bits."""
    base = ["cluster.num_workers=4", "train.batch_size=8", "cluster.shm=off",
            "update.wire_dtype=bfloat16"]
    one, state = run_cluster(tmp_path / "on", base + ["update.host_push=on"])
    each, state_each = run_cluster(tmp_path / "off", base + ["update.host_push=off"])
    assert one["shards"][0]["host_sums"] == 20 and each["shards"][0]["host_sums"] == 0
    # within a couple of bfloat16 steps at these weights' magnitude (2^-8 at 0.5-1: 0.004)
    assert_same_model(state, state_each, rtol=0, atol=1e-2)
    assert any(not torch.equal(state[k], state_each[k]) for k in state)


def test_a_killed_worker_of_a_block_rejoins_and_the_block_forms_again(tmp_path):
    """worker3 of the block 0-3 is SIGKILLed at step 20: the leader's wait for its gradient
    fails at once (its socket closed), the launcher starts it again, the block forms again in
    the new membership epoch, and the run finishes with host sums on both sides of the kill."""
    summary, _ = run_cluster(tmp_path, [
        "cluster.num_workers=4", "train.batch_size=8", "cluster.shm=off",
        "update.host_push=on", "train.steps=60", "fault.crash_role=worker",
        "fault.crash_index=3", "fault.crash_at_step=20"])
    assert summary["steps"] == 60 and summary["restored_from_step"] is None
    assert summary["workers_rejoined"] == 1 and summary["workers_lost"] == 0
    (shard,) = summary["shards"]
    assert shard["host_sums"] > 40  # (the rounds around the kill may go without the block)
    assert summary["host_push"] == ["workers 0-3 push as one, led by worker0"]


@pytest.mark.timeout(120)
def test_a_worker_of_a_block_lost_for_good_leaves_the_block_and_the_run_completes(tmp_path):
    """worker3 of the block 0-3 is SIGKILLed at step 10 with no restart left: the leader's
    wait for its gradient fails at once, and the block goes on without it (workers 0-2 sum and
    worker0 pushes, as the tree with worker3's leaf absent); the run ends, worker3 counted lost,
    and no message blames a worker that is alive."""
    summary, _ = run_cluster(tmp_path, [
        "cluster.num_workers=4", "train.batch_size=8", "cluster.shm=off",
        "update.host_push=on", "train.steps=40", "cluster.max_worker_restarts=0",
        "update.timeout_s=2", "fault.crash_role=worker", "fault.crash_index=3",
        "fault.crash_at_step=10"], timeout_s=90)
    assert summary["steps"] == 40 and summary["workers_lost"] == 1
    (shard,) = summary["shards"]
    assert shard["host_sums"] == 40 and shard["workers_lost"] == [3]
    assert shard["per_worker_applied"]["0"] == 40
    logs = "".join((tmp_path / "logs" / f"{r}.log").read_text()
                   for r in ("worker0", "worker1", "worker2", "ps0"))
    assert "host push: worker3 is gone" in logs
    assert not re.search(r"worker[012] is gone", logs)


def test_a_member_told_the_block_broke_names_why_not_its_live_leader():
    """The leader breaks its block (worker2 sent nothing in time, say): before its sockets close
    it tells the other members why, so worker1's call names worker2's silence, not 'worker0 is
    gone'."""
    to_1, from_0 = socket.socketpair()
    to_2, _ = socket.socketpair()
    args = ([True], [4], torch.float32, 5.0)
    leader = HostPush(0, 0, 2, [0, 1, 2], {1: to_1, 2: to_2}, *args)
    member = HostPush(1, 0, 2, [0, 1, 2], {0: from_0}, *args)
    fut = member.push(None, 0, 0, torch.zeros(4), 1.0, 8)
    leader._break(HostPushError("host push: worker2 sent nothing in 10 s (twice the RPC "
                                "timeout)"))
    with pytest.raises(Exception, match=r"host push: worker0, the block's leader, broke the "
                                        r"block: worker2 sent nothing in 10 s") as e:
        fut.wait()
    assert "worker0 is gone" not in str(e.value)
    member.close()
    leader.close()

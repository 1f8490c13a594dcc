"""A shard's checks on what it is sent, called directly (no RPC): bad input never touches it."""

import pytest
import torch

from psrpc.errors import PushRejected
from tests.unit_helpers import adam, make_shard, push, sync


def _rejected(fut, match):
    with pytest.raises(PushRejected, match=match):
        fut.wait()


@pytest.mark.parametrize("bad, match", [
    (dict(worker=5), r"unknown worker 5 \(workers are 0\.\.1\)"),
    (dict(grad=torch.zeros(3)), r"shape \(3,\), expected \(4,\)"),
    (dict(grad=torch.zeros(2, 2)), r"shape \(2, 2\), expected \(4,\)"),
    (dict(grad=torch.zeros(4, dtype=torch.float64)), r"dtype torch.float64, expected torch.float32"),
    (dict(grad=[0.0] * 4), r"pushed a list, expected a flat tensor"),
    (dict(version=7), r"step 7, but this shard is at step 0 \(a step from the future\)"),
])
def test_malformed_push_rejected_with_clear_error_and_shard_untouched(bad, match):
    shard = make_shard(sync(), workers=2)
    before, opt_before = shard.params.clone(), repr(shard.optimizer.state_dict())
    args = dict(worker=0, version=0, grad=torch.ones(4))
    args.update(bad)
    _rejected(shard.push_pull(args["worker"], args["version"], args["grad"], 1.0, 1), match)
    torch.testing.assert_close(shard.params, before)
    assert repr(shard.optimizer.state_dict()) == opt_before
    assert shard.version == 0 and shard.updater._members == set()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_gradient_rejected_and_counted(value):
    shard = make_shard(sync(), adam(), workers=1)
    r = push(shard, 0, 0, [1.0, value, 1.0, 1.0]).wait()
    assert not r.accepted and shard.stats.nan_rejected == 1
    assert torch.isfinite(shard.params).all() and shard.version == 0
    assert push(shard, 0, 0, [1.0] * 4).wait().accepted  # the next good push goes through


def test_pull_is_a_snapshot_not_the_master_copy():
    shard = make_shard(sync(), workers=1)
    r = shard.pull()
    r.params.add_(1.0)
    assert torch.equal(shard.params, torch.zeros(4))

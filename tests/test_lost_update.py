"""No lost update: 4 workers push 200 rounds each through the real RPC path; the master copy
ends at its start minus exactly every update applied. (PyTorch's batch-updating PS example,
which accumulates outside a lock, loses some of them.)"""

import pytest
import torch

from psrpc.factories import load_data
from psrpc.launch import launch
from tests.cluster_helpers import IntegerGradWorker, integer_grad
from tests.conftest import FAST, compose, read_outputs

pytestmark = pytest.mark.timeout(300)
W, ROUNDS = 4, IntegerGradWorker.ROUNDS


@pytest.mark.parametrize("update", ["sync", "async"])
def test_master_copy_is_start_minus_every_applied_update(tmp_path, update):
    steps = ROUNDS if update == "sync" else W * ROUNDS  # async: one global step per push
    cfg = compose(FAST + [f"update={update}", f"cluster.num_workers={W}", "cluster.num_ps=2",
                          f"train.steps={steps}", "train.log_every=100", "optim.lr=1.0",
                          "optim.momentum=0.0"])
    launch(cfg, tmp_path, timeout_s=240, replica_cls=IntegerGradWorker)
    summary, state = read_outputs(tmp_path)
    assert summary["steps"] == steps and summary["stale_dropped"] == 0

    torch.manual_seed(cfg.train.seed)  # the chief's initial model
    start = dict(IntegerGradWorker.build_model(cfg, load_data(cfg)).named_parameters())
    from psrpc.cluster.layout import Layout

    layout = Layout.plan({n: tuple(p.shape) for n, p in start.items()}, 2,
                         cfg.cluster.max_shard_bytes, cfg.cluster.bucket_bytes)
    flats = layout.split({n: p.detach() for n, p in start.items()})
    for k, n in enumerate(layout.shard_numel):
        total = sum(integer_grad(i, s, n) for i in range(W) for s in range(ROUNDS))
        flats[k] -= total / W if update == "sync" else total  # round averages vs each gradient
    expected = layout.join(flats)
    for name, value in expected.items():
        assert torch.equal(state[name], value), name  # exact: every update, nothing lost

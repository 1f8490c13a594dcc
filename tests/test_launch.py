"""The local launcher: a failing rank brings the run down at once, with its error, and leaves no
process behind (the autouse fixture in conftest checks every test for leftovers)."""

import time

import pytest

from psrpc.launch import ClusterFailed, launch
from tests.cluster_helpers import FailingWorker
from tests.conftest import FAST, compose

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("update", ["sync", "async"])
def test_failing_rank_brings_the_run_down_with_its_error(tmp_path, update):
    cfg = compose(FAST + [f"update={update}", "train.steps=1000", "update.timeout_s=60"])
    t0 = time.monotonic()
    with pytest.raises(ClusterFailed, match=r"worker1 failed: .*worker1 hit a bug at step 5"):
        launch(cfg, tmp_path, timeout_s=100, replica_cls=FailingWorker)
    assert time.monotonic() - t0 < 30  # promptly: not after update.timeout_s or the steps
    assert not (tmp_path / "summary.json").exists()


def test_run_timeout_stops_everything(tmp_path):
    cfg = compose(FAST + ["train.steps=100000"])
    with pytest.raises(ClusterFailed, match="did not finish within 8 s"):
        launch(cfg, tmp_path, timeout_s=8)

"""Real MNIST (../shared/data), cnn, 2 workers, one epoch of samples: at least 97 % test accuracy."""

import pytest

from tests.conftest import MNIST_ROOT, run_cluster

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow,
              pytest.mark.skipif(not (MNIST_ROOT / "MNIST" / "raw").is_dir(),
                                 reason="needs ../shared/data/MNIST")]


def test_sync_cnn_one_epoch_reaches_97_percent(tmp_path):
    summary, _ = run_cluster(tmp_path, [
        "data=mnist", f"data.root={MNIST_ROOT}", "model=cnn", "cluster.num_workers=2",
        "train.batch_size=64", "train.steps=469", "train.log_every=100"], fast=False)
    assert summary["samples"] >= 60000  # one epoch of samples: 469 rounds × 2 × 64
    assert summary["test_accuracy"] >= 0.97, summary

"""Determinism of the data order, the built-in synthetic set, and the loader (batches by step
from any map-style dataset, in this process or in DataLoader processes)."""

import torch

from psrpc.data import GlobalBatches, synthetic


def test_global_batch_is_the_same_samples_whatever_the_worker_count():
    one = GlobalBatches(1000, 32, seed=3)
    two = GlobalBatches(1000, 32, seed=3)
    for step in [0, 1, 30, 31, 32, 200]:  # 31/32 straddle an epoch boundary (1000 / 32)
        whole = one.slice_for(step, 0, 32)
        halves = torch.cat([two.slice_for(step, i, 16) for i in range(2)])
        assert torch.equal(whole, halves)
        assert len(set(whole.tolist())) == 32


def test_every_sample_once_per_epoch_and_seed_matters():
    b = GlobalBatches(100, 10, seed=0)
    epoch = torch.cat([b.indices(t) for t in range(10)])
    assert sorted(epoch.tolist()) == list(range(100))
    assert not torch.equal(b.indices(0), GlobalBatches(100, 10, seed=1).indices(0))
    assert not torch.equal(b.indices(0), b.indices(10))  # a new permutation each epoch


def test_synthetic_is_deterministic_and_has_a_test_split():
    args = dict(image_shape=[1, 8, 8], num_classes=3, size=50, test_size=20, noise=1.0)
    a, b = synthetic(**args, seed=0), synthetic(**args, seed=0)
    assert torch.equal(a["train"].tensors[0], b["train"].tensors[0])
    assert torch.equal(a["test"].tensors[1], b["test"].tensors[1])
    assert a["train"].tensors[0].shape == (50, 1, 8, 8) and len(a["test"]) == 20
    assert a["image_shape"] == (1, 8, 8) and a["num_classes"] == 3
    assert not torch.equal(a["train"].tensors[0], synthetic(**args, seed=1)["train"].tensors[0])

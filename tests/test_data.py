"""Determinism of the data order, the built-in synthetic set, and the loader (batches by step
from any map-style dataset, in this process or in DataLoader processes)."""

import torch

from psrpc.data import synthetic
from psrpc.worker.batches import GlobalBatches


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


class _Augmented(torch.utils.data.Dataset):
    """Random per-sample noise: deterministic only through the loader's per-sample seeding."""

    def __len__(self):
        return 50

    def __getitem__(self, i):
        return torch.full((3,), float(i)) + torch.rand(3), i


def test_loader_is_the_same_batches_whatever_the_processes_and_worker_count():
    """Per-sample randomness (augmentation) is seeded by (seed, epoch, index): a batch is the
    same in this process or in DataLoader processes, and W workers' slices make one worker's
    batch; steps may come in any order (a restart of the loader)."""
    from psrpc.worker.loader import StepBatches

    cpu = torch.device("cpu")
    one = StepBatches(_Augmented(), GlobalBatches(50, 8, 1), 0, 8, cpu, 0, seed=1)
    halves = [StepBatches(_Augmented(), GlobalBatches(50, 8, 1), r, 4, cpu, 2, seed=1)
              for r in range(2)]
    for step in [0, 1, 2, 5, 3, 9, 10]:  # 6 → 7 straddles an epoch; 5 → 3 goes back
        x, y = one.get(step)
        parts = [h.get(step) for h in halves]
        assert torch.equal(x, torch.cat([p[0] for p in parts]))
        assert torch.equal(y, torch.cat([p[1] for p in parts]))
    assert not torch.equal(one.get(0)[0], one.get(7)[0])  # a new epoch: new noise, new order
    for h in halves:
        h.close()


def test_a_tensor_dataset_is_indexed_a_batch_at_a_time():
    from torch.utils.data import TensorDataset

    from psrpc.worker.loader import fetch

    ds = TensorDataset(torch.arange(10.0).view(5, 2), torch.arange(5))
    x, y = fetch(ds, torch.tensor([3, 1]))
    assert torch.equal(x, torch.tensor([[6.0, 7.0], [2.0, 3.0]])) and y.tolist() == [3, 1]


def test_schedules_match_torch_lr_schedulers():
    """The PS's schedule is torch's LinearLR warmup / StepLR / CosineAnnealingLR arithmetic as a
    function of the global step."""
    from types import SimpleNamespace as NS

    from psrpc.optim.schedule import lr_factor

    opt = NS(lr=0.1, warmup_steps=0, step_size=7, gamma=0.5, min_lr=0.01)
    steps = 40
    for name, make in [
        ("step", lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=7, gamma=0.5)),
        ("cosine", lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, steps, 0.01)),
    ]:
        p = torch.nn.Parameter(torch.zeros(1))
        sgd = torch.optim.SGD([p], lr=0.1)
        sched = make(sgd)
        for t in range(steps):
            got = 0.1 * lr_factor(t, NS(**vars(opt), schedule=name), steps)
            assert abs(got - sgd.param_groups[0]["lr"]) < 1e-9, (name, t)
            sgd.step()
            sched.step()
    warm = NS(**{**vars(opt), "warmup_steps": 4}, schedule="constant")
    assert [lr_factor(t, warm, steps) for t in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    linear = NS(**vars(opt), schedule="linear")
    assert lr_factor(0, linear, steps) == 1.0 and abs(lr_factor(steps, linear, steps) - 0.1) < 1e-12


def test_unshuffled_batches_are_the_dataset_in_order_every_epoch():
    b = GlobalBatches(10, 4, seed=3, shuffle=False)
    assert b.indices(0).tolist() == [0, 1, 2, 3]
    assert b.indices(2).tolist() == [8, 9, 0, 1]  # the next epoch starts over, in order
    assert b.slice_for(1, 1, 2).tolist() == [6, 7]

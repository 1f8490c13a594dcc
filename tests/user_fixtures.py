"""A user's own model, datasets, loss and metric, outside the psrpc package: what the tests
train through the CLI and the Python API (by import path, as a user would)."""

from __future__ import annotations

import random

import torch
from torch import nn
from torch.utils.data import Dataset


class Pairs(Dataset):
    """A map-style dataset that is not a TensorDataset: item i is computed in __getitem__."""

    def __init__(self, n: int, features: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, features, generator=g)
        self.w = torch.randn(features, 2, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i]
        return x, torch.tanh(x @ self.w)  # a (2,) target


def make_datasets(features: int = 6, size: int = 1024, test_size: int = 128, seed: int = 0):
    return {"train": Pairs(size, features, seed), "test": Pairs(test_size, features, seed + 1),
            "features": features}


class NoisyPairs(Pairs):
    """Pairs with a random augmentation drawn in __getitem__ from torch's and Python's
    generators: the loader seeds them per sample."""

    def __getitem__(self, i: int):
        x, y = super().__getitem__(i)
        return x + 0.1 * torch.randn_like(x) + 0.01 * random.random(), y


def make_noisy_datasets(features: int = 6, size: int = 1024, test_size: int = 128, seed: int = 0):
    return {"train": NoisyPairs(size, features, seed), "test": Pairs(test_size, features, seed + 1),
            "features": features}


def make_dropout_net(features: int, hidden: int = 32, p: float = 0.3) -> nn.Sequential:
    """Dropout draws from the training process's generator every step."""
    return nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Dropout(p),
                         nn.Linear(hidden, 2))


def make_net(features: int, hidden: int = 32) -> nn.Sequential:
    """An nn.Sequential, so model parallelism can cut it."""
    return nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                         nn.Tanh(), nn.Linear(hidden, 2))


class Staged(nn.Module):
    """Not a Sequential: lists its stages for model parallelism."""

    def __init__(self, features: int, hidden: int = 32):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(features, hidden), nn.Tanh())
        self.middle = nn.Linear(hidden, hidden)
        self.head = nn.Sequential(nn.Tanh(), nn.Linear(hidden, 2))

    def pipeline_layers(self):
        return [self.encoder, self.middle, self.head]

    def forward(self, x):
        return self.head(self.middle(self.encoder(x)))


class Unstaged(Staged):
    pipeline_layers = None  # neither Sequential nor staged: model parallel must refuse it


def make_staged(features: int, hidden: int = 32) -> Staged:
    return Staged(features, hidden)


def make_unstaged(features: int) -> Unstaged:
    return Unstaged(features)


class SmoothL1(nn.Module):
    """A loss of the user's own (the batch mean, as psrpc needs)."""

    def forward(self, output, target):
        return nn.functional.smooth_l1_loss(output, target, beta=0.5)


class MeanAbsError:
    name = "mae"
    higher_is_better = False

    def __init__(self):
        self.reset()

    def reset(self):
        self.total, self.count = 0.0, 0

    def update(self, output, target):
        self.total += float((output - target).abs().sum())
        self.count += target.numel()

    def compute(self):
        return self.total / max(1, self.count)


def bad_datasets(seed: int = 0):
    """Items the model cannot take (5 features for a net built for 6)."""
    return {"train": Pairs(64, 5, seed), "features": 6}

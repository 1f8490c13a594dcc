"""Regression with a mean-squared-error loss and a metric of its own (R²).

    python -m psrpc -cd examples/conf +experiment=regression

`make_datasets` draws a smooth nonlinear function of `features` inputs plus noise
(deterministic from the seed); `make_model` is a small MLP with one output; the loss is
`torch.nn.MSELoss` (from the config, nothing to write); `R2` is the coefficient of
determination on the test split (1 is perfect, 0 is no better than predicting the mean).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import TensorDataset


def make_datasets(features: int = 8, size: int = 8192, test_size: int = 1024,
                  noise: float = 0.1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(features, 16, generator=g) / math.sqrt(features)
    w2 = torch.randn(16, generator=g) / 4

    def draw(n: int) -> TensorDataset:
        x = torch.randn(n, features, generator=g)
        y = torch.tanh(x @ w1) @ w2 + noise * torch.randn(n, generator=g)
        return TensorDataset(x, y.unsqueeze(1))

    return {"train": draw(size), "test": draw(test_size), "features": features}


def make_model(features: int, hidden: int = 64) -> nn.Module:
    return nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                         nn.Tanh(), nn.Linear(hidden, 1))


class R2:
    """1 - SS_res / SS_tot over the test split."""

    name = "r2"
    higher_is_better = True

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.preds: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []

    def update(self, output, target) -> None:
        self.preds.append(output.detach().float().reshape(-1).cpu())
        self.targets.append(target.detach().float().reshape(-1).cpu())

    def compute(self) -> float:
        p, t = torch.cat(self.preds), torch.cat(self.targets)
        return float(1 - ((t - p) ** 2).sum() / ((t - t.mean()) ** 2).sum())

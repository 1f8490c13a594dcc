"""Test-set metrics (`metric=`): what the chief reports as `test_<name>` in the summary, in
metrics.jsonl and TensorBoard, and what `checkpoint.best` keeps the best model by.

A metric is any object with `update(output, target)` (one batch), `compute()` (a float, or a dict
of floats for several values) and `reset()`, plus `name` and `higher_is_better` — the
torchmetrics protocol, so `metric._target_=torchmetrics.classification.MulticlassAccuracy
metric.num_classes=10` works as well as these.
"""

from __future__ import annotations

import math

import torch


class Metric:
    name = "metric"
    higher_is_better = True

    def reset(self) -> None:
        raise NotImplementedError

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        raise NotImplementedError

    def compute(self):
        raise NotImplementedError


class Accuracy(Metric):
    """Fraction of samples whose highest-scoring class (dim 1) is the target."""

    name = "accuracy"

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.correct, self.total = 0, 0

    def update(self, output, target) -> None:
        self.correct += int((output.argmax(1) == target).sum())
        self.total += target.numel()

    def compute(self) -> float:
        return self.correct / max(1, self.total)


class MeanSquaredError(Metric):
    name = "mse"
    higher_is_better = False

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.sum, self.count = 0.0, 0

    def update(self, output, target) -> None:
        self.sum += float(((output.reshape(target.shape) - target) ** 2).sum())
        self.count += target.numel()

    def compute(self) -> float:
        return self.sum / max(1, self.count)


class AUCLogLoss(Metric):
    """Binary click prediction: ROC AUC (the probability that a random positive scores above a
    random negative, ties counting half) and log loss, from logits. `compute()` gives both:
    the summary reports `test_auc` and `test_logloss`; `auc` is the one `checkpoint.best` uses."""

    name = "auc"

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.logits: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []

    def update(self, output, target) -> None:
        self.logits.append(output.detach().reshape(-1).float().cpu())
        self.labels.append(target.detach().reshape(-1).float().cpu())

    def compute(self) -> dict:
        logits, labels = torch.cat(self.logits), torch.cat(self.labels)
        logloss = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels))
        return {"auc": roc_auc(logits, labels), "logloss": logloss}


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Mann-Whitney U over average ranks (ties get their mean rank); NaN with one class only."""
    n = scores.numel()
    pos = float(labels.sum())
    neg = n - pos
    if pos == 0 or neg == 0:
        return math.nan
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty(n, dtype=torch.float64)
    ranks[order] = torch.arange(1, n + 1, dtype=torch.float64)
    # average the ranks of tied scores
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True,
                                                  return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    mean_rank = ends - (counts.double() - 1) / 2
    ranks[order] = mean_rank[inverse]
    return float((ranks[labels > 0.5].sum() - pos * (pos + 1) / 2) / (pos * neg))

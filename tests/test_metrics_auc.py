"""psrpc.metrics.roc_auc and AUCLogLoss against a brute-force pairwise AUC, ties included."""

from __future__ import annotations

import math

import pytest
import torch

from psrpc.metrics import AUCLogLoss, roc_auc


def pairwise_auc(scores, labels) -> float:
    """P(score of a random positive > score of a random negative), ties counting half: every
    (positive, negative) pair, one by one."""
    pos = [s for s, y in zip(scores.tolist(), labels.tolist()) if y > 0.5]
    neg = [s for s, y in zip(scores.tolist(), labels.tolist()) if y <= 0.5]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("levels", [2, 5, 1000])  # few score values: many ties
def test_roc_auc_equals_pairwise(seed, levels):
    g = torch.Generator().manual_seed(seed)
    n = 60 + seed * 7
    labels = (torch.rand(n, generator=g) < 0.3 + 0.05 * seed).float()
    labels[0], labels[1] = 0.0, 1.0  # both classes present
    scores = torch.randint(levels, (n,), generator=g).float() / levels + 0.2 * labels
    assert roc_auc(scores, labels) == pytest.approx(pairwise_auc(scores, labels), abs=1e-12)


def test_roc_auc_edge_cases():
    y = torch.tensor([0.0, 1.0, 0.0, 1.0])
    assert roc_auc(torch.tensor([0.1, 0.9, 0.2, 0.8]), y) == 1.0
    assert roc_auc(torch.tensor([0.9, 0.1, 0.8, 0.2]), y) == 0.0
    assert roc_auc(torch.full((4,), 0.3), y) == 0.5  # all tied
    signed_zero = torch.tensor([0.0, -0.0, 1.0, 1.0])  # -0.0 ties with 0.0
    assert roc_auc(signed_zero, y) == pairwise_auc(signed_zero, y) == 0.5
    assert roc_auc(torch.tensor([1, 3, 2, 3]), y.long()) == 1.0  # integer scores and labels
    assert roc_auc(torch.tensor([1.0, 3.0]), torch.tensor([False, True])) == 1.0
    assert math.isnan(roc_auc(torch.tensor([0.2, 0.4]), torch.tensor([1.0, 1.0])))
    assert math.isnan(roc_auc(torch.tensor([0.2, 0.4]), torch.tensor([0.0, 0.0])))
    assert math.isnan(roc_auc(torch.tensor([]), torch.tensor([])))


def test_auc_logloss_accumulates_batches():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(100, generator=g)
    labels = (torch.rand(100, generator=g) < torch.sigmoid(logits)).float()
    metric = AUCLogLoss()
    for chunk in range(0, 100, 30):  # batches as (B, 1) outputs, as a model may give them
        metric.update(logits[chunk:chunk + 30].unsqueeze(1), labels[chunk:chunk + 30])
    got = metric.compute()
    assert got["auc"] == pytest.approx(pairwise_auc(logits, labels), abs=1e-12)
    want_logloss = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels))
    assert got["logloss"] == pytest.approx(want_logloss, rel=1e-6)
    assert metric.name == "auc" and metric.higher_is_better
    metric.reset()
    metric.update(torch.tensor([2.0, -2.0]), torch.tensor([1.0, 0.0]))
    assert metric.compute()["auc"] == 1.0

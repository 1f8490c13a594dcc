"""psrpc.sparse.optim: each row-sparse optimizer against a straightforward dense reference on the
rows it touches; untouched rows and their state unchanged; state_dict round trip."""

from __future__ import annotations

import math

import pytest
import torch

from psrpc.sparse.optim import (SPARSE_OPTIMIZERS, LazyAdam, RowOptimizer, RowSGD, RowWiseAdagrad,
                                build_sparse_optimizer)

R, DIM = 12, 5
# (rows, lr) per step: overlapping sets, an unsorted one, and one with no rows at all
STEPS = [([1, 4, 7], 0.1), ([4, 5, 9, 11], 0.05), ([9, 1, 0], 0.1), ([], 0.1), ([4, 7], 0.2)]


def schedule(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.tensor(rows, dtype=torch.int64), torch.randn(len(rows), DIM, generator=g), lr)
            for rows, lr in STEPS]


def start_weight():
    return torch.randn(R, DIM, generator=torch.Generator().manual_seed(1))


def ref_sgd(w, steps, weight_decay=0.0):
    w = w.double()
    for rows, grads, lr in steps:
        for r, g in zip(rows.tolist(), grads.double()):
            w[r] = w[r] - lr * (g + weight_decay * w[r])
    return w, {}


def ref_adagrad(w, steps, eps=1e-8, weight_decay=0.0):
    w, acc = w.double(), torch.zeros(R, dtype=torch.float64)
    for rows, grads, lr in steps:
        for r, g in zip(rows.tolist(), grads.double()):
            g = g + weight_decay * w[r]
            acc[r] = acc[r] + (g ** 2).mean()
            w[r] = w[r] - lr * g / (math.sqrt(acc[r]) + eps)
    return w, {"sum": acc}


def ref_adam(w, steps, betas=(0.9, 0.999), eps=1e-8):
    """Adam restricted to the touched rows, with the step count of the whole table (every call,
    as torch.optim.SparseAdam counts it) and SparseAdam's eps placement: sqrt(v) + eps."""
    b1, b2 = betas
    w, m, v = w.double(), torch.zeros(R, DIM, dtype=torch.float64), torch.zeros(R, DIM,
                                                                              dtype=torch.float64)
    for t, (rows, grads, lr) in enumerate(steps, start=1):
        for r, g in zip(rows.tolist(), grads.double()):
            m[r] = b1 * m[r] + (1 - b1) * g
            v[r] = b2 * v[r] + (1 - b2) * g * g
            w[r] = w[r] - lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) * m[r] / (v[r].sqrt() + eps)
    return w, {"exp_avg": m, "exp_avg_sq": v}


CASES = [
    ("sgd", {}, ref_sgd),
    ("sgd", {"weight_decay": 0.1}, lambda w, s: ref_sgd(w, s, weight_decay=0.1)),
    ("adagrad", {}, ref_adagrad),
    ("adagrad", {"weight_decay": 0.05}, lambda w, s: ref_adagrad(w, s, weight_decay=0.05)),
    ("adam", {}, ref_adam),
    ("adam", {"betas": (0.8, 0.99), "eps": 1e-6},
     lambda w, s: ref_adam(w, s, betas=(0.8, 0.99), eps=1e-6)),
]


@pytest.mark.parametrize("name,hyper,reference", CASES)
def test_matches_dense_reference_on_touched_rows(name, hyper, reference):
    steps = schedule()
    weight = start_weight()
    opt = build_sparse_optimizer(name, weight, **hyper)
    for rows, grads, lr in steps:
        opt.step(rows, grads, lr)
    want_w, want_state = reference(start_weight(), steps)
    torch.testing.assert_close(weight, want_w.float(), rtol=1e-5, atol=1e-6)
    state = opt.state_dict()
    for k, v in want_state.items():
        torch.testing.assert_close(state[k], v.float(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", sorted(SPARSE_OPTIMIZERS))
def test_untouched_rows_and_state_unchanged(name):
    weight = start_weight()
    opt = build_sparse_optimizer(name, weight)
    opt.step(torch.tensor([2, 3]), torch.randn(2, DIM), 0.1)  # some state on rows 2, 3
    before_w = weight.clone()
    before_state = {k: v.clone() for k, v in opt.state_dict().items()
                    if k in opt.per_row_state}
    opt.step(torch.tensor([3, 8]), torch.randn(2, DIM), 0.1)
    untouched = [r for r in range(R) if r not in (3, 8)]
    assert torch.equal(weight[untouched], before_w[untouched])
    assert not torch.equal(weight[[3, 8]], before_w[[3, 8]])
    for k, v in before_state.items():
        assert torch.equal(opt.state_dict()[k][untouched], v[untouched]), k


def test_lazy_adam_equals_torch_sparse_adam():
    """Bit for bit: the same operations as torch.optim.SparseAdam on a sparse gradient of the
    same rows (including a step whose gradient has no rows)."""
    steps = schedule(3)
    weight = start_weight()
    ours = LazyAdam(weight, betas=(0.85, 0.995), eps=1e-7)
    param = torch.nn.Parameter(start_weight())
    theirs = torch.optim.SparseAdam([param], lr=1.0, betas=(0.85, 0.995), eps=1e-7)
    for rows, grads, lr in steps:
        ours.step(rows, grads, lr)
        theirs.param_groups[0]["lr"] = lr
        param.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), grads, (R, DIM),
                                             check_invariants=True)
        theirs.step()
    assert torch.equal(weight, param.detach())
    assert torch.equal(ours.exp_avg, theirs.state[param]["exp_avg"])
    assert torch.equal(ours.exp_avg_sq, theirs.state[param]["exp_avg_sq"])
    assert ours.step_count == theirs.state[param]["step"] == len(steps)


@pytest.mark.parametrize("name", sorted(SPARSE_OPTIMIZERS))
def test_state_dict_round_trip(name):
    steps = schedule(5)
    a_weight, b_weight = start_weight(), start_weight()
    a = build_sparse_optimizer(name, a_weight)
    for rows, grads, lr in steps[:3]:
        a.step(rows, grads, lr)
    b_weight.copy_(a_weight)
    b = build_sparse_optimizer(name, b_weight)
    saved = {k: v.clone() if torch.is_tensor(v) else v for k, v in a.state_dict().items()}
    for k in a.per_row_state:
        assert saved[k].shape[0] == R  # reshards by rows, like the weight
    b.load_state_dict(saved)
    for rows, grads, lr in steps[3:]:
        a.step(rows, grads, lr)
        b.step(rows, grads, lr)
    assert torch.equal(a_weight, b_weight)


def test_per_row_state_declared():
    assert RowSGD.per_row_state == ()
    assert RowWiseAdagrad.per_row_state == ("sum",)
    assert LazyAdam.per_row_state == ("exp_avg", "exp_avg_sq")
    assert LazyAdam.scalar_state == ("step_count",)
    assert all(issubclass(c, RowOptimizer) for c in SPARSE_OPTIMIZERS.values())


def test_fbgemm_defaults():
    opt = RowWiseAdagrad(torch.zeros(3, 2))
    assert opt.eps == 1e-8 and torch.equal(opt.sum, torch.zeros(3))


def test_errors():
    weight = start_weight()
    with pytest.raises(ValueError, match=r"'rmsprop'.*\['adagrad', 'adam', 'sgd'\]"):
        build_sparse_optimizer("rmsprop", weight)
    with pytest.raises(ValueError, match="momentum.*weight_decay"):
        build_sparse_optimizer("sgd", weight, momentum=0.9)
    opt = RowSGD(weight)
    with pytest.raises(ValueError, match="unique"):
        opt.step(torch.tensor([3, 1, 3]), torch.zeros(3, DIM), 0.1)
    with pytest.raises(ValueError, match=r"\[0, 12\)"):
        opt.step(torch.tensor([12]), torch.zeros(1, DIM), 0.1)
    with pytest.raises(ValueError, match=r"grads must be \(2, 5\)"):
        opt.step(torch.tensor([0, 1]), torch.zeros(2, DIM + 1), 0.1)
    with pytest.raises(ValueError, match="keys"):
        RowWiseAdagrad(weight).load_state_dict({})
    with pytest.raises(ValueError, match="shape"):
        RowWiseAdagrad(weight).load_state_dict({"sum": torch.zeros(R + 1)})

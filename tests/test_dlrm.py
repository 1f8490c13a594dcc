"""psrpc.recsys.dlrm: shapes, the interaction, gradients to used rows only, checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psrpc.recsys.dlrm import DLRM, make_dlrm
from psrpc.sparse.tables import EmbeddingTables

TABLES = [{"name": "user", "num_rows": 20}, {"name": "item", "num_rows": 30},
          {"name": "genres", "num_rows": 6, "pooling": "mean"},
          {"name": "zip", "num_rows": 64, "hash_size": 64}]


def batch(b=5, num_dense=3):
    g = torch.Generator().manual_seed(0)
    return {"dense": torch.randn(b, num_dense, generator=g),
            "user": torch.randint(20, (b,), generator=g),
            "item": torch.randint(30, (b,), generator=g),
            "genres": torch.tensor([[1, 2, -1], [3, -1, -1], [-1, -1, -1], [5, 5, 0],
                                    [4, 1, 2]])[:b],
            "zip": torch.randint(-10**12, 10**12, (b,), generator=g)}


def test_shapes_and_interaction_size():
    model = make_dlrm(3, TABLES, bottom=[8, 4], top=[16], dim=4)
    out = model(batch())
    assert out.shape == (5,) and out.dtype == torch.float32
    # 1 dense vector + 4 embeddings = 5 vectors, 10 pairs, plus the dense vector itself (4)
    assert model.top[0].in_features == 10 + 4
    assert isinstance(model.tables, EmbeddingTables)
    loss = nn.BCEWithLogitsLoss()(out, torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0]))
    assert torch.isfinite(loss)


def test_interaction_is_the_pairwise_dot_products():
    model = make_dlrm(2, TABLES[:2], bottom=[4], top=[], dim=4)
    x = batch(num_dense=2)
    top = model.top[0]  # top=[]: the top MLP is one Linear to the logit
    z = model.bottom(x["dense"])
    e = model.tables(x)
    vectors = [z, e["user"], e["item"]]
    dots = [(vectors[i] * vectors[j]).sum(1) for i in range(3) for j in range(i + 1, 3)]
    want = top(torch.cat([z, torch.stack(dots, 1)], 1)).squeeze(1)
    torch.testing.assert_close(model(x), want)


def test_gradients_reach_used_rows_only():
    model = make_dlrm(3, TABLES, bottom=[8, 4], top=[16], dim=4)
    x = batch()
    model(x).sum().backward()
    for name in ("user", "item", "genres"):
        grad = model.tables.bags[name].weight.grad
        used = set(x[name][x[name] >= 0].tolist())
        touched = set(torch.nonzero(grad.abs().sum(1)).flatten().tolist())
        assert touched and touched <= used, name
    assert all(p.grad is not None for p in model.top.parameters())
    assert all(p.grad is not None for p in model.bottom.parameters())


def test_no_dense_features():
    model = make_dlrm(0, TABLES, top=[8], dim=4)
    x = batch()
    del x["dense"]
    assert model(x).shape == (5,)
    assert model.bottom is None and model.top[0].in_features == 6  # 4 embeddings: 6 pairs
    with pytest.raises(ValueError, match="at least two tables"):
        make_dlrm(0, TABLES[:1])


def test_deterministic_and_seeded():
    a, b = make_dlrm(3, TABLES, seed=1), make_dlrm(3, TABLES, seed=1)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    c = make_dlrm(3, TABLES, seed=2).state_dict()
    assert not torch.equal(sa["top.0.weight"], c["top.0.weight"])
    rng = torch.get_rng_state()
    make_dlrm(3, TABLES)
    assert torch.equal(rng, torch.get_rng_state())  # the caller's RNG is untouched


def test_tables_can_be_replaced():
    local = make_dlrm(3, TABLES, bottom=[8, 4], top=[16], dim=4, seed=5)
    swapped = DLRM(3, local.specs, [8, 4], [16], seed=5,
                   tables=EmbeddingTables(local.specs, seed=5, sparse_grad=True))
    torch.testing.assert_close(swapped(batch()), local(batch()))  # same MLPs, same tables


def test_checks():
    with pytest.raises(ValueError, match=r"last width \(32.*embedding dim \(16\)"):
        make_dlrm(3, TABLES, bottom=[64, 32], dim=16)
    with pytest.raises(ValueError, match="keys must be"):
        make_dlrm(3, [{"name": "user", "num_rows": 20, "size": 3}])
    with pytest.raises(ValueError, match="hash_size=10 must equal num_rows=20"):
        make_dlrm(3, [{"name": "user", "num_rows": 20, "hash_size": 10}])

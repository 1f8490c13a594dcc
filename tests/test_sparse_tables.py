"""psrpc.sparse.tables: bags with padding, sum/mean pooling, hashing, initial values."""

from __future__ import annotations

import pytest
import torch

from psrpc.sparse.rows import Partition, TableSpec, hash_ids, init_rows, table_seed
from psrpc.sparse.tables import EmbeddingTables, bag_inputs


def test_bag_inputs():
    flat, offsets = bag_inputs(torch.tensor([3, 1, 4]))
    assert flat.tolist() == [3, 1, 4] and offsets.tolist() == [0, 1, 2]
    flat, offsets = bag_inputs(torch.tensor([[3, 1], [4, 1]]))
    assert flat.tolist() == [3, 1, 4, 1] and offsets.tolist() == [0, 2]
    flat, offsets = bag_inputs(torch.tensor([[5, -1, -1], [-1, -1, -1], [2, 7, -1], [1, 1, 1]]))
    assert flat.tolist() == [5, 2, 7, 1, 1, 1] and offsets.tolist() == [0, 1, 1, 3]
    flat, offsets = bag_inputs(torch.tensor([4, -1, 2]))  # a missing single value: empty bag
    assert flat.tolist() == [4, 2] and offsets.tolist() == [0, 1, 1]
    with pytest.raises(ValueError, match="shape"):
        bag_inputs(torch.zeros(2, 2, 2, dtype=torch.int64))


def by_hand(weight, rows_per_bag, mode):
    out = []
    for rows in rows_per_bag:
        if not rows:
            out.append(torch.zeros(weight.shape[1]))
        else:
            s = sum(weight[r] for r in rows)
            out.append(s / len(rows) if mode == "mean" else s)
    return torch.stack(out)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_pooling_with_padding_equals_hand_computation(pooling):
    tables = EmbeddingTables([TableSpec("genre", 6, 4, pooling=pooling)])
    ids = torch.tensor([[1, 3, -1], [-1, -1, -1], [5, 5, 0], [2, -1, -1]])
    got = tables({"genre": ids})["genre"]
    weight = tables.bags["genre"].weight.detach()
    want = by_hand(weight, [[1, 3], [], [5, 5, 0], [2]], pooling)
    torch.testing.assert_close(got, want)


def test_single_valued_equals_multi_valued_of_length_one():
    tables = EmbeddingTables([TableSpec("user", 10, 3), TableSpec("item", 7, 3, pooling="mean")])
    single = {"user": torch.tensor([4, 0, 9]), "item": torch.tensor([6, 1, 1]), "dense": None}
    multi = {"user": torch.tensor([[4], [0], [9]]), "item": torch.tensor([[6, -1], [1, -1],
                                                                          [-1, 1]])}
    a, b = tables(single), tables(multi)
    assert sorted(a) == ["item", "user"]
    for k in a:
        torch.testing.assert_close(a[k], b[k])
        assert a[k].shape == (3, 3)
    torch.testing.assert_close(a["user"], tables.bags["user"].weight.detach()[[4, 0, 9]])


def test_initial_values_are_init_rows_in_any_partition():
    spec = TableSpec("item", 50, 8)
    weight = EmbeddingTables([spec], seed=3).bags["item"].weight.detach()
    seed = table_seed(3, "item")
    for k, strategy in ((1, "mod"), (2, "div")):
        rows = Partition(50, 3, strategy).global_rows(k)
        assert torch.equal(weight[rows], init_rows(rows, 8, seed, spec.init_scale))
    # tables are seeded by name, not position
    other = EmbeddingTables([TableSpec("user", 9, 8), spec], seed=3).bags["item"].weight
    assert torch.equal(other.detach(), weight)


def test_hashed_table():
    spec = TableSpec("c1", 16, 2, hash_size=16)
    tables = EmbeddingTables([spec])
    raw = torch.tensor([[123456789012, -5, -1], [7, -1, -1]])
    got = tables({"c1": raw})["c1"]
    weight = tables.bags["c1"].weight.detach()
    rows = hash_ids(torch.tensor([123456789012, -5, 7]), 16).tolist()
    torch.testing.assert_close(got, by_hand(weight, [rows[:2], rows[2:]], "sum"))


def test_sparse_gradients_touch_used_rows_only():
    tables = EmbeddingTables([TableSpec("user", 10, 3)], sparse_grad=True)
    tables({"user": torch.tensor([[2, 7], [7, -1]])})["user"].sum().backward()
    grad = tables.bags["user"].weight.grad.coalesce()
    assert grad.is_sparse and grad.indices().flatten().tolist() == [2, 7]
    assert grad.values().tolist() == [[1.0] * 3, [2.0] * 3]


def test_errors():
    with pytest.raises(ValueError, match="unique"):
        EmbeddingTables([TableSpec("a", 2, 2), TableSpec("a", 3, 2)])
    tables = EmbeddingTables([TableSpec("a", 2, 2)])
    with pytest.raises(KeyError, match="'a'"):
        tables({"b": torch.tensor([0])})
    with pytest.raises(ValueError, match=r"'a'.*\[0, 2\)"):
        tables({"a": torch.tensor([2])})


class _CountingRows:
    """A RowClient stand-in for the remote form: each row's value is its id, and every pull is
    counted (what the worker's RowClient does over RPC is tested in test_sparse_cluster)."""

    def __init__(self, dim: int):
        self.dim, self.pulled = dim, []

    def pull(self, rows: dict) -> dict:
        self.pulled.append({n: r.clone() for n, r in rows.items()})
        return {n: r.double().unsqueeze(1).expand(-1, self.dim).float().clone()
                for n, r in rows.items()}


def test_rows_for_work_is_reused_by_the_forward_and_redone_after_a_change():
    """The worker asks `rows_for` the next batch before its forward: the forward then reuses
    the lookups it worked out (the same unique rows), gives what a fresh forward gives, and
    works them out anew once a feature tensor of the batch changed in place."""
    from psrpc.sparse import tables as tables_mod

    with tables_mod.remote_tables():
        remote = EmbeddingTables([TableSpec("a", 50, 4, pooling="mean")])
    rows = _CountingRows(4)
    remote.bind(rows)
    batch = {"a": torch.tensor([[3, 7, -1], [7, 7, 9]])}
    ahead = remote.rows_for(batch)
    assert torch.equal(ahead["a"], torch.tensor([3, 7, 9]))
    kept = remote._prepared[0][2]["a"]
    out = remote(batch)["a"]
    assert remote._prepared == []  # taken by the forward
    assert torch.allclose(out, torch.tensor([[5.0] * 4, [23 / 3] * 4]))
    remote.rows_for(batch)
    assert remote._prepared[0][2]["a"][1] is not kept[1]  # a new batch's work: not the old one
    batch["a"][1, 2] = 11  # in place: what rows_for saw is stale
    out = remote(batch)["a"]
    assert torch.equal(rows.pulled[-1]["a"], torch.tensor([3, 7, 11]))
    assert torch.allclose(out, torch.tensor([[5.0] * 4, [25 / 3] * 4]))

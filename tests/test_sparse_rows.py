"""psrpc.sparse.rows: hashing, partitioning, initial values, coalescing (no RPC)."""

from __future__ import annotations

import pytest
import torch

from psrpc.sparse.rows import (Partition, TableSpec, coalesce, hash64, hash_ids, init_rows,
                               table_seed)

M = 1 << 64


def splitmix64_first(seed: int) -> int:
    """The first output of splitmix64 seeded with `seed`, in Python's exact integers."""
    z = (seed + 0x9E3779B97F4A7C15) % M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % M
    return z ^ (z >> 31)


EDGE_IDS = [0, 1, -1, 2, 12345678901, -987654321, (1 << 63) - 1, -(1 << 63)]


def test_hash64_is_splitmix64():
    assert splitmix64_first(0) == 0xE220A8397B1DCDAF  # the published first output for seed 0
    got = hash64(torch.tensor(EDGE_IDS)).tolist()
    assert [g % M for g in got] == [splitmix64_first(i % M) for i in EDGE_IDS]


def test_hash_ids_range_determinism_and_salt():
    ids = torch.cat([torch.tensor(EDGE_IDS), torch.randint(-(1 << 62), 1 << 62, (5000,))])
    for size in (1, 7, 1000, (1 << 40) + 3):
        h = hash_ids(ids, size)
        assert h.dtype == torch.int64 and int(h.min()) >= 0 and int(h.max()) < size
        assert torch.equal(h, hash_ids(ids.clone(), size))
    assert not torch.equal(hash_ids(ids, 1000, salt=1), hash_ids(ids, 1000, salt=0))
    # roughly uniform: 20000 consecutive ids into 10 buckets
    counts = torch.bincount(hash_ids(torch.arange(20000), 10), minlength=10)
    assert int(counts.min()) > 1800 and int(counts.max()) < 2200
    with pytest.raises(ValueError, match="size"):
        hash_ids(ids, 0)


def test_hash_ids_known_values():
    """Pinned values: a change here changes every hashed table of every saved model."""
    got = hash_ids(torch.tensor([0, 1, -1, 1 << 40]), 1000).tolist()
    want = [(splitmix64_first(i % M) >> 1) % 1000 for i in (0, 1, -1, 1 << 40)]
    assert got == want


@pytest.mark.parametrize("strategy", ["mod", "div"])
@pytest.mark.parametrize("num_rows,num_ps", [(10, 3), (9, 3), (2, 5), (1, 1), (101, 4)])
def test_every_row_has_exactly_one_home(strategy, num_rows, num_ps):
    part = Partition(num_rows, num_ps, strategy)
    rows = torch.arange(num_rows)
    server, local = part.owner(rows)
    assert sum(part.rows_on(k) for k in range(num_ps)) == num_rows
    seen = torch.zeros(num_rows, dtype=torch.int64)
    for k in range(num_ps):
        g = part.global_rows(k)
        assert g.numel() == part.rows_on(k)
        seen[g] += 1
        # global_rows is in local order, and owner agrees with it
        assert torch.equal(server[g], torch.full_like(g, k))
        assert torch.equal(local[g], torch.arange(g.numel()))
    assert torch.equal(seen, torch.ones_like(seen))


def test_mod_layout():
    part = Partition(10, 3, "mod")
    server, local = part.owner(torch.arange(10))
    assert server.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    assert local.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert [part.rows_on(k) for k in range(3)] == [4, 3, 3]


def test_div_is_tensorflows():
    """TF's div: the first num_rows % P partitions hold one id more, contiguous ranges."""
    part = Partition(10, 3, "div")
    assert [part.rows_on(k) for k in range(3)] == [4, 3, 3]
    server, local = part.owner(torch.arange(10))
    assert server.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert local.tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2]
    assert [Partition(11, 4, "div").rows_on(k) for k in range(4)] == [3, 3, 3, 2]
    assert [Partition(2, 5, "div").rows_on(k) for k in range(5)] == [1, 1, 0, 0, 0]
    # TF's closed form: partition = max(id // (q + 1), (id - extras) // q)
    n, p = 1003, 7
    q, extras = divmod(n, p)
    ids = torch.arange(n)
    tf = torch.maximum(ids // (q + 1), (ids - extras) // q)
    assert torch.equal(Partition(n, p, "div").owner(ids)[0], tf)


@pytest.mark.parametrize("strategy", ["mod", "div"])
def test_split_round_trip(strategy):
    part = Partition(50, 3, strategy)
    ids = torch.tensor([49, 0, 7, 7, 23, 1, 48, 30, 0])
    pieces = part.split(ids)
    assert len(pieces) == 3
    covered = torch.cat([pos for pos, _ in pieces]).sort().values
    assert torch.equal(covered, torch.arange(ids.numel()))
    for k, (pos, local) in enumerate(pieces):
        assert torch.equal(pos, pos.sort().values)
        assert torch.equal(part.global_rows(k)[local], ids[pos])  # back to the global ids


def test_partition_errors():
    with pytest.raises(ValueError, match="'hash'.*mod"):
        Partition(10, 2, "hash")
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        Partition(10, 2).owner(torch.tensor([3, 10]))
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        Partition(10, 2, "div").owner(torch.tensor([-1]))
    with pytest.raises(ValueError, match="server 2"):
        Partition(10, 2).global_rows(2)


def test_init_independent_of_partition_and_order():
    n, dim, seed, scale = 97, 8, table_seed(0, "user"), 0.05
    full = init_rows(torch.arange(n), dim, seed, scale)
    assert full.shape == (n, dim) and full.dtype == torch.float32
    assert float(full.abs().max()) < scale and float(full.std()) > scale / 3
    for strategy in ("mod", "div"):
        part = Partition(n, 3, strategy)
        for k in range(3):
            g = part.global_rows(k)
            assert torch.equal(init_rows(g, dim, seed, scale), full[g])
    perm = torch.randperm(n)
    assert torch.equal(init_rows(perm, dim, seed, scale), full[perm])
    # a narrower table is the first columns of a wider one
    assert torch.equal(init_rows(torch.arange(n), 3, seed, scale), full[:, :3])
    assert not torch.equal(init_rows(torch.arange(n), dim, seed + 1, scale), full)


def test_init_chunks_do_not_matter(monkeypatch):
    import psrpc.sparse.rows as rows_module

    rows = torch.arange(1000) * 7919
    whole = init_rows(rows, 16, 5, 1.0)
    monkeypatch.setattr(rows_module, "INIT_CHUNK", 48)  # 3 rows per chunk
    assert torch.equal(init_rows(rows, 16, 5, 1.0), whole)


def test_init_pinned_and_huge_rows():
    v = init_rows(torch.tensor([0, (1 << 40) + 1]), 4, 0, 1.0)
    assert torch.isfinite(v).all() and v.abs().max() < 1
    # element (row, col) from hash64(row << 16 | col): top 24 bits, signed, centred
    h = hash64(torch.tensor([(1 << 40) + 1 << 16 | 3]))
    assert float(v[1, 3]) == pytest.approx((int(h >> 40) + 0.5) / (1 << 23), abs=1e-7)
    with pytest.raises(ValueError, match="dim"):
        init_rows(torch.arange(3), 0, 0, 1.0)


def test_table_seed_stable_and_distinct():
    assert table_seed(0, "user") == table_seed(0, "user")
    assert len({table_seed(0, "user"), table_seed(0, "item"), table_seed(1, "user")}) == 3


def test_table_spec_checks_and_rows():
    with pytest.raises(ValueError, match="pooling"):
        TableSpec("t", 10, 4, pooling="max")
    with pytest.raises(ValueError, match="hash_size=8 must equal num_rows=10"):
        TableSpec("t", 10, 4, hash_size=8)
    with pytest.raises(ValueError, match=r"'t'.*\[0, 10\)"):
        TableSpec("t", 10, 4).rows(torch.tensor([10]))
    hashed = TableSpec("h", 10, 4, hash_size=10).rows(torch.tensor([-5, 1 << 50]))
    assert int(hashed.min()) >= 0 and int(hashed.max()) < 10
    assert TableSpec("t", 100, 4).init_scale == pytest.approx(0.1)


def test_coalesce():
    ids = torch.tensor([5, 2, 5, 9, 2, 5])
    grads = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    unique, summed = coalesce(ids, grads)
    assert unique.tolist() == [2, 5, 9]
    assert summed.tolist() == [[2 + 8, 3 + 9], [0 + 4 + 10, 1 + 5 + 11], [6, 7]]
    unique, summed = coalesce(torch.tensor([], dtype=torch.int64), torch.zeros(0, 3))
    assert unique.numel() == 0 and summed.shape == (0, 3)

"""The sharding plan: greedy by bytes, dim-0 splits, and the flat round trip (no RPC)."""

import torch

from psrpc.cluster.layout import Layout

SHAPES = {"a.weight": (100, 10), "a.bias": (100,), "b.weight": (10, 100), "b.bias": (10,),
          "c.weight": (300, 10)}


def test_greedy_by_bytes_emptiest_takes_next_largest():
    layout = Layout.plan(SHAPES, 2, max_shard_bytes=10**9)
    where = {p.name: p.shard for p in layout.pieces}
    # c (3000) -> ps0; a.weight (1000) -> ps1; b.weight (1000) -> ps1; a.bias (100) -> ps1 ...
    assert where["c.weight"] == 0
    assert where["a.weight"] == 1 and where["b.weight"] == 1
    assert sum(p.numel for p in layout.pieces) == sum(torch.Size(s).numel() for s in SHAPES.values())
    assert not layout.split_names


def test_pieces_and_shards_aligned():
    """Vectorised kernels round an element by its position in the vector: aligned offsets make
    the number of PS change no bit of the result."""
    from psrpc.cluster.layout import ALIGN

    layout = Layout.plan(SHAPES, 3, max_shard_bytes=4000)
    assert all(p.offset % ALIGN == 0 for p in layout.pieces)
    assert all(n % ALIGN == 0 for n in layout.shard_numel)
    flats = layout.split({n: torch.ones(s) for n, s in SHAPES.items()})
    assert sum(int(f.sum()) for f in flats) == sum(p.numel for p in layout.pieces)  # zero padding


def test_large_tensor_split_along_dim0_across_ps():
    layout = Layout.plan(SHAPES, 3, max_shard_bytes=4000)  # c.weight is 12000 bytes
    pieces = layout.pieces_for("c.weight")
    assert len(pieces) == 3
    assert sorted((p.row_start, p.row_end) for p in pieces) == [(0, 100), (100, 200), (200, 300)]
    assert len({p.shard for p in pieces}) == 3  # each piece on a different PS
    assert layout.split_names == {"c.weight"}


def test_split_join_round_trip_and_dict_form():
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    for num_shards, max_bytes in [(1, 10**9), (2, 10**9), (3, 1000), (4, 400)]:
        layout = Layout.plan(SHAPES, num_shards, max_bytes)
        flats = layout.split(tensors)
        assert [f.numel() for f in flats] == list(layout.shard_numel)
        back = Layout.from_dict(layout.to_dict()).join(flats)
        assert list(back) == list(SHAPES)  # model order
        for n in SHAPES:
            assert torch.equal(back[n], tensors[n])


def test_plan_is_deterministic():
    assert Layout.plan(SHAPES, 3, 1000) == Layout.plan(dict(SHAPES), 3, 1000)


def test_more_ps_than_tensors_leaves_the_extra_ps_without_a_shard():
    """5 tensors on 8 PS: 5 shards, none empty (an empty shard is never pushed: the worker's
    hooks fire per parameter), each on its own PS; split and join still round-trip."""
    layout = Layout.plan(SHAPES, 8, max_shard_bytes=10**9)
    assert layout.num_shards == len(SHAPES) and all(n > 0 for n in layout.shard_numel)
    assert sorted(layout.shard_ps) == list(range(len(SHAPES)))
    tensors = {n: torch.randn(s) for n, s in SHAPES.items()}
    back = layout.join(layout.split(tensors))
    assert all(torch.equal(back[n], tensors[n]) for n in SHAPES)
    # the same with pieces: 3 pieces of c.weight + 4 others = 7 shards on 9 PS
    split = Layout.plan(SHAPES, 9, max_shard_bytes=4000)
    assert split.num_shards == 7 and all(n > 0 for n in split.shard_numel)

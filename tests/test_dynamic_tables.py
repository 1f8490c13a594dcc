"""Dynamic tables, piece by piece, without RPC: the id map, admission, eviction, checkpoints of
one table, serving lookups, and a table shard that refuses malformed pushes."""

import copy
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

from psrpc.errors import PushRejected
from psrpc.ps.tables import TableShard, TableShardSpec
from psrpc.sparse import DynamicBag, HashPartition, TableSpec, init_ids, table_seed
from psrpc.sparse.dynamic import DynamicTables
from psrpc.sparse.idmap import IdMap
from tests.unit_helpers import sgd, sync

SPEC = TableSpec("user", 1000, 4, dynamic=True)
ADAGRAD = {"eps": 1e-8, "weight_decay": 0.0}


def ids(*values):
    return torch.tensor(values, dtype=torch.int64)


class One:
    """One dynamic table (SPEC, seed 7), through the servers' DynamicTables."""

    def __init__(self, **kw):
        self.group = DynamicTables([SPEC], {SPEC.name: 7}, "adagrad", ADAGRAD, **kw)
        self.rows = self.group[SPEC.name]

    def __getattr__(self, name):  # rows_live, weight, ...: the table's
        return getattr(self.rows, name)

    @property
    def map(self):
        return self.group.map

    def lookup(self, x):
        return self.group.lookup({SPEC.name: x})[SPEC.name]

    def apply(self, x, grads, counts, step, lr):
        self.group.apply({SPEC.name: (x, grads, counts)}, step, lr)

    def state(self):
        return self.group.state(SPEC.name)

    def load(self, state, take):
        self.group.load(SPEC.name, state, take)

    def export(self):
        return self.group.export(SPEC.name)


def table(**kw):
    return One(**kw)


def apply(t, step, id_list, counts=None, value=1.0):
    x = ids(*id_list)
    c = torch.ones(x.numel(), dtype=torch.int64) if counts is None else ids(*counts)
    t.apply(x, torch.full((x.numel(), SPEC.dim), value), c, step, 0.1)


def test_id_map_matches_a_dict_through_inserts_removals_and_rebuilds():
    rng = np.random.default_rng(0)
    m, ref = IdMap({"v": np.int32}), {}
    for it in range(60):
        batch = rng.integers(-2**62, 2**62, 400)
        batch = np.unique(np.concatenate([batch, np.array(list(ref)[:40], dtype=np.int64)]))
        tags = np.zeros(batch.shape[0], dtype=np.int16)
        pos = m.find(batch, tags)
        for i, p in zip(batch.tolist(), pos.tolist()):
            assert (p >= 0) == (i in ref)
            assert p < 0 or m.columns["v"][p] == ref[i]
        new = batch[pos < 0]
        at = m.insert(new, tags[pos < 0])  # (may rebuild: the columns are new arrays after)
        m.columns["v"][at] = new % 1000
        ref.update({i: i % 1000 for i in new.tolist()})
        if it % 3 == 0:  # tombstones, and rebuilds that clear them
            gone = batch[:150]
            m.remove(m.find(gone, tags[:150]))
            for i in gone.tolist():
                ref.pop(i)
        assert len(m) == len(ref)
    assert m.used <= 0.6 * m.capacity
    # sequential ids (a hash of the id, not its value, places them) and a crowded window
    seq = np.arange(5000, dtype=np.int64)
    zero, one = np.zeros(5000, dtype=np.int16), np.ones(5000, dtype=np.int16)
    m2 = IdMap({})
    m2.insert(seq, zero)
    assert (m2.find(seq, zero) >= 0).all() and (m2.find(seq + 5000, zero) < 0).all()
    assert (m2.find(seq, one) < 0).all()  # the same ids of another table are other keys
    m2.insert(seq, one)
    assert len(m2) == 10000 and len(set(m2.find(seq, zero)) & set(m2.find(seq, one))) == 0


def test_rows_start_from_a_hash_of_the_id_and_unknown_ids_create_nothing():
    t = table()
    x = ids(5, -3, 2**50)
    assert torch.equal(t.lookup(x), init_ids(x, SPEC.dim, 7, SPEC.init_scale))
    assert t.rows_live == 0 and len(t.map) == 0
    apply(t, 0, [5])
    assert t.rows_live == t.rows_created == 1
    assert not torch.equal(t.lookup(ids(5)), init_ids(ids(5), SPEC.dim, 7, SPEC.init_scale))
    # the same id on another server (another partition) starts from the same values
    spread = HashPartition(3).owner(torch.arange(3000))[0].bincount(minlength=3)
    assert spread.min() > 900  # sequential ids spread: the hash of the id, not its value


def test_admission_drops_gradients_until_an_id_has_been_seen_n_times():
    t = table(admit_after=3)
    start = t.lookup(ids(9))
    apply(t, 0, [9])  # seen once
    apply(t, 1, [9])  # twice: still no row, its gradient dropped
    assert t.rows_live == 0 and torch.equal(t.lookup(ids(9)), start)
    apply(t, 2, [9])  # three times: a row, from its initial value, then this round's gradient
    assert t.rows_live == 1
    ref = table()
    apply(ref, 0, [9])
    assert torch.equal(t.lookup(ids(9)), ref.lookup(ids(9)))
    u = table(admit_after=3)
    apply(u, 0, [9], counts=[3])  # counts are samples: three in one batch admit at once
    assert u.rows_live == 1


def test_ttl_evicts_ids_not_trained_on_and_they_come_back_from_their_initial_value():
    t = table(evict="ttl", ttl_steps=3)
    apply(t, 0, [1, 2])
    for step in (1, 2):
        apply(t, step, [2])
    assert t.rows_live == 2
    apply(t, 3, [2])  # id 1 last trained at step 0: 3 steps without training
    assert t.rows_live == 1 and t.rows_evicted == 1
    assert torch.equal(t.lookup(ids(1)), init_ids(ids(1), SPEC.dim, 7, SPEC.init_scale))
    apply(t, 4, [1])
    fresh = table()
    apply(fresh, 0, [1])
    assert torch.equal(t.lookup(ids(1)), fresh.lookup(ids(1)))
    assert t.rows_created == 3 and t.weight.shape[0] == 4096  # a freed slot was reused


def test_lfu_keeps_at_most_max_rows_and_drops_the_least_often_seen():
    t = table(evict="lfu", max_rows=64)
    hot = list(range(10))
    for step in range(40):
        apply(t, step, hot + list(range(1000 + 30 * step, 1000 + 30 * step + 30)))
        assert t.rows_live <= 64
    assert t.weight.shape[0] <= 64 + 40  # storage: the cap and one round's new ids
    assert (t.map.find(ids(*hot).numpy(), np.zeros(10, dtype=np.int16)) >= 0).all()  # the hot ids survive every pass
    assert t.rows_created - t.rows_evicted == t.rows_live


def test_state_and_load_round_trip_into_any_number_of_servers():
    g = torch.Generator().manual_seed(1)
    t = table(admit_after=2, evict="ttl", ttl_steps=4)
    for step in range(20):
        batch = torch.randint(0, 200, (30,), generator=g).unique()
        t.apply(batch, torch.randn(batch.numel(), SPEC.dim, generator=g),
                torch.ones(batch.numel(), dtype=torch.int64), step, 0.1)
    state = t.state()
    probe = torch.arange(-5, 205)
    for p in (1, 3):  # the entries re-split by id over p servers: together, the same table
        parts = [table(admit_after=2, evict="ttl", ttl_steps=4) for _ in range(p)]
        owner = HashPartition(p).owner(state["ids"])[0]
        for k, part in enumerate(parts):
            part.load(state, owner == k)
        whole = HashPartition(p).owner(probe)[0]
        for k, part in enumerate(parts):
            mine = probe[whole == k]
            assert torch.equal(part.lookup(mine), t.lookup(mine))
            again = part.state()
            for key in ("count", "last", "has_row"):
                sel = owner == k
                assert torch.equal(again[key], state[key][sel])
        assert sum(part.rows_live for part in parts) == t.rows_live


def test_dynamic_bag_serves_trained_rows_and_initial_values_or_zeros_for_the_rest():
    t = table()
    apply(t, 0, [4, 8])
    rows = t.export()
    bag = DynamicBag(SPEC.dim, 7, SPEC.init_scale).load(rows["ids"], rows["weight"])
    x = ids(8, 3, 4)
    assert torch.equal(bag.lookup(x), t.lookup(x))
    zero = DynamicBag(SPEC.dim, 7, SPEC.init_scale, unknown="zero").load(rows["ids"],
                                                                         rows["weight"])
    assert torch.equal(zero.lookup(ids(3)), torch.zeros(1, SPEC.dim))
    pooled = bag(x, ids(0, 2))  # bags [8, 3] and [4]
    assert torch.allclose(pooled[0], t.lookup(ids(8, 3)).sum(0))


# -- a table shard with dynamic tables: malformed pushes change nothing -------------------------
def _shard(ps=0, num_ps=2):
    sp = NS(optimizer="adagrad", lr=0.5, eps=1e-8, weight_decay=0.0, betas=[0.9, 0.999],
            partition="mod", admit_after=1, evict="none", ttl_steps=0, max_rows=None)
    return TableShard(TableShardSpec(0, torch.empty(0), sgd(lr=1.0), sync(), 1, 1000, ps=ps,
                                     num_ps=num_ps, tables=[SPEC], seed=0, sparse=sp))


def _owned(ps, num_ps, n):
    candidates = torch.arange(1000)
    return candidates[HashPartition(num_ps).owner(candidates)[0] == ps][:n]


@pytest.mark.parametrize("case", ["not-owned", "negative-count", "zero-count", "no-counts",
                                  "unknown-table", "count-shape", "huge-count", "sparse-ids"])
def test_malformed_dynamic_pushes_are_refused_with_nothing_changed(case):
    shard = _shard()
    good = _owned(0, 2, 3)
    grads = torch.ones(3, SPEC.dim)
    one = torch.ones(3, dtype=torch.int64)
    shard.push_pull(0, 0, {"user": (good, grads, one)}, 1.0, 1).wait()  # a good round first
    before = (copy.deepcopy(shard.dynamic.state("user")), shard.version)
    payload = {
        "not-owned": {"user": (_owned(1, 2, 3), grads, one)},
        "negative-count": {"user": (good, grads, ids(1, -2, 1))},
        "zero-count": {"user": (good, grads, ids(1, 0, 1))},
        "no-counts": {"user": (good, grads)},
        "unknown-table": {"users": (good, grads, one)},
        "count-shape": {"user": (good, grads, ids(1, 1))},
        "huge-count": {"user": (good, grads, ids(1, 2**31, 1))},
        "sparse-ids": {"user": (good.to_sparse(), grads, one)},
    }[case]
    with pytest.raises(PushRejected) as err:
        shard.push_pull(0, 1, payload, 1.0, 1).wait()
    assert {"not-owned": "does not own", "negative-count": "count of -2",
            "zero-count": "count of 0", "no-counts": "(ids, gradients, counts)",
            "unknown-table": "unknown table", "count-shape": "counts (2,)",
            "huge-count": "count of 2147483648", "sparse-ids": "dense CPU tensor"}[case] \
        in str(err.value)
    after = shard.dynamic.state("user")
    assert shard.version == before[1]
    for key in ("ids", "count", "last", "has_row", "weight"):
        assert torch.equal(after[key], before[0][key])


def test_pulls_of_unknown_ids_give_initial_values_and_create_no_row():
    shard = _shard(ps=1)
    x = _owned(1, 2, 4)
    got = shard.pull_rows({"user": x})["user"]
    assert torch.equal(got, init_ids(x, SPEC.dim, table_seed(0, "user"), SPEC.init_scale))
    assert shard.dynamic["user"].rows_live == 0
    with pytest.raises(PushRejected, match="does not own"):  # a push of them is refused
        shard.push_pull(0, 0, {"user": (_owned(0, 2, 2), torch.ones(2, SPEC.dim),
                                        torch.ones(2, dtype=torch.int64))}, 1.0, 1).wait()


def test_numpy_initialiser_equals_init_rows_bit_for_bit():
    """The PS computes a new id's initial values with NumPy; they must be init_rows' (torch)."""
    from psrpc.sparse.rows import COLUMN_BITS, MAX_INIT_ROW, hash64, init_rows

    def init_ids_reference(ids, dim, table_seed, scale):  # through init_rows and torch
        key = (hash64(ids, table_seed) >> (64 - (63 - COLUMN_BITS))) & (MAX_INIT_ROW - 1)
        return init_rows(key, dim, table_seed, scale)

    x = torch.cat([torch.randint(-2**63, 2**63 - 1, (3000,)), torch.arange(-5, 5)])
    for dim, seed, scale in [(1, 0, 1.0), (16, 12345, 0.01), (33, -7, 0.0031622)]:
        assert torch.equal(init_ids(x, dim, seed, scale), init_ids_reference(x, dim, seed, scale))


def test_tables_of_one_server_share_the_map_but_not_their_ids_rows_or_caps():
    a, b = TableSpec("a", 100, 4, dynamic=True), TableSpec("b", 100, 4, dynamic=True)
    group = DynamicTables([a, b], {"a": 1, "b": 2}, "adagrad", ADAGRAD, evict="lfu",
                          max_rows=8)
    one = torch.ones(3, dtype=torch.int64)
    group.apply({"a": (ids(1, 2, 3), torch.ones(3, 4), one)}, 0, 0.1)
    assert group["a"].rows_live == 3 and group["b"].rows_live == 0
    got = group.lookup({"b": ids(1, 7), "a": ids(1, 9)})  # b's ids: no rows, b's initial values
    assert torch.equal(got["b"], init_ids(ids(1, 7), 4, 2, b.init_scale))
    assert torch.equal(got["a"][1], init_ids(ids(9), 4, 1, a.init_scale)[0])
    assert not torch.equal(got["a"][0], init_ids(ids(1), 4, 1, a.init_scale)[0])
    for step in range(1, 6):  # b fills past its cap; a keeps its three rows
        group.apply({"b": (torch.arange(10 * step, 10 * step + 10), torch.ones(10, 4),
                           torch.ones(10, dtype=torch.int64))}, step, 0.1)
        assert group["b"].rows_live <= 8
    assert group["a"].rows_live == 3 and group["a"].rows_evicted == 0
    assert torch.equal(group.export("a")["ids"], ids(1, 2, 3))


def test_one_server_and_two_hold_the_same_rows_through_rebuilds_of_the_map():
    """Three tables, admission and ttl, 40 rounds of random ids: the map is rebuilt several
    times (positions move) and every table's rows stay what one server per table would hold,
    and what two servers holding half the ids each hold together."""
    specs = [TableSpec(f"t{k}", 1000, 4, dynamic=True) for k in range(3)]
    seeds = {s.name: 10 + k for k, s in enumerate(specs)}

    def servers(tables):
        return DynamicTables(tables, seeds, "adagrad", ADAGRAD, admit_after=2, evict="ttl",
                             ttl_steps=5)

    one, two = servers(specs), [servers(specs), servers(specs)]
    alone = {s.name: servers([s]) for s in specs}
    owner, g, capacity = HashPartition(2), torch.Generator().manual_seed(0), one.map.capacity
    for step in range(40):
        payload = {}
        for s in specs:
            x, c = torch.randint(0, 300, (64,), generator=g).unique(return_counts=True)
            payload[s.name] = (x, torch.randn(x.numel(), 4, generator=g), c)
        one.apply(payload, step, 0.1)
        for name, group in alone.items():
            group.apply({name: payload[name]}, step, 0.1)
        for k, group in enumerate(two):
            mine = {n: tuple(t[owner.owner(p[0])[0] == k] for t in p) for n, p in payload.items()}
            group.apply(mine, step, 0.1)
    assert one.map.capacity > capacity  # it grew (rebuilt) on the way
    for s in specs:
        ref = one.export(s.name)
        for other in (alone[s.name].export(s.name),
                      {k: torch.cat([g.export(s.name)[k] for g in two]) for k in ("ids",
                                                                                  "weight")}):
            order = other["ids"].argsort()
            assert torch.equal(other["ids"][order], ref["ids"])
            assert torch.equal(other["weight"][order], ref["weight"])


def test_the_hot_row_cache_is_refused_with_dynamic_tables_naming_the_key():
    from psrpc.errors import ConfigError
    from tests.conftest import compose
    from tests.test_sparse_cluster import CLICKS

    with pytest.raises(ConfigError, match=r"sparse.cache_rows=100: the hot-row cache serves "
                                          r"fixed tables only"):
        compose(CLICKS + ["sparse.dynamic=true", "sparse.cache_rows=100",
                          "sparse.cache_staleness=2"])


def test_a_rounds_lookups_ahead_answered_together_equal_pulls_after_the_round():
    """Two workers push and ask for their next rows: the first reply looks both up in one
    batch; each gets what a pull of its ids reads once the round has closed."""
    shard = TableShard(TableShardSpec(0, torch.empty(0), sgd(lr=1.0), sync(), 2, 1000, ps=0,
                                      num_ps=1, tables=[SPEC], seed=0, sparse=_shard().sparse))
    one = torch.ones(3, dtype=torch.int64)
    pushes = [ids(1, 2, 3), ids(2, 5, 8)]
    nxt = [ids(1, 9, 40), ids(3, 8, 77)]
    futures = [shard.push_pull_rows(w, 0, {"user": (pushes[w], torch.ones(3, SPEC.dim), one)},
                                    1.0, 1, None, {"user": nxt[w]}) for w in range(2)]
    replies = [f.wait() for f in futures]
    for w in range(2):
        assert replies[w].version == 1
        assert torch.equal(replies[w].rows["user"], shard.pull_rows({"user": nxt[w]})["user"])
    assert shard.dynamic.positions(0, "user", nxt[0]) is not None  # kept for the next round


def test_a_server_restored_with_no_ids_of_a_table_keeps_its_optimizer_step_count():
    """Lazy Adam's bias correction counts the table's steps: a server that the new partition
    gives none of a table's ids must still restore the count."""
    def adam():
        return DynamicTables([SPEC], {SPEC.name: 7}, "adam", {"betas": (0.9, 0.999), "eps": 1e-8})

    t = adam()
    for step in range(10):
        t.apply({SPEC.name: (ids(5), torch.ones(1, SPEC.dim), ids(1))}, step, 0.1)
    empty = adam()
    empty.load(SPEC.name, t.state(SPEC.name), torch.zeros(1, dtype=torch.bool))
    assert empty[SPEC.name].opt.step_count == t[SPEC.name].opt.step_count == 10


def test_a_void_push_to_a_table_shard_is_discarded_not_an_error():
    """A worker whose dense view was written during its step (update.timeout_s closed a round
    without it) sends its table gradients as shm.VOID: the table shard discards them (the
    round goes on, nothing applied), as a dense shard does, rather than failing the call."""
    from psrpc.cluster import shm
    shard = _shard()
    before = copy.deepcopy(shard.dynamic.state("user"))
    reply = shard.push_pull(0, 0, shm.VOID, 1.0, 1).wait()
    assert shard.version == 1 and not reply.accepted
    after = shard.dynamic.state("user")
    for key in ("ids", "count", "last", "has_row", "weight"):
        assert torch.equal(torch.as_tensor(before[key]), torch.as_tensor(after[key])), key

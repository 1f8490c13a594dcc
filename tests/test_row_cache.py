"""The hot-row cache's bookkeeping (psrpc/worker/cache.py), in one process: a small table server
stands for the table shards (values per row, an SGD step per push), so that every gradient and
every value's age can be followed. The cache over the real shards is in test_sparse_cluster.py."""

import random

import pytest
import torch

from psrpc.sparse.rows import TableSpec
from psrpc.worker.cache import RowCache
from psrpc.worker.replica import WorkerStats

SPECS = [TableSpec("big", 200, 4), TableSpec("small", 10, 3)]


class Server:
    """Table values, the step each row was last written at, every gradient received."""

    def __init__(self):
        self.weights = {s.name: torch.randn(s.num_rows, s.dim) for s in SPECS}
        self.received = {s.name: torch.zeros(s.num_rows, s.dim) for s in SPECS}
        self.pushes, self.voids, self.pulled = 0, 0, 0

    def pull(self, rows):
        self.pulled += sum(r.numel() for r in rows.values())
        return {n: self.weights[n][r].clone() for n, r in rows.items()}

    def push_async(self, grads, versions, loss, samples, ticket=None, void=False, ahead=None):
        self.pushes += 1
        if void:
            self.voids += 1
            return []
        for name, (rows, g) in grads.items():
            assert rows.numel() == 0 or bool((rows[1:] > rows[:-1]).all()), "unique, ascending"
            self.received[name][rows] += g
            self.weights[name][rows] -= 0.1 * g
        return []

    def pull_versions(self):
        return []

    def receive(self, replies):
        pass


def _run(staleness, capacity, steps=60, void_at=(), seed=0, hold=True, received=None):
    rnd = random.Random(seed)
    server, stats, clock = Server(), WorkerStats(), [0]
    cache = RowCache(server, SPECS, capacity, staleness, clock=lambda: clock[0],
                     flush_all=lambda step: step == steps - 1, stats=stats, hold=hold)
    given = {s.name: torch.zeros(s.num_rows, s.dim) for s in SPECS}
    served, history = [], []
    for step in range(steps):
        clock[0] = step
        history.append({n: w.clone() for n, w in server.weights.items()})
        # skewed lookups: a few hot rows most of the time
        rows = {s.name: torch.tensor(sorted({min(int(rnd.paretovariate(1.0)) - 1, s.num_rows - 1)
                                             for _ in range(12)}), dtype=torch.int64)
                for s in SPECS}
        with torch.enable_grad():
            values = cache.pull(rows)
        served.append((step, {n: (rows[n], v) for n, v in values.items()}, history))
        grads = {n: (r, torch.randn(r.numel(), SPECS[i].dim)) for i, (n, r) in
                 enumerate(rows.items())}
        void = step in void_at
        if not void:
            for n, (r, g) in grads.items():
                given[n][r] += g
        cache.push_async(grads, [], 0.0, 1, void=void)
        if received is not None:  # what the server holds after each step, what it was given
            received.append(({n: r.clone() for n, r in server.received.items()},
                             {n: g.clone() for n, g in given.items()}))
    return server, stats, given, served


@pytest.mark.parametrize("staleness,capacity", [(1, 50), (3, 50), (5, 8), (4, 200)])
def test_no_gradient_is_lost_and_none_is_pushed_twice(staleness, capacity):
    server, _, given, _ = _run(staleness, capacity, void_at={7, 8, 30})
    for name in given:
        torch.testing.assert_close(server.received[name], given[name], rtol=1e-5, atol=1e-5)


def test_write_through_pushes_every_gradient_in_its_own_step_and_still_caches_reads():
    after = []
    _, stats, _, _ = _run(staleness=4, capacity=64, hold=False, received=after)
    for step, (received, given) in enumerate(after):
        for name in received:
            torch.testing.assert_close(received[name], given[name], rtol=1e-5, atol=1e-5,
                                       msg=f"{name}: a gradient held past step {step}")
    assert stats.cache_hits / stats.cache_lookups > 0.5


def test_a_cached_value_is_never_older_than_the_bound():
    """Every value a lookup served is what the server held at the start of one of the last
    `staleness` + 1 steps."""
    staleness = 3
    _, _, _, served = _run(staleness, 50)
    for step, looked, history in served:
        for name, (rows, values) in looked.items():
            for i, row in enumerate(rows.tolist()):
                assert any(torch.equal(history[t][name][row], values[i])
                           for t in range(max(0, step - staleness), step + 1)), \
                    f"{name} row {row} at step {step}: a value older than the bound"


def test_the_cache_serves_skewed_lookups_and_cuts_the_rows_on_the_wire():
    exact, _, _, _ = _run(staleness=0, capacity=0)  # no cache: every row every step
    server, stats, _, _ = _run(staleness=4, capacity=64)
    assert stats.cache_hits / stats.cache_lookups > 0.5
    assert server.pulled < 0.5 * exact.pulled


def _warm():
    """A cache (50 rows, a bound of 10 steps) that has looked up three rows once."""
    server = Server()
    cache = RowCache(server, SPECS, 50, 10, clock=lambda: 0, flush_all=lambda s: False,
                     stats=WorkerStats())
    rows = {"big": torch.tensor([1, 2]), "small": torch.tensor([0])}
    with torch.enable_grad():
        cache.pull(rows)
    return server, cache, rows


def test_evaluation_reads_the_server_not_the_cache():
    server, cache, rows = _warm()
    server.weights["big"][1] += 1.0  # another worker's update reached the server
    with torch.no_grad():
        assert torch.equal(cache.pull(rows)["big"], server.weights["big"][[1, 2]])
    with torch.enable_grad():  # training within the bound: the cached value
        assert not torch.equal(cache.pull(rows)["big"], server.weights["big"][[1, 2]])


def test_a_new_membership_epoch_starts_cold():
    server, cache, rows = _warm()
    cache.bind(server)
    before = server.pulled
    with torch.enable_grad():
        cache.pull(rows)
    assert server.pulled == before + 3


class AheadServer(Server):
    """A Server that also answers the rows asked with a push, as the table shards do: its reply
    brings their values once the push is applied (RowClient.receive / take_ahead)."""

    def __init__(self, lag):
        super().__init__()
        self.lag, self.pull_calls, self._asked, self._ahead = lag, 0, None, None

    def pull(self, rows):
        self.pull_calls += 1
        return super().pull(rows)

    def push_async(self, grads, versions, loss, samples, ticket=None, void=False, ahead=None):
        out = super().push_async(grads, versions, loss, samples, ticket, void, ahead)
        self._asked = ahead
        return out

    def receive(self, replies):
        asked, self._asked = self._asked, None
        if asked:
            self._ahead = (asked, {n: self.weights[n][r].clone() for n, r in asked.items()})

    def take_ahead(self):
        got, self._ahead = self._ahead, None
        return got


class _Version:
    """A table shard's Reply, as the cache reads it."""

    def __init__(self, version, accepted=True, skipped=False):
        self.version, self.accepted, self.skipped = version, accepted, skipped


@pytest.mark.parametrize("lag,staleness,capacity", [(0, 2, 50), (1, 1, 50), (1, 4, 8),
                                                    (1, 3, 200)])
def test_rows_pulled_ahead_fill_the_cache_within_the_bound_and_lose_no_gradient(
        lag, staleness, capacity):
    """The rows of a later lookup ride on a push and its reply fills the cache (lag 1: the
    lookup after next, as a pipelined worker asks): every value served is within the bound,
    every gradient arrives once, and after the first steps no lookup has to pull."""
    rnd, steps = random.Random(1), 60
    server, stats, clock = AheadServer(lag), WorkerStats(), [0]
    cache = RowCache(server, SPECS, capacity, staleness, clock=lambda: clock[0],
                     flush_all=lambda step: step == steps - 1, stats=stats)
    batches = [{s.name: torch.tensor(sorted({min(int(rnd.paretovariate(1.0)) - 1, s.num_rows - 1)
                                             for _ in range(12)}), dtype=torch.int64)
                for s in SPECS} for _ in range(steps)]
    given = {s.name: torch.zeros(s.num_rows, s.dim) for s in SPECS}
    history = {}  # step -> the server's weights at its start

    def lookup(n):
        history.setdefault(n, {k: w.clone() for k, w in server.weights.items()})
        with torch.enable_grad():
            values = cache.pull(batches[n])
        for name, v in values.items():  # within the bound: the server's at one of the steps
            for i, row in enumerate(batches[n][name].tolist()):
                assert any(torch.equal(history[k][name][row], v[i])
                           for k in range(max(0, n - staleness), n + 1) if k in history), \
                    f"{name} row {row} at step {n}: older than the bound"

    def push(n):
        grads = {nm: (r, torch.randn(r.numel(), SPECS[i].dim)) for i, (nm, r) in
                 enumerate(batches[n].items())}
        for nm, (r, g) in grads.items():
            given[nm][r] += g
        nxt = n + 1 + lag
        cache.push_async(grads, [], 0.0, 1, ahead=batches[nxt] if nxt < steps else None)

    if lag == 0:
        for n in range(steps):
            lookup(n)
            push(n)
            cache.receive([_Version(n + 1)])
            clock[0] = n + 1
    else:  # lookup n+1 runs before push n's reply is in
        lookup(0)
        for n in range(steps):
            push(n)
            history[n + 1] = {k: w.clone() for k, w in server.weights.items()}
            if n + 1 < steps:
                lookup(n + 1)
            cache.receive([_Version(n + 1)])
            clock[0] = n + 1
    for name in given:
        torch.testing.assert_close(server.received[name], given[name], rtol=1e-5, atol=1e-5)
    assert server.pull_calls <= 2  # the first lookups; then every row came ahead or cached


def test_a_fill_leaves_kept_slots_gives_a_slot_to_its_first_row_and_returns_held_gradients():
    """The compiled fill (cache_kernels.fill) on one table of 4 slots: slot 1 is kept for
    another row, rows 2 and 6 both map to slot 2 (the first wins), and the row displaced from
    slot 3 leaves with the gradient it held."""
    import numpy as np

    from psrpc.worker.cache import Slots

    g = Slots([TableSpec("t", 100, 2)], 4)
    g.row[:] = [-1, 9, -1, 7]  # row 9 in slot 1 (kept), row 7 in slot 3 holding a gradient
    g.pending[3] = [1.5, -2.0]
    g.pending_since[3] = 4
    g.units[3] = 2  # two steps' gradients in that sum
    rows = np.array([5, 2, 6, 11, 4], dtype=np.int64)  # slots 1, 2, 2, 3, 0
    values = np.arange(10, dtype=np.float32).reshape(5, 2)
    (tables, gone, sums, units), placed = g.fill(rows, rows % 4, values, 8, np.array([1]))
    assert placed.tolist() == [1, 3, 4]  # not 5 (slot 1 kept), not 6 (slot 2 taken by 2)
    assert g.row.tolist() == [4, 9, 2, 11]
    assert g.values[2].tolist() == [2, 3] and g.values[0].tolist() == [8, 9]
    assert g.pulled_at.tolist() == [8, 0, 8, 8]
    assert tables.tolist() == [0] and gone.tolist() == [7] and sums.tolist() == [[1.5, -2.0]]
    assert units.tolist() == [2] and g.units[3] == 0
    assert g.pending_since[3] == -1 and not g.pending[3].any()
    assert not g._mark.any()  # the scratch is left clear


def test_a_row_evicted_and_missed_in_one_step_goes_out_once_with_both_sums():
    """Rows 1 and 51 share slot 1 of 50: row 1 takes it, row 51 misses. A held sum of row 51
    waiting to go out (evicted, or given back by a push the PS refused) and its gradient of
    this step leave in one entry, summed in a fixed order (the held sum first): the PS takes
    unique, ascending rows only."""
    import numpy as np

    server = Server()
    cache = RowCache(server, SPECS, 50, 10, clock=lambda: 0, flush_all=lambda s: False,
                     stats=WorkerStats())
    rows = {"big": torch.tensor([1, 51])}
    with torch.enable_grad():
        cache.pull(rows)
    held = np.array([[0.5, 0.25, -1.0, 2.0]], dtype=np.float32)
    cache._evicted.append((0, (np.array([0]), np.array([51]), held, np.array([3]))))
    grad = torch.randn(2, 4)
    cache.push_async({"big": (rows["big"], grad)}, [], 0.0, 1)  # Server checks unique rows
    assert torch.equal(server.received["big"][51], torch.from_numpy(held[0]) + grad[1])
    assert not server.received["big"][1].any()  # row 1 is in its slot: held
    assert cache.units_held() == 1 and cache.stats.cache_grads == 2


class RefusingServer(Server):
    """A Server whose pushes at the steps in `refuse` are not applied (a push past the step
    training stopped at, or a stale one): its reply says not accepted."""

    def __init__(self, refuse):
        super().__init__()
        self.refuse, self.step = set(refuse), 0

    def push_async(self, grads, versions, loss, samples, ticket=None, void=False, ahead=None):
        if self.step in self.refuse:
            for rows in (g[0] for g in grads.values()):
                assert rows.numel() == 0 or bool((rows[1:] > rows[:-1]).all())
            return []
        return super().push_async(grads, versions, loss, samples, ticket, void, ahead)

    def take_ahead(self):
        return None

    def hand_over(self, grads):
        for name, (rows, g) in grads.items():
            self.received[name][rows] += g


@pytest.mark.parametrize("staleness,capacity,pipelined", [(3, 50, False), (5, 8, False),
                                                            (4, 4, True)])
def test_a_push_the_ps_refuses_gives_its_held_sums_back_and_the_hand_over_takes_the_rest(
        staleness, capacity, pipelined):
    """The refused pushes' own step gradients are dropped (as the step's dense gradient is);
    every other gradient reaches the server, once: with a later push or, for what is still
    held when training ends early (no flush in the last steps), with the hand-over.
    `pipelined`: the next lookup runs before the push's reply (as a worker pulling ahead),
    so a sum holding the refused step's gradient may have been evicted meanwhile."""
    rnd, steps, refused = random.Random(2), 40, {9, 17, 18, 39}
    server, stats, clock = RefusingServer(refused), WorkerStats(), [0]
    cache = RowCache(server, SPECS, capacity, staleness, clock=lambda: clock[0],
                     flush_all=lambda step: False, stats=stats)
    batches = [{s.name: torch.tensor(sorted({min(int(rnd.paretovariate(1.0)) - 1,
                                                 s.num_rows - 1) for _ in range(12)}))
                for s in SPECS} for _ in range(steps)]
    given = {s.name: torch.zeros(s.num_rows, s.dim) for s in SPECS}
    own = 0  # the refused steps' own row gradients

    def lookup(step):
        with torch.enable_grad():
            cache.pull(batches[step])

    lookup(0)
    for step in range(steps):
        clock[0] = server.step = step
        grads = {n: (r, torch.randn(r.numel(), SPECS[i].dim)) for i, (n, r) in
                 enumerate(batches[step].items())}
        if step not in refused:
            for n, (r, g) in grads.items():
                given[n][r] += g
        else:
            own += sum(r.numel() for r in batches[step].values())
        cache.push_async(grads, [], 0.0, 1)
        if pipelined and step + 1 < steps:
            lookup(step + 1)
        cache.receive([_Version(step + 1, accepted=step not in refused)])
        if not pipelined and step + 1 < steps:
            lookup(step + 1)
    assert cache.units_held() > 0  # an early stop: the last steps did not flush
    cache.hand_over()
    assert cache.units_held() == 0
    for name in given:
        torch.testing.assert_close(server.received[name], given[name], rtol=1e-5, atol=1e-5)
    assert stats.cache_grads_dropped == own
    assert stats.cache_grads_held == 0 and stats.cache_grads_handed_over > 0

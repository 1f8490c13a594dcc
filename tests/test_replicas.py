"""cluster.ps_replicas: every shard has a backup on another PS, kept bit for bit equal to it;
a PS killed with SIGKILL fails over to the backups in the next membership epoch, with nothing
rolled back (no checkpoint.dir at all here) and, in sync training, the very result of a run
that was never interrupted."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from psrpc.errors import ConfigError
from psrpc.sparse import load_tables
from tests.conftest import assert_equal_model, compose, run_cluster
from psrpc.ps.replicas import placement
from tests.test_elastic import _children_named, _kill_when
from tests.test_sparse_cluster import CLICKS

pytestmark = pytest.mark.timeout(300)

MLP = ["cluster.num_ps=2", "cluster.num_workers=2", "train.steps=60"]
REPLICAS = ["cluster.ps_replicas=1"]


def _crash(ps: int, step: int) -> list[str]:
    return ["fault.crash_role=ps", f"fault.crash_index={ps}", f"fault.crash_at_step={step}"]


def _failed_over(summary, ps: str) -> dict:
    """The run's one membership epoch: ps failed over, nothing rolled back, backups agree."""
    assert summary["restored_from_step"] is None
    (epoch,) = summary["epochs"]
    assert epoch["started_again"] == ps and epoch["rolled_back_to"] is None
    assert epoch["failovers"] and all(f["from"] == ps for f in epoch["failovers"])
    assert summary["replicas"]["agree"], summary["replicas"]
    assert all(s["version"] == summary["steps"] for s in summary["shards"])
    return epoch


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run_cluster(tmp_path_factory.mktemp("plain"), MLP)


@pytest.mark.parametrize("ps,step,shm", [(1, 35, "auto"), (0, 20, "auto"), (1, 20, "off")],
                         ids=["ps1-shared-memory", "ps0-shared-memory", "ps1-tcp"])
def test_sync_a_killed_ps_fails_over_and_equals_an_uninterrupted_run(tmp_path, uninterrupted,
                                                                      ps, step, shm):
    """With shared memory (the default on one host), the workers read the lost PS's master
    copy in place: they take their own copy of the moved shards and push them over TCP."""
    summary, state = run_cluster(tmp_path, MLP + REPLICAS + _crash(ps, step)
                                 + [f"cluster.shm={shm}"])
    epoch = _failed_over(summary, f"ps{ps}")
    assert epoch["at_step"] in (step - 1, step)  # the step the shards had reached
    assert_equal_model(state, uninterrupted[1])
    if shm == "off":  # no shared memory: the gradients went over TensorPipe
        assert all(s["replicated_in_rings"] == 0 for s in summary["shards"])
    # every shard has a backup again: on the PS that came back
    assert all(c["backups"] for c in summary["replicas"]["copies"].values())


def test_a_backup_equals_its_primary_and_costs_no_result(tmp_path, uninterrupted):
    """Without a failure: replication changes nothing of the result, and each backup's state
    (parameters, optimizer state, version) equals its primary's bit for bit."""
    summary, state = run_cluster(tmp_path, MLP + REPLICAS)
    replicas = summary["replicas"]
    assert replicas["agree"]
    assert all(c["primary"] != b for c in replicas["copies"].values() for b in c["backups"])
    assert all(s["replicated"] == 60 and s["backups"] for s in summary["shards"])
    # the MLP's shards are large: their backups run the same optimizer steps, each gradient
    # left in shared memory (a ring) for the backup on this host
    assert {s["replicated_as"] for s in summary["shards"]} == {"updates"}
    assert all(s["replicated_in_rings"] == 60 for s in summary["shards"]), summary["shards"]
    assert_equal_model(state, uninterrupted[1])


def test_tables_fail_over_in_sync_bit_for_bit(tmp_path):
    """DLRM, dense shards and table shards on 2 PS, Adam (its step count is state too): ps0
    killed; the dense parameters and every table's rows equal an uninterrupted run's, and the
    backups agreed with their primaries before it."""
    mode = CLICKS + ["cluster.num_ps=2", "cluster.num_workers=2", "train.steps=30", "optim=adam"]
    plain = run_cluster(tmp_path / "plain", mode, fast=False)
    summary, state = run_cluster(tmp_path / "killed", mode + REPLICAS + _crash(0, 12), fast=False)
    _failed_over(summary, "ps0")
    # small dense shards and fixed tables: their backups copy what each update changed
    # (values, Adam's moments and step; rows and their row-wise state)
    assert {s["replicated_as"] for s in summary["shards"]} == {"values"}
    assert_equal_model(state, plain[1])
    assert_equal_model(load_tables(tmp_path / "killed"), load_tables(tmp_path / "plain"))


def test_dense_allreduce_a_killed_clock_ps_fails_over_and_its_backups_agree(tmp_path):
    """update.dense=allreduce with the hot-row cache (psrpc's best DLRM configuration): the PS
    holds the tables and a clock shard with no parameters; ps0, the clock's, killed. It fails
    over with nothing rolled back, every backup agrees with its primary (no optimizer state
    made on one side only) and the run ends at its last step. The step the lost PS left
    unanswered is not pushed again in this mode (a warning says so): the shards behind pass
    it, so the result is not an uninterrupted run's."""
    mode = CLICKS + ["update.dense=allreduce", "sparse.cache_rows=64", "sparse.cache_staleness=2",
                     "cluster.num_ps=2", "cluster.num_workers=2", "train.steps=30"]
    summary, _ = run_cluster(tmp_path / "killed", mode + REPLICAS + _crash(0, 12), fast=False)
    _failed_over(summary, "ps0")
    assert summary["steps"] == 30


@pytest.mark.parametrize("extra", [
    ["sparse.dynamic=true", "sparse.admit_after=2", "sparse.evict=lfu", "sparse.max_rows=80"],
    ["sparse.cache_rows=64", "sparse.cache_staleness=2"],
    ["sparse.cache_rows=64", "sparse.cache_staleness=2", "sparse.cache_writes=hold"]],
    ids=["dynamic-lfu", "row-cache", "row-cache-write-back"])
def test_dynamic_tables_and_the_row_cache_fail_over_in_sync_bit_for_bit(tmp_path, extra):
    """Dynamic tables (ids made, admitted and evicted on the PS: the id map and its counts are
    replicated too), or a worker's hot-row cache in front of fixed tables (read-only, or
    holding gradients): ps1 killed, the result is the uninterrupted run's. The cache keeps its
    rows and held gradients over a failover (nothing was rolled back)."""
    mode = CLICKS + extra + ["cluster.num_ps=2", "cluster.num_workers=2", "train.steps=30"]
    plain = run_cluster(tmp_path / "plain", mode, fast=False)
    summary, state = run_cluster(tmp_path / "killed", mode + REPLICAS + _crash(1, 14), fast=False)
    _failed_over(summary, "ps1")
    assert_equal_model(state, plain[1])
    a, b = load_tables(tmp_path / "killed"), load_tables(tmp_path / "plain")
    assert a.keys() == b.keys()
    for name, table in b.items():  # a fixed table's rows, or a dynamic table's ids and rows
        pairs = ([(a[name], table)] if torch.is_tensor(table) else
                 [(a[name].ids, table.ids), (a[name].weight, table.weight)])
        assert all(torch.equal(x, y) for x, y in pairs), name


@pytest.mark.parametrize("mode", [["update=async"], ["update=async", "update.max_staleness=2"]],
                         ids=["async", "bounded"])
def test_async_a_killed_ps_fails_over_with_nothing_rolled_back(tmp_path, mode):
    summary, _ = run_cluster(tmp_path, MLP + mode + REPLICAS + _crash(1, 40))
    _failed_over(summary, "ps1")
    assert summary["steps"] == 60


def test_the_ps_back_is_a_backup_and_a_second_kill_fails_over_again(tmp_path):
    """ps1 dies (fault), comes back as the backup of every shard (copied while training goes
    on); then ps0, now the primary of every shard, is killed from outside: the shards fail
    over to ps1, again with nothing rolled back, and the result is the uninterrupted run's."""
    mode = MLP[:2] + ["train.steps=300", "fault.slow_worker=1", "fault.slow_s=0.01"]
    log = tmp_path / "killed" / "logs" / "worker0.log"
    killer = _kill_when("psrpc-ps0", lambda: log.exists() and log.read_text().count(
        "a new backup on ps1") >= 2)
    summary, state = run_cluster(tmp_path / "killed", mode + REPLICAS + _crash(1, 30))
    killer.join(1)
    first, second = summary["epochs"]
    assert first["started_again"] == "ps1" and second["started_again"] == "ps0"
    assert {f["to"] for f in second["failovers"]} == {"ps1"}
    assert len(second["failovers"]) == 2  # both shards, each primary on ps0 by then
    assert all(e["rolled_back_to"] is None for e in (first, second))
    assert summary["restored_from_step"] is None and summary["replicas"]["agree"]
    plain = run_cluster(tmp_path / "plain", mode)
    assert_equal_model(state, plain[1])


def test_every_copy_lost_at_once_rolls_back_to_the_checkpoint_saying_why(tmp_path):
    """2 PS with 1 backup each, both killed together: some shard has no copy left, so every
    shard rolls back to the last committed checkpoint, as without replicas, with a line
    naming the shards."""
    metrics = tmp_path / "metrics.jsonl"

    def both():
        return metrics.exists() and metrics.read_text().count("\n") >= 25

    killer = threading.Thread(target=lambda: (
        _wait(both, 60), [p.kill() for p in _children_named({"psrpc-ps0", "psrpc-ps1"})]),
        daemon=True)
    killer.start()
    summary, _ = run_cluster(tmp_path, MLP[:2] + REPLICAS + [
        "train.steps=300", "fault.slow_worker=1", "fault.slow_s=0.01",
        "checkpoint.every_steps=10", f"checkpoint.dir={tmp_path / 'ck'}"])
    killer.join(1)
    assert summary["steps"] == 300
    rolled = [e for e in summary["epochs"] if e["rolled_back_to"] is not None]
    assert rolled and rolled[0]["failovers"] == [], summary["epochs"]
    assert "lost every copy" in (tmp_path / "logs" / "worker0.log").read_text()


def _wait(cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not cond():
        time.sleep(0.05)


def test_backups_go_to_other_hosts_first_then_the_next_ps():
    assert placement(3, 1, ["a", "a", "a"]) == [[1], [2], [0]]
    assert placement(4, 1, ["a", "a", "b", "b"]) == [[2], [3], [0], [1]]  # spread over h_b
    assert placement(4, 2, ["a", "a", "b", "b"]) == [[2, 3], [3, 2], [0, 1], [1, 0]]
    assert placement(3, 2, ["a", "b", "a"]) == [[1, 2], [2, 0], [1, 0]]
    assert placement(2, 0, ["a", "b"]) == [[], []]


@pytest.mark.parametrize("overrides,key", [
    (["cluster.num_ps=2", "cluster.ps_replicas=2"], "cluster.ps_replicas=2"),
    (["cluster.ps_replicas=-1"], "cluster.ps_replicas=-1"),
    (["cluster.num_ps=2", "cluster.ps_replicas=1", "parallel=model", "cluster.num_workers=2",
      "parallel.stages=2"], "cluster.ps_replicas=1"),
])
def test_bad_replica_configs_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        compose(overrides)


def test_a_ring_slot_is_written_again_only_once_the_backup_applied_it():
    """A large shard's gradient to a backup on its host (psrpc/ps/ring.py): the backup reads
    what the primary wrote; with every slot still to be applied the gradient goes in the
    message instead (None) and nothing the backup has yet to read is overwritten; the run's
    clean-up removes the ring."""
    from psrpc.cluster import shm
    from psrpc.ps import ring

    run = shm.new_run()
    try:
        r = ring.Ring(run, 3, 5)
        ops = [("count",), ("step", torch.full((5,), 1.0), 1.0)]
        first = ring.ringed(r, 1, ops)
        assert first[0] == ("count",) and isinstance(first[1][1], ring.InRing)
        assert torch.equal(ring.read(first[1][1]), torch.full((5,), 1.0))  # (the backup)
        second = ring.ringed(r, 2, [("step", torch.full((5,), 2.0), 1.0)])
        assert isinstance(second[0][1], ring.InRing)
        third = [("step", torch.full((5,), 3.0), 1.0)]
        assert ring.ringed(r, 3, third) is third  # slot of update 1: not applied yet
        assert torch.equal(ring.read(first[1][1]), torch.full((5,), 1.0))
        ring.applied(first, 1)
        again = ring.ringed(r, 3, third)
        assert again[0][1].slot == first[1][1].slot
        assert torch.equal(ring.read(again[0][1]), torch.full((5,), 3.0))
        half = [("step", torch.ones(5, dtype=torch.bfloat16), 1.0)]
        assert ring.ringed(r, 4, half) is half  # not float32: in the message
        assert (shm.directory() / r.name).exists()
    finally:
        shm.remove(run)
    assert not (shm.directory() / r.name).exists()
    ring.forget(3)


def test_a_backlog_applies_in_order_and_completes_each_future_once():
    """Backlog.take: updates more than WINDOW ahead of the last applied one wait; taken inline
    (a side channel's reader, a backup just built taking the updates that came first) they are
    applied in this thread, in seq order, and each take's Future completes exactly once (a
    second completion raises); out of order, the missing one is waited for."""
    from types import SimpleNamespace
    from psrpc.ps.backup import Backlog
    from psrpc.ps.replicas import Update

    applied = []
    shard = SimpleNamespace(index=3, name="ps0/shard3",
                            apply_update=lambda u: applied.append(u.seq))
    log = Backlog(shard)
    u = [Update(3, s, s, [], {}, [], 100) for s in range(1, 11)]
    first = log.take(u[:6][::-1])  # 6 at once: past the window, all applied here
    assert first.done() and applied == [1, 2, 3, 4, 5, 6] and log.applied == 6
    late = log.take([u[8]], inline=False)  # 9 before 8: held, nothing applied yet
    assert late.done() and applied == [1, 2, 3, 4, 5, 6]
    log.take([u[6], u[7]], inline=True)  # 7 and 8 here, then 9 that was waiting for them
    log.drain(5.0)
    assert applied == [1, 2, 3, 4, 5, 6, 7, 8, 9] and log.applied == 9
    log.close()

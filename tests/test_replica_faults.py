"""cluster.ps_replicas under a second fault: a backup that stalls (SIGSTOP: hung, not dead) is
given up and fenced, never promoted later; a primary killed between its sends to two backups
fails over to the most advanced copy; a copy onto a PS that still holds a given-up backup
replaces it. The checker is always the uninterrupted run of the same config, bit for bit (a
roll back to a checkpoint is exact too), never the summary's word for it."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import assert_equal_model, run_cluster
from tests.test_elastic import _children_named

pytestmark = pytest.mark.timeout(400)

# 3 PS, 2 shards (ps1: shard 0, ps0: shard 1); backups: ps0's on ps1, ps1's on ps2, so ps2 holds
# no primary and stopping it stalls only ps1's replication
THREE_PS = ["cluster.num_ps=3", "cluster.num_workers=2", "train.steps=400", "train.log_every=1",
            "fault.slow_worker=1", "fault.slow_s=0.01"]
REPLICAS = ["cluster.ps_replicas=1"]
GAVE_UP = "did not take an update"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run_cluster(tmp_path_factory.mktemp("plain"), THREE_PS)


def _steps(out: Path) -> int:
    metrics = out / "metrics.jsonl"
    return metrics.read_text().count("\n") if metrics.exists() else 0


def _wait(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _one(name: str):
    (p,) = _children_named({name})  # this test's own rank, never another run's
    return p


def _in_log(out: Path, rank: str, text: str) -> bool:
    log = out / "logs" / f"{rank}.log"
    return log.exists() and text in log.read_text()


def _in_background(script) -> tuple[threading.Thread, list]:
    done: list = []
    t = threading.Thread(target=lambda: done.append(script()), daemon=True)
    t.start()
    return t, done


def _stall_ps2_until_given_up(out: Path) -> bool:
    """SIGSTOP ps2 (ps1's backup) at step 20 until ps1 gives it up, then SIGCONT."""
    if not _wait(lambda: _steps(out) >= 20, 120):
        return False
    ps2 = _one("psrpc-ps2")
    ps2.send_signal(signal.SIGSTOP)
    try:
        return _wait(lambda: _in_log(out, "ps1", GAVE_UP), 120)
    finally:
        ps2.send_signal(signal.SIGCONT)


def test_a_given_up_backup_is_never_promoted_the_run_rolls_back_exactly(tmp_path,
                                                                         uninterrupted):
    """ps1's backup on ps2 hangs until ps1 gives it up, comes back, then ps1 is killed: the
    stale copy (it lacks every update since) is fenced, so every shard rolls back to the
    checkpoint, with a line, and the result is the uninterrupted run's."""
    out = tmp_path / "run"

    def script():
        stalled = _stall_ps2_until_given_up(out)
        time.sleep(1.0)  # ps2 reads what it still holds; training goes on
        _one("psrpc-ps1").kill()
        return stalled

    t, done = _in_background(script)
    summary, state = run_cluster(out, THREE_PS + REPLICAS + [
        "checkpoint.every_steps=10", f"checkpoint.dir={tmp_path / 'ck'}"], timeout_s=380)
    t.join(5)
    assert done == [True], "the fault was not delivered"
    (epoch,) = summary["epochs"]
    assert epoch["rolled_back_to"] is not None and epoch["failovers"] == [], epoch
    assert _in_log(out, "worker0", "were given up by its primary")
    assert summary["steps"] == 400
    assert_equal_model(state, uninterrupted[1])


def test_a_hung_backup_is_given_up_and_training_goes_on(tmp_path, uninterrupted):
    """Over TensorPipe (cluster.shm=off), with update.timeout_s=5: the workers' calls (65 s)
    outlast the backup's acknowledgement bound, so the hung backup is given up, not the run;
    hung to the end, the end's comparison of the copies says it could not tell (agree null),
    and model.pt and summary.json are written all the same."""
    out = tmp_path / "run"

    def script():
        if not _wait(lambda: _steps(out) >= 20, 120):
            return False
        ps2 = _one("psrpc-ps2")
        ps2.send_signal(signal.SIGSTOP)  # (the launcher's teardown ends it at the end)
        return _wait(lambda: _in_log(out, "ps1", GAVE_UP), 120)

    t, done = _in_background(script)
    summary, state = run_cluster(out, THREE_PS + REPLICAS + [
        "cluster.shm=off", "update.timeout_s=5"], timeout_s=380)
    t.join(5)
    assert done == [True], "the fault was not delivered"
    assert summary["steps"] == 400 and summary["epochs"] == []
    assert summary["replicas"]["agree"] is None and summary["replicas"]["why"]
    assert_equal_model(state, uninterrupted[1])


def test_a_new_copy_replaces_a_given_up_backup_on_its_ps(tmp_path, uninterrupted):
    """ps2's backup of shard 0 is given up; then ps0 is killed (shard 1 fails over to ps1):
    the epoch drops the given-up copy and copies shard 0 to ps2 again, and that copy takes
    every update sent meanwhile (it equals its primary at the end); the result is the
    uninterrupted run's."""
    out = tmp_path / "run"

    def script():
        stalled = _stall_ps2_until_given_up(out)
        time.sleep(1.0)
        _one("psrpc-ps0").kill()
        return stalled and _wait(lambda: _in_log(out, "worker0", "a new backup on ps2"), 120)

    t, done = _in_background(script)
    summary, state = run_cluster(out, THREE_PS + REPLICAS, timeout_s=380)
    t.join(5)
    assert done == [True], "the fault was not delivered"
    copies = summary["replicas"]["copies"]
    assert copies["0"]["backups"] == ["ps2"] and copies["0"]["given_up"] == [], copies
    assert summary["replicas"]["agree"] is True
    assert summary["steps"] == 400 and summary["inexact"] == []
    assert_equal_model(state, uninterrupted[1])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_backups_a_primary_killed_between_its_sends_fails_over_to_the_most_advanced(
        tmp_path, uninterrupted, mode):
    """cluster.ps_replicas=2: ps1 dies after sending an update to one backup, before the
    other. The copy that has it is promoted, the other (one behind) dropped and copied again;
    nobody waits for an update that never comes, no two histories of the shard. Sync: the
    uninterrupted run's result."""
    summary, state = run_cluster(tmp_path, THREE_PS + [
        f"update={mode}", "cluster.ps_replicas=2", "fault.crash_role=ps", "fault.crash_index=1",
        "fault.crash_at_step=30", "fault.crash_point=between_backups"], timeout_s=380)
    (epoch,) = summary["epochs"]
    assert epoch["rolled_back_to"] is None and epoch["failovers"], epoch
    assert summary["steps"] == 400 and summary["replicas"]["agree"] is True
    assert all(len(c["backups"]) == 2 for c in summary["replicas"]["copies"].values())
    if mode == "sync":
        assert_equal_model(state, uninterrupted[1])


def test_a_hung_ps_counts_no_worker_lost_the_result_is_the_uninterrupted_runs(tmp_path):
    """ps1, a primary, is stopped (SIGSTOP) for 6 s, three times update.timeout_s: the
    workers' pushes wait in its sockets. When it runs again its rounds do not close without
    them (its own clock stood still: slow is not dead), and the result is the uninterrupted
    run's, with no round short."""
    out = tmp_path / "run"

    def script():
        if not _wait(lambda: _steps(out) >= 20, 120):
            return False
        ps1 = _one("psrpc-ps1")
        ps1.send_signal(signal.SIGSTOP)
        time.sleep(6.0)
        ps1.send_signal(signal.SIGCONT)
        return True

    # worker1 is 0.2 s slower each step: ps1 is stopped with a round open, worker1's push
    # waiting in its socket
    slow = THREE_PS[:4] + ["train.steps=60", "fault.slow_worker=1", "fault.slow_s=0.2"]
    t, done = _in_background(script)
    summary, state = run_cluster(out, slow + ["update.timeout_s=2"], timeout_s=380)
    t.join(5)
    assert done == [True], "the fault was not delivered"
    assert summary["workers_lost"] == 0 and summary["inexact"] == [], summary["inexact"]
    assert_equal_model(state, run_cluster(tmp_path / "plain", slow)[1])


def test_the_update_rules_clock_stands_still_while_the_process_is_stopped():
    """liveness.running_time: a process stopped for 2 s sees (nearly) no time pass on it,
    while its monotonic clock does."""
    code = ("import time, sys; from psrpc.ps.liveness import Watchdog, running_time\n"
            "w = Watchdog(lambda: None, 0.05, 'test'); r0, m0 = running_time(), time.monotonic()\n"
            "print('ready', flush=True); sys.stdin.readline(); time.sleep(0.3)\n"
            "print(running_time() - r0, time.monotonic() - m0, flush=True)\n")
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGSTOP)
        time.sleep(2.0)
        p.send_signal(signal.SIGCONT)
        p.stdin.write("\n")
        p.stdin.flush()
        ran, passed = map(float, p.stdout.readline().split())
    finally:
        p.kill()
        p.wait(5)
    assert passed > 2.0 and ran < 1.5, (ran, passed)


def test_a_backup_refuses_an_update_number_it_has_from_another_primary():
    """Two histories of one shard: update 3 applied from primary "a" and then update 3 from
    primary "b" is refused (the Future fails, nothing applied); the same update sent again by
    "a" is taken silently, and "b"'s update 4 goes on from there."""
    from types import SimpleNamespace

    from psrpc.ps.backup import Backlog
    from psrpc.ps.replicas import Update

    applied = []
    shard = SimpleNamespace(index=3, name="ps0/shard3",
                            apply_update=lambda u: applied.append((u.seq, u.origin)))
    log = Backlog(shard)
    log.take([Update(3, s, s, [], {}, [], 100, "a") for s in (1, 2, 3)])
    clash = log.take([Update(3, 3, 3, [], {}, [], 100, "b")])
    with pytest.raises(Exception, match="refused update 3 from primary b"):
        clash.wait()
    assert log.take([Update(3, 3, 3, [], {}, [], 100, "a")]).done()  # (sent again)
    log.take([Update(3, 4, 4, [], {}, [], 100, "b")])
    log.drain(5.0)
    assert applied == [(1, "a"), (2, "a"), (3, "a"), (4, "b")]
    log.close()


def test_a_dropped_backup_takes_the_updates_held_for_its_copy_with_it():
    """replicas.drop_backup: the updates that came for a copy not built yet (_EARLY) are
    failed and forgotten, not left for the next copy of the shard on this PS."""
    from psrpc.ps import replicas

    fut = torch.futures.Future()
    replicas._EARLY.setdefault(7, {})[1] = (object(), fut)
    assert replicas.drop_backup(7) is False  # (none registered: only the early updates)
    assert 7 not in replicas._EARLY and fut.done()
    with pytest.raises(Exception, match="dropped"):
        fut.wait()


def test_dense_allreduce_a_worker_lost_for_good_leaves_the_workers_group(tmp_path):
    """update.dense=allreduce, 3 workers: worker2 dies with no restart left. The workers' own
    group must form again without it: the launcher announces an epoch for that alone, the
    others average among themselves, the run ends with its outputs, and the summary names the
    lost worker as why the result is not an uninterrupted run's."""
    from tests.test_sparse_cluster import CLICKS

    summary, _ = run_cluster(tmp_path, CLICKS + [
        "update.dense=allreduce", "cluster.num_ps=2", "cluster.num_workers=3",
        "train.steps=40", "cluster.max_worker_restarts=0", "fault.crash_role=worker",
        "fault.crash_index=2", "fault.crash_at_step=10"], timeout_s=300, fast=False)
    assert summary["steps"] == 40 and summary["workers_lost"] == 1
    assert any("worker2" in why for why in summary["inexact"]), summary["inexact"]
    (epoch,) = summary["epochs"]
    assert epoch["started_again"].startswith("nobody"), epoch


def test_a_reply_waits_for_a_backup_that_went_live_after_its_push():
    """A round's first push comes while the shard's only backup is still being copied (no live
    backup: nothing to wait for then); the copy completes and goes live before the round
    closes, so the update that round sends it must be held before any reply carries it (a
    worker answered first, with the primary killed then, had seen an update its new primary
    lacks). The backup's pending acknowledgement stands in the journal as `commit` leaves it."""
    from psrpc.ps.replicas import Journal
    from tests.unit_helpers import make_shard, push, sync
    shard = make_shard(sync(), workers=2)
    shard.journal = Journal(shard, [], copy_timeout_s=10)
    first = push(shard, 0, 0, [1.0, 1.0, 1.0, 1.0])
    backup_has_it = torch.futures.Future()
    shard.journal._acks[1] = backup_has_it  # the live backup's ack of update 1, not yet in
    second = push(shard, 1, 0, [1.0, 1.0, 1.0, 1.0])  # closes the round: version 1
    assert shard.version == 1 and not first.done() and not second.done()
    backup_has_it.set_result(True)
    assert first.wait().version == 1 and second.wait().version == 1


def test_a_worker_with_nothing_to_replay_computes_only_on_shards_at_one_version():
    """After a failover the shards a lost PS held are a step behind until the other workers'
    replays close that round. A worker started again (its push of that step died with the PS)
    must not compute on parameters of two versions and push into that round as if of one (a
    silent divergence, fault campaign schedule 108): it pulls again until the shards are level.
    Not in lockstep (backup workers, async), shards apart are normal: no wait."""
    from types import SimpleNamespace

    from psrpc.worker.data_parallel import Worker

    seen = iter([[299, 298, 299], [299, 298, 299], [299, 299, 299]])
    tables = iter([[299, 298], [299, 298], [299, 299]])
    pulls = []

    def load(replies):
        worker.table_versions = next(tables)
        return replies

    worker = SimpleNamespace(allreduce=None, lockstep=True, index=2, table_versions=[299, 298],
                             cfg=SimpleNamespace(update=SimpleNamespace(timeout_s=5.0)),
                             client=SimpleNamespace(pull=lambda: pulls.append(1) or next(seen)),
                             load=load)
    replies, versions = Worker.level(worker, [299, 298, 299], [299, 298, 299])
    assert versions == [299, 299, 299] and worker.table_versions == [299, 299]
    assert len(pulls) == 3
    worker.lockstep, pulls[:] = False, []
    assert Worker.level(worker, [5, 4], [5, 4]) == ([5, 4], [5, 4]) and pulls == []

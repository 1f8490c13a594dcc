"""Elastic membership over real clusters (local launcher): a worker killed with SIGKILL is
started again and rejoins the running job (no checkpoint restored); a PS killed after a
checkpoint is started again and every shard rolls back to it; the chief's death restarts the
group from the checkpoint; every process is named after its rank."""

import json
import logging
import re
import shutil
import threading
import time

import psutil
import pytest

from tests.conftest import assert_equal_model, compose, read_outputs, run_cluster

pytestmark = pytest.mark.timeout(300)


def _rejoined(summary, worker: int = 2):
    """Its epochs' records, and whether the worker pushed again after each rejoin."""
    epochs = summary["epochs"]
    final = int(summary["shards"][0]["per_worker_applied"].get(str(worker), 0))
    grew = all(final > int(e["applied_before"].get(str(worker), 0)) for e in epochs)
    return epochs, grew


MODES = {"sync": ["update=sync"], "async": ["update=async"],
         "async-bounded": ["update=async", "update.max_staleness=4"]}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_killed_worker_rejoins_the_running_job(tmp_path, mode):
    summary, _ = run_cluster(tmp_path, [
        *MODES[mode], "cluster.num_workers=3", "train.steps=120",
        "fault.crash_role=worker", "fault.crash_index=2", "fault.crash_at_step=20"])
    epochs, grew = _rejoined(summary)
    assert summary["steps"] == 120 and summary["restored_from_step"] is None
    assert summary["workers_rejoined"] == 1 and summary["workers_lost"] == 0
    assert [e["started_again"] for e in epochs] == ["worker2"]
    assert epochs[0]["rolled_back_to"] is None and 0 < epochs[0]["pause_s"] < 30
    # It pushed again: certain where the others wait for it (sync rounds; the staleness clock
    # lets them go at most 4 steps past it). Unbounded async waits for nobody: the survivors
    # can finish the run while it makes its data, so there it is not asserted.
    assert grew or mode == "async"
    if mode == "sync":  # no round waited for the dead worker until update.timeout_s
        assert "update.timeout_s" not in (tmp_path / "logs" / "ps0.log").read_text()


def _children_named(names) -> list:
    """This test's processes (the ranks its launcher forked) named psrpc-<rank> in `names`:
    never another run's on the same machine."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name() in names:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def _kill_when(name: str, ready, timeout_s: float = 60) -> threading.Thread:
    """A thread that SIGKILLs this test's process `name` (psrpc-<rank>) once `ready()` holds."""

    def run():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                for p in _children_named([name]):
                    p.kill()
                    return
            time.sleep(0.1)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_the_same_worker_killed_twice_rejoins_twice(tmp_path):
    """The second kill comes from outside (kill -9 of the process named psrpc-worker2), once
    the first rejoin is in the chief's log."""
    log = tmp_path / "logs" / "worker0.log"
    killer = _kill_when("psrpc-worker2", lambda: log.exists()
                        and "membership epoch 1:" in log.read_text())
    summary, _ = run_cluster(tmp_path, [
        "cluster.num_workers=3", "train.steps=400", "fault.slow_worker=1", "fault.slow_s=0.02",
        "fault.crash_role=worker", "fault.crash_index=2", "fault.crash_at_step=20"])
    killer.join(1)
    epochs, grew = _rejoined(summary)
    assert summary["steps"] == 400 and summary["workers_rejoined"] == 2
    assert [e["epoch"] for e in epochs] == [1, 2] and grew


def test_a_killed_ps_recovers_in_place_and_equals_a_run_restored_from_that_checkpoint(tmp_path):
    """Every shard rolls back to the last committed step (the PS's from its files, the others
    from theirs) and training goes on: bit for bit what a run restored from that step gives."""
    mode = ["cluster.num_ps=2", "cluster.num_workers=2", "train.steps=60",
            "checkpoint.every_steps=10", "checkpoint.keep=100"]
    ck = tmp_path / "ck"
    summary, state = run_cluster(tmp_path / "killed", mode + [
        f"checkpoint.dir={ck}", "fault.crash_role=ps", "fault.crash_index=1",
        "fault.crash_at_step=35"])
    (epoch,) = summary["epochs"]
    # step 30 unless its commit had not landed 5 steps (milliseconds) later: the newest
    # committed step, either way
    back = epoch["rolled_back_to"]
    assert epoch["started_again"] == "ps1" and back in (20, 30)
    assert summary["steps"] == 60 and all(s["version"] == 60 for s in summary["shards"])
    shutil.copytree(ck / f"step-{back}", tmp_path / "from" / f"step-{back}")
    restored = run_cluster(tmp_path / "restored", mode + [f"checkpoint.dir={tmp_path / 'from'}"])
    assert restored[0]["restored_from_step"] == back
    assert_equal_model(state, restored[1])


def test_the_chiefs_death_restarts_the_group_from_the_last_checkpoint(tmp_path):
    """As TensorFlow's MonitoredTrainingSession: the chief's session is gone with it, so every
    process starts again and training resumes from the last committed checkpoint."""
    summary, _ = run_cluster(tmp_path, [
        "train.steps=60", "checkpoint.every_steps=10", f"checkpoint.dir={tmp_path / 'ck'}",
        "fault.crash_role=worker", "fault.crash_index=0", "fault.crash_at_step=35"])
    # step 30 unless its commit had not landed when the chief died at 35 (a loaded machine):
    # the last committed step, either way
    assert summary["steps"] == 60 and summary["restored_from_step"] in (20, 30)


def test_every_process_is_named_after_its_rank_and_logs_its_pid(tmp_path):
    names = {}
    log = tmp_path / "logs" / "worker0.log"
    seen = threading.Event()

    def watch():
        while not seen.is_set():
            for p in _children_named({"psrpc-ps0", "psrpc-worker0", "psrpc-worker1",
                                      "psrpc-worker2"}):  # this test's: not another run's
                try:
                    names[p.name()] = p.pid
                except psutil.NoSuchProcess:
                    pass
            if len(names) == 3:
                seen.set()
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    run_cluster(tmp_path, ["train.steps=200", "fault.slow_worker=1", "fault.slow_s=0.01"])
    seen.set()
    assert set(names) == {"psrpc-ps0", "psrpc-worker0", "psrpc-worker1"}
    for rank, pid in names.items():
        first = (tmp_path / "logs" / f"{rank[6:]}.log").read_text().splitlines()[0]
        assert f"is pid {pid} (process name {rank})" in first


def _kill_together(names, ready, gap_s: float = 0.0, timeout_s: float = 120) -> list:
    """SIGKILL this test's processes named `names`, one right after the other (`gap_s` apart),
    once `ready()` holds, from a thread. Returns the list the killed pids are appended to."""
    killed: list[int] = []

    def run():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                for p in _children_named(names):
                    p.kill()
                    killed.append(p.pid)
                    time.sleep(gap_s)
                return
            time.sleep(0.05)

    threading.Thread(target=run, daemon=True).start()
    return killed


def _chief_step(tmp_path) -> int:
    """The last step the chief has logged (0 before the first)."""
    log = tmp_path / "logs" / "worker0.log"
    steps = re.findall(r"step\s+(\d+)/", log.read_text()) if log.exists() else []
    return int(steps[-1]) if steps else 0


def _started_again(summary) -> list[str]:
    return sorted(n for e in summary["epochs"] for n in e["started_again"].split(","))


@pytest.mark.parametrize("gap_s", [0.0, 0.1], ids=["same-ms", "100ms-apart"])
def test_two_workers_killed_together_both_rejoin(tmp_path, gap_s):
    """The second death's wake-up (SIGUSR1) can reach the first one's replacement before it
    has a handler: it must not kill it, and every rank joins the newest epoch, not the one it
    was started for (two groups would form and neither complete). 100 ms apart the launcher
    sees the deaths in two polls: two epochs, the first replaced before its group forms."""
    killed = _kill_together(["psrpc-worker1", "psrpc-worker2"],
                            lambda: _chief_step(tmp_path) >= 60, gap_s)
    t0 = time.monotonic()
    summary, _ = run_cluster(tmp_path, [
        "cluster.num_workers=3", "train.steps=300", "cluster.init_timeout_s=20",
        "fault.slow_worker=1", "fault.slow_s=0.02"], timeout_s=150)
    assert len(killed) == 2
    assert summary["steps"] == 300 and summary["workers_lost"] == 0
    assert _started_again(summary) == ["worker1", "worker2"]
    assert summary["workers_rejoined"] == 2
    assert time.monotonic() - t0 < 120


def test_a_ps_and_a_worker_killed_together_recover(tmp_path):
    """A PS and a worker SIGKILLed in the same moment: both are started again, every shard
    rolls back to the last committed checkpoint and training ends."""
    ck = tmp_path / "ck"
    killed = _kill_together(["psrpc-ps1", "psrpc-worker2"],
                            lambda: (ck / "step-50" / "manifest.json").exists())
    summary, _ = run_cluster(tmp_path, [
        "cluster.num_ps=2", "cluster.num_workers=3", "train.steps=200", f"checkpoint.dir={ck}",
        "checkpoint.every_steps=50", "cluster.max_ps_restarts=1", "cluster.init_timeout_s=20",
        "fault.slow_worker=1", "fault.slow_s=0.02"], timeout_s=150)
    assert len(killed) == 2
    assert summary["steps"] == 200 and all(s["version"] == 200 for s in summary["shards"])
    assert _started_again(summary) == ["ps1", "worker2"]
    assert summary["epochs"][-1]["rolled_back_to"] in (50, 100, 150)


def test_a_worker_killed_during_the_final_evaluation_is_not_started_again(tmp_path, caplog):
    """Training is over (the chief evaluates the final model): a worker lost now is not
    started again (the chief would never join that epoch and the others would wait for it):
    the run ends with its outputs."""
    caplog.set_level(logging.WARNING, logger="psrpc")
    killed = _kill_together(["psrpc-worker1"], lambda: _chief_step(tmp_path) >= 20
                            and (time.sleep(1.0) or True))  # into the final evaluation
    t0 = time.monotonic()
    summary, state = run_cluster(tmp_path, [
        "model=cnn", "data.test_size=20000", "train.steps=20"], timeout_s=120)
    assert len(killed) == 1 and state
    assert summary["steps"] == 20 and summary["workers_rejoined"] == 0
    assert summary["test_accuracy"] is not None
    assert "worker1 died (killed by SIGKILL) after training ended; not started again" in caplog.text
    assert time.monotonic() - t0 < 90


@pytest.mark.timeout(150)
@pytest.mark.parametrize("lost", [2, 1], ids=["the-last-worker", "a-worker-before-another"])
def test_a_worker_lost_for_good_leaves_the_membership_and_a_later_ps_failover_forms(tmp_path,
                                                                                  lost):
    """A worker dies with no restart left (lost for good), then ps1 is killed from outside:
    the failover's epoch forms without it (it is out of every later epoch; the ranks after it
    are numbered one lower there), training ends, and the summary still counts it lost."""
    killer = _kill_when("psrpc-ps1", lambda: _chief_step(tmp_path) >= 30
                        and f"worker{lost}" in (tmp_path / "logs" / "ps0.log").read_text(), 90)
    t0 = time.monotonic()
    summary, _ = run_cluster(tmp_path, [
        "cluster.num_ps=2", "cluster.num_workers=3", "cluster.ps_replicas=1",
        "cluster.max_worker_restarts=0", "cluster.init_timeout_s=15", "update.timeout_s=2",
        "train.steps=200", "fault.slow_worker=1", "fault.slow_s=0.02",
        "fault.crash_role=worker", f"fault.crash_index={lost}", "fault.crash_at_step=10"],
        timeout_s=120)
    killer.join(1)
    assert summary["steps"] == 200 and summary["workers_lost"] == 1
    (epoch,) = summary["epochs"]
    assert epoch["started_again"] == "ps1" and epoch["failovers"]
    assert epoch["rolled_back_to"] is None and epoch["at_step"] >= 30
    assert time.monotonic() - t0 < 100
    # each shard waited update.timeout_s for worker2 once; the epoch's shards know it gone
    waits = sum(p.read_text().count(f"going on without worker{lost}")
                for p in (tmp_path / "logs").glob("ps*.log"))
    assert waits <= len(summary["shards"]), waits

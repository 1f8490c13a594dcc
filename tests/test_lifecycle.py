"""Start and end of a run: init timeouts, early stop from a hook, SIGTERM to the launcher, and
torchrun restarting the group after a kill -9 (training resumes from the last checkpoint)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Optional
from pathlib import Path

import pytest

from psrpc.launch import ClusterFailed, launch
from tests.cluster_helpers import SlowChiefWorker
from tests.conftest import FAST, ROOT, _process_table, compose, run_cluster

pytestmark = pytest.mark.timeout(300)


def test_workers_time_out_waiting_for_the_chief_with_a_clear_message(tmp_path):
    cfg = compose(FAST + ["cluster.init_timeout_s=5"])
    with pytest.raises(ClusterFailed, match=r"worker1: no plan from the chief \(worker0\) after "
                                            r"waiting up to 5 s \(cluster.init_timeout_s\)"):
        launch(cfg, tmp_path, timeout_s=60, replica_cls=SlowChiefWorker)


@pytest.mark.parametrize("mode", [
    [],  # sync, the chief in every round: it stops exactly there
    ["update=async", "cluster.num_ps=2", "cluster.bucket_bytes=0"],
    ["update=async", "update.max_staleness=1", "cluster.num_ps=2", "cluster.bucket_bytes=0"],
], ids=["sync", "async", "async-bounded"])
def test_user_hook_from_config_stops_every_shard_at_one_step(tmp_path, mode):
    """Stopping early ends every shard at the same step (shards can be apart or moving when
    the chief asks), so the final checkpoint, which needs all of them, is committed."""
    summary, _ = run_cluster(tmp_path, mode + [
        "train.steps=1000", f"checkpoint.dir={tmp_path / 'ck'}",
        "hooks=[{_target_: psrpc.hooks.StopAtStep, last_step: 30}]"])
    steps = summary["steps"]
    assert summary["stopped_early"] and (steps == 30 if not mode else 30 <= steps < 100)
    assert all(s["version"] == steps for s in summary["shards"])
    assert (tmp_path / "ck" / f"step-{steps}" / "manifest.json").exists()


def _descendants(pid: int) -> list[int]:
    table, out, todo = _process_table(), [], [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, (pp, state) in table.items() if pp == parent and state != "Z"]
        out += kids
        todo += kids
    return out


LIMIT_S = 20.0  # SIGTERM to every process gone: 3-6 s idle, past 10 s seen under the full suite


def _wait_for(path: Path, timeout: float, out: Optional[Path] = None) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared{_tails(out)}"
        time.sleep(0.2)


def _tails(out: Optional[Path]) -> str:
    """The end of each rank's log under out/logs (for a failure's diagnosis)."""
    if out is None or not (out / "logs").is_dir():
        return ""
    return "".join(f"\n--- {f.name}\n" + "\n".join(f.read_text().splitlines()[-15:])
                   for f in sorted((out / "logs").glob("*.log")))


def _alive(pids: list[int]) -> list[int]:
    table = _process_table()  # one snapshot: a pid may vanish between two reads
    return [p for p in pids if p in table and table[p][1] != "Z"]


def test_sigterm_to_launcher_commits_the_step_it_stopped_at_and_every_process_is_gone(tmp_path):
    """resnet18 with a 10,000-image test split: evaluating it takes about 9 s here (0.94 s per
    1,000 32x32 images on one thread, measured), which a stop on a signal must not spend. The
    final checkpoint comes first, evaluation is skipped, and the launcher, its forkserver and
    every rank are gone within seconds of the SIGTERM (LIMIT_S: room for a loaded machine; the
    skipped evaluation is checked apart), the launcher last."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "psrpc", "model=resnet18", "data.image_shape=[3,32,32]",
         "data.size=512", "data.test_size=10000", "train.batch_size=8", "train.steps=1000000",
         "train.log_every=10", f"checkpoint.dir={ck}", "checkpoint.every_steps=10",
         f"out_dir={out}"],  # output to a file: a pipe nobody reads could fill and block it
        cwd=tmp_path, stdout=(tmp_path / "output.txt").open("w"), stderr=subprocess.STDOUT)
    try:
        _wait_for(ck / "step-10" / "manifest.json", 150, out)
        family = [proc.pid] + _descendants(proc.pid)
        assert len(family) >= 6  # launcher, forkserver, resource tracker, ps0, worker0, worker1
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        while proc.poll() is None and time.monotonic() - t0 < LIMIT_S:
            time.sleep(0.02)
        left_at_exit = _alive(family[1:])
        while _alive(family) and time.monotonic() - t0 < LIMIT_S:
            time.sleep(0.1)
        took = time.monotonic() - t0
        assert not _alive(family), (f"still running {LIMIT_S} s after SIGTERM: {_alive(family)}"
                                    f"{_tails(out)}")
        assert not left_at_exit, f"the launcher exited before {left_at_exit}"
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = (tmp_path / "output.txt").read_text()
    print(f"every process gone {took:.1f} s after SIGTERM")
    assert proc.returncode != 0 and "stopped by SIGTERM" in output, output[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_early"] and summary["steps"] >= 10
    assert summary["test_accuracy"] is None  # not evaluated
    final = ck / f"step-{summary['steps']}"
    assert (final / "manifest.json").exists() and (final / "buffers.pt").exists(), output[-2000:]
    assert (out / "model.pt").exists()


def test_sigterm_with_a_lost_worker_still_commits_the_final_checkpoint_at_once(tmp_path):
    """worker1 was killed earlier (async: the others went on). After SIGTERM the chief must not
    wait update.timeout_s (60 s) for worker1's done report, before its final checkpoint or after."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "psrpc", "update=async", "update.timeout_s=60",
         "cluster.max_worker_restarts=0", "train.steps=1000000", "fault.crash_role=worker", "fault.crash_index=1",
         "fault.crash_at_step=3", f"checkpoint.dir={ck}", "checkpoint.every_steps=50",
         f"out_dir={out}"],  # output to a file: a pipe nobody reads could fill and block it
        cwd=tmp_path, stdout=(tmp_path / "output.txt").open("w"), stderr=subprocess.STDOUT)
    try:
        _wait_for(ck / "step-50" / "manifest.json", 120, out)
        # worker1 starts its first step only once it has made its data (about a second on
        # two busy cores): the signal waits for its death, or it could still be alive then
        deadline = time.monotonic() + 60
        while "worker1 died" not in (tmp_path / "output.txt").read_text():
            assert time.monotonic() < deadline, f"worker1 never died{_tails(out)}"
            time.sleep(0.2)
        family = [proc.pid] + _descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        while _alive(family) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert not _alive(family), f"still running 10 s after SIGTERM: {_alive(family)}"
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = (tmp_path / "output.txt").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_early"] and summary["workers_lost"] == 1, output[-2000:]
    assert (ck / f"step-{summary['steps']}" / "manifest.json").exists()


def test_ranks_wait_for_the_chiefs_stop_while_it_answers(monkeypatch):
    """After SIGTERM a PS must stay while the chief writes its final checkpoint and model.pt
    from the shards: as long as the chief answers, for longer than the launchers' own grace
    (torchrun kills 30 s after its SIGTERM), so that the launcher decides, not this timer."""
    from psrpc import process
    from psrpc.cluster import comm
    from psrpc.cluster.topology import Topology

    pings = []

    def ping(to, fn, *args, **kwargs):  # the chief answers, then says stop
        pings.append(to)
        if len(pings) == 2:
            process.stop_serving(True)
        return "finishing"

    monkeypatch.setattr(comm, "call_sync", ping)
    monkeypatch.setattr(process, "_TERMINATING", [time.monotonic() - 29])  # signal 29 s ago
    monkeypatch.setattr(process, "_STOP", threading.Event())
    monkeypatch.setattr(process, "_GRACEFUL", [True])
    assert process._wait_for_stop(Topology(1, 2).with_rank(0)) is True
    assert pings == ["worker0"] * 2


def test_ranks_leave_a_chief_stuck_in_training_after_the_signal(monkeypatch, caplog):
    """A chief that cannot end its step (e.g. at a barrier for a dead worker) is left, so that
    it fails and torchrun can restart the group without waiting for its SIGKILL."""
    from psrpc import process
    from psrpc.cluster import comm
    from psrpc.cluster.topology import Topology

    monkeypatch.setattr(comm, "call_sync", lambda *a, **k: "training")
    monkeypatch.setattr(process, "_TERMINATING", [time.monotonic() - process.STOP_WAIT_S - 1])
    monkeypatch.setattr(process, "_STOP", threading.Event())
    assert process._wait_for_stop(Topology(1, 2).with_rank(0)) is False
    assert "no stop from the chief (training) 8 s after the signal; leaving" in caplog.text


def test_ranks_leave_at_once_when_the_chief_is_gone(monkeypatch):
    from psrpc import process
    from psrpc.cluster import comm
    from psrpc.cluster.topology import Topology
    from psrpc.errors import PsrpcError

    def ping(to, fn, *args, **kwargs):
        raise RuntimeError("connection refused")

    monkeypatch.setattr(comm, "call_sync", ping)
    monkeypatch.setattr(process, "_TERMINATING", [time.monotonic()])
    monkeypatch.setattr(process, "_STOP", threading.Event())
    with pytest.raises(PsrpcError, match=r"ps0: lost contact with the chief \(worker0\)"):
        process._wait_for_stop(Topology(1, 2).with_rank(0))


def test_a_ping_failing_during_a_membership_change_rejoins_instead_of_leaving(monkeypatch):
    """The chief can leave the old group for a new epoch's while a PS's ping is under way
    (the launcher's wake-up reaches the ranks one by one): the PS joins that epoch too, and
    pings the chief there, instead of ending with 'lost contact'."""
    from psrpc import process
    from psrpc.cluster import comm, membership
    from psrpc.cluster.topology import Topology

    pings, rejoined = [], []
    stop = threading.Event()

    def ping(to, fn, *args, **kwargs):
        pings.append(to)
        if len(pings) == 1:
            raise RuntimeError("RPC is no longer running")  # the chief left mid-ping
        stop.set()  # in the new group: the chief answers, then says stop
        return "training"

    monkeypatch.setattr(comm, "call_sync", ping)
    monkeypatch.setattr(process, "PING_EVERY_S", 0.01)
    monkeypatch.setattr(process, "_TERMINATING", [])
    monkeypatch.setattr(process, "_STOP", stop)
    monkeypatch.setattr(process, "_GRACEFUL", [True])
    monkeypatch.setattr(membership, "ended", lambda: False)
    monkeypatch.setattr(membership, "wait_change", lambda timeout_s: True)
    monkeypatch.setattr(membership, "rejoin", lambda: rejoined.append(1) or 1)
    assert process._wait_for_stop(Topology(1, 2).with_rank(0)) is True
    assert rejoined == [1] and pings == ["worker0", "worker0"]


def _busy_final_save() -> None:
    signal.signal(signal.SIGTERM, lambda *a: None)  # a chief still busy saving
    time.sleep(60)


def test_second_signal_to_the_launcher_kills_every_child_at_once():
    import multiprocessing as mp

    from psrpc.launch import _Signals, _terminate

    child = mp.get_context("fork").Process(target=_busy_final_save)
    child.start()
    time.sleep(0.5)
    signals = _Signals()
    try:
        threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
        t0 = time.monotonic()
        _terminate([child], grace_s=30, signals=signals)
        assert time.monotonic() - t0 < 5 and child.exitcode == -signal.SIGKILL
    finally:
        signals.restore()
        if child.exitcode is None:
            child.kill()


def _rank_pids(root: int) -> dict[int, int]:
    """{RANK: pid} of the processes torchrun started (not their own children, such as a PS's
    resource tracker, which inherit RANK too)."""
    pids = {}
    for pid in _descendants(root):
        try:
            if not Path(f"/proc/{pid}/comm").read_text().startswith("psrpc-"):
                continue
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ranks = [e for e in env if e.startswith(b"RANK=")]
        if ranks and any(e.startswith(b"LOCAL_RANK=") for e in env):
            pids[int(ranks[0][5:])] = pid
    return pids


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 2], ids=["ps0", "worker1"])
def test_torchrun_restarts_after_kill_9_and_resumes_from_checkpoint(tmp_path, victim):
    ck, out = tmp_path / "ck", tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=3", "--max-restarts=2",
         "-m", "psrpc", "train.steps=2000", "train.log_every=500", f"checkpoint.dir={ck}",
         "checkpoint.every_steps=100", f"out_dir={out}"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        _wait_for(ck / "step-200" / "manifest.json", 150)
        os.kill(_rank_pids(proc.pid)[victim], signal.SIGKILL)
        output = proc.communicate(timeout=200)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2000 and summary["restored_from_step"] >= 200
    assert "restored step" in output

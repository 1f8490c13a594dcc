"""Start and end of a run: init timeouts, early stop from a hook, SIGTERM to the launcher, and
torchrun restarting the group after a kill -9 (training resumes from the last checkpoint)."""

import json
import os
import signal
import subprocess
import sys
import time
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
        launch(cfg, tmp_path, timeout_s=60, worker_cls=SlowChiefWorker)


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


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def test_sigterm_to_launcher_stops_every_process_with_a_final_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    proc = subprocess.Popen(
        [sys.executable, "-m", "psrpc", "train.steps=1000000", f"checkpoint.dir={ck}",
         "checkpoint.every_steps=100", f"out_dir={tmp_path / 'out'}"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(ck / "step-100" / "manifest.json", 120)
        family = [proc.pid] + _descendants(proc.pid)
        assert len(family) >= 4  # launcher, forkserver, ps0, worker0, worker1
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        alive = family
        while alive and time.monotonic() - t0 < 10:
            time.sleep(0.1)
            alive = [p for p in family if p in _process_table()
                     and _process_table()[p][1] != "Z"]
        assert not alive, f"still running 10 s after SIGTERM: {alive}"
        out = proc.communicate(timeout=10)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and "stopped by SIGTERM" in out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["stopped_early"]
    assert (ck / f"step-{summary['steps']}" / "manifest.json").exists()  # the final checkpoint


def _rank_pids(root: int) -> dict[int, int]:
    pids = {}
    for pid in _descendants(root):
        try:
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

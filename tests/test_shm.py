"""Shared memory between colocated workers and PS (cluster.shm): the same bits as TCP, a slot
read only after the push says it is ready, and no segment left in /dev/shm, also when a
process is killed."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from psrpc.cluster import shm
from tests.conftest import assert_equal_model, run_cluster
from tests.unit_helpers import sgd, sync

pytestmark = pytest.mark.timeout(300)


def _ours() -> set[str]:
    return {p.name for p in shm.SHM_DIR.glob("psrpc-*")}


@pytest.mark.parametrize("mode", [
    ["cluster.num_workers=2"],  # sync, every worker in each round: views of the master copy
    ["cluster.num_workers=2", "cluster.num_ps=2", "cluster.bucket_bytes=200000"],
    ["update=async", "cluster.num_workers=1"],  # slots, parameters in the reply
    ["cluster.num_workers=3", "update.replicas_to_aggregate=3", "cluster.max_shard_bytes=60000"],
], ids=["sync", "sync-buckets", "async", "split-tensors"])
def test_shared_memory_gives_the_same_bits_as_tcp(tmp_path, mode):
    before = _ours()
    on = run_cluster(tmp_path / "on", mode + ["cluster.shm=on"])
    off = run_cluster(tmp_path / "off", mode + ["cluster.shm=off"])
    assert "shared memory with the PS" in (tmp_path / "on" / "logs" / "worker0.log").read_text()
    assert_equal_model(on[1], off[1])
    assert _ours() == before  # the launcher removed the run's segments


def test_backup_workers_through_slots_train_to_the_end(tmp_path):
    summary, state = run_cluster(tmp_path, [
        "cluster.num_workers=3", "update.replicas_to_aggregate=2", "cluster.shm=on"])
    assert summary["steps"] == 20 and all(torch.isfinite(v).all() for v in state.values())


def test_a_slot_is_read_only_after_its_push(tmp_path):
    """A worker that dies while writing its slot never pushed: the round closes without it
    (update.timeout_s) and the master copy holds only the others' gradient."""
    from psrpc.ps.shard import Shard, ShardSpec

    run = shm.new_run()
    try:
        shm.create(shm.segment(run, 0, "params"), 4)
        for w in (0, 1):
            shm.create(shm.segment(run, 0, f"g{w}"), 4)
        shard = Shard(ShardSpec(0, torch.zeros(4), sgd(lr=1.0), sync(timeout_s=0.3), 2, 100,
                                shm=("views", run, [0, 1])))
        slot0 = shm.attach(shm.segment(run, 0, "g0"), 4)
        slot1 = shm.attach(shm.segment(run, 0, "g1"), 4)
        slot1.fill_(float("nan"))  # worker1, half way through writing, dies: no push
        slot0.fill_(2.0)
        reply = shard.push_pull(0, 0, shm.SLOT, 1.0, 1).wait()
        assert reply.version == 1 and reply.params.numel() == 0  # it reads the master itself
        master = shm.attach(shm.segment(run, 0, "params"), 4)
        assert torch.equal(master, torch.full((4,), -2.0)) and shard.stats.nan_rejected == 0
        shard.close()
    finally:
        shm.remove(run)


@pytest.mark.parametrize("victim", ["launcher", "psrpc-worker1"])
def test_no_segment_outlives_a_killed_process(tmp_path, victim):
    """SIGKILL of a rank (it rejoins) or of the launcher itself (every rank leaves within a
    second: none trains on as an orphan):
    /dev/shm holds none of the run's segments afterwards (the launcher removes them, or
    multiprocessing's resource tracker does when every process of the run is gone)."""
    before = _ours()
    proc = subprocess.Popen(
        [sys.executable, "-m", "psrpc", "train.steps=100000", "train.device=cpu",
         "cluster.shm=on", f"out_dir={tmp_path / 'out'}"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (_ours() - before) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _ours() - before, "the run made no segment"
        time.sleep(1.0)
        if victim == "launcher":
            os.kill(proc.pid, signal.SIGKILL)
        else:
            import psutil

            (p,) = [p for p in psutil.process_iter(["name"]) if p.info["name"] == victim]
            p.kill()
            time.sleep(3)  # it rejoins; then the run is stopped the ordinary way
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 20
        while _ours() - before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not (_ours() - before), f"left in /dev/shm: {sorted(_ours() - before)}"
        import psutil

        ranks = [p for p in psutil.process_iter(["name", "cwd"])
                 if (p.info["name"] or "").startswith("psrpc-") and p.info["cwd"] == str(tmp_path)]
        assert not ranks, f"ranks outlived the launcher: {ranks}"
    finally:
        if proc.poll() is None:
            proc.kill()

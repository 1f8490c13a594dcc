"""Shared memory between colocated workers and PS (cluster.shm): the same bits as TCP, a slot
read only after the push says it is ready, and no segment left in /dev/shm, also when a
process is killed."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from psrpc.cluster import shm, shmdir
from psrpc.errors import PsrpcError
from tests.conftest import assert_equal_model, run_cluster
from tests.unit_helpers import sgd, sync

pytestmark = pytest.mark.timeout(300)


def _ours(launcher: int = os.getpid()) -> set[str]:
    """The segments of runs whose launcher is `launcher` (a run's segments are named after
    it: psrpc-<pid>x<random>-...), not those of any other psrpc run on this machine."""
    return {p.name for p in shm.directory().glob(f"psrpc-{launcher}x*")}


def _wait_for_segments(launcher: int, timeout_s: float = 120) -> None:
    """Until the run's PS has made its segments (the launcher's lock file comes first)."""
    deadline = time.monotonic() + timeout_s
    while not any(".lock" not in n for n in _ours(launcher)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert any(".lock" not in n for n in _ours(launcher)), "the run made no segment"


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
        shm.create(shm.segment(run, 0, "params"), shm.master_numel(4), b"n" * shm.NONCE_BYTES)
        for w in (0, 1):
            shm.create(shm.segment(run, 0, f"g{w}"), 4, b"n" * shm.NONCE_BYTES)
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
    every rank does as it leaves when the launcher is gone)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "psrpc", "train.steps=100000", "train.device=cpu",
         "cluster.shm=on", f"out_dir={tmp_path / 'out'}"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_segments(proc.pid)
        time.sleep(1.0)
        (lock,) = [n for n in _ours(proc.pid) if n.endswith("-launcher.lock")]
        assert not shmdir._unheld(lock), "the launcher does not keep its run alive"
        if victim == "launcher":
            os.kill(proc.pid, signal.SIGKILL)
        else:
            (p,) = [p for p in psutil.Process(proc.pid).children(recursive=True)
                    if p.name() == victim]  # this run's rank, not another run's
            p.kill()
            time.sleep(3)  # it rejoins; then the run is stopped the ordinary way
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 20
        while _ours(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _ours(proc.pid), f"left in /dev/shm: {sorted(_ours(proc.pid))}"
        def ranks():
            out = []
            for p in psutil.process_iter(["name", "cwd", "status"]):
                if (p.info["name"] or "").startswith("psrpc-") and p.info["cwd"] == str(
                        tmp_path) and p.info["status"] != psutil.STATUS_ZOMBIE:
                    out.append(p)
            return out

        deadline = time.monotonic() + 20  # each rank checks its launcher every 0.5 s
        while ranks() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not ranks(), f"ranks outlived the launcher: {ranks()}"
    finally:
        if proc.poll() is None:
            proc.kill()


# -- /dev/shm is world-writable: nothing found there is trusted --------------------------------
def test_a_planted_symlink_is_never_followed_or_truncated(tmp_path):
    victim = tmp_path / "precious"
    victim.write_bytes(b"do not truncate")
    assert shm.problem() is None
    run = shm.new_run()
    name = shm.segment(run, 0, "params")
    (shm.directory() / name).symlink_to(victim)
    try:
        with pytest.raises(PsrpcError, match="already exists"):
            shm.create(name, 1024, b"n" * shm.NONCE_BYTES)
        with pytest.raises(shm.SegmentProblem, match="cannot be opened safely"):
            shm.attach(name, 4)
        assert victim.read_bytes() == b"do not truncate"
    finally:
        (shm.directory() / name).unlink()


def test_a_segment_is_mapped_only_if_it_is_what_the_ps_created():
    run, nonce = shm.new_run(), b"a" * shm.NONCE_BYTES
    name = shm.segment(run, 0, "g0")
    assert shm.problem() is None
    try:
        shm.create(name, 8, nonce)
        assert (shm.directory() / name).stat().st_mode & 0o777 == 0o600
        shm.check(name, 8, nonce)
        assert shm.attach(name, 8).numel() == 8
        with pytest.raises(shm.SegmentProblem, match="nonce differs"):  # another PS's file
            shm.check(name, 8, b"b" * shm.NONCE_BYTES)
        with pytest.raises(shm.SegmentProblem, match="holds 32 bytes, not 64"):
            shm.attach(name, 16)
        os.chmod(shm.directory() / name, 0o644)
        with pytest.raises(shm.SegmentProblem, match="has mode 644"):
            shm.attach(name, 8)
        # Another /dev/shm (a container with the same host name and boot id): not there.
        assert "does not exist here" in shm.check_all([(shm.segment(run, 1, "g0"), 8, nonce)])
    finally:
        shm.remove(run)


def test_stale_runs_are_removed_and_live_ones_kept():
    """A run whose lock files nobody holds (its processes were killed together) is removed;
    one whose PS holds its lock, or one with no lock file yet, is left alone."""
    dead, live, starting = shm.new_run(), shm.new_run(), shm.new_run()
    nonce = b"x" * shm.NONCE_BYTES
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from psrpc.cluster import shm; "
        f"shm.hold('{dead}', 'ps0'); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        holder.kill()  # SIGKILL: no cleanup of its own; the kernel drops its lock
        holder.wait(timeout=10)
        shm.hold(live, "ps0")  # this process: alive
        for run in (dead, live, starting):
            shm.create(shm.segment(run, 0, "params"), 4, nonce)
        assert dead in shm.remove_stale()  # (and any other dead run on this host)
        left = {p.name for p in shm.directory().glob("psrpc-*")}
        assert not any(dead in n for n in left)
        assert shm.segment(live, 0, "params") in left and shm.segment(starting, 0, "params") in left
    finally:
        holder.kill()
        shm.release()
        for run in (dead, live, starting):
            shm.remove(run)


def test_kill_9_of_a_whole_run_leaves_nothing_after_the_next_run(tmp_path):
    """SIGKILL of the launcher and every rank at once (a job scheduler, the OOM killer): nobody
    is left to remove the segments, which stay until the next run on the host removes them (no
    lock of the killed run is held)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "psrpc", "train.steps=100000", "train.device=cpu",
         "cluster.shm=on", f"out_dir={tmp_path / 'killed'}"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)  # its own process group, killed whole below
    try:
        _wait_for_segments(proc.pid)
        time.sleep(1.0)
        group = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        for pid in group:  # all at once: nobody is left to clean up
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
        # Its segments are there now (unless another psrpc run on this host has already
        # removed them, as it should): the next run must leave none.
        run_cluster(tmp_path / "next", ["cluster.shm=on", "train.steps=5"])
        assert not _ours(proc.pid), f"left in /dev/shm: {sorted(_ours(proc.pid))}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        shm.remove_stale()


def test_a_views_gradient_computed_across_an_update_is_never_applied():
    """Views mode with update.timeout_s: shard T's round times out (worker1 is slow: think
    SIGSTOP) and T's optimizer rewrites the master copy that worker1, already past its forward,
    still reads in its backward; shard S's round, still open at the same step, must not take
    worker1's gradient computed on that mix (it is discarded and counted; worker0's stands)."""
    from torch import nn

    from psrpc.cluster.layout import Layout
    from psrpc.ps.shard import Shard, ShardSpec
    from psrpc.worker.flat import FlatModel

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    layout = Layout.plan({n: tuple(p.shape) for n, p in models[0].named_parameters()}, 2,
                         max_shard_bytes=1 << 20)
    with torch.no_grad():
        start = layout.split(dict(models[0].named_parameters()))
    run = shm.new_run()
    try:
        for g, n in enumerate(layout.shard_numel):
            shm.create(shm.segment(run, g, "params"), shm.master_numel(n), b"n" * shm.NONCE_BYTES)
            for w in (0, 1):
                shm.create(shm.segment(run, g, f"g{w}"), n, b"n" * shm.NONCE_BYTES)
        # shard 0 (T) times out quickly, shard 1 (S) not yet
        shards = [Shard(ShardSpec(g, start[g].detach(), sgd(lr=0.1),
                                  sync(timeout_s=0.3 if g == 0 else 60.0), 2, 100,
                                  shm=("views", run, [0, 1]))) for g in (0, 1)]
        flats = [FlatModel(m, layout, torch.device("cpu"), shm=[
            ("views", shm.segment(run, g, "params"), shm.segment(run, g, f"g{w}"))
            for g in (0, 1)]) for w, m in enumerate(models)]
        for f in flats:  # the first pull: the parameters are the master copy
            for g in (0, 1):
                f.load(g, torch.empty(0))
        x = torch.randn(2, 3)
        futures = {}

        def step_and_push(w):
            for g in (0, 1):
                flats[w].send(g, lambda payload, g=g: futures.__setitem__(
                    (w, g), shards[g].push_pull(w, 0, payload, 1.0, 1)))

        for f in flats:
            f.zero_grad()
        loss1 = models[1](x).pow(2).sum()  # worker1: forward on step 0 ... then stopped
        models[0](x).pow(2).sum().backward()  # worker0: a whole step, pushed
        g0 = [flats[0].grads[g].clone() for g in (0, 1)]
        step_and_push(0)
        assert futures[(0, 0)].wait().version == 1  # T's round closed without worker1
        assert not futures[(0, 1)].done()  # S's round is still open at step 0
        loss1.backward()  # worker1 runs again: its backward reads T's master, now at step 1
        step_and_push(1)
        assert futures[(0, 1)].wait().version == 1
        alone = Shard(ShardSpec(1, start[1].detach(), sgd(lr=0.1), sync(), 1, 100))
        alone.push_pull(0, 0, g0[1], 1.0, 1).wait()  # worker0's gradient only
        assert torch.equal(shards[1].params, alone.params), "S took a gradient across an update"
        assert shards[1].stats.per_worker_applied == {0: 1}
        assert shards[1].stats.per_worker_stale == {1: 1}
        assert not futures[(1, 1)].wait().accepted and not futures[(1, 1)].wait().skipped
        for s in shards + [alone]:
            s.close()
    finally:
        shm.remove(run)

"""Faults over real clusters: lost workers, a dead PS, NaN gradients (README's fault table)."""

import json
import math
import subprocess
import time

import pytest
import torch

from psrpc import checkpoint
from psrpc.launch import ClusterFailed
from tests.conftest import FAST, cli, run_cluster

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("update", ["async", "sync"])
def test_worker_crash_with_no_restarts_left_others_finish_all_steps(tmp_path, update):
    summary, state = run_cluster(tmp_path, [
        f"update={update}", "cluster.num_workers=3", "train.steps=60", "update.timeout_s=5",
        "cluster.max_worker_restarts=0",
        "fault.crash_role=worker", "fault.crash_index=2", "fault.crash_at_step=10"])
    assert summary["steps"] == 60 and summary["workers_lost"] == 1
    assert all(torch.isfinite(v).all() for v in state.values())
    log = (tmp_path / "logs" / "ps0.log").read_text()
    if update == "sync":  # one round waited update.timeout_s, the later ones did not
        assert log.count("s (update.timeout_s=5) with") == 1, log


def test_ps_crash_with_no_restarts_left_stops_the_run_naming_it_and_rerun_resumes(tmp_path):
    ck = f"checkpoint.dir={tmp_path / 'ck'}"
    t0 = time.monotonic()
    with pytest.raises(ClusterFailed, match=r"^ps0 died \(killed by SIGKILL\)"):
        run_cluster(tmp_path / "first", [ck, "checkpoint.every_steps=10", "train.steps=60",
                                         "cluster.max_ps_restarts=0",
                                         "fault.crash_role=ps", "fault.crash_index=0",
                                         "fault.crash_at_step=45",
                                         # 20 ms a step: the background commits have time
                                         "fault.slow_worker=0", "fault.slow_s=0.02"])
    assert time.monotonic() - t0 < 60
    # Checkpoints commit in the background: on a loaded machine the newest step may not have
    # landed before the crash, but some must have, 35 steps (0.7 s) after the first was due.
    committed = [s for s, f in checkpoint.steps_on_disk(tmp_path / "ck")
                 if (f / checkpoint.MANIFEST).exists()]
    assert committed and max(committed) in (10, 20, 30, 40), committed
    summary, _ = run_cluster(tmp_path / "second", [ck, "checkpoint.every_steps=10",
                                                   "train.steps=60"])
    assert summary["restored_from_step"] == max(committed) and summary["steps"] == 60


@pytest.mark.parametrize("wire, workers", [("float32", 1), ("float32", 2), ("bfloat16", 2),
                                           ("float16", 1)])
def test_nan_gradient_skips_its_batch_and_the_run_goes_on(tmp_path, wire, workers):
    """The injected NaN reaches the PS whatever the wire dtype (it used to be overwritten on a
    bf16/fp16 wire), its batch is skipped (no spin with W=1), training goes on."""
    summary, state = run_cluster(tmp_path, [f"cluster.num_workers={workers}",
                                            f"update.wire_dtype={wire}",
                                            "fault.nan_worker=0", "fault.nan_at_step=5"])
    assert summary["steps"] == 20 and summary["nan_rejected"] >= 1
    assert summary["samples"] == (20 * workers - 1) * 16  # exactly one batch skipped
    assert all(torch.isfinite(v).all() for v in state.values())
    assert math.isfinite(summary["final_loss"])


def test_every_gradient_overflowing_stops_with_an_error_naming_worker_and_step(tmp_path):
    """float16 on the wire (TCP: shared memory carries float32) with gradients past 65504: every
    push is non-finite. The run stops
    after train.nonfinite_patience in a row instead of pushing the same batch forever."""
    with pytest.raises(ClusterFailed, match=r"worker0: 3 non-finite gradients in a row \(the "
                                            r"last at step \d+, .*float16 overflows past 65504"):
        run_cluster(tmp_path, ["cluster.num_workers=1", "update.wire_dtype=float16",
                               "cluster.shm=off", "optim.lr=1e5", "train.nonfinite_patience=3",
                               "train.steps=50"], timeout_s=120)


def test_a_full_disk_under_checkpoint_dir_is_said_and_ends_the_run_non_zero(tmp_path):
    """checkpoint.dir on a 200 KB tmpfs: every save fails with ENOSPC. Training goes on (each
    failure is logged with its cause), the outputs are written, and then the run ends with one
    line saying the final checkpoint was not written and why, exit code 2: a lost checkpoint
    is not a success."""
    ck = tmp_path / "ck"
    ck.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(ck)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        r = cli(FAST + ["model=cnn", f"checkpoint.dir={ck}", "checkpoint.every_steps=10",
                        f"out_dir={tmp_path / 'out'}"], tmp_path)
    finally:
        subprocess.run(["umount", "-l", str(ck)], capture_output=True)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("psrpc: error: the final checkpoint (step 20) was not written: ")
    assert "No space left on device" in last and "holds no committed checkpoint" in last
    assert "checkpoint step 10 not made: ps0/shard0: " in r.stderr  # and why, in words
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 20 and "No space left" in summary["final_checkpoint_error"]

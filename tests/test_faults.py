"""Faults over real clusters (DESIGN §7): lost workers, a dead PS, NaN gradients."""

import math
import time

import pytest
import torch

from psrpc.launch import ClusterFailed
from tests.conftest import run_cluster

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("update", ["async", "sync"])
def test_worker_crash_others_finish_all_steps(tmp_path, update):
    summary, state = run_cluster(tmp_path, [
        f"update={update}", "cluster.num_workers=3", "train.steps=60", "update.timeout_s=5",
        "fault.crash_role=worker", "fault.crash_index=2", "fault.crash_at_step=10"])
    assert summary["steps"] == 60 and summary["workers_lost"] == 1
    assert all(torch.isfinite(v).all() for v in state.values())
    log = (tmp_path / "logs" / "ps0.log").read_text()
    if update == "sync":  # one round waited update.timeout_s, the later ones did not
        assert log.count("waited 5.0 s (update.timeout_s)") == 1, log


def test_ps_crash_stops_the_run_naming_it_and_rerun_resumes(tmp_path):
    ck = f"checkpoint.dir={tmp_path / 'ck'}"
    t0 = time.monotonic()
    with pytest.raises(ClusterFailed, match=r"^ps0 died \(killed by SIGKILL\)"):
        run_cluster(tmp_path / "first", [ck, "checkpoint.every_steps=10", "train.steps=60",
                                         "fault.crash_role=ps", "fault.crash_index=0",
                                         "fault.crash_at_step=25"])
    assert time.monotonic() - t0 < 60
    summary, _ = run_cluster(tmp_path / "second", [ck, "checkpoint.every_steps=10",
                                                   "train.steps=60"])
    assert summary["restored_from_step"] == 20 and summary["steps"] == 60


def test_nan_gradients_rejected_run_finishes_finite(tmp_path):
    summary, state = run_cluster(tmp_path, ["cluster.num_workers=2", "fault.nan_worker=1",
                                            "fault.nan_at_step=5"])
    assert summary["steps"] == 20 and summary["nan_rejected"] >= 1
    assert all(torch.isfinite(v).all() for v in state.values())
    assert math.isfinite(summary["final_loss"])

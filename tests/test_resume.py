"""Exact resume over real clusters: a run stopped at 40 and rerun to 60 equals 60 uninterrupted
(BatchNorm statistics included), and a checkpoint made with 2 PS restores into 1 or 3 PS."""

import shutil
import time

import pytest
import torch

from psrpc import checkpoint
from tests.conftest import assert_equal_model, run_cluster

pytestmark = pytest.mark.timeout(300)
CKPT = ["checkpoint.every_steps=10"]


@pytest.mark.parametrize("mode", [
    ["update=sync", "cluster.num_workers=2"],
    ["update=async", "cluster.num_workers=1"],
])
def test_40_then_60_equals_60_uninterrupted(tmp_path, mode):
    ck = f"checkpoint.dir={tmp_path / 'ck'}"
    whole = run_cluster(tmp_path / "whole", mode + ["train.steps=60"])
    first = run_cluster(tmp_path / "first", mode + CKPT + [ck, "train.steps=40"])
    assert first[0]["restored_from_step"] is None
    second = run_cluster(tmp_path / "second", mode + CKPT + [ck, "train.steps=60"])
    assert second[0]["restored_from_step"] == 40 and second[0]["steps"] == 60
    assert second[0]["samples"] == whole[0]["samples"]  # counters carried over
    assert_equal_model(second[1], whole[1])


def test_dropout_20_then_30_equals_30_whatever_the_loader(tmp_path):
    """Randomness is state: dropout masks and augmentation draw from generators seeded by
    (seed, replica, step) and (seed, epoch, sample), so a resumed run draws what the
    uninterrupted one drew, and loading (in the worker or in 2 loader processes) never moves the
    training stream: 20 + 10 steps with either loader equals 30 steps, bit for bit."""
    user = dict(model={"_target_": "tests.user_fixtures.make_dropout_net", "hidden": 16},
                data="tests.user_fixtures.make_noisy_datasets",
                loss="tests.user_fixtures.SmoothL1", metric="tests.user_fixtures.MeanAbsError")
    mode = ["cluster.num_workers=2", "train.batch_size=8"]
    whole = run_cluster(tmp_path / "whole", mode + ["train.steps=30", "data.num_workers=0"],
                        **user)
    mode += CKPT
    for loaders in (0, 2):
        ck = f"checkpoint.dir={tmp_path / f'ck{loaders}'}"
        run_cluster(tmp_path / f"first{loaders}",
                    mode + [ck, "train.steps=20", f"data.num_workers={loaders}"], **user)
        second = run_cluster(tmp_path / f"second{loaders}",
                             mode + [ck, "train.steps=30", f"data.num_workers={loaders}"], **user)
        assert second[0]["restored_from_step"] == 20
        assert_equal_model(second[1], whole[1])


@pytest.mark.slow
def test_resnet18_40_then_60_equals_60_bit_for_bit_buffers_included(tmp_path):
    """BatchNorm running statistics are state: the checkpoint carries the chief's at the saved
    step and every replica gets them back, so the resumed model.pt is the uninterrupted one,
    running_mean/var and num_batches_tracked as well as every parameter. Sync on CPU with a
    fixed seed is deterministic: compared with torch.equal, not a tolerance."""
    mode = ["model=resnet18", "data.image_shape=[3,16,16]", "data.size=512", "data.test_size=0",
            "train.batch_size=8", "cluster.num_workers=2"]
    ck = f"checkpoint.dir={tmp_path / 'ck'}"
    t0 = time.monotonic()
    whole = run_cluster(tmp_path / "whole", mode + ["train.steps=60"])
    run_cluster(tmp_path / "first", mode + CKPT + [ck, "train.steps=40"])
    assert (tmp_path / "ck" / "step-40" / "buffers.pt").exists()
    second = run_cluster(tmp_path / "second", mode + CKPT + [ck, "train.steps=60"])
    print(f"3 resnet18 runs in {time.monotonic() - t0:.1f} s")
    assert second[0]["restored_from_step"] == 40 and second[0]["steps"] == 60
    a, b = second[1], whole[1]
    assert a.keys() == b.keys() and any("running_mean" in k for k in a)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}: max " \
        f"{max(float((a[k].double() - b[k].double()).abs().max()) for k in differ)}"


def test_checkpoint_from_2_ps_restores_into_1_and_3(tmp_path):
    mode = ["cluster.num_workers=2", "cluster.max_shard_bytes=60000"]  # split tensors too
    whole = run_cluster(tmp_path / "whole", mode + ["train.steps=60"])
    run_cluster(tmp_path / "first", mode + CKPT + [f"checkpoint.dir={tmp_path / 'ck2'}",
                                                  "cluster.num_ps=2", "train.steps=40"])
    for ps in (1, 3):
        ck = tmp_path / f"ck{ps}"
        shutil.copytree(tmp_path / "ck2", ck)
        summary, state = run_cluster(tmp_path / f"to{ps}", mode + CKPT + [
            f"checkpoint.dir={ck}", f"cluster.num_ps={ps}", "train.steps=60"])
        assert summary["restored_from_step"] == 40 and summary["num_ps"] == ps
        assert_equal_model(state, whole[1])


def test_truncated_newest_shard_file_restores_previous_with_warning(tmp_path):
    ck = tmp_path / "ck"
    run_cluster(tmp_path / "first", CKPT + [f"checkpoint.dir={ck}", "train.steps=40",
                                            "cluster.num_ps=2"])
    bad = ck / "step-40" / "shard-1.pt"
    bad.write_bytes(bad.read_bytes()[:1000])
    step40 = {f.name: f.read_bytes() for f in (ck / "step-40").iterdir()}
    summary, _ = run_cluster(tmp_path / "second", CKPT + [f"checkpoint.dir={ck}",
                                                          "train.steps=50", "cluster.num_ps=2"])
    assert summary["restored_from_step"] == 30 and summary["steps"] == 50
    log = (tmp_path / "second" / "logs" / "worker0.log").read_text()
    assert f"checkpoint step 40 skipped: {bad} is truncated or corrupt" in log
    # A step that does not load counts for nothing: the earlier run's step-40 is set aside as
    # it was (step-40.corrupt, never overwritten nor deleted), and the rerun makes step 40
    # again, and 50, both loadable.
    assert {f.name: f.read_bytes() for f in (ck / "step-40.corrupt").iterdir()} == step40
    assert "checkpoint step-40 does not load" in log and "moved to step-40.corrupt" in log
    assert (ck / "step-40" / "manifest.json").exists()
    assert checkpoint.find_latest(str(ck)).step == 50

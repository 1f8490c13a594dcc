"""Model parallel over real RPC: stages, pipelined micro-batches, distributed autograd, and the
same update paths; the cut itself is checked directly."""

import pytest
import torch
from torch import nn

from psrpc.errors import ConfigError
from psrpc.models import mlp as make_mlp
from psrpc.models.stages import cut_points
from tests.conftest import MNIST_ROOT, assert_equal_model, models_differ, run_cluster

pytestmark = pytest.mark.timeout(300)
MP = ["parallel=model", "parallel.stages=2"]


def test_balanced_cut_by_parameter_count():
    model = nn.Sequential(nn.Linear(10, 100), nn.ReLU(), nn.Linear(100, 10), nn.Linear(10, 10),
                          nn.Linear(10, 1000))
    assert cut_points(model, 1) == [0]
    assert cut_points(model, 2) == [0, 4]  # 1100+1010+110 | 11000
    assert cut_points(model, 3) == [0, 2, 4]
    assert cut_points(model, 2, split=[1]) == [0, 1]


@pytest.mark.parametrize("stages, split, match", [
    (4, None, r"parallel.stages=4: the model has only 3 layers with parameters"),
    (2, [1], r"parallel.split=\[1\]: need 1 increasing"),  # stage 0 = Flatten: no parameters
    (2, [6], r"parallel.split=\[6\]"),  # past the last layer
    (2, [2, 4], r"parallel.split=\[2, 4\]: need 1"),
    (3, [4, 2], r"parallel.split=\[4, 2\]: need 2"),  # not increasing
])
def test_bad_cuts_are_clear_errors(stages, split, match):
    mlp = make_mlp((1, 4, 4), 3)  # Flatten, Linear, ReLU, Linear, ReLU, Linear
    assert cut_points(mlp, 2, [2]) == [0, 2]  # a valid explicit cut, for contrast
    with pytest.raises(ConfigError, match=match):
        cut_points(mlp, stages, split)


@pytest.mark.parametrize("micro", [4, 1])
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_two_stages_equal_data_parallel_w1(tmp_path, model, micro):
    """Bit for bit: M micro-batches through the pipeline, whose gradients are summed in
    micro-batch order, against one data-parallel worker accumulating M micro-batches. (The
    pipeline's loss is the whole batch's mean, the worker's the mean of each micro-batch's
    means: with M and the batch powers of two they differ by exact scalings, so the bits
    agree on any CPU; with M=3 they would not.)"""
    dp = run_cluster(tmp_path / "dp", [f"model={model}", "cluster.num_workers=1",
                                       "train.batch_size=32", f"train.accumulate={micro}"])
    summary, state = run_cluster(tmp_path / "mp", MP + [
        f"model={model}", "cluster.num_workers=2", "train.batch_size=32",
        f"parallel.microbatches={micro}"])
    assert summary["parallel"] == "model" and summary["steps"] == 20
    assert len(summary["shards"]) == 2  # one shard per stage on the single PS
    assert_equal_model(state, dp[1])


def test_hybrid_2_replicas_x_2_stages_equals_data_parallel_w2(tmp_path):
    """Bit for bit against 2 data-parallel workers accumulating 2 micro-batches each."""
    dp = run_cluster(tmp_path / "dp", ["cluster.num_workers=2", "train.batch_size=16",
                                       "train.accumulate=2"])
    mp = run_cluster(tmp_path / "mp", MP + ["cluster.num_workers=4", "train.batch_size=16",
                                            "parallel.microbatches=2", "cluster.num_ps=2"])
    assert mp[0]["samples"] == dp[0]["samples"] == 20 * 32
    assert_equal_model(mp[1], dp[1])
    one = run_cluster(tmp_path / "one", MP + ["cluster.num_workers=2", "train.batch_size=16",
                                              "parallel.microbatches=2"])
    assert models_differ(one[1], dp[1])  # one replica sees half the data: the check can fail


def test_resnet18_two_stages_is_reproducible(tmp_path):
    """torchvision's resnet18 cut at its top-level children runs through the pipeline, and the
    same config gives the same model bit for bit: the micro-batches' gradients are summed in
    their order, not in the order their concurrent backward passes happen to finish."""
    args = MP + ["model=resnet18", "data.image_shape=[3,32,32]", "cluster.num_workers=2",
                 "train.batch_size=8", "parallel.microbatches=4", "train.steps=4"]
    first = run_cluster(tmp_path / "a", args)
    second = run_cluster(tmp_path / "b", args)
    assert first[0]["steps"] == 4 and first[0]["final_loss"] is not None
    assert first[1].keys() == second[1].keys()
    assert all(torch.equal(first[1][k], second[1][k]) for k in first[1])
    # BatchNorm statistics come from the stages that trained them (stage 0 and stage 1 alike)
    for bn in ("1", "7.1.bn2"):
        assert not torch.equal(first[1][f"{bn}.running_mean"], torch.zeros_like(
            first[1][f"{bn}.running_mean"])), bn


def test_resnet18_two_stages_resumed_equals_uninterrupted_buffers_included(tmp_path):
    """Each stage gets its layers' BatchNorm statistics back from the checkpoint (the stages
    own them, not the leader), so 2 steps + 2 resumed equals 4 straight, bit for bit."""
    args = MP + ["model=resnet18", "data.image_shape=[3,16,16]", "cluster.num_workers=2",
                 "train.batch_size=8", "parallel.microbatches=2", "data.test_size=0"]
    ck = [f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every_steps=2"]
    whole = run_cluster(tmp_path / "whole", args + ["train.steps=4"])
    run_cluster(tmp_path / "first", args + ck + ["train.steps=2"])
    second = run_cluster(tmp_path / "second", args + ck + ["train.steps=4"])
    assert second[0]["restored_from_step"] == 2
    differ = [k for k in whole[1] if not torch.equal(whole[1][k], second[1][k])]
    assert not differ, differ[:5]


def test_model_parallel_async_runs_to_the_end(tmp_path):
    summary, _ = run_cluster(tmp_path, MP + ["update=async", "cluster.num_workers=4",
                                             "train.steps=40"])
    assert summary["steps"] == 40 and summary["update"] == "async"


@pytest.mark.slow
@pytest.mark.skipif(not (MNIST_ROOT / "MNIST" / "raw").is_dir(), reason="needs ../shared/data")
def test_mnist_cnn_two_stages_97_percent_in_one_epoch(tmp_path):
    summary, _ = run_cluster(tmp_path, MP + [
        "data=mnist", f"data.root={MNIST_ROOT}", "model=cnn", "cluster.num_workers=2",
        "train.batch_size=128", "train.steps=469", "train.log_every=100",
        "parallel.microbatches=4"], fast=False)
    assert summary["samples"] >= 60000 and summary["test_accuracy"] >= 0.97, summary

"""Embedding tables on the PS over real RPC (model=dlrm on synthetic click logs): the contracts
hold for tables as for dense parameters, and the tables can be read back."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from psrpc.sparse import load_tables
from tests.conftest import MNIST_ROOT, SHM, assert_equal_model, compose, on_cpu, run_cluster

pytestmark = pytest.mark.timeout(300)
MOVIELENS = MNIST_ROOT / "ml-100k"  # ../shared/data/ml-100k
CLICKS = ["model=dlrm", "model.dim=8", "model.bottom=[16,8]", "model.top=[16]", "data=clicks",
          "data.num_samples=4096", "data.test_samples=512", "data.cardinalities=[1000,500,64]",
          "data.num_dense=4", "loss=bce", "metric=auc", "train.steps=20", "train.log_every=10",
          "train.untimed_steps=2", "update.timeout_s=30", "sparse.lr=0.1"]


def _run(tmp_path, overrides):
    summary, state = run_cluster(tmp_path, CLICKS + overrides, fast=False)
    return summary, state, load_tables(tmp_path)


def _assert_equal(a, b):
    """Bit for bit: the dense parameters and the tables."""
    assert_equal_model(a[1], b[1])
    assert_equal_model(a[2], b[2])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Sync, 1 PS, W=1 × batch 64."""
    return _run(tmp_path_factory.mktemp("ref"), ["cluster.num_workers=1",
                                                 "train.batch_size=64"])


def test_sync_w2_equals_w1_accumulating_two_micro_batches_tables_included(tmp_path):
    """Bit for bit: the micro-batches' row gradients are averaged by the PS's own function."""
    w2 = _run(tmp_path, ["cluster.num_workers=2", "train.batch_size=32"])
    acc = _run(tmp_path / "acc", ["cluster.num_workers=1", "train.batch_size=64",
                                  "train.accumulate=2"])
    assert w2[0]["samples"] == acc[0]["samples"] == 20 * 64
    _assert_equal(w2, acc)
    assert 0 < w2[0]["test_auc"] < 1 and w2[0]["test_logloss"] > 0
    assert w2[0]["test_auc"] < w2[0]["hidden_auc"] < 1  # the hidden model: the ceiling
    assert w2[0]["hidden_auc"] > 0.5
    # model.pt and the tables' files load into the model the config builds, outside psrpc
    from psrpc import factories
    from psrpc.sparse import load_model

    cfg = compose(CLICKS + ["cluster.num_workers=2", "train.batch_size=32"], check=False)
    model = load_model(factories.build_model(cfg, factories.load_data(cfg), remote_tables=False),
                       str(tmp_path))
    assert torch.equal(model.tables.bags["cat_0"].weight.detach(), w2[2]["cat_0"])


@pytest.mark.parametrize("layout", [["cluster.num_ps=2"], ["cluster.num_ps=3"],
                                    ["cluster.num_ps=3", "sparse.partition=div"]],
                         ids=["2ps-mod", "3ps-mod", "3ps-div"])
def test_number_of_ps_and_partition_change_no_bit(tmp_path, reference, layout):
    run = _run(tmp_path, layout + ["cluster.num_workers=1", "train.batch_size=64"])
    assert len(list((tmp_path / "tables").glob("ps*.pt"))) == run[0]["num_ps"]
    _assert_equal(run, reference)


def test_a_2_ps_export_over_an_earlier_3_ps_one_loads_the_2_ps_runs_rows(tmp_path, reference):
    """One out_dir: a 3-PS run of 10 steps, then the reference's run on 2 PS. load_tables gives
    the second run's rows (the reference's bits: the number of PS changes none), none from the
    first run's ps2.pt, which the chief removed before the servers wrote this run's files."""
    one = ["cluster.num_workers=1", "train.batch_size=64"]
    first = _run(tmp_path, one + ["cluster.num_ps=3", "train.steps=10"])
    assert first[0]["steps"] == 10 and (tmp_path / "tables" / "ps2.pt").exists()
    second = _run(tmp_path, one + ["cluster.num_ps=2"])
    _assert_equal(second, reference)
    index = json.loads((tmp_path / "tables" / "index.json").read_text())
    assert index["files"] == ["ps0.pt", "ps1.pt"] and index["num_ps"] == 2
    assert index["version"] == second[0]["steps"] == 20
    assert sorted(p.name for p in (tmp_path / "tables").iterdir()) == ["index.json", "ps0.pt",
                                                                      "ps1.pt"]


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_resumed_equals_uninterrupted_row_state_included_and_into_other_ps(tmp_path, optimizer):
    """Rows and their optimizer state (row-wise Adagrad's accumulator, lazy Adam's moments and
    step count) are checkpointed step-consistently and re-split for another number of PS."""
    mode = ["cluster.num_workers=2", "train.batch_size=32", f"sparse.optimizer={optimizer}"]
    whole = _run(tmp_path / "whole", mode + ["cluster.num_ps=2"])
    ck = tmp_path / "ck"
    _run(tmp_path / "first", mode + ["cluster.num_ps=2", f"checkpoint.dir={ck}",
                                     "hooks=[{_target_: psrpc.hooks.StopAtStep, last_step: 10}]"])
    assert (ck / "step-10" / "tables-1.pt").exists()
    for ps in (2, 3):  # the same layout, and re-split into 3 PS
        import shutil

        shutil.copytree(ck, tmp_path / f"ck{ps}")
        second = _run(tmp_path / f"second{ps}", mode + [f"cluster.num_ps={ps}",
                                                        f"checkpoint.dir={tmp_path / f'ck{ps}'}"])
        assert second[0]["restored_from_step"] == 10 and second[0]["steps"] == 20
        _assert_equal(second, whole)


def test_async_with_tables_runs_to_the_end(tmp_path):
    summary, state, tables = _run(tmp_path, ["update=async", "cluster.num_workers=2",
                                             "cluster.num_ps=2", "train.batch_size=32"])
    assert summary["steps"] == 20 and all(s["version"] == 20 for s in summary["shards"])
    assert all(torch.isfinite(t).all() for t in tables.values())


def test_table_pushes_through_the_side_channel_and_over_tensorpipe_give_the_same_bits(
        tmp_path, reference):
    """The reference pushed its tables to the PS on its host through the side channel (a Unix
    socket); with cluster.shm=off everything goes over TensorPipe."""
    run = _run(tmp_path, ["cluster.num_workers=1", "train.batch_size=64", "cluster.shm=off"])
    _assert_equal(run, reference)
    assert run[0]["side_channel_share"] == 0
    if SHM is None:  # 20 pushes and the first pull
        assert reference[0]["side_channel_share"] == round(20 / 21, 2)


def test_row_cache_with_staleness_0_changes_no_bit(tmp_path, reference):
    run = _run(tmp_path, ["cluster.num_workers=1", "train.batch_size=64",
                          "sparse.cache_rows=100", "sparse.cache_staleness=0"])
    _assert_equal(run, reference)
    assert run[0]["cache_hit_rate"] is None and reference[0]["cache_hit_rate"] is None
    assert run[0]["sparse_bytes_per_step"] == reference[0]["sparse_bytes_per_step"] > 0
    # one message per step to the one server: the next batch's rows come with the push's reply
    # (a pull only before the first step)
    assert run[0]["table_rpcs_per_step"] == reference[0]["table_rpcs_per_step"] == 1 + 1 / 20


def test_row_cache_serves_hot_rows_and_halves_the_table_traffic(tmp_path):
    """Sync, W=2, 2 PS, write-back: with a bound of 8 steps the workers' caches serve most
    lookups of the skewed ids, the table bytes per step fall by half or more, every held gradient reaches the
    PS by the end (every shard at the last step), and the model still learns as the exact one."""
    mode = ["cluster.num_workers=2", "cluster.num_ps=2", "train.batch_size=32",
            "train.steps=40"]
    exact = _run(tmp_path / "exact", mode)
    cached = _run(tmp_path / "cached", mode + ["sparse.cache_rows=400",
                                               "sparse.cache_staleness=8",
                                               "sparse.cache_writes=hold"])
    summary = cached[0]
    assert summary["steps"] == 40 and all(s["version"] == 40 for s in summary["shards"])
    assert summary["cache_hit_rate"] > 0.5
    assert summary["sparse_bytes_per_step"] <= 0.5 * exact[0]["sparse_bytes_per_step"]
    assert all(torch.isfinite(t).all() for t in cached[2].values())
    assert abs(summary["test_auc"] - exact[0]["test_auc"]) < 0.05


@pytest.mark.slow
@pytest.mark.skipif(not (MOVIELENS / "ml-100k.inter").is_file(), reason="needs ../shared/data")
def test_movielens_dlrm_beats_logistic_regression_on_the_same_features(tmp_path):
    """Real data: DLRM with its tables on the PS, sync W=2, 4 epochs, against a one-hot logistic
    regression on the same features and split, computed here (not a remembered number)."""
    from psrpc.recsys.data import movielens
    from psrpc.recsys.reference import logistic_regression_auc

    data = movielens(str(MOVIELENS))
    baseline = logistic_regression_auc(data["train"], data["test"], tables=data["tables"],
                                       num_dense=data["num_dense"])
    summary, _ = run_cluster(tmp_path, ["+experiment=movielens_dlrm",
                                        f"data.root={MOVIELENS}", "train.eval_every=0"],
                             fast=False, timeout_s=280)
    print(f"DLRM test AUC {summary['test_auc']:.4f}, logistic regression {baseline:.4f}")
    assert summary["test_auc"] > baseline + 0.005


HOLD = ["cluster.num_workers=2", "cluster.num_ps=2", "train.batch_size=32", "train.steps=60",
        "sparse.cache_rows=16", "sparse.cache_staleness=8", "sparse.cache_writes=hold"]


def _assert_every_held_gradient_reached_the_ps(summary, ck: Path, out: Path) -> None:
    """Every row gradient a worker computed for a step the PS applied reached the PS: the
    caches held some when training stopped (no last steps flushed them), and handed them over,
    none is left in a worker; at most one step's rows per worker (the push past the stop,
    refused as its dense gradient is) were dropped. The final checkpoint holds them, as the
    exported tables do."""
    assert summary["stopped_early"] and summary["cache_grads_held_at_end"] == 0
    assert summary["cache_grads_handed_over"] > 0
    for w in summary["workers"].values():
        assert w["cache_grads_held"] == 0 and w["cache_grads"] > 0
        assert w["cache_grads_dropped"] <= 3 * 32  # 3 features of 32 samples
    tables = [r for r in summary["shards"] if "tables" in r]
    assert all(r["hand_over_missing"] == [] and set(r["handed_over"]) == {"0", "1"}
               for r in tables)
    for k in range(len(tables)):
        saved = torch.load(ck / f"step-{summary['steps']}" / f"tables-{k}.pt",
                           weights_only=True)["tables"]
        final = torch.load(out / "tables" / f"ps{k}.pt", weights_only=True)["tables"]
        assert all(torch.equal(t["weight"], final[n]["weight"]) for n, t in saved.items())


@pytest.mark.parametrize("dense", ["ps", "allreduce"])
def test_an_early_stop_hands_every_held_gradient_to_the_ps_before_the_final_checkpoint(
        tmp_path, dense):
    """A hook's info.stop (StopAtStep) at step 30 of 60, write-back cache (16 rows, a bound of
    8): with the dense part on the PS, and all-reduced among the workers (pulling ahead: a
    step computed ahead is never pushed)."""
    ck = tmp_path / "ck"
    summary, _, _ = _run(tmp_path / "out", HOLD + [
        f"update.dense={dense}", "optim=adam", f"checkpoint.dir={ck}",
        "hooks=[{_target_: psrpc.hooks.StopAtStep, last_step: 30}]"])
    assert summary["steps"] == 30
    _assert_every_held_gradient_reached_the_ps(summary, ck, tmp_path / "out")


def test_sigterm_hands_every_held_gradient_to_the_ps_before_the_final_checkpoint(tmp_path):
    ck, out = tmp_path / "ck", tmp_path / "out"
    args = [sys.executable, "-m", "psrpc", *on_cpu(CLICKS + HOLD + [
        "train.steps=1000000", "train.log_every=5", f"checkpoint.dir={ck}", f"out_dir={out}"])]
    with (tmp_path / "output.txt").open("w") as log:
        proc = subprocess.Popen(args, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 150
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 4):
            assert time.monotonic() < deadline and proc.poll() is None, \
                (tmp_path / "output.txt").read_text()[-2000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] >= 20, (tmp_path / "output.txt").read_text()[-2000:]
    _assert_every_held_gradient_reached_the_ps(summary, ck, out)

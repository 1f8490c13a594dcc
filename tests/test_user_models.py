"""Your own model, datasets, loss and metric (tests/user_fixtures.py, outside the psrpc package),
by import path: through the CLI and the Python API, with the exactness contracts unchanged, and a
clear error before anything starts when they do not fit."""

import json
import os
import subprocess
import sys

import pytest
import torch

import psrpc
from psrpc.errors import ConfigError
from tests.conftest import (FAST, ROOT, assert_equal_model, assert_same_model, cli, compose,
                            read_outputs, run_cluster)

pytestmark = pytest.mark.timeout(300)
F = "tests.user_fixtures"
USER = dict(model={"_target_": f"{F}.make_net", "hidden": 16}, data=f"{F}.make_datasets",
            loss=f"{F}.SmoothL1", metric=f"{F}.MeanAbsError")
USER_CLI = ["model=custom", f"model._target_={F}.make_net", "+model.hidden=16",
            "data=custom", f"data._target_={F}.make_datasets",
            "loss=custom", f"loss._target_={F}.SmoothL1",
            "metric=custom", f"metric._target_={F}.MeanAbsError"]
QUICK = ["train.steps=20", "train.batch_size=16", "train.log_every=10", "train.device=cpu"]


def test_cli_and_python_api_train_the_same_user_model(tmp_path):
    """The CLI (as a user types it) and psrpc.train (from Python) run the same processes and
    write the same outputs: the same model, bit for bit."""
    r = cli(USER_CLI + QUICK + [f"out_dir={tmp_path / 'cli'}"], tmp_path,
            env={"PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    by_cli = read_outputs(tmp_path / "cli")
    summary = psrpc.train(QUICK + [f"out_dir={tmp_path / 'api'}"], **USER)
    assert summary == json.loads((tmp_path / "api" / "summary.json").read_text())
    assert summary["steps"] == 20 and 0 < summary["test_mae"] < 1  # the metric names itself
    assert "test_accuracy" not in summary
    assert_equal_model(read_outputs(tmp_path / "api")[1], by_cli[1])


def test_sync_w2_equals_w1_accumulating_two_micro_batches_for_a_user_model(tmp_path):
    """Bit for bit (the same sums in the same order), and, against one worker taking both
    micro-batches in one pass, close within a tolerance no CPU's rounding reaches: the model
    and the loss are smooth (tanh, smooth L1: no ReLU whose input a rounding can move across
    zero, so a rounding difference stays rounding-sized instead of becoming a learning-rate
    step). Measured, W=2 × 16 against W=1 × 32: at most 6e-8 after these 20 steps (9e-8 with
    ATEN_CPU_CAPABILITY=default, the same with AVX2's kernels; 2.4e-7 after 200): atol 1e-5
    leaves a hundredfold margin."""
    w2 = run_cluster(tmp_path / "w2", ["cluster.num_workers=2", "train.batch_size=16"], **USER)
    acc = run_cluster(tmp_path / "acc", ["cluster.num_workers=1", "train.batch_size=32",
                                         "train.accumulate=2"], **USER)
    w1 = run_cluster(tmp_path / "w1", ["cluster.num_workers=1", "train.batch_size=32"], **USER)
    assert w1[0]["samples"] == w2[0]["samples"] == acc[0]["samples"] == 20 * 32
    assert_equal_model(w2[1], acc[1])
    assert_same_model(w2[1], w1[1], rtol=0, atol=1e-5)


def test_dropout_draws_per_micro_batch_as_the_workers_would(tmp_path):
    """Micro-batch m of worker i draws what worker i·k+m of a cluster of W·k workers draws:
    with dropout too, W=2 × 16 equals W=1 accumulating 2 micro-batches of 16, bit for bit."""
    user = dict(USER, model={"_target_": f"{F}.make_dropout_net", "hidden": 16})
    w2 = run_cluster(tmp_path / "w2", ["cluster.num_workers=2", "train.batch_size=16"], **user)
    acc = run_cluster(tmp_path / "acc", ["cluster.num_workers=1", "train.batch_size=32",
                                         "train.accumulate=2"], **user)
    assert_equal_model(w2[1], acc[1])


@pytest.mark.parametrize("model, stages", [
    ({"_target_": f"{F}.make_net", "hidden": 16}, 2),  # an nn.Sequential
    ({"_target_": f"{F}.make_staged", "hidden": 16}, 3),  # lists its pipeline_layers()
], ids=["sequential", "pipeline_layers"])
def test_model_parallel_with_a_user_model_equals_data_parallel(tmp_path, model, stages):
    user = {**USER, "model": model}
    """Bit for bit against one data-parallel worker accumulating the same 2 micro-batches."""
    dp = run_cluster(tmp_path / "dp", ["cluster.num_workers=1", "train.accumulate=2"], **user)
    mp = run_cluster(tmp_path / "mp", ["parallel=model", f"parallel.stages={stages}",
                                       f"cluster.num_workers={stages}",
                                       "parallel.microbatches=2"], **user)
    assert mp[0]["parallel"] == "model" and mp[0]["steps"] == 20
    assert_equal_model(mp[1], dp[1])


@pytest.mark.parametrize("change, match", [
    (dict(model=f"{F}.no_such_factory"), r"model._target_='tests.user_fixtures.no_such_factory' "
                                         r"does not import"),
    (dict(model={"_target_": f"{F}.make_net", "depth": 3}),
     r"model.depth: tests.user_fixtures.make_net\(\) takes no argument 'depth' \(it takes: "
     r"features, hidden\)"),
    (dict(data=f"{F}.bad_datasets"), r"model._target_='tests.user_fixtures.make_net' cannot "
                                     r"take a batch of data._target_='tests.user_fixtures"
                                     r".bad_datasets'.*input \(2, 5\) float32"),
    (dict(loss="torch.nn.NLLLoss"), r"loss._target_='torch.nn.NLLLoss' on the "
                                             r"model's output \(2, 2\) float32 and the target"),
    (dict(metric="collections.OrderedDict"), r"metric._target_='collections.OrderedDict': has "
                                             r"no compute\(\)"),
])
def test_a_user_factory_that_does_not_fit_is_one_clear_error_before_start(change, match):
    with pytest.raises(ConfigError, match=match):
        compose(FAST, **{**USER, **change})


def test_model_parallel_needs_a_sequential_or_listed_stages():
    with pytest.raises(ConfigError, match=r"must be an nn.Sequential, or define "
                                          r"pipeline_layers\(\).*Unstaged is neither"):
        compose(FAST + ["parallel=model", "parallel.stages=2"],
                **{**USER, "model": f"{F}.make_unstaged"})


def test_loader_processes_give_the_same_model_as_loading_in_the_worker(tmp_path):
    """data.num_workers only moves the loading: the same batches, the same model."""
    inline = run_cluster(tmp_path / "0", ["data.num_workers=0"], **USER)
    procs = run_cluster(tmp_path / "2", ["data.num_workers=2"], **USER)
    assert_equal_model(procs[1], inline[1])


def test_cosine_schedule_resumed_equals_uninterrupted(tmp_path):
    """The learning rate is a function of the global step, which a checkpoint restores."""
    mode = ["optim.schedule=cosine", "optim.warmup_steps=5", "optim.min_lr=0.001",
            "cluster.num_workers=2"]
    ck = f"checkpoint.dir={tmp_path / 'ck'}"
    whole = run_cluster(tmp_path / "whole", mode + ["train.steps=40"], **USER)
    run_cluster(tmp_path / "first", mode + [ck, "train.steps=40",
                                            "hooks=[{_target_: psrpc.hooks.StopAtStep, "
                                            "last_step: 20}]"], **USER)
    second = run_cluster(tmp_path / "second", mode + [ck, "train.steps=40"], **USER)
    assert second[0]["restored_from_step"] == 20
    assert_equal_model(second[1], whole[1])
    constant = run_cluster(tmp_path / "constant", ["cluster.num_workers=2", "train.steps=40"],
                           **USER)
    assert not all(torch.equal(constant[1][k], whole[1][k]) for k in whole[1])  # it mattered


def test_periodic_evaluation_and_the_best_model_kept_apart(tmp_path):
    summary, _ = run_cluster(tmp_path, ["train.eval_every=5", "checkpoint.best=true",
                                        f"checkpoint.dir={tmp_path / 'ck'}",
                                        "checkpoint.every_steps=10"], **USER)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["test_mae"] for r in records if "test_mae" in r}
    assert sorted(evals) == [5, 10, 15, 20]
    best = json.loads((tmp_path / "ck" / "best" / "best.json").read_text())
    assert best["metric"] == "test_mae" and best["value"] == min(evals.values())  # lower: better
    assert best["step"] == min(evals, key=evals.get)
    state = torch.load(tmp_path / "ck" / "best" / "model.pt", weights_only=True)
    assert set(state) == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}


def test_clipping_bounds_each_workers_push(tmp_path):
    """One step of plain SGD at lr 1 moves the weights by exactly the clipped gradient: its
    norm is train.clip_grad_norm (the worker's own gradient norm is far larger)."""
    from tests.user_fixtures import make_net

    _, state = run_cluster(tmp_path, ["cluster.num_workers=1", "train.steps=1", "optim.lr=1",
                                       "optim.momentum=0", "train.clip_grad_norm=0.001"], **USER)
    torch.manual_seed(0)  # the chief's initial model: built right after seeding with train.seed
    start = make_net(6, 16).state_dict()
    moved = torch.cat([(state[k] - start[k]).reshape(-1) for k in start]).norm()
    assert 0.00099 < float(moved) < 0.00101


def test_bf16_autocast_trains(tmp_path):
    summary, state = run_cluster(tmp_path, ["train.amp=bf16", "train.steps=30"], **USER)
    assert summary["steps"] == 30 and summary["final_loss"] < 0.5
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in state.values())


def test_overrides_apply_to_a_factory_given_from_python():
    """`data.size=1024` beside `data={...}`: the dict replaced the config's node, and the
    override must not be lost with it."""
    cfg = psrpc.compose(["data.size=1024", "+data.features=4", "train.steps=3"],
                        data={"_target_": f"{F}.make_datasets", "size": 64})
    assert cfg.data == {"_target_": f"{F}.make_datasets", "size": 1024, "features": 4}
    assert cfg.train.steps == 3


@pytest.mark.parametrize("guarded", [True, False])
def test_a_script_that_calls_train_runs_with_the_guard_and_says_why_without(tmp_path, guarded):
    """The README's example as a script: every rank re-imports it. With the __main__ guard it
    trains; without, each rank says in one line what to do, and the run fails."""
    call = f'psrpc.train({QUICK + ["cluster.num_workers=1"]!r}, **{USER!r})'
    body = (f'if __name__ == "__main__":\n    print("steps", {call}["steps"])\n' if guarded
            else f'print("steps", {call}["steps"])\n')
    script = tmp_path / "train_it.py"
    script.write_text("import psrpc\n\n" + body)
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=200, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if guarded:
        assert r.returncode == 0, r.stderr[-2000:]
        assert "steps 20" in r.stdout
    else:
        assert r.returncode != 0
        assert 'call it under `if __name__ == "__main__":`' in r.stderr
